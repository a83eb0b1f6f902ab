package kvcache

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/allocator"
)

// Two ends of one lease race (Release and Abort, or an export's reclaim
// deadline and the engine's Release): the loser returns ErrLeaseReleased
// at once, and the engine recycles the Lease while the winner's scrub is
// still filling. Nothing the next incarnation does (its admission's
// canary check, its own release) may write into the page list the first
// scrub still reads: that scrub would then fill and clean pages that are
// free or another lease's, and leave its own quarantined for ever.
func TestRecycledLeaseDoesNotOverwriteAnInFlightScrub(t *testing.T) {
	for _, canary := range []bool{false, true} {
		name := "zero"
		if canary {
			name = "canary"
		}
		t.Run(name, func(t *testing.T) {
			dev := newScripted()
			cfg := tinyConfig(8)
			cfg.Device = dev
			if canary {
				cfg.Scrub = ScrubPolicy{Kind: ScrubCanary}
			}
			p := newPool(t, cfg)
			var l Lease
			require.NoError(t, p.TryAdmitInto(Request{ID: "one", Tenant: "a", PromptTokens: 8}, &l))
			first, err := l.BlockTable()
			require.NoError(t, err)

			gate := dev.gateNextFill()
			var wg sync.WaitGroup
			var winner error
			wg.Add(1)
			go func() { defer wg.Done(); winner = l.Release() }()
			<-gate.entered // the winner's scrub fills, outside the lock
			require.ErrorIs(t, l.Abort(), ErrLeaseReleased, "the loser")
			require.False(t, l.Live())

			// The engine recycles the Lease at once.
			require.NoError(t, p.TryAdmitInto(Request{ID: "two", Tenant: "b", PromptTokens: 8}, &l))
			second, err := l.BlockTable()
			require.NoError(t, err)
			require.NotEqual(t, first, second)
			require.NoError(t, l.Release())
			close(gate.proceed)
			wg.Wait()
			require.NoError(t, winner)

			require.NoError(t, p.Check())
			s := p.Stats()
			assert.Equal(t, 8, s.FreePages, "every page is free again")
			assert.Zero(t, s.QuarantinedPages)
			assert.NoError(t, p.Fault())
			admit(t, p, "all", "a", 32) // and clean: the canary finds them so
		})
	}
}

// admittingIs waits until n admissions or growths are in progress: each
// has made its first attempt (under the same hold of Pool.mu as the
// count) and waits.
func admittingIs(t *testing.T, p *Pool, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.mu.admitting == n
	}, 5*time.Second, time.Millisecond)
}

// Two growths of one lease wait at once. Each must be woken when pages
// free up; neither may hang, and Close must not wait for one for ever.
func TestConcurrentGrowthsOfOneLeaseBothWake(t *testing.T) {
	var l Lease
	p, hog := crowdedRun(t, &l, TenantConfig{Name: "a"})
	got := make(chan error, 2)
	for _, n := range []int{4, 8} {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			got <- l.Grow(ctx, n)
		}()
	}
	admittingIs(t, p, 2)
	require.NoError(t, hog.Release())
	for range 2 {
		require.NoError(t, <-got)
	}
	assert.Equal(t, 3, l.Pages())
	require.NoError(t, p.Check())
}

// A growth waits; another goroutine releases its lease and recycles the
// Lease into an admission that waits too. The stale growth ends
// (ErrLeaseReleased) and must not take the new admission's place in the
// queue with it: the admission would never be woken. Which of the two
// runs first is up to the scheduler, so the race is run a number of
// times.
func TestStaleGrowthDoesNotDequeueTheNextIncarnation(t *testing.T) {
	for i := range 20 {
		var l Lease
		p, hog := crowdedRun(t, &l, TenantConfig{Name: "a"})
		grown := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			grown <- l.Grow(ctx, 8)
		}()
		admittingIs(t, p, 1)
		require.NoError(t, l.Release())
		admitted := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			admitted <- p.AdmitInto(ctx, Request{ID: "next", Tenant: "a", PromptTokens: 3 * 4}, &l)
		}()
		require.ErrorIs(t, <-grown, ErrLeaseReleased)
		require.Eventually(t, func() bool { // the admission waits
			p.mu.Lock()
			defer p.mu.Unlock()
			return p.mu.admitting == 1 && p.groups[0].alloc.Count(allocator.Free) == 1
		}, 5*time.Second, time.Millisecond)
		require.NoError(t, hog.Release())
		require.NoError(t, <-admitted, "round %d", i)
		require.NoError(t, p.Check())
		require.NoError(t, p.Close())
	}
}

// AttachTokens derives its keys outside Pool.mu. If its lease ends
// meanwhile and the Lease is admitted again (another request, another
// tenant, another domain), the stale call must not give the new
// incarnation the old one's tokens: CachePrefix would publish the new
// request's pages under a prompt they were not computed for, with keys
// rooted in the other domain.
func TestStaleAttachTokensDoesNotReachTheNextIncarnation(t *testing.T) {
	p := newPrefixPool(t, 16, PrefixConfig{}, TenantConfig{Name: "a"}, TenantConfig{Name: "b"})
	var l Lease
	require.NoError(t, p.TryAdmitInto(Request{ID: "one", Tenant: "a", PromptTokens: 2 * prefixTPP}, &l))
	testHookAttachTokensHashed = func() {
		testHookAttachTokensHashed = nil
		require.NoError(t, l.Release())
		require.NoError(t, p.TryAdmitInto(Request{ID: "two", Tenant: "b", PromptTokens: 2 * prefixTPP}, &l))
	}
	t.Cleanup(func() { testHookAttachTokensHashed = nil })
	require.ErrorIs(t, l.AttachTokens("", tokens(2*prefixTPP, 0, 1)), ErrLeaseReleased)

	require.NoError(t, l.Commit(2*prefixTPP))
	n, err := l.CachePrefix(2 * prefixTPP)
	require.NoError(t, err)
	assert.Zero(t, n, "the new incarnation has no tokens, so it publishes nothing")
	assert.Zero(t, p.Stats().Prefix.Domains[1].IndexedPages)
	require.NoError(t, p.Check())
}

// Check looked at the prefix match of every waiter's lease, a growth's
// too. A growth whose lease has ended may still be queued when the Lease
// is admitted into again, and admit resets the match outside Pool.mu: a
// Check then (any goroutine's, or the self-check after any state change
// under -race) read it unsynchronised. A growth's lease is live, in the
// lease table, and checked there. The race detector sees this one, so
// the test fails only under -race; the race is run a number of times.
func TestCheckDoesNotReadTheMatchOfAStaleGrowthsLease(t *testing.T) {
	for range 200 {
		var l Lease
		p, hog := crowdedRun(t, &l, TenantConfig{Name: "a", ReservedPages: 1})
		grown := make(chan error, 1)
		go func() { grown <- l.Grow(context.Background(), 8) }()
		admittingIs(t, p, 1)
		var stop atomic.Bool
		checked := make(chan struct{})
		go func() {
			defer close(checked)
			for !stop.Load() {
				assert.NoError(t, p.Check())
			}
		}()
		require.NoError(t, l.Release())
		require.NoError(t, p.TryAdmitInto(Request{ID: "next", Tenant: "a", PromptTokens: 4}, &l), "inside its reservation")
		stop.Store(true)
		<-checked
		require.ErrorIs(t, <-grown, ErrLeaseReleased)
		require.NoError(t, hog.Release())
		require.NoError(t, l.Release())
		require.NoError(t, p.Check())
		require.NoError(t, p.Close())
	}
}
