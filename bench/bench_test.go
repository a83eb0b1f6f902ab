package bench

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvfence/kvfence/bench/internal/kvsim"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// tiny pages make admission bookkeeping, not memory traffic, the cost.
var tinyGeometry = kvcache.Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 8, DType: kvcache.FP16}

// modelGeometry is a scaled-down model: 4 layers × 4 KV heads × 64 dims
// in fp16, 16 tokens per page: 64 KiB per page over 8 regions.
var modelGeometry = kvcache.Geometry{TokensPerPage: 16, Layers: 4, KVHeads: 4, HeadDim: 64, DType: kvcache.FP16}

func newPool(b *testing.B, g kvcache.Geometry, pages int, dev cudaops.Device) *kvcache.Pool {
	b.Helper()
	p, err := kvcache.New(kvcache.Config{Geometry: g, Pages: pages, MaxContextTokens: pages * g.TokensPerPage,
		Tenants: []kvcache.TenantConfig{{Name: "a"}, {Name: "b"}, {Name: "c"}, {Name: "d"}}, Device: dev})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { p.Close() })
	return p
}

var tenants = []string{"a", "b", "c", "d"}

// fill admits n one-page leases, spread over the tenants, and keeps them.
func fill(b *testing.B, p *kvcache.Pool, n int) []*kvcache.Lease {
	b.Helper()
	leases := make([]*kvcache.Lease, n)
	for i := range leases {
		l, err := p.TryAdmit(kvcache.Request{ID: fmt.Sprintf("live-%d", i), Tenant: tenants[i%4], PromptTokens: 16})
		if err != nil {
			b.Fatal(err)
		}
		leases[i] = l
	}
	return leases
}

// admitRelease runs n admissions of a 4-page request, each released at
// once, reusing one Lease and one ID, as an engine that recycles its
// request structs does.
func admitRelease(b *testing.B, p *kvcache.Pool, n int) {
	var l kvcache.Lease
	req := kvcache.Request{ID: "bench", Tenant: "b", PromptTokens: 48, MaxNewTokens: 16}
	for range n {
		if err := p.TryAdmitInto(req, &l); err != nil {
			b.Fatal(err)
		}
		if err := l.Release(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkAdmitUnderLiveLeases: admission + release of one request while
// a pool holds many live leases. Target: cost independent of the live
// lease count (ratio to an empty pool ≤ 1.5 at 16k leases).
func BenchmarkAdmitUnderLiveLeases(b *testing.B) {
	const pages = 1 << 15
	for _, live := range []int{0, 1 << 10, 1 << 14} {
		b.Run(fmt.Sprintf("live=%d", live), func(b *testing.B) {
			empty := newPool(b, tinyGeometry, pages, nil)
			loaded := newPool(b, tinyGeometry, pages, nil)
			fill(b, loaded, live)
			start := time.Now()
			admitRelease(b, empty, b.N)
			base := time.Since(start)
			b.ResetTimer()
			admitRelease(b, loaded, b.N)
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/admit+release")
			b.ReportMetric(float64(b.Elapsed())/float64(base), "x-vs-empty-pool")
			if err := loaded.Check(); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// admitAll admits one 4-page lease per element of leases.
func admitAll(b *testing.B, p *kvcache.Pool, leases []kvcache.Lease) {
	b.Helper()
	for i := range leases {
		req := kvcache.Request{ID: fmt.Sprintf("s%d", i), Tenant: tenants[i%4], PromptTokens: 40, MaxNewTokens: 24}
		if err := p.TryAdmitInto(req, &leases[i]); err != nil {
			b.Fatal(err)
		}
	}
}

func releaseAll(b *testing.B, leases []kvcache.Lease) {
	b.Helper()
	for i := range leases {
		if err := leases[i].Release(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkReleaseStorm: many leases ending together (a batch finishing),
// each release scrubbing its 4 pages of 64 KiB. Only the releases on the
// safe pool are timed; the same storm on the unsafe baseline (same pool
// on a device whose fills do nothing) is timed by hand in the same loop,
// so the ratio is what clean-before-reuse costs a release. Target: the
// scrub runs at ≥ 50% of memset bandwidth (see BenchmarkFillBatch).
func BenchmarkReleaseStorm(b *testing.B) {
	for _, n := range []int{16, 256} {
		b.Run(fmt.Sprintf("leases=%d", n), func(b *testing.B) {
			pages := 4 * n
			safe := newPool(b, modelGeometry, pages, nil)
			unsafe := newPool(b, modelGeometry, pages, kvsim.UnsafeNoScrub(cudaops.NewHost()))
			leases := make([]kvcache.Lease, n)
			b.SetBytes(int64(pages) * modelGeometry.PageBytes())
			var unsafeTime time.Duration
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				admitAll(b, unsafe, leases)
				start := time.Now()
				releaseAll(b, leases)
				unsafeTime += time.Since(start)
				admitAll(b, safe, leases)
				b.StartTimer()
				releaseAll(b, leases)
			}
			b.StopTimer()
			el := b.Elapsed()
			b.ReportMetric(float64(el.Nanoseconds())/float64(b.N*pages), "ns/page")
			b.ReportMetric(float64(unsafeTime.Nanoseconds())/float64(b.N*pages), "ns/page-unsafe")
			b.ReportMetric(float64(el)/float64(max(unsafeTime, 1)), "x-vs-unsafe-nofill")
			if err := safe.Check(); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// BenchmarkFillBatch: one Host Fill of a batch of scattered pages over 8
// regions, against clearing the same number of bytes in one contiguous
// buffer (memset speed), interleaved in the same loop. Target: zero fills of ≥ 64
// pages at ≥ 0.8× memset; canary fills (per-page words) at ≥ 0.5×.
func BenchmarkFillBatch(b *testing.B) {
	const poolPages = 2048 // 128 MiB over 8 regions
	g := modelGeometry
	dev := cudaops.NewHost()
	b.Cleanup(func() { dev.Close() })
	for range g.Regions() {
		if _, err := dev.AllocRegion(poolPages, g.RegionPageBytes()); err != nil {
			b.Fatal(err)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	perm := rng.Perm(poolPages)
	for _, batch := range []int{1, 8, 64, 512} {
		pages := make([]int32, batch)
		for i := range pages {
			pages[i] = int32(perm[i])
		}
		slices.Sort(pages)
		bytes := int64(batch) * g.PageBytes()
		scratch := make([]byte, bytes)
		for _, spec := range []struct {
			name string
			spec cudaops.FillSpec
		}{
			{"zero", cudaops.FillSpec{}},
			{"canary", cudaops.FillSpec{Word: 0x5ca1ab1e, PageSalt: 0x9e3779b1, ClearMask: 0x40004000}},
		} {
			b.Run(fmt.Sprintf("pages=%d/%s", batch, spec.name), func(b *testing.B) {
				b.SetBytes(bytes)
				// The baseline runs interleaved with the fills so that both
				// meet the same cache state; ns/op counts both, the custom
				// metrics each alone.
				var base, el time.Duration
				for range b.N {
					t0 := time.Now()
					clear(scratch)
					t1 := time.Now()
					f, err := dev.Fill(pages, spec.spec, cudaops.Ordering{})
					if err != nil {
						b.Fatal(err)
					}
					if err := f.Wait(); err != nil {
						b.Fatal(err)
					}
					base, el = base+t1.Sub(t0), el+time.Since(t1)
				}
				b.ReportMetric(float64(el.Nanoseconds())/float64(b.N*batch), "ns/page")
				b.ReportMetric(float64(bytes)*float64(b.N)/el.Seconds()/1e9, "GB/s")
				b.ReportMetric(float64(base)/float64(el), "x-of-memclr-speed")
			})
		}
	}
}
