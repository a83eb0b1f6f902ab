//go:build cgo && ucx

package ucxx

/*
#cgo LDFLAGS: -lucp -lucs
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"encoding/binary"
	"fmt"
	"os"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/kvfence/kvfence/handoff"
)

// This file and shim.c are the package's cgo: a UCX context (ucxContext)
// and its workers, the progress loop that drives each, and the
// operations the connections post on them. Everything above (conn.go,
// client.go, server.go) is Go.
//
// A Transport or a Server owns a context: UCX's configuration, its
// transports and the memory registrations. Each connection has a worker
// of its own, for as long as it lives, and ends with it:
//
//   - A connection that ends as the protocol says (every operation
//     completed, the endpoint flushed and closed) gives its worker back
//     to the context, which keeps a few idle for the next connections
//     (a worker takes 1-4 ms of CPU to make and 1-2 to destroy).
//   - A connection that fails (its peer gone, a timeout, a cut, Close)
//     destroys its worker at once, and with it every operation still in
//     flight: once ucp_worker_destroy has returned, UCX reads and writes
//     no memory for them (the pages a sender lent to its puts, the pages
//     a receiver exposed), whatever the peer still sends. UCX 1.13 gives
//     an endpoint in error mode NONE (shim.c's kvf_connect says why
//     ucxx's are) no other end: it refuses a forced close, and a close
//     that flushes waits for a peer that may never answer.
//
// Every UCX call on a worker is made with w.mu held (the worker is
// UCS_THREAD_MODE_SERIALIZED), by the goroutine that posts an operation
// or by the progress loop. UCX's callbacks only queue events (shim.c);
// the loop drains the queue after each progress, under w.mu, and hands
// each event to whoever waits for it: an operation's completion, a
// connection's message or failure. Those handlers run with w.mu held:
// they do little (close a channel, queue a message, post a small send,
// destroy the worker) and never block.

// available is nil: this build has UCX.
var available error

// ucsError is a UCX status as an error.
type ucsError C.ucs_status_t

func (e ucsError) Error() string { return C.GoString(C.ucs_status_string(C.ucs_status_t(e))) }

func statusErr(st C.ucs_status_t) error {
	if st == C.UCS_OK {
		return nil
	}
	return ucsError(st)
}

// ucxContext is a UCX context and the workers idle on it.
type ucxContext struct {
	c *C.kvf_context

	mu struct {
		sync.Mutex
		idle   []*worker // workers whose connection ended cleanly, ready for another
		holds  int       // workers not yet destroyed, idle or not, and memory still mapped
		closed bool

		made, destroyed int // workers, for tests (export_test.go)
	}
	drained chan struct{} // closed once closed and nothing holds the context
}

// maxIdleWorkers bounds the workers a context keeps for the next
// connections.
const maxIdleWorkers = 4

// openContext creates a context from UCX's environment (UCX_TLS,
// UCX_NET_DEVICES, ...), and a worker on it for the first connection: a
// configuration UCX cannot serve fails here, and the first transfer does
// not pay for the worker.
func openContext() (*ucxContext, error) {
	var c *C.kvf_context
	if st := C.kvf_context_open(&c); st != C.UCS_OK {
		return nil, fmt.Errorf("%w: ucxx: UCX context: %w", handoff.ErrTransport, statusErr(st))
	}
	x := &ucxContext{c: c, drained: make(chan struct{})}
	w, err := x.worker()
	if err != nil {
		x.close()
		return nil, err
	}
	x.release(w)
	return x, nil
}

// worker returns an idle worker, or a new one.
func (x *ucxContext) worker() (*worker, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.mu.closed {
		return nil, errWorkerClosed
	}
	if n := len(x.mu.idle); n > 0 {
		w := x.mu.idle[n-1]
		x.mu.idle = x.mu.idle[:n-1]
		return w, nil
	}
	w, err := openWorker(x)
	if err != nil {
		return nil, err
	}
	x.mu.holds++
	x.mu.made++
	return w, nil
}

// hold keeps the context from being destroyed until unhold: memory
// mapped on it is unmapped on it.
func (x *ucxContext) hold() error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.mu.closed {
		return errWorkerClosed
	}
	x.mu.holds++
	return nil
}

// release takes back a worker whose connection ended cleanly: no
// operation of it is in flight, and its endpoint is closed. It is kept
// for the next connection, or destroyed.
func (x *ucxContext) release(w *worker) {
	x.mu.Lock()
	if !x.mu.closed && len(x.mu.idle) < maxIdleWorkers {
		x.mu.idle = append(x.mu.idle, w)
		x.mu.Unlock()
		return
	}
	x.mu.Unlock()
	w.close()
}

// unhold undoes a hold.
func (x *ucxContext) unhold() {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.unholdLocked()
}

// destroyed accounts for a worker that has been destroyed, and undoes
// its hold.
func (x *ucxContext) destroyed() {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.mu.destroyed++
	x.unholdLocked()
}

func (x *ucxContext) unholdLocked() {
	if x.mu.holds--; x.mu.holds == 0 && x.mu.closed {
		close(x.drained)
	}
}

// close destroys the idle workers, waits for the others to be destroyed
// and for the memory mapped on the context to be unmapped (their
// connections end first: the Transport's and Server's Close see to
// that), and then destroys the context.
func (x *ucxContext) close() {
	x.mu.Lock()
	if x.mu.closed {
		x.mu.Unlock()
		<-x.drained
		return
	}
	x.mu.closed = true
	idle := x.mu.idle
	x.mu.idle = nil
	if x.mu.holds == 0 {
		close(x.drained)
	}
	x.mu.Unlock()
	for _, w := range idle {
		w.close()
	}
	<-x.drained
	C.kvf_context_close(x.c)
}

// worker is a UCX worker and the loop that progresses it, serving one
// connection at a time.
type worker struct {
	x       *ucxContext
	mu      sync.Mutex
	w       *C.kvf_worker // nil once destroyed
	file    *os.File      // a duplicate of the worker's event fd, in Go's poller
	address []byte        // the worker's address, which peers connect to

	// Guarded by mu.
	ops      map[uint64]func(error) // posted operations' completions by token
	byEP     map[C.ucp_ep_h]*conn   // connections by their endpoint (its failures)
	byID     map[uint64]*conn       // and by their ID (the messages for them)
	token    uint64
	sleeping bool // the loop waits for the event fd: a new operation signals it
	closed   bool // destroyed
	// polls: while operations are in flight, the worker is progressed
	// without waiting for its event fd, by the goroutines that wait for
	// them (drive) and by the loop on a timer, for some transport of its
	// connection (shared memory) moves them in progress alone and never
	// signals. Over TCP alone the fd signals every move, and polling
	// would only spin: each progress an epoll_wait and a receive of
	// whatever bytes are in, where sleeping until more is in costs
	// none. True until the connection's lanes say otherwise
	// (conn.learnLanesLocked).
	polls bool
	// landed, if set, is called after each progress that did something,
	// on the goroutine that progressed: the exposed memory's watch
	// (serverEnd.WatchLanding), which sums the blocks UCX copied or
	// received into it while they are in that core's cache.
	landed func()

	loopDone chan struct{}
}

// openWorker creates a worker of x and starts its progress loop.
func openWorker(x *ucxContext) (*worker, error) {
	var cw *C.kvf_worker
	if st := C.kvf_worker_open(x.c, &cw); st != C.UCS_OK {
		return nil, fmt.Errorf("%w: ucxx: UCX worker: %w", handoff.ErrTransport, statusErr(st))
	}
	fd, err := syscall.Dup(int(cw.efd))
	if err == nil {
		err = syscall.SetNonblock(fd, true)
	}
	if err != nil {
		C.kvf_worker_close(cw)
		return nil, fmt.Errorf("%w: ucxx: the worker's event fd: %w", handoff.ErrTransport, err)
	}
	var addr unsafe.Pointer
	var addrLen C.size_t
	if st := C.kvf_address(cw, &addr, &addrLen); st != C.UCS_OK {
		syscall.Close(fd)
		C.kvf_worker_close(cw)
		return nil, fmt.Errorf("%w: ucxx: the worker's address: %w", handoff.ErrTransport, statusErr(st))
	}
	address := C.GoBytes(addr, C.int(addrLen))
	C.free(addr)
	w := &worker{x: x, w: cw, file: os.NewFile(uintptr(fd), "ucx-worker"), address: address,
		ops: make(map[uint64]func(error)), byEP: make(map[C.ucp_ep_h]*conn), byID: make(map[uint64]*conn),
		polls: true, loopDone: make(chan struct{})}
	go w.loop()
	return w, nil
}

// loop progresses the worker until close: whenever UCX has work
// (progress returns something; arm says busy, for a while: busyRounds)
// it goes round again, otherwise it waits in Go's poller for the event
// fd.
//
// RawConn.Read resets the poller's readiness before it calls f, and
// parks only when f returns false: so the worker is armed inside f, and
// an event that arrives after the arm wakes the wait that follows.
//
// Not every transport signals the event fd as an operation moves (shared
// memory's copies and sends do not: they advance in progress alone), so
// while operations are in flight the loop does not wait for the fd
// alone: a timer wakes it after a while (backoff, from 50 µs, doubling
// to 1 ms while nothing moves). Most of that work is done by the
// goroutines that wait for their operations, which progress the worker
// themselves while it moves (drive), rather than by the loop, which
// would have to spin.
func (w *worker) loop() {
	defer close(w.loopDone)
	defer w.file.Close()
	rc, err := w.file.SyscallConn()
	if err != nil {
		return
	}
	var backoff time.Duration
	busy := 0 // rounds in a row that UCX said busy and progress did nothing
	nudge := time.AfterFunc(time.Hour, w.signal)
	nudge.Stop()
	defer nudge.Stop()
	for {
		stop := false
		err := rc.Read(func(uintptr) bool {
			w.mu.Lock()
			defer w.mu.Unlock()
			w.sleeping = false
			if w.closed {
				stop = true
				return true
			}
			if w.progressLocked() {
				backoff, busy = 0, 0
				return true // more may follow at once
			}
			armed := C.ucp_worker_arm(w.w.worker) == C.UCS_OK
			if armed {
				busy = 0
			} else if busy++; busy < busyRounds {
				runtime.Gosched()
				return true
			}
			w.sleeping = true
			if !armed || w.polls && len(w.ops) > 0 {
				backoff = min(max(2*backoff, 50*time.Microsecond), time.Millisecond)
				nudge.Reset(backoff)
			}
			return false
		})
		if err != nil || stop {
			return
		}
	}
}

// busyRounds is how many rounds in a row the loop goes round again, each
// after a yield, when UCX says it cannot sleep (ucp_worker_arm: busy:
// shared memory says so while a sender is midway through a write into
// its receive queue, or a signal of one is pending) and yet progress
// finds nothing to do; then it waits on the timer, as when operations are
// in flight. Going round at once without end held a core that the sender,
// on a machine of few cores, needed to finish: the process's CPU time
// then equalled the handoff's.
const busyRounds = 64

// progressLocked progresses the worker until it has nothing to do and
// hands out the events, and reports whether anything happened.
func (w *worker) progressLocked() bool {
	n := 0
	for C.ucp_worker_progress(w.w.worker) != 0 {
		n++
		if w.landed != nil {
			w.landed()
		}
	}
	return w.dispatchLocked() || n > 0
}

// drive progresses the worker from the calling goroutine, which is about
// to wait for done, for as long as that makes something happen: a
// transfer's copies (shared memory's) and sends run on the goroutine that
// waits for them instead of on the loop's.
//
// It takes the worker's lock round by round, so that other goroutines
// post their operations in between.
func (w *worker) drive(done <-chan struct{}) {
	for idle := 0; idle < driveIdle; {
		select {
		case <-done:
			return
		default:
		}
		w.mu.Lock()
		if w.closed || !w.polls {
			w.mu.Unlock()
			return
		}
		if w.progressLocked() {
			idle = 0
		} else {
			idle++
		}
		w.mu.Unlock()
	}
}

// driveIdle is how many rounds of progress in a row that do nothing
// drive takes before it leaves the rest to the loop.
const driveIdle = 32

// signal wakes the loop (from a timer).
func (w *worker) signal() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed && w.sleeping {
		C.ucp_worker_signal(w.w.worker)
	}
}

// wakeLocked has the loop look at the worker again, after an operation
// was posted that progress must drive.
func (w *worker) wakeLocked() {
	if w.sleeping && !w.closed {
		w.sleeping = false
		C.ucp_worker_signal(w.w.worker)
	}
}

// dispatchLocked hands the queued events to their handlers, and
// reports whether there were any.
func (w *worker) dispatchLocked() bool {
	var evs *C.kvf_event
	var n C.size_t
	C.kvf_events(w.w, &evs, &n)
	if n == 0 {
		return false
	}
	defer C.free(unsafe.Pointer(evs))
	for _, ev := range unsafe.Slice(evs, int(n)) {
		if w.closed {
			// A handler destroyed the worker: what follows concerns
			// nobody (its operations have ended), and a rendezvous
			// descriptor went with the worker.
			if ev.kind == C.KVF_EV_AM && ev.rndv == 0 {
				C.free(ev.data)
			}
			continue
		}
		switch ev.kind {
		case C.KVF_EV_DONE:
			if done, ok := w.ops[uint64(ev.token)]; ok {
				delete(w.ops, uint64(ev.token))
				done(statusErr(C.ucs_status_t(ev.status)))
			}
		case C.KVF_EV_EPERR:
			if c := w.byEP[C.ucp_ep_h(ev.data)]; c != nil {
				c.failLocked(fmt.Errorf("%w: ucxx: connection failed: %w", handoff.ErrTransport, statusErr(C.ucs_status_t(ev.status))))
			}
		case C.KVF_EV_AM:
			w.messageLocked(&ev)
		}
	}
	if !w.closed && w.w.overflow != 0 {
		// An event was lost for want of memory: nothing it concerned can
		// be trusted to end, so every connection fails now.
		w.w.overflow = 0
		for _, c := range w.byEP {
			c.failLocked(fmt.Errorf("%w: ucxx: out of memory for UCX's events", handoff.ErrTransport))
		}
	}
	return true
}

// messageLocked gives an active message to the connection its header
// names, or drops it: a message for no connection of this worker's (one
// that has ended, or a peer that is not ucxx) has nobody to tell.
//
// ucxx sends every message eagerly (shim.c): one that would have to be
// fetched (a rendezvous) is not a ucxx peer's, and fails its connection.
// Writes into a receiver's exposed memory (a longer header) are the
// exception: they go to the connection's writeArrivedLocked.
func (w *worker) messageLocked(ev *C.kvf_event) {
	h := C.GoBytes(unsafe.Pointer(&ev.header[0]), C.int(ev.header_len))
	var c *conn
	if (len(h) == headerLen || len(h) == writeHeaderLen) && string(h[:4]) == magic {
		c = w.byID[binary.LittleEndian.Uint64(h[8:])]
	}
	if c != nil && len(h) == writeHeaderLen {
		c.writeArrivedLocked(h, ev)
		return
	}
	var m inMessage
	if ev.rndv != 0 {
		C.ucp_am_data_release(w.w.worker, ev.data)
	} else if ev.data != nil {
		m.data = C.GoBytes(ev.data, C.int(ev.len))
		C.free(ev.data)
	}
	switch {
	case c == nil:
	case ev.rndv != 0:
		c.failLocked(fmt.Errorf("%w: ucxx: a message of %d bytes sent by rendezvous, which ucxx does not", ErrHandshake, ev.len))
	default:
		c.arrivedLocked(h, m)
	}
}

// postLocked registers done for the operation that post posts with the
// token it is given, and returns post's result: done runs with w.mu
// held, once, when the operation ends, unless post fails or completes at
// once (then the caller has the result and done never runs).
func (w *worker) postLocked(post func(token C.uint64_t) C.ucs_status_t, done func(error)) (inProgress bool, err error) {
	if w.closed {
		return false, errWorkerClosed
	}
	w.token++
	tok := w.token
	switch st := post(C.uint64_t(tok)); st {
	case C.UCS_OK:
		return false, nil
	case C.UCS_INPROGRESS:
		w.ops[tok] = done
		w.wakeLocked()
		return true, nil
	default:
		return false, statusErr(st)
	}
}

// errWorkerClosed is what operations posted on a closed worker get.
var errWorkerClosed = fmt.Errorf("%w: ucxx: closed", handoff.ErrTransport)

// pending waits for the operations of one call: each op posted adds one,
// each completion takes it back, and wait returns the first error once
// none is left. Its methods other than wait run with w.mu held.
type pending struct {
	n    int
	err  error
	done chan struct{}
	pin  runtime.Pinner // Go memory UCX reads or writes until the ops end
}

func newPending() *pending { return &pending{done: make(chan struct{})} }

// add accounts for one more posted operation's outcome.
func (p *pending) add(inProgress bool, err error) {
	if err != nil && p.err == nil {
		p.err = err
	}
	if inProgress {
		p.n++
	}
}

// complete is an operation's completion (postLocked's done).
func (p *pending) complete(err error) {
	if err != nil && p.err == nil {
		p.err = err
	}
	p.n--
	if p.n == 0 {
		p.pin.Unpin()
		close(p.done)
	}
}

// seal is called once every operation is posted: if none is in progress,
// the wait is over.
func (p *pending) seal() {
	if p.n == 0 {
		p.pin.Unpin()
		close(p.done)
	}
}

// destroyLocked destroys the worker: every operation still in flight
// ends (with errAbandoned) and UCX touches no memory for any of them
// from now on. Its loop stops at its next round; destroyLocked does not
// wait for it, so the loop itself may call it (a connection that fails
// in a message's handler).
func (w *worker) destroyLocked() {
	if w.closed {
		return
	}
	w.closed = true
	C.kvf_worker_close(w.w)
	w.w = nil
	// The loop, which owns the file, closes it as it ends: a Close here
	// would wait for the loop's read, whose callback waits for w.mu.
	w.file.SetReadDeadline(time.Unix(1, 0)) // ends the loop's wait, if it waits
	for tok, done := range w.ops {
		delete(w.ops, tok)
		done(errAbandoned)
	}
	w.x.destroyed()
}

// close destroys the worker and waits for its loop to end; not from the
// loop.
func (w *worker) close() {
	w.mu.Lock()
	w.destroyLocked()
	w.mu.Unlock()
	<-w.loopDone
}
