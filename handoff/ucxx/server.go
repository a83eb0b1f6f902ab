//go:build cgo && ucx

package ucxx

/*
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvfence/kvfence/handoff"
)

// Server accepts ucxx connections and imports each one's transfer with a
// receiver (handoff.Receiver.Serve, one goroutine per connection), each
// on a UCX worker of its own (see the package doc's Model). It owns a
// UCX context and the workers, which Close destroys. It is safe for
// concurrent use.
type Server struct {
	serve  func(context.Context, handoff.Endpoint) error
	opts   Options
	x      *ucxContext
	ctx    context.Context
	cancel context.CancelFunc
	conns  sync.WaitGroup // connections being served, from their accept

	overMax, refused atomic.Uint64
	lastLog          atomic.Int64 // unix nanoseconds of the last refusal logged

	mu struct {
		sync.Mutex
		closed    bool
		listeners map[net.Listener]struct{}
		accepted  map[net.Conn]struct{} // every connection being served
		active    map[*conn]struct{}    // those past their hellos
	}
}

// lingerTimeout is how long a server waits, after the receiver's last
// verdict, for the sender to end its side before it closes the
// connection.
const lingerTimeout = 2 * time.Second

// NewServer returns a server that imports transfers with r. Listen on
// an address to serve; stop with Shutdown or Close. A nil receiver is
// handoff.ErrInvalidArgument.
func NewServer(r *handoff.Receiver, opts Options) (*Server, error) {
	if r == nil {
		return nil, fmt.Errorf("%w: ucxx: server without a receiver", handoff.ErrInvalidArgument)
	}
	return newServer(r.Serve, opts)
}

func newServer(serve func(context.Context, handoff.Endpoint) error, opts Options) (*Server, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	x, err := openContext()
	if err != nil {
		return nil, err
	}
	s := &Server{serve: serve, opts: opts, x: x}
	s.mu.listeners = make(map[net.Listener]struct{})
	s.mu.accepted = make(map[net.Conn]struct{})
	s.mu.active = make(map[*conn]struct{})
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s, nil
}

// errNoServer is what a nil or zero Server answers.
var errNoServer = fmt.Errorf("%w: ucxx: server not made by NewServer (NewServer failed?)", handoff.ErrInvalidArgument)

// Listen listens for connections on addr (host:port; port 0 picks one),
// serves them on goroutines of its own until Shutdown or Close, and
// returns the address listened on, which Dial takes. The transfers' bytes
// go over UCX, on the transports UCX picks (UCX_TLS, UCX_NET_DEVICES);
// each one's connection here carries the two ends' hellos, and stays
// open as long as the transfer does.
func (s *Server) Listen(addr string) (string, error) {
	if s == nil || s.x == nil {
		return "", errNoServer
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", fmt.Errorf("%w: ucxx: listen on %s: %w", handoff.ErrTransport, addr, err)
	}
	s.mu.Lock()
	if s.mu.closed {
		s.mu.Unlock()
		ln.Close()
		return "", ErrServerClosed
	}
	s.mu.listeners[ln] = struct{}{}
	s.mu.Unlock()
	go s.accept(ln)
	return ln.Addr().String(), nil
}

// accept serves ln's connections until it is closed.
func (s *Server) accept(ln net.Listener) {
	var backoff time.Duration
	for {
		nc, err := ln.Accept()
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Temporary() && !s.closing() { //nolint:staticcheck // no other way to tell
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				time.Sleep(backoff)
				continue
			}
			return
		}
		backoff = 0
		s.mu.Lock()
		switch {
		case s.mu.closed:
			s.mu.Unlock()
			nc.Close()
			return
		case len(s.mu.accepted) >= s.opts.MaxConns:
			s.mu.Unlock()
			s.overMax.Add(1)
			s.logRefusal("max_conns", nc.RemoteAddr(), fmt.Errorf("%w: ucxx: %d connections being served (Options.MaxConns)", handoff.ErrTransport, s.opts.MaxConns))
			nc.Close()
			continue
		}
		s.mu.accepted[nc] = struct{}{}
		s.conns.Add(1)
		s.mu.Unlock()
		go s.handle(nc)
	}
}

func (s *Server) closing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.closed
}

// Stats returns the server's connection counts; a nil or zero Server's
// are zero.
func (s *Server) Stats() ServerStats {
	if s == nil || s.x == nil {
		return ServerStats{}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return ServerStats{Conns: len(s.mu.accepted), OverMaxConns: s.overMax.Load(), FailedHandshakes: s.refused.Load()}
}

// logRefusal logs a refused connection, at most one a second: a flood of
// them costs the log nothing more (Stats counts each).
func (s *Server) logRefusal(reason string, remote net.Addr, err error) {
	if s.opts.Logger == nil {
		return
	}
	now := time.Now().UnixNano()
	last := s.lastLog.Load()
	if now-last < int64(time.Second) || !s.lastLog.CompareAndSwap(last, now) {
		return
	}
	s.opts.Logger.LogAttrs(context.Background(), slog.LevelWarn, "ucxx: connection refused",
		slog.String("reason", reason), slog.String("remote", remote.String()), slog.Any("error", err))
}

// handle serves one connection: the hellos and the endpoint to the
// client's worker, the transfer, then the end of the receiver's
// messages.
func (s *Server) handle(nc net.Conn) {
	defer s.conns.Done()
	defer func() {
		s.mu.Lock()
		delete(s.mu.accepted, nc)
		s.mu.Unlock()
	}()
	c, err := s.meet(nc)
	if err != nil {
		nc.Close()
		if !s.closing() {
			s.refused.Add(1)
			s.logRefusal("handshake", nc.RemoteAddr(), err)
		}
		return
	}
	s.mu.Lock()
	if s.mu.closed {
		s.mu.Unlock()
		c.close()
		return
	}
	s.mu.active[c] = struct{}{}
	s.mu.Unlock()
	go c.watch()
	ep := &serverEnd{s: s, c: c, interrupt: make(chan struct{})}
	s.serve(s.ctx, ep) // the receiver counts, logs and answers its refusals
	ep.finish()
	s.mu.Lock()
	delete(s.mu.active, c)
	s.mu.Unlock()
}

// meet reads the client's hello, creates the connection and its endpoint
// to the client's worker, and answers with its own hello, all within
// Options.ConnectTimeout.
func (s *Server) meet(nc net.Conn) (*conn, error) {
	nc.SetDeadline(time.Now().Add(s.opts.ConnectTimeout))
	peer, addr, err := readHello(nc)
	if err != nil {
		return nil, err
	}
	w, err := s.x.worker()
	if err != nil {
		return nil, err
	}
	c := newConn(w, nc, s.opts.MaxMessageBytes)
	c.credit = true
	w.mu.Lock()
	c.registerLocked()
	err = c.connectLocked(addr, peer)
	w.mu.Unlock()
	if err == nil {
		err = writeHello(nc, c.id, w.address)
	}
	if err != nil {
		c.close()
		return nil, err
	}
	nc.SetDeadline(time.Time{})
	return c, nil
}

// Shutdown stops accepting connections and waits for the transfers of
// those accepted to end. If ctx ends first, it closes them (as Close)
// and returns ctx's error.
func (s *Server) Shutdown(ctx context.Context) error {
	switch {
	case s == nil || s.x == nil:
		return errNoServer
	case ctx == nil:
		return fmt.Errorf("%w: ucxx: Shutdown with a nil context", handoff.ErrInvalidArgument)
	}
	s.stopListening()
	served := make(chan struct{})
	go func() {
		s.conns.Wait()
		close(served)
	}()
	select {
	case <-served:
		s.x.close()
		return nil
	case <-ctx.Done():
		s.Close()
		return ctx.Err()
	}
}

// Close stops accepting connections, closes those accepted (their
// transfers fail: the receiver aborts each import through the scrubber)
// and returns once each one's goroutine has, with the worker destroyed.
func (s *Server) Close() error {
	if s == nil || s.x == nil {
		return errNoServer
	}
	s.stopListening()
	s.cancel()
	s.mu.Lock()
	for nc := range s.mu.accepted {
		nc.Close() // a connection in its hellos
	}
	active := make([]*conn, 0, len(s.mu.active))
	for c := range s.mu.active {
		active = append(active, c)
	}
	s.mu.Unlock()
	for _, c := range active {
		c.fail(fmt.Errorf("%w: ucxx: server closed", handoff.ErrTransport))
	}
	s.conns.Wait()
	s.x.close()
	return nil
}

// stopListening marks the server closed and closes its listeners.
func (s *Server) stopListening() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.mu.closed = true
	for ln := range s.mu.listeners {
		ln.Close()
		delete(s.mu.listeners, ln)
	}
}

// serverEnd is the receiver's end of one transfer.
type serverEnd struct {
	s             *Server
	c             *conn
	interrupt     chan struct{}
	interruptOnce sync.Once
	ended         bool // the sender's end of messages was read
}

var _ handoff.LandingWatcher = (*serverEnd)(nil)

// Recv implements handoff.Endpoint: the sender's next message, valid
// until the next Recv; io.EOF after the sender's CloseSend. It waits at
// most Options.MessageTimeout, and not at all once InterruptRecv was
// called.
func (e *serverEnd) Recv() ([]byte, error) {
	msg, err := e.c.recv(e.s.opts.MessageTimeout, e.interrupt)
	if isEOF(err) {
		e.ended = true
	}
	return msg, err
}

// Send implements handoff.Endpoint.
func (e *serverEnd) Send(msg []byte) error {
	return e.c.send(kindMsg, [][]byte{msg}, e.s.opts.MessageTimeout)
}

// InterruptRecv implements handoff.InterruptibleEndpoint.
func (e *serverEnd) InterruptRecv() { e.interruptOnce.Do(func() { close(e.interrupt) }) }

// ExposeMemory implements handoff.MemoryEndpoint: each extent is mapped
// (ucp_mem_map: registered with every transport that writes remote
// memory, for remote writes) and its remote key packed; the description
// is each one's address and key. The extents are the import's pages and
// nothing else, and stay registered only until revoke.
func (e *serverEnd) ExposeMemory(mems [][]byte) ([]byte, func(), error) {
	if e.s.opts.DataPath == PathMessages {
		return nil, nil, fmt.Errorf("%w: ucxx: the server sends pages as messages (PathMessages)", handoff.ErrNoRemoteMemory)
	}
	e.c.w.mu.Lock()
	tcp := e.c.learnLanesLocked()
	e.c.w.mu.Unlock()
	if tcp && e.s.opts.DataPath == PathAuto {
		return e.exposeForReceives(mems)
	}
	x := e.s.x
	if err := x.hold(); err != nil {
		return nil, nil, err
	}
	var pin runtime.Pinner // the pool's memory, whose address UCX keeps until the unmap
	var memhs []C.ucp_mem_h
	desc := []byte{descPuts}
	unmap := func() {
		for _, m := range memhs {
			C.ucp_mem_unmap(x.c.ctx, m)
		}
		pin.Unpin()
		x.unhold()
	}
	c := e.c
	c.w.mu.Lock()
	err := c.err
	c.w.mu.Unlock()
	if err != nil {
		unmap()
		return nil, nil, err
	}
	for i, m := range mems {
		if len(m) == 0 {
			unmap()
			return nil, nil, fmt.Errorf("%w: ucxx: extent %d is empty", handoff.ErrInvalidArgument, i)
		}
		pin.Pin(&m[0])
		var memh C.ucp_mem_h
		var rkey unsafe.Pointer
		var rkeyLen C.size_t
		if st := C.kvf_mem_map(x.c, unsafe.Pointer(unsafe.SliceData(m)), C.size_t(len(m)), &memh, &rkey, &rkeyLen); st != C.UCS_OK {
			unmap()
			return nil, nil, fmt.Errorf("%w: ucxx: registering %d bytes: %w", handoff.ErrNoRemoteMemory, len(m), statusErr(st))
		}
		memhs = append(memhs, memh)
		desc = appendDesc(desc, uint64(uintptr(unsafe.Pointer(unsafe.SliceData(m)))), unsafe.Slice((*byte)(rkey), int(rkeyLen)))
		C.ucp_rkey_buffer_release(rkey)
	}
	var once sync.Once
	revoke := func() {
		once.Do(func() {
			e.unwatch()
			e.takeBack()
			unmap()
		})
	}
	return desc, revoke, nil
}

// LandsHere implements handoff.LandingWatcher: whether every lane of
// the connection's endpoint is a transport whose bytes this process's
// own threads land (landsHere): shared memory's queues and TCP.
func (e *serverEnd) LandsHere() bool {
	e.c.w.mu.Lock()
	defer e.c.w.mu.Unlock()
	return landsHere(e.c.lanesLocked())
}

// WatchLanding implements handoff.LandingWatcher: the worker calls scan
// after each progress that did something, under its lock, on the
// goroutine that progressed it. Over shared memory that progress is what
// copies the sender's puts out of the worker's queue into the memory,
// and over TCP alone what receives them into it. The memory's revoke
// ends the watch before it takes the memory back.
func (e *serverEnd) WatchLanding(scan func()) {
	e.c.w.mu.Lock()
	e.c.w.landed = scan
	e.c.w.mu.Unlock()
}

// unwatch ends WatchLanding's watch: from its return the scan is not
// called again.
func (e *serverEnd) unwatch() {
	e.c.w.mu.Lock()
	e.c.w.landed = nil
	e.c.w.mu.Unlock()
}

// exposeForReceives is ExposeMemory over TCP alone: nothing is
// registered; the sender's writes come as rendezvous messages, each of
// which this end receives itself into the extent and offset it names,
// only inside mems (conn.writeArrivedLocked). The description says so,
// and nothing else: no address or key of this process's leaves it.
// revoke closes mems to writes, has the sender stop, and waits for the
// receives in flight to end.
func (e *serverEnd) exposeForReceives(mems [][]byte) ([]byte, func(), error) {
	c := e.c
	var pin runtime.Pinner // the pool's memory, which UCX writes until the receives end
	for i, m := range mems {
		if len(m) == 0 {
			pin.Unpin()
			return nil, nil, fmt.Errorf("%w: ucxx: extent %d is empty", handoff.ErrInvalidArgument, i)
		}
		pin.Pin(&m[0])
	}
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	switch {
	case c.err != nil:
		pin.Unpin()
		return nil, nil, c.err
	case c.landing != nil:
		pin.Unpin()
		return nil, nil, fmt.Errorf("%w: ucxx: memory exposed twice on one connection", handoff.ErrInvalidArgument)
	}
	c.landing, c.landingOpen = mems, true
	var once sync.Once
	revoke := func() {
		once.Do(func() {
			c.w.mu.Lock()
			c.landingOpen = false
			c.w.landed = nil
			c.w.mu.Unlock()
			e.takeBack()
			c.closeLanding(e.s.opts.RevokeTimeout)
			c.w.mu.Lock()
			c.landing = [][]byte{} // closed: a late write is released unread
			c.w.mu.Unlock()
			pin.Unpin()
		})
	}
	return []byte{descReceives}, revoke, nil
}

// takeBack has the sender stop writing the exposed memory: it asks, and
// waits for the sender's acknowledgement (every write it posted has
// completed, and it posts none from now on), at most
// Options.RevokeTimeout. Without one (the time passed, the connection
// failed) the connection ends, and its worker with it: a sender that
// cannot be heard from writes nothing through it any more, and nothing
// it sent before is delivered.
func (e *serverEnd) takeBack() {
	c := e.c
	acks := make(chan struct{})
	c.w.mu.Lock()
	if c.err != nil {
		c.w.mu.Unlock()
		return // failed: the worker is destroyed (failLocked)
	}
	c.revokeAcks = acks
	c.w.mu.Unlock()
	err := c.send(kindRevoke, nil, e.s.opts.RevokeTimeout)
	if err == nil {
		t := time.NewTimer(e.s.opts.RevokeTimeout)
		defer t.Stop()
		select {
		case <-acks:
		case <-t.C:
		}
		err = fmt.Errorf("%w: ucxx: the sender did not stop writing within %v of the revoke", handoff.ErrTransport, e.s.opts.RevokeTimeout)
	}
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	if !c.revokeAcked {
		c.failLocked(err) // a connection that failed already has: with its lock held, its worker is gone
	}
}

// finish ends the receiver's messages and waits, at most lingerTimeout,
// for the sender to end its side (its messages are dropped), so that the
// verdict is read before the connection goes; then it closes it.
func (e *serverEnd) finish() {
	c := e.c
	defer c.closeGracefully(closeFlush)
	if c.send(kindEnd, nil, e.s.opts.MessageTimeout) != nil || e.ended {
		return
	}
	deadline := time.Now().Add(lingerTimeout)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return
		}
		if _, err := c.recv(left, nil); err != nil {
			return
		}
	}
}

// tcpOnly reports whether every lane of an endpoint, as lanes describes
// them (ucp_ep_print_info: "lane[0]:  1:tcp/lo.0 md[0] ..."), is UCX's
// TCP transport: where UCX 1.13 emulates a put with active messages
// (two copies in user space beside the kernel's, for 111-131 ms of CPU
// per 256 MiB on the machine of bench/README.md) while its rendezvous
// moves the bytes with the kernel's copies alone (57-67 ms, ucx_perftest
// tag_bw and ucp_am_bw; bench/results/2026-12-04-ucx-3.txt). Over shared
// memory the emulated puts still beat the rendezvous (cma), and over
// InfiniBand and RoCE the NIC writes a put: PathAuto keeps the puts
// there.
func tcpOnly(lanes string) bool {
	return everyLane(lanes, func(tl string) bool { return tl == "tcp" })
}

// landsHere reports whether every lane of an endpoint, as lanes
// describes them, is a transport whose bytes the receiving process's own
// threads land: shared memory's queues (posix, sysv: its worker copies an
// emulated put's elements out of them), cma (its worker reads the
// sender's memory), TCP (its worker receives) and self. Over InfiniBand
// and RoCE (rc, dc, ud) a NIC writes the memory; over xpmem and knem the
// sender's process does.
func landsHere(lanes string) bool {
	return everyLane(lanes, func(tl string) bool {
		switch tl {
		case "tcp", "posix", "sysv", "cma", "self":
			return true
		}
		return false
	})
}

// everyLane reports whether lanes (ucp_ep_print_info: "lane[0]:
// 1:tcp/lo.0 md[0] ...") describes at least one lane, and ok holds for
// every lane's transport.
func everyLane(lanes string, ok func(transport string) bool) bool {
	n := 0
	for _, line := range strings.Split(lanes, "\n") {
		f := strings.Fields(line)
		for i := 0; i+1 < len(f); i++ {
			if !strings.HasPrefix(f[i], "lane[") {
				continue
			}
			_, tl, _ := strings.Cut(f[i+1], ":")
			if tl, _, _ = strings.Cut(tl, "/"); !ok(tl) {
				return false
			}
			n++
			break
		}
	}
	return n > 0
}
