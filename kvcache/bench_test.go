package kvcache

import (
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
