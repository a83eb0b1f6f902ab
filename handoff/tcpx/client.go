package tcpx

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvfence/kvfence/handoff"
)

// Transport is a handoff.Transport to one tcpx server: each Open dials a
// connection of its own for the transfer, and the transfer's end closes
// it. It is safe for concurrent use.
type Transport struct {
	addr string
	tls  *tls.Config // nil: Insecure
	opts Options

	mu struct {
		sync.Mutex
		closed bool
		open   map[*clientStream]struct{}
	}
}

var _ handoff.Transport = (*Transport)(nil)

// Dial returns a transport to addr (host:port) with sec (required: TLS,
// or Insecure for a trusted network) and opts. Nothing is connected
// until Open.
func Dial(addr string, sec Security, opts Options) (*Transport, error) {
	if err := sec.check(); err != nil {
		return nil, err
	}
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("%w: tcpx: address %q: %w", handoff.ErrInvalidArgument, addr, err)
	}
	t := &Transport{addr: addr, opts: opts}
	if sec.tls != nil {
		t.tls = sec.tls.Clone()
		if t.tls.ServerName == "" {
			t.tls.ServerName = host
		}
	}
	t.mu.open = make(map[*clientStream]struct{})
	return t, nil
}

// errNoTransport is what a nil or zero Transport answers: one not made
// by Dial.
var errNoTransport = fmt.Errorf("%w: tcpx: transport not made by Dial (Dial failed?)", handoff.ErrInvalidArgument)

// Close ends every transfer still open on t (each fails with
// handoff.ErrTransport) and refuses further Opens.
func (t *Transport) Close() error {
	if t == nil || t.addr == "" {
		return errNoTransport
	}
	t.mu.Lock()
	t.mu.closed = true
	open := t.mu.open
	t.mu.open = nil // and forget deletes from nothing
	t.mu.Unlock()
	for s := range open {
		s.hangUp()
	}
	return nil
}

// Open implements handoff.Transport: it connects (TCP, the TLS
// handshake, the client's hello), all within Options.HandshakeTimeout,
// and returns the transfer's stream. The server's hello is checked when
// its first message arrives, so no round trip is spent on it here. The
// connection closes when ctx is done (every call on the stream then
// fails with handoff.ErrTransport, wrapping ctx's cause) or the stream is
// closed. A nil or zero transport, or a nil context, is
// handoff.ErrInvalidArgument.
func (t *Transport) Open(ctx context.Context) (handoff.Stream, error) {
	switch {
	case t == nil || t.addr == "": // Dial sets addr, and nothing changes it
		return nil, errNoTransport
	case ctx == nil:
		return nil, fmt.Errorf("%w: tcpx: Open with a nil context", handoff.ErrInvalidArgument)
	}
	conn, err := t.connect(ctx)
	if err != nil {
		return nil, err
	}
	s := newClientStream(t, conn, ctx)
	t.mu.Lock()
	if t.mu.closed {
		t.mu.Unlock()
		conn.Close()
		return nil, fmt.Errorf("%w: tcpx: transport closed", handoff.ErrTransport)
	}
	t.mu.open[s] = struct{}{}
	t.mu.Unlock()
	s.stop = context.AfterFunc(ctx, s.hangUp)
	go s.read(newFrameReader(conn, t.opts.MaxMessageBytes))
	return s, nil
}

// connect dials t's server and sends the client's hello.
func (t *Transport) connect(ctx context.Context) (net.Conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("%w: tcpx: %w", handoff.ErrTransport, context.Cause(ctx))
	}
	hctx, cancel := context.WithTimeout(ctx, t.opts.HandshakeTimeout)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(hctx, "tcp", t.addr)
	if err != nil {
		return nil, fmt.Errorf("%w: tcpx: %w", handoff.ErrTransport, err)
	}
	if t.tls != nil {
		tc := tls.Client(conn, t.tls)
		if err := tc.HandshakeContext(hctx); err != nil {
			conn.Close()
			return nil, fmt.Errorf("%w: tcpx: TLS handshake with %s: %w", handoff.ErrTransport, t.addr, err)
		}
		conn = tc
	}
	deadline, _ := hctx.Deadline()
	conn.SetWriteDeadline(deadline)
	if _, err := conn.Write(hello()); err != nil {
		conn.Close()
		return nil, fmt.Errorf("%w: tcpx: hello to %s: %w", handoff.ErrTransport, t.addr, err)
	}
	return conn, nil
}

func (t *Transport) forget(s *clientStream) {
	t.mu.Lock()
	delete(t.mu.open, s)
	t.mu.Unlock()
}

// clientStream is the sender's end of one transfer. Send, SendViews,
// CloseSend and Recv are the sender's goroutine's; a reader goroutine
// takes the receiver's messages off the connection as they come, so that
// a transfer the receiver has ended stops at the next Send (ended),
// without waiting for the sender to look.
type clientStream struct {
	t          *Transport
	conn       net.Conn
	ctx        context.Context
	stop       func() bool // ctx's AfterFunc
	wr         frameWriter
	sendClosed bool

	// replies carries the receiver's messages; the reader closes it after
	// setting readErr (io.EOF after the receiver's end of messages), and
	// then readDone.
	replies  chan []byte
	readErr  error
	readDone chan struct{}
	// ended: the reader has stopped, at the receiver's end of messages or
	// because the connection failed; nothing the sender sends is read.
	ended atomic.Bool
	// broken is closed with the connection (hangUp).
	broken    chan struct{}
	hangOnce  sync.Once
	closeOnce sync.Once
}

var _ handoff.ViewStream = (*clientStream)(nil)

func newClientStream(t *Transport, conn net.Conn, ctx context.Context) *clientStream {
	return &clientStream{t: t, conn: conn, ctx: ctx,
		wr:      frameWriter{conn: conn, max: t.opts.MaxMessageBytes, timeout: t.opts.MessageTimeout},
		replies: make(chan []byte, 4), readDone: make(chan struct{}), broken: make(chan struct{})}
}

// hangUp closes the connection, which ends the reader.
func (s *clientStream) hangUp() {
	s.hangOnce.Do(func() {
		s.conn.Close()
		close(s.broken)
	})
}

// read is the reader goroutine: the server's hello, then its messages
// until its end of messages or a failure.
func (s *clientStream) read(fr frameReader) {
	defer close(s.readDone)
	defer fr.release()
	defer close(s.replies)
	defer s.ended.Store(true)
	s.conn.SetReadDeadline(time.Now().Add(s.t.opts.HandshakeTimeout))
	if err := readHello(s.conn, "server"); err != nil {
		s.readErr = s.fail("reading the server's hello", err)
		return
	}
	// The sender's waits for verdicts are bounded in Recv; the reader
	// itself waits as long as the transfer lasts.
	s.conn.SetReadDeadline(time.Time{})
	for {
		msg, err := fr.next()
		if err == io.EOF {
			s.readErr = io.EOF
			return
		}
		if err != nil {
			s.readErr = s.fail("receiving", err)
			return
		}
		select {
		case s.replies <- append([]byte(nil), msg...): // replies are few and small
		case <-s.broken:
			s.readErr = s.fail("receiving", net.ErrClosed)
			return
		}
	}
}

// fail wraps err, of the operation what, in handoff.ErrTransport (unless
// it is this package's, which does) and, if ctx is done (which closed the
// connection), names ctx's cause.
func (s *clientStream) fail(what string, err error) error {
	if !errors.Is(err, handoff.ErrTransport) {
		err = fmt.Errorf("%w: tcpx: %s: %w", handoff.ErrTransport, what, err)
	}
	if s.ctx.Err() != nil {
		return fmt.Errorf("%w (%w)", err, context.Cause(s.ctx))
	}
	return err
}

// errEnded is a Send after the receiver ended the transfer: its verdict,
// which Recv returns, says why.
var errEnded = fmt.Errorf("%w: tcpx: the receiver has ended the transfer", handoff.ErrTransport)

func (s *clientStream) Send(msg []byte) error { return s.send(msg, nil) }

// SendViews implements handoff.ViewStream: the frame's length prefix and
// head, then the views, go to the connection in one vectored write
// (writev on TCP), from the exporting pool's pages themselves; done runs
// once that write has returned, when the kernel has copied them (or the
// write failed).
func (s *clientStream) SendViews(head []byte, views [][]byte, done func()) error {
	defer done()
	return s.send(head, views)
}

func (s *clientStream) send(head []byte, parts [][]byte) error {
	switch {
	case s.sendClosed:
		return fmt.Errorf("%w: tcpx: send after CloseSend", handoff.ErrTransport)
	case s.ended.Load(): // which publishes readErr
		if s.readErr != io.EOF {
			return s.readErr
		}
		return errEnded
	case s.ctx.Err() != nil:
		// Done, and the connection closing (AfterFunc): do not race it.
		s.hangUp()
		return s.fail("sending", context.Cause(s.ctx))
	}
	if err := s.wr.write(head, parts); err != nil {
		return s.broke("sending", err)
	}
	return nil
}

// broke ends a stream whose write failed: a message may be half written,
// so the stream is done for. Hanging up lets Recv return at once with
// what the receiver had already said, rather than wait for verdicts that
// cannot come. A write the network failed (a reset) has the reader fail
// too, at once, after what arrived before the failure: a server that
// refused the handshake, and closed, which is what failed the write, is
// the better explanation, so the reader is given readGrace to get to it.
func (s *clientStream) broke(what string, err error) error {
	var ne net.Error
	if errors.As(err, &ne) && !ne.Timeout() {
		select {
		case <-s.readDone:
		case <-time.After(readGrace):
		}
	}
	s.hangUp()
	<-s.readDone
	if errors.Is(s.readErr, ErrHandshake) {
		return s.readErr
	}
	return s.fail(what, err)
}

// CloseSend sends the end of the sender's messages.
func (s *clientStream) CloseSend() error {
	if s.sendClosed {
		return nil
	}
	s.sendClosed = true
	if err := s.wr.end(); err != nil {
		return s.broke("closing", err)
	}
	return nil
}

// Recv returns the receiver's next message, waiting at most
// Options.MessageTimeout (after which it closes the connection); io.EOF
// after the receiver's end of messages.
func (s *clientStream) Recv() ([]byte, error) {
	timer := time.NewTimer(s.t.opts.MessageTimeout)
	defer timer.Stop()
	select {
	case msg, ok := <-s.replies:
		if !ok {
			return nil, s.readErr
		}
		return msg, nil
	case <-timer.C:
		s.hangUp()
		return nil, fmt.Errorf("%w: tcpx: no message from the receiver in %v", handoff.ErrTransport, s.t.opts.MessageTimeout)
	}
}

// Close closes the connection: a transfer still going fails on the
// receiver's side.
func (s *clientStream) Close() error {
	s.closeOnce.Do(func() {
		s.stop()
		s.hangUp()
		s.t.forget(s)
	})
	return nil
}
