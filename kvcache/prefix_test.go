package kvcache

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

const prefixTPP = 4 // tokens per page in these tests

// prefixGeometry has 64-byte pages in each of 2 regions.
var prefixGeometry = Geometry{TokensPerPage: prefixTPP, Layers: 1, KVHeads: 1, HeadDim: 4, DType: FP32}

func newPrefixPool(t testing.TB, pages int, prefix PrefixConfig, tenants ...TenantConfig) *Pool {
	t.Helper()
	p, err := New(Config{
		Geometry:         prefixGeometry,
		Pages:            pages,
		MaxContextTokens: pages * prefixTPP,
		Tenants:          tenants,
		Prefix:           prefix,
	})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// tokens returns n token IDs: the first shared of them from seed 0 (a
// common system prompt), the rest from seed.
func tokens(n, shared int, seed int32) []int32 {
	out := make([]int32, n)
	for i := range out {
		if i < shared {
			out[i] = int32(1000 + i)
		} else {
			out[i] = seed*100000 + int32(i)
		}
	}
	return out
}

// admitComputeCache admits a request, "computes" its prompt (Commit) and
// publishes it, and returns the live lease.
func admitComputeCache(t testing.TB, p *Pool, id, tenant string, toks []int32, maxNew int) *Lease {
	t.Helper()
	l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: len(toks), MaxNewTokens: maxNew, TokenIDs: toks})
	require.NoError(t, err)
	require.NoError(t, l.Commit(len(toks)))
	_, err = l.CachePrefix(len(toks))
	require.NoError(t, err)
	require.NoError(t, p.Check())
	return l
}

func domainStats(p *Pool, name string) DomainStats {
	for _, d := range p.Stats().Prefix.Domains {
		if d.Name == name {
			return d
		}
	}
	return DomainStats{}
}

func tableOf(t testing.TB, l *Lease) []int32 {
	t.Helper()
	bt, err := l.BlockTable()
	require.NoError(t, err)
	return bt
}

func commonPages(a, b []int32) int {
	n := 0
	for _, x := range a {
		if slices.Contains(b, x) {
			n++
		}
	}
	return n
}

// pairedSharing runs the paired conformance check: a publisher in domain
// pub, then the same prompt from sameTenant (which must share it) and from
// otherTenant (which must not). It returns an error naming the half that
// failed; both halves are always evaluated together, so a pool that never
// shares (which passes the second half alone) fails the first.
func pairedSharing(t *testing.T, p *Pool, round int, pubTenant, sameTenant, otherTenant string) error {
	t.Helper()
	toks := tokens(9*prefixTPP+1, 9*prefixTPP+1, int32(round)) // 9 full pages + 1 token, all "system prompt"
	toks[0] = int32(round)                                     // a fresh prompt per round
	pub := admitComputeCache(t, p, fmt.Sprintf("pub-%d", round), pubTenant, toks, 0)
	defer pub.Release()

	sameDomain := pub.Domain()
	before := domainStats(p, sameDomain)
	same, err := p.TryAdmit(Request{ID: fmt.Sprintf("same-%d", round), Tenant: sameTenant, PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(t, err)
	defer same.Release()
	afterSame := domainStats(p, sameDomain)

	other, err := p.TryAdmit(Request{ID: fmt.Sprintf("other-%d", round), Tenant: otherTenant, PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(t, err)
	defer other.Release()
	afterOther := domainStats(p, sameDomain)
	require.NoError(t, p.Check())

	var errs []error
	if same.HitTokens() != 9*prefixTPP || commonPages(tableOf(t, same), tableOf(t, pub)) != 9 ||
		afterSame.HitPages != before.HitPages+9 {
		errs = append(errs, fmt.Errorf("same domain %q: %d hit tokens, %d pages shared, hit counter %d → %d",
			sameDomain, same.HitTokens(), commonPages(tableOf(t, same), tableOf(t, pub)), before.HitPages, afterSame.HitPages))
	}
	if other.Domain() == sameDomain || other.HitTokens() != 0 || commonPages(tableOf(t, other), tableOf(t, pub)) != 0 ||
		afterOther.HitPages != afterSame.HitPages {
		errs = append(errs, fmt.Errorf("other domain %q: %d hit tokens, %d pages shared with %q",
			other.Domain(), other.HitTokens(), commonPages(tableOf(t, other), tableOf(t, pub)), sameDomain))
	}
	return errors.Join(errs...)
}

func TestPrefixPairedConformance(t *testing.T) {
	tenants := []TenantConfig{
		{Name: "a", Domain: "org"},
		{Name: "b", Domain: "org"},
		{Name: "c"},
	}
	t.Run("enabled", func(t *testing.T) {
		p := newPrefixPool(t, 64, PrefixConfig{}, tenants...)
		require.NoError(t, pairedSharing(t, p, 1, "a", "b", "c"))
		// Own domain: a tenant shares with itself.
		require.NoError(t, pairedSharing(t, p, 2, "c", "c", "a"))

		// c joins org: now it shares with a, and b's private move cuts it off.
		require.NoError(t, p.UpdateTenant(TenantConfig{Name: "c", Domain: "org"}))
		require.NoError(t, p.UpdateTenant(TenantConfig{Name: "b"}))
		require.NoError(t, pairedSharing(t, p, 3, "a", "c", "b"))
		// b's old org pages are not visible from its private domain, nor
		// its private pages from org.
		require.NoError(t, pairedSharing(t, p, 4, "b", "b", "c"))
		require.NoError(t, p.Check())
	})
	t.Run("disabled fails the pair", func(t *testing.T) {
		p := newPrefixPool(t, 64, PrefixConfig{Disable: true}, tenants...)
		err := pairedSharing(t, p, 1, "a", "b", "c")
		require.Error(t, err)
		assert.Contains(t, err.Error(), "same domain")
		assert.NotContains(t, err.Error(), "other domain")
	})
}

func TestPrefixMoveKeepsLiveLeasesInOldDomain(t *testing.T) {
	p := newPrefixPool(t, 64, PrefixConfig{}, TenantConfig{Name: "a", Domain: "org"}, TenantConfig{Name: "b", Domain: "org"})
	toks := tokens(17, 17, 1)
	la := admitComputeCache(t, p, "a1", "a", toks, 0)
	require.NoError(t, p.UpdateTenant(TenantConfig{Name: "a", Domain: "elsewhere"}))
	assert.Equal(t, "org", la.Domain())
	require.NoError(t, p.Check())
	// b still shares what a published in org.
	lb, err := p.TryAdmit(Request{ID: "b1", Tenant: "b", PromptTokens: 17, TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, 16, lb.HitTokens())
	// a itself, now elsewhere, does not.
	la2, err := p.TryAdmit(Request{ID: "a2", Tenant: "a", PromptTokens: 17, TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, 0, la2.HitTokens())
	assert.Equal(t, "elsewhere", la2.Domain())
	for _, l := range []*Lease{la, lb, la2} {
		require.NoError(t, l.Release())
		require.NoError(t, p.Check())
	}
}

func TestPrefixInvalidRequests(t *testing.T) {
	p := newPrefixPool(t, 32, PrefixConfig{}, TenantConfig{Name: "a"})
	long := make([]byte, MaxIDLen+1)
	tests := []struct {
		name string
		req  Request
	}{
		{"tokens and keys", Request{PromptTokens: 8, TokenIDs: make([]int32, 8), PageKeys: make([]BlockKey, 1)}},
		{"token count differs", Request{PromptTokens: 8, TokenIDs: make([]int32, 7)}},
		{"too many keys", Request{PromptTokens: 8, PageKeys: make([]BlockKey, 3)}},
		{"long adapter", Request{PromptTokens: 8, TokenIDs: make([]int32, 8), Adapter: string(long)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := p.Stats()
			tc.req.ID, tc.req.Tenant = "r", "a"
			_, err := p.TryAdmit(tc.req)
			require.ErrorIs(t, err, ErrInvalidRequest)
			var ae *AdmissionError
			require.ErrorAs(t, err, &ae)
			after := p.Stats()
			assert.Equal(t, before.InUsePages, after.InUsePages)
			assert.Equal(t, before.Refused.InvalidRequest+1, after.Refused.InvalidRequest)
			require.NoError(t, p.Check())
		})
	}
}

func TestPrefixInvalidDomain(t *testing.T) {
	_, err := New(Config{Geometry: prefixGeometry, Pages: 8, MaxContextTokens: 32,
		Tenants: []TenantConfig{{Name: "a", Domain: isolation.PrivateDomainPrefix + "b"}}})
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.ErrorIs(t, err, isolation.ErrInvalidTenant)

	p := newPrefixPool(t, 8, PrefixConfig{}, TenantConfig{Name: "a"})
	err = p.UpdateTenant(TenantConfig{Name: "a", Domain: isolation.PrivateDomainPrefix + "a"})
	require.ErrorIs(t, err, isolation.ErrInvalidTenant)
	_, err = New(Config{Geometry: prefixGeometry, Pages: 8, MaxContextTokens: 32, Prefix: PrefixConfig{EventBuffer: -1}})
	require.ErrorIs(t, err, ErrInvalidConfig)
}

func TestCachePrefixErrors(t *testing.T) {
	p := newPrefixPool(t, 32, PrefixConfig{}, TenantConfig{Name: "a"})
	toks := tokens(10, 10, 1)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 10, MaxNewTokens: 6, TokenIDs: toks})
	require.NoError(t, err)
	_, err = l.CachePrefix(4)
	require.ErrorIs(t, err, ErrInvalidArgument, "nothing written yet")
	require.NoError(t, l.Commit(12))
	_, err = l.CachePrefix(12)
	require.ErrorIs(t, err, ErrInvalidArgument, "output tokens have no keys")
	_, err = l.CachePrefix(-1)
	require.ErrorIs(t, err, ErrInvalidArgument)
	n, err := l.CachePrefix(7)
	require.NoError(t, err)
	assert.Equal(t, 4, n, "only full pages are published")
	n, err = l.CachePrefix(10)
	require.NoError(t, err)
	assert.Equal(t, 8, n)
	require.NoError(t, p.Check())
	require.NoError(t, l.Release())
	_, err = l.CachePrefix(8)
	require.ErrorIs(t, err, ErrLeaseReleased)

	// A request without tokens publishes nothing.
	l2, err := p.TryAdmit(Request{ID: "r2", Tenant: "a", PromptTokens: 10})
	require.NoError(t, err)
	require.NoError(t, l2.Commit(10))
	n, err = l2.CachePrefix(8)
	require.NoError(t, err)
	assert.Zero(t, n)
	require.NoError(t, l2.Release())
	require.NoError(t, p.Check())
}

func TestPrefixLastPromptPageNeverShared(t *testing.T) {
	p := newPrefixPool(t, 32, PrefixConfig{}, TenantConfig{Name: "a"})
	toks := tokens(12, 12, 1) // exactly 3 full pages
	l := admitComputeCache(t, p, "r", "a", toks, 0)
	require.NoError(t, l.Release())
	l2, err := p.TryAdmit(Request{ID: "r2", Tenant: "a", PromptTokens: 12, TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, 8, l2.HitTokens(), "the page of the last prompt token is computed afresh")
	require.NoError(t, l2.Release())
	require.NoError(t, p.Check())
}

func TestPrefixPageKeysRequest(t *testing.T) {
	p := newPrefixPool(t, 32, PrefixConfig{}, TenantConfig{Name: "a", Domain: "org"}, TenantConfig{Name: "b"})
	toks := tokens(13, 13, 1)
	l := admitComputeCache(t, p, "r", "a", toks, 0)
	defer l.Release()
	keys, err := p.PageKeys("a", "", toks, nil)
	require.NoError(t, err)
	require.Len(t, keys, 3)
	la, err := p.TryAdmit(Request{ID: "ra", Tenant: "a", PromptTokens: 13, PageKeys: keys})
	require.NoError(t, err)
	assert.Equal(t, 12, la.HitTokens())
	require.NoError(t, la.Release())
	// b presenting a's keys finds nothing: its lookups stay in its domain.
	lb, err := p.TryAdmit(Request{ID: "rb", Tenant: "b", PromptTokens: 13, PageKeys: keys})
	require.NoError(t, err)
	assert.Zero(t, lb.HitTokens())
	require.NoError(t, lb.Release())
	// Another adapter is another cache.
	lo, err := p.TryAdmit(Request{ID: "ro", Tenant: "a", PromptTokens: 13, TokenIDs: toks, Adapter: "lora-7"})
	require.NoError(t, err)
	assert.Zero(t, lo.HitTokens())
	require.NoError(t, lo.Release())
	_, err = p.PageKeys("nobody", "", toks, nil)
	require.ErrorIs(t, err, ErrUnknownTenant)
	require.NoError(t, p.Check())
}

func TestPrefixSharedPageChargedOncePerTenant(t *testing.T) {
	// 5 pages per request, 4 shared. Quota 8: a's second lease costs only
	// its one private page; b pays for the shared pages once too.
	p := newPrefixPool(t, 32, PrefixConfig{}, TenantConfig{Name: "a", Domain: "org", QuotaPages: 8}, TenantConfig{Name: "b", Domain: "org", QuotaPages: 8})
	toks := tokens(17, 17, 1)
	l1 := admitComputeCache(t, p, "1", "a", toks, 3) // 5 pages
	usedA := func() int {
		for _, ts := range p.Stats().Tenants {
			if ts.Name == "a" {
				return ts.UsedPages
			}
		}
		return -1
	}
	assert.Equal(t, 5, usedA())
	l2, err := p.TryAdmit(Request{ID: "2", Tenant: "a", PromptTokens: 17, MaxNewTokens: 3, TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, 16, l2.HitTokens())
	assert.Equal(t, 6, usedA())
	assert.Equal(t, 6, p.Stats().InUsePages)
	l3, err := p.TryAdmit(Request{ID: "3", Tenant: "a", PromptTokens: 17, MaxNewTokens: 3, TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, 7, usedA())
	require.NoError(t, p.Check())

	// Over quota: fail closed with the numbers, nothing changes.
	before := p.Stats()
	_, err = p.TryAdmit(Request{ID: "4", Tenant: "a", PromptTokens: 17, MaxNewTokens: 8, TokenIDs: toks})
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	require.ErrorIs(t, err, ErrExceedsQuota)
	assert.Equal(t, 3, ae.Need) // 3 fresh pages (the shared 4 are held already)
	assert.Equal(t, 1, ae.Have)
	assert.Equal(t, 8, ae.Limit)
	after := p.Stats()
	assert.Equal(t, before.InUsePages, after.InUsePages)
	assert.Equal(t, before.Prefix.Domains, after.Prefix.Domains)
	require.NoError(t, p.Check())

	for _, l := range []*Lease{l1, l2, l3} {
		require.NoError(t, l.Release())
		require.NoError(t, p.Check())
	}
	assert.Equal(t, 0, usedA())
	assert.Equal(t, 4, p.Stats().CachedPages)
}

func TestPrefixEvictionThroughScrubber(t *testing.T) {
	p := newPrefixPool(t, 16, PrefixConfig{EventBuffer: 64}, TenantConfig{Name: "a"}, TenantConfig{Name: "b"})
	host := p.dev.(*cudaops.Host)
	toks := tokens(40, 40, 1) // 10 full pages, all published
	l := admitComputeCache(t, p, "a1", "a", toks, 0)
	for _, page := range tableOf(t, l) {
		for r := range 2 {
			b := host.PageBytes(r, page)
			for i := range b {
				b[i] = 0xAA
			}
		}
	}
	require.NoError(t, l.Release())
	st := p.Stats()
	require.Equal(t, 10, st.CachedPages)
	require.Equal(t, 6, st.FreePages)

	// b needs 12 pages: 6 free + 6 evicted, scrubbed before b gets them.
	before := st.Scrub.PagesScrubbed
	lb, err := p.TryAdmit(Request{ID: "b1", Tenant: "b", PromptTokens: 48})
	require.NoError(t, err)
	require.NoError(t, p.Check())
	for _, page := range tableOf(t, lb) {
		for r := range 2 {
			assert.NotContains(t, host.PageBytes(r, page), byte(0xAA), "page %d region %d", page, r)
		}
	}
	st = p.Stats()
	assert.Equal(t, 4, st.CachedPages)
	assert.Equal(t, uint64(6), st.Scrub.PagesScrubbed-before)
	assert.Equal(t, uint64(6), domainStats(p, "tenant:a").EvictedPages)
	// The deepest pages went first: a's first 4 pages are still shared.
	require.NoError(t, lb.Release())
	la, err := p.TryAdmit(Request{ID: "a2", Tenant: "a", PromptTokens: 40, TokenIDs: toks})
	require.NoError(t, err)
	assert.Equal(t, 16, la.HitTokens())
	require.NoError(t, la.Release())
	require.NoError(t, p.Check())

	var kinds []KVEventKind
	stored, removed := 0, 0
	for len(p.Events()) > 0 {
		ev := <-p.Events()
		kinds = append(kinds, ev.Kind)
		switch ev.Kind {
		case KVStored:
			stored += len(ev.Keys)
			assert.Equal(t, len(ev.Keys)*prefixTPP, ev.Tokens)
			assert.Equal(t, "tenant:a", ev.Domain)
		case KVRemoved:
			removed += len(ev.Keys)
		}
	}
	assert.Equal(t, 10, stored) // a1's 10 full prompt pages; a2 published nothing
	assert.Equal(t, 6, removed)
	assert.Equal(t, []KVEventKind{KVStored, KVRemoved}, kinds)
}

func TestPrefixNoEvictionWhenItCannotHelp(t *testing.T) {
	p := newPrefixPool(t, 10, PrefixConfig{}, TenantConfig{Name: "a"}, TenantConfig{Name: "b"}, TenantConfig{Name: "c"})
	l := admitComputeCache(t, p, "a1", "a", tokens(13, 13, 1), 0) // 4 pages, 3 published
	hold, err := p.TryAdmit(Request{ID: "hold", Tenant: "b", PromptTokens: 12})
	require.NoError(t, err) // 3 pages; 3 free left
	require.NoError(t, l.Release())
	before := p.Stats()
	require.Equal(t, 3, before.CachedPages)
	require.Equal(t, 4, before.FreePages)
	_, err = p.TryAdmit(Request{ID: "big", Tenant: "c", PromptTokens: 32})
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	require.ErrorIs(t, err, ErrPoolExhausted)
	assert.Equal(t, 8, ae.Need)
	assert.Equal(t, 7, ae.Have) // 4 free + 3 cached
	after := p.Stats()
	assert.Equal(t, before.CachedPages, after.CachedPages, "nothing evicted for a request that cannot fit")
	require.NoError(t, hold.Release())
	require.NoError(t, p.Check())
}

func TestPrefixWaitingAdmissionWakesOnParkedPages(t *testing.T) {
	p := newPrefixPool(t, 8, PrefixConfig{}, TenantConfig{Name: "a"}, TenantConfig{Name: "b"})
	l := admitComputeCache(t, p, "a1", "a", tokens(29, 29, 1), 3) // 8 pages: the whole pool
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		lb, err := p.Admit(ctx, Request{ID: "b1", Tenant: "b", PromptTokens: 16})
		if err == nil {
			err = lb.Release()
		}
		done <- err
	}()
	time.Sleep(20 * time.Millisecond) // let b block on the semaphore
	// a's release parks 7 published pages (cached, not free) and frees 1.
	require.NoError(t, l.Release())
	require.NoError(t, <-done)
	require.NoError(t, p.Check())
}

func TestClearPrefixCacheAndClose(t *testing.T) {
	p, err := New(Config{Geometry: prefixGeometry, Pages: 32, MaxContextTokens: 128,
		Tenants: []TenantConfig{{Name: "a"}}, Prefix: PrefixConfig{EventBuffer: 1}})
	require.NoError(t, err)
	toks := tokens(21, 21, 1)
	l1 := admitComputeCache(t, p, "1", "a", toks, 0)
	l2 := admitComputeCache(t, p, "2", "a", tokens(21, 0, 2), 0)
	require.NoError(t, l2.Release())
	require.Equal(t, 5, p.Stats().CachedPages)
	require.NoError(t, p.ClearPrefixCache())
	require.NoError(t, p.Check())
	st := p.Stats()
	assert.Equal(t, 0, st.CachedPages)
	assert.Equal(t, 6, st.InUsePages, "l1 keeps its pages")
	// Cleared: no more hits, and l1's shared pages are scrubbed on release.
	l3, err := p.TryAdmit(Request{ID: "3", Tenant: "a", PromptTokens: 21, TokenIDs: toks})
	require.NoError(t, err)
	assert.Zero(t, l3.HitTokens())
	require.NoError(t, l1.Release())
	require.NoError(t, p.Check())
	assert.Equal(t, 0, p.Stats().CachedPages)
	st = p.Stats()
	assert.Equal(t, uint64(1), st.Prefix.EventsSent, "buffer of one")
	assert.Positive(t, st.Prefix.EventsDropped)

	_, err = l3.CachePrefix(0)
	require.NoError(t, err)
	require.NoError(t, l3.Commit(21))
	_, err = l3.CachePrefix(20)
	require.NoError(t, err)
	require.NoError(t, p.Close())
	require.NoError(t, p.Check())
	st = p.Stats()
	assert.Equal(t, 0, st.CachedPages+st.InUsePages, "a closed pool keeps no KV")
	ev, ok := <-p.Events()
	assert.True(t, ok)
	assert.Equal(t, KVStored, ev.Kind)
	for range p.Events() {
	}
	require.ErrorIs(t, p.ClearPrefixCache(), ErrPoolClosed)
}
