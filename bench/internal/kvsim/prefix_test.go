package kvsim

import (
	"encoding/binary"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// prefixTrace: tenants a and b form the organisation "org", c is alone
// but sends the same system prompt (prefix_id "org") from its own domain.
// Tiny geometry: 16 tokens per page; a prompt of P tokens looks up its
// first (P-1)/16 full pages.
const prefixTrace = `{"type":"tenant","name":"a","domain":"org"}
{"type":"tenant","name":"b","domain":"org"}
{"type":"tenant","name":"c"}
{"type":"request","at":0,"id":"r1","tenant":"a","prompt":100,"prefix":64,"output":4}
{"type":"request","at":0.5,"id":"r2","tenant":"a","prompt":80,"prefix":64,"output":4}
{"type":"request","at":1,"id":"r3","tenant":"b","prompt":70,"prefix":64,"output":4}
{"type":"request","at":1.5,"id":"r4","tenant":"c","prompt":70,"prefix":64,"prefix_id":"org","output":4}
{"type":"request","at":2,"id":"r5","tenant":"c","prompt":70,"prefix":64,"prefix_id":"org","output":4}
`

func prefixConfig(policy, domains string) RunConfig {
	cfg := handConfig(policy)
	cfg.Duration, cfg.PrefixCache, cfg.Domains, cfg.Seed = 3*time.Second, true, domains, 7
	return cfg
}

// Hits by request (pages of 16 tokens):
//
//	r1 a  6 looked up, 6 miss; publishes 6 pages (org)
//	r2 a  4 looked up, 4 hit (tokens 0..63); publishes its page 4
//	r3 b  4 looked up: shared → 4 hit (a's pages); per-tenant → 4 miss, publishes 4
//	r4 c  4 looked up, 4 miss (same tokens, its own domain); publishes 4
//	r5 c  4 looked up, 4 hit
func TestRunPrefixHandTrace(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(prefixTrace), "prefix")
	require.NoError(t, err)
	tokenBytes := uint64(tinyGeometry.TokenBytes())
	tests := []struct {
		domains                        string
		nDomains                       int
		hits, misses, stored, kvTokens uint64
		perDomainHits                  map[string]uint64
	}{
		{DomainsShared, 2, 12, 10, 11, 104 + 20 + 10 + 74 + 10, map[string]uint64{"org": 8, "tenant:c": 4}},
		{DomainsPerTenant, 3, 8, 14, 15, 104 + 20 + 74 + 74 + 10, map[string]uint64{"tenant:a": 4, "tenant:b": 0, "tenant:c": 4}},
	}
	for _, tt := range tests {
		for _, policy := range Policies {
			t.Run(tt.domains+"/"+policy, func(t *testing.T) {
				res, err := Run(tr, prefixConfig(policy, tt.domains))
				require.NoError(t, err)
				px := res.Prefix
				assert.True(t, px.Enabled)
				assert.Equal(t, tt.nDomains, px.Domains)
				assert.Equal(t, tt.hits, px.HitPages)
				assert.Equal(t, tt.misses, px.MissPages)
				assert.Equal(t, tt.hits+tt.misses, px.LookupPages)
				assert.InDelta(t, float64(tt.hits)/float64(tt.hits+tt.misses), px.HitRate, 1e-12)
				assert.Equal(t, 16*tt.hits, px.HitTokens)
				assert.True(t, px.LeaseHitTokensMatch, "pool counters = sum of Lease.HitTokens")
				assert.Equal(t, 16*tt.hits*tokenBytes, px.PrefillBytesAvoided)
				assert.InDelta(t, float64(16*tt.hits)/390, px.PromptHitShare, 1e-12)
				assert.Equal(t, tt.stored, px.StoredPages)
				assert.Zero(t, px.EvictedPages, "64 pages hold everything")
				assert.Equal(t, int(tt.stored), px.CachedPagesAtEnd)
				hits := map[string]uint64{}
				for _, d := range px.PerDomain {
					hits[d.Name] = d.HitPages
				}
				assert.Equal(t, tt.perDomainHits, hits)
				assert.Equal(t, tt.kvTokens*tokenBytes, res.KVBytesWritten, "hit tokens are not written")
				assert.EqualValues(t, 5*4, res.TokensGenerated)
				assert.EqualValues(t, 5, res.Completed)
				assert.Equal(t, tt.hits, res.Audit.HitPagesChecked, "every hit page checked")
				assert.Zero(t, res.Audit.ForeignHitPages)
				assert.Zero(t, res.Audit.EmptyHitPages)
				if policy == Baseline {
					return
				}
				assert.True(t, res.Audit.Passed, res.Audit.Summary)
				// Only the pages nobody published are scrubbed at release: the
				// last page of each request (cached pages wait for eviction).
				assert.EqualValues(t, 5, res.PagesScrubbed)
			})
		}
	}
}

// The same trace with the prefix cache off: no lookups, every prompt
// token is written, and published pages are not kept.
func TestRunPrefixCacheOff(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(prefixTrace), "prefix")
	require.NoError(t, err)
	cfg := prefixConfig("zero", DomainsShared)
	cfg.PrefixCache = false
	res, err := Run(tr, cfg)
	require.NoError(t, err)
	assert.False(t, res.Prefix.Enabled)
	assert.Zero(t, res.Prefix.LookupPages)
	assert.Zero(t, res.Prefix.HitTokens)
	assert.Equal(t, (390+20)*uint64(tinyGeometry.TokenBytes()), res.KVBytesWritten)
	assert.EqualValues(t, 7+6+5+5+5, res.PagesScrubbed, "every page scrubbed at release")
}

// With a prefill budget, a prefix hit saves virtual prefill time: r2 has
// 16 tokens left to compute instead of 80.
func TestRunPrefillBudget(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(prefixTrace), "prefix")
	require.NoError(t, err)
	ttft := func(prefix bool) TTFTSummary {
		cfg := prefixConfig("zero", DomainsShared)
		cfg.PrefixCache, cfg.PrefillTokens = prefix, 16
		res, err := Run(tr, cfg)
		require.NoError(t, err)
		require.EqualValues(t, 5, res.Completed)
		return res.TTFT
	}
	on, off := ttft(true), ttft(false)
	assert.Equal(t, 5, on.N)
	// Steps of 10 ms computing 16 tokens each: off, prompts of 100, 80,
	// 70, 70, 70 tokens take 7, 5, 5, 5, 5 steps; on, r2, r3 and r5 have
	// 16, 6 and 6 tokens left: 1 step each, r4 computes all 70.
	assert.InDelta(t, (7+5+5+5+5)*0.010/5, off.Mean, 1e-9)
	assert.InDelta(t, (7+1+1+5+1)*0.010/5, on.Mean, 1e-9)
}

// Prefix caching on, a synthetic workload with organisations and a pool
// small enough to evict: every safe policy passes the audit (fresh pages
// scrubbed, hit pages hold their own domain's KV); the unsafe baseline
// fails it on stale fresh pages only.
func TestRunPrefixAuditSynthetic(t *testing.T) {
	tr, err := Generate(GenConfig{Seed: 5, Duration: 3 * time.Second, Rate: 40, Tenants: 8, OrgSize: 4,
		AbortFraction: 0.1, CapacityTokens: 256 * 16, MaxContext: 8192, TokensPerPage: 16})
	require.NoError(t, err)
	for _, domains := range DomainModes {
		for _, policy := range Policies {
			t.Run(domains+"/"+policy, func(t *testing.T) {
				cfg := prefixConfig(policy, domains)
				cfg.PoolPages, cfg.MaxContext, cfg.Duration, cfg.QueueTimeout = 256, 8192, 3*time.Second, 500*time.Millisecond
				cfg.PrefillTokens = 512
				res, err := Run(tr, cfg)
				require.NoError(t, err)
				assert.Positive(t, res.Prefix.HitPages)
				assert.Positive(t, res.Prefix.EvictedPages, "a pool this small evicts")
				// The served bound counts what the run admitted as the pool
				// does, with an infinite cache: the same lookups, no fewer hits.
				sb := res.Prefix.ServedBound
				assert.Equal(t, res.Prefix.LookupPages, sb.LookupPages)
				assert.EqualValues(t, res.Admitted, sb.Requests)
				assert.LessOrEqual(t, res.Prefix.HitPages, sb.HitPages, "an infinite cache hits at least as much")
				assert.True(t, res.Prefix.LeaseHitTokensMatch)
				assert.Positive(t, res.Audit.HitPagesChecked)
				assert.Zero(t, res.Audit.ForeignHitPages+res.Audit.EmptyHitPages)
				if policy == Baseline {
					assert.False(t, res.Audit.Passed)
					assert.Positive(t, res.Audit.StalePages)
					return
				}
				assert.True(t, res.Audit.Passed, res.Audit.Summary)
				assert.Positive(t, res.Audit.PagesChecked)
			})
		}
	}
}

// The hit check can fail: a hit page overwritten with KV of a tenant of
// another domain, or scrubbed, fails the run, even for the baseline.
func TestRunPrefixAuditCatchesForeignHit(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(prefixTrace), "prefix")
	require.NoError(t, err)
	for _, tt := range []struct {
		name   string
		word   uint32
		policy string
	}{
		{"foreign", markerWord(2, 9), "zero"}, // tenant c's KV in org's page
		{"foreign-baseline", markerWord(2, 9), Baseline},
		{"scrubbed", 0, "poison"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := prefixConfig(tt.policy, DomainsShared)
			cfg.afterAdmit = func(s *sim, a *active) {
				if a.req.ID != "r3" {
					return
				}
				require.Positive(t, a.hit)
				// The last word of the second hit page in the last region.
				page := s.host.PageBytes(s.cfg.Geometry.Regions()-1, a.table[1])
				binary.LittleEndian.PutUint32(page[len(page)-4:], tt.word)
			}
			res, err := Run(tr, cfg)
			require.ErrorIs(t, err, ErrAuditFailed)
			require.NotNil(t, res)
			if tt.word == 0 {
				assert.EqualValues(t, 1, res.Audit.EmptyHitPages)
			} else {
				assert.EqualValues(t, 1, res.Audit.ForeignHitPages)
				assert.Contains(t, strings.Join(res.Audit.Examples, "\n"), `KV of tenant "c" of domain "tenant:c"`)
			}
			assert.Contains(t, res.Audit.Summary, "prefix-hit pages")
		})
	}
}

// overloadTrace keeps requests queued and retried for most of the run.
// Pool: 64 pages of 16 tokens, steps of 10 ms. hog (a, 52 pages, 80 steps)
// and q1 (q, its whole quota of 8 pages, 88 steps) fill 60; q2 and q3 (2
// pages each) are over q's quota and are retried every step without
// holding the queue until q1 ends; w1 (a, 8 pages) finds 4 free and holds
// the queue, with w2..w5 behind it, until hog ends.
const overloadTrace = `{"type":"tenant","name":"a"}
{"type":"tenant","name":"q","quota_pages":8}
{"type":"request","at":0,"id":"hog","tenant":"a","prompt":752,"output":80}
{"type":"request","at":0,"id":"q1","tenant":"q","prompt":40,"output":88}
{"type":"request","at":0.01,"id":"q2","tenant":"q","prompt":20,"output":4}
{"type":"request","at":0.01,"id":"q3","tenant":"q","prompt":20,"output":4}
{"type":"request","at":0.02,"id":"w1","tenant":"a","prompt":100,"output":20,"max_new":28}
{"type":"request","at":0.02,"id":"w2","tenant":"a","prompt":100,"output":20,"max_new":28}
{"type":"request","at":0.02,"id":"w3","tenant":"a","prompt":100,"output":20,"max_new":28}
{"type":"request","at":0.02,"id":"w4","tenant":"a","prompt":100,"output":20,"max_new":28}
{"type":"request","at":0.02,"id":"w5","tenant":"a","prompt":100,"output":20,"max_new":28}
`

// Every request's token IDs and page keys are derived once, however often
// it is retried. The simulator re-derived the tokens of a request on most
// retries (its cache lived in a struct recycled to the next request on
// every refusal) and passed them as TokenIDs, which kvcache hashes on every
// admission: on an overloaded pool that was 99 % of the run's CPU.
func TestRunDerivesKeysOnce(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(overloadTrace), "overload")
	require.NoError(t, err)
	cfg := prefixConfig("zero", DomainsPerTenant)
	cfg.Duration, cfg.QueueTimeout = 1500*time.Millisecond, 10*time.Second
	derived := map[string]int{}
	cfg.onKeys = func(r *Request) { derived[r.ID]++ }
	res, err := Run(tr, cfg)
	require.NoError(t, err)

	// The run was overloaded: q2 and q3 were refused every step until q1
	// ended, w1 until hog did.
	assert.GreaterOrEqual(t, res.Refusals["exceeds_quota"], uint64(2*80), "q2 and q3 retried every step")
	assert.GreaterOrEqual(t, res.Refusals["pool_exhausted"], uint64(70), "w1 retried until hog ended")
	assert.EqualValues(t, 9, res.Admitted)
	assert.EqualValues(t, 9, res.Completed)
	want := map[string]int{"hog": 1, "q1": 1, "q2": 1, "q3": 1, "w1": 1, "w2": 1, "w3": 1, "w4": 1, "w5": 1}
	assert.Equal(t, want, derived, "each request's keys derived once")
	assert.EqualValues(t, len(want), res.Prefix.KeyDerivations)
	assert.Positive(t, res.Prefix.KeySeconds)
	// The pool used the keys it was given: every admission looked up its
	// full pages before the last prompt token (no prompt shares content
	// with another here, so all miss): hog 46, q1 2, q2 and q3 1, w 6 each.
	assert.EqualValues(t, 46+2+1+1+5*6, res.Prefix.LookupPages)
	assert.EqualValues(t, res.Prefix.LookupPages, res.Prefix.MissPages)
}
