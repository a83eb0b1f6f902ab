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
	maxGrid          = 4096    // blocks of a launch (CUDA.gridLimit): a persistent grid that loops over the rest
	maxGridY         = 65535   // the driver's bound on gridDim.y
	regionEntryBytes = 32      // {base, stride, words u64; chunk words, chunk shift u32} in fill.ptx
	chunkWords       = 4096    // a chunk's target size: 16 KiB, 4 vectors for each of a block's threads
	fillSpanSlots    = 8       // spans a launch can take (kvf_fill_spans)
	fillSpanBytes    = 16      // {first region, regions, list offset, pages} as u32
	fillInlineIDs    = 512     // page IDs a launch can take in its parameters (kvf_fill_ids)
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
// An empty batch queues nothing and returns a completed fence. A batch
// longer than the smallest region (it would name a page twice) is
// refused. A zero after synchronises the context first, on the calling
// thread; an Ordering CheckOrdering refuses is refused here the same way,
// with nothing queued.
func (d *CUDA) Fill(pages []int32, spec FillSpec, after Ordering) (Fence, error) {
	return d.fill(nil, pages, spec, after)
}

// FillSpans implements SpanFiller, with Fill's rules. The spans are queued
// together, ordered after after and completed by one fence; in kernel
// mode they are one launch (one per fillSpanSlots non-empty spans),
// except that a batch whose page list would take more than half the
// staging ring (it is sized for Fill's batches) is filled with memsets.
func (d *CUDA) FillSpans(spans []Span, spec FillSpec, after Ordering) (Fence, error) {
	if spans == nil {
		spans = []Span{}
	}
	return d.fill(spans, nil, spec, after)
}

var _ SpanFiller = (*CUDA)(nil)

// fill is Fill (spans nil: pages over every region) and FillSpans.
func (d *CUDA) fill(spans []Span, pages []int32, spec FillSpec, after Ordering) (Fence, error) {
	d.life.RLock()
	defer d.life.RUnlock()
	if d.closed {
		return nil, ErrClosed
	}
	n := len(pages)
	for _, s := range spans {
		n += len(s.Pages)
	}
	if n == 0 {
		if err := d.checkBatch(spans, pages); err != nil {
			return nil, err
		}
		return Completed(nil), nil
	}
	g, err := d.enter()
	if err != nil {
		return nil, err
	}
	defer g.leave()
	if err := d.checkBatch(spans, pages); err != nil {
		return nil, err
	}
	if after.IsZero() {
		// Before the device lock: the wait is the engine's, not other
		// fills'.
		if err := d.syncContext(); err != nil {
			return nil, err
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkBatchLocked(spans, pages); err != nil { // regions may have grown meanwhile
		return nil, err
	}
	if spans == nil {
		spans = []Span{{First: 0, Count: len(d.mu.regions), Pages: pages}}
	}
	var slot uint64
	prevHead := d.mu.ring.head
	mode := d.mu.mode
	if mode == FillKernel && !d.inlineLocked(spans) && 4*uint64(n) > uint64(len(d.mu.ring.host))/2 {
		// The ring is sized for several of the largest Fill batches, but
		// a FillSpans batch is bounded by each span's regions only, and
		// may be longer. A slot of more than half the ring may never fit,
		// even in an empty ring (a slot does not wrap), so such a batch
		// is filled with memsets, which need no page list.
		mode = FillMemset
	}
	if mode == FillKernel && !d.inlineLocked(spans) {
		for {
			var ok bool
			prevHead = d.mu.ring.head
			if slot, ok = d.mu.ring.reserve(4 * uint64(n)); ok {
				break
			}
			d.stagingWaits.Add(1)
			if d.mu.ring.inFlight > 0 {
				// Every slot may still be read by fills in flight: wait
				// for the reaper to free one, without holding the device
				// lock.
				d.mu.ringFreed.Wait()
				continue
			}
			// No fence in flight can free the ring: the fills holding it
			// failed (their waits, or before their fences), and their
			// queued copies may still read it. Only a drained stream
			// frees it; if the drain fails, fail rather than wait for a
			// reaper that has nothing to wait for.
			if err := d.drv.streamSynchronize(d.stream); err != nil {
				return nil, fmt.Errorf("%w: staging ring full (%d of %d bytes held by failed fills), draining the stream: %w",
					ErrDriver, d.mu.ring.head-d.mu.ring.tail, len(d.mu.ring.host), err)
			}
			d.mu.ring.tail = d.mu.ring.head
			d.mu.ringFreed.Broadcast()
		}
	}
	undo := func() { d.mu.ring.head = prevHead } // nothing after us reserved: mu is held
	if !after.IsZero() {
		if err := d.orderAfterLocked(after); err != nil {
			undo()
			return nil, err
		}
	}
	ev, err := d.getEvent()
	if err != nil {
		undo()
		return nil, err
	}
	var launches, written uint64
	listQueued := false // a copy that reads the ring slot when it runs is queued
	if mode == FillKernel {
		launches, listQueued, err = d.launchKernelLocked(spans, n, spec, slot)
		written = d.batchBytesLocked(spans)
	} else {
		launches, written, err = d.memsetLocked(spans, spec)
	}
	if err == nil {
		if err = d.drv.eventRecord(ev, d.stream); err != nil {
			err = fmt.Errorf("%w: %w", ErrDriver, err)
		}
	}
	if err != nil {
		// Part of the batch may be queued; the pages stay dirty as far
		// as the caller knows. The event was not recorded: it can be
		// reused at once. A queued copy of the page list reads its ring
		// slot when it runs, not now, and a launch queued after it uses
		// what it read: the slot is given back only once the stream has
		// drained (if that wait fails, a later fence that completes
		// without error frees the slot, or a fill that finds the ring
		// full drains the stream).
		if !listQueued || d.drv.streamSynchronize(d.stream) == nil {
			undo()
		}
		d.putEvent(ev)
		return nil, err
	}
	f := newFence(ev)
	f.ringGen, f.ringEnd = d.mu.ring.gen, d.mu.ring.head
	d.mu.ring.inFlight++
	d.reap.track(f)
	d.fillCalls.Add(1)
	d.launches.Add(launches)
	d.pagesFilled.Add(uint64(n))
	d.bytesFilled.Add(written)
	return f, nil
}

// checkBatch validates a batch (spans, or pages over every region when
// spans is nil) against the region table.
func (d *CUDA) checkBatch(spans []Span, pages []int32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.checkBatchLocked(spans, pages)
}

func (d *CUDA) checkBatchLocked(spans []Span, pages []int32) error {
	if spans != nil {
		return CheckSpans(d.mu.regions, spans)
	}
	if err := CheckPages(d.mu.regions, pages); err != nil {
		return err
	}
	if n := len(d.mu.regions); n > 0 {
		limit := d.mu.regions[0].Pages
		for _, r := range d.mu.regions {
			limit = min(limit, r.Pages)
		}
		if len(pages) > limit {
			return fmt.Errorf("%w: batch of %d pages, the regions hold %d: a page is named twice", ErrInvalidArgument, len(pages), limit)
		}
	}
	return nil
}

func (d *CUDA) batchBytesLocked(spans []Span) uint64 {
	var total uint64
	for _, s := range spans {
		var per uint64
		for _, r := range d.mu.regions[s.First : s.First+s.Count] {
			per += uint64(r.PageBytes)
		}
		total += per * uint64(len(s.Pages))
	}
	return total
}

// inlineLocked reports whether the batch goes to the kernel in its launch
// parameters alone: few enough spans for one launch, few enough pages to
// be listed in it (fillInlineIDs, or fewer in tests of the ring). Else
// the page list goes through the staging ring.
func (d *CUDA) inlineLocked(spans []Span) bool {
	n, k := 0, 0
	for _, s := range spans {
		if len(s.Pages) > 0 {
			n += len(s.Pages)
			k++
		}
	}
	return k <= fillSpanSlots && n <= d.inlineIDs
}

// launchKernelLocked queues the batch as launches of kvf_fill: ONE for a
// batch of up to fillSpanSlots non-empty spans, which is every Fill and
// any FillSpans of a pool's cache groups, and one per further
// fillSpanSlots spans. The page IDs (as their regions' own page numbers)
// travel in the launch's parameters when the batch is inlineLocked; else
// they are copied from their ring slot in one upload. It returns the
// launches queued and whether the upload was.
func (d *CUDA) launchKernelLocked(spans []Span, n int, spec FillSpec, slot uint64) (launches uint64, uploaded bool, err error) {
	var list uint64 // device address of the page list, 0 when inline
	if !d.inlineLocked(spans) {
		buf := d.mu.ring.host[slot : slot+4*uint64(n)]
		i := 0
		for _, s := range spans {
			for _, p := range s.Pages {
				binary.LittleEndian.PutUint32(buf[4*i:], uint32(p-s.IDBase))
				i++
			}
		}
		list = d.mu.ring.dev + slot
		if err := d.drv.memcpyHtoDAsync(list, buf, d.stream); err != nil {
			return 0, false, fmt.Errorf("%w: uploading the fill batch: %w", ErrDriver, err)
		}
		uploaded = true
	}
	for len(spans) > 0 {
		// The next launch: up to fillSpanSlots non-empty spans.
		var group []Span
		pages := 0
		for len(spans) > 0 && len(group) < fillSpanSlots {
			if len(spans[0].Pages) > 0 {
				group = append(group, spans[0])
				pages += len(spans[0].Pages)
			}
			spans = spans[1:]
		}
		if len(group) == 0 {
			break
		}
		args, grid := d.fillArgsLocked(group, list, spec)
		if err := d.drv.launchKernel(d.fillFn, grid, d.block, d.stream, args); err != nil {
			return launches, uploaded, fmt.Errorf("%w: %s fill of %d pages in %d spans: %w", ErrDriver, fillKernelName, pages, len(group), err)
		}
		launches++
		if list != 0 {
			list += 4 * uint64(pages)
		}
	}
	return launches, uploaded, nil
}

// fillArgsLocked builds kvf_fill's arguments for one launch over group
// (non-empty spans, at most fillSpanSlots), in the order and with the
// names and sizes fill.ptx declares (the simulated driver checks them),
// and sizes its grid: a row of blocks per region (gridDim.y, up to the
// driver's bound), as many columns as the largest region's chunks need,
// the whole at most gridLimit blocks; the kernel loops over the rest.
// With list 0 the page IDs go into the parameters. An empty group is the
// warm-up launch: no work.
func (d *CUDA) fillArgsLocked(group []Span, list uint64, spec FillSpec) (*kernelArgs, [3]uint32) {
	a := &d.mu.args
	a.reset()
	a.u64("kvf_fill_table", d.mu.table)
	a.u64("kvf_fill_list", list)
	a.u32("kvf_fill_word", spec.Word)
	a.u32("kvf_fill_salt", spec.PageSalt)
	a.u32("kvf_fill_keep", ^spec.ClearMask)
	slots, maxChunks := 0, uint64(1)
	for _, s := range group {
		slots += s.Count
		for _, c := range d.mu.chunks[s.First : s.First+s.Count] {
			maxChunks = max(maxChunks, uint64(len(s.Pages))<<c.shift)
		}
	}
	a.u32("kvf_fill_nslots", uint32(slots))
	a.u32("kvf_fill_nspans", uint32(len(group)))
	desc := a.add("kvf_fill_spans", fillSpanSlots*fillSpanBytes)
	ids := a.add("kvf_fill_ids", 4*fillInlineIDs)
	off := 0
	for i, s := range group {
		e := desc[i*fillSpanBytes:]
		binary.LittleEndian.PutUint32(e[0:], uint32(s.First))
		binary.LittleEndian.PutUint32(e[4:], uint32(s.Count))
		binary.LittleEndian.PutUint32(e[8:], uint32(off))
		binary.LittleEndian.PutUint32(e[12:], uint32(len(s.Pages)))
		if list == 0 {
			for j, p := range s.Pages {
				binary.LittleEndian.PutUint32(ids[4*(off+j):], uint32(p-s.IDBase))
			}
		}
		off += len(s.Pages)
	}
	limit := uint64(max(d.gridLimit, 1))
	gy := min(uint64(max(slots, 1)), maxGridY, limit)
	gx := min(maxChunks, max(limit/gy, 1), 1<<31-1)
	return a, [3]uint32{uint32(gx), uint32(gy), 1}
}

// regionChunks is how the kernel splits a region's pages (the region
// table's last two fields): 1 << shift chunks of words words each, the
// last ones shorter or empty.
type regionChunks struct {
	words uint32
	shift uint32
}

// chunksFor splits pages of pageWords words into a power of two of chunks
// of at most about target words, each a multiple of 4 words so that
// every chunk starts at its page's 16-byte phase.
func chunksFor(pageWords, target uint64) regionChunks {
	var c regionChunks
	for k := uint64(1); k*target < pageWords; k <<= 1 {
		c.shift++
	}
	k := uint64(1) << c.shift
	c.words = uint32((pageWords+k-1)/k+3) &^ 3
	return c
}

// memsetLocked fills with one driver memset per run of adjacent page IDs
// per region (per page when each page has its own word): cuMemsetD32Async
// when the run is contiguous memory, cuMemsetD2D32Async (rows = pages,
// pitch = stride) when the region is strided.
func (d *CUDA) memsetLocked(spans []Span, spec FillSpec) (launches, written uint64, err error) {
	for _, s := range spans {
		for _, r := range d.mu.regions[s.First : s.First+s.Count] {
			words := uint64(r.PageBytes / 4)
			pages := s.Pages
			for i := 0; i < len(pages); {
				j := i + 1
				if spec.Uniform() {
					for j < len(pages) && pages[j] == pages[j-1]+1 {
						j++
					}
				}
				n := uint64(j - i)
				local := pages[i] - s.IDBase
				dst := r.Base + uint64(local)*uint64(r.Stride)
				w := spec.WordFor(local)
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
	}
	return launches, written, nil
}

// Stats are a CUDA device's own figures, beyond Counters.
type Stats struct {
	// Mode is how the device fills now; KernelError says why it fills
	// with memsets when the kernel could not be loaded or warmed up
	// (then Mode is FillMemset), and is empty otherwise.
	Mode        FillMode
	KernelError string
	// ContextSyncs counts fills whose zero Ordering synchronised the
	// context: each stalled its caller until the device was idle.
	ContextSyncs uint64
	// StagingWaits counts fills that found the staging ring full and
	// waited for earlier fills to complete.
	StagingWaits uint64
	// FencesPending is how many fills the reaper has not seen complete.
	FencesPending int
}

// Stats returns the device's figures.
func (d *CUDA) Stats() Stats {
	d.mu.Lock()
	s := Stats{Mode: d.mu.mode}
	d.mu.Unlock()
	if d.kernErr != nil {
		s.KernelError = d.kernErr.Error()
	}
	s.ContextSyncs = d.contextSyncs.Load()
	s.StagingWaits = d.stagingWaits.Load()
	s.FencesPending = d.reap.pending()
	return s
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
