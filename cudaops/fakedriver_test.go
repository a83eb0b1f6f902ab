package cudaops

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/kvfence/kvfence/internal/ptx"
)

// fakeDriver simulates the CUDA driver in host memory so that the CUDA
// device's own logic runs under `go test -race` without a GPU.
//
// Work queued on a stream runs lazily: only when something forces that
// stream (a synchronize, an event query, another stream waiting on one of
// its events). That is the most hostile legal schedule: a copy reads its
// page-locked source when it runs, not when it was queued, so a staging
// buffer reused too early corrupts a fill; and engine work a fill failed to
// wait for lands after the fill.
//
// Kernels are not emulated: module load parses the very PTX image the
// device passes (internal/ptx), function lookup resolves its .entry, and
// a launch checks its arguments against the declared .params and runs
// the kernel text, every thread of every block, over simulated device
// memory, each load and store bounds- and alignment-checked.
type fakeDriver struct {
	mu      sync.Mutex
	initErr int // CUresult cuInit returns
	devices int
	mem     map[uint64]*fakeAlloc // allocation base → memory
	next    uint64
	host    map[*byte]uintptr // page-locked buffers → their context
	streams map[uintptr]*fakeStream
	events  map[uintptr]*fakeEvent
	special map[[2]uintptr]*fakeStream // (context, CU_STREAM_LEGACY or _PER_THREAD) → stream
	handle  uintptr
	// ctxStacks are the context stacks of the OS threads, as the driver
	// keeps them (the device locks its goroutine to a thread around
	// every driver section; reapers run on threads of their own).
	ctxStacks map[int][]uintptr
	retained  int
	failAt    map[string]int // call name → CUresult for its next call
	faultAt   map[string]int // op name → CUresult it raises when it runs
	sticky    int            // a fault poisons the context, as on a GPU
	calls     map[string]int
	loadErr   int    // cuModuleLoadData result
	loadLog   string // the JIT error log that goes with it
	stubborn  bool   // event queries never let work run
	// relaxed counts threads (callers between two exchanges) in
	// CU_STREAM_CAPTURE_MODE_RELAXED; the fake cannot tell OS threads
	// apart, so "any caller relaxed" stands for "this caller".
	relaxed int
	// hold, when set, blocks every cuEventSynchronize until it is closed.
	hold chan struct{}
	// eventFlags are the flags each event was created with.
	eventFlags map[uintptr]uint32
	// The loaded modules and the functions looked up in them.
	modules map[uintptr]fakeModule
	funcs   map[uintptr]fakeFunc
	// budget is each launch's instruction budget.
	budget int64
	// faultMsg is the interpreter's account of the fault that set sticky.
	faultMsg string
	kstats   fakeKernelStats
	// rewrite, when set, changes the image a module load receives: the
	// mutation tests' way to load a broken kernel.
	rewrite func([]byte) []byte
	// Bytes copied between the host and the device: from or to
	// page-locked memory (async copies, which staging feeds) and from or
	// to Go memory (the synchronous copies, which the real driver stages
	// through its own page-locked buffer).
	pinnedBytes, pageableBytes uint64
	// failIn: call name → the failure of a later call (FailLater).
	failIn map[string]fakeFailure
}

// fakeFailure is a failure injected into a later call: the one after
// skip more calls of that entry point.
type fakeFailure struct{ skip, code int }

// fakeAlloc is one device allocation: its bytes and where they live.
type fakeAlloc struct {
	b       []byte
	ctx     uintptr
	ordinal int32
}

type fakeStream struct {
	ops      []fakeOp
	done     int // ops run so far
	ctx      uintptr
	blocking bool // synchronises with the legacy default stream
	legacy   bool // the legacy default stream of ctx
	// capture is the stream's capture status; captureGlobal says whether
	// it began in CU_STREAM_CAPTURE_MODE_GLOBAL. Work queued while
	// capturing goes into the graph (captured), not onto the stream.
	capture       int
	captureGlobal bool
	captured      int
}

type fakeOp struct {
	name string
	run  func() int // returns a CUresult
	wait *fakeEvent // or, for a wait op, the snapshot to wait for
}

// fakeEvent is what the event captured at its last record: a stream and
// the number of its ops that must have run.
type fakeEvent struct {
	stream   *fakeStream
	upTo     int
	queried  bool // an event query has answered "not ready" since the record
	captured bool // last recorded inside a capture sequence
	ctx      uintptr
}

// The simulated contexts: device d's primary context, and one context no
// device opened through kvfence (an engine's own).
const (
	fakePrimaryCtx = 0xc0
	fakeForeignCtx = 0xd0
)

func newFakeDriver() *fakeDriver {
	return &fakeDriver{
		devices:    1,
		mem:        map[uint64]*fakeAlloc{},
		next:       0x7f00_0000_0000,
		host:       map[*byte]uintptr{},
		streams:    map[uintptr]*fakeStream{},
		events:     map[uintptr]*fakeEvent{},
		special:    map[[2]uintptr]*fakeStream{},
		handle:     0x1000,
		failAt:     map[string]int{},
		failIn:     map[string]fakeFailure{},
		faultAt:    map[string]int{},
		calls:      map[string]int{},
		eventFlags: map[uintptr]uint32{},
		ctxStacks:  map[int][]uintptr{},
		modules:    map[uintptr]fakeModule{},
		funcs:      map[uintptr]fakeFunc{},
		budget:     1 << 28,
	}
}

// errLocked is the error of a failed call. The sticky error of a kernel
// that faulted also names what the interpreter saw.
func (f *fakeDriver) errLocked(call string, code int) error {
	if code == 0 {
		return nil
	}
	name := cuResultName(code)
	if code == f.sticky && f.faultMsg != "" {
		name += " [simulated: " + f.faultMsg + "]"
	}
	return &DriverError{Call: call, Code: code, Name: name}
}

// enterLocked counts a call and returns its injected failure, if any.
func (f *fakeDriver) enterLocked(call string) error {
	f.calls[call]++
	if c, ok := f.failAt[call]; ok {
		delete(f.failAt, call)
		return f.errLocked(call, c)
	}
	if fl, ok := f.failIn[call]; ok {
		if fl.skip > 0 {
			fl.skip--
			f.failIn[call] = fl
			return nil
		}
		delete(f.failIn, call)
		return f.errLocked(call, fl.code)
	}
	return nil
}

func (f *fakeDriver) newHandleLocked() uintptr {
	f.handle += 0x10
	return f.handle
}

func (f *fakeDriver) curCtxLocked() uintptr {
	st := f.ctxStacks[osThread()]
	if len(st) == 0 {
		return 0
	}
	return st[len(st)-1]
}

// ctxDepthLocked is how many contexts are pushed, over all threads.
func (f *fakeDriver) ctxDepthLocked() int {
	n := 0
	for _, st := range f.ctxStacks {
		n += len(st)
	}
	return n
}

// unsafeLocked is the check of a "potentially unsafe" call during stream
// capture: while a capture begun in global mode is active anywhere, a
// caller not in relaxed mode is refused and the capture invalidated, as
// the driver does.
func (f *fakeDriver) unsafeLocked(call string) error {
	if f.relaxed > 0 {
		return nil
	}
	hit := false
	for _, st := range f.allStreamsLocked() {
		if st.capture == cuCaptureStatusActive && st.captureGlobal {
			st.capture = cuCaptureStatusInvalid
			hit = true
		}
	}
	if hit {
		return f.errLocked(call, cuErrorCaptureUnsupp)
	}
	return nil
}

func (f *fakeDriver) allStreamsLocked() []*fakeStream {
	var all []*fakeStream
	for _, st := range f.streams {
		all = append(all, st)
	}
	for _, st := range f.special {
		all = append(all, st)
	}
	return all
}

// span resolves [addr, addr+n) to simulated memory, or nil.
func (f *fakeDriver) spanLocked(addr, n uint64) []byte {
	if a, base := f.allocLocked(addr); a != nil && n <= uint64(len(a.b))-(addr-base) {
		return a.b[addr-base : addr-base+n]
	}
	return nil
}

// allocLocked returns the allocation holding addr and its base.
func (f *fakeDriver) allocLocked(addr uint64) (*fakeAlloc, uint64) {
	for base, a := range f.mem {
		if addr >= base && addr-base < uint64(len(a.b)) {
			return a, base
		}
	}
	return nil, 0
}

// runLocked forces s until at least upTo of its ops have run.
func (f *fakeDriver) runLocked(s *fakeStream, upTo int) int {
	for s.done < upTo {
		op := s.ops[s.done]
		if op.wait != nil {
			if r := f.runLocked(op.wait.stream, op.wait.upTo); r != 0 {
				return r
			}
		} else if f.sticky == 0 {
			if c, ok := f.faultAt[op.name]; ok {
				delete(f.faultAt, op.name)
				f.sticky = c
			} else if r := op.run(); r != 0 {
				f.sticky = r
			}
		}
		s.done++
	}
	return f.sticky
}

// streamLocked resolves a stream handle as the driver does: 0 and
// CU_STREAM_LEGACY name the current context's legacy default stream,
// CU_STREAM_PER_THREAD its per-thread default stream (one, here: the fake
// has no threads), anything else a created stream.
func (f *fakeDriver) streamLocked(s uintptr) (*fakeStream, error) {
	if s <= 2 {
		ctx := f.curCtxLocked()
		if ctx == 0 {
			return nil, f.errLocked("stream", cuErrorInvalidContext)
		}
		kind := max(s, 1)
		st, ok := f.special[[2]uintptr{ctx, kind}]
		if !ok {
			st = &fakeStream{ctx: ctx, blocking: true, legacy: kind == 1}
			f.special[[2]uintptr{ctx, kind}] = st
		}
		return st, nil
	}
	st, ok := f.streams[s]
	if !ok {
		return nil, f.errLocked("stream", cuErrorInvalidHandle)
	}
	return st, nil
}

// implicitLocked adds the implicit synchronisation of the legacy default
// stream before an op on st: the legacy stream waits for every blocking
// stream of its context, and a blocking stream waits for the legacy
// stream. Non-blocking streams synchronise with nothing.
func (f *fakeDriver) implicitLocked(st *fakeStream) {
	if !st.blocking {
		return
	}
	if st.legacy {
		for _, b := range f.allStreamsLocked() {
			if b != st && b.blocking && b.ctx == st.ctx && b.done < len(b.ops) {
				st.ops = append(st.ops, fakeOp{name: "implicit", wait: &fakeEvent{stream: b, upTo: len(b.ops)}})
			}
		}
		return
	}
	if lg, ok := f.special[[2]uintptr{st.ctx, 1}]; ok && lg.done < len(lg.ops) {
		st.ops = append(st.ops, fakeOp{name: "implicit", wait: &fakeEvent{stream: lg, upTo: len(lg.ops)}})
	}
}

func (f *fakeDriver) queueLocked(call string, s uintptr, op fakeOp) error {
	if err := f.enterLocked(call); err != nil {
		return err
	}
	if f.curCtxLocked() == 0 {
		return f.errLocked(call, cuErrorInvalidContext)
	}
	st, err := f.streamLocked(s)
	if err != nil {
		return f.errLocked(call, driverCode(err))
	}
	if st.capture == cuCaptureStatusActive {
		st.captured++ // into the graph, not onto the stream
		return nil
	}
	if st.legacy && f.blockingCaptureLocked(st.ctx) {
		return f.errLocked(call, cuErrorCaptureImplicit)
	}
	f.implicitLocked(st)
	op.name = call
	st.ops = append(st.ops, op)
	return nil
}

// blockingCaptureLocked reports whether a blocking stream of ctx is
// capturing, which makes its legacy default stream unusable.
func (f *fakeDriver) blockingCaptureLocked(ctx uintptr) bool {
	for _, b := range f.allStreamsLocked() {
		if b.ctx == ctx && b.blocking && !b.legacy && b.capture == cuCaptureStatusActive {
			return true
		}
	}
	return false
}

func (f *fakeDriver) init() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuInit"); err != nil {
		return err
	}
	return f.errLocked("cuInit", f.initErr)
}

func (f *fakeDriver) deviceGet(ordinal int) (int32, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if ordinal < 0 || ordinal >= f.devices {
		return 0, f.errLocked("cuDeviceGet", cuErrorInvalidDevice)
	}
	return int32(ordinal), nil
}

func (f *fakeDriver) deviceName(int32) (string, error)     { return "Fake GPU", nil }
func (f *fakeDriver) deviceTotalMem(int32) (uint64, error) { return 1 << 34, nil }

func (f *fakeDriver) primaryCtxRetain(dev int32) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.retained++
	return fakePrimaryCtx + uintptr(dev), nil
}

// primaryCtxRelease drops a retain; the last one destroys the context and
// everything in it, as the driver does.
func (f *fakeDriver) primaryCtxRelease(dev int32) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.retained--
	if f.retained > 0 {
		return nil
	}
	ctx := fakePrimaryCtx + uintptr(dev)
	for p, a := range f.mem {
		if a.ctx == ctx {
			delete(f.mem, p)
		}
	}
	for b, c := range f.host {
		if c == ctx {
			delete(f.host, b)
		}
	}
	for h, st := range f.streams {
		if st.ctx == ctx {
			delete(f.streams, h)
		}
	}
	for h, e := range f.events {
		if e.ctx == ctx {
			delete(f.events, h)
		}
	}
	for h, m := range f.modules {
		if m.ctx == ctx {
			delete(f.modules, h)
		}
	}
	return nil
}

func (f *fakeDriver) ctxPush(ctx uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuCtxPushCurrent_v2"); err != nil {
		return err
	}
	tid := osThread()
	f.ctxStacks[tid] = append(f.ctxStacks[tid], ctx)
	return nil
}

func (f *fakeDriver) ctxPop() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	tid := osThread()
	st := f.ctxStacks[tid]
	if len(st) == 0 {
		return f.errLocked("cuCtxPopCurrent_v2", cuErrorInvalidContext)
	}
	if len(st) == 1 {
		delete(f.ctxStacks, tid)
	} else {
		f.ctxStacks[tid] = st[:len(st)-1]
	}
	return nil
}

func (f *fakeDriver) ctxGetDevice() (int32, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return int32(f.curCtxLocked() - fakePrimaryCtx), nil
}

func (f *fakeDriver) ctxSynchronize() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuCtxSynchronize"); err != nil {
		return err
	}
	if err := f.unsafeLocked("cuCtxSynchronize"); err != nil {
		return err
	}
	ctx := f.curCtxLocked()
	for _, st := range f.allStreamsLocked() {
		if st.ctx == ctx && st.capture != cuCaptureStatusNone {
			return f.errLocked("cuCtxSynchronize", cuErrorCaptureUnsupp)
		}
	}
	for _, st := range f.allStreamsLocked() {
		if st.ctx == ctx {
			if r := f.runLocked(st, len(st.ops)); r != 0 {
				return f.errLocked("cuCtxSynchronize", r)
			}
		}
	}
	return nil
}

func (f *fakeDriver) exchangeCaptureMode(mode int) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls["cuThreadExchangeStreamCaptureMode"]++
	if mode == cuCaptureModeRelaxed {
		f.relaxed++
		return cuCaptureModeGlobal, nil
	}
	f.relaxed--
	return cuCaptureModeRelaxed, nil
}

func (f *fakeDriver) memGetInfo() (uint64, uint64, error) { return 1 << 33, 1 << 34, nil }

func (f *fakeDriver) pointerInfo(p uint64) (ptrInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuPointerGetAttribute"); err != nil {
		return ptrInfo{}, err
	}
	a, _ := f.allocLocked(p)
	if a == nil {
		return ptrInfo{}, f.errLocked("cuPointerGetAttribute", cuErrorInvalidValue)
	}
	return ptrInfo{ctx: a.ctx, memType: cuMemoryTypeDevice, ordinal: a.ordinal}, nil
}

func (f *fakeDriver) memAlloc(n uint64) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuMemAlloc_v2"); err != nil {
		return 0, err
	}
	if err := f.unsafeLocked("cuMemAlloc_v2"); err != nil {
		return 0, err
	}
	if n > 1<<30 {
		return 0, f.errLocked("cuMemAlloc_v2", cuErrorOutOfMemory)
	}
	ctx := f.curCtxLocked()
	return f.allocInLocked(n, ctx, int32(ctx-fakePrimaryCtx)), nil
}

func (f *fakeDriver) allocInLocked(n uint64, ctx uintptr, ordinal int32) uint64 {
	p := f.next
	f.next += (n + 4096 + 255) &^ 255 // a gap between allocations
	f.mem[p] = &fakeAlloc{b: make([]byte, n), ctx: ctx, ordinal: ordinal}
	return p
}

func (f *fakeDriver) memFree(p uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls["cuMemFree_v2"]++
	if err := f.unsafeLocked("cuMemFree_v2"); err != nil {
		return err
	}
	if _, ok := f.mem[p]; !ok {
		return f.errLocked("cuMemFree_v2", cuErrorInvalidValue)
	}
	delete(f.mem, p)
	return nil
}

func (f *fakeDriver) memAllocHost(n int) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuMemAllocHost_v2"); err != nil {
		return nil, err
	}
	if err := f.unsafeLocked("cuMemAllocHost_v2"); err != nil {
		return nil, err
	}
	b := make([]byte, n)
	f.host[&b[0]] = f.curCtxLocked()
	return b, nil
}

func (f *fakeDriver) memFreeHost(b []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls["cuMemFreeHost"]++
	if _, ok := f.host[&b[0]]; !ok {
		return f.errLocked("cuMemFreeHost", cuErrorInvalidValue)
	}
	delete(f.host, &b[0])
	return nil
}

func (f *fakeDriver) memcpyHtoDAsync(dst uint64, src []byte, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	// The source is read when the copy runs, as DMA from pinned memory is.
	f.pinnedBytes += uint64(len(src)) // undone below if it is not queued
	err := f.queueLocked("cuMemcpyHtoDAsync_v2", s, fakeOp{run: func() int {
		d := f.spanLocked(dst, uint64(len(src)))
		if d == nil {
			return 700
		}
		copy(d, src)
		return 0
	}})
	if err != nil {
		f.pinnedBytes -= uint64(len(src))
	}
	return err
}

func (f *fakeDriver) memcpyDtoDAsync(dst, src, n uint64, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.queueLocked("cuMemcpyDtoDAsync_v2", s, fakeOp{run: func() int {
		d, from := f.spanLocked(dst, n), f.spanLocked(src, n)
		if d == nil || from == nil {
			return 700
		}
		copy(d, from)
		return 0
	}})
}

func (f *fakeDriver) memcpyDtoHAsync(dst []byte, src uint64, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	// The destination is written when the copy runs, as DMA to pinned
	// memory is: only after the stream is waited for may it be read.
	f.pinnedBytes += uint64(len(dst)) // undone below if it is not queued
	err := f.queueLocked("cuMemcpyDtoHAsync_v2", s, fakeOp{run: func() int {
		d := f.spanLocked(src, uint64(len(dst)))
		if d == nil {
			return 700
		}
		copy(dst, d)
		return 0
	}})
	if err != nil {
		f.pinnedBytes -= uint64(len(dst))
	}
	return err
}

// syncCopyLocked is the real driver's synchronous copy (cuda_dl_cgo.go):
// an async copy of n bytes of Go memory and a wait for the stream, each
// counted as the driver call it is.
func (f *fakeDriver) syncCopyLocked(call string, s uintptr, n int, run func() int) error {
	if err := f.queueLocked(call, s, fakeOp{run: run}); err != nil {
		return err
	}
	f.pageableBytes += uint64(n)
	f.calls["cuStreamSynchronize"]++
	st, _ := f.streamLocked(s)
	return f.errLocked("cuStreamSynchronize", f.runLocked(st, len(st.ops)))
}

func (f *fakeDriver) memcpyHtoDSync(dst uint64, src []byte, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.syncCopyLocked("cuMemcpyHtoDAsync_v2", s, len(src), func() int {
		d := f.spanLocked(dst, uint64(len(src)))
		if d == nil {
			return 700
		}
		copy(d, src)
		return 0
	})
}

func (f *fakeDriver) memcpyDtoHSync(dst []byte, src uint64, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.syncCopyLocked("cuMemcpyDtoHAsync_v2", s, len(dst), func() int {
		d := f.spanLocked(src, uint64(len(dst)))
		if d == nil {
			return 700
		}
		copy(dst, d)
		return 0
	})
}

func (f *fakeDriver) memsetD32Async(dst uint64, word uint32, n uint64, s uintptr) error {
	return f.memsetD2D32Async(dst, n*4, word, n, 1, s)
}

func (f *fakeDriver) memsetD2D32Async(dst, pitch uint64, word uint32, width, height uint64, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	call := "cuMemsetD2D32Async"
	if height == 1 && pitch == width*4 {
		call = "cuMemsetD32Async"
	}
	if dst%4 != 0 || (height > 1 && pitch < width*4) {
		return f.errLocked(call, cuErrorInvalidValue)
	}
	return f.queueLocked(call, s, fakeOp{run: func() int {
		for row := range height {
			d := f.spanLocked(dst+row*pitch, width*4)
			if d == nil {
				return 700
			}
			putWords(d, word)
		}
		return 0
	}})
}

func putWords(b []byte, w uint32) {
	for i := 0; i+4 <= len(b); i += 4 {
		binary.LittleEndian.PutUint32(b[i:], w)
	}
}

// moduleLoadData parses the image with the PTX interpreter's parser, as
// the driver's JIT would compile it: an image outside the interpreter's
// subset fails here with CUDA_ERROR_INVALID_PTX and the parser's message
// as the JIT log.
func (f *fakeDriver) moduleLoadData(image []byte) (uintptr, string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuModuleLoadDataEx"); err != nil {
		return 0, "", err
	}
	if err := f.unsafeLocked("cuModuleLoadDataEx"); err != nil {
		return 0, "", err
	}
	if f.loadErr != 0 {
		return 0, f.loadLog, f.errLocked("cuModuleLoadDataEx", f.loadErr)
	}
	if len(image) == 0 {
		return 0, "", f.errLocked("cuModuleLoadDataEx", 200)
	}
	if f.rewrite != nil {
		image = f.rewrite(image)
	}
	m, err := ptx.Parse(image)
	if err != nil {
		return 0, err.Error(), f.errLocked("cuModuleLoadDataEx", cuErrorInvalidPTX)
	}
	h := f.newHandleLocked()
	f.modules[h] = fakeModule{m, f.curCtxLocked()}
	return h, "", nil
}

func (f *fakeDriver) moduleUnload(m uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.modules[m]; !ok {
		return f.errLocked("cuModuleUnload", cuErrorInvalidHandle)
	}
	delete(f.modules, m)
	for h, fn := range f.funcs {
		if fn.module == m {
			delete(f.funcs, h)
		}
	}
	return nil
}

func (f *fakeDriver) moduleGetFunction(m uintptr, name string) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	mod, ok := f.modules[m]
	if !ok {
		return 0, f.errLocked("cuModuleGetFunction", cuErrorInvalidHandle)
	}
	e, err := mod.m.Entry(name)
	if err != nil {
		return 0, f.errLocked("cuModuleGetFunction", cuErrorNotFound)
	}
	h := f.newHandleLocked()
	f.funcs[h] = fakeFunc{module: m, entry: e}
	return h, nil
}

// fakeModule is a loaded module and the context it was loaded in.
type fakeModule struct {
	m   *ptx.Module
	ctx uintptr
}

// fakeFunc is a function handle: an entry of a loaded module.
type fakeFunc struct {
	module uintptr
	entry  *ptx.Entry
}

// launchKernel packs the arguments against the entry's declared
// parameters (a name or size that differs is refused, as the Go side
// passing what the kernel text does not declare) and queues a run of the
// kernel text by the PTX interpreter over simulated device memory. A
// thread that faults (out of bounds, misaligned, over the instruction
// budget) poisons the context with the matching CUresult, and the error
// then carries the interpreter's account of it.
func (f *fakeDriver) launchKernel(fn uintptr, grid [3]uint32, block uint32, s uintptr, args *kernelArgs) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	kf, ok := f.funcs[fn]
	if !ok {
		f.calls["cuLaunchKernel"]++
		return f.errLocked("cuLaunchKernel", cuErrorInvalidHandle)
	}
	list := make([]ptx.Arg, len(args.offs))
	for i := range list {
		list[i] = ptx.Arg{Name: args.names[i], Bytes: append([]byte(nil), args.arg(i)...)}
	}
	params, err := kf.entry.Pack(list)
	l := ptx.Launch{Grid: grid, Block: [3]uint32{block, 1, 1}, Params: params, Mem: &fakeMem{}, Budget: f.budget}
	if err == nil {
		err = kf.entry.CheckLaunch(l)
	}
	if err != nil {
		f.calls["cuLaunchKernel"]++
		return &DriverError{Call: "cuLaunchKernel", Code: cuErrorInvalidValue,
			Name: cuResultName(cuErrorInvalidValue) + " [simulated: " + err.Error() + "]"}
	}
	return f.queueLocked("cuLaunchKernel", s, fakeOp{run: func() int {
		l.Mem = f.memLocked()
		st, err := kf.entry.Run(l)
		f.kstats.Launches++
		f.kstats.Threads += st.Threads
		f.kstats.Instructions += st.Instructions
		f.kstats.BytesStored += st.BytesStored
		f.kstats.Stores += st.Stores
		if err == nil {
			return 0
		}
		f.faultMsg = err.Error()
		switch {
		case errors.Is(err, ptx.ErrOutOfBounds):
			return cuErrorIllegalAddress
		case errors.Is(err, ptx.ErrMisaligned):
			return cuErrorMisaligned
		case errors.Is(err, ptx.ErrBudget):
			return cuErrorLaunchTimeout
		}
		return cuErrorLaunchFailed
	}})
}

// fakeMem is simulated device memory as the interpreter sees it: the
// allocations as they are when the kernel runs (ops run with f.mu held,
// so none come or go meanwhile), sorted by base.
type fakeMem struct {
	bases  []uint64
	allocs []*fakeAlloc
	last   int
}

func (f *fakeDriver) memLocked() *fakeMem {
	m := &fakeMem{}
	for b := range f.mem {
		m.bases = append(m.bases, b)
	}
	slices.Sort(m.bases)
	for _, b := range m.bases {
		m.allocs = append(m.allocs, f.mem[b])
	}
	return m
}

// Global is not instrumented by the race detector (go:norace, as the
// interpreter's loop): it runs with f.mu held.
//
//go:norace
func (m *fakeMem) Global(addr uint64, n int) []byte {
	i := m.last
	if i >= len(m.bases) || addr < m.bases[i] || addr-m.bases[i] >= uint64(len(m.allocs[i].b)) {
		i = sort.Search(len(m.bases), func(j int) bool { return m.bases[j] > addr }) - 1
		if i < 0 {
			return nil
		}
		m.last = i
	}
	b, off := m.allocs[i].b, addr-m.bases[i]
	if off >= uint64(len(b)) || uint64(n) > uint64(len(b))-off {
		return nil
	}
	return b[off : off+uint64(n)]
}

// fakeKernelStats are what the interpreter ran, over all launches.
type fakeKernelStats struct {
	Launches, Threads, Instructions, Stores, BytesStored int64
}

func (f *fakeDriver) streamCreate(flags uint32) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuStreamCreate"); err != nil {
		return 0, err
	}
	h := f.newHandleLocked()
	f.streams[h] = &fakeStream{ctx: f.curCtxLocked(), blocking: flags&cuStreamNonBlocking == 0}
	return h, nil
}

func (f *fakeDriver) streamDestroy(s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, ok := f.streams[s]
	if !ok {
		return f.errLocked("cuStreamDestroy_v2", cuErrorInvalidHandle)
	}
	f.runLocked(st, len(st.ops)) // destroy lets queued work finish
	delete(f.streams, s)
	return nil
}

func (f *fakeDriver) streamSynchronize(s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuStreamSynchronize"); err != nil {
		return err
	}
	if err := f.unsafeLocked("cuStreamSynchronize"); err != nil {
		return err
	}
	st, err := f.streamLocked(s)
	if err != nil {
		return err
	}
	return f.errLocked("cuStreamSynchronize", f.runLocked(st, len(st.ops)))
}

func (f *fakeDriver) streamWaitEvent(s, ev uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	e, ok := f.events[ev]
	if !ok {
		return f.errLocked("cuStreamWaitEvent", cuErrorInvalidHandle)
	}
	if e.captured {
		// An event of a capture joins only streams of the same capture;
		// waiting on it from outside breaks the capture.
		if e.stream != nil && e.stream.capture == cuCaptureStatusActive {
			e.stream.capture = cuCaptureStatusInvalid
		}
		return f.errLocked("cuStreamWaitEvent", cuErrorCaptureIsolation)
	}
	if e.stream == nil { // never recorded: nothing to wait for
		return f.enterLocked("cuStreamWaitEvent")
	}
	snap := *e // the wait captures the event's most recent record
	return f.queueLocked("cuStreamWaitEvent", s, fakeOp{wait: &snap})
}

func (f *fakeDriver) streamGetCtx(s uintptr) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuStreamGetCtx"); err != nil {
		return 0, err
	}
	st, err := f.streamLocked(s)
	if err != nil {
		return 0, f.errLocked("cuStreamGetCtx", driverCode(err))
	}
	return st.ctx, nil
}

func (f *fakeDriver) streamIsCapturing(s uintptr) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuStreamIsCapturing"); err != nil {
		return 0, err
	}
	st, err := f.streamLocked(s)
	if err != nil {
		return 0, f.errLocked("cuStreamIsCapturing", driverCode(err))
	}
	if st.legacy && f.blockingCaptureLocked(st.ctx) {
		return 0, f.errLocked("cuStreamIsCapturing", cuErrorCaptureImplicit)
	}
	return st.capture, nil
}

func (f *fakeDriver) eventCreate(flags uint32) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuEventCreate"); err != nil {
		return 0, err
	}
	h := f.newHandleLocked()
	f.events[h] = &fakeEvent{ctx: f.curCtxLocked()}
	f.eventFlags[h] = flags
	return h, nil
}

func (f *fakeDriver) eventRecord(ev, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuEventRecord"); err != nil {
		return err
	}
	e, ok := f.events[ev]
	st, err := f.streamLocked(s)
	if !ok || err != nil || e.ctx != st.ctx {
		// Event and stream must be handles of one context.
		return f.errLocked("cuEventRecord", cuErrorInvalidHandle)
	}
	if st.capture == cuCaptureStatusActive {
		// The record becomes a node of the engine's graph.
		st.captured++
		*e = fakeEvent{stream: st, upTo: len(st.ops), captured: true, ctx: e.ctx}
		return nil
	}
	if st.legacy && f.blockingCaptureLocked(st.ctx) {
		return f.errLocked("cuEventRecord", cuErrorCaptureImplicit)
	}
	f.implicitLocked(st)
	*e = fakeEvent{stream: st, upTo: len(st.ops), ctx: e.ctx}
	return nil
}

func (f *fakeDriver) eventQuery(ev uintptr) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuEventQuery"); err != nil {
		return false, err
	}
	if err := f.unsafeLocked("cuEventQuery"); err != nil {
		return false, err
	}
	e, ok := f.events[ev]
	if !ok {
		return false, f.errLocked("cuEventQuery", cuErrorInvalidHandle)
	}
	if e.captured {
		return false, f.errLocked("cuEventQuery", cuErrorCapturedEvent)
	}
	// The first query after a record with work pending answers "not
	// ready"; the next lets the work run, so a poller is never stuck.
	if e.stream != nil && e.stream.done < e.upTo && (!e.queried || f.stubborn) {
		e.queried = true
		return false, nil
	}
	if e.stream != nil {
		if r := f.runLocked(e.stream, e.upTo); r != 0 {
			return false, f.errLocked("cuEventQuery", r)
		}
	}
	return true, nil
}

func (f *fakeDriver) eventSynchronize(ev uintptr) error {
	f.mu.Lock()
	hold := f.hold
	f.mu.Unlock()
	if hold != nil {
		<-hold
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuEventSynchronize"); err != nil {
		return err
	}
	if err := f.unsafeLocked("cuEventSynchronize"); err != nil {
		return err
	}
	e, ok := f.events[ev]
	if !ok {
		return f.errLocked("cuEventSynchronize", cuErrorInvalidHandle)
	}
	if e.stream != nil {
		return f.errLocked("cuEventSynchronize", f.runLocked(e.stream, e.upTo))
	}
	return nil
}

func (f *fakeDriver) eventDestroy(ev uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.events[ev]; !ok {
		return f.errLocked("cuEventDestroy_v2", cuErrorInvalidHandle)
	}
	delete(f.events, ev)
	return nil
}

// eventElapsed has no clock to read: it checks what the driver checks
// (both events exist, were created with timing, and are recorded and
// complete) and reports no time.
func (f *fakeDriver) eventElapsed(start, end uintptr) (time.Duration, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, ev := range []uintptr{start, end} {
		e, ok := f.events[ev]
		switch {
		case !ok || f.eventFlags[ev]&cuEventDisableTiming != 0:
			return 0, f.errLocked("cuEventElapsedTime", cuErrorInvalidHandle)
		case e.stream == nil:
			return 0, f.errLocked("cuEventElapsedTime", cuErrorInvalidValue)
		case e.stream.done < e.upTo:
			return 0, f.errLocked("cuEventElapsedTime", cuErrorNotReady)
		}
	}
	return 0, nil
}

// leaks describes resources still held, for tests that Close.
func (f *fakeDriver) leaks() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.mem) == 0 && len(f.host) == 0 && len(f.events) == 0 && len(f.streams) == 0 && f.retained == 0 && f.ctxDepthLocked() == 0 &&
		len(f.modules) == 0 {
		return ""
	}
	return fmt.Sprintf("%d device allocations, %d host buffers, %d events, %d streams, %d modules, %d context retains, context depth %d",
		len(f.mem), len(f.host), len(f.events), len(f.streams), len(f.modules), f.retained, f.ctxDepthLocked())
}
