package kvsim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// Model pools and state checkpoints.
//
// RunConfig.Model runs a pool of a model's cache spec (a preset,
// kvcache.Preset) instead of a Geometry. A real model's caches do not fit
// in host memory at the sizes worth replaying (a million tokens of
// Qwen3-Next's per-token caches are 25 GB, and one of GLM-5.3-Flash's
// state slots 148 MB), and need not: what a pool admits, shares and evicts depends on
// its pages and slots, not on their bytes. So the pool is allocated as a
// miniature (Miniature): every group, page size and slot of the spec, in
// fewer bytes, and every byte figure is reported at the spec's size,
// group by group.
//
// A hybrid model (a spec with a state group: Qwen3-Next, GLM-5.3-Flash)
// shares a prefix only with the state at its end: a state checkpoint
// (kvcache's checkpoint.go). The simulated engine checkpoints where an
// engine would:
//
//   - at the end of every prefill chunk that ends on a page boundary
//     inside the prompt. It ends its chunks on page boundaries (the
//     chunk, cut by the step's prefill budget, rounded down to a page;
//     vLLM's mamba_cache_mode "align" schedules chunks of whole blocks
//     for the same reason), so every chunk but the prompt's last does;
//   - at Lease.PrefillCheckpoint, the last page boundary before the
//     prompt's last token, the deepest a later request can hit: a chunk
//     that would pass it ends there, and the rest (under a page) is the
//     next chunk;
//   - at the whole prompt, when it is whole pages (Lease.CachePrefix,
//     which checkpoints there on a hybrid pool), as for any model.
//
// A checkpoint refused for lack of room (kvcache.ErrCheckpointCapacity)
// is skipped, as an engine would: the pool counts it. Preemption
// checkpoints inside the pool (Lease.Preempt).
//
// The hit rate of such a run is compared with its per-token-only run
// (ModelPool.PerTokenOnly): the same trace on a pool of the same pages of
// the per-token group alone, whose engine publishes every prompt whole,
// as an attention-only model's does. That is what the checkpoints cost
// the prefix cache against a model whose prefix needs no state, measured
// on the same trace, pages and schedule; the pool's own checkpoint misses
// (matched pages past the last checkpoint) are a lower figure, because a
// hybrid pool publishes pages only with a checkpoint, so that pages it
// never checkpointed are not there to be matched.

// ModelPool runs a pool of a model's cache spec (see above).
type ModelPool struct {
	// Spec is the model's cache spec at full size: byte figures are its.
	Spec kvcache.CacheSpec
	// Miniature is what the pool allocates (see Miniature): Spec's
	// groups, page sizes and slots in fewer bytes.
	Miniature kvcache.CacheSpec
	// MaxLeases sizes the state groups (kvcache.Config.MaxLeases): slots
	// for that many live leases. Required with a hybrid spec, 0 without.
	MaxLeases int
	// CheckpointSlots (kvcache.PrefixConfig.CheckpointSlots) adds state
	// slots for checkpoints; MaxCheckpoints bounds the checkpoints held
	// (0: the slots' room).
	CheckpointSlots, MaxCheckpoints int
	// PerTokenOnly allocates the miniature's per-token group alone: the
	// same pages, no state, and an engine that publishes whole prompts.
	// MaxLeases and the checkpoint settings are then not used.
	PerTokenOnly bool
}

// Hybrid reports whether m's pool has groups beyond the per-token one.
func (m *ModelPool) Hybrid() bool { return m != nil && !m.PerTokenOnly && len(m.Spec.Groups) > 1 }

// poolSpec is the spec the pool allocates.
func (m *ModelPool) poolSpec() kvcache.CacheSpec {
	if m.PerTokenOnly {
		s := m.Miniature
		s.Groups = s.Groups[:1]
		return s
	}
	return m.Miniature
}

func (m *ModelPool) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: model %q: %s", ErrBadConfig, m.Spec.Model, fmt.Sprintf(format, args...))
	}
	if err := m.Spec.Validate(); err != nil {
		return bad("%v", err)
	}
	if err := m.Miniature.Validate(); err != nil {
		return bad("miniature: %v", err)
	}
	if len(m.Miniature.Groups) != len(m.Spec.Groups) || m.Miniature.TokensPerPage() != m.Spec.TokensPerPage() {
		return bad("the miniature has %d groups of %d tokens per page, the spec %d of %d",
			len(m.Miniature.Groups), m.Miniature.TokensPerPage(), len(m.Spec.Groups), m.Spec.TokensPerPage())
	}
	for i, g := range m.Spec.Groups {
		if mg := m.Miniature.Groups[i]; mg.Kind != g.Kind || mg.TokensPerPage != g.TokensPerPage || mg.WindowTokens != g.WindowTokens {
			return bad("the miniature's group %q is not the spec's group %q in kind, page or window", mg.Name, g.Name)
		}
		if g.Kind == kvcache.GroupSlidingWindow {
			// An engine slides its windows (Lease.SlideWindows) as it
			// writes, and checkpoints before they move: not simulated.
			return bad("group %q is a sliding window, which the simulated engine does not slide", g.Name)
		}
	}
	switch {
	case m.PerTokenOnly:
	case !m.Hybrid() && (m.MaxLeases != 0 || m.CheckpointSlots != 0 || m.MaxCheckpoints != 0):
		return bad("max leases %d, checkpoint slots %d, max checkpoints %d: the spec has no state group for them",
			m.MaxLeases, m.CheckpointSlots, m.MaxCheckpoints)
	case m.Hybrid() && m.MaxLeases < 1:
		return bad("max leases %d: want ≥ 1, it sizes the state groups", m.MaxLeases)
	case m.CheckpointSlots < 0 || m.MaxCheckpoints < 0:
		return bad("checkpoint slots %d, max checkpoints %d: want ≥ 0", m.CheckpointSlots, m.MaxCheckpoints)
	}
	return nil
}

// Miniature is spec at a size a host holds, for RunConfig.Model: one
// layer of every group (kvcache.CacheSpec.Miniature); the per-token
// group's regions shrunk until the largest holds one 4-byte word per
// token (what the simulated engine writes), every other group's divided
// by stateShrink (1: one layer's state at its full size, so that a
// checkpoint copies what one real layer's does).
func Miniature(spec kvcache.CacheSpec, stateShrink int) (kvcache.CacheSpec, error) {
	if stateShrink < 1 {
		return kvcache.CacheSpec{}, fmt.Errorf("%w: state shrink %d, want ≥ 1", ErrBadConfig, stateShrink)
	}
	if err := spec.Validate(); err != nil {
		return kvcache.CacheSpec{}, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	var largest int64
	for _, r := range spec.Groups[0].Regions {
		largest = max(largest, r.PageBytes)
	}
	shrink := max(1, largest/(4*int64(spec.TokensPerPage())))
	kv, err := spec.Miniature(1, int(shrink))
	if err != nil {
		return kvcache.CacheSpec{}, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	state, err := spec.Miniature(1, stateShrink)
	if err != nil {
		return kvcache.CacheSpec{}, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	kv.Groups = append(kv.Groups[:1], state.Groups[1:]...)
	if err := kv.Validate(); err != nil {
		return kvcache.CacheSpec{}, fmt.Errorf("%w: %w", ErrBadConfig, err)
	}
	return kv, nil
}

// groupBytes is one page (slot) of g over all its regions.
func groupBytes(g kvcache.CacheGroup) int64 {
	var b int64
	for _, r := range g.Regions {
		b += r.PageBytes
	}
	return b
}

// stateBytes is one lease's units beyond the per-token group (its state
// slots): what a checkpoint holds.
func stateBytes(s kvcache.CacheSpec) int64 {
	var b int64
	for _, g := range s.Groups[1:] {
		b += groupBytes(g)
	}
	return b
}

// tokensPerPage is the page size of cfg's pool.
func (c *RunConfig) tokensPerPage() int {
	if c.Model != nil {
		return c.Model.Spec.TokensPerPage()
	}
	return c.Geometry.TokensPerPage
}

// simLayout is what the simulated engine writes into, and what the
// pool's bytes stand for in the report.
type simLayout struct {
	tpp int
	// kvRegions is the page bytes of the per-token group's regions,
	// device regions 0 on.
	kvRegions []int64
	// groups are every group's regions and bytes per unit: the host's,
	// and the report's (the model's, or the report geometry's).
	groups []layoutGroup
	// hostPool and reportPool are the pool's bytes over every group.
	hostPool, reportPool int64
	// token is a token's bytes in the per-token group at the report's
	// size.
	token int64
}

type layoutGroup struct {
	first, count int
	units        int
	host, report int64
}

// layoutOf is the layout of cfg's pool.
func layoutOf(cfg RunConfig) simLayout {
	if m := cfg.Model; m != nil {
		spec, full := m.poolSpec(), m.Spec
		l := simLayout{tpp: spec.TokensPerPage(), token: full.TokenBytes()}
		for _, r := range spec.Groups[0].Regions {
			l.kvRegions = append(l.kvRegions, r.PageBytes)
		}
		first := 0
		for i, g := range spec.Groups {
			units := cfg.PoolPages
			if i > 0 {
				units = m.MaxLeases + m.CheckpointSlots
			}
			lg := layoutGroup{first: first, count: len(g.Regions), units: units, host: groupBytes(g), report: groupBytes(full.Groups[i])}
			l.groups = append(l.groups, lg)
			l.hostPool += int64(units) * lg.host
			l.reportPool += int64(units) * lg.report
			first += len(g.Regions)
		}
		return l
	}
	g := cfg.Geometry
	l := simLayout{tpp: g.TokensPerPage, token: g.TokenBytes()}
	for range g.Regions() {
		l.kvRegions = append(l.kvRegions, g.RegionPageBytes())
	}
	report := g.PageBytes()
	if rg := cfg.ReportGeometry; rg != nil {
		report, l.token = rg.PageBytes(), rg.TokenBytes()
	}
	l.groups = []layoutGroup{{first: 0, count: g.Regions(), units: cfg.PoolPages, host: g.PageBytes(), report: report}}
	l.hostPool, l.reportPool = int64(cfg.PoolPages)*g.PageBytes(), int64(cfg.PoolPages)*report
	return l
}

// prefault fills every unit of every group of dev once and waits.
func prefault(dev cudaops.Device, lay simLayout, spec cudaops.FillSpec) error {
	spans := make([]cudaops.Span, len(lay.groups))
	for i, g := range lay.groups {
		pages := make([]int32, g.units)
		for p := range pages {
			pages[p] = int32(p)
		}
		spans[i] = cudaops.Span{First: g.first, Count: g.count, Pages: pages}
	}
	var f cudaops.Fence
	var err error
	if sf, ok := dev.(cudaops.SpanFiller); ok {
		f, err = sf.FillSpans(spans, spec, cudaops.Ordering{})
	} else if len(spans) == 1 {
		f, err = dev.Fill(spans[0].Pages, spec, cudaops.Ordering{})
	} else {
		return fmt.Errorf("%w: %s cannot fill spans of regions (cudaops.SpanFiller)", cudaops.ErrInvalidArgument, dev.Name())
	}
	if err == nil {
		err = f.Wait()
	}
	return err
}

// chunkEnd is where the prefill chunk of a that the step's budget would
// end at end stops on a hybrid model's pool: at the lease's prefill
// checkpoint if it would pass it, else inside the prompt on a page
// boundary (a.written, no chunk this step, when the budget holds less
// than a page).
func (s *sim) chunkEnd(a *active, end int) int {
	if pc := a.lease.PrefillCheckpoint(); a.written < pc && end > pc {
		return pc
	}
	if end < a.prompt {
		end = max(a.written, end/s.lay.tpp*s.lay.tpp)
	}
	return end
}

// checkpoint takes a's state checkpoint at n tokens, the end of a
// prefill chunk, on a hybrid model's pool (Lease.CheckpointState).
func (s *sim) checkpoint(a *active, n int) error {
	start := time.Now()
	err := a.lease.CheckpointState(n, cudaops.Ordering{})
	s.countCheckpoint(time.Since(start))
	if err = skipNoRoom(err); err != nil {
		return fmt.Errorf("checkpointing %s at %d tokens: %w", a.req.ID, n, err)
	}
	return nil
}

// cachePrompt publishes a's computed prompt (Lease.CachePrefix). On a
// hybrid model's pool that is a checkpoint at the prompt when it is
// whole pages (and nothing otherwise: the pages below its prefill
// checkpoint were published with it).
func (s *sim) cachePrompt(a *active) error {
	start := time.Now()
	_, err := a.lease.CachePrefix(a.prompt)
	if s.hybrid && a.prompt%s.lay.tpp == 0 {
		s.countCheckpoint(time.Since(start))
	}
	if err = skipNoRoom(err); err != nil {
		return fmt.Errorf("publishing the prompt of %s: %w", a.req.ID, err)
	}
	return nil
}

func (s *sim) countCheckpoint(took time.Duration) {
	s.ckptCalls++
	s.ckptTime += took
}

// skipNoRoom is err, but nil for a checkpoint refused for lack of room,
// which an engine skips (the pool counts it, and logs the first).
func skipNoRoom(err error) error {
	if errors.Is(err, kvcache.ErrCheckpointCapacity) {
		return nil
	}
	return err
}

// CheckpointResult is what a hybrid model's state checkpoints did in a
// run (RunConfig.Model with a state group). Times are the host device's:
// memcpy of the miniature's slots in host memory, not a GPU's copies.
type CheckpointResult struct {
	MaxLeases       int `json:"max_leases"`
	CheckpointSlots int `json:"checkpoint_slots"`
	MaxCheckpoints  int `json:"max_checkpoints"`
	// Calls counts the engine's checkpoints (chunk ends, prefill
	// checkpoints, whole prompts of whole pages); the pool's figures
	// follow (kvcache.CheckpointStats): Taken, Existing (one was there
	// already), CapacitySkips (no room), Evicted, Hits (admissions that
	// restored one) and HitTokens, Misses and MissTokens (matched pages
	// past an admission's last checkpoint).
	Calls         uint64 `json:"calls"`
	Taken         uint64 `json:"taken"`
	Existing      uint64 `json:"existing"`
	CapacitySkips uint64 `json:"capacity_skips"`
	Evicted       uint64 `json:"evicted"`
	Hits          uint64 `json:"hits"`
	HitTokens     uint64 `json:"hit_tokens"`
	Misses        uint64 `json:"misses"`
	MissTokens    uint64 `json:"miss_tokens"`
	// MatchedRate is the same pool's longest matches, checkpoints
	// ignored: (hit + checkpoint-miss tokens) ÷ looked-up tokens. A
	// hybrid pool publishes pages only with a checkpoint, so this counts
	// only pages some checkpoint published; the per-token-only run is the
	// bound the trace and pages allow.
	MatchedRate float64 `json:"matched_rate"`
	LiveAtEnd   int     `json:"live_at_end"`
	// SlotBytes is one checkpoint's state at the model's size; HostSlotBytes
	// the miniature's, which the copies moved.
	SlotBytes     int64 `json:"slot_bytes"`
	HostSlotBytes int64 `json:"host_slot_bytes"`
	// State bytes the checkpoints held, at the model's size: most over the
	// utilisation samples and at the end; HostPeakStateBytes the
	// miniature's.
	PeakStateBytes     int64 `json:"peak_state_bytes"`
	StateBytesAtEnd    int64 `json:"state_bytes_at_end"`
	HostPeakStateBytes int64 `json:"host_peak_state_bytes"`
	// CopySeconds and RestoreSeconds are the pool's time copying leases'
	// state into checkpoints and checkpoints into admitted leases (its
	// CopyNanos and RestoreNanos); per checkpoint taken and per hit in
	// ns. HostCopyGBps is the bytes both moved ÷ their time, in 10^9
	// bytes/s. ModelCopyNs is CopyNs scaled to SlotBytes: the same host
	// memcpy rate over a whole checkpoint of the model (an estimate; a
	// GPU copies at its own bandwidth).
	CopySeconds    float64 `json:"copy_seconds"`
	RestoreSeconds float64 `json:"restore_seconds"`
	CopyNs         float64 `json:"copy_ns_per_checkpoint"`
	RestoreNs      float64 `json:"restore_ns_per_hit"`
	HostCopyGBps   float64 `json:"host_copy_gb_per_s"`
	ModelCopyNs    float64 `json:"model_copy_ns_estimate"`
	// CallSeconds is the wall time of the engine's checkpoint calls:
	// publication, evictions and their scrubs, and the copy.
	CallSeconds float64 `json:"call_seconds"`
	// PerTokenOnly is the same trace's hit rate on a pool of the
	// per-token group alone (ModelPool.PerTokenOnly), when kvbench ran it.
	PerTokenOnly *PerTokenFigures `json:"per_token_only,omitempty"`
}

// HostCopyNs times a plain host memcpy of n bytes between two buffers:
// the median of rounds copies, after one that faults the pages in. It is
// the reference for a checkpoint's copy at a model's size, which the
// miniature's slots (one layer's) only estimate.
func HostCopyNs(n int64, rounds int) int64 {
	src, dst := make([]byte, n), make([]byte, n)
	for i := range src {
		src[i] = byte(i)
	}
	copy(dst, src)
	took := make([]time.Duration, max(rounds, 1))
	for i := range took {
		start := time.Now()
		copy(dst, src)
		took[i] = time.Since(start)
	}
	slices.Sort(took)
	return int64(Percentile(took, 0.5))
}

// PerTokenFigures are a per-token-only run's prefix figures.
type PerTokenFigures struct {
	HitRate        float64 `json:"hit_rate"`
	LookupPages    uint64  `json:"lookup_pages"`
	HitPages       uint64  `json:"hit_pages"`
	HitTokens      uint64  `json:"hit_tokens"`
	PromptHitShare float64 `json:"prompt_hit_share"`
	EvictedPages   uint64  `json:"evicted_pages"`
	Admitted       uint64  `json:"admitted"`
	TTFTP50        float64 `json:"ttft_p50_s"`
	TTFTP99        float64 `json:"ttft_p99_s"`
}

// PerTokenFiguresOf is r's prefix figures, r a per-token-only run.
func PerTokenFiguresOf(r *RunResult) *PerTokenFigures {
	px := r.Prefix
	return &PerTokenFigures{HitRate: px.HitRate, LookupPages: px.LookupPages, HitPages: px.HitPages, HitTokens: px.HitTokens,
		PromptHitShare: px.PromptHitShare, EvictedPages: px.EvictedPages, Admitted: r.Admitted, TTFTP50: r.TTFT.P50, TTFTP99: r.TTFT.P99}
}

// finishCheckpoints turns the pool's checkpoint figures into the result's.
func (s *sim) finishCheckpoints() {
	m := s.cfg.Model
	if !m.Hybrid() {
		return
	}
	st := s.endStats.Checkpoints
	c := &CheckpointResult{MaxLeases: m.MaxLeases, CheckpointSlots: m.CheckpointSlots, MaxCheckpoints: m.MaxCheckpoints,
		Calls: s.ckptCalls, Taken: st.Taken, Existing: st.Existing, CapacitySkips: st.CapacitySkips, Evicted: st.Evicted,
		Hits: st.Hits, HitTokens: st.HitTokens, Misses: st.Misses, MissTokens: st.MissTokens, LiveAtEnd: st.Live,
		SlotBytes: stateBytes(m.Spec), HostSlotBytes: stateBytes(m.Miniature),
		CopySeconds: float64(st.CopyNanos) / 1e9, RestoreSeconds: float64(st.RestoreNanos) / 1e9, CallSeconds: s.ckptTime.Seconds()}
	scale := func(host int64) int64 { return host / c.HostSlotBytes * c.SlotBytes }
	c.PeakStateBytes, c.HostPeakStateBytes = scale(s.peakState), s.peakState
	c.StateBytesAtEnd = scale(st.StateBytes)
	if st.Taken > 0 {
		c.CopyNs = float64(st.CopyNanos) / float64(st.Taken)
		c.ModelCopyNs = c.CopyNs * float64(c.SlotBytes) / float64(c.HostSlotBytes)
	}
	if px := s.res.Prefix; px.LookupPages > 0 {
		c.MatchedRate = float64(px.HitTokens+st.MissTokens) / float64(px.LookupPages*uint64(s.lay.tpp))
	}
	if st.Hits > 0 {
		c.RestoreNs = float64(st.RestoreNanos) / float64(st.Hits)
	}
	if ns := st.CopyNanos + st.RestoreNanos; ns > 0 {
		c.HostCopyGBps = float64((st.Taken+st.Hits)*uint64(c.HostSlotBytes)) / float64(ns)
	}
	s.res.Checkpoints = c
}

// State slots: what the audit sees of a hybrid lease's state.
//
// The simulated engine marks the state it computes: after each prefill
// chunk it writes its marker word (markerWord: tenant and admission) at
// the start of every region of the lease's state slots. With Audit, each
// admitted lease's slots are read back before the engine writes: a lease
// that hit restored a checkpoint, so each region must start with the
// marker of a tenant of its own domain (a checkpoint is its domain's
// computed state); a lease that did not must hold exactly the policy's
// scrub word for its slot, every byte of every region (a slot is
// scrubbed whenever a lease or a checkpoint lets it go).

// stateRegion is one device region of a state group.
type stateRegion struct {
	region int
	bytes  int64
}

// stateGroup is one state group of a hybrid model's pool.
type stateGroup struct {
	name    string
	regions []stateRegion
}

// stateGroupsOf lists cfg's pool's state groups (none for other pools).
func stateGroupsOf(cfg RunConfig, lay simLayout) []stateGroup {
	if !cfg.Model.Hybrid() {
		return nil
	}
	var out []stateGroup
	for i, g := range cfg.Model.Miniature.Groups[1:] {
		sg := stateGroup{name: g.Name}
		for j, r := range g.Regions {
			sg.regions = append(sg.regions, stateRegion{region: lay.groups[i+1].first + j, bytes: r.PageBytes})
		}
		out = append(out, sg)
	}
	return out
}

// stateSlots sets a.slots to its lease's slot in each state group.
func (s *sim) stateSlots(a *active) error {
	a.slots = a.slots[:0]
	for _, g := range s.stateGroups {
		var err error
		if _, a.slots, err = a.lease.GroupTable(g.name, a.slots); err != nil {
			return fmt.Errorf("the %s slot of %s: %w", g.name, a.req.ID, err)
		}
	}
	if len(a.slots) != len(s.stateGroups) {
		return fmt.Errorf("%s holds %d state slots in %d state groups", a.req.ID, len(a.slots), len(s.stateGroups))
	}
	return nil
}

// writeState marks a's state slots as computed by a (see above).
func (s *sim) writeState(a *active) {
	for i, g := range s.stateGroups {
		for _, r := range g.regions {
			copy(s.host.PageBytes(r.region, a.slots[i])[:4], a.marker)
		}
	}
}

// auditState checks a's state slots at its admission (see above).
func (s *sim) auditState(a *active) {
	au := &s.res.Audit
	for i, g := range s.stateGroups {
		slot := a.slots[i]
		au.StateSlotsChecked++
		want := s.spec.WordFor(slot)
		for _, r := range g.regions {
			if int64(len(s.stateBuf)) < r.bytes {
				s.stateBuf = make([]byte, r.bytes)
			}
			buf := s.stateBuf[:r.bytes]
			if err := s.dev.ReadPage(r.region, slot, buf); err != nil {
				au.ReadErrors++
				break
			}
			if a.hit > 0 {
				if w := binary.LittleEndian.Uint32(buf); !s.ownMarker(a, w) {
					au.ForeignStateSlots++
					s.stateExample(a, "restored", g.name, slot, r.region, 0, w)
					break
				}
				continue
			}
			off := 0
			for off < len(buf) && binary.LittleEndian.Uint32(buf[off:]) == want {
				off += 4
			}
			if off < len(buf) {
				au.StaleStateSlots++
				w := binary.LittleEndian.Uint32(buf[off:])
				if w&markerBit != 0 && int(w>>16)&0xff != a.tenant {
					au.CrossTenantStateSlots++
				}
				s.stateExample(a, "fresh", g.name, slot, r.region, off, w)
				break
			}
		}
	}
}

// stateExample records a failed state check, naming what the slot held.
func (s *sim) stateExample(a *active, kind, group string, slot int32, region, off int, got uint32) {
	au := &s.res.Audit
	if len(au.Examples) >= maxAuditExamples {
		return
	}
	what := "no state (a scrub pattern or never written)"
	if got&markerBit != 0 {
		what = "state of an unknown writer"
		if pt := int(got>>16) & 0xff; pt < len(s.tr.Tenants) {
			what = fmt.Sprintf("state of tenant %q of domain %q", s.tr.Tenants[pt].Name, s.domainOf[pt])
		}
	}
	au.Examples = append(au.Examples, fmt.Sprintf("%s %s slot %d region %d byte %d: %#08x (%s), handed to tenant %q of domain %q",
		kind, group, slot, region, off, got, what, a.req.Tenant, s.domainOf[a.tenant]))
}
