package kvcache

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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

func (d *discardFills) FillSpans(spans []cudaops.Span, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	if d.regions == nil {
		d.regions = d.Regions()
	}
	if err := cudaops.CheckSpans(d.regions, spans); err != nil {
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
//
// pages=1 and pages=16 time the growth alone: the written watermark stays
// at the prompt, and each TryGrow asks for room for one step more than
// the lease holds. pages=1+commit is the decode step an engine runs, a
// Commit of the page just written and then a growth by one page.
//
// x-floor divides the time per growth by the least any growth under the
// pool's lock can cost, measured after the loop in the same run: the
// commit's compare-and-swap and one lock and unlock of an uncontended
// mutex around a counter.
func BenchmarkGrow(b *testing.B) {
	geom := Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 8, DType: BF16}
	const pages = 1 << 20
	for _, bc := range []struct {
		step   int
		commit bool
	}{{1, false}, {16, false}, {1, true}} {
		step := bc.step
		name := fmt.Sprintf("pages=%d", step)
		if bc.commit {
			name += "+commit"
		}
		b.Run(name, func(b *testing.B) {
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
				room := (before + step) * 16
				if bc.commit {
					if err := l.Commit(before * 16); err != nil {
						b.Fatal(err)
					}
				}
				if err := l.TryGrow(room - l.Written()); err != nil {
					b.Fatal(err)
				}
				grown += l.Pages() - before
			}
			b.StopTimer()
			perGrowth := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			b.ReportMetric(perGrowth/float64(step), "ns/page")
			floor := lockFloor(b.N)
			b.ReportMetric(floor, "floor-ns/op")
			b.ReportMetric(perGrowth/floor, "x-floor")
			if grown != b.N*step {
				b.Fatalf("%d pages grown in %d growths of %d", grown, b.N, step)
			}
			if err := p.Check(); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// lockFloor returns the nanoseconds per round of n rounds of the least
// work a growth does under the pool's lock: a compare-and-swap (Commit's)
// and a mutex locked and unlocked around one counter.
func lockFloor(n int) float64 {
	var (
		mu      sync.Mutex
		written atomic.Int64
		count   int
	)
	start := time.Now()
	for i := range n {
		written.CompareAndSwap(int64(i), int64(i+1))
		mu.Lock()
		count++
		mu.Unlock()
	}
	elapsed := time.Since(start)
	if count != n || written.Load() != int64(n) {
		panic("lockFloor: lost a round")
	}
	return float64(elapsed.Nanoseconds()) / float64(n)
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

// benchGroupsSpec is the GQA model of BenchmarkAdmitRelease (4 layers ×
// K/V, 8 KV heads × 128, bf16, 16 tokens per page) as a cache spec, with
// a state group (2 linear-attention layers) and a sliding-window group (2
// layers, window 512) added as groups grows.
func benchGroupsSpec(groups int) CacheSpec {
	s := CacheSpec{Groups: []CacheGroup{{Name: "kv", Kind: GroupPerToken, TokensPerPage: 16,
		Regions: AttentionKV(4, 8, 128, BF16, 16)}}}
	if groups >= 2 {
		s.Groups = append(s.Groups, CacheGroup{Name: "state", Kind: GroupState,
			Regions: LinearAttentionState([]int{4, 5}, 64, 4, BF16, 2, 16, 16, FP32)})
	}
	if groups >= 3 {
		s.Groups = append(s.Groups, CacheGroup{Name: "swa", Kind: GroupSlidingWindow, TokensPerPage: 16, WindowTokens: 512,
			Regions: AttentionKVOf([]int{6, 7}, 1, 8, BF16, 16)})
	}
	return s
}

// BenchmarkAdmitReleaseGroups is BenchmarkAdmitRelease/fill=excluded for
// the same 2,048-token request on pools of 1, 2 and 3 cache groups, and
// on the Geometry pool of today's API as the baseline of the same run:
// the cost of groups should grow at most linearly in their number, and
// the GQA model as a spec should cost what it costs as a Geometry.
func BenchmarkAdmitReleaseGroups(b *testing.B) {
	geom := Geometry{TokensPerPage: 16, Layers: 4, KVHeads: 8, HeadDim: 128, DType: BF16}
	for _, bc := range []struct {
		name string
		cfg  Config
	}{
		{"geometry", Config{Geometry: geom}},
		{"groups=1", Config{Cache: benchGroupsSpec(1)}},
		{"groups=2", Config{Cache: benchGroupsSpec(2), MaxLeases: 4}},
		{"groups=3", Config{Cache: benchGroupsSpec(3), MaxLeases: 4}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			dev := &discardFills{Host: cudaops.NewHost()}
			defer dev.Close()
			cfg := bc.cfg
			cfg.Pages, cfg.MaxContextTokens, cfg.Device = 1024, 16*1024, dev
			cfg.Tenants = []TenantConfig{{Name: "bench"}}
			p, err := New(cfg)
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
			s := p.Stats()
			scrubbed := s.Scrub.PagesScrubbed - before.Scrub.PagesScrubbed
			perCycle := uint64(128)
			for _, g := range p.groups[1:] {
				perCycle += uint64(g.group.perLease(2048))
			}
			if s.Admitted-before.Admitted != uint64(b.N) || scrubbed != perCycle*uint64(b.N) || s.LiveLeases != 0 {
				b.Fatalf("after %d cycles: %d admitted, %d pages scrubbed (want %d a cycle), %d live", b.N, s.Admitted-before.Admitted, scrubbed, perCycle, s.LiveLeases)
			}
			for _, g := range s.Groups {
				if g.Free != g.Pages {
					b.Fatalf("group %q: %d of %d pages free after the loop", g.Name, g.Free, g.Pages)
				}
			}
			if err := p.Check(); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// hybridBenchSpec is a hybrid model at real per-layer sizes with few
// layers (host memory): 4 MLA layers (latent 512+64 in bf16) with their
// fp8 indexer keys (128 + scale), 2 sliding-window layers (8 KV heads ×
// 128, bf16, window 128), and 4 Kimi-Delta-style state layers (32 heads
// × 128 × 128 fp32 state, 3 × 8192 bf16 conv window); 16 tokens per page.
func hybridBenchSpec() CacheSpec {
	return CacheSpec{Model: "bench-hybrid", Groups: []CacheGroup{
		{Name: "kv", Kind: GroupPerToken, TokensPerPage: 16, Regions: append(
			MLALatent([]int{3, 7, 11, 15}, 512, 64, BF16, 16), IndexerKeys([]int{3, 7, 11, 15}, 128, 16)...)},
		{Name: "swa", Kind: GroupSlidingWindow, TokensPerPage: 16, WindowTokens: 128,
			Regions: AttentionKVOf([]int{16, 17}, 8, 128, BF16, 16)},
		{Name: "state", Kind: GroupState,
			Regions: LinearAttentionState([]int{0, 1, 2, 4}, 8192, 4, BF16, 32, 128, 128, FP32)},
	}}
}

// BenchmarkHybridReleaseFill releases a 2,048-token lease of a hybrid
// pool (every group scrubbed in one pass, poison policy) and compares
// with clear() of the same number of contiguous bytes, timed alternately
// in the same benchmark: x-clear = clear time ÷ release time (1 is
// memset speed). It checks that every release was one fill of every
// group's pages.
func BenchmarkHybridReleaseFill(b *testing.B) {
	p, err := New(Config{Cache: hybridBenchSpec(), Pages: 512, MaxLeases: 2, MaxContextTokens: 8192,
		Tenants: []TenantConfig{{Name: "bench"}}, Scrub: ScrubPolicy{Kind: ScrubPoison}})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	h := p.dev.(*cudaops.Host)
	req := Request{ID: "req", Tenant: "bench", PromptTokens: 2048}
	var l Lease
	if err := p.TryAdmitInto(req, &l); err != nil {
		b.Fatal(err)
	}
	var bytes int64 = int64(l.Pages()) * p.PageBytes()
	for _, g := range p.groups[1:] {
		bytes += int64(g.group.perLease(req.Tokens())) * g.pageBytes
	}
	if err := l.Release(); err != nil {
		b.Fatal(err)
	}
	baseline := make([]byte, bytes)
	for i := range baseline {
		baseline[i] = 1 // fault it in
	}
	b.SetBytes(bytes)
	before := h.Counters()
	var releaseTime, clearTime time.Duration
	cycles := 0
	for b.Loop() {
		b.StopTimer()
		if err := p.TryAdmitInto(req, &l); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		t0 := time.Now()
		if err := l.Release(); err != nil {
			b.Fatal(err)
		}
		releaseTime += time.Since(t0)
		b.StopTimer()
		t1 := time.Now()
		clear(baseline)
		clearTime += time.Since(t1)
		b.StartTimer()
		cycles++
	}
	c := h.Counters()
	if got := c.FillCalls - before.FillCalls; got != uint64(cycles) {
		b.Fatalf("%d releases made %d fills, want one each", cycles, got)
	}
	if got := c.BytesFilled - before.BytesFilled; got != uint64(cycles)*uint64(bytes) {
		b.Fatalf("%d releases filled %d bytes, want %d each", cycles, got, bytes)
	}
	b.ReportMetric(float64(clearTime)/float64(releaseTime), "x-clear")
	b.ReportMetric(float64(bytes)/(1<<20), "MiB/release")
	if err := p.Check(); err != nil {
		b.Fatal(err)
	}
}
