package cudaops

import (
	"fmt"
	"sync"
)

// Events, ordering and fences. A fill waits for the engine's work through
// an event (the engine's own, or one recorded on its stream) or, for a
// zero Ordering, by synchronising the context before it is queued; it
// ends with an event of its own, which the device's reaper waits for
// before it completes the Fence the pool waits on. Events come from a
// per-device pool, since creating one per fill would cost a driver call
// on the hot path; an event whose wait failed does not go back to it.

// CheckOrdering implements OrderingChecker: it reports, without queuing
// anything, why after cannot order a fill on this device, as an error
// wrapping ErrBadOrdering; nil if it can. See the type's documentation.
func (d *CUDA) CheckOrdering(after Ordering) error {
	if after.IsZero() {
		return nil
	}
	d.life.RLock()
	defer d.life.RUnlock()
	if d.closed {
		return ErrClosed
	}
	g, err := d.enter()
	if err != nil {
		return err
	}
	defer g.leave()
	return d.checkOrderingEntered(after)
}

// checkOrderingEntered is CheckOrdering with the context current.
func (d *CUDA) checkOrderingEntered(after Ordering) error {
	if s := after.Stream; s != 0 {
		ctx, err := d.drv.streamGetCtx(s)
		if err != nil {
			return badOrdering("stream %#x: %w", s, err)
		}
		if ctx != d.ctx {
			return badOrdering("stream %#x belongs to CUDA context %#x, %s works in %#x (open the device with OpenCUDAContext of the engine's context)",
				s, ctx, d.name, d.ctx)
		}
		status, err := d.drv.streamIsCapturing(s)
		switch {
		case err != nil && driverCode(err) == cuErrorCaptureImplicit:
			return badOrdering("stream %#x is the legacy default stream while a blocking stream captures a CUDA graph: %w", s, err)
		case err != nil:
			return badOrdering("stream %#x: %w", s, err)
		case status != cuCaptureStatusNone:
			return badOrdering("stream %#x is capturing a CUDA graph (status %d): kvfence will not add its fill to the engine's graph; release after the capture ends", s, status)
		}
	}
	if ev := after.Event; ev != 0 {
		if _, err := d.drv.eventQuery(ev); err != nil {
			if driverCode(err) == cuErrorCapturedEvent {
				return badOrdering("event %#x was recorded inside a CUDA graph capture: %w", ev, err)
			}
			return badOrdering("event %#x: %w", ev, err)
		}
	}
	return nil
}

// badOrdering is an Ordering the device cannot use: ErrBadOrdering, also
// wrapping ErrInvalidArgument (the caller's mistake).
func badOrdering(format string, args ...any) error {
	return fmt.Errorf("%w (%w): "+format, append([]any{ErrBadOrdering, ErrInvalidArgument}, args...)...)
}

// orderAfterLocked makes the device's stream wait for the engine's work
// named by a non-zero after. A handle the driver rejects now is the
// caller's mistake (ErrBadOrdering); a failure of the driver is
// ErrDriver.
func (d *CUDA) orderAfterLocked(after Ordering) error {
	wrap := func(what string, err error) error {
		switch driverCode(err) {
		case cuErrorInvalidHandle, cuErrorInvalidValue, cuErrorInvalidContext, cuErrorCaptureIsolation,
			cuErrorCaptureImplicit, cuErrorCapturedEvent, cuErrorCaptureUnsupp, cuErrorCaptureInvalid:
			return badOrdering("%s: %w", what, err)
		}
		return fmt.Errorf("%w: ordering %s: %w", ErrDriver, what, err)
	}
	if err := d.checkOrderingEntered(after); err != nil {
		return err
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

// syncContext is the zero Ordering: everything queued in the context
// before the call, on any stream, has completed when it returns. It runs
// on the caller's thread with no device lock held.
func (d *CUDA) syncContext() error {
	d.contextSyncs.Add(1)
	if err := d.drv.ctxSynchronize(); err != nil {
		switch driverCode(err) {
		case cuErrorCaptureUnsupp, cuErrorCaptureInvalid, cuErrorCaptureImplicit:
			return badOrdering("a zero Ordering synchronises the context, which a CUDA graph capture in progress forbids; name the engine's stream: %w", err)
		}
		return fmt.Errorf("%w: ordering after all work of the context: %w", ErrDriver, err)
	}
	return nil
}

// getEvent returns an event for a fence, from the pool or new: blocking
// sync (the reaper's wait sleeps) and no timing.
func (d *CUDA) getEvent() (uintptr, error) {
	d.events.Lock()
	defer d.events.Unlock()
	if n := len(d.events.free); n > 0 {
		ev := d.events.free[n-1]
		d.events.free = d.events.free[:n-1]
		return ev, nil
	}
	ev, err := d.drv.eventCreate(cuEventDisableTiming | cuEventBlockingSync)
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

// cudaFence is one Fill's completion, decided by the reaper. Done and Wait
// only read what the reaper recorded: no driver call, no OS thread.
type cudaFence struct {
	ev       uintptr
	ringGen  uint64 // the staging ring the fill's page list is in
	ringEnd  uint64 // ring position after it: freed when the fence completes without error
	finished chan struct{}
	err      error // written before finished is closed
}

func newFence(ev uintptr) *cudaFence {
	return &cudaFence{ev: ev, finished: make(chan struct{})}
}

// Done implements Fence without blocking.
func (f *cudaFence) Done() (bool, error) {
	select {
	case <-f.finished:
		return true, f.err
	default:
		return false, nil
	}
}

// Wait implements Fence.
func (f *cudaFence) Wait() error {
	<-f.finished
	return f.err
}

// reaper is the one goroutine per device that waits for fence events, in
// the order the fills were queued on the device's stream, which is the
// order they complete in.
type reaper struct {
	mu       sync.Mutex
	wake     *sync.Cond
	queue    []*cudaFence
	stopping bool
	stopErr  error // set when Close could not drain the stream
	exited   chan struct{}
}

func (r *reaper) start(d *CUDA) {
	r.wake = sync.NewCond(&r.mu)
	r.exited = make(chan struct{})
	go r.run(d)
}

// track hands a fence whose event has been recorded to the reaper.
func (r *reaper) track(f *cudaFence) {
	r.mu.Lock()
	r.queue = append(r.queue, f)
	r.wake.Signal()
	r.mu.Unlock()
}

// pending is how many fences the reaper has not completed yet.
func (r *reaper) pending() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.queue)
}

// stop completes the fences still queued (with err, if not nil, else by
// waiting for them) and waits for the reaper to exit.
func (r *reaper) stop(err error) {
	if r.exited == nil {
		return
	}
	r.mu.Lock()
	r.stopping, r.stopErr = true, err
	r.wake.Signal()
	r.mu.Unlock()
	<-r.exited
}

func (r *reaper) run(d *CUDA) {
	defer close(r.exited)
	for {
		r.mu.Lock()
		for len(r.queue) == 0 && !r.stopping {
			r.wake.Wait()
		}
		if len(r.queue) == 0 {
			r.mu.Unlock()
			return
		}
		f, stopErr := r.queue[0], r.stopErr
		r.mu.Unlock()

		err := stopErr
		if err == nil {
			err = d.waitEvent(f.ev)
		}
		d.complete(f, err)

		r.mu.Lock()
		r.queue[0] = nil
		r.queue = r.queue[1:]
		r.mu.Unlock()
	}
}

// waitEvent blocks, sleeping, until ev has completed.
func (d *CUDA) waitEvent(ev uintptr) error {
	g, err := d.enter()
	if err != nil {
		return err
	}
	defer g.leave()
	if err := d.drv.eventSynchronize(ev); err != nil {
		return fmt.Errorf("%w: fill: %w", ErrDriver, err)
	}
	return nil
}

// complete records f's outcome and, when its wait succeeded, recycles its
// event and frees the staging ring up to its slot's end: its fill and,
// the stream being in order, every fill queued before it have run. A
// failed wait says nothing about the fill's work, whose queued copy may
// still read its slot: the slot stays held until a later fence completes
// without error or the stream is drained (see fill). Its event is not
// recycled either: the driver may have failed because of the event
// itself, and a handle in an unknown state must not end the next fill;
// it stays in events.all and is destroyed at Close.
func (d *CUDA) complete(f *cudaFence, err error) {
	if err == nil {
		d.putEvent(f.ev)
	}
	d.mu.Lock()
	if f.ringGen == d.mu.ring.gen {
		d.mu.ring.inFlight--
		if err == nil && f.ringEnd > d.mu.ring.tail {
			d.mu.ring.tail = f.ringEnd
		}
	}
	d.mu.ringFreed.Broadcast()
	d.mu.Unlock()
	f.err = err
	close(f.finished)
}
