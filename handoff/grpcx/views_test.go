package grpcx_test

import (
	"context"
	"io"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/grpcx"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// viewGeometry has 4 KiB region pages (16 tokens × 128 dims of fp16): past
// gRPC's pooling threshold, so the sender hands gRPC the pages themselves
// (handoff.ViewStream), where testkit's 256-byte regions are copied.
var viewGeometry = kvcache.Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 128, DType: kvcache.FP16}

func newViewPool(t testing.TB, pages int) *kvcache.Pool {
	return newViewPoolOn(t, pages, nil)
}

// newViewPoolOn is newViewPool on host, which the caller keeps to reach
// page memory behind the leases.
func newViewPoolOn(t testing.TB, pages int, host *cudaops.Host) *kvcache.Pool {
	p, err := testkit.NewPool(testkit.PoolConfig{Geometry: viewGeometry, Pages: pages, Tenants: tenants, Device: host})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// countViews counts the views a stream lent to gRPC and the ones it gave
// back (done), passing everything else on.
type countViews struct {
	inner handoff.Transport
	mu    sync.Mutex
	lent  int
	back  int
}

func (c *countViews) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := c.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	return &countingStream{ViewStream: st.(handoff.ViewStream), c: c}, nil
}

func (c *countViews) counts() (lent, back int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lent, c.back
}

type countingStream struct {
	handoff.ViewStream
	c *countViews
}

func (s *countingStream) SendViews(head []byte, views [][]byte, done func()) error {
	c := s.c // done must not reach the stream (see grpcx's SendViews)
	c.mu.Lock()
	c.lent++
	c.mu.Unlock()
	return s.ViewStream.SendViews(head, views, func() {
		c.mu.Lock()
		c.back++
		c.mu.Unlock()
		done()
	})
}

// The pages travel as views of the prefill pool's memory, not as a
// staged copy: every frame is lent and given back by the time Send
// returns, the decode pool gets exactly the bytes, and the prefill pages
// are released.
func TestHandoffSendsThePagesThemselves(t *testing.T) {
	prefill, decode := newViewPool(t, 512), newViewPool(t, 1024)
	recv, addr, _ := serve(t, decode, insecure.NewCredentials())
	tr, err := grpcx.Dial(addr, insecure.NewCredentials())
	require.NoError(t, err)
	defer tr.Close()
	cv := &countViews{inner: tr}
	l, err := testkit.Prefill(prefill, "views", "victim", 300*16+5)
	require.NoError(t, err)
	exp, err := newSender(t, time.Minute).Export(l, 16)
	require.NoError(t, err)
	require.NoError(t, exp.Send(context.Background(), cv))
	lent, back := cv.counts()
	assert.Greater(t, lent, 1, "the pages went as lent frames")
	assert.Equal(t, lent, back, "every lent frame was given back")
	dl, ok := recv.Take("views")
	require.True(t, ok)
	require.NoError(t, testkit.VerifyContent(decode, dl, "views"))
	require.NoError(t, dl.Release())
	assert.False(t, exp.Live())
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
}

// A page changed after the sender summed it (an engine writing an
// exported page, which it must not) is caught by the receiver's checksum
// exactly as with a staged copy: the views are summed where they lie, and
// gRPC sends what lies there when it copies them out.
func TestHandoffOfViewsDetectsAPageChangedInFlight(t *testing.T) {
	host := cudaops.NewHost()
	prefill, decode := newViewPoolOn(t, 512, host), newViewPool(t, 1024)
	recv, addr, _ := serve(t, decode, insecure.NewCredentials())
	tr, err := grpcx.Dial(addr, insecure.NewCredentials())
	require.NoError(t, err)
	defer tr.Close()
	l, err := testkit.Prefill(prefill, "torn", "victim", 64*16)
	require.NoError(t, err)
	table, err := l.BlockTable()
	require.NoError(t, err)
	exp, err := newSender(t, time.Minute).Export(l, 0)
	require.NoError(t, err)
	victim := host.PageBytes(1, table[4]) // in the second frame of 3 pages (newSender's 32 KiB frames)
	err = exp.Send(context.Background(), &tamper{inner: tr, at: 2, f: func() { victim[100] ^= 0xff }})
	var refused *handoff.RefusedError
	require.ErrorAs(t, err, &refused)
	assert.ErrorIs(t, err, kvcache.ErrChecksumMismatch)
	_, ok := recv.Take("torn")
	assert.False(t, ok)
	require.NoError(t, exp.Abort())
	require.NoError(t, testkit.Sweep(decode))
}

// tamper runs f after the sender has summed the at-th lent frame and
// before gRPC copies it out (SendViews is where the stream takes it).
type tamper struct {
	inner handoff.Transport
	at    int
	f     func()
}

func (c *tamper) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := c.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	return &tamperStream{ViewStream: st.(handoff.ViewStream), c: c}, nil
}

type tamperStream struct {
	handoff.ViewStream
	c *tamper
	n int
}

func (s *tamperStream) SendViews(head []byte, views [][]byte, done func()) error {
	if s.n++; s.n == s.c.at {
		s.c.f()
	}
	return s.ViewStream.SendViews(head, views, done)
}

// proxy relays one TCP connection to target, and can stop relaying
// (frozen: the sender's flow-control window fills and gRPC holds lent
// pages) and cut every connection.
type proxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	frozen bool
	thaw   chan struct{}
	conns  []net.Conn
}

func newProxy(t *testing.T, target string) *proxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &proxy{ln: ln, target: target, thaw: make(chan struct{})}
	t.Cleanup(func() { p.cut(); ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			go p.relay(s, c)
			go p.relay(c, s)
		}
	}()
	return p
}

func (p *proxy) relay(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		p.mu.Lock()
		frozen, thaw := p.frozen, p.thaw
		p.mu.Unlock()
		if frozen {
			<-thaw
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err == io.EOF {
				if tc, ok := dst.(*net.TCPConn); ok {
					tc.CloseWrite()
				}
			}
			return
		}
	}
}

func (p *proxy) freeze() {
	p.mu.Lock()
	p.frozen = true
	p.mu.Unlock()
}

// cut closes every relayed connection and lets blocked relays go.
func (p *proxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
	if p.frozen {
		close(p.thaw)
		p.frozen, p.thaw = false, make(chan struct{})
	}
}

// The connection dies while gRPC holds lent pages: frozen first, so that
// frames wait in gRPC's queues and its window is full, then cut. The
// export still ends (Abort), which it can only do once gRPC has let go of
// every lent page, and both pools end scrubbed.
//
// Whether gRPC still held a frame it then dropped without freeing (the
// path through the buffers' cleanup this test is about) depends on where
// its goroutines were at the cut: every attempt must end well, and the
// test runs up to 5 of them until one has taken that path.
func TestHandoffOfViewsEndsWhenTheConnectionDiesUnderIt(t *testing.T) {
	for attempt := 1; ; attempt++ {
		if dyingConnectionUnderLentViews(t) {
			return
		}
		if t.Failed() || attempt == 5 {
			t.Fatalf("no lent frame came back through its cleanup in %d attempts: the path this test is about did not run", attempt)
		}
		t.Logf("attempt %d: gRPC freed every frame it held; again", attempt)
	}
}

// dyingConnectionUnderLentViews runs one attempt of the test above and
// reports whether a lent frame came back through its buffers' cleanup.
func dyingConnectionUnderLentViews(t *testing.T) bool {
	prefill, decode := newViewPool(t, 4096), newViewPool(t, 4096)
	recv, addr, _ := serve(t, decode, insecure.NewCredentials())
	px := newProxy(t, addr)
	tr, err := grpcx.Dial(px.ln.Addr().String(), insecure.NewCredentials())
	require.NoError(t, err)
	defer tr.Close()
	cv := &countViews{inner: tr}
	l, err := testkit.Prefill(prefill, "dies", "victim", 3000*16) // 12 MiB: more than gRPC's window
	require.NoError(t, err)
	s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), ReclaimAfter: time.Hour})
	require.NoError(t, err)
	exp, err := s.Export(l, 0)
	require.NoError(t, err)
	collected := grpcx.LentCollected()
	sent := make(chan error, 1)
	go func() { sent <- exp.Send(context.Background(), &freezeAfter{inner: cv, at: 2, freeze: px.freeze}) }()
	if !assert.Eventually(t, func() bool {
		lent, back := cv.counts()
		return lent >= 4 && lent > back
	}, 10*time.Second, time.Millisecond, "frames wait in gRPC") {
		lent, back := cv.counts()
		select {
		case err := <-sent:
			t.Fatalf("%d frames lent, %d given back; Send returned %v", lent, back, err)
		default:
		}
		t.Fatalf("%d frames lent, %d given back", lent, back)
	}
	px.cut()
	select {
	case err := <-sent:
		assert.ErrorIs(t, err, handoff.ErrTransport)
	case <-time.After(30 * time.Second):
		t.Fatal("Send did not return after the connection died")
	}
	time.Sleep(3 * time.Second)
	runtime.GC()
	runtime.GC()
	aborted := make(chan error, 1)
	go func() { aborted <- exp.Abort() }()
	select {
	case err := <-aborted:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Abort never ended the export: the lent pages never came back")
	}
	assert.False(t, exp.Live())
	lent, back := cv.counts()
	assert.Equal(t, lent, back, "every lent frame was given back")
	require.Eventually(t, func() bool { return decode.Stats().InUsePages == 0 }, 10*time.Second, time.Millisecond)
	_, ok := recv.Take("dies")
	assert.False(t, ok)
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
	// Did gRPC drop a message it held without freeing it (grpc-go 1.85
	// drops what is queued on a dead connection's streams), so that only
	// the collection of its buffers gave its pages back?
	return grpcx.LentCollected() > collected
}

// freezeAfter calls freeze when the at-th frame is lent.
type freezeAfter struct {
	inner  handoff.Transport
	at     int
	freeze func()
}

func (c *freezeAfter) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := c.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	return &tamperStream{ViewStream: st.(handoff.ViewStream), c: &tamper{at: c.at, f: c.freeze}}, nil
}
