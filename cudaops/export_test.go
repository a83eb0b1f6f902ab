package cudaops

import (
	"fmt"
	"time"
)

// Test hooks for the external test package (cudaops_test), which may
// import devicetest; this package's own tests may not.

// FakeDriver is the simulated driver (fakedriver_test.go).
type FakeDriver = fakeDriver

// OpenFake opens device 0 of a fresh simulated driver.
func OpenFake() (*CUDA, *FakeDriver, error) {
	f := newFakeDriver()
	d, err := openCUDA(f, 0, 0)
	return d, f, err
}

// OpenOn opens ordinal on the given simulated driver.
func OpenOn(f *FakeDriver, ordinal int) (*CUDA, error) { return openCUDA(f, ordinal, 0) }

// NewFakeDriver returns a simulated driver with one device.
func NewFakeDriver() *FakeDriver { return newFakeDriver() }

func (f *fakeDriver) SetInitError(code int) { f.initErr = code }
func (f *fakeDriver) SetLoadError(code int) { f.loadErr = code }

// SetStubborn makes event queries answer "not ready" while work is pending,
// so only waits and synchronizes let queued work run.
func (f *fakeDriver) SetStubborn(on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stubborn = on
}

// FailNext makes the next call of the named entry point fail with code.
func (f *fakeDriver) FailNext(call string, code int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failAt[call] = code
}

// FaultNext makes the next queued op of that name fault with code when it
// runs, poisoning the context as a faulting kernel does.
func (f *fakeDriver) FaultNext(op string, code int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.faultAt[op] = code
}

// FailLater makes the call of the named entry point after skip more
// calls of it fail with code: a failure in the middle of a batch.
func (f *fakeDriver) FailLater(call string, skip, code int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failIn[call] = fakeFailure{skip: skip, code: code}
}

// CopiedBytes are the bytes copied between host and device so far:
// pinned by async copies from or to page-locked memory (what staging
// carries), pageable by synchronous copies from or to Go memory (which
// the real driver carries through page-locked memory of its own).
func (f *fakeDriver) CopiedBytes() (pinned, pageable uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pinnedBytes, f.pageableBytes
}

// Calls returns how often the named entry point was called.
func (f *fakeDriver) Calls(call string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[call]
}

// Leaks describes resources the driver still holds, or "".
func (f *fakeDriver) Leaks() string { return f.leaks() }

// ContextDepth is how many contexts are pushed and not popped.
func (f *fakeDriver) ContextDepth() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ctxDepthLocked()
}

// SetLoadLog is the JIT error log a failing module load reports.
func (f *fakeDriver) SetLoadLog(log string) { f.loadLog = log }

// SetDevices sets how many devices the simulated driver has.
func (f *fakeDriver) SetDevices(n int) { f.devices = n }

// HoldSyncs makes every cuEventSynchronize block until release is called:
// fills then stay in flight as long as a test wants.
func (f *fakeDriver) HoldSyncs() (release func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ch := make(chan struct{})
	f.hold = ch
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.hold == ch {
			f.hold = nil
			close(ch)
		}
	}
}

// EventsWithoutFlags counts the events created without all of flags,
// besides the one every device creates for engine streams.
func (f *fakeDriver) EventsWithoutFlags(flags uint32) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, fl := range f.eventFlags {
		if fl&flags != flags {
			n++
		}
	}
	return n
}

// Fence-event flags, for EventsWithoutFlags.
const (
	EventBlockingSync  = cuEventBlockingSync
	EventDisableTiming = cuEventDisableTiming
)

// ForeignAlloc allocates n bytes of simulated device memory on device
// ordinal, in the primary context of that device or, with foreign, in a
// context kvfence did not open.
func (f *fakeDriver) ForeignAlloc(n uint64, ordinal int32, foreign bool) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	ctx := fakePrimaryCtx + uintptr(ordinal)
	if foreign {
		ctx = fakeForeignCtx
	}
	return f.allocInLocked(n, ctx, ordinal)
}

// CaptureStatus is a stream's capture status: 0 none, 1 active, 2
// invalidated.
func (f *fakeDriver) CaptureStatus(s uintptr) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := f.streamLocked(s)
	if err != nil {
		if f.curCtxLocked() == 0 { // the special streams need a context: look in the primary one
			st = f.special[[2]uintptr{fakePrimaryCtx, max(s, 1)}]
		}
		if st == nil {
			return -1
		}
	}
	return st.capture
}

// Capture is what an engine's graph capture on a stream looks like to the
// simulated driver: begun in global mode (PyTorch's default) until end.
func (f *fakeDriver) Capture(s uintptr) (end func() int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.streams[s]
	st.capture, st.captureGlobal = cuCaptureStatusActive, true
	return func() int {
		f.mu.Lock()
		defer f.mu.Unlock()
		status := st.capture
		st.capture, st.captureGlobal, st.captured = cuCaptureStatusNone, false, 0
		return status
	}
}

// ForeignStream creates a stream in a context kvfence did not open; free
// destroys it.
func (f *fakeDriver) ForeignStream() (s uintptr, free func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	h := f.newHandleLocked()
	f.streams[h] = &fakeStream{ctx: fakeForeignCtx}
	return h, func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.streams, h)
	}
}

// EngineStream says which stream a TestEngine writes on.
type EngineStream int

const (
	// EngineOwnStream: a stream of its own, non-blocking, as PyTorch's
	// side streams are.
	EngineOwnStream EngineStream = iota
	// EngineLegacyStream: the legacy default stream (handle 0), PyTorch's
	// default stream.
	EngineLegacyStream
	// EnginePerThreadStream: the per-thread default stream.
	EnginePerThreadStream
)

// TestEngine stands for an engine's stream on the device's own driver (the
// real one or the fake): it queues memsets on its stream, each behind a
// large scratch memset so that on a GPU the write is still pending when a
// fill is queued after it.
type TestEngine struct {
	d            *CUDA
	kind         EngineStream
	stream, ev   uintptr
	scratch      uint64
	scratchWords uint64
}

// NewTestEngine creates an engine on a stream of its own, its event and a
// scratch buffer.
func (d *CUDA) NewTestEngine(scratchBytes uint64) (*TestEngine, error) {
	return d.NewTestEngineOn(EngineOwnStream, scratchBytes)
}

// NewTestEngineOn is NewTestEngine on the given kind of stream.
func (d *CUDA) NewTestEngineOn(kind EngineStream, scratchBytes uint64) (*TestEngine, error) {
	g, err := d.enter()
	if err != nil {
		return nil, err
	}
	defer g.leave()
	e := &TestEngine{d: d, kind: kind, scratchWords: scratchBytes / 4}
	switch kind {
	case EngineLegacyStream:
		e.stream = 0
	case EnginePerThreadStream:
		e.stream = StreamPerThread
	default:
		if e.stream, err = d.drv.streamCreate(cuStreamNonBlocking); err != nil {
			return nil, err
		}
	}
	if e.ev, err = d.drv.eventCreate(cuEventDisableTiming); err != nil {
		return nil, err
	}
	if e.scratchWords > 0 {
		if e.scratch, err = d.drv.memAlloc(scratchBytes); err != nil {
			return nil, err
		}
	}
	return e, nil
}

// Stream is the engine's stream handle as an engine would pass it (0 for
// the legacy default stream).
func (e *TestEngine) Stream() uintptr { return e.stream }

// Event is the engine's event, recorded after each Write.
func (e *TestEngine) Event() uintptr { return e.ev }

// Write queues a write of word over page p of region r and returns the
// ordering that names it.
func (e *TestEngine) Write(r int, p int32, word uint32) (Ordering, error) {
	reg := e.d.Regions()[r]
	g, err := e.d.enter()
	if err != nil {
		return Ordering{}, err
	}
	defer g.leave()
	if e.scratchWords > 0 {
		if err := e.d.drv.memsetD32Async(e.scratch, word, e.scratchWords, e.stream); err != nil {
			return Ordering{}, err
		}
	}
	addr := reg.Base + uint64(p)*uint64(reg.Stride)
	if err := e.d.drv.memsetD32Async(addr, word, uint64(reg.PageBytes/4), e.stream); err != nil {
		return Ordering{}, err
	}
	if err := e.d.drv.eventRecord(e.ev, e.stream); err != nil {
		return Ordering{}, err
	}
	s := e.stream
	if s == 0 {
		s = StreamLegacy // an Ordering's zero Stream means "none"
	}
	return Ordering{Stream: s, Event: e.ev}, nil
}

// Sync waits for the engine's stream.
func (e *TestEngine) Sync() error {
	g, err := e.d.enter()
	if err != nil {
		return err
	}
	defer g.leave()
	return e.d.drv.streamSynchronize(e.stream)
}

// Close frees the engine's resources; call it before the device's Close.
func (e *TestEngine) Close() {
	g, err := e.d.enter()
	if err != nil {
		return
	}
	defer g.leave()
	_ = e.d.drv.streamSynchronize(e.stream)
	if e.scratch != 0 {
		_ = e.d.drv.memFree(e.scratch)
	}
	_ = e.d.drv.eventDestroy(e.ev)
	if e.kind == EngineOwnStream {
		_ = e.d.drv.streamDestroy(e.stream)
	}
}

// MemsetBaseline queues one cuMemsetD32Async of words words at addr on the
// device's stream and returns its fence: the benchmark's baseline.
func (d *CUDA) MemsetBaseline(addr uint64, word uint32, words uint64) (Fence, error) {
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	g, err := d.enter()
	if err != nil {
		return nil, err
	}
	defer g.leave()
	if err := d.drv.memsetD32Async(addr, word, words, d.stream); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	ev, err := d.getEvent()
	if err != nil {
		return nil, err
	}
	if err := d.drv.eventRecord(ev, d.stream); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	f := newFence(ev)
	f.ringGen, f.ringEnd = d.mu.ring.gen, d.mu.ring.head
	d.reap.track(f)
	return f, nil
}

// Simulated says whether d runs on the simulated driver.
func (d *CUDA) Simulated() bool {
	_, ok := d.drv.(*fakeDriver)
	return ok
}

// Scratch allocates n bytes of device memory outside the region table and
// returns its address and a function that frees it.
func (d *CUDA) Scratch(n uint64) (uint64, func(), error) {
	g, err := d.enter()
	if err != nil {
		return 0, nil, err
	}
	defer g.leave()
	p, err := d.drv.memAlloc(n)
	if err != nil {
		return 0, nil, fmt.Errorf("%w: %w", ErrOutOfMemory, err)
	}
	return p, func() {
		if g, err := d.enter(); err == nil {
			_ = d.drv.memFree(p)
			g.leave()
		}
	}, nil
}

// SetBudget sets the instruction budget of each simulated launch.
func (f *fakeDriver) SetBudget(n int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.budget = n
}

// KernelStats are what the PTX interpreter ran on this driver, over all
// launches.
type KernelStats = fakeKernelStats

func (f *fakeDriver) KernelStats() KernelStats {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.kstats
}

// SetGridLimit bounds the blocks of d's fill launches, so tests can make
// batches larger than the grid; 0 restores the default.
func (d *CUDA) SetGridLimit(n uint32) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if n == 0 {
		n = maxGrid
	}
	d.gridLimit = n
}

// RewriteImage makes every later module load parse rewrite(image)
// instead of the image the device passed: how the mutation tests load a
// deliberately broken kernel.
func (f *fakeDriver) RewriteImage(rewrite func([]byte) []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rewrite = rewrite
}

// Peek returns a copy of n bytes of simulated device memory at addr (nil
// unless they lie in one allocation); it does not order after queued
// work, so synchronise first.
func (f *fakeDriver) Peek(addr uint64, n int) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	b := f.spanLocked(addr, uint64(n))
	return append([]byte(nil), b...)
}

// Poke writes b into simulated device memory at addr, at once.
func (f *fakeDriver) Poke(addr uint64, b []byte) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.spanLocked(addr, uint64(len(b)))
	copy(d, b)
	return d != nil
}

// FillKernelPTX is the kernel image the device loads.
func FillKernelPTX() []byte { return append([]byte(nil), fillPTX...) }

// SetChunkWords sets the target size of the kernel's chunks, in words
// (0: the default), so that small pages are split into many chunks; call
// it before the first region is added.
func (d *CUDA) SetChunkWords(n uint32) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.mu.regions) > 0 {
		return fmt.Errorf("%w: chunk size set after regions were added", ErrInvalidArgument)
	}
	if n == 0 {
		n = chunkWords
	}
	d.chunkWords = n
	return nil
}

// SetInlineIDs bounds the page IDs a launch carries in its parameters
// (0: the default), so that small batches take the staging ring.
func (d *CUDA) SetInlineIDs(n int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if n == 0 {
		n = fillInlineIDs
	}
	d.inlineIDs = min(n, fillInlineIDs)
}

// FillLimits are the kernel's per-launch limits.
const (
	FillSpanSlots = fillSpanSlots
	FillInlineIDs = fillInlineIDs
)

// SetFillBlock sets the threads of d's fill launches (0: the default), so
// that the kernel's loops over a chunk's words iterate.
func (d *CUDA) SetFillBlock(n uint32) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if n == 0 {
		n = fillBlock
	}
	d.block = n
}

// Timed is device work bracketed by two timing events on the device's
// stream, for benchmarks: Elapsed is the device time between them once
// the work's fence has completed.
type Timed struct {
	d          *CUDA
	start, end uintptr
}

// NewTimed creates the two timing events; Close destroys them.
func (d *CUDA) NewTimed() (*Timed, error) {
	g, err := d.enter()
	if err != nil {
		return nil, err
	}
	defer g.leave()
	t := &Timed{d: d}
	if t.start, err = d.drv.eventCreate(0); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	if t.end, err = d.drv.eventCreate(0); err != nil {
		_ = d.drv.eventDestroy(t.start)
		return nil, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	return t, nil
}

func (t *Timed) record(ev uintptr) error {
	t.d.mu.Lock()
	defer t.d.mu.Unlock()
	g, err := t.d.enter()
	if err != nil {
		return err
	}
	defer g.leave()
	if err := t.d.drv.eventRecord(ev, t.d.stream); err != nil {
		return fmt.Errorf("%w: %w", ErrDriver, err)
	}
	return nil
}

// Run records the start event, runs work (which queues on the device's
// stream: a Fill, a MemsetBaseline), records the end event and returns
// work's fence.
func (t *Timed) Run(work func() (Fence, error)) (Fence, error) {
	if err := t.record(t.start); err != nil {
		return nil, err
	}
	f, err := work()
	if err != nil {
		return nil, err
	}
	return f, t.record(t.end)
}

// Elapsed is the device time from the start event to the end event; call
// it after the fence completed.
func (t *Timed) Elapsed() (time.Duration, error) {
	g, err := t.d.enter()
	if err != nil {
		return 0, err
	}
	defer g.leave()
	if err := t.d.drv.eventSynchronize(t.end); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	el, err := t.d.drv.eventElapsed(t.start, t.end)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrDriver, err)
	}
	return el, nil
}

// Close destroys the events.
func (t *Timed) Close() {
	if g, err := t.d.enter(); err == nil {
		_ = t.d.drv.eventDestroy(t.start)
		_ = t.d.drv.eventDestroy(t.end)
		g.leave()
	}
}

// CopyIn writes b to device memory at addr (any allocation: regions,
// scratch) on the device's stream, after every fill queued before.
func (d *CUDA) CopyIn(addr uint64, b []byte) error {
	return d.syncCopy(func() error { return d.drv.memcpyHtoDSync(addr, b, d.stream) })
}

// CopyOut reads device memory at addr into b on the device's stream,
// after every fill queued before.
func (d *CUDA) CopyOut(addr uint64, b []byte) error {
	return d.syncCopy(func() error { return d.drv.memcpyDtoHSync(b, addr, d.stream) })
}

// syncCopy runs one synchronous copy with the device locked and entered.
func (d *CUDA) syncCopy(copy func() error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	g, err := d.enter()
	if err != nil {
		return err
	}
	defer g.leave()
	if err := copy(); err != nil {
		return fmt.Errorf("%w: %w", ErrDriver, err)
	}
	return nil
}

// SetCopyStaging sets the size of the staging buffer batched copies use
// (0: the default), so that tests make batches larger than it; call it
// before the first ReadPages or WritePages.
func (d *CUDA) SetCopyStaging(n int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if n == 0 {
		n = copyStagingBytes
	}
	d.copyStaging = n
}
