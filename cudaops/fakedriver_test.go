package cudaops

import (
	"encoding/binary"
	"fmt"
	"sync"
)

// fakeDriver simulates the CUDA driver in host memory so that the CUDA
// device's own logic runs under `go test -race` without a GPU.
//
// Work queued on a stream runs lazily: only when something forces that
// stream (a synchronize, an event query, another stream waiting on one of
// its events). That is the most hostile legal schedule: a copy reads its
// page-locked source when it runs, not when it was queued, so a staging
// buffer reused too early corrupts a fill; and engine work a fill failed to
// wait for lands after the fill. The kernel is emulated from its documented
// semantics (fill.ptx's header), reading its table and page list from
// simulated device memory.
type fakeDriver struct {
	mu       sync.Mutex
	initErr  int // CUresult cuInit returns
	devices  int
	mem      map[uint64][]byte // allocation base → bytes
	next     uint64
	host     map[*byte]bool // page-locked buffers
	streams  map[uintptr]*fakeStream
	events   map[uintptr]*fakeEvent
	handle   uintptr
	ctxDepth int
	retained int
	failAt   map[string]int // call name → CUresult for its next call
	faultAt  map[string]int // op name → CUresult it raises when it runs
	sticky   int            // a fault poisons the context, as on a GPU
	calls    map[string]int
	loadErr  int  // cuModuleLoadData result
	stubborn bool // event queries never let work run
}

type fakeStream struct {
	ops  []fakeOp
	done int // ops run so far
}

type fakeOp struct {
	name string
	run  func() int // returns a CUresult
	wait *fakeEvent // or, for a wait op, the snapshot to wait for
}

// fakeEvent is what the event captured at its last record: a stream and
// the number of its ops that must have run.
type fakeEvent struct {
	stream  *fakeStream
	upTo    int
	queried bool // an event query has answered "not ready" since the record
}

func newFakeDriver() *fakeDriver {
	return &fakeDriver{
		devices: 1,
		mem:     map[uint64][]byte{},
		next:    0x7f00_0000_0000,
		host:    map[*byte]bool{},
		streams: map[uintptr]*fakeStream{},
		events:  map[uintptr]*fakeEvent{},
		handle:  0x1000,
		failAt:  map[string]int{},
		faultAt: map[string]int{},
		calls:   map[string]int{},
	}
}

func (f *fakeDriver) errLocked(call string, code int) error {
	if code == 0 {
		return nil
	}
	return &DriverError{Call: call, Code: code, Name: cuResultName(code)}
}

// enter counts a call and returns its injected failure, if any.
func (f *fakeDriver) enterLocked(call string) error {
	f.calls[call]++
	if c, ok := f.failAt[call]; ok {
		delete(f.failAt, call)
		return f.errLocked(call, c)
	}
	return nil
}

func (f *fakeDriver) newHandleLocked() uintptr {
	f.handle += 0x10
	return f.handle
}

// span resolves [addr, addr+n) to simulated memory, or nil.
func (f *fakeDriver) spanLocked(addr, n uint64) []byte {
	for base, b := range f.mem {
		if addr >= base && addr-base <= uint64(len(b)) && n <= uint64(len(b))-(addr-base) {
			return b[addr-base : addr-base+n]
		}
	}
	return nil
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

func (f *fakeDriver) streamLocked(s uintptr) (*fakeStream, error) {
	st, ok := f.streams[s]
	if !ok {
		return nil, f.errLocked("stream", cuErrorInvalidHandle)
	}
	return st, nil
}

func (f *fakeDriver) queueLocked(call string, s uintptr, op fakeOp) error {
	if err := f.enterLocked(call); err != nil {
		return err
	}
	if f.ctxDepth == 0 {
		return f.errLocked(call, 201) // CUDA_ERROR_INVALID_CONTEXT
	}
	st, err := f.streamLocked(s)
	if err != nil {
		return f.errLocked(call, cuErrorInvalidHandle)
	}
	op.name = call
	st.ops = append(st.ops, op)
	return nil
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

func (f *fakeDriver) primaryCtxRetain(int32) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.retained++
	return 0xc0, nil
}

func (f *fakeDriver) primaryCtxRelease(int32) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.retained--
	return nil
}

func (f *fakeDriver) ctxPush(uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ctxDepth++
	return nil
}

func (f *fakeDriver) ctxPop() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ctxDepth--
	return nil
}

func (f *fakeDriver) ctxGetDevice() (int32, error) { return 0, nil }

func (f *fakeDriver) memGetInfo() (uint64, uint64, error) { return 1 << 33, 1 << 34, nil }

func (f *fakeDriver) memAlloc(n uint64) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuMemAlloc_v2"); err != nil {
		return 0, err
	}
	if n > 1<<30 {
		return 0, f.errLocked("cuMemAlloc_v2", cuErrorOutOfMemory)
	}
	p := f.next
	f.next += (n + 4096 + 255) &^ 255 // a gap between allocations
	f.mem[p] = make([]byte, n)
	return p, nil
}

func (f *fakeDriver) memFree(p uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
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
	b := make([]byte, n)
	f.host[&b[0]] = true
	return b, nil
}

func (f *fakeDriver) memFreeHost(b []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.host[&b[0]] {
		return f.errLocked("cuMemFreeHost", cuErrorInvalidValue)
	}
	delete(f.host, &b[0])
	return nil
}

func (f *fakeDriver) memcpyHtoDAsync(dst uint64, src []byte, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	// The source is read when the copy runs, as DMA from pinned memory is.
	return f.queueLocked("cuMemcpyHtoDAsync_v2", s, fakeOp{run: func() int {
		d := f.spanLocked(dst, uint64(len(src)))
		if d == nil {
			return 700
		}
		copy(d, src)
		return 0
	}})
}

func (f *fakeDriver) syncCopyLocked(call string, s uintptr, run func() int) error {
	if err := f.queueLocked(call, s, fakeOp{run: run}); err != nil {
		return err
	}
	st := f.streams[s]
	return f.errLocked("cuStreamSynchronize", f.runLocked(st, len(st.ops)))
}

func (f *fakeDriver) memcpyHtoDSync(dst uint64, src []byte, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.syncCopyLocked("cuMemcpyHtoDAsync_v2", s, func() int {
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
	return f.syncCopyLocked("cuMemcpyDtoHAsync_v2", s, func() int {
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

func (f *fakeDriver) moduleLoadData(image []byte) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.loadErr != 0 {
		return 0, f.errLocked("cuModuleLoadData", f.loadErr)
	}
	if len(image) == 0 {
		return 0, f.errLocked("cuModuleLoadData", 200)
	}
	return f.newHandleLocked(), nil
}

func (f *fakeDriver) moduleUnload(uintptr) error { return nil }

func (f *fakeDriver) moduleGetFunction(_ uintptr, name string) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if name != fillKernelName {
		return 0, f.errLocked("cuModuleGetFunction", 500)
	}
	return f.newHandleLocked(), nil
}

// launchFill emulates kvf_fill item by item.
func (f *fakeDriver) launchFill(fn uintptr, grid, block uint32, s uintptr, a fillArgs) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if fn == 0 || grid == 0 || block == 0 || block > 1024 || a.nregions == 0 {
		return f.errLocked("cuLaunchKernel", cuErrorInvalidValue)
	}
	return f.queueLocked("cuLaunchKernel", s, fakeOp{run: func() int {
		for k := uint64(0); k < a.nitems; k++ {
			i, r := k/uint64(a.nregions), k%uint64(a.nregions)
			pb := f.spanLocked(a.pages+4*i, 4)
			e := f.spanLocked(a.table+regionEntryBytes*r, regionEntryBytes)
			if pb == nil || e == nil {
				return 700
			}
			p := binary.LittleEndian.Uint32(pb)
			base := binary.LittleEndian.Uint64(e[0:])
			stride := binary.LittleEndian.Uint64(e[8:])
			words := binary.LittleEndian.Uint64(e[16:])
			page := f.spanLocked(base+uint64(p)*stride, 4*words)
			if page == nil {
				return 700
			}
			putWords(page, (a.word^p*a.salt)&^a.clear)
		}
		return 0
	}})
}

func (f *fakeDriver) streamCreate(uint32) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuStreamCreate"); err != nil {
		return 0, err
	}
	h := f.newHandleLocked()
	f.streams[h] = &fakeStream{}
	return h, nil
}

func (f *fakeDriver) streamDestroy(s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := f.streamLocked(s)
	if err != nil {
		return err
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
	if e.stream == nil { // never recorded: nothing to wait for
		return f.enterLocked("cuStreamWaitEvent")
	}
	snap := *e // the wait captures the event's most recent record
	return f.queueLocked("cuStreamWaitEvent", s, fakeOp{wait: &snap})
}

func (f *fakeDriver) eventCreate(uint32) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuEventCreate"); err != nil {
		return 0, err
	}
	h := f.newHandleLocked()
	f.events[h] = &fakeEvent{}
	return h, nil
}

func (f *fakeDriver) eventRecord(ev, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuEventRecord"); err != nil {
		return err
	}
	e, ok := f.events[ev]
	st, ok2 := f.streams[s]
	if !ok || !ok2 {
		return f.errLocked("cuEventRecord", cuErrorInvalidHandle)
	}
	*e = fakeEvent{stream: st, upTo: len(st.ops)}
	return nil
}

func (f *fakeDriver) eventQuery(ev uintptr) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enterLocked("cuEventQuery"); err != nil {
		return false, err
	}
	e, ok := f.events[ev]
	if !ok {
		return false, f.errLocked("cuEventQuery", cuErrorInvalidHandle)
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
	defer f.mu.Unlock()
	if err := f.enterLocked("cuEventSynchronize"); err != nil {
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

// leaks describes resources still held, for tests that Close.
func (f *fakeDriver) leaks() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.mem) == 0 && len(f.host) == 0 && len(f.events) == 0 && len(f.streams) == 0 && f.retained == 0 && f.ctxDepth == 0 {
		return ""
	}
	return fmt.Sprintf("%d device allocations, %d host buffers, %d events, %d streams, %d context retains, context depth %d",
		len(f.mem), len(f.host), len(f.events), len(f.streams), f.retained, f.ctxDepth)
}
