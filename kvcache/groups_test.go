package kvcache

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

// hybridSpec is a small hybrid model: a per-token group of two
// MLA-latent layers in bf16 and their fp8 indexer keys (regions of three
// page sizes), a sliding-window group of one layer (window 8 tokens, 4 per
// page: a ring of 3 pages), and a state group of two linear-attention
// layers (bf16 conv window, fp32 recurrent state).
func hybridSpec() CacheSpec {
	return CacheSpec{Model: "test-hybrid", Groups: []CacheGroup{
		{Name: "kv", Kind: GroupPerToken, TokensPerPage: 4, Regions: append(
			MLALatent([]int{1, 3}, 12, 4, BF16, 4), IndexerKeys([]int{1, 3}, 16, 4)...)},
		{Name: "swa", Kind: GroupSlidingWindow, TokensPerPage: 4, WindowTokens: 8,
			Regions: AttentionKVOf([]int{2}, 1, 8, BF16, 4)},
		{Name: "state", Kind: GroupState,
			Regions: LinearAttentionState([]int{0, 4}, 8, 4, BF16, 2, 4, 4, FP32)},
	}}
}

func hybridConfig(pages, maxLeases int, tenants ...TenantConfig) Config {
	if len(tenants) == 0 {
		tenants = []TenantConfig{{Name: "a"}, {Name: "b"}}
	}
	return Config{Cache: hybridSpec(), Pages: pages, MaxLeases: maxLeases,
		MaxContextTokens: pages * 4, Tenants: tenants}
}

// groupPages returns, for every region of the pool, the bytes of the
// pages (slots) a lease holds in that region's group.
func leaseRegionPages(t *testing.T, p *Pool, l *Lease) map[int][]int32 {
	t.Helper()
	out := map[int][]int32{}
	for gi, g := range p.Spec().Groups {
		_, table, err := l.GroupTable(g.Name, nil)
		require.NoError(t, err)
		first := p.groups[gi].first
		for r := range g.Regions {
			out[first+r] = table
		}
	}
	return out
}

func fillMarker(b []byte, marker byte) {
	for i := range b {
		b[i] = marker
	}
}

// The specs a user gets wrong, each refused with its own error and with
// nothing allocated: the caller's device keeps no region.
func TestCacheSpecRefusedBeforeAllocating(t *testing.T) {
	base := hybridSpec
	mutate := func(f func(*CacheSpec)) CacheSpec { s := base(); f(&s); return s }
	mem := make([]byte, 1<<16)
	cases := map[string]struct {
		spec      CacheSpec
		maxLeases int
		want      string
	}{
		"no groups":               {CacheSpec{Model: "x"}, 2, "no cache groups"},
		"zero layers":             {mutate(func(s *CacheSpec) { s.Groups[0].Regions = nil }), 2, "no regions (zero layers?)"},
		"state group of 0 bytes":  {mutate(func(s *CacheSpec) { s.Groups[2].Regions[0].PageBytes = 0 }), 2, "positive multiple of 4"},
		"window without a window": {mutate(func(s *CacheSpec) { s.Groups[1].WindowTokens = 0 }), 2, "WindowTokens = 0"},
		"window beyond the context": {mutate(func(s *CacheSpec) { s.Groups[1].WindowTokens = 100 }), 2,
			"longer than the max context"},
		"first group not per-token": {mutate(func(s *CacheSpec) { s.Groups[0], s.Groups[2] = s.Groups[2], s.Groups[0] }), 2,
			"the first group must be the per-token one"},
		"second per-token group": {mutate(func(s *CacheSpec) { s.Groups[1].Kind, s.Groups[1].WindowTokens = GroupPerToken, 0 }), 2,
			"second per-token group"},
		"duplicate region": {mutate(func(s *CacheSpec) { s.Groups[2].Regions[1].Name = s.Groups[0].Regions[0].Name }), 2,
			"two regions named"},
		"duplicate group":       {mutate(func(s *CacheSpec) { s.Groups[2].Name = "kv" }), 2, "two groups named"},
		"odd page bytes":        {mutate(func(s *CacheSpec) { s.Groups[0].Regions[0].PageBytes = 6 }), 2, "multiple of 4"},
		"state with page size":  {mutate(func(s *CacheSpec) { s.Groups[2].TokensPerPage = 4 }), 2, "must be 0"},
		"invalid dtype":         {mutate(func(s *CacheSpec) { s.Groups[0].Regions[2].AlsoHolds = []DType{0} }), 2, "also holds dtype"},
		"no MaxLeases":          {base(), 0, "MaxLeases = 0"},
		"unknown kind":          {mutate(func(s *CacheSpec) { s.Groups[1].Kind = 9 }), 2, "kind GroupKind(9)"},
		"half adopted":          {mutate(func(s *CacheSpec) { s.Groups[0].Regions[0].Memory = &RegionMemory{Host: mem} }), 2, "adopt all or none"},
		"stride under a page":   {adoptAll(base(), mem, func(r *CacheRegion) { r.Memory.Stride = r.PageBytes - 4 }), 2, "smaller than a page"},
		"overlapping tensors":   {adoptAll(base(), mem, func(r *CacheRegion) { r.Memory.Host = mem }), 2, "shares bytes with region"},
		"tensor too small":      {adoptAll(base(), mem, func(r *CacheRegion) { r.Memory.Host = r.Memory.Host[:8] }), 2, "adopted host buffer of 8 bytes"},
		"fewer pages than pool": {adoptAll(base(), mem, func(r *CacheRegion) { r.Memory.Pages = 2 }), 2, "holds 2 pages"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			dev := cudaops.NewHost()
			defer dev.Close()
			cfg := hybridConfig(16, c.maxLeases)
			cfg.Cache, cfg.Device = c.spec, dev
			_, err := New(cfg)
			require.ErrorIs(t, err, ErrInvalidConfig)
			assert.ErrorContains(t, err, c.want)
			assert.Empty(t, dev.Regions(), "a refused spec left regions on the device")
		})
	}
	_, err := New(Config{Geometry: tinyGeometry, Cache: hybridSpec(), Pages: 4, MaxContextTokens: 4})
	assert.ErrorContains(t, err, "not both")
	_, err = New(Config{Geometry: tinyGeometry, Pages: 4, MaxContextTokens: 4, MaxLeases: 3})
	assert.ErrorContains(t, err, "no sliding-window or state group")
	// One poison word for fp8, bf16 and fp32: 0x7f7f is finite in bf16
	// but NaN as fp8.
	cfg := hybridConfig(16, 2)
	cfg.Scrub = ScrubPolicy{Kind: ScrubPoison, Pattern: 0x7f7f}
	_, err = New(cfg)
	assert.ErrorIs(t, err, isolation.ErrNonFinitePattern)
}

// adoptAll gives every region of s its own slice of mem (16 pages each, a
// gap of 4 bytes between pages) and applies f to each.
func adoptAll(s CacheSpec, mem []byte, f func(*CacheRegion)) CacheSpec {
	off := 0
	for gi := range s.Groups {
		for ri := range s.Groups[gi].Regions {
			r := &s.Groups[gi].Regions[ri]
			stride := r.PageBytes + 4
			n := int(stride) * 16
			r.Memory = &RegionMemory{Host: mem[off : off+n], Stride: stride, Pages: 16}
			off += n
			f(r)
		}
	}
	return s
}

// A lease takes its pages in every group or in none: when the state
// group has no slot left, the refusal names it and its numbers, and the
// per-token pages the request would have had stay free.
func TestHybridAdmissionAllOrNothing(t *testing.T) {
	p := newPool(t, hybridConfig(16, 2))
	a := admit(t, p, "r1", "a", 10)
	admit(t, p, "r2", "b", 6)
	before := state(p)
	_, err := p.TryAdmit(Request{ID: "r3", Tenant: "a", PromptTokens: 4})
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, ErrPoolExhausted, ae.Err)
	assert.Equal(t, "state", ae.Group)
	assert.Equal(t, [3]int{1, 0, 2}, [3]int{ae.Need, ae.Have, ae.Limit})
	assert.Contains(t, err.Error(), `in cache group "state"`)
	assert.Equal(t, before, state(p), "a refusal in one group took something in another")
	require.NoError(t, p.Check())

	// The per-token group short while slots are free: the refusal names
	// it, and no slot is taken.
	require.NoError(t, a.Release())
	before = state(p)
	_, err = p.TryAdmit(Request{ID: "big", Tenant: "a", PromptTokens: 60})
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "kv", ae.Group)
	assert.Equal(t, ErrPoolExhausted, ae.Err)
	assert.Equal(t, before, state(p))
	require.NoError(t, p.Check())

	gs := p.Stats().Groups
	require.Len(t, gs, 3)
	assert.Equal(t, []string{"kv", "swa", "state"}, []string{gs[0].Name, gs[1].Name, gs[2].Name})
	assert.Equal(t, GroupStats{Name: "state", Kind: GroupState, Pages: 2, PageBytes: gs[2].PageBytes, Free: 1, InUse: 1}, gs[2])
	assert.Equal(t, 2, gs[1].InUse, "r2's 6 tokens hold a ring of 2 window pages")
}

// Quotas and reservations are the same share of every group: a tenant
// allowed half the pages may hold half the slots, and one that reserves a
// quarter of the pages is kept a quarter of the slots.
func TestHybridQuotaIsAShareOfEveryGroup(t *testing.T) {
	p := newPool(t, hybridConfig(30, 4, TenantConfig{Name: "half", QuotaPages: 15}, TenantConfig{Name: "other"},
		TenantConfig{Name: "keeper", ReservedPages: 7}))
	admit(t, p, "h1", "half", 4)
	admit(t, p, "h2", "half", 4)
	_, err := p.TryAdmit(Request{ID: "h3", Tenant: "half", PromptTokens: 4})
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, ErrExceedsQuota, ae.Err)
	assert.Equal(t, "state", ae.Group)
	assert.Equal(t, [3]int{1, 0, 2}, [3]int{ae.Need, ae.Have, ae.Limit}, "half of 4 slots")
	assert.Equal(t, GroupState, ae.GroupKind)
	assert.Contains(t, err.Error(), "needs 1 slots, 0 left of quota 2", "a state group's numbers are slots")
	// 4 slots: 2 held by "half", 1 kept for "keeper": "other" gets one.
	admit(t, p, "o1", "other", 4)
	_, err = p.TryAdmit(Request{ID: "o2", Tenant: "other", PromptTokens: 4})
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "state", ae.Group)
	assert.ErrorIs(t, err, isolation.ErrReserved)
	admit(t, p, "k1", "keeper", 4)
	require.NoError(t, p.Check())

	// A reservation that fits the pages but not a group's share of it is
	// refused, and registered nowhere: 7 + 23 of 30 pages, but 3 + 10 of
	// the window group's 12 (shares round up).
	err = p.AddTenant(TenantConfig{Name: "greedy", ReservedPages: 23})
	require.ErrorIs(t, err, ErrOverReserved)
	assert.ErrorContains(t, err, `cache group "swa"`)
	_, err = p.TryAdmit(Request{ID: "g", Tenant: "greedy", PromptTokens: 1})
	assert.ErrorIs(t, err, ErrUnknownTenant)
	require.NoError(t, p.UpdateTenant(TenantConfig{Name: "half", QuotaPages: 30}))
	require.NoError(t, p.Check())
}

// A release scrubs every byte of every region of every group the lease
// held, in one fill, and nothing of any other lease.
func TestHybridReleaseScrubsEveryGroupInOneFill(t *testing.T) {
	cfg := hybridConfig(16, 3)
	cfg.Scrub = ScrubPolicy{Kind: ScrubPoison}
	p := newPool(t, cfg)
	h := hostOf(t, p)
	l := admit(t, p, "victim", "a", 10)
	keep := admit(t, p, "bystander", "b", 10)
	mark := func(l *Lease, m byte) {
		for r, pages := range leaseRegionPages(t, p, l) {
			for _, pg := range pages {
				fillMarker(h.PageBytes(r, pg), m)
			}
		}
	}
	mark(l, 0xa5)
	mark(keep, 0x5a)
	held := leaseRegionPages(t, p, l)
	fills := h.Counters().FillCalls
	require.NoError(t, l.Release())
	assert.Equal(t, fills+1, h.Counters().FillCalls, "one fill for every group")
	word := p.q.Spec().Word
	regions := h.Regions()
	for r, pages := range held {
		want := make([]byte, regions[r].PageBytes)
		for i := 0; i < len(want); i += 4 {
			binary.LittleEndian.PutUint32(want[i:], word)
		}
		for _, pg := range pages {
			assert.Equal(t, want, h.PageBytes(r, pg), "region %d page %d", r, pg)
		}
	}
	for r, pages := range leaseRegionPages(t, p, keep) {
		for _, pg := range pages {
			assert.Equal(t, bytes.Repeat([]byte{0x5a}, int(regions[r].PageBytes)), h.PageBytes(r, pg), "bystander region %d page %d", r, pg)
		}
	}
	require.NoError(t, p.Check())
}

// Canary markers written into KV pages, latents, indexer keys, window
// pages and state slots never reach another tenant, over many reuses;
// and a write into a free state slot is caught when the slot is handed
// out next.
func TestHybridCanaryMarkersNeverReachAnotherTenant(t *testing.T) {
	cfg := hybridConfig(24, 3, TenantConfig{Name: "a"}, TenantConfig{Name: "b"}, TenantConfig{Name: "c"})
	cfg.Scrub = ScrubPolicy{Kind: ScrubCanary}
	p := newPool(t, cfg)
	h := hostOf(t, p)
	rng := rand.New(rand.NewPCG(7, 8))
	tenants := []string{"a", "b", "c"}
	marker := func(tenant string) []byte { return []byte("KVFENCE-MARK-" + tenant) }
	live := map[string]*Lease{}
	for step := range 600 {
		id := fmt.Sprintf("r%d", step)
		tn := tenants[rng.IntN(3)]
		if len(live) == 3 || (len(live) > 0 && rng.IntN(2) == 0) {
			for k, l := range live {
				require.NoError(t, l.Release())
				delete(live, k)
				break
			}
		}
		l, err := p.TryAdmit(Request{ID: id, Tenant: tn, PromptTokens: 1 + rng.IntN(30)})
		if err != nil {
			require.ErrorIs(t, err, ErrPoolExhausted)
			continue
		}
		for r, pages := range leaseRegionPages(t, p, l) {
			for _, pg := range pages {
				b := h.PageBytes(r, pg)
				for _, other := range tenants {
					if other != tn && bytes.Contains(b, marker(other)[:8]) && bytes.Contains(b, marker(other)) {
						t.Fatalf("step %d: tenant %s's lease got region %d page %d holding %s's marker", step, tn, r, pg, other)
					}
				}
				copy(b, marker(tn))
				copy(b[len(b)-len(marker(tn)):], marker(tn))
			}
		}
		live[id] = l
	}
	require.NoError(t, p.Check())
	for _, l := range live {
		require.NoError(t, l.Release())
	}
	// A stray write into a free state slot: the next admission that would
	// take it refuses, faulted, naming the group.
	slotRegion := p.groups[2].first
	free := p.groups[2].alloc.PeekFree(nil, 1)
	h.PageBytes(slotRegion, free[0])[0] ^= 0xff
	_, err := p.TryAdmit(Request{ID: "after", Tenant: "a", PromptTokens: 4})
	require.ErrorIs(t, err, ErrPoolFaulted)
	require.ErrorIs(t, err, ErrCanaryMismatch)
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, "state", ae.Group)
	require.NoError(t, p.Check())
}

// A sliding window keeps a ring of window/page + 1 pages; the pages that
// slide out are scrubbed (in one fill) before the ring reuses them, while
// the lease lives, and GroupTable follows the window.
func TestSlidingWindowScrubsWhatSlidOut(t *testing.T) {
	cfg := hybridConfig(64, 2)
	cfg.Scrub = ScrubPolicy{Kind: ScrubPoison}
	p := newPool(t, cfg)
	h := hostOf(t, p)
	l := admit(t, p, "long", "a", 200)
	first, ring, err := l.GroupTable("swa", nil)
	require.NoError(t, err)
	require.Equal(t, 0, first)
	require.Len(t, ring, 3, "window 8 tokens at 4 per page: 2 pages + 1")
	swa := &p.groups[1]
	for r := swa.first; r < swa.first+swa.count; r++ {
		for _, pg := range ring {
			fillMarker(h.PageBytes(r, pg), 0xee)
		}
	}
	require.NoError(t, l.Commit(12)) // tokens [4, 12) stay in the window: page 0 (tokens 0..3) slides out
	fills := h.Counters().FillCalls
	n, err := l.SlideWindows(cudaops.Ordering{})
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	assert.Equal(t, fills+1, h.Counters().FillCalls)
	first, now, err := l.GroupTable("swa", nil)
	require.NoError(t, err)
	assert.Equal(t, 1, first)
	assert.Equal(t, []int32{ring[1], ring[2], ring[0]}, now, "the scrubbed page holds the window's next tokens")
	word := p.q.Spec().Word
	for r := swa.first; r < swa.first+swa.count; r++ {
		for i, pg := range ring {
			b := h.PageBytes(r, pg)
			if i == 0 {
				assert.Equal(t, word, binary.LittleEndian.Uint32(b), "slid-out page %d scrubbed", pg)
				assert.NotContains(t, b, byte(0xee))
			} else {
				assert.Equal(t, bytes.Repeat([]byte{0xee}, len(b)), b, "page %d still in the window", pg)
			}
		}
	}
	// Nothing more slides until the watermark passes another page; a jump
	// past the whole ring scrubs each ring page once.
	n, err = l.SlideWindows(cudaops.Ordering{})
	require.NoError(t, err)
	assert.Zero(t, n)
	require.NoError(t, l.Commit(180))
	n, err = l.SlideWindows(cudaops.Ordering{})
	require.NoError(t, err)
	assert.Equal(t, 3, n)
	first, _, err = l.GroupTable("swa", nil)
	require.NoError(t, err)
	assert.Equal(t, (180-8)/4, first)
	require.NoError(t, p.Check())
	require.NoError(t, l.Release())
	_, err = l.SlideWindows(cudaops.Ordering{})
	assert.ErrorIs(t, err, ErrLeaseReleased)
	_, _, err = l.GroupTable("nope", nil)
	assert.ErrorIs(t, err, ErrLeaseReleased)
	l2 := admit(t, p, "x", "b", 4)
	_, _, err = l2.GroupTable("nope", nil)
	assert.ErrorIs(t, err, ErrInvalidArgument)
}

// A failed fill of a release that spans groups retires its pages in every
// group and faults the pool; Check still passes.
func TestHybridFailedFillRetiresEveryGroup(t *testing.T) {
	dev := &failingSpans{Host: cudaops.NewHost()}
	cfg := hybridConfig(16, 2)
	cfg.Device = dev
	p := newPool(t, cfg)
	l := admit(t, p, "r", "a", 10)
	dev.fail = true
	err := l.Release()
	require.ErrorIs(t, err, ErrPoolFaulted)
	gs := p.Stats().Groups
	assert.Equal(t, []int{3, 3, 1}, []int{gs[0].Retired, gs[1].Retired, gs[2].Retired})
	require.NoError(t, p.Check())
	_, err = p.TryAdmit(Request{ID: "s", Tenant: "a", PromptTokens: 1})
	assert.ErrorIs(t, err, ErrPoolFaulted)
}

type failingSpans struct {
	*cudaops.Host
	fail bool
}

func (d *failingSpans) FillSpans(spans []cudaops.Span, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	if d.fail {
		return nil, errors.New("injected span fill failure")
	}
	return d.Host.FillSpans(spans, spec, after)
}

// A device that cannot fill several groups in one operation is refused
// for a spec with several groups, before anything is allocated on it.
func TestHybridOnDeviceWithoutSpans(t *testing.T) {
	dev := plainDevice{cudaops.NewHost()}
	cfg := hybridConfig(16, 2)
	cfg.Device = dev
	_, err := New(cfg)
	require.ErrorIs(t, err, ErrInvalidConfig)
	assert.ErrorContains(t, err, "SpanFiller")
}

// plainDevice hides the Host's FillSpans.
type plainDevice struct{ h *cudaops.Host }

func (d plainDevice) Name() string                            { return "plain" }
func (d plainDevice) AllocRegion(n int, b int64) (int, error) { return d.h.AllocRegion(n, b) }
func (d plainDevice) Regions() []cudaops.Region               { return d.h.Regions() }
func (d plainDevice) Fill(p []int32, s cudaops.FillSpec, o cudaops.Ordering) (cudaops.Fence, error) {
	return d.h.Fill(p, s, o)
}
func (d plainDevice) ReadPage(r int, p int32, b []byte) error  { return d.h.ReadPage(r, p, b) }
func (d plainDevice) WritePage(r int, p int32, b []byte) error { return d.h.WritePage(r, p, b) }
func (d plainDevice) Counters() cudaops.Counters               { return d.h.Counters() }
func (d plainDevice) Close() error                             { return d.h.Close() }

// Admission against a model of every group's free pages and every
// tenant's share: a random mix of admissions and releases is admitted
// exactly when the model says every group has room within the tenant's
// share, and Check holds throughout.
func TestHybridAdmissionMatchesModel(t *testing.T) {
	cfg := hybridConfig(40, 5, TenantConfig{Name: "a", QuotaPages: 24}, TenantConfig{Name: "b", QuotaPages: 16})
	p := newPool(t, cfg)
	spec := hybridSpec()
	groups := spec.Groups
	size := []int{40, 5 * groups[1].perLease(1<<20), 5}
	quota := map[string][]int{"a": {24, p.shareOf(&p.groups[1], 24), p.shareOf(&p.groups[2], 24)}, "b": {16, p.shareOf(&p.groups[1], 16), p.shareOf(&p.groups[2], 16)}}
	used := map[string][]int{"a": make([]int, 3), "b": make([]int, 3)}
	free := append([]int(nil), size...)
	need := func(tokens int) []int {
		return []int{spec.PagesFor(tokens), groups[1].perLease(tokens), groups[2].perLease(tokens)}
	}
	type held struct {
		l      *Lease
		tenant string
		need   []int
	}
	var live []held
	rng := rand.New(rand.NewPCG(3, 4))
	for step := range 3000 {
		if len(live) > 0 && rng.IntN(3) == 0 {
			i := rng.IntN(len(live))
			h := live[i]
			require.NoError(t, h.l.Release())
			for g := range 3 {
				free[g] += h.need[g]
				used[h.tenant][g] -= h.need[g]
			}
			live = append(live[:i], live[i+1:]...)
			continue
		}
		tn := []string{"a", "b"}[rng.IntN(2)]
		tokens := 1 + rng.IntN(40)
		n := need(tokens)
		fits := true
		for g := range 3 {
			if n[g] > free[g] || used[tn][g]+n[g] > quota[tn][g] {
				fits = false
			}
		}
		l, err := p.TryAdmit(Request{ID: fmt.Sprintf("r%d", step), Tenant: tn, PromptTokens: tokens})
		require.Equal(t, fits, err == nil, "step %d: tenant %s, %d tokens, need %v, free %v, used %v of %v: %v", step, tn, tokens, n, free, used[tn], quota[tn], err)
		if err == nil {
			for g := range 3 {
				free[g] -= n[g]
				used[tn][g] += n[g]
			}
			live = append(live, held{l, tn, n})
		}
		if step%97 == 0 {
			require.NoError(t, p.Check())
		}
	}
	require.NoError(t, p.Check())
}

// A Lease recycled from a pool of several groups into a pool of one (and
// back), as the C ABI recycles its lease structs, carries no scratch of
// the other pool's groups into its release.
func TestLeaseRecycledAcrossPoolsOfOtherGroups(t *testing.T) {
	hybrid := newPool(t, hybridConfig(16, 2))
	plain := newPool(t, tinyConfig(16))
	var l Lease
	for i, p := range []*Pool{hybrid, plain, hybrid, plain} {
		require.NoError(t, p.TryAdmitInto(Request{ID: fmt.Sprint("r", i), Tenant: "a", PromptTokens: 6}, &l))
		require.NoError(t, l.Release(), "round %d", i)
		require.NoError(t, p.Check())
	}
	for _, p := range []*Pool{hybrid, plain} {
		for _, g := range p.Stats().Groups {
			assert.Equal(t, g.Pages, g.Free, "group %q", g.Name)
		}
	}
}
