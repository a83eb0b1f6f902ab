package kvcache

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/internal/invariants"
)

// Evicted cache entries are reused for the next pages published
// (prefixIndex.recycle), in any domain. A reused entry must be reachable
// from nothing that reached it before: not from the index under its old
// key or tokens, not from the match an admission made while it held the
// old content, not from an event. Here an entry of domain a is reused for
// a page of domain b while a lease of tenant a still holds a match that
// names it; were that match used, tenant a would share a page of domain b.
func TestRecycledCacheEntryIsReachableFromNothingThatReachedItBefore(t *testing.T) {
	p, err := New(Config{Geometry: prefixGeometry, Pages: 16, MaxContextTokens: 16 * prefixTPP,
		Tenants: []TenantConfig{{Name: "a"}, {Name: "b"}}, Prefix: PrefixConfig{EventBuffer: 64}})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	events := p.Events()
	drain := func() (out []KVEvent) {
		for {
			select {
			case ev := <-events:
				out = append(out, ev)
			default:
				return out
			}
		}
	}

	// Tenant a publishes A: four full pages, cached once released.
	promptA := tokens(4*prefixTPP+1, 0, 1)
	la := admitComputeCache(t, p, "A", "a", promptA, 0)
	require.NoError(t, la.Release())
	storedA := drain()
	require.Len(t, storedA, 1)
	keysA := storedA[0].Keys
	require.Len(t, keysA, 4)

	// A lease of tenant a matches A, as an admission does before it
	// decides (and keeps, between attempts, while it waits).
	var stale Lease
	p.mu.Lock()
	ta, err := p.groups[0].tenants.Lookup("a")
	require.NoError(t, err)
	stale.tokens = append(stale.tokens, promptA...)
	p.matchLocked(&stale, ta.Domain, "", maxHitPages(Request{PromptTokens: len(promptA)}, prefixTPP), false)
	matched := slices.Clone(stale.match.entries)
	epoch := stale.match.epoch
	p.mu.Unlock()
	require.Len(t, matched, 4)

	// A is evicted: its entries go to the spare list...
	require.NoError(t, p.ClearPrefixCache())
	require.NoError(t, p.Check())
	p.mu.Lock()
	spares := p.mu.prefix.spareLen
	p.mu.Unlock()
	require.Equal(t, 4, spares, "A's four entries are spares")

	// ... and tenant b's B reuses them.
	promptB := tokens(4*prefixTPP+1, 0, 2)
	lb := admitComputeCache(t, p, "B", "b", promptB, 0)
	p.mu.Lock()
	reused := 0
	for _, e := range matched {
		if !e.spare && e.dom != nil && e.dom.Name == "tenant:b" {
			reused++
		}
	}
	assert.Equal(t, 4, reused, "B's pages are published in A's old entries")
	assert.NotEqual(t, epoch, p.mu.prefix.epoch, "the index moved on since the match")

	// The index no longer finds A, by key or by tokens, in any domain.
	tb, err := p.groups[0].tenants.Lookup("b")
	require.NoError(t, err)
	for i, k := range keysA {
		assert.Nil(t, p.mu.prefix.lookup(ta.Domain, k), "A's key %d in domain a", i)
		assert.Nil(t, p.mu.prefix.lookup(tb.Domain, k), "A's key %d in domain b", i)
	}
	assert.Nil(t, p.mu.prefix.root(ta.Domain, "", false).child(promptA[:prefixTPP], ta.Domain, p.mu.prefix.seed), "A's first page in a's trie")

	// The stale match is made again before anything uses it: nothing.
	p.matchLocked(&stale, ta.Domain, "", 4, false)
	assert.Empty(t, stale.match.entries, "a match made before the reuse was used as it was")
	p.mu.Unlock()

	// An admission of A's prompt by tenant a shares nothing (A is gone)
	// and gets none of B's pages; B's own prompt is still found in b.
	again, err := p.TryAdmit(Request{ID: "A2", Tenant: "a", PromptTokens: len(promptA), TokenIDs: promptA})
	require.NoError(t, err)
	assert.Zero(t, again.HitTokens())
	bt, err := lb.BlockTable()
	require.NoError(t, err)
	at, err := again.BlockTable()
	require.NoError(t, err)
	for _, pg := range at {
		assert.NotContains(t, bt[:4], pg, "tenant a got a page of domain b")
	}
	hitB, err := p.TryAdmit(Request{ID: "B2", Tenant: "b", PromptTokens: len(promptB), TokenIDs: promptB})
	require.NoError(t, err)
	assert.Equal(t, 4*prefixTPP, hitB.HitTokens())
	require.NoError(t, p.Check())

	// The events name A's keys for A and B's for B, never one for the
	// other: they carry keys, never entries.
	evs := drain()
	var removed, stored []BlockKey
	for _, ev := range evs {
		switch ev.Kind {
		case KVRemoved:
			removed = append(removed, ev.Keys...)
		case KVStored:
			stored = append(stored, ev.Keys...)
			assert.Equal(t, "tenant:b", ev.Domain)
		}
	}
	assert.ElementsMatch(t, keysA, removed)
	require.Len(t, stored, 4)
	for _, k := range stored {
		assert.NotContains(t, keysA, k)
	}
	for _, l := range []*Lease{lb, again, hitB} {
		require.NoError(t, l.Release())
	}
	require.NoError(t, p.Check())
}

// Once the cache churns, publishing reuses evicted entries with their
// token, tenant and child arrays: no allocation per published page.
func TestPublishingIntoAChurningCacheAllocatesNoEntries(t *testing.T) {
	if invariants.Enabled {
		t.Skip("the self-checks after every step allocate")
	}
	p := newPrefixPool(t, 64, PrefixConfig{}, TenantConfig{Name: "a"})
	prompt := tokens(16*prefixTPP, 0, 1)
	var l Lease
	seed := int32(0)
	cycle := func() {
		seed++
		prompt[0] = seed // a prompt no earlier one shares
		require.NoError(t, p.TryAdmitInto(Request{ID: "r", Tenant: "a", PromptTokens: len(prompt), TokenIDs: prompt}, &l))
		require.NoError(t, l.Commit(len(prompt)))
		n, err := l.CachePrefix(len(prompt))
		require.NoError(t, err)
		require.Equal(t, len(prompt), n)
		require.NoError(t, l.Release())
	}
	for range 8 { // the cache is full and evicts, and the Lease's buffers have grown
		cycle()
	}
	allocs := testing.AllocsPerRun(20, cycle)
	require.NoError(t, p.Check())
	// What remains is the lease's key derivation outside the lock (one
	// array per CachePrefix) and the hashing's own: none per page.
	t.Logf("%.1f allocations per cycle of 16 published pages", allocs)
	assert.Less(t, allocs, 16.0, "%.1f allocations per cycle of 16 published pages", allocs)
	p.mu.Lock()
	assert.Zero(t, p.mu.prefix.spareLen, "each cycle's publication reused what its admission evicted")
	p.mu.Unlock()
}
