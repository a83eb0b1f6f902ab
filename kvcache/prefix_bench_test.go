package kvcache

import (
	"crypto/sha256"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

const (
	benchTPP         = 16
	benchPromptPages = 2048 // 32,768 tokens
	matchTargetNs    = 50_000
)

var benchGeometry = Geometry{TokensPerPage: benchTPP, Layers: 1, KVHeads: 1, HeadDim: 4, DType: FP32}

// benchPrefixPool returns a pool whose cache holds a 32,768-token prompt
// (plus one token, so that all 2,048 full pages can be shared) and, with
// others > 0, that many other cached pages of one-page prompts.
func benchPrefixPool(b *testing.B, others int) (*Pool, []int32) {
	p, err := New(Config{Geometry: benchGeometry, Pages: 2*benchPromptPages + 16 + others, MaxContextTokens: 2 * benchPromptPages * benchTPP,
		Tenants: []TenantConfig{{Name: "a"}}})
	require.NoError(b, err)
	b.Cleanup(func() { p.Close() })
	toks := make([]int32, benchPromptPages*benchTPP+1)
	for i := range toks {
		toks[i] = int32(i*7919) % 128256
	}
	publish := func(id string, toks []int32) {
		l, err := p.TryAdmit(Request{ID: id, Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
		require.NoError(b, err)
		require.NoError(b, l.Commit(len(toks)))
		_, err = l.CachePrefix(len(toks))
		require.NoError(b, err)
		require.NoError(b, l.Release())
	}
	publish("pub", toks)
	other := make([]int32, benchTPP+1)
	for i := range others { // each its own first page: the root branches widely
		for j := range other {
			other[j] = int32(1_000_000 + i*benchTPP + j)
		}
		publish("other", other)
	}
	require.Equal(b, benchPromptPages+others, p.Stats().CachedPages)
	return p, toks
}

// timePerOp runs f n times and returns its mean duration in ns: the
// baseline measured inside a benchmark.
func timePerOp(n int, f func()) float64 {
	start := time.Now()
	for range n {
		f()
	}
	return float64(time.Since(start).Nanoseconds()) / float64(n)
}

// BenchmarkPrefixMatch measures finding a fully cached 32,768-token
// prompt (2,048 pages of 16 tokens) in the prefix cache.
//
//   - tokens: what Admit does with a request's token IDs before it
//     allocates: copy them into the lease and walk the trie, comparing
//     tokens; target ≤ 50 µs.
//   - tokens/1M-others: the same with a million other cached pages in the
//     index; target within 1.5× of tokens (x_empty_index).
//   - keys: the lookup of keys derived ahead (Request.PageKeys).
//   - hash+keys: deriving the 2,048 SHA-256 keys and looking them up, the
//     admission path before the trie (baseline: hashing alone).
//   - admit+release: a whole Admit (copy, walk, share 2,048 pages,
//     allocate one) and Release (park them again). Baseline: Admit and
//     Release of the same request without prefix sharing (allocate and
//     scrub 2,049 pages).
func BenchmarkPrefixMatch(b *testing.B) {
	p, toks := benchPrefixPool(b, 0)
	root := prefixRoot("tenant:a", "")
	keys := appendPageKeys(nil, root, benchTPP, toks)
	limit := (len(toks) - 1) / benchTPP
	report := func(b *testing.B, baselineNs float64, baselineName string) {
		perOp := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
		b.ReportMetric(perOp/benchPromptPages, "ns/page")
		b.ReportMetric(perOp/matchTargetNs, "x_50µs_target")
		if baselineName != "" {
			b.ReportMetric(perOp/baselineNs, "x_"+baselineName)
		}
	}
	// matcher is an admission's scratch (its tokens, keys and match) and
	// the walk or lookup Admit makes with them.
	matcher := func(p *Pool) func(tokens []int32, keys []BlockKey) int {
		t, err := p.groups[0].tenants.Lookup("a")
		require.NoError(b, err)
		var probe Lease
		return func(tokens []int32, keys []BlockKey) int {
			p.mu.Lock()
			defer p.mu.Unlock()
			probe.tokens = append(probe.tokens[:0], tokens...)
			probe.keys, probe.match.valid = keys, false // a fresh admission: no match to reuse
			p.matchLocked(&probe, t.Domain, "", limit, tokens == nil)
			return len(probe.match.entries)
		}
	}

	var emptyIndexNs float64
	b.Run("tokens", func(b *testing.B) {
		match := matcher(p)
		for b.Loop() {
			if match(toks, nil) != benchPromptPages {
				b.Fatal("prefix not found")
			}
		}
		emptyIndexNs = float64(b.Elapsed().Nanoseconds()) / float64(b.N)
		report(b, 0, "")
	})
	b.Run("tokens/1M-others", func(b *testing.B) {
		big, toks := benchPrefixPool(b, 1<<20)
		match := matcher(big)
		baseline := emptyIndexNs
		if baseline == 0 { // run alone: measure the empty index here
			baseline = timePerOp(20, func() { matcher(p)(toks, nil) })
		}
		for b.Loop() {
			if match(toks, nil) != benchPromptPages {
				b.Fatal("prefix not found")
			}
		}
		report(b, baseline, "empty_index")
	})
	b.Run("keys", func(b *testing.B) {
		match := matcher(p)
		for b.Loop() {
			if match(nil, keys) != benchPromptPages {
				b.Fatal("prefix not found")
			}
		}
		report(b, 0, "")
	})
	b.Run("hash+keys", func(b *testing.B) {
		match := matcher(p)
		buf := make([]BlockKey, 0, benchPromptPages)
		hashOnly := timePerOp(200, func() { buf = appendPageKeys(buf[:0], root, benchTPP, toks) })
		b.SetBytes(int64(4 * len(toks)))
		for b.Loop() {
			buf = appendPageKeys(buf[:0], prefixRoot("tenant:a", ""), benchTPP, toks)
			if match(nil, buf) != benchPromptPages {
				b.Fatal("prefix not found")
			}
		}
		report(b, hashOnly, "hash_only")
	})
	b.Run("admit+release", func(b *testing.B) {
		var l Lease
		plain := Request{ID: "plain", Tenant: "a", PromptTokens: len(toks)}
		cycle := func(req Request) {
			if err := p.TryAdmitInto(req, &l); err != nil {
				b.Fatal(err)
			}
			if err := l.Release(); err != nil {
				b.Fatal(err)
			}
		}
		baseline := timePerOp(50, func() { cycle(plain) })
		req := Request{ID: "hit", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks}
		b.ReportAllocs()
		for b.Loop() {
			cycle(req)
		}
		if l.HitTokens() != benchPromptPages*benchTPP {
			b.Fatalf("hit %d tokens", l.HitTokens())
		}
		report(b, baseline, "no_prefix")
	})
}

// BenchmarkWarmAdmission admits a 2,048-token request of which the first
// 127 of its 128 pages are cached (a chat turn on a cached history), and
// releases it; target ≤ 15 µs for the admission and release. Baseline: the
// same request admitted and released without its tokens (no sharing: 128
// pages allocated and scrubbed, the fill excluded).
func BenchmarkWarmAdmission(b *testing.B) {
	dev := &discardFills{Host: cudaops.NewHost()}
	defer dev.Close()
	p, err := New(Config{Geometry: benchGeometry, Pages: 1024, MaxContextTokens: 4096, Device: dev,
		Tenants: []TenantConfig{{Name: "a"}}})
	require.NoError(b, err)
	defer p.Close()
	toks := make([]int32, 128*benchTPP)
	for i := range toks {
		toks[i] = int32(i * 31)
	}
	pub, err := p.TryAdmit(Request{ID: "history", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(b, err)
	require.NoError(b, pub.Commit(len(toks)))
	_, err = pub.CachePrefix(len(toks))
	require.NoError(b, err)
	require.NoError(b, pub.Release())
	var l Lease
	cycle := func(req Request) {
		if err := p.TryAdmitInto(req, &l); err != nil {
			b.Fatal(err)
		}
		if err := l.Release(); err != nil {
			b.Fatal(err)
		}
	}
	plain := Request{ID: "turn", Tenant: "a", PromptTokens: len(toks)}
	baseline := timePerOp(2000, func() { cycle(plain) })
	req := Request{ID: "turn", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks}
	b.ReportAllocs()
	for b.Loop() {
		cycle(req)
	}
	perOp := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(perOp/1000, "µs/op")
	b.ReportMetric(perOp/15_000, "x_15µs_target")
	b.ReportMetric(perOp/baseline, "x_no_prefix")
	if l.HitTokens() != 127*benchTPP {
		b.Fatalf("hit %d tokens, want 127 pages", l.HitTokens())
	}
}

// BenchmarkPageKey measures key derivation throughput in GB/s of token
// IDs (4 bytes each), against SHA-256 over the same bytes in one buffer:
// the hardware's hashing speed, which the chain cannot beat since every
// page adds its parent key and a final block.
func BenchmarkPageKey(b *testing.B) {
	for _, tpp := range []int{16, 32, 128} {
		b.Run(fmt.Sprintf("tokens_per_page=%d", tpp), func(b *testing.B) {
			toks := make([]int32, 4096*tpp/16)
			raw := make([]byte, 4*len(toks))
			for i := range toks {
				toks[i] = int32(i * 31)
			}
			root := prefixRoot("tenant:a", "")
			keys := make([]BlockKey, 0, len(toks)/tpp)
			baseline := timePerOp(100, func() { sha256.Sum256(raw) })
			b.SetBytes(int64(len(raw)))
			for b.Loop() {
				keys = appendPageKeys(keys[:0], root, tpp, toks)
			}
			if len(keys) != len(toks)/tpp || keys[0] == keys[1] {
				b.Fatalf("%d keys for %d pages", len(keys), len(toks)/tpp)
			}
			perOp := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			b.ReportMetric(float64(len(raw))/perOp, "GB/s")
			b.ReportMetric(perOp/float64(len(toks)/tpp), "ns/page")
			b.ReportMetric(baseline/perOp, "x_sha256_flat")
		})
	}
}

// BenchmarkPublishEvict is the prefix cache's churn: each cycle admits a
// prompt of 128 full pages that no other shares (its first token is the
// cycle's), computes it (Commit), publishes it (CachePrefix, keys derived
// once per page) and releases it, its pages staying cached; the cache
// holds 8 such prompts, so from the ninth on every admission evicts the
// least recently used prompt's 128 pages (scrubbed, the fill excluded).
// Baseline, timed in alternating slices of the same loop: the same cycle
// without tokens (nothing published, nothing evicted). allocs/page is
// the cycle's allocations per published page.
func BenchmarkPublishEvict(b *testing.B) {
	const pages, promptPages, slice = 1024, 128, 64
	dev := &discardFills{Host: cudaops.NewHost()}
	defer dev.Close()
	p, err := New(Config{Geometry: benchGeometry, Pages: pages, MaxContextTokens: pages * benchTPP, Device: dev,
		Tenants: []TenantConfig{{Name: "a"}}})
	require.NoError(b, err)
	defer p.Close()
	toks := make([]int32, promptPages*benchTPP)
	for i := range toks {
		toks[i] = int32(i * 31)
	}
	var l Lease
	cycle := func(req Request) {
		if err := p.TryAdmitInto(req, &l); err != nil {
			b.Fatal(err)
		}
		if err := l.Commit(len(toks)); err != nil {
			b.Fatal(err)
		}
		if n, err := l.CachePrefix(len(toks)); err != nil || n != len(req.TokenIDs) {
			b.Fatalf("CachePrefix: %d tokens, %v", n, err)
		}
		if err := l.Release(); err != nil {
			b.Fatal(err)
		}
	}
	publish := Request{ID: "p", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks}
	plain := Request{ID: "p", Tenant: "a", PromptTokens: len(toks)}
	n := int32(0)
	for range 2 * pages / promptPages { // the cache is full, and every Lease buffer grown
		toks[0], n = n, n+1
		cycle(publish)
	}
	before := p.Stats()
	var own, base time.Duration
	cycles, baseCycles := 0, 0
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for b.Loop() {
		if cycles%slice == 0 && cycles > 0 {
			own += time.Since(start)
			b.StopTimer()
			base += time.Duration(timePerOp(slice, func() { cycle(plain) }) * slice)
			baseCycles += slice
			b.StartTimer()
			start = time.Now()
		}
		toks[0], n = n, n+1
		cycle(publish)
		cycles++
	}
	own += time.Since(start)
	b.StopTimer()
	// Every cycle published its 128 pages and evicted a prompt's worth
	// (checked before a baseline run after the loop, whose admission
	// evicts a prompt of its own).
	s := p.Stats()
	stored := s.Prefix.Domains[0].StoredPages - before.Prefix.Domains[0].StoredPages
	evicted := s.Prefix.Domains[0].EvictedPages - before.Prefix.Domains[0].EvictedPages
	if stored != uint64(promptPages*cycles) || evicted != stored || s.CachedPages != pages || s.LiveLeases != 0 {
		b.Fatalf("after %d cycles: %d pages stored, %d evicted, %d cached, %d live leases", cycles, stored, evicted, s.CachedPages, s.LiveLeases)
	}
	if baseCycles == 0 {
		base += time.Duration(timePerOp(cycles, func() { cycle(plain) }) * float64(cycles))
		baseCycles = cycles
	}
	perOp := float64(own.Nanoseconds()) / float64(cycles)
	b.ReportMetric(perOp/promptPages, "ns/page")
	b.ReportMetric(perOp/(float64(base.Nanoseconds())/float64(baseCycles)), "x_plain")
	if err := p.Check(); err != nil {
		b.Fatal(err)
	}
}
