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
	inbox       []inMessage
	queued      int   // bytes of eager messages in inbox
	err         error // the connection failed; every later call fails with it
	ended       bool  // the peer's end of messages has been read
	peerEnded   bool  // the peer's end of messages has arrived: it reads nothing more
	closed      bool
	revoked     bool           // on the sender's end: the receiver has taken its memory back
	onRevoke    func()         // on the sender's end: the receiver takes its memory back
	revokeAcks  chan struct{}  // on the receiver's end: closed when the sender has stopped writing, or the connection ended
	revokeAcked bool           // on the receiver's end: the sender has acknowledged the revoke
	credits     int            // on the sender's end: messages it may send now
	rkeys       []C.ucp_rkey_h // on the sender's end: the receiver's remote keys, unpacked on ep
	credit      bool           // on the receiver's end: it answers each message read with a credit

	// On the receiver's end, when the sender's writes come as rendezvous
	// messages (over TCP alone): the exposed memory they are received
	// into, while it is open to them, and the receives posted into it,
	// numbered in posting order: all of the first doneUpTo have ended,
	// and so have those in doneAfter.
	landing     [][]byte
	landingOpen bool
	posted      uint64
	doneUpTo    uint64
	doneAfter   map[uint64]struct{}
	received    chan struct{} // a receive ended (capacity 1)

	arrived  chan struct{} // a message arrived, or the state changed (capacity 1)
	credited chan struct{} // a credit arrived (capacity 1)
	failed   chan struct{} // closed with err
}

// inMessage is a received message: its kind and bytes, and the writes
// whose receives had been posted when it arrived (conn.posted), which
// must have ended before it is read: a landed note is read only once
// the writes it vouches for are in memory.
type inMessage struct {
	kind  byte
	data  []byte
	after uint64
}

// The message header (16 bytes): magic, version, kind, two zero bytes,
// and the ID of the connection it is for, at the receiving worker.
const (
	headerLen  = 16
	magic      = "KVFU"
	version    = 2   // 2: the description of exposed memory says how it is written (puts, rendezvous)
	kindMsg    = 'm' // a handoff message
	kindEnd    = 'e' // the end of this side's messages
	kindRevoke = 'r' // receiver → sender: stop writing my memory
	kindAck    = 'a' // sender → receiver: nothing of mine writes it any more
	kindCredit = 'c' // receiver → sender: one message read, send another
	kindWrite  = 'w' // sender → receiver, by rendezvous: bytes for the exposed memory (over TCP alone)
)

// A write's header is the message header followed by where its bytes
// go: extent u32 (an index into the memory the receiver exposed), offset
// u64. Its length is the message's.
const writeHeaderLen = headerLen + 4 + 8

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
	return &conn{w: w, ctrl: ctrl, max: max, credits: window,
		arrived: make(chan struct{}, 1), credited: make(chan struct{}, 1), received: make(chan struct{}, 1),
		failed: make(chan struct{})}
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
// progressed first, so that it is delivered before the failure. A peer
// that ended its messages before it closed has ended the transfer as the
// protocol says: that is no failure, and this end closes in its own
// time (gracefully, and its worker serves on).
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
	if c.peerEnded {
		return
	}
	c.failLocked(fmt.Errorf("%w: ucxx: the peer closed the connection", handoff.ErrTransport))
}

func (c *conn) signal() {
	select {
	case c.arrived <- struct{}{}:
	default:
	}
}

// failLocked ends the connection with err (the first failure wins):
// its worker is destroyed, which ends every operation on it (UCX reads
// and writes no memory for them from now on), and every wait on it
// returns.
func (c *conn) failLocked(err error) {
	c.setErrLocked(err)
	if c.closed {
		return
	}
	c.closed = true
	c.forgetLocked()
	c.dropRkeysLocked()
	c.w.destroyLocked()
}

// dropRkeysLocked destroys the remote keys unpacked on the endpoint,
// while its worker lives.
func (c *conn) dropRkeysLocked() {
	if c.w.closed {
		return // no key outlives its worker
	}
	for _, k := range c.rkeys {
		C.ucp_rkey_destroy(k)
	}
	c.rkeys = nil
}

// setErrLocked records the connection's end, unless one is recorded.
func (c *conn) setErrLocked(err error) {
	if c.err == nil {
		c.err = err
		close(c.failed)
		c.signal()
	}
}

// forgetLocked takes the connection off its worker, which delivers
// nothing more to it, and closes the connection the ends met over (which
// ends watch). The messages that arrived stay to be read before the
// connection's error.
func (c *conn) forgetLocked() {
	if c.revokeAcks != nil {
		close(c.revokeAcks)
		c.revokeAcks = nil
	}
	c.ctrl.Close()
	delete(c.w.byID, c.id)
	if c.ep != nil {
		delete(c.w.byEP, c.ep)
	}
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
			c.revokeAcked = true
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
	m.after = c.posted
	c.queued += len(m.data)
	c.inbox = append(c.inbox, m)
	c.signal()
}

// writeArrivedLocked takes a sender's write (over TCP alone), whose
// bytes ev holds (eager) or names (rendezvous: ev.data is UCX's
// descriptor, to receive or release): they are received straight into
// the exposed memory the header names, only if the write lies wholly
// inside one extent of it, and only while it is open to writes. A write
// after the memory was taken back is released unread (UCX ends the
// sender's send all the same; nothing vouches for it any more: the
// import has ended); anything else out of place fails the connection.
func (c *conn) writeArrivedLocked(h []byte, ev *C.kvf_event) {
	n := uint64(ev.len)
	release := func() {
		if ev.rndv != 0 {
			C.ucp_am_data_release(c.w.w.worker, ev.data)
		} else {
			C.free(ev.data)
		}
	}
	le := binary.LittleEndian
	ext, off := uint64(le.Uint32(h[headerLen:])), le.Uint64(h[headerLen+4:])
	switch {
	case c.closed || c.err != nil:
		release()
		return
	case h[4] != version || h[5] != kindWrite || h[6] != 0 || h[7] != 0:
		release()
		c.failLocked(fmt.Errorf("%w: ucxx: a message with header %q: not a ucxx peer", ErrHandshake, h))
		return
	case c.landing == nil:
		release()
		c.failLocked(fmt.Errorf("%w: ucxx: a write of %d bytes, and no memory was exposed for writes", handoff.ErrProtocol, n))
		return
	case !c.landingOpen:
		release()
		return
	case ext >= uint64(len(c.landing)) || n == 0 || off > uint64(len(c.landing[ext])) || n > uint64(len(c.landing[ext]))-off:
		release()
		c.failLocked(fmt.Errorf("%w: ucxx: a write of %d bytes at offset %d of extent %d: outside the memory exposed",
			handoff.ErrProtocol, n, off, ext))
		return
	}
	dst := c.landing[ext][off : off+n]
	if ev.rndv == 0 {
		copy(dst, unsafe.Slice((*byte)(ev.data), n))
		C.free(ev.data)
		return
	}
	seq := c.posted
	c.posted++
	done := func(err error) {
		c.receivedLocked(seq)
		if err != nil {
			c.failLocked(fmt.Errorf("%w: ucxx: receiving a write of %d bytes: %w", handoff.ErrTransport, n, err))
		}
	}
	// A receive ends when UCX completes it, or when the worker is
	// destroyed (the connection failed): UCX writes its memory no more
	// either way, which closeLanding waits for before the memory goes
	// back.
	inProgress, err := c.w.postLocked(func(tok C.uint64_t) C.ucs_status_t {
		return C.kvf_am_recv(c.w.w, ev.data, unsafe.Pointer(unsafe.SliceData(dst)), C.size_t(n), tok)
	}, done)
	if err != nil && !c.w.closed {
		C.ucp_am_data_release(c.w.w.worker, ev.data) // the receive took nothing
	}
	if !inProgress {
		done(err)
	}
}

// receivedLocked accounts for the end of receive seq: the messages that
// arrived after every receive up to it was posted may be read now.
func (c *conn) receivedLocked(seq uint64) {
	if seq != c.doneUpTo {
		if c.doneAfter == nil {
			c.doneAfter = make(map[uint64]struct{})
		}
		c.doneAfter[seq] = struct{}{}
		return
	}
	c.doneUpTo++
	for {
		if _, ok := c.doneAfter[c.doneUpTo]; !ok {
			break
		}
		delete(c.doneAfter, c.doneUpTo)
		c.doneUpTo++
	}
	c.signal()
	select {
	case c.received <- struct{}{}:
	default:
	}
}

// closeLanding closes the exposed memory to writes (those that arrive
// from now on are released unread) and waits until no receive into it is
// in flight: at most timeout, after which the connection fails, and its
// worker's destruction ends them (nothing writes once it is destroyed).
// Only then may the memory be used for anything else.
func (c *conn) closeLanding(timeout time.Duration) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		c.w.mu.Lock()
		c.landingOpen = false
		left := c.doneUpTo < c.posted
		c.w.mu.Unlock()
		if !left {
			return
		}
		select {
		case <-c.received:
		case <-t.C:
			c.fail(fmt.Errorf("%w: ucxx: writes into the exposed memory did not end within %v of the revoke", handoff.ErrTransport, timeout))
		}
	}
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
		if len(c.inbox) > 0 && c.inbox[0].after <= c.doneUpTo {
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
	p.add(c.w.postLocked(func(tok C.uint64_t) C.ucs_status_t {
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
	inProgress, err := c.w.postLocked(func(tok C.uint64_t) C.ucs_status_t {
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

// errConnClosed is what calls on a connection get once it has been
// closed.
var errConnClosed = fmt.Errorf("%w: ucxx: connection closed", handoff.ErrTransport)

// close ends the connection at once: its worker is destroyed.
func (c *conn) close() { c.fail(errConnClosed) }

// errAbandoned ends the operations of a worker that has been destroyed.
var errAbandoned = fmt.Errorf("%w: ucxx: the connection ended under the operation", handoff.ErrTransport)

// closeGracefully closes a connection whose transfer has ended: the
// endpoint is flushed, so that the messages it sent reach the peer
// before the peer sees the connection close, and closed, at most
// timeout; then the worker serves another connection. A connection that
// failed, or whose endpoint does not close in time, destroys its
// worker instead.
func (c *conn) closeGracefully(timeout time.Duration) {
	w := c.w
	p := newPending()
	w.mu.Lock()
	if c.closed {
		w.mu.Unlock()
		return
	}
	c.setErrLocked(errConnClosed)
	c.closed = true
	c.forgetLocked()
	c.dropRkeysLocked()
	if c.ep != nil {
		p.add(w.postLocked(func(tok C.uint64_t) C.ucs_status_t { return C.kvf_ep_close(w.w, c.ep, tok) }, p.complete))
	}
	p.seal()
	w.mu.Unlock()
	w.drive(p.done)
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
		w.close() // which ends p
	}
	w.mu.Lock()
	clean := p.err == nil && !w.closed && len(w.ops) == 0 && len(w.byEP) == 0
	w.polls = true // until the next connection's lanes say otherwise
	w.mu.Unlock()
	if !clean {
		w.close()
		return
	}
	w.x.release(w)
}

// learnLanesLocked looks at the transports the endpoint uses, once it
// is connected, and tells the worker whether it must poll them (see
// worker.polls), and reports whether they are all TCP.
func (c *conn) learnLanesLocked() (tcp bool) {
	tcp = tcpOnly(c.lanesLocked())
	c.w.polls = !tcp
	return tcp
}

// lanes describes the transports the connection's endpoint uses
// (ucp_ep_print_info), for tests and benchmarks to report.
func (c *conn) lanes() string {
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	return c.lanesLocked()
}

func (c *conn) lanesLocked() string {
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
