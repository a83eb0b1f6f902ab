package kvcache

import (
	"crypto/sha256"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const (
	benchTPP         = 16
	benchPromptPages = 2048 // 32,768 tokens
	matchTargetNs    = 50_000
)

var benchGeometry = Geometry{TokensPerPage: benchTPP, Layers: 1, KVHeads: 1, HeadDim: 4, DType: FP32}

// benchPrefixPool returns a pool whose cache holds a 32,768-token prompt
// (plus one token, so that all 2,048 full pages can be shared).
func benchPrefixPool(b *testing.B) (*Pool, []int32) {
	p, err := New(Config{Geometry: benchGeometry, Pages: 2*benchPromptPages + 16, MaxContextTokens: 2 * benchPromptPages * benchTPP,
		Tenants: []TenantConfig{{Name: "a"}}})
	require.NoError(b, err)
	b.Cleanup(func() { p.Close() })
	toks := make([]int32, benchPromptPages*benchTPP+1)
	for i := range toks {
		toks[i] = int32(i*7919) % 128256
	}
	l, err := p.TryAdmit(Request{ID: "pub", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(b, err)
	require.NoError(b, l.Commit(len(toks)))
	n, err := l.CachePrefix(len(toks))
	require.NoError(b, err)
	require.Equal(b, benchPromptPages*benchTPP, n)
	require.NoError(b, l.Release())
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
//   - hash+match: derive the 2,048 keys from the token IDs and look them
//     up (what Admit does before it allocates); target ≤ 50 µs. Baseline:
//     hashing alone.
//   - match: the same lookup with keys derived ahead (Request.PageKeys).
//   - admit+release: a whole Admit (hash, match, share 2,048 pages,
//     allocate one) and Release (park them again). Baseline: Admit and
//     Release of the same request without prefix sharing (allocate and
//     scrub 2,049 pages).
func BenchmarkPrefixMatch(b *testing.B) {
	p, toks := benchPrefixPool(b)
	root := prefixRoot("tenant:a", "")
	keys := appendPageKeys(nil, root, benchTPP, toks)
	limit := (len(toks) - 1) / benchTPP
	t, err := p.mu.tenants.Lookup("a")
	require.NoError(b, err)
	var probe Lease // an admission's scratch: its keys and its match
	match := func(keys []BlockKey) int {
		p.mu.Lock()
		probe.keys, probe.match.valid = keys, false // a fresh admission: no match to reuse
		p.matchLocked(&probe, t.Domain, limit)
		n := len(probe.match.entries)
		p.mu.Unlock()
		return n
	}
	report := func(b *testing.B, baselineNs float64, baselineName string) {
		perOp := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
		b.ReportMetric(perOp/benchPromptPages, "ns/page")
		b.ReportMetric(perOp/matchTargetNs, "x_50µs_target")
		b.ReportMetric(perOp/baselineNs, "x_"+baselineName)
	}

	b.Run("hash+match", func(b *testing.B) {
		buf := make([]BlockKey, 0, benchPromptPages)
		hashOnly := timePerOp(200, func() { buf = appendPageKeys(buf[:0], root, benchTPP, toks) })
		b.SetBytes(int64(4 * len(toks)))
		for b.Loop() {
			buf = appendPageKeys(buf[:0], prefixRoot("tenant:a", ""), benchTPP, toks)
			if match(buf) != benchPromptPages {
				b.Fatal("prefix not cached")
			}
		}
		report(b, hashOnly, "hash_only")
	})
	b.Run("match", func(b *testing.B) {
		hashOnly := timePerOp(200, func() { appendPageKeys(keys[:0:0], root, benchTPP, toks) })
		for b.Loop() {
			if match(keys) != benchPromptPages {
				b.Fatal("prefix not cached")
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
		for b.Loop() {
			cycle(req)
		}
		if l.HitTokens() != benchPromptPages*benchTPP {
			b.Fatalf("hit %d tokens", l.HitTokens())
		}
		report(b, baseline, "no_prefix")
	})
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
