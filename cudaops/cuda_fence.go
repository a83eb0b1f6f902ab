package cudaops

import (
	"fmt"
	"sync"
)

// Events and fences. A fill waits for the engine's work through an event
// (the engine's own, or one recorded on its stream) and ends with an event
// of its own, which is the Fence the pool waits on before it reuses the
// pages. Events come from a per-device pool, since creating one per fill
// would cost a driver call on the hot path.

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
