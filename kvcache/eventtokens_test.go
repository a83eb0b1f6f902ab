package kvcache

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/internal/invariants"
)

// TestStoredEventsCarryTokensOnlyWhenConfigured: with Prefix.EventTokens a
// stored event carries exactly its pages' tokens (a run after a shared
// prefix, its own pages' only) and the adapter; without it, none. Removals
// never carry tokens, and a lease admitted with page keys alone publishes
// keys without tokens.
func TestStoredEventsCarryTokensOnlyWhenConfigured(t *testing.T) {
	for _, on := range []bool{false, true} {
		p := newPrefixPool(t, 16, PrefixConfig{EventBuffer: 64, EventTokens: on}, TenantConfig{Name: "a"})
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
		first := tokens(16, 16, 1)  // 4 pages
		second := tokens(24, 16, 2) // the same 4 pages, then 2 of its own
		require.NoError(t, admitComputeCache(t, p, "a1", "a", first, 0).Release())
		require.NoError(t, admitComputeCache(t, p, "a2", "a", second, 0).Release())
		ev1, ev2 := next(), next()
		require.Equal(t, KVStored, ev2.Kind)
		require.Len(t, ev2.Keys, 2)
		if on {
			assert.Equal(t, first, ev1.TokenIDs)
			assert.Equal(t, second[16:], ev2.TokenIDs, "the run's pages, not the shared prefix")
		} else {
			assert.Nil(t, ev1.TokenIDs)
			assert.Nil(t, ev2.TokenIDs)
		}

		l, err := p.TryAdmit(Request{ID: "lora", Tenant: "a", PromptTokens: 8, TokenIDs: tokens(8, 0, 3), Adapter: "lora-7"})
		require.NoError(t, err)
		require.NoError(t, l.Commit(8))
		_, err = l.CachePrefix(8)
		require.NoError(t, err)
		require.NoError(t, l.Release())
		ev := next()
		assert.Equal(t, "lora-7", ev.Adapter)
		assert.Equal(t, "", ev1.Adapter)

		keys, err := p.PageKeys("a", "", tokens(8, 0, 4), nil)
		require.NoError(t, err)
		l, err = p.TryAdmit(Request{ID: "keys", Tenant: "a", PromptTokens: 8, PageKeys: keys})
		require.NoError(t, err)
		require.NoError(t, l.Commit(8))
		_, err = l.CachePrefix(8)
		require.NoError(t, err)
		require.NoError(t, l.Release())
		ev = next()
		assert.Equal(t, keys, ev.Keys)
		assert.Nil(t, ev.TokenIDs, "a lease without tokens has none to publish")

		require.NoError(t, p.ClearPrefixCache())
		for range 2 {
			if ev := next(); ev.Kind == KVRemoved {
				assert.Nil(t, ev.TokenIDs)
			}
		}
		require.NoError(t, p.Check())
	}
}

// TestReturnedEventTokensAreReused: a token array handed back carries a
// later event's tokens, and publishing with tokens into a churning cache
// whose consumer hands keys and tokens back allocates no more than
// without tokens.
func TestReturnedEventTokensAreReused(t *testing.T) {
	p := newPrefixPool(t, 64, PrefixConfig{EventBuffer: 64, EventTokens: true}, TenantConfig{Name: "a"})
	require.NoError(t, admitComputeCache(t, p, "a1", "a", tokens(16, 0, 1), 0).Release())
	ev := <-p.Events()
	array := &ev.TokenIDs[:1][0]
	p.ReturnEventTokens(ev.TokenIDs)
	p.ReturnEventKeys(ev.Keys)
	want := tokens(12, 0, 2)
	require.NoError(t, admitComputeCache(t, p, "a2", "a", want, 0).Release())
	ev = <-p.Events()
	assert.Same(t, array, &ev.TokenIDs[:1][0], "the returned array carries the next event")
	assert.Equal(t, want, ev.TokenIDs)

	// Nothing to keep: ignored.
	p.ReturnEventTokens(nil)
	p.ReturnEventTokens(make([]int32, 0, maxSpareTokens+1))
	quiet := newPrefixPool(t, 16, PrefixConfig{EventBuffer: 4}, TenantConfig{Name: "a"})
	quiet.ReturnEventTokens(ev.TokenIDs) // events without tokens keep no spare arrays
	require.NoError(t, quiet.Check())

	if invariants.Enabled {
		return // the self-checks allocate
	}
	allocs := func(eventTokens bool) float64 {
		p := newPrefixPool(t, 64, PrefixConfig{EventBuffer: 64, EventTokens: eventTokens}, TenantConfig{Name: "a"})
		prompt := tokens(16*prefixTPP, 0, 1)
		var l Lease
		seed := int32(0)
		cycle := func() {
			seed++
			prompt[0] = seed
			require.NoError(t, p.TryAdmitInto(Request{ID: "r", Tenant: "a", PromptTokens: len(prompt), TokenIDs: prompt}, &l))
			require.NoError(t, l.Commit(len(prompt)))
			_, err := l.CachePrefix(len(prompt))
			require.NoError(t, err)
			require.NoError(t, l.Release())
			for {
				select {
				case ev := <-p.Events():
					p.ReturnEventKeys(ev.Keys)
					p.ReturnEventTokens(ev.TokenIDs)
					continue
				default:
				}
				break
			}
		}
		for range 8 {
			cycle()
		}
		return testing.AllocsPerRun(20, cycle)
	}
	without, with := allocs(false), allocs(true)
	t.Logf("%.1f allocations per cycle without tokens, %.1f with", without, with)
	assert.LessOrEqual(t, with, without, "tokens cost the pool no allocation once arrays come back")
}
