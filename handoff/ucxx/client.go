//go:build cgo && ucx

package ucxx

/*
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
	"unsafe"

	"github.com/kvfence/kvfence/handoff"
)

// Transport is a handoff.Transport to one ucxx server: each Open
// connects an endpoint of its own for the transfer, on a UCX worker of
// its own, and the transfer's end closes it (see the package doc's
// Model). It owns a UCX context and the workers, which Close destroys.
// It is safe for concurrent use.
type Transport struct {
	addr string
	opts Options
	x    *ucxContext

	mu struct {
		sync.Mutex
		closed bool
		open   map[*clientStream]struct{}
	}
}

var _ handoff.Transport = (*Transport)(nil)

// Dial returns a transport to addr (host:port, the server's Listen
// address) with opts: it creates the UCX context and worker, reading
// UCX's environment (UCX_TLS, UCX_NET_DEVICES, ...); nothing is
// connected until Open.
func Dial(addr string, opts Options) (*Transport, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("%w: ucxx: address %q: %w", handoff.ErrInvalidArgument, addr, err)
	}
	x, err := openContext()
	if err != nil {
		return nil, err
	}
	t := &Transport{addr: addr, opts: opts, x: x}
	t.mu.open = make(map[*clientStream]struct{})
	return t, nil
}

// errNoTransport is what a nil or zero Transport answers.
var errNoTransport = fmt.Errorf("%w: ucxx: transport not made by Dial (Dial failed?)", handoff.ErrInvalidArgument)

// Close ends every transfer still open on t (each fails with
// handoff.ErrTransport), refuses further Opens and destroys the UCX
// context and its workers.
func (t *Transport) Close() error {
	if t == nil || t.x == nil {
		return errNoTransport
	}
	t.mu.Lock()
	if t.mu.closed {
		t.mu.Unlock()
		return nil
	}
	t.mu.closed = true
	open := t.mu.open
	t.mu.open = nil
	t.mu.Unlock()
	for s := range open {
		s.Close()
	}
	t.x.close()
	return nil
}

// Open implements handoff.Transport: it meets the server over TCP,
// connects an endpoint to its worker (all within Options.ConnectTimeout)
// and returns the transfer's stream. The
// endpoint closes when ctx is done (every call on the stream then fails
// with handoff.ErrTransport, wrapping ctx's cause) or the stream is
// closed. A nil or zero transport, or a nil context, is
// handoff.ErrInvalidArgument.
func (t *Transport) Open(ctx context.Context) (handoff.Stream, error) {
	switch {
	case t == nil || t.x == nil:
		return nil, errNoTransport
	case ctx == nil:
		return nil, fmt.Errorf("%w: ucxx: Open with a nil context", handoff.ErrInvalidArgument)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("%w: ucxx: %w", handoff.ErrTransport, context.Cause(ctx))
	}
	c, err := t.connect(ctx)
	if err != nil {
		return nil, err
	}
	s := &clientStream{t: t, c: c, ctx: ctx}
	t.mu.Lock()
	if t.mu.closed {
		t.mu.Unlock()
		c.close()
		return nil, fmt.Errorf("%w: ucxx: transport closed", handoff.ErrTransport)
	}
	t.mu.open[s] = struct{}{}
	t.mu.Unlock()
	s.stop = context.AfterFunc(ctx, func() {
		c.fail(fmt.Errorf("%w: ucxx: %w", handoff.ErrTransport, context.Cause(ctx)))
	})
	return s, nil
}

// connect meets the server (TCP, the hellos), creates the endpoint to its
// worker and waits for UCX's wireup to finish (a flush completes then),
// all within Options.ConnectTimeout.
func (t *Transport) connect(ctx context.Context) (*conn, error) {
	cctx, cancel := context.WithTimeout(ctx, t.opts.ConnectTimeout)
	defer cancel()
	var d net.Dialer
	nc, err := d.DialContext(cctx, "tcp", t.addr)
	if err != nil {
		return nil, fmt.Errorf("%w: ucxx: %w", handoff.ErrTransport, err)
	}
	deadline, _ := cctx.Deadline()
	nc.SetDeadline(deadline)
	w, err := t.x.worker()
	if err != nil {
		nc.Close()
		return nil, err
	}
	c := newConn(w, nc, t.opts.MaxMessageBytes)
	w.mu.Lock()
	c.registerLocked()
	w.mu.Unlock()
	fail := func(err error) (*conn, error) {
		c.close()
		return nil, err
	}
	if err := writeHello(nc, c.id, w.address); err != nil {
		return fail(err)
	}
	peer, addr, err := readHello(nc)
	if err != nil {
		return fail(err)
	}
	w.mu.Lock()
	err = c.connectLocked(addr, peer)
	w.mu.Unlock()
	if err != nil {
		return fail(err)
	}
	nc.SetDeadline(time.Time{})
	go c.watch()
	p := newPending()
	w.mu.Lock()
	c.onRevoke = c.stopWritingLocked
	p.add(c.w.postLocked(func(tok C.uint64_t) C.ucs_status_t { return C.kvf_flush(w.w, c.ep, tok) }, p.complete))
	p.seal()
	w.mu.Unlock()
	if !c.wait(p, time.Until(deadline)) {
		return fail(fmt.Errorf("%w: ucxx: not connected to %s in %v", handoff.ErrTransport, t.addr, t.opts.ConnectTimeout))
	}
	if p.err != nil {
		return fail(c.failure("connecting", p.err))
	}
	w.mu.Lock()
	c.learnLanesLocked()
	w.mu.Unlock()
	return c, nil
}

func (t *Transport) forget(s *clientStream) {
	t.mu.Lock()
	delete(t.mu.open, s)
	t.mu.Unlock()
}

// clientStream is the sender's end of one transfer, used by the goroutine
// that runs it (handoff.Export.Send); Close and the context's end may
// come from anywhere.
type clientStream struct {
	t          *Transport
	c          *conn
	ctx        context.Context
	stop       func() bool
	sendClosed bool
	writer     *remoteWriter
	closeOnce  sync.Once
}

var (
	_ handoff.ViewStream   = (*clientStream)(nil)
	_ handoff.MemoryStream = (*clientStream)(nil)
	_ handoff.PutSizer     = (*remoteWriter)(nil)
)

// fail wraps err, of the operation what, in handoff.ErrTransport (unless
// it wraps it already) and, if ctx is done, names its cause.
func (s *clientStream) fail(what string, err error) error {
	if err == nil {
		err = errors.New("failed")
	}
	if !errors.Is(err, handoff.ErrTransport) {
		err = fmt.Errorf("%w: ucxx: %s: %w", handoff.ErrTransport, what, err)
	}
	if s.ctx.Err() != nil && !errors.Is(err, context.Cause(s.ctx)) {
		return fmt.Errorf("%w (%w)", err, context.Cause(s.ctx))
	}
	return err
}

// errEnded is a send after the receiver ended the transfer: its
// verdict, which Recv returns, says why.
var errEnded = fmt.Errorf("%w: ucxx: the receiver has ended the transfer", handoff.ErrTransport)

func (s *clientStream) check() error {
	if s.sendClosed {
		return fmt.Errorf("%w: ucxx: send after CloseSend", handoff.ErrTransport)
	}
	s.c.w.mu.Lock()
	ended := s.c.peerEnded
	s.c.w.mu.Unlock()
	if ended {
		return errEnded
	}
	if s.ctx.Err() != nil {
		s.c.fail(fmt.Errorf("%w: ucxx: %w", handoff.ErrTransport, context.Cause(s.ctx)))
		return s.fail("sending", context.Cause(s.ctx))
	}
	return nil
}

// Send implements handoff.Stream; it returns once UCX no longer reads
// msg.
func (s *clientStream) Send(msg []byte) error {
	if err := s.check(); err != nil {
		return err
	}
	if err := s.c.send(kindMsg, [][]byte{msg}, s.t.opts.MessageTimeout); err != nil {
		return s.fail("sending", err)
	}
	return nil
}

// SendViews implements handoff.ViewStream: the head and the views go as
// one active message, gathered from where they lie (an iov), and done
// runs once UCX no longer reads them: sent eagerly, they are copied out
// by the time the send completes.
func (s *clientStream) SendViews(head []byte, views [][]byte, done func()) error {
	defer done()
	if err := s.check(); err != nil {
		return err
	}
	parts := make([][]byte, 0, 1+len(views))
	if err := s.c.send(kindMsg, append(append(parts, head), views...), s.t.opts.MessageTimeout); err != nil {
		return s.fail("sending", err)
	}
	return nil
}

// CloseSend sends the end of the sender's messages.
func (s *clientStream) CloseSend() error {
	if s.sendClosed {
		return nil
	}
	s.sendClosed = true
	if err := s.c.send(kindEnd, nil, s.t.opts.MessageTimeout); err != nil {
		return s.fail("closing", err)
	}
	return nil
}

// Recv returns the receiver's next message, waiting at most
// Options.MessageTimeout (after which it closes the connection); io.EOF
// after the receiver's end of messages.
func (s *clientStream) Recv() ([]byte, error) {
	msg, err := s.c.recv(s.t.opts.MessageTimeout, nil)
	if err != nil && !isEOF(err) {
		s.c.fail(err)
		return nil, s.fail("receiving", err)
	}
	return msg, err
}

// Close closes the endpoint: a transfer still going fails on the
// receiver's side. Writes into the receiver's memory end first.
func (s *clientStream) Close() error {
	s.closeOnce.Do(func() {
		if s.stop != nil {
			s.stop()
		}
		if s.writer != nil {
			s.writer.Close()
		}
		s.c.closeGracefully(closeFlush)
		s.t.forget(s)
	})
	return nil
}

// OpenRemote implements handoff.MemoryStream: desc is the server's
// description of the extents (ExposeMemory), each an address and a
// packed remote key, which are unpacked on this stream's endpoint.
func (s *clientStream) OpenRemote(desc []byte, memBytes []int64) (handoff.RemoteWriter, error) {
	if s.writer != nil {
		return nil, fmt.Errorf("%w: ucxx: a second remote writer on one stream", handoff.ErrProtocol)
	}
	if len(desc) == 1 && desc[0] == descReceives {
		s.writer = &remoteWriter{s: s, bytes: memBytes, receives: true}
		return s.writer, nil
	}
	exts, err := parseDesc(desc, len(memBytes))
	if err != nil {
		return nil, err
	}
	w := &remoteWriter{s: s, addrs: make([]uint64, len(exts)), bytes: memBytes}
	c := s.c
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	if c.err != nil {
		return nil, c.err
	}
	for i, e := range exts {
		var rkey C.ucp_rkey_h
		st := unpackRkey(c.ep, e.rkey, &rkey)
		if st != C.UCS_OK {
			c.dropRkeysLocked()
			return nil, fmt.Errorf("%w: ucxx: the remote key of extent %d does not unpack: %w", handoff.ErrProtocol, i, statusErr(st))
		}
		c.rkeys = append(c.rkeys, rkey)
		w.addrs[i] = e.addr
	}
	s.writer = w
	return w, nil
}

// rkeySlack is how much zeroed memory follows a remote key handed to
// ucp_ep_rkey_unpack, which takes no length: a key's size is implied by
// its contents (a memory domain map, then a length byte and that many
// bytes per domain, 64 domains at most), so a key cut short is read past
// its end, into these zeros, never past the allocation.
const rkeySlack = 64 * 256

// unpackRkey unpacks the remote key b on ep.
func unpackRkey(ep C.ucp_ep_h, b []byte, rkey *C.ucp_rkey_h) C.ucs_status_t {
	if len(b) == 0 {
		return C.UCS_ERR_INVALID_PARAM
	}
	buf := C.calloc(1, C.size_t(len(b)+rkeySlack))
	if buf == nil {
		return C.UCS_ERR_NO_MEMORY
	}
	defer C.free(buf)
	copy(unsafe.Slice((*byte)(buf), len(b)), b)
	return C.ucp_ep_rkey_unpack(ep, buf, rkey)
}

// extentDesc is one extent in a server's description: its address in the
// server's memory and its packed remote key.
type extentDesc struct {
	addr uint64
	rkey []byte
}

// The description of exposed memory is one byte that says how the
// sender writes it: descReceives, alone (over TCP alone: by rendezvous
// messages that the receiver receives into it), or descPuts, then for
// each extent its address u64, remote key length u16, remote key.
const (
	descPuts     = 'p'
	descReceives = 'r'
)

func appendDesc(dst []byte, addr uint64, rkey []byte) []byte {
	dst = binary.LittleEndian.AppendUint64(dst, addr)
	dst = binary.LittleEndian.AppendUint16(dst, uint16(len(rkey)))
	return append(dst, rkey...)
}

func parseDesc(b []byte, n int) ([]extentDesc, error) {
	if len(b) == 0 || b[0] != descPuts {
		return nil, fmt.Errorf("%w: ucxx: a description of exposed memory that is neither puts' nor receives'", handoff.ErrProtocol)
	}
	b = b[1:]
	exts := make([]extentDesc, 0, n)
	for len(b) > 0 {
		if len(b) < 10 || len(exts) == n {
			return nil, fmt.Errorf("%w: ucxx: a description of more than %d extents or cut short", handoff.ErrProtocol, n)
		}
		k := int(binary.LittleEndian.Uint16(b[8:]))
		if len(b) < 10+k {
			return nil, fmt.Errorf("%w: ucxx: a remote key of %d bytes in %d", handoff.ErrProtocol, k, len(b)-10)
		}
		exts = append(exts, extentDesc{addr: binary.LittleEndian.Uint64(b), rkey: b[10 : 10+k]})
		b = b[10+k:]
	}
	if len(exts) != n {
		return nil, fmt.Errorf("%w: ucxx: a description of %d extents for a grant of %d", handoff.ErrProtocol, len(exts), n)
	}
	return exts, nil
}

// closeFlush bounds the flush of a connection whose transfer has ended,
// before it is closed (conn.closeGracefully).
const closeFlush = time.Second

// remoteWriter puts a sender's pages into a receiver's exposed memory.
// Its batches' pending operations are tracked until they end, so that
// Close, and every error, returns only once no put reads the pages.
type remoteWriter struct {
	s     *clientStream
	addrs []uint64
	bytes []int64
	// receives: the receiver receives the writes itself (over TCP alone):
	// each run goes as a rendezvous message that names its extent and
	// offset; there are no keys, no addresses, and no flush.
	receives bool

	// Guarded by the worker's lock.
	batches []*pending
	closed  bool
}

// rendezvousPutBytes is what a put should carry, at least, where each
// is a rendezvous message (MinPutBytes): on the machine of
// bench/README.md a handoff of 32 layers' pages (64 regions of 32 KiB, a
// put each per chunk of 4 MiB) moved at 1.9-2.1 GB/s for 243-254 ms of
// CPU per 256 MiB, and at 3.0-3.8 GB/s for 123-142 ms in chunks of 1 MiB
// a region (6 rounds, bench/results/2026-12-05-ucx-5.txt).
const rendezvousPutBytes = 1 << 20

// MinPutBytes implements handoff.PutSizer: over TCP alone each put is a
// rendezvous message, with a round trip of its own, and small ones cost
// more than they move; a put (UCX's, or the NIC's) is posted without one.
func (w *remoteWriter) MinPutBytes() int64 {
	if w.receives {
		return rendezvousPutBytes
	}
	return 0
}

// errRevoked is a write after the receiver took its memory back.
var errRevoked = fmt.Errorf("%w: ucxx: the receiver has taken its memory back", handoff.ErrTransport)

// stopWritingLocked is the sender's answer to the receiver's revoke: no
// write is posted from now on (every post takes the worker's lock, so
// none is half posted), and once those posted before have completed
// (the endpoint's flush) the acknowledgement goes out.
func (c *conn) stopWritingLocked() {
	c.revoked = true
	ack := func(error) { c.postControlLocked(kindAck) }
	inProgress, err := c.w.postLocked(func(tok C.uint64_t) C.ucs_status_t { return C.kvf_flush(c.w.w, c.ep, tok) }, ack)
	if !inProgress && err == nil {
		ack(nil)
	}
}

// Write implements handoff.RemoteWriter: one put per run of the puts'
// parts that lie one after the other in this process's memory too, then
// a flush of the endpoint, whose completion means they have landed.
//
// Where the receiver receives the writes itself (over TCP alone), one
// rendezvous message per run instead, and no flush: a send ends once
// the receiver has taken its bytes (its receive posted; over TCP they
// may still be on their way), and the receiver reads a message only once
// every receive it posted before that message arrived has ended
// (conn.recv), so the landed note that follows them is read only once
// they have landed.
func (w *remoteWriter) Write(puts []handoff.RemotePut) (func() error, error) {
	for _, p := range puts {
		n := int64(0)
		for _, src := range p.Src {
			n += int64(len(src))
		}
		if p.Mem < 0 || p.Mem >= len(w.bytes) || p.Off < 0 || p.Off > w.bytes[p.Mem] || n > w.bytes[p.Mem]-p.Off {
			return nil, fmt.Errorf("%w: ucxx: a put of %d bytes at offset %d of extent %d: outside the memory the receiver granted",
				handoff.ErrProtocol, n, p.Off, p.Mem)
		}
	}
	c := w.s.c
	p := newPending()
	c.w.mu.Lock()
	err := c.err
	switch {
	case err != nil:
	case c.peerEnded:
		err = errEnded
	case w.closed:
		err = fmt.Errorf("%w: ucxx: write after Close", handoff.ErrTransport)
	case c.revoked:
		err = errRevoked
	}
	if err != nil {
		c.w.mu.Unlock()
		return nil, err
	}
	var hdr [writeHeaderLen]byte
	for _, put := range puts {
		off := uint64(put.Off)
		for i := 0; i < len(put.Src) && p.err == nil; {
			start := put.Src[i]
			n := len(start)
			j := i + 1
			for ; j < len(put.Src) && adjacent(put.Src[j-1], put.Src[j]); j++ {
				n += len(put.Src[j])
			}
			p.pin.Pin(&start[0])
			if w.receives {
				putHeader(hdr[:], kindWrite, c.peer)
				binary.LittleEndian.PutUint32(hdr[headerLen:], uint32(put.Mem))
				binary.LittleEndian.PutUint64(hdr[headerLen+4:], off)
				p.add(c.w.postLocked(func(tok C.uint64_t) C.ucs_status_t {
					return C.kvf_am_write(c.w.w, c.ep, unsafe.Pointer(&hdr[0]), writeHeaderLen,
						unsafe.Pointer(unsafe.SliceData(start)), C.size_t(n), tok)
				}, p.complete))
			} else {
				raddr, rkey := w.addrs[put.Mem]+off, c.rkeys[put.Mem]
				p.add(c.w.postLocked(func(tok C.uint64_t) C.ucs_status_t {
					return C.kvf_put(c.w.w, c.ep, unsafe.Pointer(unsafe.SliceData(start)), C.size_t(n), C.uint64_t(raddr), rkey, tok)
				}, p.complete))
			}
			off += uint64(n)
			i = j
		}
	}
	if p.err == nil && !w.receives {
		p.add(c.w.postLocked(func(tok C.uint64_t) C.ucs_status_t { return C.kvf_flush(c.w.w, c.ep, tok) }, p.complete))
	}
	p.seal()
	live := w.batches[:0] // the batches still in flight, for Close
	for _, b := range w.batches {
		select {
		case <-b.done:
		default:
			live = append(live, b)
		}
	}
	w.batches = append(live, p)
	failed := p.err != nil // p is the completions' until its done
	c.w.mu.Unlock()
	// The writes move now, on this goroutine, as far as progress takes
	// them without waiting on the peer.
	c.w.drive(p.done)
	wait := func() error {
		if !c.wait(p, w.s.t.opts.MessageTimeout) {
			return fmt.Errorf("%w: ucxx: writes into the receiver's memory did not land in %v", handoff.ErrTransport, w.s.t.opts.MessageTimeout)
		}
		if p.err != nil {
			return c.failure("writing into the receiver's memory", p.err)
		}
		return nil
	}
	if failed {
		return nil, wait() // only once what was posted has ended
	}
	return wait, nil
}

// adjacent reports whether b begins where a ends in memory.
func adjacent(a, b []byte) bool {
	return len(a) > 0 && len(b) > 0 && uintptr(unsafe.Pointer(unsafe.SliceData(a)))+uintptr(len(a)) == uintptr(unsafe.Pointer(unsafe.SliceData(b)))
}

// Close implements handoff.RemoteWriter: it waits for every batch still
// in flight (at most MessageTimeout, then the connection is cut, which
// ends them), then destroys the remote keys.
func (w *remoteWriter) Close() error {
	c := w.s.c
	c.w.mu.Lock()
	if w.closed {
		c.w.mu.Unlock()
		return nil
	}
	w.closed = true
	batches := w.batches
	w.batches = nil
	c.w.mu.Unlock()
	var err error
	for _, p := range batches {
		if !c.wait(p, w.s.t.opts.MessageTimeout) && err == nil {
			err = fmt.Errorf("%w: ucxx: writes into the receiver's memory did not end in %v", handoff.ErrTransport, w.s.t.opts.MessageTimeout)
		}
	}
	c.w.mu.Lock()
	c.dropRkeysLocked()
	c.w.mu.Unlock()
	return err
}
