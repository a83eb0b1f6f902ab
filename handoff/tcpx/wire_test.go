package tcpx_test

import (
	"context"
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/grpcx"
	"github.com/kvfence/kvfence/handoff/tcpx"
)

// logLines is a log's records, a line of text each, from any goroutine
// (a slog handler writes one record at a time); a test reads them as they
// come.
type logLines chan string

func newLogLines() logLines { return make(logLines, 1024) }

func (l logLines) Write(p []byte) (int, error) {
	select {
	case l <- string(p):
	default: // a test reads the first few
	}
	return len(p), nil
}

func (l logLines) logger() *slog.Logger { return slog.New(slog.NewTextHandler(l, nil)) }

// eventuallyLogs waits for a record that holds each of want.
func eventuallyLogs(t *testing.T, log logLines, want ...string) {
	t.Helper()
	var seen []string
	timeout := time.After(10 * time.Second)
	for {
		select {
		case line := <-log:
			if !slices.ContainsFunc(want, func(w string) bool { return !strings.Contains(line, w) }) {
				return
			}
			seen = append(seen, line)
		case <-timeout:
			t.Errorf("no record names %q; the log has:\n%s", want, strings.Join(seen, ""))
			return
		}
	}
}

// rawClient connects to addr and sends the tcpx hello.
func rawClient(t *testing.T, addr string) net.Conn {
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	_, err = c.Write(tcpxHello)
	require.NoError(t, err)
	return c
}

// readAll reads what the server sends until it closes the connection.
func readAll(t *testing.T, c net.Conn) []byte {
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		var ne net.Error
		require.False(t, assert.ErrorAs(t, err, &ne) && ne.Timeout(), "the server never closed the connection")
	}
	return got
}

// A peer's length prefix over the server's limit is refused before
// anything is allocated for it: before the manifest (the transfer fails
// at once, the server ends its messages), and mid-transfer (the sender
// hears why, as a refusal). Frames over the server's configured limit are
// refused the same way, naming it.
func TestOversizedLengthPrefix(t *testing.T) {
	t.Run("before the manifest", func(t *testing.T) {
		log := newLogLines()
		srv := serve(t, handoff.ReceiverConfig{Pool: newPool(t, 64), Logger: log.logger()}, tcpx.Insecure(), tcpx.Options{})
		c := rawClient(t, srv.addr)
		_, err := c.Write([]byte{0xff, 0xff, 0xff, 0xff})
		require.NoError(t, err)
		// The server's hello, then the end of its messages, then it closes
		// (once its linger is over, or as soon as this end closes).
		got := make([]byte, len(tcpxHello)+4)
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = io.ReadFull(c, got)
		require.NoError(t, err)
		assert.Equal(t, append(tcpxHello, 0, 0, 0, 0), got)
		require.Eventually(t, func() bool { return refusedBy(srv.recv, "transport") == 1 }, 10*time.Second, time.Millisecond)
		eventuallyLogs(t, log, "4294967295 bytes", "limit is 67108864")
	})
	t.Run("mid-transfer", func(t *testing.T) {
		prefill, decode := newPool(t, 1024), newPool(t, 2048)
		srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
		exp := export(t, newSender(t, time.Minute), prefill, "lies", 1000*16)
		w := &watch{inner: dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{}), hook: func(n int, st handoff.Stream, _ []byte) {
			if n == 3 {
				_, err := tcpx.RawConn(st).Write([]byte{0xff, 0xff, 0xff, 0x7f})
				require.NoError(t, err)
			}
		}}
		refused := requireRefused(t, exp.Send(context.Background(), w), "import", handoff.ErrTransport)
		assert.Contains(t, refused.Message, "2147483647 bytes")
		endAndSweep(t, exp, prefill, decode)
	})
	t.Run("frames over the server's limit", func(t *testing.T) {
		prefill, decode := newPool(t, 512), newPool(t, 1024)
		srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{MaxMessageBytes: 16 << 10})
		exp := export(t, newSender(t, time.Minute), prefill, "big-frames", 300*16) // 32 KiB frames
		err := exp.Send(context.Background(), dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{}))
		refused := requireRefused(t, err, "import", handoff.ErrTransport)
		assert.Contains(t, refused.Message, "limit is 16384")
		endAndSweep(t, exp, prefill, decode)
	})
	t.Run("frames over the sender's own limit", func(t *testing.T) {
		prefill, decode := newPool(t, 512), newPool(t, 1024)
		srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
		exp := export(t, newSender(t, time.Minute), prefill, "big-frames", 300*16)
		err := exp.Send(context.Background(), dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{MaxMessageBytes: 16 << 10}))
		assert.ErrorIs(t, err, tcpx.ErrMessageTooLarge)
		require.Eventually(t, func() bool { return refusedBy(srv.recv, "transport") == 1 }, 10*time.Second, time.Millisecond)
		endAndSweep(t, exp, prefill, decode)
	})
}

// A frame cut short by the peer closing fails the transfer as a transport
// failure; the server does not wait for the rest.
func TestTruncatedFrame(t *testing.T) {
	log := newLogLines()
	srv := serve(t, handoff.ReceiverConfig{Pool: newPool(t, 64), Logger: log.logger()}, tcpx.Insecure(), tcpx.Options{})
	c := rawClient(t, srv.addr)
	_, err := c.Write(append(binary.LittleEndian.AppendUint32(nil, 100), "only ten b"...))
	require.NoError(t, err)
	c.(*net.TCPConn).CloseWrite()
	assert.Equal(t, append(tcpxHello, 0, 0, 0, 0), readAll(t, c))
	require.Eventually(t, func() bool { return refusedBy(srv.recv, "transport") == 1 }, 10*time.Second, time.Millisecond)
	eventuallyLogs(t, log, "unexpected EOF")
}

// What is not a tcpx peer is refused at the hello, clearly, on both ends:
// the server logs what it got and begins no transfer; a client names what
// answered.
func TestWrongHandshake(t *testing.T) {
	t.Run("clients", func(t *testing.T) {
		log := newLogLines()
		prefill := newPool(t, 64)
		srv := serve(t, handoff.ReceiverConfig{Pool: newPool(t, 64)}, tcpx.Insecure(),
			tcpx.Options{Logger: log.logger(), HandshakeTimeout: 200 * time.Millisecond})
		// Each wrong client's own record, not a summary of those after the
		// first (TestBadHelloFloodFloodsTheLog).
		tcpx.SetRefusalLogWindow(srv.srv, 0)

		http, err := net.Dial("tcp", srv.addr)
		require.NoError(t, err)
		defer http.Close()
		_, err = io.WriteString(http, "GET / HTTP/1.1\r\nHost: decode\r\n\r\n")
		require.NoError(t, err)
		assert.Empty(t, readAll(t, http), "an HTTP client gets no answer")
		eventuallyLogs(t, log, "not a kvfence tcpx endpoint", `GET / HT`)

		g, err := grpcx.Dial(srv.addr, insecure.NewCredentials())
		require.NoError(t, err)
		defer g.Close()
		exp := export(t, newSender(t, time.Minute), prefill, "grpc", 16)
		assert.ErrorIs(t, exp.Send(context.Background(), g), handoff.ErrTransport)
		assert.True(t, exp.Live())
		require.NoError(t, exp.Abort())
		eventuallyLogs(t, log, "an HTTP/2 or gRPC client")

		other, err := net.Dial("tcp", srv.addr)
		require.NoError(t, err)
		defer other.Close()
		_, err = other.Write([]byte("KVFTCPX\x02"))
		require.NoError(t, err)
		assert.Equal(t, tcpxHello, readAll(t, other), "a client of another version is told which this server speaks")
		eventuallyLogs(t, log, "another version of tcpx, 2 (this end: 1)")

		silent, err := net.Dial("tcp", srv.addr)
		require.NoError(t, err)
		defer silent.Close()
		assert.Empty(t, readAll(t, silent), "a client that says nothing is dropped after the handshake timeout")
		eventuallyLogs(t, log, "no hello from the client within the handshake timeout")

		assert.Equal(t, handoff.ReceiverStats{}, srv.recv.Stats(), "no transfer began")
	})
	servers := []struct {
		name string
		says []string // one of
		addr func(t *testing.T) string
	}{
		// Go's HTTP server answers a request line, and waits for one
		// until the bytes it got hold a newline.
		{"an HTTP server", []string{`"HTTP/1.1" (an HTTP server)`, "no hello from the server within the handshake timeout"}, func(t *testing.T) string {
			hs := httptest.NewServer(http.NotFoundHandler())
			t.Cleanup(hs.Close)
			return hs.Listener.Addr().String()
		}},
		{"a gRPC server", []string{"(an HTTP/2 or gRPC server: its SETTINGS frame)"}, func(t *testing.T) string {
			gs, err := grpcx.NewServer(serve(t, handoff.ReceiverConfig{Pool: newPool(t, 64)}, tcpx.Insecure(), tcpx.Options{}).recv, insecure.NewCredentials())
			require.NoError(t, err)
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			go gs.Serve(ln)
			t.Cleanup(gs.Stop)
			return ln.Addr().String()
		}},
		{"a tcpx server of another version", []string{"another version of tcpx, 2 (this end: 1)"}, func(t *testing.T) string {
			return fakeServer(t, func(c net.Conn) { c.Write([]byte("KVFTCPX\x02")) })
		}},
	}
	for _, tc := range servers {
		t.Run(tc.name, func(t *testing.T) {
			prefill := newPool(t, 64)
			exp := export(t, newSender(t, time.Minute), prefill, "wrong-server", 16)
			err := exp.Send(context.Background(), dial(t, tc.addr(t), tcpx.Insecure(), tcpx.Options{HandshakeTimeout: 200 * time.Millisecond}))
			assert.ErrorIs(t, err, tcpx.ErrHandshake)
			require.Error(t, err)
			assert.True(t, slices.ContainsFunc(tc.says, func(says string) bool { return strings.Contains(err.Error(), says) }),
				"%v names none of %q", err, tc.says)
			assert.True(t, exp.Live())
			require.NoError(t, exp.Abort())
		})
	}
}
