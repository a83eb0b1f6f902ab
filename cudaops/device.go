// Package cudaops is kvfence's only door to KV memory. A Device holds the
// physical regions that back a pool's page space and fills batches of pages
// in them; it knows nothing of owners, tenants or policy.
//
// # Geometry
//
// A pool's logical page space [0, N) is mapped onto several regions, one per
// layer and per K/V (and per device for tensor-parallel ranks, which share
// page IDs). Region r places page p at Base_r + p*Stride_r, PageBytes_r
// long. Scrubbing page p means filling it in every region, so Fill takes a
// batch of pages and covers pages × regions in one device operation: one
// kernel launch on CUDA, one pass on the host. There is never a call per
// page per layer. A pool whose caches form several groups, each with its
// own regions and page IDs, fills them together with FillSpans (Span).
//
// # Ordering
//
// Fill is asynchronous: it returns a Fence that completes when every byte of
// the batch has been written. A caller must observe the fence complete
// without error before it hands any of the batch's pages to a new owner. A
// Fill is ordered after work the engine has queued on the same device
// (Ordering names the engine's stream or event; on CUDA the zero Ordering
// means all work of the context), because a release can happen while the
// engine's kernels still read or write the pages. A device with handles
// that can be wrong implements OrderingChecker, so the caller can refuse a
// bad ordering before it gives up any page.
//
// # Backends
//
// Host (this package, pure Go, the default) keeps regions in host memory;
// every byte is readable by tests. CUDA keeps them in GPU memory and loads
// the driver (libcuda.so.1) at run time, so that a binary built with
// kvfence starts, and reports ErrNoDevice, on a machine without one. Its
// files are named cuda_*.go, one per concern (context and device, fill,
// staging copies, fences); only cuda_dl_cgo.go uses cgo and unsafe, and
// its twin cuda_dl_nocgo.go keeps CGO_ENABLED=0 builds working, so no
// build of this package needs a CUDA toolkit. Both backends pass the
// conformance suite in cudaops/devicetest; on a machine without a GPU the
// CUDA backend runs it over a simulated driver that executes the fill
// kernel's own PTX text (internal/ptx), every thread, every access
// checked, so a kernel that writes one byte wrong fails go test anywhere.
// scripts/gpu-check.sh runs the rest on a GPU.
//
// # Tensor parallelism
//
// The ranks of a tensor-parallel group number pages alike and each holds
// its own shard of every region. Group is one Device over a Device per GPU
// in one process: a fill completes when every member's has. RemoteRanks is
// the scheduler's Device over ranks in processes of their own (RankWorker,
// remote.go has the protocol): each rank scrubs its shard on its own
// stream after its own kernels and reports, pages are clean only once
// every rank reported, and a rank that fails, dies or stays silent past
// the deadline fails the fill, so the pool retires the pages and faults.
package cudaops

import (
	"fmt"
	"math"
)

// Region describes where one slice of the page space lives.
type Region struct {
	// Base is the address of page 0: a device address on CUDA, the
	// address of the region's memory on Host.
	Base uint64
	// Stride is the distance in bytes from page p to page p+1; at least
	// PageBytes.
	Stride int64
	// PageBytes is the length of one page in this region; a multiple of 4,
	// since fills write 32-bit words.
	PageBytes int64
	// Pages is how many pages the region holds: valid IDs are [0, Pages).
	Pages int
}

// Validate checks a region description.
func (r Region) Validate() error {
	switch {
	case r.Pages <= 0:
		return fmt.Errorf("%w: region of %d pages", ErrInvalidArgument, r.Pages)
	case r.PageBytes <= 0 || r.PageBytes%4 != 0:
		return fmt.Errorf("%w: region page size %d bytes is not a positive multiple of 4", ErrInvalidArgument, r.PageBytes)
	case r.Stride < r.PageBytes:
		return fmt.Errorf("%w: region stride %d is less than its page size %d", ErrInvalidArgument, r.Stride, r.PageBytes)
	case r.Stride%4 != 0:
		return fmt.Errorf("%w: region stride %d is not a multiple of 4", ErrInvalidArgument, r.Stride)
	case r.Stride > (1<<62)/int64(r.Pages):
		return fmt.Errorf("%w: region of %d pages × %d bytes overflows", ErrInvalidArgument, r.Pages, r.Stride)
	}
	return nil
}

// Bytes is the region's extent from Base: the span of all its pages.
func (r Region) Bytes() int64 { return int64(r.Pages-1)*r.Stride + r.PageBytes }

// Contiguous reports whether adjacent pages touch, so runs of page IDs are
// runs of memory.
func (r Region) Contiguous() bool { return r.Stride == r.PageBytes }

// FillSpec says what a fill writes: a 32-bit word repeated over each page,
// in little-endian byte order. The word for page p is
//
//	(Word ^ uint32(p)*PageSalt) &^ ClearMask
//
// With PageSalt = 0 every page gets Word (zero, or a poison). A non-zero
// PageSalt gives each page its own canary; ClearMask then forces bits that
// keep the word a finite number in the KV dtype.
type FillSpec struct {
	Word      uint32
	PageSalt  uint32
	ClearMask uint32
}

// WordFor returns the word written to page p.
func (s FillSpec) WordFor(p int32) uint32 {
	return (s.Word ^ uint32(p)*s.PageSalt) &^ s.ClearMask
}

// Uniform reports whether every page gets the same word, so a fill may
// coalesce adjacent pages.
func (s FillSpec) Uniform() bool { return s.PageSalt == 0 }

// Ordering names engine work a fill must wait for: the engine's kernels
// may still read or write a released lease's pages, and a fill that ran
// first would leave their writes in a page marked clean. Handles are the
// driver's own (a CUstream, a CUevent) as integers, which is how C, C++
// and Python engines pass them.
//
// On a CUDA device:
//
//   - Stream waits for all work queued on that stream so far. StreamLegacy
//     (CU_STREAM_LEGACY: the legacy default stream, which PyTorch's
//     default stream is and which also waits for every blocking stream)
//     and StreamPerThread (CU_STREAM_PER_THREAD: the per-thread default
//     stream of the OS thread that calls the release; from Go, lock the
//     goroutine's thread) are accepted as such.
//   - Event waits for the event's latest record.
//   - The zero Ordering means "after all work queued in the device's
//     context before the release, on every stream": the fill synchronises
//     the context first (cuCtxSynchronize), which stalls the caller until
//     the GPU is idle. It is always safe and never fast; an engine should
//     name its stream.
//   - Own means "after the device's own work only" (the fills and moves
//     it queued), for pages no engine work can touch: a pool's own copy
//     between a page it keeps and a page it has not handed out yet.
//
// A stream of another context, or one capturing a CUDA graph, and an
// event recorded inside a capture are refused (ErrBadOrdering); see
// OrderingChecker. The Host device has no streams and ignores orderings.
type Ordering struct {
	Stream uintptr // wait for all work queued on this stream so far
	Event  uintptr // wait for this recorded event
	Own    bool    // with neither: wait for the device's own work only
}

// The driver's special stream handles (cuda.h).
const (
	StreamLegacy    uintptr = 0x1 // CU_STREAM_LEGACY, cudaStreamLegacy
	StreamPerThread uintptr = 0x2 // CU_STREAM_PER_THREAD, cudaStreamPerThread
)

// IsZero reports whether o names no engine work and is not Own: the
// ordering after all work of the context.
func (o Ordering) IsZero() bool { return o.Stream == 0 && o.Event == 0 && !o.Own }

// OrderingChecker is implemented by devices whose Ordering handles can be
// wrong (CUDA). CheckOrdering queues nothing and returns an error wrapping
// ErrBadOrdering when a Fill after o would be refused: a pool calls it
// before a lease gives up its pages, so a bad handle is the caller's error
// and never a failed scrub that faults the pool.
type OrderingChecker interface {
	CheckOrdering(o Ordering) error
}

// Fence is the completion of one Fill.
type Fence interface {
	// Done reports, without blocking, whether the work has finished, and
	// its error if it failed.
	Done() (bool, error)
	// Wait blocks until the work has finished and returns its error.
	Wait() error
}

// Counters are running totals of a device's fill work.
type Counters struct {
	FillCalls   uint64 // Fill calls that reached the device
	Launches    uint64 // device operations issued by them (kernel launches, memsets, host passes)
	PagesFilled uint64 // pages filled (each counted once, whatever the region count)
	BytesFilled uint64 // bytes written, over all regions
}

// Device is a backend that holds regions and fills pages in them. All
// methods are safe for concurrent use; concurrent Fills must name disjoint
// pages.
type Device interface {
	// Name describes the device, e.g. "host" or "cuda:0 NVIDIA H200".
	Name() string
	// AllocRegion allocates memory for pages pages of pageBytes each
	// (stride = pageBytes), appends it as a new region and returns its
	// index. The memory's initial content is unspecified.
	AllocRegion(pages int, pageBytes int64) (int, error)
	// Regions returns a copy of the region table.
	Regions() []Region
	// Fill writes spec over every byte of every listed page in every
	// region, after the work named by after. Pages must be valid in every
	// region; on a validation error nothing is written. A
	// caller that passes pages in ascending order lets the device coalesce
	// runs. The pages slice may be reused once Fill returns.
	Fill(pages []int32, spec FillSpec, after Ordering) (Fence, error)
	// ReadPage copies page p of region r into dst, which must be exactly
	// the region's PageBytes long. It waits for fills already issued.
	ReadPage(r int, p int32, dst []byte) error
	// WritePage copies src into page p of region r.
	WritePage(r int, p int32, src []byte) error
	// Counters returns running totals.
	Counters() Counters
	// Close frees memory the device allocated (adopted memory stays the
	// engine's) and makes every later call fail with ErrClosed.
	Close() error
}

// PartWriter is implemented by devices that can write part of a page in
// place. kvcache uses it to write received pages straight from the
// buffers they arrived in (a gRPC message is a list of 16 KiB buffers, so
// a page's bytes are rarely contiguous), and to write a handoff unit that
// arrives in ranges (a state slot larger than a message). The Host and
// CUDA implement it. For whole pages CUDA's import takes its
// StagedCopier instead: it gathers the parts straight into page-locked
// staging (WriteStaged), which is the one host copy a write to GPU
// memory takes anyway, where a part writer would cut each DMA into
// pieces. On a device with neither, kvcache assembles each page region
// in host memory and calls WritePage.
type PartWriter interface {
	// WritePagePart copies src into page p of region r from byte offset
	// off on; off+len(src) must not exceed the region's PageBytes. The
	// write is ordered as WritePage's.
	WritePagePart(r int, p int32, off int, src []byte) error
}

// PartReader is implemented by devices that can read part of a page:
// kvcache reads a handoff unit larger than a transport's message (a
// state slot) in ranges, each region the range covers in part read in
// part rather than whole. The Host and CUDA implement it.
type PartReader interface {
	// ReadPagePart copies bytes [off, off+len(dst)) of page p of region r
	// into dst; off+len(dst) must not exceed the region's PageBytes. The
	// read is ordered as ReadPage's.
	ReadPagePart(r int, p int32, off int, dst []byte) error
}

// PageCopier is implemented by devices that copy many pages of a region
// in one call: on CUDA through page-locked staging, one asynchronous copy
// per run of adjacent pages and one wait per staging buffer's worth,
// instead of a synchronous round trip per page; on the Host, one pass. A
// handoff moves whole leases, but its buffers are page-major (a page's
// regions one after the other) and arrive in parts, so kvcache copies
// through the StagedCopier extension where a device has one (CUDA), and
// on the Host, whose pages are host memory, in place (PartWriter,
// Outgoing.PageViews) or a page region at a time.
type PageCopier interface {
	// ReadPages copies pages of region r, in the order listed, into dst,
	// which must be exactly len(pages) × the region's PageBytes long. It
	// is ordered as ReadPage: after fills already issued.
	ReadPages(r int, pages []int32, dst []byte) error
	// WritePages copies src, len(pages) × PageBytes, into pages of region
	// r in the order listed; the writes have landed when it returns. A
	// page listed twice gets its last copy.
	WritePages(r int, pages []int32, src []byte) error
}

// StagedCopier is a PageCopier whose copies go through page-locked
// staging (CUDA) and that hands the caller the staging itself, so that
// the one host copy a DMA needs is also the caller's own: kvcache's
// export scatters each page from staging to its place in the page-major
// buffer, and its import gathers a page's received parts into staging
// and sums the staged bytes, which are then exactly the bytes that land
// on the device. Neither needs a scratch buffer in between, and every
// region of a page is copied in the same call, so a batch's copies over
// all regions are waited for once.
//
// A call copies the listed regions of the listed pages a staging
// buffer's worth (a batch of whole pages) at a time. A batch is laid out
// region by region: staged[k] holds region regions[k] of the batch's
// pages, page after page, each that region's PageBytes long, so that a
// run of adjacent pages of a contiguous region is one copy; first is the
// index in pages of the batch's first page. The callbacks run on every
// batch in page order with the device locked: they must only move bytes
// (take no lock, call no device) and must not keep staged once they
// return. A call that is not valid (a region or page out of range, no
// regions) copies nothing and calls no callback.
type StagedCopier interface {
	PageCopier
	// ReadStaged copies each batch into staging and, once it has
	// arrived, calls drain with it. It is ordered as ReadPage: after
	// fills already issued.
	ReadStaged(regions []int, pages []int32, drain func(first int, staged [][]byte)) error
	// WriteStaged calls fill with each batch's staging, which fill must
	// fill in whole, and then copies it to the device; the writes have
	// landed when it returns. A page listed twice gets its last copy. On
	// an error, the batches before the failed one have landed.
	WriteStaged(regions []int, pages []int32, fill func(first int, staged [][]byte)) error
}

// checkCopy validates a PageCopier call against region r of regions (a
// StagedCopier call of that one region, with a buffer of n bytes): it
// returns the region.
func checkCopy(regions []Region, r int, pages []int32, n int) (Region, error) {
	pageBytes, err := checkStaged(regions, []int{r}, pages)
	if err != nil {
		return Region{}, err
	}
	if int64(n) != int64(len(pages))*pageBytes {
		return Region{}, fmt.Errorf("%w: buffer of %d bytes for %d pages of %d", ErrInvalidArgument, n, len(pages), pageBytes)
	}
	return regions[r], nil
}

// checkStaged validates a StagedCopier call against a region table: the
// listed regions exist, there is one at least, and every page is valid in
// each. It returns the bytes of one page over the listed regions.
func checkStaged(table []Region, regions []int, pages []int32) (int64, error) {
	if len(regions) == 0 {
		return 0, fmt.Errorf("%w: a page copy of no regions", ErrInvalidArgument)
	}
	var pageBytes int64
	limit := math.MaxInt32
	for _, r := range regions {
		if r < 0 || r >= len(table) {
			return 0, fmt.Errorf("%w: region %d of %d", ErrInvalidArgument, r, len(table))
		}
		pageBytes += table[r].PageBytes
		limit = min(limit, table[r].Pages)
	}
	return pageBytes, checkPagesBelow(pages, limit)
}

// Completed returns a Fence that is already done with err.
func Completed(err error) Fence {
	if err == nil {
		return doneFence{}
	}
	return failedFence{err}
}

type doneFence struct{}

func (doneFence) Done() (bool, error) { return true, nil }
func (doneFence) Wait() error         { return nil }

type failedFence struct{ err error }

func (f failedFence) Done() (bool, error) { return true, f.err }
func (f failedFence) Wait() error         { return f.err }

// chanFence is the completion of work that a goroutine finishes later:
// it sets err, then closes finished.
type chanFence struct {
	finished chan struct{}
	err      error // written before finished is closed
}

func newChanFence() *chanFence { return &chanFence{finished: make(chan struct{})} }

func (f *chanFence) Done() (bool, error) {
	select {
	case <-f.finished:
		return true, f.err
	default:
		return false, nil
	}
}

func (f *chanFence) Wait() error { <-f.finished; return f.err }

// CheckPages validates a fill batch against a region table: every page in
// range of every region. Backends call it before touching memory.
func CheckPages(regions []Region, pages []int32) error {
	if len(regions) == 0 && len(pages) > 0 {
		return fmt.Errorf("%w: fill on a device with no regions", ErrInvalidArgument)
	}
	limit := math.MaxInt32
	for _, r := range regions {
		limit = min(limit, r.Pages)
	}
	return checkPagesBelow(pages, limit)
}

// checkPagesBelow names the first of pages outside [0, limit), limit at
// most math.MaxInt32; nil if there is none.
func checkPagesBelow(pages []int32, limit int) error {
	for _, p := range pages {
		if uint32(p) >= uint32(limit) { // a negative page is a huge uint32: one compare for both ends
			return fmt.Errorf("%w: page %d outside [0, %d)", ErrInvalidArgument, p, limit)
		}
	}
	return nil
}
