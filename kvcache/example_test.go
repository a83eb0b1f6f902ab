package kvcache_test

import (
	"errors"
	"fmt"

	"github.com/kvfence/kvfence/kvcache"
)

// An engine admits a request before prefill, uses the block table, and
// releases the lease when the request ends; the pages are scrubbed before
// anyone else can get them.
func Example() {
	pool, err := kvcache.New(kvcache.Config{
		Geometry:         kvcache.Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 2, HeadDim: 64, DType: kvcache.BF16},
		Pages:            64,
		MaxContextTokens: 1024,
		Tenants:          []kvcache.TenantConfig{{Name: "acme", QuotaPages: 32}},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	lease, err := pool.TryAdmit(kvcache.Request{ID: "req-1", Tenant: "acme", PromptTokens: 40, MaxNewTokens: 20})
	if err != nil {
		fmt.Println(err)
		return
	}
	table, _ := lease.BlockTable()
	fmt.Println("block table:", table)
	slots, _ := lease.SlotMapping(0, 3, nil)
	fmt.Println("first slots:", slots)
	_ = lease.Commit(40) // prefill wrote the prompt

	if err := lease.Release(); err != nil {
		fmt.Println(err)
	}
	s := pool.Stats()
	fmt.Println("free pages:", s.FreePages, "scrubbed after release:", s.Scrub.PagesScrubbed-64)
	// Output:
	// block table: [0 1 2 3]
	// first slots: [0 1 2]
	// free pages: 64 scrubbed after release: 4
}

// A request the pool can never hold is refused with the numbers, and
// nothing is allocated.
func ExamplePool_Admit_refused() {
	pool, _ := kvcache.New(kvcache.Config{
		Geometry:            kvcache.Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 8, DType: kvcache.FP16},
		Pages:               100,
		MaxContextTokens:    4096,
		AllowUndersizedPool: true,
		Tenants:             []kvcache.TenantConfig{{Name: "acme"}},
	})
	defer pool.Close()

	_, err := pool.TryAdmit(kvcache.Request{ID: "long", Tenant: "acme", PromptTokens: 2000})
	var ae *kvcache.AdmissionError
	if errors.As(err, &ae) {
		fmt.Println(errors.Is(err, kvcache.ErrExceedsCapacity), ae.Need, ae.Limit, ae.Permanent())
	}
	fmt.Println(err)
	fmt.Println("pages in use:", pool.Stats().InUsePages)
	// Output:
	// true 125 100 true
	// kvcache: request exceeds pool capacity: request "long" of tenant "acme" needs 125 pages (2000 tokens), pool has 100 pages (1600 tokens) in service
	// pages in use: 0
}
