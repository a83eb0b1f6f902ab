package cudaops

import (
	_ "embed"
	"encoding/binary"
	"fmt"
)

// The fill: one batch of pages over every region, queued on the device's
// stream either as one launch of the kvf_fill kernel (fill.ptx, embedded
// and JIT-compiled by the driver at open) or as driver memsets. The
// ordering before it and the fence after it are in cuda_fence.go; the
// buffer that carries the batch to the kernel is in cuda_staging.go.

// FillMode selects how a CUDA device fills pages.
type FillMode int

const (
	// FillKernel: one launch of the kvf_fill kernel per batch. The default.
	FillKernel FillMode = iota
	// FillMemset: one driver memset per run of adjacent pages per region.
	// The baseline, and what a device uses when the kernel cannot be
	// loaded (see KernelError).
	FillMemset
)

func (m FillMode) String() string {
	switch m {
	case FillKernel:
		return "kernel"
	case FillMemset:
		return "memset"
	}
	return fmt.Sprintf("FillMode(%d)", int(m))
}

//go:embed fill.ptx
var fillPTX []byte

const (
	fillKernelName   = "kvf_fill"
	fillBlock        = 256     // threads per block
	maxGrid          = 1 << 20 // blocks; the kernel loops over further items
	regionEntryBytes = 24      // {base, stride, words} as u64 in fill.ptx
	maxPageBytes     = 1 << 40 // bound that keeps every product below 2^63
)

// KernelError says why the fill kernel could not be loaded (the device
// then fills with memsets), or nil.
func (d *CUDA) KernelError() error { return d.kernErr }

// SetFillMode selects kernel or memset fills. FillKernel fails when the
// kernel could not be loaded.
func (d *CUDA) SetFillMode(m FillMode) error {
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	switch {
	case d.closed:
		return ErrClosed
	case m != FillKernel && m != FillMemset:
		return fmt.Errorf("%w: fill mode %d", ErrInvalidArgument, int(m))
	case m == FillKernel && d.kernErr != nil:
		return fmt.Errorf("%w: fill kernel unavailable: %w", ErrDriver, d.kernErr)
	}
	d.mu.mode = m
	return nil
}

// Fill implements Device; see the type's documentation for what it queues.
// An empty batch queues nothing and returns a completed fence.
func (d *CUDA) Fill(pages []int32, spec FillSpec, after Ordering) (Fence, error) {
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	if err := CheckPages(d.mu.regions, pages); err != nil {
		return nil, err
	}
	if len(pages) == 0 {
		return Completed(nil), nil
	}
	if err := d.enter(); err != nil {
		return nil, err
	}
	defer d.leave()

	if err := d.orderAfterLocked(after); err != nil {
		return nil, err
	}
	ev, err := d.getEvent()
	if err != nil {
		return nil, err
	}
	var (
		st       *staging
		launches uint64
		written  uint64
	)
	if d.mu.mode == FillKernel {
		st, err = d.launchKernelLocked(pages, spec)
		launches, written = 1, d.batchBytesLocked(len(pages))
	} else {
		launches, written, err = d.memsetLocked(pages, spec)
	}
	if err == nil {
		if err = d.drv.eventRecord(ev, d.stream); err != nil {
			err = fmt.Errorf("%w: %w", ErrDriver, err)
		}
	}
	if err != nil {
		// Part of the batch may be queued. Drain the stream so the event
		// and the staging buffer are idle before they are reused; the
		// pages stay dirty as far as the caller knows.
		_ = d.drv.streamSynchronize(d.stream)
		d.putEvent(ev)
		return nil, err
	}
	f := &cudaFence{d: d}
	f.mu.ev = ev
	if st != nil {
		st.fence = f
	}
	d.fillCalls.Add(1)
	d.launches.Add(launches)
	d.pagesFilled.Add(uint64(len(pages)))
	d.bytesFilled.Add(written)
	return f, nil
}

func (d *CUDA) batchBytesLocked(pages int) uint64 {
	var per uint64
	for _, r := range d.mu.regions {
		per += uint64(r.PageBytes)
	}
	return per * uint64(pages)
}

// launchKernelLocked uploads the region table and the page list and
// launches kvf_fill once. It returns the staging buffer it used.
func (d *CUDA) launchKernelLocked(pages []int32, spec FillSpec) (*staging, error) {
	regions := d.mu.regions
	tableBytes := len(regions) * regionEntryBytes
	need := tableBytes + 4*len(pages)
	st, err := d.stagingLocked(need)
	if err != nil {
		return nil, err
	}
	buf := st.host[:need]
	for i, r := range regions {
		e := buf[i*regionEntryBytes:]
		binary.LittleEndian.PutUint64(e[0:], r.Base)
		binary.LittleEndian.PutUint64(e[8:], uint64(r.Stride))
		binary.LittleEndian.PutUint64(e[16:], uint64(r.PageBytes/4))
	}
	for i, p := range pages {
		binary.LittleEndian.PutUint32(buf[tableBytes+4*i:], uint32(p))
	}
	if err := d.drv.memcpyHtoDAsync(st.dev, buf, d.stream); err != nil {
		return nil, fmt.Errorf("%w: uploading the fill batch: %w", ErrDriver, err)
	}
	items := uint64(len(regions)) * uint64(len(pages))
	grid := uint32(min(items, maxGrid))
	err = d.drv.launchFill(d.fillFn, grid, fillBlock, d.stream, fillArgs{
		table:    st.dev,
		pages:    st.dev + uint64(tableBytes),
		nitems:   items,
		nregions: uint32(len(regions)),
		word:     spec.Word,
		salt:     spec.PageSalt,
		clear:    spec.ClearMask,
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %s fill of %d pages × %d regions: %w", ErrDriver, fillKernelName, len(pages), len(regions), err)
	}
	return st, nil
}

// memsetLocked fills with one driver memset per run of adjacent page IDs
// per region (per page when each page has its own word): cuMemsetD32Async
// when the run is contiguous memory, cuMemsetD2D32Async (rows = pages,
// pitch = stride) when the region is strided.
func (d *CUDA) memsetLocked(pages []int32, spec FillSpec) (launches, written uint64, err error) {
	for _, r := range d.mu.regions {
		words := uint64(r.PageBytes / 4)
		for i := 0; i < len(pages); {
			j := i + 1
			if spec.Uniform() {
				for j < len(pages) && pages[j] == pages[j-1]+1 {
					j++
				}
			}
			n := uint64(j - i)
			dst := r.Base + uint64(pages[i])*uint64(r.Stride)
			w := spec.WordFor(pages[i])
			if r.Contiguous() || n == 1 {
				err = d.drv.memsetD32Async(dst, w, n*words, d.stream)
			} else {
				err = d.drv.memsetD2D32Async(dst, uint64(r.Stride), w, words, n, d.stream)
			}
			if err != nil {
				return launches, written, fmt.Errorf("%w: memset fill: %w", ErrDriver, err)
			}
			launches++
			written += n * uint64(r.PageBytes)
			i = j
		}
	}
	return launches, written, nil
}

// Counters implements Device. Launches counts kernel launches in
// FillKernel mode and driver memsets in FillMemset mode.
func (d *CUDA) Counters() Counters {
	return Counters{
		FillCalls:   d.fillCalls.Load(),
		Launches:    d.launches.Load(),
		PagesFilled: d.pagesFilled.Load(),
		BytesFilled: d.bytesFilled.Load(),
	}
}
