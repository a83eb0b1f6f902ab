package kvcache

import (
	"fmt"
	"testing"

	"github.com/kvfence/kvfence/cudaops"
)

// discardFills is a device whose fills touch no memory: it isolates the
// cost of admission and release from the fill, which BenchmarkHostFill
// (cudaops) and BenchmarkCUDAFill measure on their own.
type discardFills struct {
	*cudaops.Host
	regions []cudaops.Region // cached after the pool allocated them
}

func (d *discardFills) Fill(pages []int32, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	if d.regions == nil {
		d.regions = d.Regions()
	}
	if err := cudaops.CheckPages(d.regions, pages); err != nil {
		return nil, err
	}
	return cudaops.Completed(nil), nil
}

// BenchmarkAdmitRelease admits and releases one 2,048-token request (128
// pages of 16 tokens) under the zero policy.
func BenchmarkAdmitRelease(b *testing.B) {
	geom := Geometry{TokensPerPage: 16, Layers: 4, KVHeads: 8, HeadDim: 128, DType: BF16}
	for _, bc := range []struct {
		name string
		dev  func() cudaops.Device
	}{
		{"fill=excluded", func() cudaops.Device { return &discardFills{Host: cudaops.NewHost()} }},
		{"fill=host", func() cudaops.Device { return cudaops.NewHost() }},
	} {
		b.Run(bc.name, func(b *testing.B) {
			dev := bc.dev()
			defer dev.Close()
			p, err := New(Config{Geometry: geom, Pages: 1024, MaxContextTokens: 16 * 1024, Device: dev,
				Tenants: []TenantConfig{{Name: "bench"}}})
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			req := Request{ID: "req", Tenant: "bench", PromptTokens: 2048}
			var l Lease
			before := p.Stats()
			b.ReportAllocs()
			for b.Loop() {
				if err := p.TryAdmitInto(req, &l); err != nil {
					b.Fatal(err)
				}
				if err := l.Release(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/128, "ns/page")
			// Every cycle admitted 128 pages and scrubbed them back.
			s := p.Stats()
			if l.Pages() != 128 || s.Admitted-before.Admitted != uint64(b.N) ||
				s.Scrub.PagesScrubbed-before.Scrub.PagesScrubbed != uint64(128*b.N) || s.FreePages != 1024 || s.LiveLeases != 0 {
				b.Fatalf("after %d cycles: lease of %d pages, %d admitted, %d pages scrubbed, %d free, %d live",
					b.N, l.Pages(), s.Admitted-before.Admitted, s.Scrub.PagesScrubbed-before.Scrub.PagesScrubbed, s.FreePages, s.LiveLeases)
			}
			if err := p.Check(); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// BenchmarkGrow grows one on-demand lease on a 1M-page pool by one page
// and by 16 pages a time, reporting ns per page added; the lease is
// released and admitted again, off the clock, whenever it nears its
// limit. The fill is excluded (discardFills), as in AdmitRelease.
func BenchmarkGrow(b *testing.B) {
	geom := Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 8, DType: BF16}
	const pages = 1 << 20
	for _, step := range []int{1, 16} {
		b.Run(fmt.Sprintf("pages=%d", step), func(b *testing.B) {
			dev := &discardFills{Host: cudaops.NewHost()}
			defer dev.Close()
			p, err := New(Config{Geometry: geom, Pages: pages, MaxContextTokens: pages * 16, Device: dev,
				Tenants: []TenantConfig{{Name: "bench"}}, Sizing: Sizing{Mode: SizeOnDemand}})
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			const limit = 4096 // pages a lease grows to before it starts again
			req := Request{ID: "grow", Tenant: "bench", PromptTokens: 16, MaxNewTokens: limit * 16}
			var l Lease
			restart := func() {
				if l.Live() {
					if err := l.Release(); err != nil {
						b.Fatal(err)
					}
				}
				if err := p.TryAdmitInto(req, &l); err != nil {
					b.Fatal(err)
				}
			}
			restart()
			restart() // the Lease's buffers have grown once
			grown := 0
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if l.Pages()+step > limit {
					b.StopTimer()
					restart()
					b.StartTimer()
				}
				before := l.Pages()
				if err := l.Commit(before * 16); err != nil {
					b.Fatal(err)
				}
				if err := l.TryGrow(step * 16); err != nil {
					b.Fatal(err)
				}
				grown += l.Pages() - before
			}
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*step), "ns/page")
			if grown != b.N*step {
				b.Fatalf("%d pages grown in %d growths of %d", grown, b.N, step)
			}
			if err := p.Check(); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// BenchmarkAdmitReleaseSizing admits and releases a request of 2,048
// prompt and 2,048 output tokens under full sizing (256 pages) and under
// on-demand sizing with no headroom (the prompt's 128 pages), and, as the
// like-for-like check, a prompt-only request under each (128 pages both):
// on-demand admission does no more work per page than full.
func BenchmarkAdmitReleaseSizing(b *testing.B) {
	geom := Geometry{TokensPerPage: 16, Layers: 4, KVHeads: 8, HeadDim: 128, DType: BF16}
	for _, bc := range []struct {
		name   string
		sizing Sizing
		maxNew int
		pages  int
	}{
		{"full/out=2048", Sizing{Mode: SizeFull}, 2048, 256},
		{"on-demand/out=2048", Sizing{Mode: SizeOnDemand}, 2048, 128},
		{"full/out=0", Sizing{Mode: SizeFull}, 0, 128},
		{"on-demand/out=0", Sizing{Mode: SizeOnDemand}, 0, 128},
	} {
		b.Run(bc.name, func(b *testing.B) {
			dev := &discardFills{Host: cudaops.NewHost()}
			defer dev.Close()
			p, err := New(Config{Geometry: geom, Pages: 1024, MaxContextTokens: 16 * 1024, Device: dev,
				Tenants: []TenantConfig{{Name: "bench"}}, Sizing: bc.sizing})
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			req := Request{ID: "req", Tenant: "bench", PromptTokens: 2048, MaxNewTokens: bc.maxNew}
			var l Lease
			b.ReportAllocs()
			for b.Loop() {
				if err := p.TryAdmitInto(req, &l); err != nil {
					b.Fatal(err)
				}
				if err := l.Release(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*bc.pages), "ns/page")
			if l.Pages() != bc.pages {
				b.Fatalf("lease of %d pages, want %d", l.Pages(), bc.pages)
			}
		})
	}
}
