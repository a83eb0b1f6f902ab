package cudaops_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// benchGeometry is a model's cache as the fill sees it: its regions' page
// sizes and its tokens per page.
type benchGeometry struct {
	name          string
	tokensPerPage int
	pageBytes     []int64 // per region
}

// presetGeometry reads a kvcache preset's per-token group.
func presetGeometry(tb testing.TB, name string) benchGeometry {
	tb.Helper()
	spec, err := kvcache.Preset(name)
	if err != nil {
		tb.Fatal(err)
	}
	g := spec.Groups[0]
	geo := benchGeometry{name: name, tokensPerPage: g.TokensPerPage}
	for _, r := range g.Regions {
		geo.pageBytes = append(geo.pageBytes, r.PageBytes)
	}
	return geo
}

func (g benchGeometry) pagesFor(tokens int) int {
	return (tokens + g.tokensPerPage - 1) / g.tokensPerPage
}

func (g benchGeometry) perPage() (n uint64) {
	for _, pb := range g.pageBytes {
		n += uint64(pb)
	}
	return n
}

// benchRun is one benchmark configuration: the geometries, the batch
// sizes in tokens, the pool every geometry gets, and whether times mean
// anything (not on the simulated driver).
type benchRun struct {
	models     []benchGeometry
	tokens     []int
	poolTokens int
	timed      bool
}

// BenchmarkCUDAFill scrubs batches of scattered pages (ascending, as a
// pool passes them) of 64, 2,048, 8,192 and 32,768 tokens of Llama-3.1-8B
// (32 layers × K/V of 8 heads × 128, bf16, 16 tokens a page) and of
// DeepSeek-V3's MLA latents (61 layers, 64 tokens a page), on GPU 0, in
// kernel and memset mode, each fill ordered after an engine stream and
// waited for. Reported per batch, in the same run:
//
//   - us-min, us-med, us-max: Fill + Wait, wall time;
//   - kernel-us-min/med/max: device time of the fill alone, from CUDA
//     events on the device's stream around it;
//   - GB/s, kernel-GB/s: the batch's bytes over the medians;
//   - x-memset: GB/s ÷ that of one contiguous cuMemsetD32Async of the
//     same bytes (Fill + Wait against MemsetBaseline + Wait, medians of
//     the same number of runs), and x-memset-kernel the same with device
//     times;
//   - launches/op, which must be 1 in kernel mode.
//
// After the timed loop it checks that the fills happened (fillCheck). It
// skips without a GPU (BenchmarkCUDAFillSimulated runs the same code on
// the simulated driver).
func BenchmarkCUDAFill(b *testing.B) {
	run := benchRun{
		models:     []benchGeometry{presetGeometry(b, "llama-3.1-8b"), presetGeometry(b, "deepseek-v3")},
		tokens:     []int{64, 2048, 8192, 32768},
		poolTokens: 65536,
		timed:      true,
	}
	d := openGPU(b)
	b.Logf("device %s", d.Name())
	_ = d.Close()
	run.bench(b, func(b *testing.B) *cudaops.CUDA { return openGPU(b) })
}

// BenchmarkCUDAFillSimulated is BenchmarkCUDAFill on the simulated
// driver, over a small geometry: the kernel's text runs on the CPU, so
// its times mean nothing, but it checks that every batch is one launch
// (launches/op) and that the fills happened.
func BenchmarkCUDAFillSimulated(b *testing.B) {
	run := benchRun{
		models:     []benchGeometry{{name: "small", tokensPerPage: 16, pageBytes: []int64{2048, 2048, 1024, 1024}}},
		tokens:     []int{64, 1024},
		poolTokens: 4096,
	}
	run.bench(b, func(b *testing.B) *cudaops.CUDA {
		d, _, err := cudaops.OpenFake()
		if err != nil {
			b.Fatal(err)
		}
		return d
	})
}

func (run benchRun) bench(b *testing.B, open func(*testing.B) *cudaops.CUDA) {
	for _, geo := range run.models {
		b.Run(geo.name, func(b *testing.B) {
			d := open(b)
			defer d.Close()
			poolPages := geo.pagesFor(run.poolTokens)
			for _, pb := range geo.pageBytes {
				if _, err := d.AllocRegion(poolPages, pb); err != nil {
					if errors.Is(err, cudaops.ErrOutOfMemory) {
						b.Skipf("pool does not fit: %v", err)
					}
					b.Fatal(err)
				}
			}
			maxBytes := uint64(geo.pagesFor(slices.Max(run.tokens))) * geo.perPage()
			scratch, free, err := d.Scratch(maxBytes)
			if err != nil {
				b.Skipf("baseline buffer does not fit: %v", err)
			}
			defer free()
			engine, err := d.NewTestEngine(0)
			if err != nil {
				b.Fatal(err)
			}
			defer engine.Close()
			after := cudaops.Ordering{Stream: engine.Stream()}
			timer, err := d.NewTimed()
			if err != nil {
				b.Fatal(err)
			}
			defer timer.Close()
			rng := rand.New(rand.NewPCG(1, 2))
			for _, tokens := range run.tokens {
				n := geo.pagesFor(tokens)
				pages := make([]int32, 0, n)
				for _, p := range rng.Perm(poolPages)[:n] {
					pages = append(pages, int32(p))
				}
				slices.Sort(pages)
				bytes := uint64(n) * geo.perPage()
				for _, mode := range []cudaops.FillMode{cudaops.FillKernel, cudaops.FillMemset} {
					b.Run(fmt.Sprintf("tokens=%d/mode=%s", tokens, mode), func(b *testing.B) {
						benchFillBatch(b, run, d, timer, pages, bytes, scratch, mode, after)
					})
				}
			}
		})
	}
}

// durations are one measurement's runs.
type durations []time.Duration

func (ds durations) stats() (lo, med, hi time.Duration) {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[0], s[len(s)/2], s[len(s)-1]
}

// maxTimedRuns bounds the runs timed with events and the baseline's runs.
const maxTimedRuns = 64

func benchFillBatch(b *testing.B, run benchRun, d *cudaops.CUDA, timer *cudaops.Timed, pages []int32, bytes, scratch uint64,
	mode cudaops.FillMode, after cudaops.Ordering) {
	if err := d.SetFillMode(mode); err != nil {
		b.Fatal(err)
	}
	spec := cudaops.FillSpec{Word: 0x80008000}
	fill := func() (cudaops.Fence, error) { return d.Fill(pages, spec, after) }
	wait := func(f cudaops.Fence, err error) {
		if err == nil {
			err = f.Wait()
		}
		if err != nil {
			b.Fatal(err)
		}
	}
	wait(fill()) // warm: the first fill of a batch size pays its first-touch costs
	b.SetBytes(int64(bytes))
	check, err := newFillCheck(d, pages, spec)
	if err != nil {
		b.Fatal(err)
	}
	before := d.Counters()
	wall := make(durations, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		wait(fill())
		wall = append(wall, time.Since(t0))
	}
	b.StopTimer()
	after2 := d.Counters()
	launches := float64(after2.Launches-before.Launches) / float64(b.N)
	if mode == cudaops.FillKernel && after2.Launches-before.Launches != uint64(b.N) {
		b.Fatalf("%d kernel fills made %d launches", b.N, after2.Launches-before.Launches)
	}
	if err := check.verify(b.N); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(launches, "launches/op")
	if !run.timed {
		return
	}
	// In the same run: the baseline's wall time, measured as the fill's
	// (no timing events around it), and the device times of the fill
	// alone and of the baseline, from timing events around them.
	runs := min(b.N, maxTimedRuns)
	memset := func() (cudaops.Fence, error) { return d.MemsetBaseline(scratch, 0x80008000, bytes/4) }
	elapsed := func() time.Duration {
		el, err := timer.Elapsed()
		if err != nil {
			b.Fatal(err)
		}
		return el
	}
	var kernel, base, baseKernel durations
	for range runs {
		t0 := time.Now()
		wait(memset())
		base = append(base, time.Since(t0))
		wait(timer.Run(fill))
		kernel = append(kernel, elapsed())
		wait(timer.Run(memset))
		baseKernel = append(baseKernel, elapsed())
	}
	gbs := func(t time.Duration) float64 { return float64(bytes) / t.Seconds() / 1e9 }
	lo, med, hi := wall.stats()
	klo, kmed, khi := kernel.stats()
	_, bmed, _ := base.stats()
	_, bkmed, _ := baseKernel.stats()
	us := func(t time.Duration) float64 { return float64(t.Nanoseconds()) / 1e3 }
	b.ReportMetric(us(lo), "us-min")
	b.ReportMetric(us(med), "us-med")
	b.ReportMetric(us(hi), "us-max")
	b.ReportMetric(us(klo), "kernel-us-min")
	b.ReportMetric(us(kmed), "kernel-us-med")
	b.ReportMetric(us(khi), "kernel-us-max")
	b.ReportMetric(gbs(med), "GB/s")
	b.ReportMetric(gbs(kmed), "kernel-GB/s")
	b.ReportMetric(gbs(bmed), "memset-GB/s")
	b.ReportMetric(gbs(med)/gbs(bmed), "x-memset")
	b.ReportMetric(gbs(kmed)/gbs(bkmed), "x-memset-kernel")
}
