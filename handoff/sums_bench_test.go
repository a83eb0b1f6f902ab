package handoff

import (
	"fmt"
	"testing"
)

// BenchmarkChunkSums is the sender's share of a remote transfer's
// checksums on its own: 256 MiB of units (4 regions of 32 KiB pages, a
// chunk of 4 MiB at a time, as BenchmarkHandoff's), summed by sumChunk
// with 1, 2 and 4 goroutines a chunk, from memory no chunk before has
// left in the cache. GB/s is the sum's rate; the decode side's Landed sums
// the same bytes the same way.
func BenchmarkChunkSums(b *testing.B) {
	const (
		regions    = 4
		pageBytes  = 32 << 10
		chunkUnits = 32
		total      = 256 << 20
	)
	mem := make([]byte, total)
	for i := range mem {
		mem[i] = byte(i * 131)
	}
	unitBytes := regions * pageBytes
	units := total / unitBytes
	chunks := make([]remoteChunk, 0, units/chunkUnits)
	for first := 0; first < units; first += chunkUnits {
		c := remoteChunk{first: first, n: chunkUnits, regions: regions}
		for u := first; u < first+chunkUnits; u++ {
			for r := range regions {
				off := u*unitBytes + r*pageBytes
				c.views = append(c.views, mem[off:off+pageBytes])
			}
		}
		chunks = append(chunks, c)
	}
	sums := make([]uint64, units)
	for _, workers := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			defer SetSumSpansForTest(workers, minSpanBytes.Load())()
			b.SetBytes(total)
			for b.Loop() {
				for i := range chunks {
					sumChunk(&chunks[i], sums)
				}
			}
			b.ReportMetric(float64(total)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}
