package kvcache

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPrefixConcurrent runs admissions that share, publish, evict and wait
// from several goroutines while another checks the pool. Pages are tight,
// so admissions wait for releases and for evictions; domains move under
// them. Run under -race.
func TestPrefixConcurrent(t *testing.T) {
	p := newPrefixPool(t, 40, PrefixConfig{EventBuffer: 8},
		TenantConfig{Name: "a", Domain: "org"}, TenantConfig{Name: "b", Domain: "org"},
		TenantConfig{Name: "c"}, TenantConfig{Name: "d"})
	systems := [][]int32{tokens(24, 24, 0), tokens(16, 0, 1)}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	errs := make(chan error, 16)
	for w := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for i := range 150 {
				toks := append([]int32{}, systems[rng.IntN(2)]...)
				for range 1 + rng.IntN(8) {
					toks = append(toks, int32(rng.IntN(2)))
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				l, err := p.Admit(ctx, Request{ID: fmt.Sprintf("w%d-%d", w, i), Tenant: string(rune('a' + rng.IntN(4))),
					PromptTokens: len(toks), MaxNewTokens: rng.IntN(8), TokenIDs: toks})
				cancel()
				if err != nil {
					errs <- err
					return
				}
				if err := l.Commit(len(toks)); err != nil {
					errs <- err
					return
				}
				if _, err := l.CachePrefix(len(toks)); err != nil {
					errs <- err
					return
				}
				time.Sleep(time.Duration(rng.IntN(200)) * time.Microsecond)
				if err := l.Release(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	go func() { // drain events slowly: drops must not stall anyone
		for {
			select {
			case <-stop:
				return
			case <-p.Events():
				time.Sleep(time.Millisecond)
			}
		}
	}()
	checker := make(chan struct{})
	go func() {
		defer close(checker)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := p.Check(); err != nil {
				errs <- err
				return
			}
			if i%10 == 0 {
				dom := []string{"", "org"}[i/10%2]
				if err := p.UpdateTenant(TenantConfig{Name: "c", Domain: dom}); err != nil {
					errs <- err
					return
				}
			}
			time.Sleep(100 * time.Microsecond)
		}
	}()
	wg.Wait()
	close(stop)
	<-checker
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, p.Check())
	st := p.Stats()
	assert.Equal(t, st.TotalPages, st.FreePages+st.CachedPages)
	hits := uint64(0)
	for _, d := range st.Prefix.Domains {
		hits += d.HitPages
	}
	assert.Positive(t, hits)
	assert.Positive(t, evictedTotal(p))
}
