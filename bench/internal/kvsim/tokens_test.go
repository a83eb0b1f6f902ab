package kvsim

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvcache"
)

// pageKeys derives the page keys of r's prompt as the simulator does, in a
// pool of tenant "t" at tokensPerPage.
func pageKeys(t *testing.T, tokensPerPage, blockTokens int, r *Request) []kvcache.BlockKey {
	t.Helper()
	g := kvcache.Geometry{TokensPerPage: tokensPerPage, Layers: 1, KVHeads: 1, HeadDim: 2, DType: kvcache.FP16}
	pool, err := kvcache.New(kvcache.Config{Geometry: g, Pages: 4, MaxContextTokens: 4 * tokensPerPage, AllowUndersizedPool: true,
		Tenants: []kvcache.TenantConfig{{Name: "t"}}})
	require.NoError(t, err)
	defer pool.Close()
	keys, err := pool.PageKeys("t", "", AppendPromptTokens(nil, 1, r, blockTokens), nil)
	require.NoError(t, err)
	return keys
}

// Equal block chains give equal page keys at every page size that divides
// the block size; chains that differ in a block share no page from that
// block on, even when their IDs differ only in high bits (the ID is
// spelled in 17-bit digits: 1 and 1+1<<51 differ in the fourth token only),
// and whatever follows.
func TestBlockChainKeys(t *testing.T) {
	const block = 64
	chain := func(prompt int, ids ...int64) *Request {
		return &Request{ID: fmt.Sprint(ids), Tenant: "t", Prompt: prompt, Blocks: ids}
	}
	base := chain(3*block, 1, 2, 3)
	for _, tpp := range []int{4, 8, 16, 32, 64} {
		t.Run(fmt.Sprintf("page=%d", tpp), func(t *testing.T) {
			perBlock := block / tpp
			want := pageKeys(t, tpp, block, base)
			require.Len(t, want, 3*perBlock)
			assert.Equal(t, want, pageKeys(t, tpp, block, chain(3*block, 1, 2, 3)), "same chain, same keys")
			// Another request of the same chain, its last block partial:
			// the same keys for the pages it fills.
			partial := pageKeys(t, tpp, block, chain(2*block+block/2, 1, 2, 3))
			assert.Equal(t, want[:len(partial)], partial)
			for _, tt := range []struct {
				name   string
				r      *Request
				shared int // leading pages shared with base
			}{
				{"third block differs", chain(3*block, 1, 2, 4), 2 * perBlock},
				{"first block differs, rest alike", chain(3*block, 9, 2, 3), 0},
				{"IDs differ in the high digit only", chain(3*block, 1, 2+1<<51, 3), perBlock},
				{"IDs differ in bit 62", chain(3*block, 1|1<<62, 2, 3), 0},
			} {
				got := pageKeys(t, tpp, block, tt.r)
				require.Len(t, got, len(want), tt.name)
				assert.Equal(t, want[:tt.shared], got[:tt.shared], "%s: the pages before the difference are shared", tt.name)
				for i := tt.shared; i < len(want); i++ {
					assert.NotEqual(t, want[i], got[i], "%s: page %d shared after the chains differ", tt.name, i)
				}
			}
		})
	}
}

// Mooncake's blocks at kvbench's default page size and at the block size.
func TestBlockChainKeysMooncakeSizes(t *testing.T) {
	a := &Request{ID: "a", Tenant: "t", Prompt: 1500, Blocks: []int64{0, 14, 15}}
	b := &Request{ID: "b", Tenant: "t", Prompt: 1100, Blocks: []int64{0, 14, 77}}
	for _, tpp := range []int{16, MooncakeBlockTokens} {
		ka, kb := pageKeys(t, tpp, MooncakeBlockTokens, a), pageKeys(t, tpp, MooncakeBlockTokens, b)
		shared := 2 * MooncakeBlockTokens / tpp
		assert.Equal(t, ka[:shared], kb[:shared], "page %d: blocks 0 and 14 shared", tpp)
		for i := shared; i < len(kb); i++ {
			assert.NotEqual(t, ka[i], kb[i], "page size %d, page %d", tpp, i)
		}
	}
}

// Block tokens are deterministic, in the vocabulary, and follow the seed.
func TestBlockTokens(t *testing.T) {
	r := &Request{ID: "x", Prompt: 1000, Blocks: []int64{5, 6}}
	a := AppendPromptTokens(nil, 3, r, 512)
	require.Len(t, a, 1000)
	assert.Equal(t, a, AppendPromptTokens(nil, 3, r, 512))
	assert.NotEqual(t, a[:4], AppendPromptTokens(nil, 4, r, 512)[:4], "another seed, other tokens")
	r2 := &Request{ID: "other ID, same chain", Prompt: 600, Blocks: []int64{5, 6}}
	assert.Equal(t, a[:600], AppendPromptTokens(nil, 3, r2, 512), "tokens follow from the blocks, not the request")
	for _, tok := range a {
		require.True(t, tok >= 0 && tok < Vocab)
	}
}
