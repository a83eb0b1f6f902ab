package cudaops

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
)

// The CUDA device is split by concern. This file is the device itself:
// loading the driver, the context and the device it opens, making that
// context current around every driver call, the region table, and Close.
// cuda_fill.go queues the batched fill, cuda_staging.go owns the
// page-locked buffers and the host↔device copies, and cuda_fence.go the
// events that order a fill after the engine and report its completion.
// None of them uses cgo or unsafe: they call the driver interface
// (cuda_driver.go), whose only real implementation, the one file with cgo
// and unsafe, is cuda_dl_cgo.go; its pure-Go twin cuda_dl_nocgo.go makes
// a CGO_ENABLED=0 build report ErrNoDevice instead of failing to build.

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
// # Ordering
//
// A fill is ordered after the engine's work on the pages (see Ordering for
// what each value means here): an engine event is waited for on the
// device's stream (cuStreamWaitEvent), an engine stream through the
// device's own event recorded on it now, and the zero Ordering by
// synchronising the context (cuCtxSynchronize, on the caller's thread)
// before anything is queued, so it follows all work of every stream
// queued before the release. The device's stream is non-blocking, so it
// never synchronises with the legacy default stream by accident: an
// engine on the default stream must name it (StreamLegacy) or pass zero.
//
// It is created at the default priority, 0, which is also the least
// (cuCtxGetStreamPriorityRange: lower numbers are higher priorities, and
// 0 is the least): a scrub is already the low-priority work, and blocks
// of an engine's kernels on streams of a higher priority (negative, such
// as PyTorch's torch.cuda.Stream(priority=-1)) are scheduled before the
// fill's when both are ready. A lower-priority stream for scrubs does not
// exist to be had.
//
// CheckOrdering vets an Ordering without queuing anything: the stream
// exists, belongs to the device's context and is not capturing a CUDA
// graph (cuStreamGetCtx, cuStreamIsCapturing), the event exists and was
// not recorded inside a capture (cuEventQuery). A pool calls it before a
// lease lets go of its pages, so a bad handle is the caller's error and
// never a failed scrub. Recording on, or waiting from, a capturing stream
// would put kvfence's work into the engine's graph; instead it is refused.
//
// Every driver call runs with the calling thread's stream-capture mode
// set to relaxed (cuThreadExchangeStreamCaptureMode) and restored after:
// a capture the engine runs in global mode on another thread is then
// never invalidated by kvfence's queries, waits or allocations.
//
// # Fill
//
// A Fill of a non-empty batch is, on the device's stream:
//
//  1. the wait for the engine (above);
//  2. for a batch of more than fillInlineIDs (512) pages only, an async
//     copy of the page list from the staging ring (page-locked host
//     memory, allocated with the regions, never on the release path) to
//     its device twin; smaller batches carry their page IDs in the
//     launch's parameters, so a typical release is a launch and nothing
//     else. The region table (with how the kernel splits each region's
//     pages into chunks) is resident in device memory, uploaded when
//     regions are added;
//  3. ONE launch of kvf_fill (fill.ptx) over every region of every span,
//     a grid over (chunk, region) with streaming stores (see the
//     kernel's header), or, in FillMemset mode, one cuMemsetD32Async /
//     cuMemsetD2D32Async per run of adjacent pages per region (the
//     baseline, and the fallback when the kernel cannot be loaded or
//     fails its warm-up launch at open, and for a FillSpans batch whose
//     page list would take more than half the staging ring);
//  4. an event record: the Fence.
//
// # Completion
//
// Fence events are created with CU_EVENT_BLOCKING_SYNC and without
// timing. One reaper goroutine per device waits for them in order
// (fills on one stream complete in order) with cuEventSynchronize, which
// then sleeps instead of spinning, and completes each Fence: Done and
// Wait never call the driver, so any number of waiters costs no OS
// thread and no CPU. When the wait succeeds the reaper frees the fill's
// slot of the staging ring (and any earlier slot still held: the stream
// runs in order); a failed wait frees nothing, since the fill's queued
// copy may still read its slot. A Fill finding the ring full waits for a
// fence in flight to free it without holding the device lock (Stats
// counts it), or, with none in flight, drains the stream, and fails with
// ErrDriver if that fails. Any error while queuing returns an error
// wrapping ErrDriver (or ErrBadOrdering) and no fence; the caller (the
// pool) must then treat the pages as not clean. An error the device
// reports later (a faulting kernel) comes out of the fence, also wrapping
// ErrDriver.
//
// ReadPage and WritePage queue their copy on the same stream and wait for
// it, so they observe every fill issued before them. (A plain synchronous
// cuMemcpy would run on the legacy default stream, which a non-blocking
// stream does not synchronise with.)
//
// # Locks
//
// life (RWMutex) is held shared by every method for its whole duration and
// exclusively by Close, so Close waits for calls in flight. mu serialises
// the device state (regions, staging, the stream). The reaper's and the
// event pool's mutexes are leaves. Order: life → mu → reaper.mu →
// events.mu. The reaper takes mu only to free ring space, never with its
// own lock held.
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
		table   uint64         // device copy of the region table (regionEntryBytes per region)
		args    kernelArgs     // the launch's arguments, reused
		chunks  []regionChunks // how the kernel splits each region's pages (in table)
		// copyHost is the page-locked staging of batched copies
		// (PageCopier), allocated at the first.
		copyHost []byte
		// abandonedHost are staging buffers a failed wait left with
		// copies that may still run (copyStaged); freed only at Close,
		// once the stream has drained.
		abandonedHost [][]byte
		// hostMem is the page-locked memory AllocHost returned and
		// FreeHost has not freed (a host tier, cuda_hostcopy.go);
		// hostSuspect is set once a wait for host copies failed, after
		// which copies may still reach it, so that only Close frees it.
		hostMem     [][]byte
		hostSuspect bool
		ring        stagingRing
		// ringFreed is signalled whenever the reaper completes a fence
		// (it may have freed ring space, or left none in flight that
		// could) and when ring space is freed otherwise.
		ringFreed *sync.Cond
	}
	stream  uintptr // our fills, copies and memsets
	orderEv uintptr // recorded on an engine stream to order a fill after it
	module  uintptr
	fillFn  uintptr
	kernErr error // why FillKernel is unavailable, or nil
	// gridLimit bounds a fill launch's blocks; the kernel loops over the
	// rest. maxGrid, except in tests that make batches larger than the
	// grid.
	gridLimit uint32
	// chunkWords is the target size of a kernel chunk: chunkWords,
	// except in tests that split small pages into many chunks.
	chunkWords uint32
	// inlineIDs is how many page IDs a launch may carry in its
	// parameters: fillInlineIDs, except in tests of the staging ring.
	inlineIDs int
	// block is a fill launch's threads: fillBlock, except in tests that
	// make the kernel's loops iterate with few threads.
	block uint32
	// copyStaging is the size of copyHost: copyStagingBytes, except in
	// tests of batches larger than it.
	copyStaging int

	reap reaper

	events struct {
		sync.Mutex
		free []uintptr
		all  []uintptr
	}

	fillCalls, launches, pagesFilled, bytesFilled atomic.Uint64
	// Why a fill took a slower path than asked: a zero Ordering made it
	// synchronise the context, or a full staging ring made it wait.
	contextSyncs, stagingWaits atomic.Uint64
}

var _ Device = (*CUDA)(nil)

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
	d := &CUDA{drv: drv, ordinal: ordinal, ctx: ctx, gridLimit: maxGrid, chunkWords: chunkWords, inlineIDs: fillInlineIDs, block: fillBlock,
		copyStaging: copyStagingBytes}
	if ctx == 0 {
		if d.dev, err = drv.deviceGet(ordinal); err != nil {
			return nil, fmt.Errorf("%w: cuda:%d: %w", ErrNoDevice, ordinal, err)
		}
		if d.ctx, err = drv.primaryCtxRetain(d.dev); err != nil {
			return nil, fmt.Errorf("%w: cuda:%d: %w", ErrNoDevice, ordinal, err)
		}
		d.primary = true
	}
	d.mu.ringFreed = sync.NewCond(&d.mu)
	g, err := d.enter()
	if err != nil {
		d.releaseCtx()
		return nil, err
	}
	// From here on, undo what succeeded if a later step fails.
	defer func() {
		if err != nil {
			d.teardownLocked()
			g.leave()
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
	d.loadKernel()
	g.leave()
	d.reap.start(d)
	return d, nil
}

// loadKernel JIT-compiles the fill kernel and warms it up with a launch of
// no items, so that the first release pays neither and a kernel that
// cannot run is found now. A driver that cannot JIT or launch it still
// fills correctly with memsets: KernelError (and Stats) say why, with the
// JIT's log, rather than the device being refused.
func (d *CUDA) loadKernel() {
	m, log, err := d.drv.moduleLoadData(fillPTX)
	if err != nil {
		if log != "" {
			err = fmt.Errorf("%w: loading %s: %w; JIT log: %s", ErrDriver, fillKernelName, err, log)
		} else {
			err = fmt.Errorf("%w: loading %s: %w", ErrDriver, fillKernelName, err)
		}
	} else {
		d.module = m
		d.fillFn, err = d.drv.moduleGetFunction(m, fillKernelName)
		if err == nil {
			// No spans: every thread finds nothing to do.
			args, grid := d.fillArgsLocked(nil, 0, FillSpec{})
			err = d.drv.launchKernel(d.fillFn, grid, d.block, d.stream, args)
		}
		if err == nil {
			err = d.drv.streamSynchronize(d.stream)
		}
		if err != nil {
			err = fmt.Errorf("%w: warming up %s: %w", ErrDriver, fillKernelName, err)
		}
	}
	if err != nil {
		d.kernErr = err
		d.mu.mode = FillMemset
	}
}

func (d *CUDA) releaseCtx() {
	if d.primary {
		_ = d.drv.primaryCtxRelease(d.dev)
	}
}

// entered is a driver section on one OS thread: the device's context
// current and the thread's capture mode relaxed, both restored by leave.
type entered struct {
	d        *CUDA
	prevMode int
}

// enter makes the device's context current on this goroutine's thread and
// sets the thread's stream-capture mode to relaxed, so that nothing
// kvfence calls can invalidate a graph capture the engine runs in global
// mode on another thread; leave undoes both. Every driver call happens
// between the two.
func (d *CUDA) enter() (entered, error) {
	runtime.LockOSThread()
	if err := d.drv.ctxPush(d.ctx); err != nil {
		runtime.UnlockOSThread()
		return entered{}, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	prev, err := d.drv.exchangeCaptureMode(cuCaptureModeRelaxed)
	if err != nil {
		_ = d.drv.ctxPop()
		runtime.UnlockOSThread()
		return entered{}, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	return entered{d: d, prevMode: prev}, nil
}

func (g entered) leave() {
	_, _ = g.d.drv.exchangeCaptureMode(g.prevMode)
	_ = g.d.drv.ctxPop()
	runtime.UnlockOSThread()
}

// Name implements Device.
func (d *CUDA) Name() string { return d.name }

// Context returns the CUcontext the device works in.
func (d *CUDA) Context() uintptr { return d.ctx }

// MemInfo returns the device's free and total memory as the driver sees it
// from this context.
func (d *CUDA) MemInfo() (free, total uint64, err error) {
	d.life.RLock()
	defer d.life.RUnlock()
	if d.closed {
		return 0, 0, ErrClosed
	}
	g, err := d.enter()
	if err != nil {
		return 0, 0, err
	}
	defer g.leave()
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
	g, err := d.enter()
	if err != nil {
		return 0, err
	}
	defer g.leave()
	base, err := d.drv.memAlloc(uint64(r.Bytes()))
	if err != nil {
		if driverCode(err) == cuErrorOutOfMemory {
			return 0, fmt.Errorf("%w: region of %d bytes on %s: %w", ErrOutOfMemory, r.Bytes(), d.name, err)
		}
		return 0, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	r.Base = base
	i, err := d.addLocked(r, true)
	if err != nil {
		_ = d.drv.memFree(base)
	}
	return i, err
}

// AdoptRegion registers engine-owned device memory in this device's context
// as a region: pages pages, stride bytes apart, pageBytes long, page 0 at
// base (e.g. a PyTorch KV tensor's data_ptr()). Both ends of the extent
// [base, base + (pages-1)*stride + pageBytes) must be device memory of
// this device, allocated in this context or in none (cuMemMap mappings,
// as PyTorch's expandable segments are): memory of another GPU or context
// would make the fill kernel fault, and a fault is sticky in the context
// the engine shares. kvfence cannot check that the extent between the
// ends is one live allocation; the engine must guarantee it, keep the
// memory alive until Close, and touch the pages only under kvfence
// leases. Close does not free adopted memory.
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
	g, err := d.enter()
	if err != nil {
		return 0, err
	}
	defer g.leave()
	for _, addr := range []uint64{base, base + uint64(r.Bytes()) - 1} {
		if err := d.checkPointerLocked(addr); err != nil {
			return 0, err
		}
	}
	if err := checkAdopted(d.mu.regions, r); err != nil {
		return 0, err
	}
	return d.addLocked(r, false)
}

// checkPointerLocked refuses an address that is not device memory of this
// device and context.
func (d *CUDA) checkPointerLocked(addr uint64) error {
	pi, err := d.drv.pointerInfo(addr)
	switch {
	case err != nil:
		return fmt.Errorf("%w: adopted address %#x is not device memory the driver knows: %w", ErrInvalidArgument, addr, err)
	case pi.memType != cuMemoryTypeDevice && pi.memType != cuMemoryTypeUnified:
		return fmt.Errorf("%w: adopted address %#x is host memory (memory type %d), not device memory", ErrInvalidArgument, addr, pi.memType)
	case pi.ordinal != d.dev:
		return fmt.Errorf("%w: adopted address %#x is memory of device %d, this device is %d", ErrInvalidArgument, addr, pi.ordinal, d.dev)
	case pi.ctx != 0 && pi.ctx != d.ctx:
		return fmt.Errorf("%w: adopted address %#x was allocated in context %#x, this device works in %#x (open it with OpenCUDAContext)",
			ErrInvalidArgument, addr, pi.ctx, d.ctx)
	}
	return nil
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

// addLocked appends r to the region table and brings the device's copies
// up to date: the region table in device memory and a staging ring large
// enough for the largest batch, both allocated here, on the setup path,
// so that no fill allocates or frees. The context is current.
func (d *CUDA) addLocked(r Region, owned bool) (int, error) {
	regions := append(d.mu.regions[:len(d.mu.regions):len(d.mu.regions)], r)
	if err := d.resizeLocked(regions); err != nil {
		return 0, err
	}
	d.mu.regions = regions
	d.mu.owned = append(d.mu.owned, owned)
	return len(d.mu.regions) - 1, nil
}

// Regions implements Device.
func (d *CUDA) Regions() []Region {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]Region(nil), d.mu.regions...)
}

// Close implements Device. It waits for calls in flight and for the work
// queued on the device's stream, then frees what the device allocated and
// releases the primary context. Fences not yet observed complete with the
// result of that wait. Closing twice is allowed.
func (d *CUDA) Close() error {
	d.life.Lock()
	defer d.life.Unlock()
	if d.closed {
		return nil
	}
	d.closed = true
	g, err := d.enter()
	if err != nil {
		// Without the context nothing can be freed or waited for; the
		// memory goes when the context does, which releasing our retain
		// of a primary context lets happen. Fences not yet complete end
		// with this error.
		d.closeErr = err
		d.reap.stop(err)
		d.releaseCtx()
		return err
	}
	if err := d.drv.streamSynchronize(d.stream); err != nil {
		d.closeErr = fmt.Errorf("%w: %w", ErrDriver, err)
	}
	g.leave()
	// The stream is drained: the reaper completes what is left and exits
	// (it may need mu to free ring space, so mu is not held here).
	d.reap.stop(nil)
	g, err = d.enter()
	if err != nil {
		d.releaseCtx()
		return err
	}
	d.mu.Lock()
	for i, r := range d.mu.regions {
		if d.mu.owned[i] {
			_ = d.drv.memFree(r.Base)
		}
	}
	d.mu.regions, d.mu.owned = nil, nil
	d.teardownLocked()
	d.mu.Unlock()
	g.leave()
	d.releaseCtx()
	return d.closeErr
}

// teardownLocked frees the device's own resources; the context is current.
func (d *CUDA) teardownLocked() {
	d.mu.ring.free(d.drv)
	if d.mu.copyHost != nil {
		_ = d.drv.memFreeHost(d.mu.copyHost)
		d.mu.copyHost = nil
	}
	for _, b := range d.mu.abandonedHost {
		_ = d.drv.memFreeHost(b)
	}
	d.mu.abandonedHost = nil
	for _, b := range d.mu.hostMem {
		_ = d.drv.memFreeHost(b)
	}
	d.mu.hostMem = nil
	if d.mu.table != 0 {
		_ = d.drv.memFree(d.mu.table)
		d.mu.table = 0
	}
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
