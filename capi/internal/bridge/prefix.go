package bridge

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sync"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// HitTokens is how many leading prompt tokens the lease shares from the
// prefix cache; prefill starts after them.
func HitTokens(h Handle) (int64, error) {
	var n int64
	err := withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		n = int64(l.HitTokens())
		return nil
	})
	return n, err
}

// CachePrefix publishes the lease's full prompt pages holding its first
// tokens tokens to its domain's prefix cache and returns how many prompt
// tokens are now shared or published.
func CachePrefix(h Handle, tokens int64) (int64, error) {
	var n int
	err := withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		var err error
		n, err = l.CachePrefix(clampInt(tokens))
		return err
	})
	return int64(n), err
}

// Phase is a lease's handoff phase (kvf_phase); the values are
// kvcache.Phase's and part of the ABI.
func Phase(h Handle) (kvcache.Phase, error) {
	var ph kvcache.Phase
	err := withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		ph = l.Phase()
		return nil
	})
	return ph, err
}

// BeginPrefill, FinishPrefill and Abort move a lease through its phases.
func BeginPrefill(h Handle) error {
	return withLease(h, func(_ *poolEntry, l *kvcache.Lease) error { return l.BeginPrefill() })
}

// FinishPrefill records a complete prefill (written = prompt tokens).
func FinishPrefill(h Handle) error {
	return withLease(h, func(_ *poolEntry, l *kvcache.Lease) error { return l.FinishPrefill() })
}

// Abort ends the lease from any phase through the scrubber.
func Abort(h Handle) error {
	return withLease(h, func(_ *poolEntry, l *kvcache.Lease) error { return l.Abort() })
}

// eventQueue hands a pool's prefix-cache events to C in batches. Events
// taken off the channel stay in pending until a call's buffer holds them,
// so a short buffer loses nothing.
type eventQueue struct {
	ch <-chan kvcache.KVEvent // nil: events are off
	mu struct {
		sync.Mutex
		pending []EventDoc
	}
}

// maxEventBatch bounds one batch, and so the buffer a caller needs.
const maxEventBatch = 256

// EventDoc is one kvcache.KVEvent in JSON; keys are hex.
type EventDoc struct {
	Kind   string   `json:"kind"`
	Seq    uint64   `json:"seq"`
	Domain string   `json:"domain"`
	Keys   []string `json:"keys"`
	Parent string   `json:"parent,omitempty"`
	Tokens int      `json:"tokens"`
	// Medium is where the pages are: "device", or "host" for the host
	// tier (since ABI 12).
	Medium string `json:"medium"`
}

// EventsDoc is what kvf_pool_events_json writes.
type EventsDoc struct {
	Enabled bool       `json:"enabled"`
	Events  []EventDoc `json:"events"`
}

// Events writes the next batch of the pool's prefix-cache events into dst
// as an EventsDoc, NUL-terminated, and returns the bytes it needs, NUL
// included. A short dst gets nothing and a *BufferError, and the batch
// stays queued for the next call.
func Events(h Handle, dst []byte) (int, error) {
	pe, err := lookupPool(h)
	if err != nil {
		return 0, err
	}
	q := &pe.events
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.mu.pending) == 0 && q.ch != nil {
	drain:
		for len(q.mu.pending) < maxEventBatch {
			select {
			case ev, ok := <-q.ch:
				if !ok {
					break drain
				}
				q.mu.pending = append(q.mu.pending, eventDoc(ev))
				pe.pool.ReturnEventKeys(ev.Keys) // copied out as hex
			default:
				break drain
			}
		}
	}
	doc := EventsDoc{Enabled: q.ch != nil, Events: q.mu.pending}
	if doc.Events == nil {
		doc.Events = []EventDoc{}
	}
	js, err := json.Marshal(doc)
	if err != nil { // plain structs of numbers and strings: a bug
		return 0, fmt.Errorf("%w: events JSON: %w", ErrInternal, err)
	}
	if len(dst) < len(js)+1 {
		return len(js) + 1, &BufferError{What: "events JSON (bytes, NUL included)", Need: len(js) + 1, Have: len(dst)}
	}
	dst[copy(dst, js)] = 0
	q.mu.pending = nil
	return len(js) + 1, nil
}

func eventDoc(ev kvcache.KVEvent) EventDoc {
	d := EventDoc{Kind: ev.Kind.String(), Seq: ev.Seq, Domain: ev.Domain, Tokens: ev.Tokens, Keys: make([]string, len(ev.Keys)),
		Medium: ev.Medium.String()}
	for i, k := range ev.Keys {
		d.Keys[i] = hex.EncodeToString(k[:])
	}
	if !ev.Parent.IsZero() {
		d.Parent = hex.EncodeToString(ev.Parent[:])
	}
	return d
}

// Regions copies the pool device's regions (layer l's K is region 2l, its
// V 2l+1) into dst and returns how many there are; a short dst gets
// nothing and a *BufferError.
func Regions(h Handle, dst []cudaops.Region) (int, error) {
	pe, err := lookupPool(h)
	if err != nil {
		return 0, err
	}
	rs := pe.pool.Regions()
	if len(dst) < len(rs) {
		return len(rs), &BufferError{What: "regions", Need: len(rs), Have: len(dst)}
	}
	copy(dst, rs)
	return len(rs), nil
}
