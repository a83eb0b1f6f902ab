package kvcache_test

import (
	"fmt"

	"github.com/kvfence/kvfence/kvcache"
)

// Two tenants of one organisation share a sharing domain, so the second
// reuses the system prompt the first computed; a tenant of another domain
// sending the same tokens shares nothing.
func ExampleLease_CachePrefix() {
	pool, err := kvcache.New(kvcache.Config{
		Geometry:         kvcache.Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 2, HeadDim: 8, DType: kvcache.BF16},
		Pages:            256,
		MaxContextTokens: 4096,
		Tenants: []kvcache.TenantConfig{
			{Name: "acme-support", Domain: "acme"},
			{Name: "acme-sales", Domain: "acme"},
			{Name: "globex"}, // its own domain
		},
		Prefix: kvcache.PrefixConfig{EventBuffer: 16},
	})
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	prompt := make([]int32, 1000) // a 1,000-token system prompt and question
	for i := range prompt {
		prompt[i] = int32(i % 500)
	}
	admit := func(id, tenant string) *kvcache.Lease {
		l, err := pool.TryAdmit(kvcache.Request{
			ID: id, Tenant: tenant, PromptTokens: len(prompt), MaxNewTokens: 200, TokenIDs: prompt})
		if err != nil {
			panic(err)
		}
		fmt.Printf("%s (%s): %d of %d prompt tokens cached\n", id, l.Domain(), l.HitTokens(), len(prompt))
		return l
	}

	first := admit("req-1", "acme-support")
	// … the engine runs prefill for tokens [HitTokens, 1000) …
	first.Commit(len(prompt))
	published, _ := first.CachePrefix(len(prompt))
	fmt.Println("published tokens:", published)
	ev := <-pool.Events()
	fmt.Printf("event: %s %d keys, %d tokens in %s\n", ev.Kind, len(ev.Keys), ev.Tokens, ev.Domain)
	first.Release()

	second := admit("req-2", "acme-sales")
	other := admit("req-3", "globex")
	second.Release()
	other.Release()

	for _, d := range pool.Stats().Prefix.Domains {
		fmt.Printf("domain %s: %d pages hit, %d missed\n", d.Name, d.HitPages, d.MissPages)
	}
	// Output:
	// req-1 (acme): 0 of 1000 prompt tokens cached
	// published tokens: 992
	// event: stored 62 keys, 992 tokens in acme
	// req-2 (acme): 992 of 1000 prompt tokens cached
	// req-3 (tenant:globex): 0 of 1000 prompt tokens cached
	// domain acme: 62 pages hit, 62 missed
	// domain tenant:globex: 0 pages hit, 62 missed
}
