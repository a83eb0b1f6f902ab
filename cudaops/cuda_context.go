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
