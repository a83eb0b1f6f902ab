//go:build cgo && ucx

package ucxx

/*
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"time"
	"unsafe"

	"github.com/kvfence/kvfence/handoff"
)

// conn is one transfer's connection, either end: a UCX endpoint to the
// peer's worker for the messages and the writes, and the TCP connection
// the two ends met over, which stays open as long as the transfer does,
// so that either end learns at once when the other's process is gone.
// Its state is guarded by the worker's lock, under which the progress
// loop delivers its messages and failure; the goroutine that uses it
// waits on its channels.
type conn struct {
	w    *worker
	id   uint64 // the peer addresses its messages to this connection with it
	peer uint64 // and this end its messages to the peer's with this
	ctrl net.Conn
	ep   C.ucp_ep_h
	max  int // Options.MaxMessageBytes

	// Guarded by w.mu.
	inbox      []inMessage
	queued     int   // bytes of eager messages in inbox
	err        error // the connection failed; every later call fails with it
	ended      bool  // the peer's end of messages has been read
	peerEnded  bool  // the peer's end of messages has arrived: it reads nothing more
	closed     bool
	revoked    bool                // on the sender's end: the receiver has taken its memory back
	onRevoke   func()              // on the sender's end: the receiver takes its memory back
	revokeAcks chan struct{}       // on the receiver's end: closed when the sender has stopped writing
	ops        map[uint64]struct{} // the endpoint's operations in flight, by token
	credits    int                 // on the sender's end: messages it may send now
	credit     bool                // on the receiver's end: it answers each message read with a credit

	arrived  chan struct{} // a message arrived, or the state changed (capacity 1)
	credited chan struct{} // a credit arrived (capacity 1)
	failed   chan struct{} // closed with err
}

// inMessage is a received message: its kind and bytes.
type inMessage struct {
	kind byte
	data []byte
}

// The message header (16 bytes): magic, version, kind, two zero bytes,
// and the ID of the connection it is for, at the receiving worker.
const (
	headerLen  = 16
	magic      = "KVFU"
	version    = 1
	kindMsg    = 'm' // a handoff message
	kindEnd    = 'e' // the end of this side's messages
	kindRevoke = 'r' // receiver → sender: stop writing my memory
	kindAck    = 'a' // sender → receiver: nothing of mine writes it any more
	kindCredit = 'c' // receiver → sender: one message read, send another
)

// window is how many messages a sender may have sent that its receiver
// has not read: messages go eagerly (shim.c), so without a bound a sender
// faster than its receiver would queue the whole prompt there. Each
// message the receiver reads earns the sender a credit back.
const window = 4

// putHeader writes the header of a message of kind to connection peer.
func putHeader(h []byte, kind byte, peer uint64) {
	copy(h, magic)
	h[4], h[5], h[6], h[7] = version, kind, 0, 0
	binary.LittleEndian.PutUint64(h[8:], peer)
}

// maxQueued bounds the messages a peer can queue at a connection before
// they are read: a sender sends at most window at a time, a receiver a
// few verdicts, a grant and its end. Their bytes are bounded too
// (conn.maxQueuedBytes): a peer cannot queue more than window messages
// of Options.MaxMessageBytes.
const maxQueued = 4 * window

// maxQueuedBytes bounds the bytes of the messages queued unread.
func (c *conn) maxQueuedBytes() int { return window*c.max + 1<<20 }

func newConn(w *worker, ctrl net.Conn, max int) *conn {
	return &conn{w: w, ctrl: ctrl, max: max, credits: window, ops: make(map[uint64]struct{}),
		arrived: make(chan struct{}, 1), credited: make(chan struct{}, 1), failed: make(chan struct{})}
}

// registerLocked gives c an ID of its own at its worker, so that the
// peer's messages reach it. IDs are random: a peer cannot address
// another transfer's connection by guessing.
func (c *conn) registerLocked() {
	for c.id == 0 || c.w.byID[c.id] != nil {
		var b [8]byte
		rand.Read(b[:])
		c.id = binary.LittleEndian.Uint64(b[:])
	}
	c.w.byID[c.id] = c
}

// connectLocked creates the endpoint to the peer's worker, whose address
// is addr, for its connection peer.
func (c *conn) connectLocked(addr []byte, peer uint64) error {
	if c.w.closed {
		return errWorkerClosed
	}
	ca := C.CBytes(addr)
	defer C.free(ca)
	var ep C.ucp_ep_h
	if st := C.kvf_connect(c.w.w, ca, &ep); st != C.UCS_OK {
		return fmt.Errorf("%w: ucxx: an endpoint to the peer's worker: %w", handoff.ErrTransport, statusErr(st))
	}
	c.ep, c.peer = ep, peer
	c.w.byEP[ep] = c
	c.w.wakeLocked()
	return nil
}

// watch reads the connection the two ends met over until it closes: the
// peer has ended the transfer, or its process is gone. What the peer
// sent before it closed may still be in UCX's queues: the worker is
// progressed first, so that it is delivered before the failure.
func (c *conn) watch() {
	io.Copy(io.Discard, c.ctrl)
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	if c.closed || c.w.closed {
		return
	}
	for C.ucp_worker_progress(c.w.w.worker) != 0 {
	}
	c.w.dispatchLocked()
	c.failLocked(fmt.Errorf("%w: ucxx: the peer closed the connection", handoff.ErrTransport))
}

func (c *conn) signal() {
	select {
	case c.arrived <- struct{}{}:
	default:
	}
}

// failLocked ends the connection with err (the first failure wins) and
// closes its endpoint: every operation on it completes, with an error,
// and every wait on it returns.
func (c *conn) failLocked(err error) {
	if c.err == nil {
		c.err = err
		close(c.failed)
		c.signal()
	}
	c.closeLocked()
}

// arrivedLocked takes a message from the peer.
func (c *conn) arrivedLocked(header []byte, m inMessage) {
	if c.closed || c.err != nil {
		return
	}
	if header[6] != 0 || header[7] != 0 {
		c.failLocked(fmt.Errorf("%w: ucxx: a message with header %q: not a ucxx peer", ErrHandshake, header))
		return
	}
	if header[4] != version {
		c.failLocked(fmt.Errorf("%w: ucxx: the peer speaks version %d, this end %d", ErrHandshake, header[4], version))
		return
	}
	m.kind = header[5]
	switch m.kind {
	case kindRevoke:
		if c.onRevoke != nil {
			c.onRevoke()
		}
		return
	case kindAck:
		if c.revokeAcks != nil {
			close(c.revokeAcks)
			c.revokeAcks = nil
		}
		return
	case kindCredit:
		if c.credits++; c.credits > window {
			c.failLocked(fmt.Errorf("%w: ucxx: the peer granted more credits than messages were sent", handoff.ErrProtocol))
			return
		}
		select {
		case c.credited <- struct{}{}:
		default:
		}
		return
	case kindMsg, kindEnd:
	default:
		c.failLocked(fmt.Errorf("%w: ucxx: a message of kind %q", handoff.ErrProtocol, m.kind))
		return
	}
	switch {
	case len(m.data) > c.max:
		c.failLocked(fmt.Errorf("%w: a message of %d bytes, more than the %d of Options.MaxMessageBytes", ErrMessageTooLarge, len(m.data), c.max))
		return
	case len(c.inbox) >= maxQueued || c.queued+len(m.data) > c.maxQueuedBytes():
		c.failLocked(fmt.Errorf("%w: ucxx: the peer sent %d messages (%d bytes) that were not read", handoff.ErrTransport, len(c.inbox), c.queued))
		return
	}
	if m.kind == kindEnd {
		c.peerEnded = true
	}
	c.queued += len(m.data)
	c.inbox = append(c.inbox, m)
	c.signal()
}

func isEOF(err error) bool { return err == io.EOF }

// errInterrupted is what a receive returns once the caller stopped
// waiting (the receiver's InterruptRecv).
var errInterrupted = fmt.Errorf("%w: ucxx: the receiver stopped waiting for the sender", handoff.ErrTransport)

// recv returns the peer's next message, which the caller keeps; io.EOF
// after the peer's end of messages. It waits at most timeout, and not
// past interrupt.
func (c *conn) recv(timeout time.Duration, interrupt <-chan struct{}) ([]byte, error) {
	var timer <-chan time.Time
	for {
		c.w.mu.Lock()
		if len(c.inbox) > 0 {
			m := c.inbox[0]
			c.inbox[0] = inMessage{}
			c.inbox = c.inbox[1:]
			c.queued -= len(m.data)
			if m.kind == kindEnd {
				c.ended = true
				c.w.mu.Unlock()
				return nil, io.EOF
			}
			if c.credit {
				c.postControlLocked(kindCredit)
			}
			c.w.mu.Unlock()
			return m.data, nil
		}
		if c.ended {
			c.w.mu.Unlock()
			return nil, io.EOF
		}
		if err := c.err; err != nil {
			c.w.mu.Unlock()
			return nil, err
		}
		c.w.mu.Unlock()
		if timer == nil {
			t := time.NewTimer(timeout)
			defer t.Stop()
			timer = t.C
		}
		select {
		case <-c.arrived:
		case <-interrupt:
			return nil, errInterrupted
		case <-timer:
			return nil, fmt.Errorf("%w: ucxx: no message from the peer in %v", handoff.ErrTransport, timeout)
		}
	}
}

// send sends one message of kind made of parts, and returns once UCX no
// longer reads them (or the connection failed): at most timeout, after
// which the connection is closed.
func (c *conn) send(kind byte, parts [][]byte, timeout time.Duration) error {
	if kind == kindMsg {
		if err := c.takeCredit(timeout); err != nil {
			return err
		}
	}
	n := 0
	for _, p := range parts {
		if len(p) > 0 {
			n++
		}
	}
	// The header and the iov array stay in C memory until the send ends.
	// Zeroed: storing a pointer into memory makes the garbage collector
	// look at the value it replaces, which must not be malloc's garbage.
	block := C.calloc(1, C.size_t(headerLen+n*int(unsafe.Sizeof(C.ucp_dt_iov_t{}))))
	if block == nil {
		return fmt.Errorf("%w: ucxx: out of memory", handoff.ErrTransport)
	}
	putHeader(unsafe.Slice((*byte)(block), headerLen), kind, c.peer)
	iov := unsafe.Slice((*C.ucp_dt_iov_t)(unsafe.Add(block, headerLen)), n)
	p := newPending()
	i := 0
	for _, part := range parts {
		if len(part) == 0 {
			continue
		}
		p.pin.Pin(&part[0])
		iov[i] = C.ucp_dt_iov_t{buffer: unsafe.Pointer(unsafe.SliceData(part)), length: C.size_t(len(part))}
		i++
	}
	c.w.mu.Lock()
	if err := c.err; err != nil {
		c.w.mu.Unlock()
		p.pin.Unpin()
		C.free(block)
		return err
	}
	p.add(c.postLocked(func(tok C.uint64_t) C.ucs_status_t {
		var iovp *C.ucp_dt_iov_t
		if n > 0 {
			iovp = &iov[0]
		}
		return C.kvf_am_send(c.w.w, c.ep, block, headerLen, iovp, C.size_t(n), tok)
	}, p.complete))
	p.seal()
	c.w.mu.Unlock()
	defer C.free(block)
	if !c.wait(p, timeout) {
		return fmt.Errorf("%w: ucxx: a message of %d parts not sent in %v", handoff.ErrTransport, len(parts), timeout)
	}
	if p.err != nil {
		return c.failure("sending", p.err)
	}
	return nil
}

// takeCredit waits, at most timeout, until the peer has read enough of
// this end's messages for one more to go, and takes the credit.
func (c *conn) takeCredit(timeout time.Duration) error {
	var timer <-chan time.Time
	for {
		c.w.mu.Lock()
		switch {
		case c.err != nil:
			err := c.err
			c.w.mu.Unlock()
			return err
		case c.credits > 0:
			c.credits--
			c.w.mu.Unlock()
			return nil
		}
		c.w.mu.Unlock()
		if timer == nil {
			t := time.NewTimer(timeout)
			defer t.Stop()
			timer = t.C
		}
		select {
		case <-c.credited:
		case <-c.failed:
		case <-timer:
			err := fmt.Errorf("%w: ucxx: the peer read none of %d messages in %v", handoff.ErrTransport, window, timeout)
			c.fail(err)
			return err
		}
	}
}

// postControlLocked sends a message of kind with no bytes (a credit, a
// revoke's acknowledgement); nothing waits for it on this side.
func (c *conn) postControlLocked(kind byte) {
	if c.closed {
		return
	}
	block := C.calloc(1, headerLen)
	if block == nil {
		c.failLocked(fmt.Errorf("%w: ucxx: out of memory", handoff.ErrTransport))
		return
	}
	putHeader(unsafe.Slice((*byte)(block), headerLen), kind, c.peer)
	inProgress, err := c.postLocked(func(tok C.uint64_t) C.ucs_status_t {
		return C.kvf_am_send(c.w.w, c.ep, block, headerLen, nil, 0, tok)
	}, func(error) { C.free(block) })
	if !inProgress {
		C.free(block)
	}
	if err != nil {
		c.failLocked(fmt.Errorf("%w: ucxx: sending a %q: %w", handoff.ErrTransport, kind, err))
	}
}

// wait waits for p's operations to end, at most timeout: then it fails
// the connection, which ends them, and waits for that. It reports
// whether they ended in time.
func (c *conn) wait(p *pending, timeout time.Duration) bool {
	c.w.drive(p.done)
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.done:
		return true
	case <-t.C:
		c.fail(fmt.Errorf("%w: ucxx: an operation did not end in %v", handoff.ErrTransport, timeout))
		<-p.done
		return false
	}
}

// failure is the error of an operation that failed with err: the
// connection's own failure when it has one (it says more), else err.
func (c *conn) failure(what string, err error) error {
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	if c.err != nil {
		return c.err
	}
	return fmt.Errorf("%w: ucxx: %s: %w", handoff.ErrTransport, what, err)
}

// fail is failLocked for a caller without the lock.
func (c *conn) fail(err error) {
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	c.failLocked(err)
}

// close closes the endpoint (force: outstanding operations are
// cancelled) and drops what it had queued.
func (c *conn) close() {
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	if c.err == nil {
		c.err = fmt.Errorf("%w: ucxx: connection closed", handoff.ErrTransport)
		close(c.failed)
		c.signal()
	}
	c.closeLocked()
}

func (c *conn) closeLocked() {
	if c.closed {
		return
	}
	c.closed = true // the messages that arrived stay to be read before the failure
	if c.revokeAcks != nil {
		close(c.revokeAcks)
		c.revokeAcks = nil
	}
	c.ctrl.Close() // ends watch
	delete(c.w.byID, c.id)
	if c.ep == nil {
		return
	}
	delete(c.w.byEP, c.ep)
	inProgress, _ := c.w.postLocked(func(tok C.uint64_t) C.ucs_status_t {
		return C.kvf_ep_close(c.w.w, c.ep, 1, tok)
	}, func(error) { c.abandonLocked() })
	if !inProgress {
		c.abandonLocked()
	}
}

// postLocked posts an operation on the connection's endpoint (see
// worker.postLocked), and keeps track of it until it ends.
func (c *conn) postLocked(post func(token C.uint64_t) C.ucs_status_t, done func(error)) (inProgress bool, err error) {
	var tok uint64
	inProgress, err = c.w.postLocked(func(t C.uint64_t) C.ucs_status_t {
		tok = uint64(t)
		return post(t)
	}, func(err error) {
		delete(c.ops, tok)
		done(err)
	})
	if inProgress {
		c.ops[tok] = struct{}{}
	}
	return inProgress, err
}

// errAbandoned ends the operations of an endpoint that has been closed.
var errAbandoned = fmt.Errorf("%w: ucxx: the connection was closed under the operation", handoff.ErrTransport)

// abandonLocked ends, with errAbandoned, the operations the endpoint's
// close did not end: UCX 1.13 cancels the operations it queues, but on
// an endpoint in error mode NONE (shim.c) it may never end others, such
// as a flush that waits on a peer that is gone. Nothing reads or writes
// their memory any more once the endpoint is closed; were UCX to end
// one later after all, its completion finds no one waiting (postLocked's
// token is gone) and is dropped.
func (c *conn) abandonLocked() {
	for tok := range c.ops {
		delete(c.ops, tok)
		if done, ok := c.w.ops[tok]; ok {
			delete(c.w.ops, tok)
			done(errAbandoned)
		}
	}
}

// closeGracefully closes a connection whose transfer has ended: it first
// flushes the endpoint (at most timeout), so that the messages it sent
// have reached the peer before the peer sees the connection close.
func (c *conn) closeGracefully(timeout time.Duration) {
	p := newPending()
	c.w.mu.Lock()
	if c.err == nil && c.ep != nil {
		p.add(c.postLocked(func(tok C.uint64_t) C.ucs_status_t { return C.kvf_flush(c.w.w, c.ep, tok) }, p.complete))
	}
	p.seal()
	c.w.mu.Unlock()
	c.wait(p, timeout)
	c.close()
}

// lanes describes the transports the connection's endpoint uses
// (ucp_ep_print_info), for tests and benchmarks to report.
func (c *conn) lanes() string {
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	if c.closed || c.ep == nil {
		return ""
	}
	info := C.kvf_ep_info(c.ep)
	if info == nil {
		return ""
	}
	defer C.free(unsafe.Pointer(info))
	return C.GoString(info)
}
