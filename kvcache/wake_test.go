package kvcache

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A waiter inside its tenant's unused reservation is admitted ahead of
// the line, also when it queued behind an earlier waiter that still
// does not fit: the pages that free up are its own.
func TestReservedWaiterBehindTheLineIsWoken(t *testing.T) {
	dev := newScripted()
	cfg := tinyConfig(8, TenantConfig{Name: "gold", ReservedPages: 4}, TenantConfig{Name: "a"})
	cfg.Device = dev
	p := newPool(t, cfg)
	g := admit(t, p, "g", "gold", 4*4)
	hog := admit(t, p, "hog", "a", 4*4)
	first := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := p.Admit(ctx, Request{ID: "first", Tenant: "a", PromptTokens: 4 * 4})
		first <- err
	}()
	admittingIs(t, p, 1)
	dev.mu.Lock()
	dev.mu.hold = true // gold's pages stay in quarantine a while
	dev.mu.Unlock()
	require.NoError(t, g.Release())
	second := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		_, err := p.Admit(ctx, Request{ID: "second", Tenant: "gold", PromptTokens: 4 * 4})
		second <- err
	}()
	admittingIs(t, p, 2)
	dev.complete() // gold's reservation is free again
	require.NoError(t, <-second, "gold waited for its own reserved pages")
	require.NoError(t, hog.Release())
	require.NoError(t, <-first)
	require.NoError(t, p.Check())
}

// A growth passes the admissions waiting in line, so a growth that
// waits behind an admission that still does not fit must be woken when
// pages free up too, not only the first in line.
func TestWaitingGrowthBehindTheLineIsWoken(t *testing.T) {
	var l Lease
	p, hog := crowdedRun(t, &l, TenantConfig{Name: "a"})
	big := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := p.Admit(ctx, Request{ID: "big", Tenant: "b", PromptTokens: 8 * 4})
		big <- err
	}()
	admittingIs(t, p, 1)
	grown := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		grown <- l.Grow(ctx, 4)
	}()
	admittingIs(t, p, 2)
	require.NoError(t, hog.Release()) // 7 free: the growth fits, "big" does not
	require.NoError(t, <-grown)
	assert.Equal(t, 2, l.Pages())
	require.NoError(t, l.Release())
	require.NoError(t, <-big)
	require.NoError(t, p.Check())
}

// crowdedRun admits request "run" of tenant a (configured as a) into l on
// an on-demand pool of 8 pages, 4 tokens committed in its one page and 28
// more to grow into, and has tenant b hold the 7 other pages: a growth of
// l waits. It returns the pool and b's lease.
func crowdedRun(t *testing.T, l *Lease, a TenantConfig) (*Pool, *Lease) {
	t.Helper()
	p := onDemandPool(t, 8, 0, 0, a, TenantConfig{Name: "b"})
	require.NoError(t, p.TryAdmitInto(Request{ID: "run", Tenant: "a", PromptTokens: 4, MaxNewTokens: 28}, l))
	require.NoError(t, l.Commit(4))
	return p, admit(t, p, "hog", "b", 7*4)
}
