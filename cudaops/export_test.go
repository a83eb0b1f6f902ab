package cudaops

import "fmt"

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
	return f.ctxDepth
}

// TestEngine stands for an engine's stream on the device's own driver (the
// real one or the fake): it queues memsets on a stream of its own, each
// behind a large scratch memset so that on a GPU the write is still pending
// when a fill is queued after it.
type TestEngine struct {
	d            *CUDA
	stream, ev   uintptr
	scratch      uint64
	scratchWords uint64
}

// NewTestEngine creates the engine stream, its event and a scratch buffer.
func (d *CUDA) NewTestEngine(scratchBytes uint64) (*TestEngine, error) {
	if err := d.enter(); err != nil {
		return nil, err
	}
	defer d.leave()
	e := &TestEngine{d: d, scratchWords: scratchBytes / 4}
	var err error
	if e.stream, err = d.drv.streamCreate(cuStreamNonBlocking); err != nil {
		return nil, err
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

// Write queues a write of word over page p of region r and returns the
// ordering that names it.
func (e *TestEngine) Write(r int, p int32, word uint32) (Ordering, error) {
	reg := e.d.Regions()[r]
	if err := e.d.enter(); err != nil {
		return Ordering{}, err
	}
	defer e.d.leave()
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
	return Ordering{Stream: e.stream, Event: e.ev}, nil
}

// Sync waits for the engine's stream.
func (e *TestEngine) Sync() error {
	if err := e.d.enter(); err != nil {
		return err
	}
	defer e.d.leave()
	return e.d.drv.streamSynchronize(e.stream)
}

// Close frees the engine's resources; call it before the device's Close.
func (e *TestEngine) Close() {
	if e.d.enter() != nil {
		return
	}
	defer e.d.leave()
	_ = e.d.drv.streamSynchronize(e.stream)
	if e.scratch != 0 {
		_ = e.d.drv.memFree(e.scratch)
	}
	_ = e.d.drv.eventDestroy(e.ev)
	_ = e.d.drv.streamDestroy(e.stream)
}

// MemsetBaseline queues one cuMemsetD32Async of words words at addr on the
// device's stream and returns its fence: the benchmark's baseline.
func (d *CUDA) MemsetBaseline(addr uint64, word uint32, words uint64) (Fence, error) {
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(); err != nil {
		return nil, err
	}
	defer d.leave()
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
	f := &cudaFence{d: d}
	f.mu.ev = ev
	return f, nil
}

// DriverCalls says whether d runs on the simulated driver.
func (d *CUDA) Simulated() bool {
	_, ok := d.drv.(*fakeDriver)
	return ok
}

// Scratch allocates n bytes of device memory outside the region table and
// returns its address and a function that frees it.
func (d *CUDA) Scratch(n uint64) (uint64, func(), error) {
	if err := d.enter(); err != nil {
		return 0, nil, err
	}
	defer d.leave()
	p, err := d.drv.memAlloc(n)
	if err != nil {
		return 0, nil, fmt.Errorf("%w: %w", ErrOutOfMemory, err)
	}
	return p, func() {
		if d.enter() == nil {
			_ = d.drv.memFree(p)
			d.leave()
		}
	}, nil
}
