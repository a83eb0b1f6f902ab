package cudaops

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvfence/kvfence/internal/memfill"
)

// Host is the default Device: regions are Go byte slices and fills are
// passes over host memory. It exists so that every guarantee can be tested
// byte by byte without a GPU, and so that CPU-only deployments (and the C
// ABI's tests) have a real backend.
//
// By default a fill is synchronous: the Fence a Fill returns is already
// complete, and the caller (a pool's Release) has paid for the pass. With
// HostConfig.AsyncFills, each Fill runs on a goroutine of its own and its
// Fence completes when the last byte is written, as a GPU's fill kernel
// completes after its launch returns: the pool keeps the pages quarantined
// until then, so nothing changes for isolation, and a release of a large
// lease (about 9 ms per 256 MiB on bench/README.md's machine) no longer
// holds up its caller. Close waits for fills in flight, so that adopted
// memory is never written after Close returns.
//
// Ordering handles are device streams and events; host memory has none, so
// Host accepts and ignores them.
//
// On Linux, regions of 64 MiB or more are advised to use transparent huge
// pages (MADV_HUGEPAGE): fills and handoff copies stream through whole
// regions, and 2 MiB pages spare them a TLB miss every 4 KiB (a 256 MiB
// handoff ran 5–10 % faster). They stay Go memory, so the race detector
// still sees every access. WritePage and WritePagePart copy with
// streaming stores (memfill.CopyStreaming): a page written from host
// memory (a received handoff) is read next by the engine much later, so
// caching it only evicts data, and skipping the read-for-ownership cuts a
// quarter of the copy's memory traffic.
type Host struct {
	async bool // HostConfig.AsyncFills; set at construction

	// last is the fence of the asynchronous fill issued last (nil before
	// the first). Each such fill starts once the one issued before it has
	// ended, so they complete in issue order, as on a stream, and a copy
	// that waits for last is ordered after every fill issued before it.
	last atomic.Pointer[chanFence]

	// mu guards the region table. A fill holds it for reading while it
	// writes, including an asynchronous fill's goroutine, which takes over
	// the read lock its Fill call acquired: so Close, which locks it for
	// writing, returns only once every fill in flight has ended.
	mu struct {
		sync.RWMutex
		regions []Region
		mem     [][]byte
		closed  bool
	}
	fillCalls, launches, pagesFilled, bytesFilled atomic.Uint64
}

var _ Device = (*Host)(nil)

// HostConfig configures a Host device (NewHostWith). The zero value is
// NewHost's device.
type HostConfig struct {
	// AsyncFills runs every Fill and FillSpans on a goroutine of its own
	// and returns at once with a Fence that completes when the pages are
	// written; validation errors are still returned by the call, with
	// nothing written. Counters count a fill once it has completed.
	AsyncFills bool
}

// NewHost returns a Host device with no regions whose fills are
// synchronous.
func NewHost() *Host { return &Host{} }

// NewHostWith returns a Host device with no regions, configured by c.
func NewHostWith(c HostConfig) *Host { return &Host{async: c.AsyncFills} }

// Name implements Device.
func (h *Host) Name() string { return "host" }

// AllocRegion implements Device.
func (h *Host) AllocRegion(pages int, pageBytes int64) (int, error) {
	r := Region{Stride: pageBytes, PageBytes: pageBytes, Pages: pages}
	if err := r.Validate(); err != nil {
		return 0, err
	}
	if r.Bytes() > maxHostRegion {
		return 0, fmt.Errorf("%w: host region of %d bytes exceeds %d", ErrOutOfMemory, r.Bytes(), int64(maxHostRegion))
	}
	mem := make([]byte, r.Bytes())
	adviseHuge(mem) // before the first touch: a large allocation is still unfaulted
	return h.add(r, mem, false)
}

// hugeRegionBytes is the region size from which AllocRegion asks for
// transparent huge pages: large enough that the 2 MiB granularity wastes
// nothing worth counting.
const hugeRegionBytes = 64 << 20

// maxHostRegion bounds one host region: 64 GiB.
const maxHostRegion = 64 << 30

// AdoptRegion registers memory the caller owns as a region of pages pages,
// stride bytes apart, pageBytes long each. The caller must keep mem alive and
// must not use the pages except through kvfence leases. A region whose
// pages share bytes with a page of a region the device already has is
// refused (see Overlap).
func (h *Host) AdoptRegion(mem []byte, pages int, stride, pageBytes int64) (int, error) {
	r := Region{Stride: stride, PageBytes: pageBytes, Pages: pages}
	if err := r.Validate(); err != nil {
		return 0, err
	}
	if int64(len(mem)) < r.Bytes() {
		return 0, fmt.Errorf("%w: adopted buffer of %d bytes, region needs %d", ErrInvalidArgument, len(mem), r.Bytes())
	}
	return h.add(r, mem[:r.Bytes():r.Bytes()], true)
}

// add appends a region over mem; Base is mem's address.
func (h *Host) add(r Region, mem []byte, adopted bool) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.mu.closed {
		return 0, ErrClosed
	}
	r.Base = hostAddr(mem)
	if adopted {
		if err := checkAdopted(h.mu.regions, r); err != nil {
			return 0, err
		}
	}
	h.mu.regions = append(h.mu.regions, r)
	h.mu.mem = append(h.mu.mem, mem)
	return len(h.mu.regions) - 1, nil
}

// Regions implements Device.
func (h *Host) Regions() []Region {
	h.mu.RLock()
	defer h.mu.RUnlock()
	return append([]Region(nil), h.mu.regions...)
}

// Fill implements Device. Adjacent page IDs in a contiguous region are
// filled as one run; a uniform word is written by copying a cache-resident
// pattern block, which runs at memset speed.
func (h *Host) Fill(pages []int32, spec FillSpec, _ Ordering) (Fence, error) {
	h.mu.RLock()
	if h.mu.closed {
		h.mu.RUnlock()
		return nil, ErrClosed
	}
	if err := CheckPages(h.mu.regions, pages); err != nil {
		h.mu.RUnlock()
		return nil, err
	}
	if h.async { // the caller may reuse pages once Fill returns
		return h.fillAsyncLocked([]Span{{First: 0, Count: len(h.mu.regions), Pages: slices.Clone(pages)}}, spec, len(pages)), nil
	}
	defer h.mu.RUnlock()
	h.fillSpansLocked([]Span{{First: 0, Count: len(h.mu.regions), Pages: pages}}, spec, len(pages))
	return Completed(nil), nil
}

// FillSpans implements SpanFiller: all spans in one pass, as Fill.
func (h *Host) FillSpans(spans []Span, spec FillSpec, _ Ordering) (Fence, error) {
	h.mu.RLock()
	if h.mu.closed {
		h.mu.RUnlock()
		return nil, ErrClosed
	}
	if err := CheckSpans(h.mu.regions, spans); err != nil {
		h.mu.RUnlock()
		return nil, err
	}
	pages := 0
	for _, s := range spans {
		pages += len(s.Pages)
	}
	if h.async {
		return h.fillAsyncLocked(cloneSpans(spans, pages), spec, pages), nil
	}
	defer h.mu.RUnlock()
	h.fillSpansLocked(spans, spec, pages)
	return Completed(nil), nil
}

// fillAsyncLocked fills validated spans, pages pages in all, on a
// goroutine of its own, which releases the read lock of h.mu that the
// caller holds once it has. spans must be the fill's own (they outlive
// the call): a synchronous fill's never reach here, so that they can stay
// on their caller's stack.
func (h *Host) fillAsyncLocked(spans []Span, spec FillSpec, pages int) Fence {
	f := newChanFence()    // a validated host fill cannot fail: err stays nil
	prev := h.last.Swap(f) // not kept in f: a chain of fences would never be freed
	go func() {
		defer h.mu.RUnlock() // taken over from Fill: a read lock has no owner
		// The fence completes before the lock is let go, so that a Close
		// that has returned finds it complete.
		defer close(f.finished)
		if prev != nil {
			<-prev.finished
		}
		h.fillSpansLocked(spans, spec, pages)
	}()
	return f
}

// afterFills returns once every asynchronous fill issued before the call
// has ended: page copies are ordered after them, as the Device contract
// asks.
func (h *Host) afterFills() {
	if f := h.last.Load(); f != nil {
		<-f.finished
	}
}

// cloneSpans copies spans and their page lists (pages IDs in all) into
// one allocation of IDs, for a fill that outlives its call.
func cloneSpans(spans []Span, pages int) []Span {
	ids := make([]int32, 0, pages)
	out := slices.Clone(spans)
	for i, s := range out {
		n := len(ids)
		ids = append(ids, s.Pages...)
		out[i].Pages = ids[n:len(ids):len(ids)]
	}
	return out
}

var _ SpanFiller = (*Host)(nil)

// fillSpansLocked writes validated spans of pages pages in all; h.mu is
// held for reading.
func (h *Host) fillSpansLocked(spans []Span, spec FillSpec, pages int) {
	var perBatch int64
	for _, s := range spans {
		for _, r := range h.mu.regions[s.First : s.First+s.Count] {
			perBatch += r.PageBytes * int64(len(s.Pages))
		}
	}
	fill := memfill.Words
	if perBatch >= streamingBytes {
		fill = memfill.WordsStreaming
	}
	var written uint64
	for _, s := range spans {
		for ri := s.First; ri < s.First+s.Count; ri++ {
			r, mem := h.mu.regions[ri], h.mu.mem[ri]
			written += fillRegion(mem, r, s.Pages, s.IDBase, spec, fill)
		}
	}
	h.fillCalls.Add(1)
	h.launches.Add(1)
	h.pagesFilled.Add(uint64(pages))
	h.bytesFilled.Add(written)
}

// fillRegion fills the listed pages (less base) of one region, runs of
// adjacent IDs at once where the region is contiguous and the word
// uniform, and returns the bytes written.
func fillRegion(mem []byte, r Region, pages []int32, base int32, spec FillSpec, fill func([]byte, uint32)) (written uint64) {
	for i := 0; i < len(pages); {
		start := pages[i] - base
		j := i + 1
		if spec.Uniform() && r.Contiguous() {
			for j < len(pages) && pages[j] == pages[j-1]+1 {
				j++
			}
		}
		off := int64(start) * r.Stride
		end := off + int64(j-i-1)*r.Stride + r.PageBytes
		fill(mem[off:end], spec.WordFor(start))
		written += uint64(end - off)
		i = j
	}
	return written
}

// streamingBytes is the batch size from which fills bypass the cache: past
// what the caches hold, cached stores gain nothing and cost a read per line.
const streamingBytes = 4 << 20

func (h *Host) page(r int, p int32, n int) ([]byte, error) {
	if h.mu.closed {
		return nil, ErrClosed
	}
	if r < 0 || r >= len(h.mu.regions) {
		return nil, fmt.Errorf("%w: region %d of %d", ErrInvalidArgument, r, len(h.mu.regions))
	}
	reg := h.mu.regions[r]
	if p < 0 || int(p) >= reg.Pages {
		return nil, fmt.Errorf("%w: page %d outside [0, %d)", ErrInvalidArgument, p, reg.Pages)
	}
	if int64(n) != reg.PageBytes {
		return nil, fmt.Errorf("%w: buffer of %d bytes for a page of %d", ErrInvalidArgument, n, reg.PageBytes)
	}
	off := int64(p) * reg.Stride
	return h.mu.mem[r][off : off+reg.PageBytes], nil
}

// ReadPage implements Device.
func (h *Host) ReadPage(r int, p int32, dst []byte) error {
	h.afterFills()
	h.mu.RLock()
	defer h.mu.RUnlock()
	src, err := h.page(r, p, len(dst))
	if err != nil {
		return err
	}
	copy(dst, src)
	return nil
}

// WritePage implements Device.
func (h *Host) WritePage(r int, p int32, src []byte) error {
	h.afterFills()
	h.mu.RLock()
	defer h.mu.RUnlock()
	dst, err := h.page(r, p, len(src))
	if err != nil {
		return err
	}
	memfill.CopyStreaming(dst, src) // a written page is not read back soon
	return nil
}

// WritePagePart implements PartWriter.
func (h *Host) WritePagePart(r int, p int32, off int, src []byte) error {
	return h.pagePart(r, p, off, len(src), func(part []byte) { memfill.CopyStreaming(part, src) })
}

// ReadPagePart implements PartReader.
func (h *Host) ReadPagePart(r int, p int32, off int, dst []byte) error {
	return h.pagePart(r, p, off, len(dst), func(part []byte) { copy(dst, part) })
}

// pagePart checks n bytes at offset off of page p of region r and calls
// f with them, after the fills issued before and under the read lock.
func (h *Host) pagePart(r int, p int32, off, n int, f func(part []byte)) error {
	h.afterFills()
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.mu.closed {
		return ErrClosed
	}
	if r < 0 || r >= len(h.mu.regions) {
		return fmt.Errorf("%w: region %d of %d", ErrInvalidArgument, r, len(h.mu.regions))
	}
	page, err := h.page(r, p, int(h.mu.regions[r].PageBytes))
	if err != nil {
		return err
	}
	if off < 0 || off > len(page) || n > len(page)-off {
		return fmt.Errorf("%w: %d bytes at offset %d of a page of %d", ErrInvalidArgument, n, off, len(page))
	}
	f(page[off : off+n])
	return nil
}

var (
	_ PartWriter = (*Host)(nil)
	_ PartReader = (*Host)(nil)
)

// ReadPages implements PageCopier.
func (h *Host) ReadPages(r int, pages []int32, dst []byte) error {
	return h.copyPages(r, pages, dst, false)
}

// WritePages implements PageCopier.
func (h *Host) WritePages(r int, pages []int32, src []byte) error {
	return h.copyPages(r, pages, src, true)
}

func (h *Host) copyPages(r int, pages []int32, buf []byte, write bool) error {
	h.afterFills()
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.mu.closed {
		return ErrClosed
	}
	reg, err := checkCopy(h.mu.regions, r, pages, len(buf))
	if err != nil {
		return err
	}
	for i, p := range pages {
		off := int64(p) * reg.Stride
		page := h.mu.mem[r][off : off+reg.PageBytes]
		part := buf[int64(i)*reg.PageBytes:][:reg.PageBytes]
		if write {
			memfill.CopyStreaming(page, part)
		} else {
			copy(part, page)
		}
	}
	return nil
}

var _ PageCopier = (*Host)(nil)

// PageBytes returns the live memory of page p in region r, for tests and
// host-side engines that read and write KV in place. It is nil for an
// invalid page or a closed device. Like the copies, it returns once the
// asynchronous fills issued before it have ended; writes through a view
// kept from before are not ordered after later fills.
func (h *Host) PageBytes(r int, p int32) []byte {
	h.afterFills()
	h.mu.RLock()
	defer h.mu.RUnlock()
	if r < 0 || r >= len(h.mu.regions) {
		return nil
	}
	b, err := h.page(r, p, int(h.mu.regions[r].PageBytes))
	if err != nil {
		return nil
	}
	return b
}

// Counters implements Device.
func (h *Host) Counters() Counters {
	return Counters{
		FillCalls:   h.fillCalls.Load(),
		Launches:    h.launches.Load(),
		PagesFilled: h.pagesFilled.Load(),
		BytesFilled: h.bytesFilled.Load(),
	}
}

// Close implements Device. Closing twice is allowed.
func (h *Host) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.mu.closed = true
	h.mu.regions, h.mu.mem = nil, nil
	return nil
}
