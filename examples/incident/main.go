// Command incident replays the shape of the KV-cache leak that kvfence was
// built to prevent, against a kvfence pool on the host backend, and says in
// plain words what happens at each step.
//
// In the incident, a model with a 1,048,576-token context was served from
// prefill GPUs whose KV pool held 681,280 tokens. An over-long prompt was
// marked rejected and replaced by a one-token placeholder; prefill still
// ran and the decode node generated from pages that held other customers'
// prompts.
//
// The replay uses kvfence's GLM-5 preset (a GLM-family model: an MLA
// latent and sparse-attention indexer keys on each of 78 layers). At the
// model's size the incident's pool is 68 GB, so the pool that serves the
// requests is the preset's miniature: the same pages, tokens and
// decisions at a fraction of the bytes.
//
//	go run ./examples/incident
package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"

	"github.com/kvfence/kvfence/kvcache"
)

const (
	model         = "glm-5"
	poolTokens    = 681_280
	contextTokens = 1_048_576
	// The miniature keeps each group's first layer at 1/64 of its bytes.
	miniLayers, miniShrink = 1, 64
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "incident:", err)
		os.Exit(1)
	}
}

func run() error {
	full, err := kvcache.Preset(model)
	if err != nil {
		return err
	}
	mini, err := full.Miniature(miniLayers, miniShrink)
	if err != nil {
		return err
	}
	pages := poolTokens / full.TokensPerPage()
	config := func(s kvcache.CacheSpec) kvcache.Config {
		return kvcache.Config{
			Cache:            s,
			Pages:            pages,
			MaxContextTokens: contextTokens,
			Tenants:          []kvcache.TenantConfig{{Name: "customer-a"}, {Name: "customer-b"}},
		}
	}

	step(1, "Build the incident's pool for %s: %d tokens of KV for a %d-token context window.", model, poolTokens, contextTokens)
	realBytes := full.BytesFor(pages, 0)
	say("%s caches %d bytes per token (%d pages of %d tokens: %d bytes, %.1f GiB)",
		model, full.TokenBytes(), pages, full.TokensPerPage(), realBytes, float64(realBytes)/(1<<30))
	if p, err := kvcache.New(config(full)); errors.Is(err, kvcache.ErrUndersizedPool) {
		say("refused at construction, before a byte is allocated: %v", err)
	} else {
		if p != nil {
			p.Close()
		}
		return fmt.Errorf("an undersized pool was accepted: %v", err)
	}

	step(2, "The operator opts in to the undersized pool explicitly (AllowUndersizedPool).")
	cfg := config(mini)
	cfg.AllowUndersizedPool = true
	pool, err := kvcache.New(cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	say("this replay runs the preset's miniature (first layer, 1/%d of the bytes): %d bytes instead of %d, the same %d pages and %d tokens",
		miniShrink, mini.BytesFor(pages, 0), realBytes, pool.Pages(), pool.CapacityTokens())
	say("requests longer than the pool will be refused at admission")

	step(3, "customer-a runs a request and its KV fills every byte of its pages.")
	a, err := pool.TryAdmit(kvcache.Request{ID: "a-1", Tenant: "customer-a", PromptTokens: 3000, MaxNewTokens: 200})
	if err != nil {
		return err
	}
	secret := []byte("customer-a's private prompt ")
	tableA, _ := a.BlockTable()
	// The engine's kernels would write the KV; here the lease's own page
	// writes do, region by region of every page it holds.
	group, regions := mini.Groups[0].Name, mini.Groups[0].Regions
	for i := range tableA {
		for r, region := range regions {
			mem := make([]byte, region.PageBytes)
			for j := range mem {
				mem[j] = secret[j%len(secret)]
			}
			if err := a.WritePage(group, i, r, mem); err != nil {
				return err
			}
		}
	}
	say("lease a-1 holds %d pages (%d..%d), all written with customer-a's data", len(tableA), tableA[0], tableA[len(tableA)-1])
	if err := a.Release(); err != nil {
		return err
	}
	s := pool.Stats()
	say("released: %d pages scrubbed (zero fill over every region: latents and indexer keys) before returning to the free list", len(tableA))
	say("pool now: %d free, %d in use, %d quarantined", s.FreePages, s.InUsePages, s.QuarantinedPages)

	step(4, "customer-b sends a request for the whole %d-token context: longer than the pool.", contextTokens)
	before := pool.Stats()
	long, err := pool.TryAdmit(kvcache.Request{ID: "b-long", Tenant: "customer-b", PromptTokens: contextTokens - 1, MaxNewTokens: 1})
	var refusal *kvcache.AdmissionError
	if long != nil || !errors.As(err, &refusal) || !errors.Is(err, kvcache.ErrExceedsCapacity) {
		return fmt.Errorf("the over-long request was not refused: lease %v, error %v", long, err)
	}
	say("refused: %v", err)
	say("at the model's size it needed %d bytes of KV; the pool has %d",
		int64(refusal.NeedTokens)*full.TokenBytes(), int64(refusal.LimitTokens)*full.TokenBytes())
	after := pool.Stats()
	say("no lease, no placeholder, no truncated prompt: pages in use %d → %d, free %d → %d",
		before.InUsePages, after.InUsePages, before.FreePages, after.FreePages)

	step(5, "customer-b runs a request that fits and receives customer-a's old pages.")
	b, err := pool.TryAdmit(kvcache.Request{ID: "b-1", Tenant: "customer-b", PromptTokens: 3000, MaxNewTokens: 200})
	if err != nil {
		return err
	}
	tableB, _ := b.BlockTable()
	reused, dirty := 0, 0
	inA := map[int32]bool{}
	for _, p := range tableA {
		inA[p] = true
	}
	for i, page := range tableB {
		if inA[page] {
			reused++
		}
		for r, region := range regions {
			mem := make([]byte, region.PageBytes)
			if err := b.ReadPage(group, i, r, mem); err != nil {
				return err
			}
			if !bytes.Equal(mem, make([]byte, len(mem))) {
				dirty++
			}
		}
	}
	say("%d of its %d pages held customer-a's KV before the scrub", reused, len(tableB))
	if dirty != 0 {
		return fmt.Errorf("LEAK: %d page regions handed to customer-b still hold data", dirty)
	}
	say("leak check clean: every byte of every page customer-b received is zero")

	step(6, "Accounting check.")
	if err := pool.Check(); err != nil {
		return err
	}
	s = pool.Stats()
	say("Check passed: free %d + in use %d + quarantined %d + retired %d = %d pages; %d refusal(s) for capacity",
		s.FreePages, s.InUsePages, s.QuarantinedPages, s.RetiredPages, s.TotalPages, s.Refused.ExceedsCapacity)
	return b.Release()
}

func step(n int, format string, args ...any) {
	fmt.Printf("\n%d. %s\n", n, fmt.Sprintf(format, args...))
}

func say(format string, args ...any) { fmt.Printf("   %s\n", fmt.Sprintf(format, args...)) }
