package kvcache

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The reference model keys pages by their content (domain, adapter and
// every token up to the page's end) instead of hashes, and keeps its own
// LRU list, so it is independent of the pool's key derivation and index.

type mEntry struct {
	content string
	domain  string
	page    int32
	refs    map[string]int // tenant → leases holding the page
	cached  bool           // no lease holds it; on the LRU list
}

type mLease struct {
	l         *Lease
	tenant    string
	domain    string
	tokens    []int32
	pages     []int32
	published int
}

type prefixModel struct {
	t       *testing.T
	p       *Pool
	total   int
	quota   map[string]int
	domain  map[string]string // tenant → domain name
	free    int
	entries map[string]*mEntry // domain + content → entry (indexed only)
	byPage  map[int32]*mEntry  // every entry, detached ones too
	lru     []*mEntry          // least recently used first
	leases  map[string]*mLease
	hits    map[string]uint64 // domain → hit pages
	evicted map[string]uint64
	nextID  int
}

func contentKey(domain string, toks []int32, pages int) string {
	var b strings.Builder
	b.WriteString(domain)
	for _, t := range toks[:pages*prefixTPP] {
		fmt.Fprintf(&b, ",%d", t)
	}
	return b.String()
}

func (m *prefixModel) used(tenant string) int {
	n := 0
	seen := map[int32]bool{}
	for _, ml := range m.leases {
		if ml.tenant != tenant {
			continue
		}
		for _, pg := range ml.pages {
			if m.byPage[pg] != nil {
				if seen[pg] {
					continue
				}
				seen[pg] = true
			}
			n++
		}
	}
	return n
}

func (m *prefixModel) lruRemove(e *mEntry) {
	i := slices.Index(m.lru, e)
	require.GreaterOrEqual(m.t, i, 0)
	m.lru = slices.Delete(m.lru, i, i+1)
	e.cached = false
}

func (m *prefixModel) admit(rng *rand.Rand, tenant string, toks []int32, maxNew int) {
	m.nextID++
	id := fmt.Sprintf("r%d", m.nextID)
	dom := m.domain[tenant]
	need := (len(toks) + maxNew + prefixTPP - 1) / prefixTPP
	// Expected hits: the longest cached content prefix, never the last
	// prompt token's page.
	var hits []*mEntry
	for i := 1; i <= (len(toks)-1)/prefixTPP; i++ {
		e := m.entries[contentKey(dom, toks, i)]
		if e == nil {
			break
		}
		hits = append(hits, e)
	}
	fresh := need - len(hits)
	charge := fresh
	cachedHits := 0
	for _, e := range hits {
		if e.refs[tenant] == 0 {
			charge++
		}
		if e.cached {
			cachedHits++
		}
	}
	var wantErr error
	switch {
	case need > m.total:
		wantErr = ErrExceedsCapacity
	case need > m.quota[tenant]:
		wantErr = ErrExceedsQuota
	case m.used(tenant)+charge > m.quota[tenant]:
		wantErr = ErrExceedsQuota
	case fresh > m.free+len(m.lru)-cachedHits:
		wantErr = ErrPoolExhausted
	}
	before := m.p.Stats()
	l, err := m.p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: len(toks), MaxNewTokens: maxNew, TokenIDs: toks})
	if wantErr != nil {
		require.ErrorIs(m.t, err, wantErr, "admit %s of %s: %d tokens, %d hits", id, tenant, len(toks), len(hits))
		after := m.p.Stats()
		require.Equal(m.t, before.FreePages, after.FreePages, "a refusal changes nothing")
		require.Equal(m.t, before.CachedPages, after.CachedPages, "a refusal evicts nothing")
		return
	}
	require.NoError(m.t, err, "admit %s of %s", id, tenant)
	// Eviction: least recently used, never this request's hits.
	if short := fresh - m.free; short > 0 {
		for i := 0; short > 0; {
			e := m.lru[i]
			if slices.Contains(hits, e) {
				i++
				continue
			}
			m.lruRemove(e)
			delete(m.entries, e.content)
			delete(m.byPage, e.page)
			m.evicted[e.domain]++
			m.free++
			short--
		}
	}
	m.free -= fresh
	table := tableOf(m.t, l)
	require.Len(m.t, table, need)
	require.Equal(m.t, len(hits)*prefixTPP, l.HitTokens(), "admit %s of %s", id, tenant)
	for i, e := range hits {
		require.Equal(m.t, e.page, table[i], "hit page %d", i)
		if e.cached {
			m.lruRemove(e)
		}
		e.refs[tenant]++
	}
	m.hits[dom] += uint64(len(hits))
	m.leases[id] = &mLease{l: l, tenant: tenant, domain: dom, tokens: toks, pages: table, published: len(hits)}
	_ = rng
}

func (m *prefixModel) cache(ml *mLease, n int) {
	require.NoError(m.t, ml.l.Commit(max(n, ml.l.Written())))
	got, err := ml.l.CachePrefix(n)
	require.NoError(m.t, err)
	upTo := n / prefixTPP
	for i := ml.published; i < upTo; i++ {
		key := contentKey(ml.domain, ml.tokens, i+1)
		if m.entries[key] != nil || m.byPage[ml.pages[i]] != nil {
			continue
		}
		e := &mEntry{content: key, domain: ml.domain, page: ml.pages[i], refs: map[string]int{ml.tenant: 1}}
		m.entries[key] = e
		m.byPage[e.page] = e
	}
	ml.published = max(ml.published, upTo)
	require.Equal(m.t, ml.published*prefixTPP, got)
}

func (m *prefixModel) release(id string) {
	ml := m.leases[id]
	require.NoError(m.t, ml.l.Release())
	delete(m.leases, id)
	for i := len(ml.pages) - 1; i >= 0; i-- {
		pg := ml.pages[i]
		e := m.byPage[pg]
		if e == nil {
			m.free++
			continue
		}
		if e.refs[ml.tenant]--; e.refs[ml.tenant] == 0 {
			delete(e.refs, ml.tenant)
		}
		if len(e.refs) > 0 {
			continue
		}
		if m.entries[e.content] != e { // detached by a clear
			delete(m.byPage, pg)
			m.free++
			continue
		}
		e.cached = true
		m.lru = append(m.lru, e)
	}
}

func (m *prefixModel) clear() {
	require.NoError(m.t, m.p.ClearPrefixCache())
	for _, e := range m.lru {
		delete(m.byPage, e.page)
		m.evicted[e.domain]++
		m.free++
	}
	m.lru = nil
	clear(m.entries)
}

func (m *prefixModel) verify() {
	m.t.Helper()
	require.NoError(m.t, m.p.Check())
	st := m.p.Stats()
	require.Equal(m.t, m.free, st.FreePages, "free pages")
	require.Equal(m.t, len(m.lru), st.CachedPages, "cached pages")
	require.Zero(m.t, st.QuarantinedPages)
	for _, ts := range st.Tenants {
		require.Equal(m.t, m.used(ts.Name), ts.UsedPages, "tenant %s", ts.Name)
	}
	for _, d := range st.Prefix.Domains {
		require.Equal(m.t, m.hits[d.Name], d.HitPages, "domain %s hits", d.Name)
		require.Equal(m.t, m.evicted[d.Name], d.EvictedPages, "domain %s evictions", d.Name)
	}
}

func TestPrefixReferenceModel(t *testing.T) {
	for seed := range uint64(8) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			runPrefixModel(t, seed, 400)
		})
	}
}

func runPrefixModel(t *testing.T, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, 99))
	tenants := []TenantConfig{
		{Name: "t0", Domain: "org"},
		{Name: "t1", Domain: "org"},
		{Name: "t2"},
		{Name: "t3", QuotaPages: 10},
	}
	const total = 24
	p := newPrefixPool(t, total, PrefixConfig{}, tenants...)
	m := &prefixModel{t: t, p: p, total: total, free: total,
		quota:   map[string]int{"t0": total, "t1": total, "t2": total, "t3": 10},
		domain:  map[string]string{},
		entries: map[string]*mEntry{}, byPage: map[int32]*mEntry{},
		leases: map[string]*mLease{}, hits: map[string]uint64{}, evicted: map[string]uint64{}}
	for _, tc := range tenants {
		m.domain[tc.Name] = "tenant:" + tc.Name
		if tc.Domain != "" {
			m.domain[tc.Name] = tc.Domain
		}
	}
	// Three system prompts; requests extend one of them.
	systems := [][]int32{tokens(12, 12, 0), tokens(9, 0, 1), tokens(5, 0, 2)}
	names := []string{"t0", "t1", "t2", "t3"}
	for step := range steps {
		switch op := rng.IntN(20); {
		case op < 6:
			sys := systems[rng.IntN(len(systems))]
			toks := slices.Clone(sys[:max(0, len(sys)-rng.IntN(6))])
			for range 1 + rng.IntN(10) {
				toks = append(toks, int32(rng.IntN(3))) // tiny alphabet: suffixes collide often
			}
			m.admit(rng, names[rng.IntN(len(names))], toks, rng.IntN(6))
		case op < 11 && len(m.leases) > 0:
			ml := m.leases[anyKey(rng, m.leases)]
			m.cache(ml, rng.IntN(len(ml.tokens)+1))
		case op < 18 && len(m.leases) > 0:
			m.release(anyKey(rng, m.leases))
		case op == 18:
			name := names[rng.IntN(len(names))]
			dom := []string{"", "org", "other"}[rng.IntN(3)]
			require.NoError(t, p.UpdateTenant(TenantConfig{Name: name, Domain: dom, QuotaPages: map[string]int{"t3": 10}[name]}))
			m.domain[name] = dom
			if dom == "" {
				m.domain[name] = "tenant:" + name
			}
		case op == 19 && rng.IntN(4) == 0:
			m.clear()
		}
		m.verify()
		if t.Failed() {
			t.Fatalf("step %d", step)
		}
	}
	for id := range m.leases {
		m.release(id)
		m.verify()
	}
	t.Logf("prefix %+v, refused %+v", m.p.Stats().Prefix, m.p.Stats().Refused)
	assert.Positive(t, m.p.Stats().Prefix.Domains[0].HitPages+m.p.Stats().Prefix.Domains[1].HitPages, "the trace must exercise sharing")
}

func anyKey[V any](rng *rand.Rand, m map[string]V) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys[rng.IntN(len(keys))]
}
