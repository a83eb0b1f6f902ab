//go:build cgo

package main

import (
	"encoding/json"
	"os"
	"testing"
	"time"

	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/kvcache"
)

// benchConfig is the core benchmark's request shape: 2,048 tokens at 16
// tokens per page (128 pages), zero scrub. The geometry is small so that
// the host fill, which both sides pay alike, does not drown the per-call
// cost being compared.
const benchConfig = `{"geometry": {"tokens_per_page": 16, "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "fp16"},
 "pages": 1024, "max_context_tokens": 16384, "tenants": [{"name": "bench"}]}`

const benchTokens = 2048

// BenchmarkCAdmitRelease measures admit → block table → release → free of
// a 2,048-token request through the C ABI (a C loop calling the exported
// functions), and the same cycle in pure Go (TryAdmitInto a recycled
// lease, as kvf_admit with wait_ms = 0 does, AppendBlockTable, Release) on
// an identical pool in the same run.
// Metrics: ns/op (C), go-ns/op, x-go = C ÷ Go (target ≤ 1.5), ns/page (C);
// allocs/op are the C path's (the Go path allocates nothing).
//
// It fails unless both sides did what they are timed for: every block
// table held the request's 128 pages (the last one of each side is checked
// to name 128 distinct pages of the pool), and afterwards each pool had
// admitted exactly the cycles run, refused none, and holds no page or
// lease: every release happened.
func BenchmarkCAdmitRelease(b *testing.B) {
	b.ReportAllocs()
	cfg, err := bridge.ParseConfig([]byte(benchConfig))
	if err != nil {
		b.Fatal(err)
	}
	goPool, err := kvcache.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer goPool.Close()
	cPool, err := bridge.CreatePool([]byte(benchConfig))
	if err != nil {
		b.Fatal(err)
	}
	defer bridge.DestroyPool(cPool)
	pages := benchTokens / 16
	table := make([]int32, pages)

	var l kvcache.Lease // recycled, with its page slices, across all cycles
	req := kvcache.Request{ID: "bench", Tenant: "bench", PromptTokens: benchTokens}
	dst := make([]int32, 0, pages)
	goCycles := func(n int) time.Duration {
		start := time.Now()
		for range n {
			if err := goPool.TryAdmitInto(req, &l); err != nil {
				b.Fatal(err)
			}
			var err error
			if dst, err = l.AppendBlockTable(dst[:0]); err != nil {
				b.Fatal(err)
			}
			if len(dst) != pages {
				b.Fatalf("Go block table of %d pages, want %d", len(dst), pages)
			}
			if err := l.Release(); err != nil {
				b.Fatal(err)
			}
		}
		return time.Since(start)
	}
	// Warm both paths (lease recycling, interned names) before timing.
	goCycles(100)
	cCycles := func(n int) time.Duration {
		for i := range table {
			table[i] = -1 // so that the check below sees this run's table
		}
		start := time.Now()
		switch st := cAdmitRelease(cPool, "bench", "bench", benchTokens, table, n); st {
		case 0:
		case -1:
			b.Fatalf("C block table shorter than %d pages", pages)
		default:
			b.Fatalf("C loop: %v", bridge.Status(st))
		}
		return time.Since(start)
	}
	cCycles(100)

	// Alternate chunks of Go and C cycles so that both see the same
	// machine load; on a shared box a load change between two long phases
	// would otherwise move the ratio.
	const chunk = 512
	var goElapsed, cElapsed time.Duration
	b.ResetTimer()
	for done := 0; done < b.N; done += chunk {
		n := min(chunk, b.N-done)
		goElapsed += goCycles(n)
		cElapsed += cCycles(n)
	}
	b.StopTimer()
	cNs := float64(cElapsed.Nanoseconds()) / float64(b.N)
	goNs := float64(goElapsed.Nanoseconds()) / float64(b.N)
	b.ReportMetric(cNs, "ns/op") // the C figure, not C + Go
	b.ReportMetric(goNs, "go-ns/op")
	b.ReportMetric(cNs/goNs, "x-go")
	b.ReportMetric(cNs/float64(pages), "ns/page")
	if err := goPool.Check(); err != nil {
		b.Fatal(err)
	}
	if err := bridge.Check(cPool); err != nil {
		b.Fatal(err)
	}
	checkTable(b, "C", table, pages, cfg.Pages)
	checkTable(b, "Go", dst, pages, cfg.Pages)
	js, err := bridge.StatsJSON(cPool)
	if err != nil {
		b.Fatal(err)
	}
	var cs bridge.StatsDoc
	if err := json.Unmarshal(js, &cs); err != nil {
		b.Fatal(err)
	}
	gs := goPool.Stats()
	cycles := uint64(100 + b.N)
	for _, s := range []struct {
		who               string
		admitted, refused uint64
		inUse, leases     int
	}{
		{"C", cs.Admitted, cs.Refused.Total, cs.InUsePages, cs.LiveLeases},
		{"Go", gs.Admitted, gs.Refused.Total(), gs.InUsePages, gs.LiveLeases},
	} {
		if s.admitted != cycles || s.refused != 0 || s.inUse != 0 || s.leases != 0 {
			b.Errorf("%s pool after %d cycles: %d admitted, %d refused, %d pages in use, %d live leases",
				s.who, cycles, s.admitted, s.refused, s.inUse, s.leases)
		}
	}
}

// checkTable fails unless table names want distinct pages of a pool of
// total pages.
func checkTable(b *testing.B, who string, table []int32, want, total int) {
	b.Helper()
	seen := make(map[int32]bool, len(table))
	for _, pg := range table {
		if pg < 0 || int(pg) >= total || seen[pg] {
			b.Fatalf("%s block table %v: page %d out of range or repeated", who, table, pg)
		}
		seen[pg] = true
	}
	if len(seen) != want {
		b.Fatalf("%s block table of %d pages, want %d", who, len(seen), want)
	}
}

// BenchmarkGoAdmitTokensRelease is the pure-Go side of the Python
// package's benchmark (python/bench/bench_admit.py): a 2,048-token prompt
// admitted by its token IDs (matched in its domain's prefix trie by the
// tokens themselves; with nothing published, no page key is derived), its
// block table read, released. The pool is the Python run's: the JSON
// config in KVF_BENCH_CONFIG, or benchConfig.
// Metrics: ns/op, ns/page.
//
// It fails unless every cycle's table held the prompt's pages, each of
// them distinct, and the pool admitted every cycle and holds nothing
// afterwards.
func BenchmarkGoAdmitTokensRelease(b *testing.B) {
	b.ReportAllocs()
	js := benchConfig
	if env := os.Getenv("KVF_BENCH_CONFIG"); env != "" {
		js = env
	}
	cfg, err := bridge.ParseConfig([]byte(js))
	if err != nil {
		b.Fatal(err)
	}
	pool, err := kvcache.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	tokens := make([]int32, benchTokens)
	for i := range tokens {
		tokens[i] = int32((i*7919 + 13) % 50000)
	}
	tpp := cfg.Geometry.TokensPerPage
	if tpp == 0 {
		b.Fatal("KVF_BENCH_CONFIG must be a \"geometry\" pool")
	}
	pages := (benchTokens + tpp - 1) / tpp
	tenant := cfg.Tenants[0].Name
	req := kvcache.Request{ID: "bench", Tenant: tenant, PromptTokens: benchTokens, TokenIDs: tokens}
	var l kvcache.Lease
	dst := make([]int32, 0, pages)
	cycle := func() {
		if err := pool.TryAdmitInto(req, &l); err != nil {
			b.Fatal(err)
		}
		if dst, err = l.AppendBlockTable(dst[:0]); err != nil {
			b.Fatal(err)
		}
		if len(dst) != pages {
			b.Fatalf("block table of %d pages, want %d", len(dst), pages)
		}
		if err := l.Release(); err != nil {
			b.Fatal(err)
		}
	}
	for range 100 {
		cycle()
	}
	b.ResetTimer()
	for range b.N {
		cycle()
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(pages), "ns/page")
	checkTable(b, "Go", dst, pages, cfg.Pages)
	if err := pool.Check(); err != nil {
		b.Fatal(err)
	}
	s := pool.Stats()
	if s.Admitted != uint64(100+b.N) || s.InUsePages != 0 || s.LiveLeases != 0 || s.Refused.Total() != 0 {
		b.Fatalf("after %d cycles: %d admitted, %d refused, %d pages in use, %d leases",
			100+b.N, s.Admitted, s.Refused.Total(), s.InUsePages, s.LiveLeases)
	}
}
