package bridge

import (
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// State checkpoints through C (since ABI 10): the prefix cache of a pool
// with sliding-window or state groups keeps a lease's state at a page
// boundary when the engine says it reflects exactly that many tokens
// (kvcache.Lease.CheckpointState), and a later admission of the domain
// whose prompt starts with those tokens receives it. Everything is
// kvcache's: the bridge converts the numbers and the ordering.

// CheckpointState takes lease h's state checkpoint at tokens tokens,
// copied after the engine work named by after (kvcache.Lease.
// CheckpointState). A count beyond int is clamped, and refused by
// kvcache as past the prompt.
func CheckpointState(h Handle, tokens int64, after cudaops.Ordering) error {
	return withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		return l.CheckpointState(clampInt(tokens), after)
	})
}

// PrefillCheckpoint is where lease h's prefill should be checkpointed so
// that a later request with the same prompt reuses all it can
// (kvcache.Lease.PrefillCheckpoint): 0 for a prompt within one page and
// in a pool without window or state groups.
func PrefillCheckpoint(h Handle) (int64, error) {
	var n int
	err := withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		n = l.PrefillCheckpoint()
		return nil
	})
	return int64(n), err
}

// CheckpointsDoc is kvcache.CheckpointStats (since ABI 10): all zero in
// a pool without window or state groups.
type CheckpointsDoc struct {
	Live          int    `json:"live"`
	Restoring     int    `json:"restoring"`
	StateBytes    int64  `json:"state_bytes"`
	Taken         uint64 `json:"taken"`
	Existing      uint64 `json:"existing"`
	Hits          uint64 `json:"hits"`
	HitTokens     uint64 `json:"hit_tokens"`
	Misses        uint64 `json:"misses"`
	MissTokens    uint64 `json:"miss_tokens"`
	Evicted       uint64 `json:"evicted"`
	CapacitySkips uint64 `json:"capacity_skips"`
	RestoreNanos  uint64 `json:"restore_nanos"`
	CopyNanos     uint64 `json:"copy_nanos"`
}

func checkpointsDoc(c kvcache.CheckpointStats) CheckpointsDoc {
	return CheckpointsDoc{Live: c.Live, Restoring: c.Restoring, StateBytes: c.StateBytes, Taken: c.Taken,
		Existing: c.Existing, Hits: c.Hits, HitTokens: c.HitTokens, Misses: c.Misses, MissTokens: c.MissTokens,
		Evicted: c.Evicted, CapacitySkips: c.CapacitySkips, RestoreNanos: c.RestoreNanos, CopyNanos: c.CopyNanos}
}
