package cudaops_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvfence/kvfence/cudaops"
)

// The benchmark geometry: a 70B-class model with grouped-query attention.
const (
	benchLayers        = 80
	benchKVHeads       = 8
	benchHeadDim       = 128
	benchDtypeBytes    = 2 // bf16
	benchTokensPerPage = 16
	benchPoolPages     = 4096 // 65,536 tokens: 20 GiB over 160 regions
	benchPageBytes     = benchTokensPerPage * benchKVHeads * benchHeadDim * benchDtypeBytes
)

// BenchmarkCUDAFill scrubs batches of scattered pages (ascending, as the
// pool passes them) over 80 layers × K/V on GPU 0, and compares the fill's
// bandwidth with one cuMemsetD32Async over a contiguous range of the same
// size, measured in the same run (x-memset). After the timed loop it
// checks that the fills happened (fillCheck: the counters, and sampled
// pages in every region read back). It skips without a GPU.
func BenchmarkCUDAFill(b *testing.B) {
	d := openGPU(b)
	defer d.Close()
	for range 2 * benchLayers {
		if _, err := d.AllocRegion(benchPoolPages, benchPageBytes); err != nil {
			if errors.Is(err, cudaops.ErrOutOfMemory) {
				b.Skipf("pool does not fit: %v", err)
			}
			b.Fatal(err)
		}
	}
	perPage := uint64(2 * benchLayers * benchPageBytes)
	maxBytes := uint64(32768/benchTokensPerPage) * perPage
	scratch, free, err := d.Scratch(maxBytes)
	if err != nil {
		b.Skipf("baseline buffer does not fit: %v", err)
	}
	defer free()
	rng := rand.New(rand.NewPCG(1, 2))

	for _, tokens := range []int{64, 1024, 8192, 32768} {
		n := tokens / benchTokensPerPage
		pages := make([]int32, 0, n)
		for _, p := range rng.Perm(benchPoolPages)[:n] {
			pages = append(pages, int32(p))
		}
		slices.Sort(pages)
		bytes := uint64(n) * perPage
		memsetGBs := memsetBandwidth(b, d, scratch, bytes)
		for _, mode := range []cudaops.FillMode{cudaops.FillKernel, cudaops.FillMemset} {
			b.Run(fmt.Sprintf("tokens=%d/mode=%s", tokens, mode), func(b *testing.B) {
				if err := d.SetFillMode(mode); err != nil {
					b.Fatal(err)
				}
				spec := cudaops.FillSpec{Word: 0x80008000}
				b.SetBytes(int64(bytes))
				check, err := newFillCheck(d, pages, spec)
				if err != nil {
					b.Fatal(err)
				}
				before := d.Counters()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					f, err := d.Fill(pages, spec, cudaops.Ordering{})
					if err != nil {
						b.Fatal(err)
					}
					if err := f.Wait(); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				after := d.Counters()
				if err := check.verify(b.N); err != nil {
					b.Fatal(err)
				}
				if mode == cudaops.FillKernel && after.Launches-before.Launches != uint64(b.N) {
					b.Fatalf("%d kernel fills made %d launches", b.N, after.Launches-before.Launches)
				}
				sec := b.Elapsed().Seconds()
				gbs := float64(bytes) * float64(b.N) / sec / 1e9
				b.ReportMetric(gbs, "GB/s")
				b.ReportMetric(float64(after.Launches-before.Launches)/float64(b.N), "launches/op")
				b.ReportMetric(gbs/memsetGBs, "x-memset")
				b.ReportMetric(sec*1e9/float64(b.N)/float64(n), "ns/page")
				b.ReportMetric(memsetGBs, "memset-GB/s")
			})
		}
	}
}

// memsetBandwidth times one cuMemsetD32Async of bytes at addr, waited for,
// as the fill's baseline: the median of 21 runs after 3 warm-ups, in GB/s.
func memsetBandwidth(b *testing.B, d *cudaops.CUDA, addr, bytes uint64) float64 {
	b.Helper()
	var runs []time.Duration
	for i := range 24 {
		start := time.Now()
		f, err := d.MemsetBaseline(addr, 0x80008000, bytes/4)
		if err != nil {
			b.Fatal(err)
		}
		if err := f.Wait(); err != nil {
			b.Fatal(err)
		}
		if i >= 3 {
			runs = append(runs, time.Since(start))
		}
	}
	slices.Sort(runs)
	return float64(bytes) / runs[len(runs)/2].Seconds() / 1e9
}
