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

	"github.com/kvfence/kvfence/cudaops"
)

// Close while admissions wait (with contexts that never end), growths
// wait, windows slide and leases end: every call returns (Close wakes or
// waits for each), what returned an error holds nothing, and after Close
// every page of every group is free and Check passes. Run on a pool of
// one group and on one of three (sliding window and state slots).
func TestCloseWhileEverythingIsInFlight(t *testing.T) {
	one := tinyConfig(24, TenantConfig{Name: "a", ReservedPages: 4}, TenantConfig{Name: "b", QuotaPages: 16})
	three := hybridConfig(24, 4, TenantConfig{Name: "a", ReservedPages: 4}, TenantConfig{Name: "b", QuotaPages: 16})
	for name, cfg := range map[string]Config{"one group": one, "three groups": three} {
		t.Run(name, func(t *testing.T) {
			cfg.Sizing = onDemand(4)
			closeWhileInFlight(t, cfg)
		})
	}
}

func closeWhileInFlight(t *testing.T, cfg Config) {
	p, err := New(cfg)
	require.NoError(t, err)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var unexpected []error
	bad := func(what string, err error) {
		if err == nil || errors.Is(err, ErrPoolClosed) || errors.Is(err, ErrLeaseReleased) || errors.Is(err, ErrContextDone) ||
			errors.Is(err, ErrPoolExhausted) || errors.Is(err, ErrExceedsQuota) {
			return
		}
		mu.Lock()
		unexpected = append(unexpected, fmt.Errorf("%s: %w", what, err))
		mu.Unlock()
	}
	started := make(chan struct{}, 8)
	for w := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 3))
			var l Lease
			for i := 0; ; i++ {
				if i == 3 {
					started <- struct{}{}
				}
				tenant := string(rune('a' + rng.IntN(2)))
				err := p.AdmitInto(context.Background(), Request{ID: fmt.Sprintf("w%d", w), Tenant: tenant,
					PromptTokens: 1 + rng.IntN(20), MaxNewTokens: rng.IntN(40)}, &l)
				if err != nil && l.Live() {
					bad("admit", fmt.Errorf("refused (%w), and the lease is live", err))
				}
				if errors.Is(err, ErrPoolClosed) {
					return
				}
				bad("admit", err)
				if err != nil {
					continue
				}
				w := min(l.CapacityTokens(), l.PromptTokens()+l.MaxNewTokens())
				bad("commit", l.Commit(w))
				_, err = l.SlideWindows(cudaops.Ordering{})
				bad("slide", err)
				if room := l.PromptTokens() + l.MaxNewTokens() - w; room > 0 {
					// A growth waits a while, then the engine would preempt:
					// leases all waiting to grow, none ending, would wait for
					// each other for ever.
					ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rng.IntN(2000))*time.Microsecond)
					bad("grow", l.Grow(ctx, 1+rng.IntN(room)))
					cancel()
				}
				time.Sleep(time.Duration(rng.IntN(300)) * time.Microsecond)
				if err := l.Release(); errors.Is(err, ErrPoolClosed) {
					return // Close ends the lease
				} else {
					bad("release", err)
				}
			}
		})
	}
	for range 8 {
		select {
		case <-started:
		case <-time.After(20 * time.Second):
			t.Fatal("a worker made no progress")
		}
	}
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("Close did not return")
	}
	wg.Wait()
	assert.Empty(t, unexpected)
	require.NoError(t, p.Check())
	for _, g := range p.Stats().Groups {
		assert.Equal(t, g.Pages, g.Free, "group %q", g.Name)
	}
}
