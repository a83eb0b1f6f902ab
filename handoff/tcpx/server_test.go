package tcpx_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/handoff/tcpx"
	"github.com/kvfence/kvfence/internal/testlog"
)

// Shutdown stops accepting at once but lets a transfer in flight finish,
// and returns once it has; Serve returns ErrServerClosed, and a transfer
// opened after finds no server.
func TestShutdownWaitsForTransfers(t *testing.T) {
	prefill, decode := newPool(t, 1024), newPool(t, 2048)
	srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
	tr := dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{})
	exp := export(t, newSender(t, time.Minute), prefill, "graceful", 300*16) // 5 frames
	shutdown := make(chan error, 1)
	w := &watch{inner: tr, hook: func(n int, _ handoff.Stream, _ []byte) {
		switch n {
		case 1:
			go func() { shutdown <- srv.srv.Shutdown(context.Background()) }()
			require.Eventually(t, func() bool { return serveReturned(srv) }, 10*time.Second, time.Millisecond, "Serve returned ErrServerClosed")
		case 5:
			select {
			case err := <-shutdown:
				t.Errorf("Shutdown returned %v before the transfer ended", err)
			default:
			}
		}
	}}
	require.NoError(t, exp.Send(context.Background(), w))
	require.NoError(t, <-shutdown)
	takeVerified(t, srv, decode, "graceful")

	exp = export(t, newSender(t, time.Minute), prefill, "late", 16)
	assert.ErrorIs(t, exp.Send(context.Background(), tr), handoff.ErrTransport)
	endAndSweep(t, exp, prefill, decode)
}

// serveReturned reports whether srv's Serve has returned
// ErrServerClosed.
func serveReturned(srv *server) bool {
	select {
	case err := <-srv.done:
		srv.done <- err
		return errors.Is(err, tcpx.ErrServerClosed)
	default:
		return false
	}
}

// A Shutdown whose context ends before the transfers do closes them, as
// Close: the sender fails, the import is aborted before Shutdown returns.
func TestShutdownPastItsDeadlineClosesTransfers(t *testing.T) {
	prefill, decode := newPool(t, 1024), newPool(t, 2048)
	srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
	exp := export(t, newSender(t, time.Minute), prefill, "cut-short", 1000*16)
	var inUse int
	w := &watch{inner: dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{}), hook: func(n int, _ handoff.Stream, _ []byte) {
		if n == 2 {
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancel()
			assert.ErrorIs(t, srv.srv.Shutdown(ctx), context.DeadlineExceeded)
			inUse = decode.Stats().InUsePages
		}
	}}
	assert.ErrorIs(t, exp.Send(context.Background(), w), handoff.ErrTransport)
	assert.Zero(t, inUse, "decode pages in use when Shutdown returned")
	endAndSweep(t, exp, prefill, decode)
}

// Serve on a server already closed returns ErrServerClosed (and closes
// the listener); on a listener that fails, that failure.
func TestServeAfterClose(t *testing.T) {
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: newPool(t, 16), Key: testkit.Key()})
	require.NoError(t, err)
	srv, err := tcpx.NewServer(recv, tcpx.Insecure(), tcpx.Options{})
	require.NoError(t, err)
	broken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	broken.Close()
	err = srv.Serve(broken)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.NotErrorIs(t, err, tcpx.ErrServerClosed)

	require.NoError(t, srv.Close())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	assert.ErrorIs(t, srv.Serve(ln), tcpx.ErrServerClosed)
	_, err = net.Dial("tcp", ln.Addr().String())
	assert.Error(t, err, "the listener is closed")
}

// Close while connections keep arriving, in every state (just accepted,
// in the hello, mid-frame, mid-transfer, over MaxConns): it returns, Serve
// returns ErrServerClosed, every connection the server took is closed, and
// the race detector sees nothing. Run with -race.
func TestCloseWhileConnectionsArrive(t *testing.T) {
	for _, maxConns := range []int{0, 4} {
		t.Run(fmt.Sprint("MaxConns=", maxConns), func(t *testing.T) { closeWhileConnectionsArrive(t, maxConns) })
	}
}

func closeWhileConnectionsArrive(t *testing.T, maxConns int) {
	srv := serve(t, handoff.ReceiverConfig{Pool: newPool(t, 64)}, tcpx.Insecure(),
		tcpx.Options{HandshakeTimeout: time.Minute, MessageTimeout: time.Minute, MaxConns: maxConns})
	stop := make(chan struct{})
	var clients sync.WaitGroup
	var conns sync.Mutex
	var held []net.Conn
	for i := range 8 {
		clients.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				c, err := net.Dial("tcp", srv.addr)
				if err != nil {
					return // the listener is closed
				}
				// Say nothing, half a hello, a hello, or a hello and half a frame.
				switch (i + n) % 4 {
				case 1:
					c.Write(tcpxHello[:3])
				case 2:
					c.Write(tcpxHello)
				case 3:
					c.Write(append(append([]byte(nil), tcpxHello...), 10, 0, 0, 0, 'M'))
				}
				conns.Lock()
				held = append(held, c)
				conns.Unlock()
			}
		})
	}
	time.Sleep(100 * time.Millisecond)
	closed := make(chan error, 1)
	go func() { closed <- srv.srv.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return")
	}
	close(stop)
	clients.Wait()
	require.Eventually(t, func() bool { return serveReturned(srv) }, 10*time.Second, time.Millisecond)
	require.NotEmpty(t, held)
	// Every connection was closed by the server, or never accepted: none
	// is left open. A connection never accepted is not always reset when
	// the listener closes: one whose last ACK the kernel dropped (its
	// accept queue full) is established on the client's side only, and
	// the kernel answers it only when a segment comes. So each sends a
	// byte first: one the server closed, or never had, is reset; one it
	// left open takes the byte and says nothing.
	for _, c := range held {
		c.SetDeadline(time.Now().Add(5 * time.Second))
		c.Write([]byte{0})
		_, err := io.Copy(io.Discard, c)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("a connection left open after Close: %v", err)
		}
		c.Close()
	}
}

// A server holds a goroutine, and soon a read buffer, for every
// connection it accepts, before anything on it is authenticated: past
// MaxConns connections being served (here two clients that say nothing,
// in their handshakes), another is closed at once, nothing read from it,
// and counted; once a slot is free again, a transfer goes through.
func TestConnectionsOverMaxConnsClosedUnread(t *testing.T) {
	prefill, decode := newPool(t, 1024), newPool(t, 2048)
	log := &testlog.Buffer{}
	srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(),
		tcpx.Options{MaxConns: 2, HandshakeTimeout: time.Minute, Logger: log.Logger()})
	var silent []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", srv.addr)
		require.NoError(t, err)
		defer c.Close()
		silent = append(silent, c)
	}
	require.Eventually(t, func() bool { return srv.srv.Stats().Conns == 2 }, 10*time.Second, time.Millisecond)

	over, err := net.Dial("tcp", srv.addr)
	require.NoError(t, err)
	defer over.Close()
	over.Write(tcpxHello) // fails if the server has already hung up
	over.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(over)
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "the connection over MaxConns was kept open: %v", err)
	assert.Empty(t, got, "the connection over MaxConns was answered")
	assert.Equal(t, tcpx.ServerStats{Conns: 2, OverMaxConns: 1}, srv.srv.Stats())
	log.WaitFor(t, "2 connections being served (Options.MaxConns)")

	silent[0].Close()
	require.Eventually(t, func() bool { return srv.srv.Stats().Conns == 1 }, 10*time.Second, time.Millisecond)
	exp := export(t, newSender(t, time.Minute), prefill, "after", 100*16)
	require.NoError(t, exp.Send(context.Background(), dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{})))
	takeVerified(t, srv, decode, "after")
	require.NoError(t, testkit.Sweep(prefill))
}
