package kvcache

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// TestPrefixCanaryManyDomains is the canary-marker leak test with prefix
// sharing across many domains. Tenants of several domains send the same
// system prompts (equal tokens, different domains). After each admission
// the engine side writes, into every byte of every fresh page, a marker
// that names the page's domain and content, as computed KV would; shared
// pages already hold the publisher's marker. The test asserts, for every
// lease ever admitted, that each shared page holds exactly its own
// domain's marker for that prefix and each fresh page holds exactly the
// scrub pattern: no lease ever receives a page carrying another domain's
// marker, or any stale data.
func TestPrefixCanaryManyDomains(t *testing.T) {
	for _, policy := range []ScrubPolicy{{Kind: ScrubZero}, {Kind: ScrubPoison}, {Kind: ScrubCanary}} {
		t.Run(policy.Kind.String(), func(t *testing.T) {
			runCanaryManyDomains(t, policy, 1500)
		})
	}
}

// marker fills a page with a pattern derived from its domain and the
// content it holds.
func marker(dst []byte, domain, content string) {
	sum := sha256.Sum256([]byte(domain + "\x00" + content))
	for i := 0; i < len(dst); i += len(sum) {
		copy(dst[i:], sum[:])
	}
}

func runCanaryManyDomains(t *testing.T, policy ScrubPolicy, steps int) {
	var tenants []TenantConfig
	for i := range 12 {
		tc := TenantConfig{Name: fmt.Sprintf("t%02d", i)}
		switch {
		case i < 3:
			tc.Domain = "public"
		case i < 5:
			tc.Domain = "org-a"
		case i < 7:
			tc.Domain = "org-b"
		}
		tenants = append(tenants, tc) // the rest: private domains
	}
	const total = 48
	p, err := New(Config{Geometry: prefixGeometry, Pages: total, MaxContextTokens: total * prefixTPP,
		Tenants: tenants, Scrub: policy})
	require.NoError(t, err)
	defer p.Close()
	host := p.dev.(*cudaops.Host)
	spec := p.q.Spec()
	regions := prefixGeometry.Regions()
	// A new pool's pages have never been filled (see the report to the
	// lead: a canary pool would fault on its first admission), so start
	// from pages holding the policy's pattern, as after a scrub.
	all := make([]int32, total)
	for i := range all {
		all[i] = int32(i)
	}
	fence, err := host.Fill(all, spec, cudaops.Ordering{})
	require.NoError(t, err)
	require.NoError(t, fence.Wait())
	rng := rand.New(rand.NewPCG(7, uint64(policy.Kind)))
	systems := [][]int32{tokens(16, 16, 0), tokens(11, 0, 1), tokens(24, 0, 2)}

	type live struct {
		l      *Lease
		domain string
		toks   []int32
	}
	var leases []live
	contentOf := func(toks []int32, page int, id string) string {
		if (page+1)*prefixTPP <= len(toks) {
			return fmt.Sprint(toks[:(page+1)*prefixTPP]) // a full prompt page: its prefix
		}
		return "private " + id // partial or output page: the request's own
	}
	want := make([]byte, prefixGeometry.RegionPageBytes())
	shared, fresh := 0, 0
	for step := range steps {
		switch rng.IntN(3) {
		case 0, 1:
			tc := tenants[rng.IntN(len(tenants))]
			sys := systems[rng.IntN(len(systems))]
			toks := slices.Clone(sys[:len(sys)-rng.IntN(4)])
			for range 1 + rng.IntN(6) {
				toks = append(toks, int32(rng.IntN(2)))
			}
			id := fmt.Sprintf("r%d", step)
			l, err := p.TryAdmit(Request{ID: id, Tenant: tc.Name, PromptTokens: len(toks), MaxNewTokens: rng.IntN(5), TokenIDs: toks})
			if err != nil {
				require.ErrorIs(t, err, ErrPoolExhausted)
				continue
			}
			table := tableOf(t, l)
			hit := l.HitTokens() / prefixTPP
			for i, page := range table {
				if i < hit {
					marker(want, l.Domain(), contentOf(toks, i, id))
					shared++
				} else {
					w := spec.WordFor(page)
					for off := 0; off < len(want); off += 4 {
						binary.LittleEndian.PutUint32(want[off:], w)
					}
					fresh++
				}
				for r := range regions {
					require.Equal(t, want, host.PageBytes(r, page),
						"step %d: lease %s (domain %s) page %d (index %d, hit %v) region %d", step, id, l.Domain(), page, i, i < hit, r)
				}
			}
			// The engine computes the rest of the prompt and output.
			for i := hit; i < len(table); i++ {
				for r := range regions {
					marker(host.PageBytes(r, table[i]), l.Domain(), contentOf(toks, i, id))
				}
			}
			require.NoError(t, l.Commit(len(toks)))
			_, err = l.CachePrefix(rng.IntN(len(toks) + 1))
			require.NoError(t, err)
			leases = append(leases, live{l, l.Domain(), toks})
		case 2:
			if len(leases) == 0 {
				continue
			}
			i := rng.IntN(len(leases))
			require.NoError(t, leases[i].l.Release())
			leases = slices.Delete(leases, i, i+1)
		}
		require.NoError(t, p.Check())
	}
	require.Positive(t, shared, "the trace must share pages")
	require.Positive(t, p.Stats().Prefix.Domains[0].EvictedPages+p.Stats().Prefix.Domains[1].EvictedPages, "the trace must evict")
	t.Logf("%d shared and %d fresh pages verified, %d evicted in all", shared, fresh, evictedTotal(p))
}

func evictedTotal(p *Pool) uint64 {
	n := uint64(0)
	for _, d := range p.Stats().Prefix.Domains {
		n += d.EvictedPages
	}
	return n
}
