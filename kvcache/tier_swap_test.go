package kvcache

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// onDemandTier is a pool of pages pages, tier slots, whose leases grow.
func onDemandTier(pages, slots int, tenants ...TenantConfig) Config {
	cfg := tierConfig(pages, slots, tenants...)
	cfg.Sizing = Sizing{Mode: SizeOnDemand, HeadroomTokens: 4}
	return cfg
}

// running admits id for tenant with prompt tokens, computes them, and
// generates until written tokens are written (their KV marked marker).
func running(t testing.TB, p *Pool, id, tenant string, prompt []int32, written int, marker uint16) *Lease {
	t.Helper()
	l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: len(prompt), MaxNewTokens: 20, TokenIDs: prompt})
	require.NoError(t, err)
	require.NoError(t, l.TryGrow(written-len(prompt)))
	writeKV(t, l, marker, l.HitTokens()/p.tpp, p.pagesFor(written))
	require.NoError(t, l.Commit(written))
	return l
}

func TestTierSwap(t *testing.T) {
	p := newPool(t, onDemandTier(16, 8))
	prompt := tierTokens(10, 10)
	all := tierTokens(10, 14) // the prompt, then four generated tokens
	l := running(t, p, "R", "a", prompt, 14, 0xd1)
	kept, err := l.Preempt(all)
	require.NoError(t, err)
	assert.Equal(t, 14, kept, "three full pages published, the fourth swapped")
	s := tierSlotsSum(t, p)
	assert.Equal(t, uint64(1), s.SwapsOut)
	assert.Equal(t, uint64(1), s.SwapOutPages)
	assert.Equal(t, 1, s.Swapped)

	// Admitted again with everything it wrote: the full pages are hits,
	// the last comes back from the tier, and prefill starts at the last
	// token, whose logits the engine needs.
	l, err = p.TryAdmit(Request{ID: "R", Tenant: "a", PromptTokens: 14, MaxNewTokens: 50, TokenIDs: all})
	require.NoError(t, err)
	assert.Equal(t, 13, l.HitTokens())
	checkKV(t, l, 0xd1, 0, 4)
	s = tierSlotsSum(t, p)
	assert.Equal(t, uint64(1), s.SwapsIn)
	assert.Equal(t, 0, s.Swapped, "a swap is used once")
	// Its pages are its own: the restored page takes writes.
	require.NoError(t, l.Commit(14))
	require.NoError(t, l.Release())
	audit(t, p)
}

func TestTierSwapWithoutPrefixCache(t *testing.T) {
	cfg := onDemandTier(16, 8)
	cfg.Prefix.Disable = true
	p := newPool(t, cfg)
	prompt, all := tierTokens(11, 9), tierTokens(11, 11)
	l := running(t, p, "R", "a", prompt, 11, 0xd2)
	kept, err := l.Preempt(all)
	require.NoError(t, err)
	assert.Equal(t, 11, kept, "every written page swapped")
	assert.Equal(t, uint64(3), p.Stats().Tier.SwapOutPages)
	l, err = p.TryAdmit(Request{ID: "R", Tenant: "a", PromptTokens: 11, MaxNewTokens: 50, TokenIDs: all})
	require.NoError(t, err)
	assert.Equal(t, 10, l.HitTokens())
	checkKV(t, l, 0xd2, 0, 3)
	require.NoError(t, l.Release())
	audit(t, p)
}

// A swap comes back only for the same request of the same tenant, in
// the same domain, with the same tokens; one that does not fit is
// dropped, its slots filled, and nothing of it is served.
func TestTierSwapIsolation(t *testing.T) {
	for name, c := range map[string]struct {
		req   Request
		moveA string
	}{
		"other tokens":      {req: Request{ID: "R", Tenant: "a", TokenIDs: tierTokens(99, 14)}},
		"other tenant":      {req: Request{ID: "R", Tenant: "a2", TokenIDs: tierTokens(12, 14)}},
		"other adapter":     {req: Request{ID: "R", Tenant: "a", TokenIDs: tierTokens(12, 14), Adapter: "lora"}},
		"moved domain":      {req: Request{ID: "R", Tenant: "a", TokenIDs: tierTokens(12, 14)}, moveA: "elsewhere"},
		"shorter prompt":    {req: Request{ID: "R", Tenant: "a", TokenIDs: tierTokens(12, 13)}},
		"other request":     {req: Request{ID: "S", Tenant: "a", TokenIDs: tierTokens(12, 14)}},
		"other tokens, key": {req: Request{ID: "R", Tenant: "a", TokenIDs: append(tierTokens(12, 13), 7)}},
	} {
		t.Run(name, func(t *testing.T) {
			p := newPool(t, onDemandTier(16, 8, TenantConfig{Name: "a", Domain: "shared"}, TenantConfig{Name: "a2", Domain: "shared"}))
			l := running(t, p, "R", "a", tierTokens(12, 10), 14, 0xd3)
			kept, err := l.Preempt(tierTokens(12, 14))
			require.NoError(t, err)
			require.Equal(t, 14, kept)
			if c.moveA != "" {
				require.NoError(t, p.UpdateTenant(TenantConfig{Name: "a", Domain: c.moveA}))
			}
			req := c.req
			req.PromptTokens, req.MaxNewTokens = len(req.TokenIDs), 40
			l, err = p.TryAdmit(req)
			require.NoError(t, err)
			assert.LessOrEqual(t, l.HitTokens(), 12, "at most the published pages, never the swap")
			s := p.Stats().Tier
			assert.Equal(t, uint64(0), s.SwapsIn)
			require.NoError(t, l.Release())
			audit(t, p)
		})
	}
}

func TestTierSwapRefused(t *testing.T) {
	t.Run("no room", func(t *testing.T) {
		p := newPool(t, onDemandTier(16, 1))
		cfg := p.Stats()
		require.Equal(t, 1, cfg.Tier.Slots)
		// Two private pages to swap (prefix caching off), one slot.
		p2 := newPool(t, func() Config { c := onDemandTier(16, 1); c.Prefix.Disable = true; return c }())
		l := running(t, p2, "R", "a", tierTokens(13, 5), 7, 0xd4)
		kept, err := l.Preempt(tierTokens(13, 7))
		require.NoError(t, err)
		assert.Equal(t, 0, kept, "never a partial swap presented as whole")
		s := tierSlotsSum(t, p2)
		assert.Equal(t, uint64(1), s.SwapsFull)
		assert.Equal(t, 1, s.Free)
		audit(t, p2)
	})
	t.Run("copy fails", func(t *testing.T) {
		p, d := newTierDevicePool(t, onDemandTier(16, 8))
		l := running(t, p, "R", "a", tierTokens(14, 10), 14, 0xd5)
		d.failToHost, d.halfway = errors.New("DMA error"), true
		kept, err := l.Preempt(tierTokens(14, 14))
		require.NoError(t, err, "the preemption itself succeeds")
		assert.Equal(t, 12, kept, "what the prefix cache holds")
		s := tierSlotsSum(t, p)
		assert.Equal(t, uint64(1), s.SwapsFailed)
		assert.Equal(t, 0, s.Swapped)
		d.failToHost = nil
		l, err = p.TryAdmit(Request{ID: "R", Tenant: "a", PromptTokens: 14, MaxNewTokens: 40, TokenIDs: tierTokens(14, 14)})
		require.NoError(t, err)
		assert.Equal(t, 12, l.HitTokens())
		require.NoError(t, l.Release())
		audit(t, p)
	})
	t.Run("swap back fails", func(t *testing.T) {
		p, d := newTierDevicePool(t, onDemandTier(16, 8))
		l := running(t, p, "R", "a", tierTokens(15, 10), 14, 0xd6)
		_, err := l.Preempt(tierTokens(15, 14))
		require.NoError(t, err)
		d.failFromHost = errors.New("DMA error")
		_, err = p.TryAdmit(Request{ID: "R", Tenant: "a", PromptTokens: 14, MaxNewTokens: 40, TokenIDs: tierTokens(15, 14)})
		require.ErrorIs(t, err, ErrOnloadFailed)
		assert.Equal(t, 0, p.Stats().Tier.Swapped, "a swap whose copy back failed is dropped")
		audit(t, p)
		d.failFromHost = nil
		l, err = p.TryAdmit(Request{ID: "R", Tenant: "a", PromptTokens: 14, MaxNewTokens: 40, TokenIDs: tierTokens(15, 14)})
		require.NoError(t, err)
		assert.Equal(t, 12, l.HitTokens())
		require.NoError(t, l.Release())
		audit(t, p)
	})
	t.Run("NoSwap", func(t *testing.T) {
		cfg := onDemandTier(16, 8)
		cfg.HostTier.NoSwap = true
		p := newPool(t, cfg)
		l := running(t, p, "R", "a", tierTokens(16, 10), 14, 0xd7)
		kept, err := l.Preempt(tierTokens(16, 14))
		require.NoError(t, err)
		assert.Equal(t, 12, kept)
		assert.Equal(t, uint64(0), p.Stats().Tier.SwapsOut)
	})
}

// Isolation of cached pages in the tier: crafted keys (another domain's)
// and colliding keys (another key with the same index) never reach them,
// and a tenant moved to another domain while its pages sit in the tier
// does not see them until it moves back.
func TestTierIsolation(t *testing.T) {
	p := newPool(t, tierConfig(8, 8))
	toks := tierTokens(17, 4*4+1)
	publishPrompt(t, p, "A", "a", toks, 0xa9)
	keys, err := p.PageKeys("a", "", toks, nil)
	require.NoError(t, err)
	flushDevice(t, p, "b")
	require.Equal(t, 4, p.Stats().Tier.Cached)

	hits := func(req Request) int {
		t.Helper()
		req.PromptTokens = len(toks)
		l, err := p.TryAdmit(req)
		require.NoError(t, err)
		h := l.HitTokens()
		require.NoError(t, l.Release())
		require.NoError(t, p.Check())
		return h
	}
	// a's own keys, given by b: b's domain holds none of them.
	assert.Equal(t, 0, hits(Request{ID: "crafted", Tenant: "b", PageKeys: keys}))
	// Keys of b's domain that fall into the same buckets as a's.
	p.mu.Lock()
	a, _ := p.tenantsLocked().Lookup("a")
	b, _ := p.tenantsLocked().Lookup("b")
	p.mu.Unlock()
	colliding := make([]BlockKey, len(keys))
	for i, k := range keys {
		c := k
		c[31] ^= 1 // another key
		// … whose index in b's domain is k's in a's.
		x := k.index64(uint32(a.Domain.ID)) ^ uint64(b.Domain.ID)*0x9e3779b97f4a7c15
		for j := range 8 {
			c[j] = byte(x >> (8 * j))
		}
		require.Equal(t, k.index64(uint32(a.Domain.ID)), c.index64(uint32(b.Domain.ID)))
		colliding[i] = c
	}
	assert.Equal(t, 0, hits(Request{ID: "colliding", Tenant: "b", PageKeys: colliding}))
	// a's tokens under b, by tokens.
	assert.Equal(t, 0, hits(Request{ID: "tokens", Tenant: "b", TokenIDs: toks}))
	assert.Equal(t, 4, p.Stats().Tier.Cached, "none of it onloaded")

	// a moves to another domain: its pages stay where they are, out of
	// its reach.
	require.NoError(t, p.UpdateTenant(TenantConfig{Name: "a", Domain: "other"}))
	assert.Equal(t, 0, hits(Request{ID: "moved", Tenant: "a", TokenIDs: toks}))
	require.NoError(t, p.UpdateTenant(TenantConfig{Name: "a"}))
	flushDevice(t, p, "b")
	assert.Equal(t, 16, hits(Request{ID: "back", Tenant: "a", TokenIDs: toks}))
	audit(t, p)
}
