package kvsim

import (
	"fmt"
	"math/bits"
	"sync"
	"time"

	"github.com/kvfence/kvfence/cudaops"
)

// unsafeNoScrubDevice is the "none" baseline: a Device whose Fill checks its
// arguments and writes nothing, so freed pages keep their previous owner's
// KV. UNSAFE. It exists only so that kvbench can measure what scrubbing
// costs against an engine that does not scrub (which is how engines run
// today, and how the incident in docs/design.md happened); the audit shows the
// stale pages it hands out. Never serve with it.
type unsafeNoScrubDevice struct{ cudaops.Device }

// UnsafeNoScrub wraps dev in the "none" baseline device: its Fill checks
// the pages and writes nothing. UNSAFE, for measuring only.
func UnsafeNoScrub(dev cudaops.Device) cudaops.Device { return unsafeNoScrubDevice{dev} }

func (d unsafeNoScrubDevice) Name() string { return d.Device.Name() + " (UNSAFE: fills skipped)" }

// The wrappers pass a host tier's copies (cudaops.HostCopier) through to
// the device they wrap: a pool with a tier needs them.

func (d unsafeNoScrubDevice) AllocHost(n int64) ([]byte, error) { return allocHost(d.Device, n) }
func (d unsafeNoScrubDevice) FreeHost(b []byte) error           { return freeHost(d.Device, b) }
func (d unsafeNoScrubDevice) CopyToHost(c cudaops.HostCopy, after cudaops.Ordering) error {
	return copyToHost(d.Device, c, after)
}
func (d unsafeNoScrubDevice) CopyFromHost(c cudaops.HostCopy) error { return copyFromHost(d.Device, c) }

func (d *meteredDevice) AllocHost(n int64) ([]byte, error) { return allocHost(d.Device, n) }
func (d *meteredDevice) FreeHost(b []byte) error           { return freeHost(d.Device, b) }
func (d *meteredDevice) CopyToHost(c cudaops.HostCopy, after cudaops.Ordering) error {
	return copyToHost(d.Device, c, after)
}
func (d *meteredDevice) CopyFromHost(c cudaops.HostCopy) error { return copyFromHost(d.Device, c) }

// errNoHostCopy is a wrapped device's lack of host copies.
func errNoHostCopy(d cudaops.Device) error {
	return fmt.Errorf("%w: %s cannot copy pages to host memory", cudaops.ErrInvalidArgument, d.Name())
}

func allocHost(d cudaops.Device, n int64) ([]byte, error) {
	if hc, ok := d.(cudaops.HostCopier); ok {
		return hc.AllocHost(n)
	}
	return nil, errNoHostCopy(d)
}

func freeHost(d cudaops.Device, b []byte) error {
	if hc, ok := d.(cudaops.HostCopier); ok {
		return hc.FreeHost(b)
	}
	return errNoHostCopy(d)
}

func copyToHost(d cudaops.Device, c cudaops.HostCopy, after cudaops.Ordering) error {
	if hc, ok := d.(cudaops.HostCopier); ok {
		return hc.CopyToHost(c, after)
	}
	return errNoHostCopy(d)
}

func copyFromHost(d cudaops.Device, c cudaops.HostCopy) error {
	if hc, ok := d.(cudaops.HostCopier); ok {
		return hc.CopyFromHost(c)
	}
	return errNoHostCopy(d)
}

func (d unsafeNoScrubDevice) Fill(pages []int32, _ cudaops.FillSpec, _ cudaops.Ordering) (cudaops.Fence, error) {
	if err := cudaops.CheckPages(d.Regions(), pages); err != nil {
		return nil, err
	}
	return cudaops.Completed(nil), nil
}

// FillSpans, for a pool of several cache groups: checks, writes nothing.
func (d unsafeNoScrubDevice) FillSpans(spans []cudaops.Span, _ cudaops.FillSpec, _ cudaops.Ordering) (cudaops.Fence, error) {
	if err := cudaops.CheckSpans(d.Regions(), spans); err != nil {
		return nil, err
	}
	return cudaops.Completed(nil), nil
}

// MovePages copies, as the device does: state checkpoints are copies,
// not scrubs, and the baseline takes and restores them like any engine.
func (d unsafeNoScrubDevice) MovePages(spans []cudaops.MoveSpan, after cudaops.Ordering) (cudaops.Fence, error) {
	return movePages(d.Device, spans, after)
}

// movePages is dev's MovePages, or an error naming a device that has none.
func movePages(dev cudaops.Device, spans []cudaops.MoveSpan, after cudaops.Ordering) (cudaops.Fence, error) {
	m, ok := dev.(cudaops.PageMover)
	if !ok {
		return nil, fmt.Errorf("%w: %s cannot copy pages on the device (cudaops.PageMover)", cudaops.ErrInvalidArgument, dev.Name())
	}
	return m.MovePages(spans, after)
}

// batchBuckets groups fills by pages per batch: bucket b holds batches of
// [2^b, 2^(b+1)) pages.
const batchBuckets = 32

// FillBucket sums the fills of one batch-size bucket.
type FillBucket struct {
	MinPages int     `json:"min_pages"`
	MaxPages int     `json:"max_pages"`
	Fills    uint64  `json:"fills"`
	Pages    uint64  `json:"pages"`
	Bytes    uint64  `json:"bytes"`
	Seconds  float64 `json:"seconds"`
	// GBps is bytes ÷ seconds in 10^9 bytes per second; 0 when no bytes
	// were written (the unsafe baseline).
	GBps float64 `json:"gb_per_s"`
}

// meteredDevice times every fill to its completion and groups the fills
// by batch size. It waits for each fence inside Fill, which the Host
// backend does anyway; on an asynchronous backend that serialises the
// fills, which is what a per-batch bandwidth figure needs. A pool of
// several cache groups fills them together (FillSpans): a batch's size is
// then its units over every group, and the units each group's fills
// wrote are counted apart (by the span's first region), so that its
// bytes can be reported at a model's size, where a state slot and a page
// differ in bytes.
type meteredDevice struct {
	cudaops.Device
	mu struct {
		sync.Mutex
		total   time.Duration
		buckets [batchBuckets]struct {
			fills, pages, bytes uint64
			time                time.Duration
		}
		// units[first] counts the units written in the group whose
		// regions start at first (0: the per-token group, and every
		// page of a plain Fill).
		units map[int]uint64
	}
}

func (d *meteredDevice) Fill(pages []int32, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	start := time.Now()
	before := d.Device.Counters().BytesFilled
	f, err := d.Device.Fill(pages, spec, after)
	if err != nil {
		return nil, err
	}
	err = f.Wait()
	d.record(time.Since(start), d.Device.Counters().BytesFilled-before, len(pages), func(units map[int]uint64) {
		units[0] += uint64(len(pages))
	})
	return cudaops.Completed(err), nil
}

// FillSpans is Fill for a pool of several cache groups.
func (d *meteredDevice) FillSpans(spans []cudaops.Span, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	sf, ok := d.Device.(cudaops.SpanFiller)
	if !ok {
		return nil, fmt.Errorf("%w: %s cannot fill spans of regions (cudaops.SpanFiller)", cudaops.ErrInvalidArgument, d.Device.Name())
	}
	start := time.Now()
	before := d.Device.Counters().BytesFilled
	f, err := sf.FillSpans(spans, spec, after)
	if err != nil {
		return nil, err
	}
	err = f.Wait()
	n := 0
	for _, s := range spans {
		n += len(s.Pages)
	}
	d.record(time.Since(start), d.Device.Counters().BytesFilled-before, n, func(units map[int]uint64) {
		for _, s := range spans {
			units[s.First] += uint64(len(s.Pages))
		}
	})
	return cudaops.Completed(err), nil
}

// record adds one fill of n units that wrote written bytes; count adds
// its units by group, if it wrote any (the unsafe baseline's write
// nothing).
func (d *meteredDevice) record(elapsed time.Duration, written uint64, n int, count func(map[int]uint64)) {
	if n == 0 {
		return
	}
	b := bits.Len(uint(n)) - 1
	d.mu.Lock()
	defer d.mu.Unlock()
	d.mu.total += elapsed
	bk := &d.mu.buckets[b]
	bk.fills++
	bk.pages += uint64(n)
	bk.bytes += written
	bk.time += elapsed
	if written > 0 {
		if d.mu.units == nil {
			d.mu.units = map[int]uint64{}
		}
		count(d.mu.units)
	}
}

// MovePages passes state checkpoints' copies to the device.
func (d *meteredDevice) MovePages(spans []cudaops.MoveSpan, after cudaops.Ordering) (cudaops.Fence, error) {
	return movePages(d.Device, spans, after)
}

// reset forgets what was measured so far.
func (d *meteredDevice) reset() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.mu.total = 0
	clear(d.mu.buckets[:])
	clear(d.mu.units)
}

// unitsFilled returns the units written by fills in the group whose
// regions start at first.
func (d *meteredDevice) unitsFilled(first int) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mu.units[first]
}

// totals returns the time spent in fills and the bytes they wrote.
func (d *meteredDevice) totals() (time.Duration, uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var n uint64
	for _, bk := range d.mu.buckets {
		n += bk.bytes
	}
	return d.mu.total, n
}

// report returns the non-empty buckets.
func (d *meteredDevice) report() []FillBucket {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []FillBucket
	for b, bk := range d.mu.buckets {
		if bk.fills == 0 {
			continue
		}
		fb := FillBucket{MinPages: 1 << b, MaxPages: 1<<(b+1) - 1, Fills: bk.fills, Pages: bk.pages,
			Bytes: bk.bytes, Seconds: bk.time.Seconds()}
		if bk.bytes > 0 && bk.time > 0 {
			fb.GBps = float64(bk.bytes) / bk.time.Seconds() / 1e9
		}
		out = append(out, fb)
	}
	return out
}
