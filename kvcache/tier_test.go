package kvcache

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// tierConfig is tinyConfig with a host tier of slots slots.
func tierConfig(pages, slots int, tenants ...TenantConfig) Config {
	cfg := tinyConfig(pages, tenants...)
	cfg.HostTier = HostTierConfig{Pages: slots}
	return cfg
}

// tierTokens is a prompt of n tokens whose content depends on seed.
func tierTokens(seed, n int) []int32 {
	toks := make([]int32, n)
	for i := range toks {
		toks[i] = int32(seed*100_000 + i)
	}
	return toks
}

// kvWord is what the simulated engine writes over region r of the page
// holding tokens [i·tpp, (i+1)·tpp) of a prompt marked marker: its
// tenant's or domain's marker and the page, so that a page read back
// names whose KV it holds.
func kvWord(marker uint16, i, r int) uint32 {
	return uint32(marker)<<16 | uint32(i&0xfff)<<4 | uint32(r&0xf)
}

// writeKV writes pages [from, to) of l as the engine would compute them
// for a prompt marked marker.
func writeKV(t testing.TB, l *Lease, marker uint16, from, to int) {
	t.Helper()
	p := l.pool
	for i := from; i < to; i++ {
		for r := range p.groups[0].count {
			b := make([]byte, p.lay.regions[r].PageBytes)
			for off := 0; off < len(b); off += 4 {
				binary.LittleEndian.PutUint32(b[off:], kvWord(marker, i, r))
			}
			require.NoError(t, l.WritePage(p.groups[0].name, i, r, b))
		}
	}
}

// checkKV reads pages [from, to) of l back and requires them to hold what
// writeKV wrote for marker.
func checkKV(t testing.TB, l *Lease, marker uint16, from, to int) {
	t.Helper()
	p := l.pool
	for i := from; i < to; i++ {
		for r := range p.groups[0].count {
			b := make([]byte, p.lay.regions[r].PageBytes)
			require.NoError(t, l.ReadPage(p.groups[0].name, i, r, b))
			for off := 0; off < len(b); off += 4 {
				if got, want := binary.LittleEndian.Uint32(b[off:]), kvWord(marker, i, r); got != want {
					t.Fatalf("lease %q page %d region %d offset %d: %#x, want %#x (marker %#x)", l.ID(), i, r, off, got, want, marker)
				}
			}
		}
	}
}

// publishPrompt admits tokens for tenant as request id, computes them
// (writeKV with marker), publishes them and releases the lease.
func publishPrompt(t testing.TB, p *Pool, id, tenant string, tokens []int32, marker uint16) {
	t.Helper()
	l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: len(tokens), TokenIDs: tokens})
	require.NoError(t, err)
	writeKV(t, l, marker, l.HitTokens()/p.tpp, p.pagesFor(len(tokens)))
	require.NoError(t, l.Commit(len(tokens)))
	_, err = l.CachePrefix(len(tokens))
	require.NoError(t, err)
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())
}

// flushDevice admits and releases a request that needs every page of the
// pool, so that the device's cache is evicted (into the tier).
func flushDevice(t testing.TB, p *Pool, tenant string) {
	t.Helper()
	l, err := p.TryAdmit(Request{ID: "flush", Tenant: tenant, PromptTokens: p.Pages() * p.tpp})
	require.NoError(t, err)
	require.NoError(t, p.Check())
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())
}

func groupName(p *Pool) string { return p.groups[0].name }

func TestTierOffloadOnload(t *testing.T) {
	p := newPool(t, tierConfig(12, 16))
	toks := tierTokens(1, 8*4+1) // 8 full pages and one token: all 8 can be hits
	publishPrompt(t, p, "A", "a", toks, 0xa1)
	s := p.Stats()
	require.Equal(t, 8, s.CachedPages)
	require.True(t, s.Tier.Enabled)
	require.Equal(t, 16, s.Tier.Free)

	flushDevice(t, p, "a")
	s = p.Stats()
	assert.Equal(t, 0, s.CachedPages, "the device's cache was evicted")
	assert.Equal(t, 8, s.Tier.Cached, "into the tier")
	assert.Equal(t, uint64(8), s.Tier.Offloads)
	assert.Equal(t, uint64(8)*uint64(p.PageBytes()), s.Tier.OffloadBytes)
	assert.Equal(t, 8, s.Prefix.Domains[0].TierPages)

	// The same prompt again: all 8 pages come back from the tier, as hits,
	// each holding what was computed.
	l, err := p.TryAdmit(Request{ID: "A2", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(t, err)
	require.NoError(t, p.Check())
	assert.Equal(t, 32, l.HitTokens())
	checkKV(t, l, 0xa1, 0, 8)
	s = p.Stats()
	assert.Equal(t, uint64(8), s.Tier.Onloads)
	assert.Equal(t, uint64(8), s.Prefix.Domains[0].TierHitPages)
	assert.Equal(t, uint64(8), s.Prefix.Domains[0].HitPages-0, "tier hits are hits")
	assert.Equal(t, 8, s.Tier.Cached, "the tier keeps its copies")
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())

	// Onloaded pages are the device's cache again: the next admission
	// shares them without a copy.
	l, err = p.TryAdmit(Request{ID: "A3", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, 32, l.HitTokens())
	assert.Equal(t, uint64(8), p.Stats().Tier.Onloads, "no copy")
	checkKV(t, l, 0xa1, 0, 8)
	require.NoError(t, l.Release())

	// Another domain never sees them, on the device or in the tier.
	flushDevice(t, p, "a")
	l, err = p.TryAdmit(Request{ID: "B", Tenant: "b", PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, 0, l.HitTokens())
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())

	// Evicted again, the pages the tier holds need no copy.
	assert.Equal(t, uint64(8), p.Stats().Tier.Offloads)
}

func TestTierConfig(t *testing.T) {
	for name, c := range map[string]HostTierConfig{
		"both":          {Pages: 4, Bytes: 4096},
		"negative":      {Pages: -1},
		"bytes too few": {Bytes: 10},
	} {
		_, err := New(tierConfig(8, 0, TenantConfig{Name: "a"}).withTier(c))
		assert.ErrorIs(t, err, ErrInvalidConfig, name)
	}
	p := newPool(t, tierConfig(8, 0).withTier(HostTierConfig{Bytes: 10 * 256}))
	assert.Equal(t, 10, p.Stats().Tier.Slots)

	// A hybrid pool's tier keeps checkpoints: it must say how many, and
	// only it may.
	_, err := New(hybridConfig(16, 4).withTier(HostTierConfig{Pages: 4}))
	assert.ErrorIs(t, err, ErrInvalidConfig)
	assert.ErrorIs(t, err, ErrTierUnsupported, "a hybrid pool's tier without checkpoints")
	assert.ErrorContains(t, err, "set HostTier.Checkpoints")
	_, err = New(tierConfig(8, 4).withTier(HostTierConfig{Pages: 4, Checkpoints: 2}))
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = New(hybridConfig(16, 4).withTier(HostTierConfig{Checkpoints: 2}))
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = New(hybridConfig(16, 4).withTier(HostTierConfig{Pages: 4, Checkpoints: -1}))
	assert.ErrorIs(t, err, ErrInvalidConfig)
	ck := checkpointSlotBytes(hybridConfigLayout(t))
	_, err = New(hybridConfig(16, 4).withTier(HostTierConfig{Bytes: 3 * ck, Checkpoints: 3}))
	assert.ErrorIs(t, err, ErrInvalidConfig, "bytes for the checkpoints, none for a page")
	h := newPool(t, hybridConfig(16, 4).withTier(HostTierConfig{Bytes: 3*ck + 5*h0PageBytes(t), Checkpoints: 3}))
	s := h.Stats().Tier
	assert.Equal(t, 8, s.Slots)
	assert.Equal(t, 3, s.CheckpointSlots)
	assert.Equal(t, ck, s.CheckpointSlotBytes)
	require.NoError(t, h.Check())

	// A device that cannot copy pages to host memory has none.
	_, err = New(Config{Geometry: tinyGeometry, Pages: 8, MaxContextTokens: 32, Device: noHostCopy{cudaops.NewHost()},
		HostTier: HostTierConfig{Pages: 4}})
	assert.ErrorIs(t, err, ErrTierUnsupported)

	// A negative tier share is a bad tenant.
	_, err = New(tierConfig(8, 4, TenantConfig{Name: "a", TierPages: -1}))
	assert.ErrorIs(t, err, ErrInvalidTenant)
}

func (c Config) withTier(h HostTierConfig) Config {
	c.HostTier = h
	return c
}

// noHostCopy is a device without HostCopier.
type noHostCopy struct{ cudaops.Device }

var _ = errors.New
var _ = fmt.Sprint

// tierDevice is a Host whose copies to and from host memory a test can
// fail (all of it, or after half the pages) or hold until released.
type tierDevice struct {
	*cudaops.Host
	failToHost, failFromHost error
	halfway                  bool
	// hold, if set, stops the next copy at its entry: it sends on
	// entered, then waits for proceed.
	hold *fillGate
	// seen, if set, is told of every copy before it runs.
	seen func(c cudaops.HostCopy, toHost bool)
}

func (d *tierDevice) copy(c cudaops.HostCopy, toHost bool, run func(cudaops.HostCopy) error) error {
	if d.seen != nil {
		d.seen(c, toHost)
	}
	if g := d.hold; g != nil {
		d.hold = nil
		g.entered <- struct{}{}
		<-g.proceed
	}
	err := d.failFromHost
	if toHost {
		err = d.failToHost
	}
	if err == nil {
		return run(c)
	}
	if d.halfway && len(c.Pages) > 1 {
		half := c
		half.Pages, half.Slots = c.Pages[:len(c.Pages)/2], c.Slots[:len(c.Slots)/2]
		_ = run(half) // what a copy failing half-way leaves behind
	}
	return err
}

func (d *tierDevice) CopyToHost(c cudaops.HostCopy, after cudaops.Ordering) error {
	return d.copy(c, true, func(c cudaops.HostCopy) error { return d.Host.CopyToHost(c, after) })
}

func (d *tierDevice) CopyFromHost(c cudaops.HostCopy) error {
	return d.copy(c, false, d.Host.CopyFromHost)
}

func newTierDevicePool(t *testing.T, cfg Config) (*Pool, *tierDevice) {
	d := &tierDevice{Host: cudaops.NewHost()}
	t.Cleanup(func() { d.Host.Close() })
	cfg.Device = d
	return newPool(t, cfg), d
}

// tierSlotsSum requires the tier's slots to add up and returns its stats.
func tierSlotsSum(t testing.TB, p *Pool) TierStats {
	t.Helper()
	s := p.Stats().Tier
	require.Equal(t, s.Slots, s.Free+s.Cached+s.Swapped+s.Checkpoints+s.InFlight+s.Quarantined+s.Retired, "%+v", s)
	require.NoError(t, p.Check())
	return s
}

// A chain's pages go to adjacent slots in page order however the free
// slots lie (here after a clear freed them in LRU order, which reversed
// them on the free stack), so that an offload and an onload each copy
// the chain as one run per region.
func TestTierCopiesAdjacentSlots(t *testing.T) {
	p, d := newTierDevicePool(t, tierConfig(12, 16))
	toks := tierTokens(1, 8*4+1)
	var copies []cudaops.HostCopy
	d.seen = func(c cudaops.HostCopy, _ bool) {
		copies = append(copies, cudaops.HostCopy{Pages: slices.Clone(c.Pages), Slots: slices.Clone(c.Slots)})
	}
	oneRun := func(c cudaops.HostCopy) {
		t.Helper()
		require.Len(t, c.Pages, 8)
		for i := 1; i < len(c.Pages); i++ {
			require.Equal(t, c.Pages[i-1]+1, c.Pages[i], "pages %v", c.Pages)
			require.Equal(t, c.Slots[i-1]+1, c.Slots[i], "pages %v into slots %v", c.Pages, c.Slots)
		}
	}
	for round := range 3 {
		copies = copies[:0]
		publishPrompt(t, p, "A", "a", toks, 0xa1)
		flushDevice(t, p, "a")
		l, err := p.TryAdmit(Request{ID: "A2", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
		require.NoError(t, err)
		require.Equal(t, 32, l.HitTokens(), "round %d", round)
		checkKV(t, l, 0xa1, 0, 8)
		require.NoError(t, l.Release())
		require.Len(t, copies, 2, "an offload and an onload")
		oneRun(copies[0])
		oneRun(copies[1])
		require.NoError(t, p.ClearPrefixCache())
		tierSlotsSum(t, p)
	}
}

func TestTierEvents(t *testing.T) {
	cfg := tierConfig(8, 8)
	cfg.Prefix = PrefixConfig{EventBuffer: 256, EventTokens: true}
	p := newPool(t, cfg)
	toks := tierTokens(2, 3*4+1)
	// Under an adapter, which every event of the pages names.
	const lora = "lora-7"
	l, err := p.TryAdmit(Request{ID: "A", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks, Adapter: lora})
	require.NoError(t, err)
	require.NoError(t, l.Commit(len(toks)))
	_, err = l.CachePrefix(len(toks))
	require.NoError(t, err)
	require.NoError(t, l.Release())
	next := func() KVEvent {
		t.Helper()
		select {
		case ev := <-p.Events():
			return ev
		default:
			t.Fatal("no event")
			return KVEvent{}
		}
	}
	ev := next()
	require.Equal(t, KVStored, ev.Kind)
	require.Equal(t, MediumDevice, ev.Medium)
	require.Equal(t, lora, ev.Adapter)
	keys := ev.Keys
	require.Len(t, keys, 3)

	// Evicted into the tier: stored there first (one event: the pages
	// chain), then removed from the device, so that a router always
	// finds a page's parent somewhere.
	flushDevice(t, p, "a")
	ev = next()
	require.Equal(t, KVStored, ev.Kind)
	require.Equal(t, MediumHost, ev.Medium)
	require.Equal(t, "tenant:a", ev.Domain)
	assert.Equal(t, lora, ev.Adapter)
	assert.Equal(t, keys, ev.Keys)
	assert.True(t, ev.Parent.IsZero())
	assert.Equal(t, toks[:12], ev.TokenIDs)
	ev = next()
	assert.Equal(t, KVRemoved, ev.Kind)
	assert.Equal(t, MediumDevice, ev.Medium)
	assert.ElementsMatch(t, keys, ev.Keys)

	// Onloaded: stored on the device again.
	l, err = p.TryAdmit(Request{ID: "A2", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks, Adapter: lora})
	require.NoError(t, err)
	require.Equal(t, 12, l.HitTokens())
	ev = next()
	assert.Equal(t, KVStored, ev.Kind)
	assert.Equal(t, MediumDevice, ev.Medium)
	assert.Equal(t, lora, ev.Adapter)
	assert.Equal(t, keys, ev.Keys, "one event: the pages chain")
	assert.Equal(t, toks[:12], ev.TokenIDs)
	require.NoError(t, l.Release())

	// A clear covers both.
	require.NoError(t, p.ClearPrefixCache())
	var kinds []KVEventKind
	for {
		select {
		case ev := <-p.Events():
			kinds = append(kinds, ev.Kind)
			continue
		default:
		}
		break
	}
	assert.Contains(t, kinds, KVCleared)
	s := tierSlotsSum(t, p)
	assert.Equal(t, 8, s.Free, "a clear empties the tier, its slots filled")
	assert.Equal(t, uint64(3), s.ScrubbedSlots)
}

func TestTierEvictionAndShares(t *testing.T) {
	// Four slots: a's share is 2, b sets none.
	p := newPool(t, tierConfig(8, 4, TenantConfig{Name: "a", TierPages: 2}, TenantConfig{Name: "b"}))
	ta, tb := tierTokens(3, 3*4+1), tierTokens(4, 2*4+1)
	publishPrompt(t, p, "B", "b", tb, 0xb4)
	flushDevice(t, p, "b")
	s := tierSlotsSum(t, p)
	require.Equal(t, 2, s.Cached)

	// a's three pages go in, but a keeps two at most: its own least
	// recently used one goes, never b's.
	publishPrompt(t, p, "A", "a", ta, 0xa3)
	flushDevice(t, p, "b")
	s = tierSlotsSum(t, p)
	assert.Equal(t, 4, s.Cached)
	doms := p.Stats().Prefix.Domains
	require.Equal(t, "tenant:a", doms[0].Name)
	assert.Equal(t, 2, doms[0].TierPages)
	assert.Equal(t, 2, doms[0].TierBound)
	assert.Equal(t, 2, doms[1].TierPages)
	assert.Equal(t, 4, doms[1].TierBound)
	l, err := p.TryAdmit(Request{ID: "B2", Tenant: "b", PromptTokens: len(tb), TokenIDs: tb})
	require.NoError(t, err)
	assert.Equal(t, 8, l.HitTokens(), "b's pages are all there")
	checkKV(t, l, 0xb4, 0, 2)
	require.NoError(t, l.Release())

	// b, unbounded, takes the whole tier by LRU: its new pages evict a's.
	tb2 := tierTokens(5, 4*4+1)
	publishPrompt(t, p, "B3", "b", tb2, 0xb5)
	flushDevice(t, p, "a")
	s = tierSlotsSum(t, p)
	assert.Equal(t, 4, s.Cached)
	assert.Positive(t, s.EvictedSlots)
	doms = p.Stats().Prefix.Domains
	assert.Equal(t, 0, doms[0].TierPages, "a's least recently used pages went")

	// Lowering a's share bounds it from its next offload on.
	require.NoError(t, p.UpdateTenant(TenantConfig{Name: "a", TierPages: 1}))
	publishPrompt(t, p, "A2", "a", ta, 0xa3)
	flushDevice(t, p, "b")
	doms = p.Stats().Prefix.Domains
	assert.LessOrEqual(t, doms[0].TierPages, 1)
	tierSlotsSum(t, p)
}

func TestTierFullMidOffload(t *testing.T) {
	// Six cached pages evicted at once into a tier of four: four go in,
	// two are dropped, counted; nothing is lost.
	p := newPool(t, tierConfig(8, 4))
	toks := tierTokens(6, 6*4+1)
	publishPrompt(t, p, "A", "a", toks, 0xa6)
	flushDevice(t, p, "a")
	s := tierSlotsSum(t, p)
	assert.Equal(t, 4, s.Cached)
	assert.Equal(t, uint64(4), s.Offloads)
	assert.Equal(t, uint64(2), s.OffloadsDropped)
	// Pages 0-3 made it (the tier takes the lowest device pages first,
	// which here are the prompt's first).
	l, err := p.TryAdmit(Request{ID: "A2", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, 16, l.HitTokens())
	checkKV(t, l, 0xa6, 0, 4)
	require.NoError(t, l.Release())
	tierSlotsSum(t, p)
}

// The host tier's fields keep cacheEntry within its size class of whole
// cache lines (see cacheEntrySize).
func TestCacheEntrySize(t *testing.T) {
	assert.LessOrEqual(t, unsafe.Sizeof(cacheEntry{}), uintptr(cacheEntrySize))
}
