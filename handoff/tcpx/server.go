package tcpx

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvfence/kvfence/handoff"
)

// ErrServerClosed is what Serve returns once Shutdown or Close has been
// called.
var ErrServerClosed = errors.New("tcpx: server closed")

// Server accepts tcpx connections and imports each one's transfer with a
// receiver (handoff.Receiver.Serve, one goroutine per connection). It is
// safe for concurrent use: Serve may run on several listeners at once.
type Server struct {
	serve func(context.Context, handoff.Endpoint) error // the receiver's Serve
	tls   *tls.Config                                   // nil: Insecure
	opts  Options
	// ctx is every transfer's: Close cancels it, which ends the waits of
	// admissions (handoff.ReceiverConfig.AdmitWait).
	ctx    context.Context
	cancel context.CancelFunc
	conns  sync.WaitGroup // connections being served
	// overMax counts connections closed unread for MaxConns, and
	// failedHandshakes those whose TLS handshake or hello failed.
	overMax, failedHandshakes atomic.Uint64
	// overMaxErr is every refusal's over MaxConns, made once: the accept
	// loop refuses without allocating.
	overMaxErr error
	// overMaxLog and handshakeLog log those refusals, one limiter each: a
	// flood of one kind (a scanner's garbage, say) must not hide the first
	// record of the other (the server at MaxConns), and the two call for
	// different remedies (a wrong peer on the port; too little capacity
	// or a connection flood), so each gets its own first record and count.
	overMaxLog, handshakeLog refusalLog

	mu struct {
		sync.Mutex
		closed    bool
		listeners map[net.Listener]struct{}
		conns     map[net.Conn]struct{}
	}
}

// NewServer returns a server that imports transfers with r, over
// connections protected by sec (required: TLS with a certificate, or
// Insecure for a trusted network). Serve it on a listener; stop it with
// Shutdown or Close. Without a Security it fails with ErrNoSecurity,
// without a receiver with handoff.ErrInvalidArgument.
func NewServer(r *handoff.Receiver, sec Security, opts Options) (*Server, error) {
	if err := sec.check(); err != nil {
		return nil, err
	}
	if r == nil {
		return nil, fmt.Errorf("%w: tcpx: server without a receiver", handoff.ErrInvalidArgument)
	}
	return newServer(r.Serve, sec, opts)
}

func newServer(serve func(context.Context, handoff.Endpoint) error, sec Security, opts Options) (*Server, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	s := &Server{serve: serve, opts: opts,
		overMaxErr: fmt.Errorf("%w: tcpx: %d connections being served (Options.MaxConns)", handoff.ErrTransport, opts.MaxConns)}
	s.overMaxLog.init(opts.Logger, "max_conns")
	s.handshakeLog.init(opts.Logger, "handshake")
	if c := sec.tls; c != nil {
		if len(c.Certificates) == 0 && c.GetCertificate == nil && c.GetConfigForClient == nil {
			return nil, fmt.Errorf("%w: tcpx: a server's TLS config needs a certificate", handoff.ErrInvalidConfig)
		}
		s.tls = c.Clone()
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.mu.listeners = make(map[net.Listener]struct{})
	s.mu.conns = make(map[net.Conn]struct{})
	return s, nil
}

// ServerStats are a server's connection counts.
type ServerStats struct {
	// Conns is how many connections the server is serving now, from
	// their accept on (at most Options.MaxConns).
	Conns int
	// OverMaxConns counts connections closed unread because MaxConns
	// were being served.
	OverMaxConns uint64
	// FailedHandshakes counts connections whose TLS handshake or hello
	// failed (not a tcpx client, or a stalled one), closed before any
	// transfer began: the log names only the first of a flood of them,
	// this counts each. A handshake that Close cut short is not counted.
	FailedHandshakes uint64
}

// Stats returns the server's connection counts; a nil or zero Server's
// are zero.
func (s *Server) Stats() ServerStats {
	if s == nil || s.serve == nil {
		return ServerStats{}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return ServerStats{Conns: len(s.mu.conns), OverMaxConns: s.overMax.Load(), FailedHandshakes: s.failedHandshakes.Load()}
}

// errNoServer is what a nil or zero Server answers: one not made by
// NewServer.
var errNoServer = fmt.Errorf("%w: tcpx: server not made by NewServer (NewServer failed?)", handoff.ErrInvalidArgument)

// Serve accepts connections on ln and serves each on a goroutine of its
// own until Shutdown or Close, then returns ErrServerClosed; on any other
// failure to accept it returns that error (wrapping
// handoff.ErrTransport). It closes ln when it returns.
func (s *Server) Serve(ln net.Listener) error {
	switch {
	case s == nil || s.serve == nil:
		return errNoServer
	case ln == nil:
		return fmt.Errorf("%w: tcpx: Serve on a nil listener", handoff.ErrInvalidArgument)
	}
	defer ln.Close()
	if !s.addListener(ln) {
		return ErrServerClosed
	}
	defer removeFrom(s, s.mu.listeners, ln)
	var backoff time.Duration
	for {
		conn, err := ln.Accept()
		if err != nil {
			if s.closed() {
				return ErrServerClosed
			}
			// Out of file descriptors and the like: wait and try again,
			// as net/http does.
			if ne, ok := err.(net.Error); ok && ne.Temporary() { //nolint:staticcheck // no other way to tell
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				time.Sleep(backoff)
				continue
			}
			return fmt.Errorf("%w: tcpx: accept: %w", handoff.ErrTransport, err)
		}
		backoff = 0
		switch s.addConn(conn) {
		case connClosed:
			conn.Close()
			return ErrServerClosed
		case connOverMax:
			s.refuseOverMax(conn)
			continue
		}
		go s.handle(conn)
	}
}

// addListener tracks ln unless the server is closed.
func (s *Server) addListener(ln net.Listener) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.closed {
		return false
	}
	s.mu.listeners[ln] = struct{}{}
	return true
}

// What addConn made of a connection.
const (
	connServed  = iota // tracked: serve it
	connClosed         // the server is closed
	connOverMax        // MaxConns are being served
)

// addConn tracks an accepted connection unless the server is closed or
// serves MaxConns already: in its set, and in s.conns, counted under the
// lock that marks the server closed, so that Close's wait, which follows
// that mark, counts every connection that will be served.
func (s *Server) addConn(c net.Conn) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.mu.closed:
		return connClosed
	case len(s.mu.conns) >= s.opts.MaxConns:
		return connOverMax
	}
	s.mu.conns[c] = struct{}{}
	s.conns.Add(1)
	return connServed
}

// refuseOverMax closes a connection over MaxConns before reading a byte
// of it (no goroutine, no buffer, no TLS), and counts and logs it. It
// counts and logs first: a client that has seen the close finds it in
// Stats, and in the log, or in the summary a Close made after it.
func (s *Server) refuseOverMax(c net.Conn) {
	s.overMax.Add(1)
	s.overMaxLog.refused(s.ctx, c.RemoteAddr(), s.overMaxErr)
	c.Close()
}

// refusalLogWindow is how long a refusal logged at once silences the
// next ones of its kind: a flood costs at most two records a second per
// kind (one refusal and one summary), however many connections it opens.
const refusalLogWindow = time.Second

// refusalLog logs one kind of refused connection without letting a flood
// of them flood the log: the first refusal of a window is logged at once,
// as a single one is; the rest of the window's are only counted (no
// allocation, a lock and an add), and when the window ends a timer logs
// one summary record of how many and the last (its remote and error).
// The timer, rather than the next refusal, ends the window, so that the
// count of a flood that stopped is not held back until the next one.
type refusalLog struct {
	logger *slog.Logger // nil: log nothing
	reason string       // the kind, as the records' reason
	mu     sync.Mutex
	window time.Duration
	until  time.Time // the window's end; refusals before it are counted
	// suppressed counts the window's refusals not logged, the last of
	// which came from lastRemote and failed with lastErr.
	suppressed uint64
	lastRemote net.Addr
	lastErr    error
	timer      *time.Timer // summarises the window at its end; made once
}

func (l *refusalLog) init(logger *slog.Logger, reason string) {
	l.logger, l.reason, l.window = logger, reason, refusalLogWindow
}

// refused logs, or counts, the refusal of a connection from remote.
func (l *refusalLog) refused(ctx context.Context, remote net.Addr, err error) {
	if l.logger == nil {
		return
	}
	now := time.Now()
	l.mu.Lock()
	if now.Before(l.until) {
		l.suppressed++
		l.lastRemote, l.lastErr = remote, err
		if l.suppressed == 1 {
			if l.timer == nil {
				l.timer = time.AfterFunc(l.until.Sub(now), l.flush)
			} else {
				l.timer.Reset(l.until.Sub(now))
			}
		}
		l.mu.Unlock()
		return
	}
	// A window whose timer has not run yet is summarised here, before the
	// refusal that opens the next one.
	sum := l.takeLocked()
	l.until = now.Add(l.window)
	l.mu.Unlock()
	l.summarise(sum)
	l.logger.LogAttrs(ctx, slog.LevelWarn, "tcpx: connection refused",
		slog.String("reason", l.reason), slog.String("remote", addrString(remote)), slog.Any("error", err))
}

// refusalSummary is what a window's summary record says.
type refusalSummary struct {
	suppressed uint64
	window     time.Duration
	lastRemote net.Addr
	lastErr    error
}

// takeLocked returns the window's count and last refusal, and zeroes
// them.
func (l *refusalLog) takeLocked() refusalSummary {
	sum := refusalSummary{l.suppressed, l.window, l.lastRemote, l.lastErr}
	l.suppressed, l.lastRemote, l.lastErr = 0, nil, nil
	return sum
}

// flush summarises the refusals counted so far, if any.
func (l *refusalLog) flush() {
	l.mu.Lock()
	sum := l.takeLocked()
	l.mu.Unlock()
	l.summarise(sum)
}

// stop summarises what is counted now that the server is closed, and
// stops the timer. A refusal that races with Close may still arm it
// again: its summary then comes a window later, as while serving.
func (l *refusalLog) stop() {
	if l.logger == nil {
		return
	}
	l.mu.Lock()
	if l.timer != nil {
		l.timer.Stop()
	}
	l.mu.Unlock()
	l.flush()
}

func (l *refusalLog) summarise(sum refusalSummary) {
	if sum.suppressed == 0 {
		return
	}
	l.logger.LogAttrs(context.Background(), slog.LevelWarn, "tcpx: connections refused and not logged one by one",
		slog.String("reason", l.reason), slog.Uint64("suppressed", sum.suppressed), slog.Duration("window", sum.window),
		slog.String("remote", addrString(sum.lastRemote)), slog.Any("error", sum.lastErr))
}

// addrString is a's String, or "" for a connection that has no remote
// address (a net.Conn of a listener other than TCP's).
func addrString(a net.Addr) string {
	if a == nil {
		return ""
	}
	return a.String()
}

func removeFrom[T comparable](s *Server, set map[T]struct{}, c T) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(set, c)
}

func (s *Server) closed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.closed
}

// Shutdown stops accepting connections and waits for the transfers of
// those accepted to end. If ctx ends first, it closes them (as Close)
// and returns ctx's error.
func (s *Server) Shutdown(ctx context.Context) error {
	switch {
	case s == nil || s.serve == nil:
		return errNoServer
	case ctx == nil:
		return fmt.Errorf("%w: tcpx: Shutdown with a nil context", handoff.ErrInvalidArgument)
	}
	s.stopAccepting()
	served := make(chan struct{})
	go func() {
		s.conns.Wait()
		close(served)
	}()
	select {
	case <-served:
		s.flushRefusals()
		return nil
	case <-ctx.Done():
		s.Close()
		return ctx.Err()
	}
}

// Close stops accepting connections, closes those accepted (their
// transfers fail: the receiver aborts each import through the scrubber)
// and returns once each one's goroutine has.
func (s *Server) Close() error {
	if s == nil || s.serve == nil {
		return errNoServer
	}
	conns := s.stopAccepting()
	s.cancel()
	for _, c := range conns {
		c.Close()
	}
	s.conns.Wait()
	s.flushRefusals()
	return nil
}

// flushRefusals logs the refusals counted and not yet summarised, so that
// none goes unlogged when the process exits after Close or Shutdown.
func (s *Server) flushRefusals() {
	s.overMaxLog.stop()
	s.handshakeLog.stop()
}

// stopAccepting marks the server closed, closes its listeners and
// returns its connections.
func (s *Server) stopAccepting() []net.Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.mu.closed = true
	for ln := range s.mu.listeners {
		ln.Close()
	}
	conns := make([]net.Conn, 0, len(s.mu.conns))
	for c := range s.mu.conns {
		conns = append(conns, c)
	}
	return conns
}

// handle serves one connection: the handshake, the transfer, and the
// end of the receiver's messages.
func (s *Server) handle(raw net.Conn) {
	defer s.conns.Done()
	defer removeFrom(s, s.mu.conns, raw)
	defer raw.Close()
	conn, err := s.handshake(raw)
	if err != nil {
		// A handshake a closing server cut short was not refused.
		if s.ctx.Err() == nil {
			s.failedHandshakes.Add(1)
			s.handshakeLog.refused(s.ctx, raw.RemoteAddr(), err)
		}
		return
	}
	ep := &serverEnd{conn: conn, rd: newFrameReader(conn, s.opts.MaxMessageBytes), timeout: s.opts.MessageTimeout,
		wr: frameWriter{conn: conn, max: s.opts.MaxMessageBytes, timeout: s.opts.MessageTimeout}}
	defer ep.releaseBuffers()
	s.serve(s.ctx, ep) // the receiver counts, logs and answers its refusals
	ep.finish()
}

// handshake runs the TLS handshake, if any, and the hellos: the client's
// is read and checked first, then the server's sent. A client of another
// version gets the server's hello, which tells it which, and is refused.
func (s *Server) handshake(raw net.Conn) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(s.ctx, s.opts.HandshakeTimeout)
	defer cancel()
	deadline, _ := ctx.Deadline()
	raw.SetDeadline(deadline)
	conn := raw
	if s.tls != nil {
		tc := tls.Server(raw, s.tls)
		if err := tc.HandshakeContext(ctx); err != nil {
			return nil, fmt.Errorf("%w: tcpx: TLS handshake: %w", ErrHandshake, err)
		}
		conn = tc
	}
	herr := readHello(conn, "client")
	if herr != nil && !errors.Is(herr, errVersion) {
		return nil, herr // not ours: nothing to tell it
	}
	if _, err := conn.Write(hello()); err != nil {
		return nil, fmt.Errorf("%w: tcpx: hello: %w", handoff.ErrTransport, err)
	}
	if herr != nil {
		return nil, herr
	}
	conn.SetDeadline(time.Time{})
	return conn, nil
}

// serverEnd is the receiver's end of one transfer.
type serverEnd struct {
	conn    net.Conn
	rd      frameReader
	wr      frameWriter
	timeout time.Duration
	ended   bool // the sender's end of messages has been read
	one     [1][]byte
	// mu orders InterruptRecv's deadline after the one each Recv sets, so
	// that a Recv that begins as it is interrupted cannot wait a whole
	// MessageTimeout.
	mu struct {
		sync.Mutex
		interrupted bool
	}
	// spare holds read buffers that held messages (RecvHeld) gave back,
	// for the reader to take up again: a transfer that overlaps its
	// writes with its reads circulates two. Releases come from the
	// receiver's write goroutine, hence the lock.
	spare struct {
		sync.Mutex
		bufs [][]byte
	}
}

var (
	_ handoff.HoldingEndpoint       = (*serverEnd)(nil)
	_ handoff.InterruptibleEndpoint = (*serverEnd)(nil)
)

// errInterrupted is what Recv returns once the receiver has stopped
// waiting for the sender (InterruptRecv).
var errInterrupted = fmt.Errorf("%w: tcpx: the receiver stopped waiting for the sender", handoff.ErrTransport)

// Recv implements handoff.Endpoint: the sender's next message, in the
// connection's read buffer, valid until the next Recv; io.EOF after the
// sender's CloseSend. It waits at most Options.MessageTimeout, and not
// at all once InterruptRecv was called. Its errors, and Send's, go to
// handoff.Receiver, which wraps each in handoff.ErrTransport.
func (e *serverEnd) Recv() ([]byte, error) {
	if e.ended {
		return nil, io.EOF
	}
	e.mu.Lock()
	err := errInterrupted
	if !e.mu.interrupted {
		err = e.conn.SetReadDeadline(time.Now().Add(e.timeout))
	}
	e.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if e.rd.buf == nil { // the last buffer went with a held message
		e.rd.buf = e.takeSpare()
	}
	msg, err := e.rd.next()
	if err == io.EOF {
		e.ended = true
	}
	return msg, err
}

// RecvHeld implements handoff.HoldingEndpoint: the frame is read as by
// Recv, into the connection's read buffer, and the message takes that
// buffer with it; the next read goes into a spare, which release gives
// back.
func (e *serverEnd) RecvHeld() ([][]byte, func(), error) {
	msg, err := e.Recv()
	if err != nil {
		return nil, nil, err
	}
	buf := e.rd.buf // msg's bytes, at its start
	e.rd.buf = nil
	return [][]byte{msg}, func() { e.putSpare(buf) }, nil
}

func (e *serverEnd) takeSpare() []byte {
	e.spare.Lock()
	defer e.spare.Unlock()
	n := len(e.spare.bufs)
	if n == 0 {
		return getReadBuffer() // the second buffer of a transfer
	}
	b := e.spare.bufs[n-1]
	e.spare.bufs = e.spare.bufs[:n-1]
	return b
}

func (e *serverEnd) putSpare(b []byte) {
	e.spare.Lock()
	e.spare.bufs = append(e.spare.bufs, b[:0])
	e.spare.Unlock()
}

// releaseBuffers gives the connection's read buffers back for other
// connections, once the receiver has returned (and with it every held
// message).
func (e *serverEnd) releaseBuffers() {
	e.rd.release()
	e.spare.Lock()
	defer e.spare.Unlock()
	for _, b := range e.spare.bufs {
		putReadBuffer(b)
	}
	e.spare.bufs = nil
}

// RecvParts implements handoff.PartsEndpoint with one part: a frame is
// read whole into one buffer, straight from the socket, so there are no
// parts to save a copy of.
func (e *serverEnd) RecvParts() ([][]byte, error) {
	msg, err := e.Recv()
	if err != nil {
		return nil, err
	}
	e.one[0] = msg
	return e.one[:], nil
}

func (e *serverEnd) Send(msg []byte) error { return e.wr.write(msg, nil) }

// InterruptRecv implements handoff.InterruptibleEndpoint: a read deadline
// in the past ends a read in progress, and the flag every later Recv. The
// connection's writes are untouched, so the verdict still goes out.
func (e *serverEnd) InterruptRecv() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.mu.interrupted = true
	e.conn.SetReadDeadline(time.Unix(1, 0))
}

// finish ends the receiver's messages. A transfer the receiver ended
// before the sender's end of messages (a refusal; or a success, which
// ends at the seal, just before it) may still have frames coming: they
// are read and dropped, for lingerTimeout at most, so that the connection
// is not reset under the verdict before the sender has read it, which it
// does as soon as its next send sees the end.
func (e *serverEnd) finish() {
	if e.wr.end() != nil || e.ended {
		return
	}
	e.conn.SetReadDeadline(time.Now().Add(lingerTimeout))
	for {
		_, err := e.rd.next()
		if errors.Is(err, ErrMessageTooLarge) {
			io.Copy(io.Discard, e.conn) // no frames to tell apart any more
			return
		}
		if err != nil {
			return
		}
	}
}
