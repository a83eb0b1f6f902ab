package kvcache

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// bytesToTokens reads little-endian int32 token IDs.
func bytesToTokens(b []byte) []int32 {
	out := make([]int32, len(b)/4)
	for i := range out {
		out[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

// FuzzPageKeys checks the key chain's properties on adversarial input:
// equal tokens in two domains or under two adapters never share a key; a
// change in one token changes that page's key and every later one but no
// earlier one; a trailing partial page gets no key; derivation is
// deterministic.
func FuzzPageKeys(f *testing.F) {
	f.Add("tenant:a", "tenant:b", "", "", []byte("0123456789abcdef0123456789abcdef"), uint(17), int32(1))
	f.Add("org", "org", "", "lora-1", make([]byte, 64), uint(15), int32(0)) // last token of a page
	f.Add("a", "a\x00", "", "", make([]byte, 48), uint(0), int32(-1))
	f.Add("ab", "a", "c", "bc", []byte{1, 2, 3, 4, 5, 6, 7, 8, 9}, uint(1), int32(7)) // length-prefix ambiguity
	f.Fuzz(func(t *testing.T, domA, domB, adA, adB string, raw []byte, flip uint, delta int32) {
		toks := bytesToTokens(raw)
		for _, tpp := range []int{1, prefixTPP, 5} {
			keysA := appendPageKeys(nil, prefixRoot(domA, adA), tpp, toks)
			require.Len(t, keysA, len(toks)/tpp)
			require.Equal(t, keysA, appendPageKeys(nil, prefixRoot(domA, adA), tpp, toks))
			keysB := appendPageKeys(nil, prefixRoot(domB, adB), tpp, toks)
			if domA != domB || adA != adB {
				seen := map[BlockKey]bool{}
				for _, k := range keysA {
					seen[k] = true
				}
				for _, k := range keysB {
					require.False(t, seen[k], "domains %q/%q adapters %q/%q share a key", domA, domB, adA, adB)
				}
			} else {
				require.Equal(t, keysA, keysB)
			}
			if len(toks) == 0 || delta == 0 {
				continue
			}
			i := int(flip % uint(len(toks)))
			changed := append([]int32(nil), toks...)
			changed[i] += delta
			keysC := appendPageKeys(nil, prefixRoot(domA, adA), tpp, changed)
			for pg := range keysA {
				if pg < i/tpp {
					require.Equal(t, keysA[pg], keysC[pg], "page %d precedes the change at token %d", pg, i)
				} else {
					require.NotEqual(t, keysA[pg], keysC[pg], "page %d follows the change at token %d", pg, i)
				}
			}
		}
	})
}

// FuzzPrefixMatch publishes a prompt in one domain and matches another
// prompt from a tenant of the same and of another domain: the same domain
// shares exactly the longest common run of full pages (never the last
// prompt token's page), another domain shares nothing.
func FuzzPrefixMatch(f *testing.F) {
	f.Add([]byte("0123456789abcdef0123456789abcdef0123"), []byte("0123456789abcdef0123456789abcdefXXXX"), "")
	f.Add(make([]byte, 40), make([]byte, 40), "lora")
	f.Add([]byte("aaaabbbbccccdddd"), []byte("aaaabbbbccccddde"), "") // differs in a page's last token
	f.Fuzz(func(t *testing.T, rawPub, rawQuery []byte, adapter string) {
		pub, query := bytesToTokens(rawPub), bytesToTokens(rawQuery)
		// adapter+"x" names the weights of the third query: a name, which
		// TestNamesThatBreakWhereTheyTravelAreRefused covers when it is not.
		if len(pub) == 0 || len(query) == 0 || len(pub) > 256 || len(query) > 256 ||
			isolation.NameProblem(adapter+"x", MaxIDLen) != "" {
			return
		}
		p := newPrefixPool(t, 200, PrefixConfig{}, TenantConfig{Name: "a", Domain: "org"}, TenantConfig{Name: "b", Domain: "org"}, TenantConfig{Name: "c"})
		l := admitComputeCache(t, p, "pub", "a", pub, 0)
		defer l.Release()
		common := 0
		for common < min(len(pub), len(query)) && pub[common] == query[common] {
			common++
		}
		want := min(common/prefixTPP, (len(query)-1)/prefixTPP) * prefixTPP
		for _, tc := range []struct {
			tenant, adapter string
			want            int
		}{{"b", "", want}, {"c", "", 0}, {"b", adapter + "x", 0}} {
			q, err := p.TryAdmit(Request{ID: "q", Tenant: tc.tenant, PromptTokens: len(query), TokenIDs: query, Adapter: tc.adapter})
			require.NoError(t, err)
			assert.Equal(t, tc.want, q.HitTokens(), "tenant %s adapter %q", tc.tenant, tc.adapter)
			shared := commonPages(tableOf(t, q), tableOf(t, l))
			assert.Equal(t, tc.want/prefixTPP, shared)
			require.NoError(t, p.Check())
			require.NoError(t, q.Release())
		}
	})
}

// TestPrefixIndexCollisions drives the key index through crafted 64-bit
// index collisions: entries that share a bucket are told apart by their
// full key and domain, and unindexing any of them keeps the others.
func TestPrefixIndexCollisions(t *testing.T) {
	var c prefixIndex
	c.init(8, 1)
	d1, d2 := &tenancy.Domain{ID: 1, Name: "d1"}, &tenancy.Domain{ID: 2, Name: "d2"}
	var k1 BlockKey
	k1[31] = 1
	// k2 in d2 lands in k1's d1 bucket: its first 8 bytes absorb the
	// domain term of index64.
	k2 := k1
	binary.LittleEndian.PutUint64(k2[:8], k1.index64(1)^BlockKey{}.index64(2))
	require.Equal(t, k1.index64(1), k2.index64(2))
	k3 := k1
	k3[31] = 3
	binary.LittleEndian.PutUint64(k3[:8], k1.index64(1)^BlockKey{}.index64(1))
	require.Equal(t, k1.index64(1), k3.index64(1))

	e1 := &cacheEntry{key: k1, dom: d1, page: 1}
	e2 := &cacheEntry{key: k2, dom: d2, page: 2}
	e3 := &cacheEntry{key: k3, dom: d1, page: 3}
	for _, e := range []*cacheEntry{e1, e2, e3} {
		c.insert(e, nil)
	}
	require.Len(t, c.byKey, 1, "all three share one bucket")
	assert.Same(t, e1, c.lookup(d1, k1))
	assert.Same(t, e2, c.lookup(d2, k2))
	assert.Same(t, e3, c.lookup(d1, k3))
	assert.Nil(t, c.lookup(d2, k1), "same key, other domain")
	assert.Nil(t, c.lookup(d1, k2))
	c.unindex(e3) // middle of the chain
	assert.Nil(t, c.lookup(d1, k3))
	assert.Same(t, e1, c.lookup(d1, k1))
	assert.Same(t, e2, c.lookup(d2, k2))
	c.drop(e2)
	c.drop(e1)
	c.drop(e3)
	assert.Empty(t, c.byKey)
	assert.Equal(t, make([]*cacheEntry, 8), c.byPage)
	var ck checker
	c.check(&ck, nil)
	require.NoError(t, ck.err())
}
