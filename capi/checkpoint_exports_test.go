//go:build cgo

package main

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/kvfence/kvfence/capi/internal/bridge"
)

// TestCheckpointThroughExports: kvf_lease_checkpoint_state and
// kvf_lease_prefill_checkpoint (ABI 10) from C's types: token counts
// that no int64 arithmetic can hold are refused as bad arguments naming
// the number, not a recovered panic; a NULL out-parameter and a handle of
// another kind are the boundary's errors; a checkpoint taken through the
// export is restored by the next admission with the same prompt.
func TestCheckpointThroughExports(t *testing.T) {
	pool := newPool(t, strings.Replace(hybridConfig, `"max_leases": 4,`, `"max_leases": 4, "prefix": {"checkpoint_slots": 1},`, 1))
	prompt := make([]int32, 22)
	for i := range prompt {
		prompt[i] = int32(7000 + i)
	}
	l, err := bridge.AdmitTokens(uint64(pool), "r", "acme", prompt, 8, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	lease := cLease(l)
	defer kvf_lease_free(lease)
	var at cInt64
	wantCall(t, "prefill_checkpoint NULL", func() cStatus { return kvf_lease_prefill_checkpoint(lease, nil) }, bridge.StatusNullPointer, "out")
	wantCall(t, "prefill_checkpoint", func() cStatus { return kvf_lease_prefill_checkpoint(lease, &at) }, bridge.OK)
	if at != 20 {
		t.Errorf("prefill checkpoint %d, want 20", at)
	}
	wantCall(t, "prefill_checkpoint of a pool", func() cStatus { return kvf_lease_prefill_checkpoint(cLease(pool), &at) }, bridge.StatusInvalidHandle)
	wantCall(t, "commit", func() cStatus { return kvf_lease_commit(lease, 20) }, bridge.OK)
	wantCall(t, "slide", func() cStatus { return kvf_lease_slide_windows(lease, 0, 0, nil) }, bridge.OK)
	for _, n := range []cInt64{math.MinInt64, -4, 0, 2, 24, math.MaxInt64, math.MaxInt64 - 3} {
		wantCall(t, fmt.Sprintf("checkpoint_state(%d)", n), func() cStatus { return kvf_lease_checkpoint_state(lease, n, 0, 0) },
			bridge.StatusInvalidArgument, fmt.Sprint(int64(n)))
	}
	wantCall(t, "checkpoint_state of 0", func() cStatus { return kvf_lease_checkpoint_state(0, 20, 0, 0) }, bridge.StatusInvalidHandle)
	// A host pool takes any ordering: it has no stream to wait for.
	wantCall(t, "checkpoint_state", func() cStatus { return kvf_lease_checkpoint_state(lease, 20, 1, 2) }, bridge.OK)
	checkPool(t, pool)
	wantCall(t, "release", func() cStatus { return kvf_lease_release(lease, 0, 0) }, bridge.OK)
	wantCall(t, "checkpoint_state released", func() cStatus { return kvf_lease_checkpoint_state(lease, 20, 0, 0) }, bridge.StatusLeaseReleased)

	again, err := bridge.AdmitTokens(uint64(pool), "again", "acme", prompt, 8, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer kvf_lease_free(cLease(again))
	var hit cInt64
	wantCall(t, "hit", func() cStatus { return kvf_lease_hit_tokens(cLease(again), &hit) }, bridge.OK)
	if hit != 20 {
		t.Errorf("hit %d tokens, want the checkpoint's 20", hit)
	}
	checkPool(t, pool)
}
