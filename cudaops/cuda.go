package cudaops

import (
	_ "embed"
	"encoding/binary"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
)

// CUDA is the GPU Device. Its regions live in device memory, allocated with
// cuMemAlloc or adopted from the engine, and its fills run on its own
// stream.
//
// # Loading the driver
//
// The driver API is reached through libcuda.so.1, opened at run time with
// dlopen by one small cgo file (cuda_dl_cgo.go). A binary that contains
// kvfence therefore starts everywhere: on a machine without a driver, with
// the toolkit's stub library, or built with CGO_ENABLED=0, OpenCUDA returns
// an error wrapping ErrNoDevice that names the reason, and the process
// lives on. We use a few lines of cgo rather than a pure-Go dlopen
// (purego): the NVML probe needs cgo anyway, so cgo costs nothing more,
// adds no dependency, and the C compiler checks the call signatures we
// declare. No CUDA header or toolkit is needed to build.
//
// # Contexts and threads
//
// Driver calls act on the context current on the calling OS thread. Every
// method locks its goroutine to its thread, pushes the device's context
// (the device's primary context, which the CUDA runtime and PyTorch share,
// or the engine's own, see OpenCUDAContext) and pops it before returning,
// so whatever the thread had current before is restored.
//
// # Fill
//
// A Fill of a non-empty batch is, on the device's stream (non-blocking, so
// it never waits for the legacy default stream by accident):
//
//  1. waits for the engine work named by Ordering (cuStreamWaitEvent on the
//     engine's event, or on an event recorded on the engine's stream now);
//  2. an async copy of the region table and the page list from a
//     page-locked staging buffer to device memory;
//  3. ONE launch of kvf_fill (fill.ptx) over pages × regions, or, in
//     FillMemset mode, one cuMemsetD32Async / cuMemsetD2D32Async per run
//     of adjacent pages per region (the baseline, and the fallback when
//     the kernel cannot be loaded);
//  4. an event record: the Fence. Done is cuEventQuery, Wait is
//     cuEventSynchronize.
//
// A staging buffer is reused only once the fence of the fill that used it
// has completed, since the copy that reads it may still be queued behind
// the engine's work. Any error while queuing returns an error wrapping
// ErrDriver and no fence; the caller (the pool) must then treat the pages
// as not clean. An error the device reports later (a faulting kernel)
// comes out of the fence, also wrapping ErrDriver.
//
// ReadPage and WritePage queue their copy on the same stream and wait for
// it, so they observe every fill issued before them. (A plain synchronous
// cuMemcpy would run on the legacy default stream, which a non-blocking
// stream does not synchronise with.)
//
// # Locks
//
// life (RWMutex) is held shared by every method for its whole duration and
// exclusively by Close, so Close waits for calls in flight, including
// Fence.Wait. mu serialises the device state (regions, staging, the stream).
// A fence's own mutex and the event pool's mutex are leaves. Order: life →
// mu → fence.mu → events.mu.
type CUDA struct {
	drv     driver
	ordinal int
	dev     int32
	ctx     uintptr
	primary bool // ctx is dev's primary context, retained by us
	name    string

	// life is held shared by every call and exclusively by Close, so
	// closed and closeErr, written only under the exclusive lock, can be
	// read under the shared one.
	life     sync.RWMutex
	closed   bool
	closeErr error // the result of draining the stream at Close

	mu struct {
		sync.Mutex
		regions []Region
		owned   []bool // regions[i] was allocated by us
		mode    FillMode
		staging []*staging
	}
	stream  uintptr // our fills, copies and memsets
	orderEv uintptr // recorded on an engine stream to order a fill after it
	module  uintptr
	fillFn  uintptr
	kernErr error // why FillKernel is unavailable, or nil

	events struct {
		sync.Mutex
		free []uintptr
		all  []uintptr
	}

	fillCalls, launches, pagesFilled, bytesFilled atomic.Uint64
}

var _ Device = (*CUDA)(nil)

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
	maxStaging       = 16      // staging buffers, so fills in flight
	maxPageBytes     = 1 << 40 // bound that keeps every product below 2^63
)

// OpenCUDA opens device ordinal (as the driver numbers them, honouring
// CUDA_VISIBLE_DEVICES) through its primary context. Without a usable
// driver or device it returns an error wrapping ErrNoDevice that names the
// driver's reason, e.g. "cuInit: CUDA_ERROR_STUB_LIBRARY (34)".
func OpenCUDA(ordinal int) (*CUDA, error) {
	drv, err := loadDriver()
	if err != nil {
		return nil, err
	}
	return openCUDA(drv, ordinal, 0)
}

// OpenCUDAContext opens the device of an engine-owned context (a CUcontext
// as an integer, e.g. from gorgonia.org/cu), which must stay alive until
// Close. Use it when the engine's streams and events live in a context
// other than the primary one: a fill can only wait on those in their own
// context.
func OpenCUDAContext(ctx uintptr) (*CUDA, error) {
	if ctx == 0 {
		return nil, fmt.Errorf("%w: nil CUDA context", ErrInvalidArgument)
	}
	drv, err := loadDriver()
	if err != nil {
		return nil, err
	}
	return openCUDA(drv, -1, ctx)
}

// openCUDA opens ordinal's primary context, or, with ordinal -1, the
// context ctx.
func openCUDA(drv driver, ordinal int, ctx uintptr) (_ *CUDA, err error) {
	if ctx == 0 && ordinal < 0 {
		return nil, fmt.Errorf("%w: device ordinal %d", ErrInvalidArgument, ordinal)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := drv.init(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoDevice, err)
	}
	// d, not the result, so the cleanup below still sees it after a
	// "return nil, err".
	d := &CUDA{drv: drv, ordinal: ordinal, ctx: ctx}
	if ctx == 0 {
		if d.dev, err = drv.deviceGet(ordinal); err != nil {
			return nil, fmt.Errorf("%w: cuda:%d: %w", ErrNoDevice, ordinal, err)
		}
		if d.ctx, err = drv.primaryCtxRetain(d.dev); err != nil {
			return nil, fmt.Errorf("%w: cuda:%d: %w", ErrNoDevice, ordinal, err)
		}
		d.primary = true
	}
	if err := drv.ctxPush(d.ctx); err != nil {
		d.releaseCtx()
		return nil, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	// From here on, undo what succeeded if a later step fails.
	defer func() {
		if err != nil {
			d.teardownLocked()
			_ = drv.ctxPop()
			d.releaseCtx()
		}
	}()
	if ctx != 0 {
		if d.dev, err = drv.ctxGetDevice(); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrDriver, err)
		}
		d.ordinal = int(d.dev)
	}
	name, err := drv.deviceName(d.dev)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	d.name = fmt.Sprintf("cuda:%d %s", d.ordinal, name)
	if d.stream, err = drv.streamCreate(cuStreamNonBlocking); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	if d.orderEv, err = drv.eventCreate(cuEventDisableTiming); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	// A driver that cannot JIT the kernel still fills correctly with
	// memsets; say why in KernelError rather than refuse the device.
	if d.module, d.kernErr = drv.moduleLoadData(fillPTX); d.kernErr == nil {
		d.fillFn, d.kernErr = drv.moduleGetFunction(d.module, fillKernelName)
	}
	if d.kernErr != nil {
		d.mu.mode = FillMemset
	}
	// A failed pop leaves nothing to undo that the caller could act on.
	_ = drv.ctxPop()
	return d, nil
}

func (d *CUDA) releaseCtx() {
	if d.primary {
		_ = d.drv.primaryCtxRelease(d.dev)
	}
}

// enter makes the device's context current on this goroutine's thread;
// leave undoes it. Every driver call happens between the two.
func (d *CUDA) enter() error {
	runtime.LockOSThread()
	if err := d.drv.ctxPush(d.ctx); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("%w: %w", ErrDriver, err)
	}
	return nil
}

func (d *CUDA) leave() {
	_ = d.drv.ctxPop()
	runtime.UnlockOSThread()
}

// Name implements Device.
func (d *CUDA) Name() string { return d.name }

// Context returns the CUcontext the device works in.
func (d *CUDA) Context() uintptr { return d.ctx }

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

// MemInfo returns the device's free and total memory as the driver sees it
// from this context.
func (d *CUDA) MemInfo() (free, total uint64, err error) {
	d.life.RLock()
	defer d.life.RUnlock()
	if d.closed {
		return 0, 0, ErrClosed
	}
	if err := d.enter(); err != nil {
		return 0, 0, err
	}
	defer d.leave()
	free, total, err = d.drv.memGetInfo()
	if err != nil {
		return 0, 0, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	return free, total, nil
}

// AllocRegion implements Device with one cuMemAlloc per region (256-byte
// aligned, so the kernel always takes its 16-byte store path when
// pageBytes is a multiple of 16).
func (d *CUDA) AllocRegion(pages int, pageBytes int64) (int, error) {
	r := Region{Stride: pageBytes, PageBytes: pageBytes, Pages: pages}
	if err := validateDeviceRegion(r); err != nil {
		return 0, err
	}
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return 0, ErrClosed
	}
	if err := d.enter(); err != nil {
		return 0, err
	}
	defer d.leave()
	base, err := d.drv.memAlloc(uint64(r.Bytes()))
	if err != nil {
		if driverCode(err) == cuErrorOutOfMemory {
			return 0, fmt.Errorf("%w: region of %d bytes on %s: %w", ErrOutOfMemory, r.Bytes(), d.name, err)
		}
		return 0, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	r.Base = base
	return d.addLocked(r, true), nil
}

// AdoptRegion registers engine-owned device memory in this device's context
// as a region: pages pages, stride bytes apart, pageBytes long, page 0 at
// base (e.g. a PyTorch KV tensor's data_ptr()). kvfence cannot check that
// the extent [base, base + (pages-1)*stride + pageBytes) belongs to one
// live allocation (the driver cannot tell for memory mapped with
// cuMemMap, as PyTorch's expandable segments are); the engine must
// guarantee it, keep the memory alive until Close, and touch the pages
// only under kvfence leases. Close does not free adopted memory.
func (d *CUDA) AdoptRegion(base uint64, pages int, stride, pageBytes int64) (int, error) {
	r := Region{Base: base, Stride: stride, PageBytes: pageBytes, Pages: pages}
	if err := validateDeviceRegion(r); err != nil {
		return 0, err
	}
	switch {
	case base == 0:
		return 0, fmt.Errorf("%w: adopted region at address 0", ErrInvalidArgument)
	case base%4 != 0:
		return 0, fmt.Errorf("%w: adopted region at %#x is not 4-byte aligned", ErrInvalidArgument, base)
	case base > ^uint64(0)-uint64(r.Bytes()):
		return 0, fmt.Errorf("%w: adopted region at %#x of %d bytes wraps the address space", ErrInvalidArgument, base, r.Bytes())
	}
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return 0, ErrClosed
	}
	return d.addLocked(r, false), nil
}

// validateDeviceRegion adds to Region.Validate the bound the kernel's
// arithmetic relies on.
func validateDeviceRegion(r Region) error {
	if err := r.Validate(); err != nil {
		return err
	}
	if r.PageBytes > maxPageBytes || r.Bytes() > maxPageBytes*64 {
		return fmt.Errorf("%w: region of %d-byte pages spanning %d bytes is too large", ErrInvalidArgument, r.PageBytes, r.Bytes())
	}
	return nil
}

func (d *CUDA) addLocked(r Region, owned bool) int {
	d.mu.regions = append(d.mu.regions, r)
	d.mu.owned = append(d.mu.owned, owned)
	return len(d.mu.regions) - 1
}

// Regions implements Device.
func (d *CUDA) Regions() []Region {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]Region(nil), d.mu.regions...)
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

// orderAfterLocked makes the device's stream wait for the engine's work.
// A handle the driver rejects is the caller's mistake: ErrInvalidArgument.
func (d *CUDA) orderAfterLocked(after Ordering) error {
	wrap := func(what string, err error) error {
		if c := driverCode(err); c == cuErrorInvalidHandle || c == cuErrorInvalidValue {
			return fmt.Errorf("%w: ordering %s: %w", ErrInvalidArgument, what, err)
		}
		return fmt.Errorf("%w: ordering %s: %w", ErrDriver, what, err)
	}
	if after.Event != 0 {
		if err := d.drv.streamWaitEvent(d.stream, after.Event); err != nil {
			return wrap(fmt.Sprintf("event %#x", after.Event), err)
		}
	}
	if after.Stream != 0 {
		// cuStreamWaitEvent waits for the event's most recent record at the
		// time of the call, so one internal event serves every fill.
		if err := d.drv.eventRecord(d.orderEv, after.Stream); err != nil {
			return wrap(fmt.Sprintf("stream %#x", after.Stream), err)
		}
		if err := d.drv.streamWaitEvent(d.stream, d.orderEv); err != nil {
			return wrap(fmt.Sprintf("stream %#x", after.Stream), err)
		}
	}
	return nil
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

// staging is a page-locked host buffer and a device buffer of the same
// size that carry one fill's region table and page list.
type staging struct {
	host  []byte
	dev   uint64
	fence *cudaFence // the last fill that used it; nil if none
}

// idle reports whether no queued copy or kernel can still use s.
func (s *staging) idle() bool {
	if s.fence == nil {
		return true
	}
	done, _ := s.fence.poll()
	return done
}

// stagingLocked returns an idle staging buffer of at least n bytes,
// growing or adding one if needed and, when maxStaging are all busy,
// waiting for the oldest.
func (d *CUDA) stagingLocked(n int) (*staging, error) {
	var spare *staging
	for _, s := range d.mu.staging {
		if !s.idle() {
			continue
		}
		if len(s.host) >= n {
			s.fence = nil
			return s, nil
		}
		spare = s
	}
	if spare == nil && len(d.mu.staging) >= maxStaging {
		// All busy: wait for the first. Its fence's error, if any,
		// belongs to its own Fill's caller.
		spare = d.mu.staging[0]
		_ = spare.fence.wait()
		if len(spare.host) >= n {
			spare.fence = nil
			return spare, nil
		}
	}
	size := max(n, 64<<10)
	host, err := d.drv.memAllocHost(size)
	if err != nil {
		return nil, fmt.Errorf("%w: staging buffer: %w", ErrDriver, err)
	}
	dev, err := d.drv.memAlloc(uint64(size))
	if err != nil {
		_ = d.drv.memFreeHost(host)
		return nil, fmt.Errorf("%w: staging buffer: %w", ErrDriver, err)
	}
	s := &staging{host: host, dev: dev}
	if spare != nil {
		// spare is idle: nothing queued reads its buffers any more.
		d.freeStaging(spare)
		for i, x := range d.mu.staging {
			if x == spare {
				d.mu.staging[i] = s
			}
		}
	} else {
		d.mu.staging = append(d.mu.staging, s)
	}
	return s, nil
}

func (d *CUDA) freeStaging(s *staging) {
	_ = d.drv.memFreeHost(s.host)
	_ = d.drv.memFree(s.dev)
}

// getEvent returns an event for a fence, from the pool or new.
func (d *CUDA) getEvent() (uintptr, error) {
	d.events.Lock()
	defer d.events.Unlock()
	if n := len(d.events.free); n > 0 {
		ev := d.events.free[n-1]
		d.events.free = d.events.free[:n-1]
		return ev, nil
	}
	ev, err := d.drv.eventCreate(cuEventDisableTiming)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	d.events.all = append(d.events.all, ev)
	return ev, nil
}

func (d *CUDA) putEvent(ev uintptr) {
	d.events.Lock()
	defer d.events.Unlock()
	d.events.free = append(d.events.free, ev)
}

// page validates (r, p, n) and returns the page's device address. d.mu held.
func (d *CUDA) pageLocked(r int, p int32, n int) (uint64, error) {
	if d.closed {
		return 0, ErrClosed
	}
	if r < 0 || r >= len(d.mu.regions) {
		return 0, fmt.Errorf("%w: region %d of %d", ErrInvalidArgument, r, len(d.mu.regions))
	}
	reg := d.mu.regions[r]
	if p < 0 || int(p) >= reg.Pages {
		return 0, fmt.Errorf("%w: page %d outside [0, %d)", ErrInvalidArgument, p, reg.Pages)
	}
	if int64(n) != reg.PageBytes {
		return 0, fmt.Errorf("%w: buffer of %d bytes for a page of %d", ErrInvalidArgument, n, reg.PageBytes)
	}
	return reg.Base + uint64(p)*uint64(reg.Stride), nil
}

// ReadPage implements Device: it waits for every fill already issued.
func (d *CUDA) ReadPage(r int, p int32, dst []byte) error {
	return d.copyPage(r, p, len(dst), "reading", func(addr uint64) error {
		return d.drv.memcpyDtoHSync(dst, addr, d.stream)
	})
}

// WritePage implements Device: the write lands after every fill already
// issued, and has landed when WritePage returns.
func (d *CUDA) WritePage(r int, p int32, src []byte) error {
	return d.copyPage(r, p, len(src), "writing", func(addr uint64) error {
		return d.drv.memcpyHtoDSync(addr, src, d.stream)
	})
}

// copyPage runs a synchronous copy of page p of region r on the device's
// stream, so that it is ordered after every fill already issued.
func (d *CUDA) copyPage(r int, p int32, n int, verb string, copyAt func(addr uint64) error) error {
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	addr, err := d.pageLocked(r, p, n)
	if err != nil {
		return err
	}
	if err := d.enter(); err != nil {
		return err
	}
	defer d.leave()
	if err := copyAt(addr); err != nil {
		return fmt.Errorf("%w: %s page %d of region %d: %w", ErrDriver, verb, p, r, err)
	}
	return nil
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

// Close implements Device. It waits for calls in flight and for the work
// queued on the device's stream, then frees what the device allocated and
// releases the primary context. Fences not yet observed complete with the
// result of that wait. Closing twice is allowed.
func (d *CUDA) Close() error {
	d.life.Lock()
	defer d.life.Unlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	if err := d.enter(); err != nil {
		// Without the context nothing can be freed or waited for; the
		// memory goes when the context does.
		d.closeErr = err
		return err
	}
	if err := d.drv.streamSynchronize(d.stream); err != nil {
		d.closeErr = fmt.Errorf("%w: %w", ErrDriver, err)
	}
	for i, r := range d.mu.regions {
		if d.mu.owned[i] {
			_ = d.drv.memFree(r.Base)
		}
	}
	d.mu.regions, d.mu.owned = nil, nil
	d.teardownLocked()
	d.leave()
	d.releaseCtx()
	return d.closeErr
}

// teardownLocked frees the device's own resources; the context is current.
func (d *CUDA) teardownLocked() {
	for _, s := range d.mu.staging {
		d.freeStaging(s)
	}
	d.mu.staging = nil
	d.events.Lock()
	for _, ev := range d.events.all {
		_ = d.drv.eventDestroy(ev)
	}
	d.events.all, d.events.free = nil, nil
	d.events.Unlock()
	if d.orderEv != 0 {
		_ = d.drv.eventDestroy(d.orderEv)
	}
	if d.module != 0 {
		_ = d.drv.moduleUnload(d.module)
	}
	if d.stream != 0 {
		_ = d.drv.streamDestroy(d.stream)
	}
}

// cudaFence is the event recorded after one Fill. Its event goes back to
// the device's pool once the fence has seen it complete and no Wait is
// still blocked on it.
type cudaFence struct {
	d  *CUDA
	mu struct {
		sync.Mutex
		done    bool
		err     error
		ev      uintptr
		waiters int
	}
}

// Done implements Fence without blocking.
func (f *cudaFence) Done() (bool, error) {
	f.d.life.RLock()
	defer f.d.life.RUnlock()
	return f.poll()
}

// Wait implements Fence.
func (f *cudaFence) Wait() error {
	f.d.life.RLock()
	defer f.d.life.RUnlock()
	return f.wait()
}

// poll is Done for a caller holding d.life shared.
func (f *cudaFence) poll() (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.mu.done {
		return true, f.mu.err
	}
	if f.d.closed {
		// Close drained the stream: the fill ended with that.
		f.finishLocked(f.d.closeErr)
		return true, f.mu.err
	}
	if err := f.d.enter(); err != nil {
		f.finishLocked(err)
		return true, f.mu.err
	}
	done, err := f.d.drv.eventQuery(f.mu.ev)
	f.d.leave()
	switch {
	case err != nil:
		f.finishLocked(fmt.Errorf("%w: fill: %w", ErrDriver, err))
	case done:
		f.finishLocked(nil)
	}
	return f.mu.done, f.mu.err
}

// wait is Wait for a caller holding d.life shared. It does not hold f.mu
// while it blocks, so Done stays non-blocking.
func (f *cudaFence) wait() error {
	f.mu.Lock()
	if f.mu.done || f.d.closed {
		defer f.mu.Unlock()
		if !f.mu.done {
			f.finishLocked(f.d.closeErr)
		}
		return f.mu.err
	}
	ev := f.mu.ev
	f.mu.waiters++
	f.mu.Unlock()

	err := f.d.enter()
	if err == nil {
		if err = f.d.drv.eventSynchronize(ev); err != nil {
			err = fmt.Errorf("%w: fill: %w", ErrDriver, err)
		}
		f.d.leave()
	}

	f.mu.Lock()
	defer f.mu.Unlock()
	f.mu.waiters--
	if !f.mu.done {
		f.finishLocked(err)
	} else if f.mu.waiters == 0 {
		f.releaseLocked()
	}
	return f.mu.err
}

// finishLocked records the outcome and recycles the event unless a Wait is
// still blocked on it (the last one recycles it then).
func (f *cudaFence) finishLocked(err error) {
	f.mu.done, f.mu.err = true, err
	if f.mu.waiters == 0 {
		f.releaseLocked()
	}
}

func (f *cudaFence) releaseLocked() {
	if f.mu.ev != 0 && !f.d.closed {
		f.d.putEvent(f.mu.ev)
	}
	f.mu.ev = 0
}
