package kvsim

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Pages of 16 tokens, blocks of 64 (4 pages):
//
//	r1 [1 2]    128 tokens: looks up 7 pages, hits 0; publishes 8 (blocks 1, 2 whole)
//	r2 [1 2 3]  150 tokens: looks up 9, hits 8 (blocks 1, 2); publishes 9 pages (16 tokens of block 3)
//	r3 [1 9]    100 tokens: looks up 6, hits 4 (block 1; block 9 after 1 is new)
//	r4 [1 2 3]  140 tokens: looks up 8, hits 8 (blocks 1, 2 and 12 of block 3's 16 published tokens,
//	            then the page holding its last token is not looked up)
//	r5 [2 1]    128 tokens: looks up 7, hits 0 (block 2 at the root is not block 2 after block 1)
//	long [1 2]  its prompt + max_new exceed the window: left out
//	big  [1 2 3 …] 1500 tokens, within the window (2048 tokens), not the pool (1024): left out
//	            at the pool's limit; at the window's, looks up 93 pages and hits 9 (blocks 1, 2,
//	            and the 16 published tokens of block 3)
const boundTrace = `{"type":"trace","block_tokens":64}
{"type":"tenant","name":"a"}
{"type":"request","at":0,"id":"r1","tenant":"a","prompt":128,"blocks":[1,2],"output":1}
{"type":"request","at":1,"id":"r2","tenant":"a","prompt":150,"blocks":[1,2,3],"output":1}
{"type":"request","at":2,"id":"r3","tenant":"a","prompt":100,"blocks":[1,9],"output":1}
{"type":"request","at":3,"id":"r4","tenant":"a","prompt":140,"blocks":[1,2,3],"output":1}
{"type":"request","at":4,"id":"r5","tenant":"a","prompt":128,"blocks":[2,1],"output":1}
{"type":"request","at":5,"id":"long","tenant":"a","prompt":128,"blocks":[1,2],"output":1,"max_new":2000}
{"type":"request","at":6,"id":"big","tenant":"a","prompt":1500,"blocks":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24],"output":1}
`

func TestBoundBlockChains(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(boundTrace), "bound")
	require.NoError(t, err)
	b := Bound(tr, 16, 1024, DomainsPerTenant)
	assert.Equal(t, PrefixBound{Domains: DomainsPerTenant, Requests: 5, MaxTokens: 1024, LookupPages: 7 + 9 + 6 + 8 + 7, HitPages: 8 + 4 + 8,
		HitRate: 20.0 / 37, PromptTokens: 128 + 150 + 100 + 140 + 128, HitTokens: 20 * 16, PromptHitShare: 320.0 / 646}, b)
	b = Bound(tr, 16, 2048, DomainsPerTenant)
	assert.Equal(t, 6, b.Requests)
	assert.EqualValues(t, 37+93, b.LookupPages)
	assert.EqualValues(t, 20+9, b.HitPages)
}

// The bound counts hits as the pool does, so a run whose requests never
// overlap (each is computed and published before the next arrives) on a
// pool that evicts nothing hits exactly the bound: for block chains, and
// for prefixes in both domain layouts.
func TestBoundEqualsRunWithoutContention(t *testing.T) {
	for _, tt := range []struct {
		name, trace, domains string
	}{
		{"blocks", boundTrace, DomainsPerTenant},
		{"prefixes, shared domains", prefixTrace, DomainsShared},
		{"prefixes, per-tenant domains", prefixTrace, DomainsPerTenant},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tr, err := ParseTrace(strings.NewReader(tt.trace), "t")
			require.NoError(t, err)
			cfg := prefixConfig("zero", tt.domains)
			cfg.Duration = tr.Duration() + cfg.Step*10
			res, err := Run(tr, cfg)
			require.NoError(t, err)
			require.Zero(t, res.Prefix.EvictedPages)
			b := Bound(tr, cfg.Geometry.TokensPerPage, min(cfg.MaxContext, cfg.PoolPages*cfg.Geometry.TokensPerPage), tt.domains)
			assert.Equal(t, b, res.Prefix.Bound, "the run reports the trace's bound")
			assert.Equal(t, b, res.Prefix.ServedBound, "every request it can take was served, in order")
			assert.Equal(t, res.Prefix.HitPages, b.HitPages)
			assert.Equal(t, res.Prefix.LookupPages, b.LookupPages)
			assert.Equal(t, res.Prefix.HitTokens, b.HitTokens)
		})
	}
}

// Sharing is counted inside a sharing domain: the first request of each
// domain misses what other domains published. A share of prefix tokens
// (kvbench's former "shareable" column) counts those first uses as
// shareable, and reads 100 % here, where no page can be hit.
func TestBoundFirstUseInEachDomainMisses(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(`{"type":"tenant","name":"a"}
{"type":"tenant","name":"b"}
{"type":"request","at":0,"tenant":"a","prompt":64,"prefix":64,"prefix_id":"sys","output":1}
{"type":"request","at":1,"tenant":"b","prompt":64,"prefix":64,"prefix_id":"sys","output":1}
`), "t")
	require.NoError(t, err)
	b := Bound(tr, 16, 1024, DomainsPerTenant)
	assert.EqualValues(t, 6, b.LookupPages)
	assert.Zero(t, b.HitPages)
}
