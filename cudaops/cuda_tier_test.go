package cudaops_test

import (
	"bytes"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// kvcache's host tier on a CUDA pool, over the simulated driver: the tier
// is page-locked memory (cuMemAllocHost, freed at the pool's Close), a
// prefix the device evicts is copied there and back into an admission's
// fresh pages byte for byte, never into another domain's, and a failed
// copy back refuses the admission with nothing held.

// openTierPool is openHandoffPool's pool (4 regions, pages of 4 tokens)
// with a host tier of slots pages and tenants a and b in domains of
// their own.
func openTierPool(t *testing.T, pages, slots int) (*cudaops.CUDA, *cudaops.FakeDriver, *kvcache.Pool) {
	t.Helper()
	cfg := kvcache.Config{Pages: pages, MaxContextTokens: pages * handoffTPP,
		Geometry: kvcache.Geometry{TokensPerPage: handoffTPP, Layers: 2, KVHeads: 1, HeadDim: 200, DType: kvcache.FP16},
		Tenants:  []kvcache.TenantConfig{{Name: "a"}, {Name: "b"}}}
	open := func(tier int) (*cudaops.CUDA, *cudaops.FakeDriver, *kvcache.Pool) {
		d, f := openFake(t)
		require.NoError(t, d.SetFillMode(cudaops.FillMemset))
		c := cfg
		c.Device, c.HostTier = d, kvcache.HostTierConfig{Pages: tier}
		p, err := kvcache.New(c)
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		return d, f, p
	}
	_, plain, _ := open(0)
	d, f, p := open(slots)
	assert.Equal(t, plain.Calls("cuMemAllocHost_v2")+1, f.Calls("cuMemAllocHost_v2"), "the tier is one page-locked allocation")
	return d, f, p
}

// tierPrompt admits tokens for tenant, writes random KV into its pages
// through the device, publishes them and releases the lease; it returns
// the pages' bytes, page-major.
func tierPrompt(t *testing.T, d *cudaops.CUDA, p *kvcache.Pool, rng *rand.Rand, tenant string, tokens []int32) []byte {
	t.Helper()
	l, err := p.TryAdmit(kvcache.Request{ID: "prompt-" + tenant, Tenant: tenant, PromptTokens: len(tokens), TokenIDs: tokens})
	require.NoError(t, err)
	table, err := l.BlockTable()
	require.NoError(t, err)
	full := len(tokens) / handoffTPP
	content := make([]byte, full*handoffPage)
	for i := range content {
		content[i] = byte(rng.Uint32())
	}
	for i, pg := range table[:full] {
		for r := range 4 {
			off := i*handoffPage + r*handoffRegionPage
			require.NoError(t, d.WritePage(r, pg, content[off:off+handoffRegionPage]))
		}
	}
	require.NoError(t, l.Commit(len(tokens)))
	_, err = l.CachePrefix(len(tokens))
	require.NoError(t, err)
	require.NoError(t, l.Release())
	return content
}

// flushTier admits and releases a request of every page, evicting the
// device's cache into the tier.
func flushTier(t *testing.T, p *kvcache.Pool) {
	t.Helper()
	l, err := p.TryAdmit(kvcache.Request{ID: "flush", Tenant: "a", PromptTokens: p.Pages() * handoffTPP})
	require.NoError(t, err)
	require.NoError(t, l.Release())
	scrubbed(t, p)
	require.NoError(t, p.Check())
}

func TestCUDAHostTierRoundTrip(t *testing.T) {
	d, f, p := openTierPool(t, 16, 8)
	rng := rand.New(rand.NewPCG(32, 1))
	tokens := make([]int32, 6*handoffTPP+1) // 6 full pages and a token
	for i := range tokens {
		tokens[i] = int32(1000 + i)
	}
	content := tierPrompt(t, d, p, rng, "a", tokens)
	scrubbed(t, p)
	pinned0, pageable0 := f.CopiedBytes()
	flushTier(t, p)
	s := p.Stats().Tier
	require.Equal(t, uint64(6), s.Offloads)
	require.Equal(t, 6, s.Cached)
	pinned1, pageable1 := f.CopiedBytes()
	assert.Equal(t, uint64(6*handoffPage), pinned1-pinned0, "straight into page-locked memory")
	assert.Equal(t, pageable0, pageable1, "no copy through pageable memory")

	// Another domain finds nothing of it, on the device or in the tier.
	l, err := p.TryAdmit(kvcache.Request{ID: "b", Tenant: "b", PromptTokens: len(tokens), TokenIDs: tokens})
	require.NoError(t, err)
	assert.Equal(t, 0, l.HitTokens())
	require.NoError(t, l.Release())
	scrubbed(t, p)

	// The same prompt in its own domain: the pages come back from the
	// tier as hits, each holding what was written.
	l, err = p.TryAdmit(kvcache.Request{ID: "again", Tenant: "a", PromptTokens: len(tokens), TokenIDs: tokens})
	require.NoError(t, err)
	require.Equal(t, 6*handoffTPP, l.HitTokens())
	assert.Equal(t, uint64(6), p.Stats().Tier.Onloads)
	table, err := l.BlockTable()
	require.NoError(t, err)
	var got []byte
	for _, pg := range table[:6] {
		for r := range 4 {
			got = append(got, readPage(t, d, r, pg)...)
		}
	}
	assert.True(t, bytes.Equal(content, got), "onloaded pages hold the prompt's KV")
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())

	// Close frees the page-locked memory.
	freed := f.Calls("cuMemFreeHost")
	require.NoError(t, p.Close())
	assert.Equal(t, 1, f.Calls("cuMemFreeHost")-freed)
}

func TestCUDAHostTierFailedOnload(t *testing.T) {
	d, f, p := openTierPool(t, 16, 8)
	rng := rand.New(rand.NewPCG(32, 2))
	tokens := make([]int32, 4*handoffTPP+1)
	for i := range tokens {
		tokens[i] = int32(7000 + i)
	}
	tierPrompt(t, d, p, rng, "a", tokens)
	scrubbed(t, p)
	flushTier(t, p)
	before := p.Stats()

	// The copy back fails at its wait: the admission is refused, retryable,
	// with nothing held; the tier drops what it could not copy.
	f.FailNext("cuStreamSynchronize", 999)
	_, err := p.TryAdmit(kvcache.Request{ID: "again", Tenant: "a", PromptTokens: len(tokens), TokenIDs: tokens})
	require.ErrorIs(t, err, kvcache.ErrOnloadFailed)
	var ae *kvcache.AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.True(t, ae.Retryable())
	scrubbed(t, p)
	require.NoError(t, p.Check())
	s := p.Stats()
	assert.Equal(t, before.FreePages, s.FreePages, "every page of the refused admission is free again")
	assert.Equal(t, 0, s.LiveLeases)
	assert.Equal(t, uint64(4), s.Tier.OnloadsFailed)
	assert.Equal(t, 0, s.Tier.Cached, "the copies it could not read back are dropped")

	// The prompt is computed afresh next time.
	l, err := p.TryAdmit(kvcache.Request{ID: "fresh", Tenant: "a", PromptTokens: len(tokens), TokenIDs: tokens})
	require.NoError(t, err)
	assert.Equal(t, 0, l.HitTokens())
	require.NoError(t, l.Release())
}
