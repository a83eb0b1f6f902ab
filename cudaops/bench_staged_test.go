package cudaops_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvfence/kvfence/cudaops"
)

// BenchmarkCUDAStagedCopies moves the pages of a Llama-3.1-8B prompt of
// 2,048 and 8,192 tokens (64 regions of 32 KiB pages, 2 MiB a page)
// between GPU 0 and Go memory the way a handoff does: out, ReadStaged of
// every region of every page, each batch drained from page-locked
// staging into a page-major buffer (d2h, kvcache's export); in,
// WriteStaged filled from it (h2d, the import). The pages lie adjacent,
// as in a fresh pool. Reported per direction, in the same run:
//
//   - GB/s: the prompt's bytes over the median op;
//   - memcpy-GB/s: one plain cuMemcpyDtoHAsync (or HtoDAsync) of the same
//     bytes between a contiguous region and page-locked memory, waited
//     for, run after each op: CopyToHost (CopyFromHost) of all its pages,
//     which coalesces them into that one copy;
//   - x-memcpy: GB/s over memcpy-GB/s (medians): what the staging, the
//     batches and the host copy into Go memory cost against the bare DMA.
//
// After the loop the device's pages are read back and compared with what
// was written. It skips without a GPU; BenchmarkCUDAStagedCopiesSimulated
// runs the same code on the simulated driver, where times mean nothing.
func BenchmarkCUDAStagedCopies(b *testing.B) {
	d := openGPU(b)
	b.Logf("device %s", d.Name())
	_ = d.Close()
	benchStagedCopies(b, []int{2048, 8192}, llamaRegionPage, true, func(b *testing.B) *cudaops.CUDA { return openGPU(b) })
}

// BenchmarkCUDAStagedCopiesSimulated is BenchmarkCUDAStagedCopies on the
// simulated driver, with small pages (benchRegionPage bytes a region):
// it checks that the bytes go and come back whole, and runs the baseline,
// whose times it does not report.
func BenchmarkCUDAStagedCopiesSimulated(b *testing.B) {
	benchStagedCopies(b, []int{2048}, benchRegionPage, false, func(b *testing.B) *cudaops.CUDA {
		d, _, err := cudaops.OpenFake()
		if err != nil {
			b.Fatal(err)
		}
		return d
	})
}

func benchStagedCopies(b *testing.B, tokens []int, regionPage int64, timed bool, open func(*testing.B) *cudaops.CUDA) {
	for _, n := range tokens {
		pages := n / llamaTPP
		for _, dir := range []string{"d2h", "h2d"} {
			b.Run(fmt.Sprintf("tokens=%d/%s", n, dir), func(b *testing.B) {
				d := open(b)
				defer d.Close()
				regions := make([]int, llamaRegions)
				for r := range regions {
					var err error
					if regions[r], err = d.AllocRegion(pages, regionPage); err != nil {
						b.Skipf("the prompt's pages do not fit: %v", err)
					}
				}
				ids := make([]int32, pages)
				for i := range ids {
					ids[i] = int32(i)
				}
				pageBytes := int(regionPage) * llamaRegions
				size := pages * pageBytes
				// Page-major, as the handoff's buffers are: a page's regions
				// one after the other.
				want := make([]byte, size)
				rng := rand.New(rand.NewPCG(uint64(n), 34))
				for i := 0; i+8 <= len(want); i += 8 {
					binary.LittleEndian.PutUint64(want[i:], rng.Uint64())
				}
				buf := make([]byte, size)
				// scatter and gather move a batch between staging (region
				// by region, page after page) and the page-major buffer.
				scatter := func(first int, staged [][]byte) {
					for k, st := range staged {
						for p := 0; p*int(regionPage) < len(st); p++ {
							copy(buf[(first+p)*pageBytes+k*int(regionPage):], st[p*int(regionPage):(p+1)*int(regionPage)])
						}
					}
				}
				gather := func(first int, staged [][]byte) {
					for k, st := range staged {
						for p := 0; p*int(regionPage) < len(st); p++ {
							copy(st[p*int(regionPage):(p+1)*int(regionPage)], want[(first+p)*pageBytes+k*int(regionPage):])
						}
					}
				}
				write := func() error { return d.WriteStaged(regions, ids, gather) }
				read := func() error { return d.ReadStaged(regions, ids, scatter) }
				if err := write(); err != nil {
					b.Fatal(err)
				}
				op := read
				if dir == "h2d" {
					op = write
				}
				// The baseline: a region of the prompt's bytes in one
				// piece and page-locked memory as large.
				ref, err := d.AllocRegion(pages, int64(pageBytes))
				if err != nil {
					b.Skipf("the baseline's region does not fit: %v", err)
				}
				host, err := d.AllocHost(int64(size))
				if err != nil {
					b.Skipf("the baseline's host memory does not fit: %v", err)
				}
				whole := cudaops.HostCopy{Regions: []int{ref}, Host: [][]byte{host}, Pages: ids, Slots: ids}
				baseline := func() error {
					if dir == "h2d" {
						return d.CopyFromHost(whole)
					}
					return d.CopyToHost(whole, cudaops.Ordering{})
				}
				b.SetBytes(int64(size))
				var ops, refs durations
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					t0 := time.Now()
					if err := op(); err != nil {
						b.Fatal(err)
					}
					ops = append(ops, time.Since(t0))
					b.StopTimer()
					t0 = time.Now()
					if err := baseline(); err != nil {
						b.Fatal(err)
					}
					refs = append(refs, time.Since(t0))
					b.StartTimer()
				}
				b.StopTimer()
				clear(buf)
				if err := read(); err != nil {
					b.Fatal(err)
				}
				if !bytes.Equal(buf, want) {
					b.Fatalf("the pages read back are not the pages written (%s)", dir)
				}
				if !timed {
					return
				}
				gbs := func(t time.Duration) float64 { return float64(size) / t.Seconds() / 1e9 }
				_, med, _ := ops.stats()
				_, rmed, _ := refs.stats()
				b.ReportMetric(gbs(med), "GB/s")
				b.ReportMetric(gbs(rmed), "memcpy-GB/s")
				b.ReportMetric(gbs(med)/gbs(rmed), "x-memcpy")
			})
		}
	}
}
