package kvcache

import (
	"fmt"
	"slices"
)

// KVEventKind says what happened to cached pages.
type KVEventKind uint8

const (
	// KVStored: pages were published to a domain's prefix cache.
	KVStored KVEventKind = iota + 1
	// KVRemoved: cached pages were evicted (and are being scrubbed).
	KVRemoved
	// KVCleared: a whole cache was dropped (ClearPrefixCache, Close).
	KVCleared
)

func (k KVEventKind) String() string {
	switch k {
	case KVStored:
		return "stored"
	case KVRemoved:
		return "removed"
	case KVCleared:
		return "cleared"
	}
	return fmt.Sprintf("KVEventKind(%d)", uint8(k))
}

// KVEvent tells a KV-aware router what the pool's prefix cache holds. A
// router that keeps, per domain, the set of stored keys minus the removed
// ones (and forgets everything on KVCleared) mirrors the cache; a gap in
// Seq means events were dropped and the mirror must be rebuilt.
type KVEvent struct {
	Kind KVEventKind
	// Seq numbers every event the pool produced, dropped ones included.
	Seq uint64
	// Domain is the sharing domain's name; empty on a KVCleared that
	// covers all domains.
	Domain string
	// Keys are the pages' keys; for KVStored in chain order, each the
	// parent of the next.
	Keys []BlockKey
	// Parent is the key of the page before Keys[0] in its prompt
	// (KVStored only); zero when Keys[0] is a prompt's first page.
	Parent BlockKey
	// Tokens is the number of tokens the keys cover.
	Tokens int
}

// PrefixConfig configures the prefix cache.
type PrefixConfig struct {
	// Disable turns prefix sharing off: requests' tokens are validated but
	// never matched, and Lease.CachePrefix publishes nothing.
	Disable bool
	// EventBuffer is the capacity of the channel Pool.Events returns; zero
	// means no events. A full channel drops events (counted in Stats)
	// rather than stall an admission.
	EventBuffer int
}

// maxEventBuffer keeps a typo from allocating gigabytes.
const maxEventBuffer = 1 << 20

func (c PrefixConfig) validate() error {
	if c.EventBuffer < 0 || c.EventBuffer > maxEventBuffer {
		return fmt.Errorf("%w: Prefix.EventBuffer = %d, want 0..%d", ErrInvalidConfig, c.EventBuffer, maxEventBuffer)
	}
	return nil
}

// eventSink delivers events without ever blocking. Guarded by Pool.mu.
type eventSink struct {
	ch      chan KVEvent
	closed  bool
	seq     uint64
	sent    uint64
	dropped uint64
	// scratch and runs gather KVRemoved events (gatherRemovedLocked).
	scratch []BlockKey
	runs    []removedRun
}

// emitLocked sends ev if the consumer has room, and counts it dropped
// otherwise. ev.Keys must not be shared with the pool's own state.
func (s *eventSink) emitLocked(ev KVEvent) {
	if s.ch == nil || s.closed {
		return
	}
	s.seq++
	ev.Seq = s.seq
	select {
	case s.ch <- ev:
		s.sent++
	default:
		s.dropped++
	}
}

func (s *eventSink) enabled() bool { return s.ch != nil && !s.closed }

// closeLocked ends the stream; receivers ranging over Events finish.
func (s *eventSink) closeLocked() {
	if s.ch != nil && !s.closed {
		s.closed = true
		close(s.ch)
	}
}

// Events returns the channel of prefix-cache events, or nil if
// Config.Prefix.EventBuffer is zero. It is closed by Close.
func (p *Pool) Events() <-chan KVEvent { return p.events }

// removedRun is a KVRemoved event being gathered: keys[start:] of the
// sink's scratch, up to the next run's start.
type removedRun struct {
	domain string
	start  int
}

// gatherRemovedLocked adds the key of an evicted page of domain to the
// KVRemoved events being gathered, one per run of a domain's pages, in
// the sink's reused scratch: no allocation per page.
func (s *eventSink) gatherRemovedLocked(domain string, key BlockKey) {
	if k := len(s.runs) - 1; k < 0 || s.runs[k].domain != domain {
		s.runs = append(s.runs, removedRun{domain: domain, start: len(s.scratch)})
	}
	s.scratch = append(s.scratch, key)
}

// emitRemovedLocked emits the gathered KVRemoved events, each with its
// own keys (one allocation, of their size), and empties the scratch.
func (s *eventSink) emitRemovedLocked(tokensPerPage int) {
	for i, r := range s.runs {
		end := len(s.scratch)
		if i+1 < len(s.runs) {
			end = s.runs[i+1].start
		}
		keys := slices.Clone(s.scratch[r.start:end])
		s.emitLocked(KVEvent{Kind: KVRemoved, Domain: r.domain, Keys: keys, Tokens: len(keys) * tokensPerPage})
	}
	clear(s.runs) // no domain name kept
	s.runs, s.scratch = s.runs[:0], s.scratch[:0]
	if cap(s.scratch) > maxRemovedScratch {
		s.scratch = nil // a large clear's worth is not kept for later
	}
}

// maxRemovedScratch bounds the keys gatherRemovedLocked's scratch keeps
// between evictions: a few long prompts' worth.
const maxRemovedScratch = 1 << 14
