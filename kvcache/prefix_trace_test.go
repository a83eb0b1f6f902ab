package kvcache

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// traceResult summarises one replay of the synthetic trace.
type traceResult struct {
	requests, promptTokens, hitTokens, evicted uint64
}

func (r traceResult) hitRate() float64 { return float64(r.hitTokens) / float64(r.promptTokens) }

// llama8BTokenBytes is the KV of one token of a Llama-3-8B-shaped model
// (32 layers, 8 KV heads, head dim 128, bf16): what a hit token saves in
// prefill writes. The replay itself runs on small pages.
var llama8BTokenBytes = Geometry{TokensPerPage: 16, Layers: 32, KVHeads: 8, HeadDim: 128, DType: BF16}.TokenBytes()

// replayTrace runs a deterministic multi-tenant trace: 16 tenants of 4
// organisations; each organisation has a 2,048-token system prompt its
// tenants all use, each tenant a 256-token instruction block of its own;
// then a user turn of 64-511 fresh tokens and up to 256 output tokens.
// Eight requests are in flight at a time. orgDomains puts each
// organisation's tenants in one sharing domain; otherwise every tenant has
// its own.
func replayTrace(t *testing.T, orgDomains bool, requests int) traceResult {
	const tpp, orgs, perOrg = 16, 4, 4
	var tenants []TenantConfig
	for o := range orgs {
		for i := range perOrg {
			tc := TenantConfig{Name: fmt.Sprintf("org%d-t%d", o, i)}
			if orgDomains {
				tc.Domain = fmt.Sprintf("org%d", o)
			}
			tenants = append(tenants, tc)
		}
	}
	g := Geometry{TokensPerPage: tpp, Layers: 1, KVHeads: 1, HeadDim: 4, DType: FP32}
	p, err := New(Config{Geometry: g, Pages: 2048, MaxContextTokens: 2048 * tpp, Tenants: tenants})
	require.NoError(t, err)
	defer p.Close()

	rng := rand.New(rand.NewPCG(2024, 6))
	system := func(org int) []int32 { return tokens(2048, 0, int32(1+org)) }
	instructions := func(tenant int) []int32 { return tokens(256, 0, int32(100+tenant)) }
	var res traceResult
	var inflight []*Lease
	for r := range requests {
		ti := rng.IntN(len(tenants))
		prompt := append(append([]int32{}, system(ti/perOrg)...), instructions(ti)...)
		for range 64 + rng.IntN(448) {
			prompt = append(prompt, int32(rng.IntN(1<<17)))
		}
		l, err := p.TryAdmit(Request{ID: fmt.Sprint(r), Tenant: tenants[ti].Name,
			PromptTokens: len(prompt), MaxNewTokens: rng.IntN(257), TokenIDs: prompt})
		require.NoError(t, err)
		res.requests++
		res.promptTokens += uint64(len(prompt))
		res.hitTokens += uint64(l.HitTokens())
		require.NoError(t, l.Commit(len(prompt)))
		_, err = l.CachePrefix(len(prompt))
		require.NoError(t, err)
		inflight = append(inflight, l)
		if len(inflight) == 8 {
			i := rng.IntN(len(inflight))
			require.NoError(t, inflight[i].Release())
			inflight = append(inflight[:i], inflight[i+1:]...)
		}
	}
	require.NoError(t, p.Check())
	res.evicted = evictedTotal(p)
	return res
}

// TestPrefixTraceSharedDomains compares the same trace with one domain per
// tenant and with one per organisation. Shared domains must hit more; the
// figures are logged (go test -run TraceShared -v ./kvcache).
func TestPrefixTraceSharedDomains(t *testing.T) {
	const requests = 400
	private := replayTrace(t, false, requests)
	shared := replayTrace(t, true, requests)
	for _, r := range []struct {
		name string
		res  traceResult
	}{{"one domain per tenant", private}, {"one domain per organisation", shared}} {
		t.Logf("%-28s %d requests, %d prompt tokens, hit rate %.1f%%, prefill avoided %d tokens = %.1f GiB of KV (Llama-3-8B shape), %d pages evicted",
			r.name, r.res.requests, r.res.promptTokens, 100*r.res.hitRate(), r.res.hitTokens,
			float64(r.res.hitTokens)*float64(llama8BTokenBytes)/(1<<30), r.res.evicted)
	}
	require.Greater(t, shared.hitRate(), private.hitRate(), "sharing a domain must raise the hit rate")
	require.Positive(t, private.hitRate(), "a tenant still hits its own prompts")
}
