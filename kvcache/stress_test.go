package kvcache

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Admissions with contexts that end at random, racing their grants, the
// claims and evictions of others, growths that wait, ClearPrefixCache and
// tenants moving domain, each goroutine recycling one Lease (with an
// Abort racing some of its Releases, and some preempted). Every call either succeeds or
// returns a typed error with nothing held for it; at the end, with every
// lease released, every page is free or cached and Check passes. The
// self-checks after each state change run under -race.
func TestCancellationRacingGrantsLeavesNothingAllocated(t *testing.T) {
	cfg := Config{Geometry: prefixGeometry, Pages: 36, MaxContextTokens: 36 * prefixTPP,
		Sizing: onDemand(2), GrowthWatermark: 0.1,
		Tenants: []TenantConfig{{Name: "a", Domain: "org"}, {Name: "b", Domain: "org"},
			{Name: "c", ReservedPages: 6}, {Name: "d", QuotaPages: 12}}}
	p := newPool(t, cfg)
	sentinels := []error{ErrPoolExhausted, ErrExceedsQuota, ErrLeaseReleased, ErrContextDone, ErrDuplicateRequest}
	typed := func(err error) bool {
		for _, s := range sentinels {
			if errors.Is(err, s) {
				return true
			}
		}
		return false
	}
	systems := [][]int32{tokens(20, 20, 0), tokens(12, 0, 1)}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	report := func(what string, err error) {
		select {
		case errs <- fmt.Errorf("%s: %w", what, err):
		default:
		}
	}
	stop := make(chan struct{})
	for w := range 6 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			var l Lease
			for range 120 {
				toks := append([]int32{}, systems[rng.IntN(2)]...)
				for range 1 + rng.IntN(10) {
					toks = append(toks, int32(rng.IntN(3)))
				}
				req := Request{ID: fmt.Sprintf("r%d", rng.IntN(8)), Tenant: string(rune('a' + rng.IntN(4))),
					PromptTokens: len(toks), MaxNewTokens: rng.IntN(24)}
				if rng.IntN(3) > 0 {
					req.TokenIDs = toks
				}
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.IntN(3000))*time.Microsecond)
				err := p.AdmitInto(ctx, req, &l)
				cancel()
				if err != nil {
					if !typed(err) {
						report("admit", err)
					}
					if l.Live() {
						report("admit", fmt.Errorf("refused (%v), yet the lease is live", err))
					}
					continue
				}
				if err := l.Commit(len(toks)); err != nil {
					report("commit", err)
				}
				if rng.IntN(2) == 0 {
					if _, err := l.CachePrefix(len(toks)); err != nil {
						report("cache", err)
					}
				}
				if n := rng.IntN(req.MaxNewTokens + 1); n > 0 {
					ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.IntN(2000))*time.Microsecond)
					if err := l.Grow(ctx, n); err != nil && !typed(err) {
						report("grow", err)
					}
					cancel()
				}
				switch rng.IntN(5) {
				case 0:
					if _, err := l.Preempt(toks); err != nil {
						report("preempt", err)
					}
				case 1:
					var race sync.WaitGroup
					race.Go(func() { _ = l.Abort() })
					_ = l.Release()
					race.Wait()
				default:
					if err := l.Release(); err != nil {
						report("release", err)
					}
				}
			}
		})
	}
	var side sync.WaitGroup
	side.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			if i%5 == 0 {
				_ = p.ClearPrefixCache()
			}
			dom := "org"
			if i%2 == 0 {
				dom = ""
			}
			_ = p.UpdateTenant(TenantConfig{Name: "b", Domain: dom})
			assert.NoError(t, p.Check())
		}
	})
	wg.Wait()
	close(stop)
	side.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	require.NoError(t, p.Check())
	s := p.Stats()
	t.Logf("admitted %d, refused %+v, growth %+v, evicted/scrub %+v", s.Admitted, s.Refused, s.Growth, s.Scrub)
	assert.Zero(t, s.LiveLeases)
	assert.Equal(t, 36, s.FreePages+s.CachedPages, "every page free or cached")
	assert.Zero(t, s.QuarantinedPages)
	require.NoError(t, p.ClearPrefixCache())
	assert.Equal(t, 36, p.Stats().FreePages)
	require.NoError(t, p.Check())
}
