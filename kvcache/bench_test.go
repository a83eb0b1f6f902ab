package kvcache

import (
	"context"
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
			ctx := context.Background()
			req := Request{ID: "req", Tenant: "bench", PromptTokens: 2048}
			var l Lease
			b.ReportAllocs()
			for b.Loop() {
				if err := p.AdmitInto(ctx, req, &l); err != nil {
					b.Fatal(err)
				}
				if err := l.Release(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/128, "ns/page")
		})
	}
}
