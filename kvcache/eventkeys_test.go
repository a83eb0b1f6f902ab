package kvcache

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestReturnedEventKeysAreReusedNotShared: an array handed back with
// ReturnEventKeys carries a later event's keys (no new allocation), and
// that event's keys are its own, whole and in order; arrays too large to
// keep, empty ones, and returns to a pool without events are ignored.
func TestReturnedEventKeysAreReusedNotShared(t *testing.T) {
	p := newPrefixPool(t, 16, PrefixConfig{EventBuffer: 64}, TenantConfig{Name: "a"})
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
	first := tokens(16, 16, 1) // 4 pages
	l := admitComputeCache(t, p, "a1", "a", first, 0)
	require.NoError(t, l.Release())
	stored := next()
	require.Equal(t, KVStored, stored.Kind)
	require.Len(t, stored.Keys, 4)
	want := append([]BlockKey(nil), stored.Keys...)
	assert.Equal(t, want, pageKeysOf(t, p, "a", first))
	array := &stored.Keys[:1][0]
	p.ReturnEventKeys(stored.Keys)

	second := tokens(12, 0, 2) // 3 pages, none shared
	l = admitComputeCache(t, p, "a2", "a", second, 0)
	require.NoError(t, l.Release())
	again := next()
	require.Equal(t, KVStored, again.Kind)
	assert.Same(t, array, &again.Keys[:1][0], "the returned array carries the next event")
	assert.Equal(t, pageKeysOf(t, p, "a", second), again.Keys)
	assert.NotEqual(t, want[:3], again.Keys, "the old keys are gone, not mixed in")

	// Nothing to keep: these come back as no-ops, and the next event
	// gets a fresh array.
	p.ReturnEventKeys(nil)
	p.ReturnEventKeys(make([]BlockKey, 0, maxSpareKeys+1))
	for range spareKeyArrays + 8 { // more than are kept: the rest are dropped
		p.ReturnEventKeys(make([]BlockKey, 1))
	}
	require.NoError(t, p.Check())

	quiet := newPrefixPool(t, 16, PrefixConfig{}, TenantConfig{Name: "a"})
	quiet.ReturnEventKeys(again.Keys) // no events, no spare arrays: ignored
	require.NoError(t, quiet.Check())
}

// pageKeysOf derives the page keys of toks in tenant's domain.
func pageKeysOf(t *testing.T, p *Pool, tenant string, toks []int32) []BlockKey {
	t.Helper()
	keys, err := p.PageKeys(tenant, "", toks, nil)
	require.NoError(t, err)
	return keys
}
