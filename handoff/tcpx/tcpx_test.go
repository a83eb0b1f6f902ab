package tcpx_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/handoff/tcpx"
	"github.com/kvfence/kvfence/kvcache"
)

var tenants = []kvcache.TenantConfig{{Name: "victim"}, {Name: "other"}}

func newPool(t testing.TB, pages int) *kvcache.Pool { return newPoolOf(t, testkit.Geometry, pages) }

// pool is a testkit pool of c, with the package's tenants, closed at the
// end of the test.
func pool(t testing.TB, c testkit.PoolConfig) *kvcache.Pool {
	c.Tenants = tenants
	p, err := testkit.NewPool(c)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

func newPoolOf(t testing.TB, g kvcache.Geometry, pages int) *kvcache.Pool {
	p, err := testkit.NewPool(testkit.PoolConfig{Geometry: g, Pages: pages, Tenants: tenants})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// server is a tcpx server on a loopback port, with its receiver.
type server struct {
	recv *handoff.Receiver
	srv  *tcpx.Server
	addr string
	done chan error // Serve's result
}

// serve starts a tcpx server on a loopback port that imports into the
// decode pool of rc (whose Key defaults to testkit's), closed at the end
// of the test.
func serve(t testing.TB, rc handoff.ReceiverConfig, sec tcpx.Security, opts tcpx.Options) *server {
	if rc.Key == nil {
		rc.Key = testkit.Key()
	}
	recv, err := handoff.NewReceiver(rc)
	require.NoError(t, err)
	srv, err := tcpx.NewServer(recv, sec, opts)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &server{recv: recv, srv: srv, addr: ln.Addr().String(), done: make(chan error, 1)}
	go func() { s.done <- srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	return s
}

func dial(t testing.TB, addr string, sec tcpx.Security, opts tcpx.Options) *tcpx.Transport {
	tr, err := tcpx.Dial(addr, sec, opts)
	require.NoError(t, err)
	t.Cleanup(func() { tr.Close() })
	return tr
}

func newSender(t testing.TB, reclaim time.Duration) *handoff.Sender {
	s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), ReclaimAfter: reclaim, FrameBytes: 32 << 10})
	require.NoError(t, err)
	return s
}

// export prefills a lease of prompt tokens for request id and exports it.
func export(t testing.TB, s *handoff.Sender, pool *kvcache.Pool, id string, prompt int) *handoff.Export {
	l, err := testkit.Prefill(pool, id, "victim", prompt)
	require.NoError(t, err)
	exp, err := s.Export(l, 16)
	require.NoError(t, err)
	return exp
}

// takeVerified takes the decode lease of id, checks it holds what
// prefill wrote, and releases it.
func takeVerified(t testing.TB, s *server, decode *kvcache.Pool, id string) {
	t.Helper()
	dl, ok := s.recv.Take(id)
	require.True(t, ok, "no decode lease for %s", id)
	require.NoError(t, testkit.VerifyContent(decode, dl, id))
	require.NoError(t, dl.Release())
}

// watch passes a transport's streams on, counting the frames lent to
// them (SendViews) and given back (done), and calls hook, if set, before
// the n-th frame (from 1) goes to the stream.
type watch struct {
	inner      handoff.Transport
	hook       func(n int, st handoff.Stream, head []byte)
	mu         sync.Mutex
	lent, back int
}

func (w *watch) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := w.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	return &watchedStream{ViewStream: st.(handoff.ViewStream), w: w}, nil
}

func (w *watch) counts() (lent, back int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lent, w.back
}

type watchedStream struct {
	handoff.ViewStream
	w *watch
	n int
}

func (s *watchedStream) SendViews(head []byte, views [][]byte, done func()) error {
	w := s.w
	s.n++
	w.mu.Lock()
	w.lent++
	w.mu.Unlock()
	if w.hook != nil {
		w.hook(s.n, s.ViewStream, head)
	}
	return s.ViewStream.SendViews(head, views, func() {
		w.mu.Lock()
		w.back++
		w.mu.Unlock()
		done()
	})
}

// testCert is a certificate for 127.0.0.1 and the roots that trust it:
// net/http/httptest's, which saves making one.
func testCert(t testing.TB) (tls.Certificate, *x509.CertPool) {
	hs := httptest.NewUnstartedServer(nil)
	hs.StartTLS()
	defer hs.Close()
	roots := x509.NewCertPool()
	roots.AddCert(hs.Certificate())
	return hs.TLS.Certificates[0], roots
}

// Over TLS: a client that does not trust the server's certificate, and
// a plain-TCP client, never get a page across (the export stays pinned
// for a retry); a trusting client hands off. A TLS client on a plain-TCP
// server is refused at its handshake.
func TestTLSHandoff(t *testing.T) {
	cert, roots := testCert(t)
	prefill, decode := newPool(t, 512), newPool(t, 1024)
	srv := serve(t, handoff.ReceiverConfig{Pool: decode},
		tcpx.TLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13}), tcpx.Options{})
	ctx := context.Background()
	s := newSender(t, time.Minute)
	exp := export(t, s, prefill, "tls-1", 300*16)

	untrusted := dial(t, srv.addr, tcpx.TLS(&tls.Config{RootCAs: x509.NewCertPool()}), tcpx.Options{})
	err := exp.Send(ctx, untrusted)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.ErrorContains(t, err, "certificate")
	assert.True(t, exp.Live())

	plain := dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{})
	err = exp.Send(ctx, plain)
	assert.ErrorIs(t, err, tcpx.ErrHandshake)
	assert.True(t, exp.Live())

	tr := dial(t, srv.addr, tcpx.TLS(&tls.Config{RootCAs: roots}), tcpx.Options{}) // ServerName from the address
	require.NoError(t, exp.Send(ctx, tr))
	takeVerified(t, srv, decode, "tls-1")
	assert.Equal(t, handoff.ReceiverStats{Imported: 1}, srv.recv.Stats(), "the refused connections began no transfer")

	plainSrv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
	exp = export(t, s, prefill, "tls-2", 16)
	err = exp.Send(ctx, dial(t, plainSrv.addr, tcpx.TLS(&tls.Config{RootCAs: roots}), tcpx.Options{}))
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.ErrorContains(t, err, "TLS handshake")
	require.NoError(t, exp.Abort())
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
}

// A state slot larger than tcpx's message bound crosses in parts when
// the sender's frames fit the bound; a sender whose frames do not is
// refused by the transport with tcpx.ErrMessageTooLarge, and nothing is
// imported or left behind on either side.
func TestHybridSlotLargerThanAMessage(t *testing.T) {
	const bound = 8 << 10 // the hybrid's slot is 16.2 KiB
	opts := tcpx.Options{MaxMessageBytes: bound}
	for _, tc := range []struct {
		frame int
		want  error
	}{
		{bound, nil},
		{4 * bound, tcpx.ErrMessageTooLarge},
	} {
		t.Run(fmt.Sprint(tc.frame), func(t *testing.T) {
			prefill := pool(t, testkit.PoolConfig{Spec: testkit.HybridSpec(), Pages: 64})
			decode := pool(t, testkit.PoolConfig{Spec: testkit.HybridSpec(), Pages: 64})
			srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), opts)
			tr := dial(t, srv.addr, tcpx.Insecure(), opts)
			s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), FrameBytes: tc.frame})
			require.NoError(t, err)
			exp := export(t, s, prefill, "slot", 40)
			err = exp.Send(context.Background(), tr)
			if tc.want == nil {
				require.NoError(t, err)
				takeVerified(t, srv, decode, "slot")
			} else {
				require.ErrorIs(t, err, tc.want)
				require.NoError(t, exp.Abort())
				_, ok := srv.recv.Take("slot")
				require.False(t, ok)
				require.Eventually(t, func() bool { return decode.Stats().LiveLeases == 0 }, 5*time.Second, time.Millisecond)
			}
			require.NoError(t, testkit.Sweep(prefill))
			require.NoError(t, testkit.Sweep(decode))
		})
	}
}
