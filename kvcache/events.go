package kvcache

import "fmt"

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

// Medium says where an event's pages are: in the pool's device memory
// (the zero value) or in its host tier (Config.HostTier). kvevents
// publishes them as vLLM's medium, "GPU" and "CPU".
type Medium uint8

const (
	MediumDevice Medium = iota
	MediumHost
)

func (m Medium) String() string {
	switch m {
	case MediumDevice:
		return "device"
	case MediumHost:
		return "host"
	}
	return fmt.Sprintf("Medium(%d)", uint8(m))
}

// KVEvent tells a KV-aware router what the pool's prefix cache holds. A
// router that keeps, per domain, the set of stored keys minus the removed
// ones (and forgets everything on KVCleared) mirrors the cache; a gap in
// Seq means events were dropped and the mirror must be rebuilt.
type KVEvent struct {
	Kind KVEventKind
	// Seq numbers every event the pool produced, dropped ones included.
	Seq uint64
	// Medium is where the pages are stored or were removed from: a page
	// the device evicts into the host tier is removed from the device and
	// stored in the host tier (two events), and one onloaded back is
	// stored on the device again. KVCleared covers both.
	Medium Medium
	// Domain is the sharing domain's name; empty on a KVCleared that
	// covers all domains.
	Domain string
	// Keys are the pages' keys; for KVStored in chain order, each the
	// parent of the next. The array is the receiver's; once read, it may
	// be handed back with Pool.ReturnEventKeys for a later event to reuse.
	Keys []BlockKey
	// Parent is the key of the page before Keys[0] in its prompt
	// (KVStored only); zero when Keys[0] is a prompt's first page.
	Parent BlockKey
	// Tokens is the number of tokens the keys cover.
	Tokens int
	// Adapter is the adapter the keys were derived under (KVStored only;
	// empty for none).
	Adapter string
	// TokenIDs are the token IDs of the pages in Keys, Tokens of them in
	// order (KVStored only), when the pool is configured with
	// Prefix.EventTokens and the lease that published the pages holds
	// their tokens; nil otherwise (a lease admitted with PageKeys and no
	// TokenIDs). They are tenants' prompts: see PrefixConfig.EventTokens.
	// Like Keys, the array is the receiver's; once read, it may be handed
	// back with Pool.ReturnEventTokens for a later event to reuse.
	TokenIDs []int32
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
	// EventTokens makes KVStored events carry the token IDs of the pages
	// they report (KVEvent.TokenIDs), for routers that derive their own
	// keys from tokens (kvevents publishes them as vLLM's token_ids).
	// Off by default: the tokens are tenants' prompts, and with it on
	// they leave the pool with every event, to wherever its consumer
	// sends them. Without EventBuffer it does nothing.
	EventTokens bool
	// MaxCheckpoints bounds the state checkpoints the prefix cache of a
	// pool with window or state groups keeps at once (checkpoint.go);
	// zero means as many as those groups have room for. Each tenant's
	// are bounded too (TenantConfig.MaxCheckpoints).
	MaxCheckpoints int
	// CheckpointSlots sizes the window and state groups for that many
	// checkpoints beside MaxLeases leases: each a state slot and a window
	// ring more. Leases and checkpoints share the slots: checkpoints use
	// what leases leave, and are evicted (least recently used first) for
	// an admission that needs their slots. Zero leaves checkpoints only
	// the slots of leases not live.
	CheckpointSlots int
}

// maxEventBuffer keeps a typo from allocating gigabytes.
const maxEventBuffer = 1 << 20

// maxCheckpoints bounds MaxCheckpoints settings.
const maxCheckpoints = 1 << 24

func (c PrefixConfig) validate() error {
	if c.EventBuffer < 0 || c.EventBuffer > maxEventBuffer {
		return fmt.Errorf("%w: Prefix.EventBuffer = %d, want 0..%d", ErrInvalidConfig, c.EventBuffer, maxEventBuffer)
	}
	if c.MaxCheckpoints < 0 || c.MaxCheckpoints > maxCheckpoints {
		return fmt.Errorf("%w: Prefix.MaxCheckpoints = %d, want 0..%d", ErrInvalidConfig, c.MaxCheckpoints, maxCheckpoints)
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
	// spare holds key arrays consumers gave back (Pool.ReturnEventKeys),
	// for keysLocked to reuse; not guarded by Pool.mu (a channel).
	spare chan []BlockKey
	// spareTokens is the same for token arrays (Pool.ReturnEventTokens);
	// nil unless Prefix.EventTokens, when events carry no tokens.
	spareTokens chan []int32
}

// Key arrays given back are kept up to spareKeyArrays of them, each of at
// most maxSpareKeys keys: a busy stream's worth, not a large clear's.
const (
	spareKeyArrays = 64
	maxSpareKeys   = 1 << 14
	maxSpareTokens = 1 << 18
)

// keysLocked returns an empty key array with room for n keys: one given
// back by a consumer if it is large enough, otherwise a new one. Without
// a consumer that gives arrays back, every event costs one allocation
// of its keys, which is most of what events cost a pool (its fresh
// memory is page faults and cache misses on the admission path).
func (s *eventSink) keysLocked(n int) []BlockKey {
	select {
	case k := <-s.spare:
		if cap(k) >= n {
			return k[:0]
		}
	default:
	}
	return make([]BlockKey, 0, n)
}

// ReturnEventKeys gives the pool back the Keys of an event received from
// Events, for a later event to reuse instead of allocating its own. It
// is optional (kvevents' publisher does it once a batch is encoded), and
// safe to call from any goroutine. The caller must be done with keys:
// hand back each event's array at most once, and never read it after.
func (p *Pool) ReturnEventKeys(keys []BlockKey) {
	s := p.mu.events.spare // set in New, never changed
	if s == nil || cap(keys) == 0 || cap(keys) > maxSpareKeys {
		return
	}
	select {
	case s <- keys[:0]:
	default: // enough kept
	}
}

// tokensLocked returns a copy of tokens for an event, in an array given
// back by a consumer if one is large enough; nil if events carry no
// tokens.
func (s *eventSink) tokensLocked(tokens []int32) []int32 {
	if s.spareTokens == nil {
		return nil
	}
	select {
	case t := <-s.spareTokens:
		if cap(t) >= len(tokens) {
			return append(t[:0], tokens...)
		}
	default:
	}
	return append(make([]int32, 0, len(tokens)), tokens...)
}

// ReturnEventTokens gives the pool back the TokenIDs of an event received
// from Events, as ReturnEventKeys does its Keys: the same rules apply.
func (p *Pool) ReturnEventTokens(tokens []int32) {
	s := p.mu.events.spareTokens // set in New, never changed
	if s == nil || cap(tokens) == 0 || cap(tokens) > maxSpareTokens {
		return
	}
	select {
	case s <- tokens[:0]:
	default: // enough kept
	}
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
	medium Medium
	start  int
}

// gatherRemovedLocked adds the key of a page of domain evicted from
// medium to the KVRemoved events being gathered, one per run of a
// domain's pages of one medium, in the sink's reused scratch: no
// allocation per page.
func (s *eventSink) gatherRemovedLocked(domain string, key BlockKey, medium Medium) {
	if k := len(s.runs) - 1; k < 0 || s.runs[k].domain != domain || s.runs[k].medium != medium {
		s.runs = append(s.runs, removedRun{domain: domain, medium: medium, start: len(s.scratch)})
	}
	s.scratch = append(s.scratch, key)
}

// emitRemovedLocked emits the gathered KVRemoved events, each with a key
// array of its own (a spare, or one allocation of their size), and
// empties the scratch.
func (s *eventSink) emitRemovedLocked(tokensPerPage int) {
	for i, r := range s.runs {
		end := len(s.scratch)
		if i+1 < len(s.runs) {
			end = s.runs[i+1].start
		}
		keys := append(s.keysLocked(end-r.start), s.scratch[r.start:end]...)
		s.emitLocked(KVEvent{Kind: KVRemoved, Medium: r.medium, Domain: r.domain, Keys: keys, Tokens: len(keys) * tokensPerPage})
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
