package handoff

import (
	"runtime"
	"sync"
	"sync/atomic"
)

// Where the fabric moves the bytes (a NIC's RDMA writes, UCX's puts), the
// checksums are the one cost of a remote transfer that grows with its
// bytes on the hosts' cores: the sender sums every unit it writes, the
// receiver every unit that lands. One core sums about 25 GB/s of memory
// not in its cache (XXH3, bench/README.md's machine), less than a 400
// Gb/s link carries, so a chunk's units are summed by several goroutines
// where the machine has cores to spare. Each unit's sum is its own (the
// content checksum folds them in unit order afterwards), so how the
// units are split changes no checksum.

// sumWorkers is how many goroutines sum one chunk's units at most
// (defaultSumWorkers of GOMAXPROCS when the package is loaded), and
// minSpanBytes the least one of them is given to sum: a goroutine costs
// about a microsecond, 256 KiB about ten to sum. Tests change them
// (export_sums_test.go).
var sumWorkers, minSpanBytes atomic.Int64

func init() {
	sumWorkers.Store(int64(defaultSumWorkers(runtime.GOMAXPROCS(0))))
	minSpanBytes.Store(256 << 10)
}

// defaultSumWorkers is one goroutine per 8 of procs, 1 to 4: a machine
// with few cores already keeps them busy with a transfer's copies and
// both ends' sums (and, on one host, both ends), and a prefill or decode
// host runs an engine beside the transfer.
func defaultSumWorkers(procs int) int { return min(4, max(1, procs/8)) }

// inSpans splits units [0, n), bytes bytes in all, into up to sumWorkers
// consecutive spans of about minSpanBytes at least, calls f(lo, hi) for
// each on a goroutine of its own, and returns once every call has, with
// the error of the first span (in unit order) that failed. The caller
// only waits: a span it ran itself would keep the goroutine it had just
// made runnable queued behind it on its own core for a while (the
// scheduler steals a just-readied goroutine late), and two spans would
// then run one after the other.
func inSpans(n int, bytes int64, f func(lo, hi int) error) error {
	w := int(min(sumWorkers.Load(), int64(n), bytes/max(minSpanBytes.Load(), 1)))
	if w <= 1 {
		return f(0, n)
	}
	errs := make([]error, w)
	var wg sync.WaitGroup
	for i := range w {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(i*n/w, (i+1)*n/w)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
