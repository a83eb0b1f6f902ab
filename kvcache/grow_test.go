package kvcache

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/isolation"
)

// onDemand is a sizing that reserves the prompt plus headroom tokens.
func onDemand(headroom int) Sizing { return Sizing{Mode: SizeOnDemand, HeadroomTokens: headroom} }

func onDemandPool(t testing.TB, pages int, headroom int, watermark float64, tenants ...TenantConfig) *Pool {
	t.Helper()
	cfg := tinyConfig(pages, tenants...)
	cfg.Sizing = onDemand(headroom)
	cfg.GrowthWatermark = watermark
	return newPool(t, cfg)
}

func TestOnDemandAdmitsThePromptAndItsHeadroom(t *testing.T) {
	p := onDemandPool(t, 32, 6, 0)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 10, MaxNewTokens: 100})
	require.NoError(t, err)
	assert.Equal(t, 4, l.Pages(), "10 prompt + 6 headroom tokens at 4 per page")
	assert.Equal(t, 16, l.CapacityTokens())

	// Overrides: a tenant's sizing over the pool's, a request's over both.
	require.NoError(t, p.UpdateTenant(TenantConfig{Name: "b", Sizing: Sizing{Mode: SizeFull}}))
	full, err := p.TryAdmit(Request{ID: "f", Tenant: "b", PromptTokens: 10, MaxNewTokens: 30})
	require.NoError(t, err)
	assert.Equal(t, 10, full.Pages())
	own, err := p.TryAdmit(Request{ID: "o", Tenant: "b", PromptTokens: 10, MaxNewTokens: 30, Sizing: onDemand(0)})
	require.NoError(t, err)
	assert.Equal(t, 3, own.Pages(), "the prompt alone")
	require.NoError(t, p.Check())
}

// The incident's door: a prompt is admitted whole or not at all, whatever
// the sizing; growth never applies to it.
func TestOnDemandNeverAdmitsPartOfAPrompt(t *testing.T) {
	cfg := tinyConfig(16, TenantConfig{Name: "a", QuotaPages: 8}, TenantConfig{Name: "b"})
	cfg.Sizing, cfg.MaxContextTokens, cfg.AllowUndersizedPool = onDemand(4), 100, true
	p := newPool(t, cfg)
	st := state(p)
	for _, tc := range []struct {
		req  Request
		want error
	}{
		{Request{ID: "long", Tenant: "b", PromptTokens: 101, MaxNewTokens: 0}, ErrExceedsMaxContext},
		{Request{ID: "over", Tenant: "b", PromptTokens: 65, MaxNewTokens: 30}, ErrExceedsCapacity},
		{Request{ID: "quota", Tenant: "a", PromptTokens: 33}, ErrExceedsQuota},
	} {
		_, err := p.TryAdmit(tc.req)
		require.ErrorIs(t, err, tc.want, "%+v", tc.req)
	}
	assert.Equal(t, st, state(p))
}

func TestGrowAddsPagesAllOrNothing(t *testing.T) {
	p := onDemandPool(t, 16, 0, 0, TenantConfig{Name: "a", QuotaPages: 10}, TenantConfig{Name: "b"})
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 8, MaxNewTokens: 40})
	require.NoError(t, err)
	require.Equal(t, 2, l.Pages())
	require.NoError(t, l.Commit(8))
	assert.ErrorIs(t, l.Commit(9), ErrInvalidArgument, "no commit past the capacity")
	_, err = l.SlotMapping(8, 9, nil)
	assert.ErrorIs(t, err, ErrInvalidArgument, "no slot beyond the lease's pages")

	require.NoError(t, l.TryGrow(5)) // room for 13: 4 pages
	assert.Equal(t, 4, l.Pages())
	table, _ := l.BlockTable()
	assert.Len(t, table, 4)
	slots, err := l.SlotMapping(8, 13, nil)
	require.NoError(t, err)
	for i, s := range slots {
		tok := 8 + i
		assert.Equal(t, int64(table[tok/4])*4+int64(tok%4), s)
	}
	require.NoError(t, l.Commit(13))
	require.NoError(t, l.TryGrow(3), "room enough already: nothing added")
	assert.Equal(t, 4, l.Pages())
	require.NoError(t, p.Check())

	// Refusals name the numbers and change nothing.
	other := admit(t, p, "hog", "b", 40) // 10 of the 12 free
	st := state(p)
	err = l.TryGrow(16) // 29 tokens: 8 pages, 4 more
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, ErrPoolExhausted, ae.Err)
	assert.Equal(t, 4, ae.Need)
	assert.Equal(t, 2, ae.Have)
	assert.Equal(t, "r", ae.RequestID)
	assert.Equal(t, st, state(p))
	require.NoError(t, other.Release())

	err = l.TryGrow(27) // 13 + 27 = 40 tokens: 10 pages, the quota exactly
	require.NoError(t, err)
	require.NoError(t, l.Commit(40))
	err = l.TryGrow(9) // 49 tokens: past prompt + max new tokens
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, ErrExceedsMaxContext, ae.Err)
	assert.Equal(t, 48, ae.Limit)
	assert.ErrorIs(t, l.TryGrow(-1), ErrInvalidArgument)
	s := p.Stats()
	assert.Equal(t, uint64(2), s.Growth.Grown)
	assert.Equal(t, uint64(8), s.Growth.PagesGrown)
	assert.Equal(t, uint64(1), s.Growth.Refused.PoolExhausted)
	assert.Equal(t, uint64(1), s.Growth.Refused.ExceedsContext)
	assert.Zero(t, s.Refused.Total(), "growth refusals are not admission refusals")
	require.NoError(t, p.Check())
}

func TestGrowQuotaBindsAndWaits(t *testing.T) {
	p := onDemandPool(t, 32, 0, 0, TenantConfig{Name: "a", QuotaPages: 6}, TenantConfig{Name: "b"})
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 8, MaxNewTokens: 40})
	require.NoError(t, err)
	require.NoError(t, l.Commit(8))
	other := admit(t, p, "q", "a", 16) // a holds all 6 of its quota
	var ae *AdmissionError
	require.ErrorAs(t, l.TryGrow(1), &ae)
	assert.Equal(t, ErrExceedsQuota, ae.Err)
	assert.True(t, ae.Retryable())
	require.ErrorAs(t, l.TryGrow(5*4), &ae)
	assert.Equal(t, ErrExceedsQuota, ae.Err)
	assert.True(t, ae.Permanent(), "7 pages never fit a quota of 6")

	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		done <- l.Grow(ctx, 1)
	}()
	time.Sleep(10 * time.Millisecond)
	require.NoError(t, other.Release())
	require.NoError(t, <-done, "the tenant's release woke the growth")
	assert.Equal(t, 3, l.Pages())
	require.NoError(t, p.Check())
}

// The watermark keeps pages from new admissions for the growth of running
// leases; a growth passes it, and passes the admissions waiting in line.
func TestGrowthWatermarkKeepsPagesForRunningLeases(t *testing.T) {
	p := onDemandPool(t, 16, 0, 0.25, TenantConfig{Name: "a"}, TenantConfig{Name: "b"})
	l, err := p.TryAdmit(Request{ID: "run", Tenant: "a", PromptTokens: 4, MaxNewTokens: 40}) // 1 page
	require.NoError(t, err)
	require.NoError(t, l.Commit(4))
	admit(t, p, "fill", "b", 11*4) // 11 more: 4 free, all kept
	_, err = p.TryAdmit(Request{ID: "x", Tenant: "b", PromptTokens: 1})
	require.ErrorIs(t, err, ErrPoolExhausted)
	require.ErrorIs(t, err, ErrKeptForGrowth)
	got := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := p.Admit(ctx, Request{ID: "w", Tenant: "b", PromptTokens: 1})
		got <- err
	}()
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.mu.poolWaiters == 1
	}, 5*time.Second, time.Millisecond)
	require.NoError(t, l.TryGrow(3*4), "the kept pages are for growth, queue or no queue")
	assert.Equal(t, 4, l.Pages())
	require.NoError(t, l.Release()) // 4 back: 3 of 16 kept, the waiter fits
	require.NoError(t, <-got)
	require.NoError(t, p.Check())
}

// Growth and preemption of a request whose pages are published: its
// next admission shares every full page it had written.
// grownLease admits a request of a 10-token prompt, with its token IDs,
// into an on-demand pool of 32 pages and has it generate 9 tokens, growing
// and committing as it goes: 19 tokens written, 5 pages. It returns the
// pool, the lease and the IDs of the tokens written.
func grownLease(t *testing.T) (*Pool, *Lease, []int32) {
	t.Helper()
	cfg := Config{Geometry: prefixGeometry, Pages: 32, MaxContextTokens: 32 * prefixTPP,
		Tenants: []TenantConfig{{Name: "a"}}, Sizing: onDemand(0)}
	p := newPool(t, cfg)
	prompt := tokens(10, 0, 1)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: len(prompt), MaxNewTokens: 40, TokenIDs: prompt})
	require.NoError(t, err)
	require.NoError(t, l.Commit(10))
	all := append(append([]int32(nil), prompt...), tokens(9, 0, 2)...)
	for n := 11; n <= len(all); n++ {
		require.NoError(t, l.TryGrow(1))
		require.NoError(t, l.Commit(n))
	}
	require.Equal(t, 5, l.Pages())
	return p, l, all
}

func TestPreemptKeepsWhatWasComputedForReadmission(t *testing.T) {
	p, l, all := grownLease(t)
	host := hostOf(t, p)
	markWith(t, host, l, 0x3c)
	before := leaseBytes(t, host, p.geom.Regions(), l, 4)

	_, err := l.Preempt(all[:5])
	require.ErrorIs(t, err, ErrInvalidArgument, "token IDs must be what is written")
	kept, err := l.Preempt(all)
	require.NoError(t, err)
	assert.Equal(t, 4*prefixTPP, kept, "19 tokens: 4 full pages")
	assert.False(t, l.Live())
	assert.Equal(t, PhaseReleased, l.Phase())
	s := p.Stats()
	assert.Equal(t, 4, s.CachedPages)
	assert.Equal(t, uint64(1), s.Growth.Preempted)

	again, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: len(all), MaxNewTokens: 40 - 9, TokenIDs: all})
	require.NoError(t, err)
	assert.Equal(t, 4*prefixTPP, again.HitTokens())
	assert.Equal(t, before, leaseBytes(t, host, p.geom.Regions(), again, 4), "the same KV, not recomputed")
	require.NoError(t, p.Check())
}

// Growth under the canary policy: every page a lease grows into holds the
// scrub pattern and nothing of the tenants that held it before.
func TestGrownPagesHoldOnlyTheScrubPattern(t *testing.T) {
	g := tinyGeometry
	policy := ScrubPolicy{Kind: ScrubCanary}
	p := newPool(t, Config{Geometry: g, Pages: 24, MaxContextTokens: 24 * 4, Scrub: policy,
		Device: canaryDevice(t, g, 24, policy), Sizing: onDemand(0),
		Tenants: []TenantConfig{{Name: "a"}, {Name: "b"}, {Name: "c"}}})
	host := hostOf(t, p)
	rng := rand.New(rand.NewPCG(4, 2))
	live := map[string]*Lease{}
	seen := map[int32]bool{}
	for step := range 600 {
		id := fmt.Sprintf("r%d", rng.IntN(8))
		if l, ok := live[id]; ok {
			switch rng.IntN(3) {
			case 0:
				require.NoError(t, l.Release())
				delete(live, id)
			default:
				before := l.Pages()
				if err := l.TryGrow(rng.IntN(9)); err != nil {
					require.ErrorIs(t, err, ErrPoolExhausted, "step %d", step)
					require.Equal(t, before, l.Pages())
					break
				}
				table, _ := l.BlockTable()
				for _, page := range table[before:] {
					for r, reg := range host.Regions() {
						want := bytes.Repeat(wordLE(p.q.Spec().WordFor(page)), int(reg.PageBytes/4))
						require.Equal(t, want, host.PageBytes(r, page), "step %d: grown page %d region %d", step, page, r)
					}
					seen[page] = true
				}
				markWith(t, host, l, byte(0x40+len(id))) // the tenant writes its KV into every page
			}
			continue
		}
		tenant := []string{"a", "b", "c"}[rng.IntN(3)]
		l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: 1 + rng.IntN(12), MaxNewTokens: 40})
		if err != nil {
			require.ErrorIs(t, err, ErrPoolExhausted, "step %d", step)
			continue
		}
		require.NoError(t, expectScrubbed(p, host, l), "step %d", step)
		markWith(t, host, l, byte(0x20+len(id)))
		live[id] = l
		require.NoError(t, p.Check(), "step %d", step)
	}
	assert.Greater(t, len(seen), 12, "growth reused pages")
	assert.Zero(t, p.Stats().Scrub.CanaryFailures)
}

func TestBadSizingIsRefused(t *testing.T) {
	cfg := tinyConfig(8)
	cfg.Sizing = Sizing{Mode: SizeFull, HeadroomTokens: 4}
	_, err := New(cfg)
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorIs(t, err, isolation.ErrInvalidSizing)
	for _, w := range []float64{-0.1, 0.6, nanFloat()} {
		cfg := tinyConfig(8)
		cfg.GrowthWatermark = w
		_, err := New(cfg)
		require.ErrorIs(t, err, ErrInvalidConfig, "watermark %v", w)
	}
	p := newPool(t, tinyConfig(8))
	_, err = p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 1, Sizing: Sizing{Mode: 9}})
	require.ErrorIs(t, err, ErrInvalidRequest)
	require.ErrorIs(t, p.AddTenant(TenantConfig{Name: "c", Sizing: onDemand(-1)}), ErrInvalidTenant)
}

func nanFloat() float64 { var z float64; return z / z }

// A growth of a lease released meanwhile, sealed, or never admitted does
// nothing and says why.
func TestGrowOfAnEndedOrSealedLease(t *testing.T) {
	p := handoffPool(t, 16)
	l := prefilled(t, p, "r", 6)
	out, err := l.Export(time.Now().Add(time.Minute))
	require.NoError(t, err)
	require.ErrorIs(t, l.TryGrow(8), ErrLeasePhase)
	require.NoError(t, out.Abort())
	require.ErrorIs(t, l.TryGrow(8), ErrLeaseReleased)
	var zero Lease
	require.ErrorIs(t, zero.TryGrow(1), ErrInvalidArgument)
	var nilLease *Lease
	require.ErrorIs(t, nilLease.TryGrow(1), ErrInvalidArgument)
	_, err = nilLease.Preempt(nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
}
