package kvcache

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A growth first tries growFastLocked, which grants only what needs no
// claim, eviction, canary check or refusal. These are the growths it must
// hand to the general path, each one a way a shortcut could leak or lose a
// page.

// nextFree is the page the pool's next allocation takes.
func nextFree(p *Pool) int32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.groups[0].alloc.PeekFree(nil, 1)[0]
}

func TestGrowthIntoAFreePageWrittenAfterFreeIsCaught(t *testing.T) {
	cfg := tinyConfig(8)
	cfg.Scrub = ScrubPolicy{Kind: ScrubCanary}
	cfg.Sizing = onDemand(0)
	p := newPool(t, cfg)
	h := hostOf(t, p)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 4, MaxNewTokens: 16})
	require.NoError(t, err)
	next := nextFree(p)
	h.PageBytes(1, next)[3] ^= 0xff // a stale writer touches the page the growth would take

	err = l.TryGrow(8) // room for 8 tokens from none written: one page more
	require.ErrorIs(t, err, ErrCanaryMismatch, "the growth verified the page it was about to take")
	require.ErrorIs(t, err, ErrPoolFaulted)
	assert.Equal(t, 1, l.Pages(), "nothing was granted")
	assert.NotContains(t, tableOf(t, l), next)
	s := p.Stats()
	assert.Equal(t, uint64(1), s.Scrub.CanaryFailures)
	assert.Equal(t, 1, s.RetiredPages)
	require.NoError(t, p.Check())
}

func TestGrowthOfAFaultedPoolIsRefused(t *testing.T) {
	dev := newScripted()
	cfg := tinyConfig(8)
	cfg.Device = dev
	cfg.Sizing = onDemand(0)
	p := newPool(t, cfg)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 4, MaxNewTokens: 16})
	require.NoError(t, err)
	victim := admit(t, p, "victim", "b", 4)
	dev.mu.failNext = errors.New("device lost")
	require.ErrorIs(t, victim.Release(), ErrPoolFaulted)
	free := p.Stats().FreePages
	require.Positive(t, free, "free pages remain: only the fault refuses")

	require.ErrorIs(t, l.TryGrow(8), ErrPoolFaulted)
	assert.Equal(t, 1, l.Pages())
	assert.Equal(t, free, p.Stats().FreePages)
	require.NoError(t, p.Check())
	p.ClearFault()
	require.NoError(t, l.TryGrow(8))
	assert.Equal(t, 2, l.Pages())
}

func TestGrowthIntoTheCacheScrubsTheEvictedPageFirst(t *testing.T) {
	cfg := tinyConfig(4)
	cfg.Sizing = onDemand(0)
	p := newPool(t, cfg)
	h := hostOf(t, p)
	// Two pages of tenant b's prompt stay cached after its release.
	cached := admitComputeCache(t, p, "cached", "b", tokens(8, 0, 7), 0)
	markWith(t, h, cached, 0x5b)
	was := tableOf(t, cached)
	require.NoError(t, cached.Release())
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 8, MaxNewTokens: 8})
	require.NoError(t, err)
	require.Zero(t, p.Stats().FreePages, "only cached pages are left")

	require.NoError(t, l.TryGrow(12), "the growth evicts what it needs")
	require.Equal(t, 3, l.Pages())
	grown := tableOf(t, l)[2]
	assert.Contains(t, was, grown, "the grown page was tenant b's")
	require.NoError(t, expectScrubbed(p, h, l), "and holds nothing of it")
	require.NoError(t, p.Check())
}

func TestGrowthPastAnotherTenantsReservationIsRefused(t *testing.T) {
	cfg := tinyConfig(8, TenantConfig{Name: "a"}, TenantConfig{Name: "b", ReservedPages: 4})
	cfg.Sizing = onDemand(0)
	p := newPool(t, cfg)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 16, MaxNewTokens: 16})
	require.NoError(t, err)
	require.Equal(t, 4, p.Stats().FreePages, "free, but b's")

	err = l.TryGrow(20)
	require.ErrorIs(t, err, ErrPoolExhausted)
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, 4, l.Pages())
	assert.Equal(t, 4, p.Stats().FreePages)
	require.NoError(t, p.Check())
}
