package bench

import (
	"bytes"
	"encoding/binary"
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

// newPool is a pool of the zero scrub policy (kvcache's default): its
// freed pages read back as zero bytes.
func newPool(tb testing.TB, g kvcache.Geometry, pages int, dev cudaops.Device) *kvcache.Pool {
	tb.Helper()
	p, err := kvcache.New(kvcache.Config{Geometry: g, Pages: pages, MaxContextTokens: pages * g.TokensPerPage,
		Tenants: []kvcache.TenantConfig{{Name: "a"}, {Name: "b"}, {Name: "c"}, {Name: "d"}}, Device: dev})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.Close() })
	return p
}

var tenants = []string{"a", "b", "c", "d"}

// fill admits n one-page leases, spread over the tenants, and keeps them.
func fill(tb testing.TB, p *kvcache.Pool, n int) []*kvcache.Lease {
	tb.Helper()
	leases := make([]*kvcache.Lease, n)
	for i := range leases {
		l, err := p.TryAdmit(kvcache.Request{ID: fmt.Sprintf("live-%d", i), Tenant: tenants[i%4], PromptTokens: 16})
		if err != nil {
			tb.Fatal(err)
		}
		if l.Pages() != 1 {
			tb.Fatalf("live lease %d holds %d pages, want 1", i, l.Pages())
		}
		leases[i] = l
	}
	return leases
}

// admitRelease runs n admissions of a 4-page request, each released at
// once, reusing one Lease and one ID, as an engine that recycles its
// request structs does. Each admission must hand out the 4 pages (a
// length read, inside the timed loop: too cheap to move the figure).
func admitRelease(b *testing.B, p *kvcache.Pool, n int) {
	var l kvcache.Lease
	req := kvcache.Request{ID: "bench", Tenant: "b", PromptTokens: 48, MaxNewTokens: 16}
	for range n {
		if err := p.TryAdmitInto(req, &l); err != nil {
			b.Fatal(err)
		}
		if l.Pages() != 4 {
			b.Fatalf("admitted lease holds %d pages, want 4", l.Pages())
		}
		if err := l.Release(); err != nil {
			b.Fatal(err)
		}
	}
}

// checkAdmitted says whether p admitted n more requests than it had at
// before and holds exactly the live one-page leases: every admission
// happened, and every release gave its pages back.
func checkAdmitted(p *kvcache.Pool, before kvcache.Stats, n, live int) error {
	st := p.Stats()
	if got := st.Admitted - before.Admitted; got != uint64(n) {
		return fmt.Errorf("%d admissions counted, want %d", got, n)
	}
	if st.LiveLeases != live || st.InUsePages != live {
		return fmt.Errorf("%d live leases holding %d pages after the releases, want %d and %d", st.LiveLeases, st.InUsePages, live, live)
	}
	return p.Check()
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
			emptyBefore, loadedBefore := empty.Stats(), loaded.Stats()
			start := time.Now()
			admitRelease(b, empty, b.N)
			base := time.Since(start)
			b.ResetTimer()
			admitRelease(b, loaded, b.N)
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/admit+release")
			b.ReportMetric(float64(b.Elapsed())/float64(base), "x-vs-empty-pool")
			if err := checkAdmitted(empty, emptyBefore, b.N, 0); err != nil {
				b.Fatal("empty pool: ", err)
			}
			if err := checkAdmitted(loaded, loadedBefore, b.N, live); err != nil {
				b.Fatal("loaded pool: ", err)
			}
		})
	}
}

// admitAll admits one 4-page lease per element of leases.
func admitAll(tb testing.TB, p *kvcache.Pool, leases []kvcache.Lease) {
	tb.Helper()
	for i := range leases {
		req := kvcache.Request{ID: fmt.Sprintf("s%d", i), Tenant: tenants[i%4], PromptTokens: 40, MaxNewTokens: 24}
		if err := p.TryAdmitInto(req, &leases[i]); err != nil {
			tb.Fatal(err)
		}
		if leases[i].Pages() != 4 {
			tb.Fatalf("lease %d holds %d pages, want 4", i, leases[i].Pages())
		}
	}
}

func releaseAll(tb testing.TB, leases []kvcache.Lease) {
	tb.Helper()
	for i := range leases {
		if err := leases[i].Release(); err != nil {
			tb.Fatal(err)
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
			// The devices are the test's own, so that it can read what the
			// pools left in freed pages.
			safeDev, unsafeDev := cudaops.NewHost(), kvsim.UnsafeNoScrub(cudaops.NewHost())
			safe := newPool(b, modelGeometry, pages, safeDev)
			unsafe := newPool(b, modelGeometry, pages, unsafeDev)
			leases := make([]kvcache.Lease, n)
			scrubbed0 := safe.Stats().Scrub.PagesScrubbed // the pool scrubbed its pages at creation
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
			if got, want := safe.Stats().Scrub.PagesScrubbed-scrubbed0, uint64(b.N*pages); got != want {
				b.Fatalf("safe pool scrubbed %d pages in the storms, want %d", got, want)
			}
			// One more storm of each, untimed, over pages the engine wrote:
			// the safe pool's must read back as zeros, the baseline's must
			// still hold the KV (else the ratio is not against "no fill").
			if err := checkStorm(b, safe, safeDev, leases, true); err != nil {
				b.Fatal(err)
			}
			if err := checkStorm(b, unsafe, unsafeDev, leases, false); err != nil {
				b.Fatal(err)
			}
			if err := safe.Check(); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// checkStorm admits leases on p, writes a marker into every page of every
// region as an engine would, releases them all and reads every page back:
// with scrubbed, each must hold only zeros; without, still the marker.
// Setup failures are fatal to tb; what the pages hold is the error.
func checkStorm(tb testing.TB, p *kvcache.Pool, dev cudaops.Device, leases []kvcache.Lease, scrubbed bool) error {
	tb.Helper()
	g := p.Geometry()
	marker := make([]byte, g.RegionPageBytes())
	for off := 0; off < len(marker); off += 4 {
		binary.LittleEndian.PutUint32(marker[off:], 0x4b564b56)
	}
	want := marker
	if scrubbed {
		want = make([]byte, len(marker))
	}
	admitAll(tb, p, leases)
	var pages []int32
	for i := range leases {
		var err error
		if pages, err = leases[i].AppendBlockTable(pages); err != nil {
			tb.Fatal(err)
		}
	}
	for _, pg := range pages {
		for r := range g.Regions() {
			if err := dev.WritePage(r, pg, marker); err != nil {
				tb.Fatal(err)
			}
		}
	}
	releaseAll(tb, leases)
	got := make([]byte, len(marker))
	for _, pg := range pages {
		for r := range g.Regions() {
			if err := dev.ReadPage(r, pg, got); err != nil {
				tb.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				return fmt.Errorf("%s: page %d region %d after release: first bytes %x, want %x (scrubbed: %v)",
					dev.Name(), pg, r, got[:8], want[:8], scrubbed)
			}
		}
	}
	return nil
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
		batchBytes := int64(batch) * g.PageBytes()
		scratch := make([]byte, batchBytes)
		for _, spec := range []struct {
			name string
			spec cudaops.FillSpec
		}{
			{"zero", cudaops.FillSpec{}},
			{"canary", cudaops.FillSpec{Word: 0x5ca1ab1e, PageSalt: 0x9e3779b1, ClearMask: 0x40004000}},
		} {
			b.Run(fmt.Sprintf("pages=%d/%s", batch, spec.name), func(b *testing.B) {
				dirtyPages(b, dev, g, pages)
				b.SetBytes(batchBytes)
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
				b.ReportMetric(float64(batchBytes)*float64(b.N)/el.Seconds()/1e9, "GB/s")
				b.ReportMetric(float64(base)/float64(el), "x-of-memclr-speed")
				if err := checkFilled(dev, g, pages, spec.spec); err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}

// dirtyPages writes a word no fill spec here produces into pages, in
// every region, so that checkFilled sees what the fills wrote.
func dirtyPages(tb testing.TB, dev cudaops.Device, g kvcache.Geometry, pages []int32) {
	tb.Helper()
	dirty := bytes.Repeat([]byte{0xa5}, int(g.RegionPageBytes()))
	for _, p := range pages {
		for r := range g.Regions() {
			if err := dev.WritePage(r, p, dirty); err != nil {
				tb.Fatal(err)
			}
		}
	}
}

// checkFilled says whether every page of pages holds spec's word for it
// in every region.
func checkFilled(dev cudaops.Device, g kvcache.Geometry, pages []int32, spec cudaops.FillSpec) error {
	got := make([]byte, g.RegionPageBytes())
	want := make([]byte, len(got))
	for _, p := range pages {
		w := spec.WordFor(p)
		for off := 0; off < len(want); off += 4 {
			binary.LittleEndian.PutUint32(want[off:], w)
		}
		for r := range g.Regions() {
			if err := dev.ReadPage(r, p, got); err != nil {
				return err
			}
			if !bytes.Equal(got, want) {
				return fmt.Errorf("page %d region %d after the fills: first bytes %x, want word %#08x", p, r, got[:8], w)
			}
		}
	}
	return nil
}
