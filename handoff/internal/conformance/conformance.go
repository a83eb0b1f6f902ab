// Package conformance is the handoff conformance suite: what every
// transport of this module must do, run over each of them (grpcx, tcpx,
// ucxx) by Run, so that they are held to one suite rather than to copies
// of it. A transport plugs in through a Harness: how to serve a receiver,
// dial the server, and close it. The suite drives real handoffs through
// it, breaks them at every point a transport can break, and audits both
// pools after each (testkit.Sweep: accounting, canaries, no tenant's
// bytes in a free page).
//
// The suite sees a transfer through a wrapper around the transport's
// streams (watch), which passes everything on and counts the page
// operations (data frames, and writes into the receiver's memory on a
// transport that makes them), so that a test can act between two of them
// whichever way the pages travel.
package conformance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// Harness is what the suite needs of a transport.
type Harness struct {
	// Serve starts a server that imports with recv, closed when the test
	// ends.
	Serve func(t testing.TB, recv *handoff.Receiver) Server
	// Cut, if set, breaks the connection under a stream the transport's
	// Open returned, abruptly (a reset), as a network failure would.
	Cut func(st handoff.Stream)
}

// Server is a transport's server, as the suite uses it.
type Server interface {
	// Dial returns a transport to the server, closed when the test ends.
	Dial(t testing.TB) handoff.Transport
	// Close closes the server: the transfers in flight fail, and it
	// returns once the receiver has ended every import it began.
	Close() error
}

// Run runs the suite over the transport h plugs in.
func Run(t *testing.T, h Harness) {
	for _, tc := range []struct {
		name string
		test func(*testing.T, Harness)
	}{
		{"RoundTrip", roundTrip},
		{"Hybrid", hybrid},
		{"Concurrent", concurrent},
		{"RefusedAtTheManifest", refusedAtTheManifest},
		{"TamperedManifest", tamperedManifest},
		{"ForgedGenerationWhilePagesFlow", forgedGeneration},
		{"PageChangedAfterItWasSummed", pageChanged},
		{"ConnectionDropped", connectionDropped},
		{"ServerClosedMidTransfer", serverClosed},
		{"ContextCancelled", contextCancelled},
		{"SilentSender", silentSender},
		{"DuplicateOnTwoStreams", duplicate},
		{"CanarySoak", canarySoak},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.test(t, h) })
	}
}

var tenants = []kvcache.TenantConfig{{Name: "victim"}, {Name: "other"}}

func newPool(t testing.TB, pages int) *kvcache.Pool {
	p, err := testkit.NewPool(testkit.PoolConfig{Pages: pages, Tenants: tenants})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// env is a prefill pool, a decode pool, a receiver into the decode pool
// served over the transport, and a sender.
type env struct {
	prefill, decode *kvcache.Pool
	recv            *handoff.Receiver
	srv             Server
	s               *handoff.Sender
}

// frameBytes is the senders' frame size: 7 testkit pages a data frame,
// so a test moves hundreds of frames in little memory.
const frameBytes = 4 << 10

func setup(t *testing.T, h Harness, prefillPages, decodePages int, rc handoff.ReceiverConfig) *env {
	e := &env{prefill: newPool(t, prefillPages), decode: newPool(t, decodePages)}
	rc.Pool, rc.Key = e.decode, testkit.Key()
	recv, err := handoff.NewReceiver(rc)
	require.NoError(t, err)
	e.recv = recv
	e.srv = h.Serve(t, recv)
	e.s, err = handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), FrameBytes: frameBytes, ReclaimAfter: time.Minute})
	require.NoError(t, err)
	return e
}

// export prefills a lease of prompt tokens for request id and exports it.
func (e *env) export(t testing.TB, id string, prompt int) *handoff.Export {
	l, err := testkit.Prefill(e.prefill, id, "victim", prompt)
	require.NoError(t, err)
	exp, err := e.s.Export(l, 16)
	require.NoError(t, err)
	return exp
}

// takeVerified takes the decode lease of id, checks it holds what
// prefill wrote, and releases it.
func (e *env) takeVerified(t testing.TB, id string) {
	t.Helper()
	dl, ok := e.recv.Take(id)
	require.True(t, ok, "no decode lease for %s", id)
	require.NoError(t, testkit.VerifyContent(e.decode, dl, id))
	require.NoError(t, dl.Release())
}

// end aborts exp (a failed transfer leaves the pages pinned for a retry)
// and audits both pools once the decode side has let go.
func (e *env) end(t *testing.T, exp *handoff.Export) {
	t.Helper()
	require.NoError(t, exp.Abort())
	assert.False(t, exp.Live())
	require.Eventually(t, func() bool { return e.decode.Stats().InUsePages == 0 }, 10*time.Second, time.Millisecond)
	require.NoError(t, testkit.Sweep(e.prefill))
	require.NoError(t, testkit.Sweep(e.decode))
}

// refusedBy is how many transfers recv refused for the reason named name.
func refusedBy(recv *handoff.Receiver, name string) uint64 {
	for code, n := range handoff.ReasonNames {
		if n == name {
			return recv.Stats().RefusedBy[code]
		}
	}
	panic("no reason " + name)
}

// requireRefused checks that err is the receiver's refusal at stage for
// reason.
func requireRefused(t *testing.T, err error, stage string, reason error) *handoff.RefusedError {
	t.Helper()
	var refused *handoff.RefusedError
	require.ErrorAs(t, err, &refused)
	assert.Equal(t, stage, refused.Stage)
	assert.ErrorIs(t, err, reason)
	return refused
}

// Prompts of one token, one page and many frames' worth arrive exactly
// and leave both pools clean, every page the stream was lent given back;
// a replay of one of them is refused.
func roundTrip(t *testing.T, h Harness) {
	e := setup(t, h, 2048, 4096, handoff.ReceiverConfig{})
	w := &watch{inner: e.srv.Dial(t)}
	ctx := context.Background()
	for _, tc := range []struct {
		id     string
		prompt int
	}{{"first", 1}, {"second", 16}, {"third", 1500*16 + 7}} {
		exp := e.export(t, tc.id, tc.prompt)
		require.NoError(t, exp.Send(ctx, w))
		assert.False(t, exp.Live())
		e.takeVerified(t, tc.id)
	}
	ops, lent, back := w.counts()
	assert.Greater(t, ops, 3, "the pages went in several operations")
	assert.Equal(t, lent, back, "every page lent to the stream was given back")

	exp := e.export(t, "first", 1)
	err := exp.Send(ctx, w)
	requireRefused(t, err, "manifest", handoff.ErrReplay)
	require.NoError(t, exp.Abort())
	assert.Equal(t, uint64(3), e.recv.Stats().Imported)
	require.NoError(t, testkit.Sweep(e.prefill))
	require.NoError(t, testkit.Sweep(e.decode))
}

// A hybrid model's prompt crosses whole: per-token pages, the window's
// pages at the prompt's end and the state slot (in parts where the
// frames are smaller than it, for a transport that sends frames); the
// decode lease holds exactly what prefill wrote, in every group, and
// both pools end clean.
func hybrid(t *testing.T, h Harness) {
	for _, frame := range []int{handoff.MinFrameBytes, 32 << 10} {
		pool := func() *kvcache.Pool {
			p, err := testkit.NewPool(testkit.PoolConfig{Spec: testkit.HybridSpec(), Pages: 128, Tenants: tenants})
			require.NoError(t, err)
			t.Cleanup(func() { p.Close() })
			return p
		}
		prefill, decode := pool(), pool()
		recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: testkit.Key()})
		require.NoError(t, err)
		tr := h.Serve(t, recv).Dial(t)
		s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), FrameBytes: frame})
		require.NoError(t, err)
		for i, prompt := range []int{5, 16*30 + 1} {
			id := fmt.Sprintf("h%d-%d", frame, i)
			l, err := testkit.Prefill(prefill, id, "victim", prompt)
			require.NoError(t, err)
			exp, err := s.Export(l, 16)
			require.NoError(t, err)
			require.NoError(t, exp.Send(context.Background(), tr))
			dl, ok := recv.Take(id)
			require.True(t, ok, "no decode lease for %s", id)
			require.NoError(t, testkit.VerifyContent(decode, dl, id))
			require.NoError(t, dl.Release())
		}
		require.NoError(t, testkit.Sweep(prefill))
		require.NoError(t, testkit.Sweep(decode))
	}
}

// Transfers from several goroutines over one transport and one server
// run at once and all arrive; a closed transport opens no more.
func concurrent(t *testing.T, h Harness) {
	e := setup(t, h, 2048, 4096, handoff.ReceiverConfig{})
	tr := e.srv.Dial(t)
	var wg sync.WaitGroup
	for i := range 6 {
		exp := e.export(t, fmt.Sprint("concurrent-", i), (100+50*i)*16)
		wg.Go(func() { assert.NoError(t, exp.Send(context.Background(), tr)) })
	}
	wg.Wait()
	for i := range 6 {
		e.takeVerified(t, fmt.Sprint("concurrent-", i))
	}
	require.NoError(t, tr.(io.Closer).Close())
	_, err := tr.Open(context.Background())
	assert.ErrorIs(t, err, handoff.ErrTransport, "Open after Close")
	require.NoError(t, testkit.Sweep(e.prefill))
	require.NoError(t, testkit.Sweep(e.decode))
}

// The receiver's refusal of the manifest reaches the sender, with its
// reason, before any page moved.
func refusedAtTheManifest(t *testing.T, h Harness) {
	e := setup(t, h, 512, 64, handoff.ReceiverConfig{})
	exp := e.export(t, "too-big", 200*16)
	w := &watch{inner: e.srv.Dial(t)}
	err := exp.Send(context.Background(), w)
	requireRefused(t, err, "manifest", kvcache.ErrExceedsMaxContext)
	ops, _, _ := w.counts()
	assert.Zero(t, ops, "pages moved after a refusal")
	e.end(t, exp)
}

// A manifest changed on its way is refused for its MAC.
func tamperedManifest(t *testing.T, h Harness) {
	e := setup(t, h, 512, 1024, handoff.ReceiverConfig{})
	exp := e.export(t, "tampered", 50*16)
	w := &watch{inner: e.srv.Dial(t), message: func(msg []byte) {
		if msg[0] == 'M' {
			msg[len(msg)/2] ^= 1
		}
	}}
	requireRefused(t, exp.Send(context.Background(), w), "manifest", handoff.ErrBadMAC)
	// The receiver counts the refusal once its verdict is out.
	require.Eventually(t, func() bool { return refusedBy(e.recv, "bad_mac") == 1 }, 10*time.Second, time.Millisecond)
	e.end(t, exp)
}

// The second page-carrying message (a data frame's head, or a note that
// written pages have landed) names a generation the manifest does not:
// the receiver refuses it and ends the transfer, and the sender stops at
// its next page operation instead of sending the other few hundred.
func forgedGeneration(t *testing.T, h Harness) {
	e := setup(t, h, 4096, 4096, handoff.ReceiverConfig{})
	exp := e.export(t, "forged", 3000*16)
	n, tamperedAt := 0, 0
	var w *watch
	w = &watch{inner: e.srv.Dial(t), message: func(msg []byte) {
		if msg[0] == 'D' || msg[0] == 'L' {
			if n++; n == 2 {
				msg[1+16+4+4] ^= 0xff // the first generation
				tamperedAt, _, _ = w.counts()
			}
		}
	}, before: func(op int) {
		// A data frame's head is seen just before its own operation,
		// a landed note between two: wait from the operation after the
		// one that may carry it.
		if n >= 2 && op > tamperedAt+1 {
			// The receiver answers once it has scrubbed the import,
			// which takes a while under the race detector.
			require.Eventually(t, func() bool { return e.recv.Stats().Refused == 1 }, 10*time.Second, time.Millisecond)
			time.Sleep(time.Millisecond) // for the verdict to arrive
		}
	}}
	err := exp.Send(context.Background(), w)
	requireRefused(t, err, "import", handoff.ErrProtocol)
	ops, lent, back := w.counts()
	assert.Less(t, ops, 100, "the sender went on to the end")
	assert.Equal(t, lent, back, "every page lent to the stream was given back")
	require.Eventually(t, func() bool { return refusedBy(e.recv, "protocol") == 1 }, 10*time.Second, time.Millisecond)
	e.end(t, exp)
}

// A page changed after the sender summed it (an engine writing an
// exported page, which it must not) is caught by the receiver's content
// checksum, however the pages travel.
func pageChanged(t *testing.T, h Harness) {
	e := setup(t, h, 512, 1024, handoff.ReceiverConfig{})
	l, err := testkit.Prefill(e.prefill, "torn", "victim", 300*16)
	require.NoError(t, err)
	exp, err := e.s.Export(l, 0)
	require.NoError(t, err)
	w := &watch{inner: e.srv.Dial(t), pages: func(op int, pages [][]byte) {
		if op == 2 {
			pages[0][100] ^= 0xff // a prefill page of this operation: summed, not yet sent
		}
	}}
	err = exp.Send(context.Background(), w)
	requireRefused(t, err, "import", kvcache.ErrChecksumMismatch)
	_, ok := e.recv.Take("torn")
	assert.False(t, ok)
	e.end(t, exp)
}

// A connection that breaks under a transfer, however it breaks, fails
// the sender's Send with handoff.ErrTransport and leaves the export
// pinned for a retry (every page lent given back), and the receiver
// aborts the import through the scrubber as a transport failure.
func connectionDropped(t *testing.T, h Harness) {
	cases := []struct {
		name string
		cut  func(e *env, tr handoff.Transport, st handoff.Stream)
	}{
		{"the server closed", func(e *env, _ handoff.Transport, _ handoff.Stream) { e.srv.Close() }},
		{"the transport closed", func(_ *env, tr handoff.Transport, _ handoff.Stream) { tr.(io.Closer).Close() }},
		{"the stream closed", func(_ *env, _ handoff.Transport, st handoff.Stream) { st.Close() }},
	}
	if h.Cut != nil {
		cases = append(cases, struct {
			name string
			cut  func(e *env, tr handoff.Transport, st handoff.Stream)
		}{"reset under the sender", func(_ *env, _ handoff.Transport, st handoff.Stream) { h.Cut(st) }})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := setup(t, h, 1024, 2048, handoff.ReceiverConfig{})
			tr := e.srv.Dial(t)
			exp := e.export(t, "cut", 1000*16)
			w := &watch{inner: tr}
			w.before = func(op int) {
				if op == 4 {
					tc.cut(e, tr, w.stream())
				}
			}
			err := exp.Send(context.Background(), w)
			assert.ErrorIs(t, err, handoff.ErrTransport)
			assert.True(t, exp.Live(), "the pages stay pinned for a retry")
			_, lent, back := w.counts()
			assert.Equal(t, lent, back, "every page lent to the stream was given back")
			require.Eventually(t, func() bool { return e.recv.Stats().Refused == 1 }, 10*time.Second, time.Millisecond,
				"the receiver failed the transfer")
			assert.Equal(t, uint64(1), refusedBy(e.recv, "transport"), "the receiver failed it as a transport failure: %v", e.recv.Stats().RefusedBy)
			_, ok := e.recv.Take("cut")
			assert.False(t, ok)
			e.end(t, exp)
		})
	}
}

// Closing the server mid-transfer returns once the import it began has
// ended: no decode page is in use when Close returns.
func serverClosed(t *testing.T, h Harness) {
	e := setup(t, h, 1024, 2048, handoff.ReceiverConfig{})
	exp := e.export(t, "closed", 1000*16)
	inUse := -1
	w := &watch{inner: e.srv.Dial(t), before: func(op int) {
		if op == 4 {
			require.NoError(t, e.srv.Close())
			inUse = e.decode.Stats().InUsePages
		}
	}}
	assert.ErrorIs(t, exp.Send(context.Background(), w), handoff.ErrTransport)
	assert.Zero(t, inUse, "decode pages in use when Close returned")
	e.end(t, exp)
}

// Cancelling the sender's context mid-transfer fails Send with
// handoff.ErrTransport naming the cancellation, and the receiver aborts
// the import. A context already done opens nothing.
func contextCancelled(t *testing.T, h Harness) {
	e := setup(t, h, 1024, 2048, handoff.ReceiverConfig{})
	tr := e.srv.Dial(t)
	exp := e.export(t, "cancel", 1000*16)
	ctx, cancel := context.WithCancel(context.Background())
	w := &watch{inner: tr, before: func(op int) {
		if op == 4 {
			cancel()
		}
	}}
	err := exp.Send(ctx, w)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.ErrorIs(t, err, context.Canceled)
	_, lent, back := w.counts()
	assert.Equal(t, lent, back, "every page lent to the stream was given back")
	require.Eventually(t, func() bool { return e.recv.Stats().Refused == 1 }, 10*time.Second, time.Millisecond)

	_, err = tr.Open(ctx)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.ErrorIs(t, err, context.Canceled)
	e.end(t, exp)
}

// A sender that sends its manifest and then nothing holds neither the
// server's goroutine, nor its connection, nor its request ID longer than
// the receiver's TransferTimeout: the sender hears incomplete_transfer,
// and the request may be sent again.
func silentSender(t *testing.T, h Harness) {
	// The timeout bounds the whole transfer, the second one's too, which
	// must fit in it on a loaded machine under -race (50 ms did not: 40
	// pages sent again timed out under three test processes at once).
	const bound = 10 * time.Second // generous: the timeout is 500 ms
	e := setup(t, h, 512, 1024, handoff.ReceiverConfig{TransferTimeout: 500 * time.Millisecond})
	tr := e.srv.Dial(t)
	exp := e.export(t, "silent", 40*16)
	manifest, err := exp.ManifestBytes()
	require.NoError(t, err)

	st, err := tr.Open(context.Background())
	require.NoError(t, err)
	defer st.Close()
	require.NoError(t, st.Send(append([]byte{'M'}, manifest...)))
	accept := testkit.RecvWithin(t, st, bound, "the answer to the manifest")
	if accept[0] != 'G' { // a grant of memory accepts too
		assert.Equal(t, []byte{'V', 1, 0}, accept)
	}
	v := testkit.RecvWithin(t, st, bound, "verdict after the transfer timeout")
	require.GreaterOrEqual(t, len(v), 3)
	assert.Equal(t, []byte{'V', 2}, v[:2], "an import-stage verdict")
	assert.Equal(t, "incomplete_transfer", handoff.ReasonNames[v[2]], "verdict %q", v)
	require.Eventually(t, func() bool { return refusedBy(e.recv, "incomplete_transfer") == 1 }, bound, time.Millisecond,
		"Serve did not return: refusals %v", e.recv.Stats().RefusedBy)
	_, ok := e.recv.Take("silent")
	assert.False(t, ok)
	require.NoError(t, e.decode.Check())
	st.Close()

	// The claim went with the import.
	require.NoError(t, exp.Send(context.Background(), tr))
	e.takeVerified(t, "silent")
	e.end(t, exp)
}

// The same export sent on two streams at once is imported once; the
// other is refused as a replay or in progress, or finds its pages
// released.
func duplicate(t *testing.T, h Harness) {
	e := setup(t, h, 512, 1024, handoff.ReceiverConfig{})
	tr := e.srv.Dial(t)
	exp := e.export(t, "dup", 200*16)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Go(func() { errs[i] = exp.Send(context.Background(), tr) })
	}
	wg.Wait()
	ok := 0
	for _, err := range errs {
		switch {
		case err == nil:
			ok++
		case errors.Is(err, handoff.ErrReplay), errors.Is(err, kvcache.ErrReclaimed):
		default:
			t.Errorf("the second transfer failed with %v, want a replay refusal", err)
		}
	}
	assert.Equal(t, 1, ok)
	e.takeVerified(t, "dup")
	require.Eventually(t, func() bool { return e.decode.Stats().InUsePages == 0 }, 10*time.Second, time.Millisecond)
	require.NoError(t, testkit.Sweep(e.prefill))
	require.NoError(t, testkit.Sweep(e.decode))
}

// Many tenants' handoffs, most delivered and some broken at a random
// point (a cancelled sender, a tampered frame, a page changed in flight),
// run a few at a time through the transport; the decode leases are read
// back and released, and both pools' every free page holds exactly its
// canary: no tenant's marker anywhere, Check balanced.
func canarySoak(t *testing.T, h Harness) {
	rounds := 60
	if testing.Short() {
		rounds = 20
	}
	e := setup(t, h, 4096, 4096, handoff.ReceiverConfig{})
	tr := e.srv.Dial(t)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 3)
	var mu sync.Mutex
	delivered := 0
	for i := range rounds {
		sem <- struct{}{}
		id := fmt.Sprint("soak-", i)
		prompt := 1 + (i*977)%(300*16)
		exp := e.export(t, id, prompt)
		wg.Go(func() {
			defer func() { <-sem }()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			w := &watch{inner: tr}
			switch i % 5 {
			case 1: // cancelled part way
				w.before = func(op int) {
					if op == 2 {
						cancel()
					}
				}
			case 3: // a frame or landed note tampered with
				w.message = func(msg []byte) {
					if (msg[0] == 'D' || msg[0] == 'L') && len(msg) > 1+16+4+4 {
						msg[1+16+4+4] ^= 0x40
					}
				}
			}
			err := exp.Send(ctx, w)
			if err == nil {
				dl, ok := e.recv.Take(id)
				if assert.True(t, ok) {
					assert.NoError(t, testkit.VerifyContent(e.decode, dl, id))
					assert.NoError(t, dl.Release())
				}
				mu.Lock()
				delivered++
				mu.Unlock()
				return
			}
			assert.NoError(t, exp.Abort())
		})
	}
	wg.Wait()
	assert.Greater(t, delivered, rounds/2)
	require.Eventually(t, func() bool { return e.decode.Stats().InUsePages == 0 }, 10*time.Second, time.Millisecond)
	require.NoError(t, e.prefill.Check())
	require.NoError(t, e.decode.Check())
	require.NoError(t, testkit.Sweep(e.prefill))
	require.NoError(t, testkit.Sweep(e.decode))
}

// watch passes a transport's streams on, and lets a test see the
// sender's side of a transfer: every message before it goes (message,
// which may change it in place), and each page operation (a data frame,
// sent as views or as bytes; a write into the receiver's memory), counted
// from 1, before it goes (before, and pages with the prefill pages it
// reads). It counts the views lent to the stream and given back.
type watch struct {
	inner   handoff.Transport
	message func(msg []byte)
	before  func(op int)
	pages   func(op int, pages [][]byte)

	mu              sync.Mutex
	ops, lent, back int
	last            handoff.Stream
}

func (w *watch) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := w.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	w.last = st
	w.mu.Unlock()
	return &watchedStream{Stream: st, w: w}, nil
}

// stream is the transport's stream the watch opened last.
func (w *watch) stream() handoff.Stream {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.last
}

func (w *watch) counts() (ops, lent, back int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.ops, w.lent, w.back
}

// op counts a page operation and runs the hooks on it.
func (w *watch) op(pages [][]byte) {
	w.mu.Lock()
	w.ops++
	n := w.ops
	w.mu.Unlock()
	if w.pages != nil {
		w.pages(n, pages)
	}
	if w.before != nil {
		w.before(n)
	}
}

// watchedStream is a stream with every optional interface a transport's
// may have; where the transport's lacks one, it does what the handoff's
// sender would do without it.
type watchedStream struct {
	handoff.Stream
	w *watch
}

var (
	_ handoff.ViewStream   = (*watchedStream)(nil)
	_ handoff.OwningStream = (*watchedStream)(nil)
	_ handoff.MemoryStream = (*watchedStream)(nil)
)

func (s *watchedStream) see(msg []byte) {
	if s.w.message != nil && len(msg) > 0 {
		s.w.message(msg)
	}
}

func (s *watchedStream) Send(msg []byte) error {
	msg = bytes.Clone(msg)
	s.see(msg)
	if msg[0] == 'D' {
		s.w.op(nil)
	}
	return s.Stream.Send(msg)
}

func (s *watchedStream) SendOwned(msg []byte, done func()) error {
	s.see(msg)
	if msg[0] == 'D' {
		s.w.op(nil)
	}
	if os, ok := s.Stream.(handoff.OwningStream); ok {
		return os.SendOwned(msg, done)
	}
	defer done()
	return s.Stream.Send(msg)
}

func (s *watchedStream) SendViews(head []byte, views [][]byte, done func()) error {
	s.see(head)
	s.w.mu.Lock()
	s.w.lent++
	s.w.mu.Unlock()
	back := func() {
		s.w.mu.Lock()
		s.w.back++
		s.w.mu.Unlock()
		done()
	}
	s.w.op(views)
	if vs, ok := s.Stream.(handoff.ViewStream); ok {
		return vs.SendViews(head, views, back)
	}
	defer back()
	msg := bytes.Clone(head)
	for _, v := range views {
		msg = append(msg, v...)
	}
	return s.Stream.Send(msg)
}

func (s *watchedStream) OpenRemote(desc []byte, memBytes []int64) (handoff.RemoteWriter, error) {
	ms, ok := s.Stream.(handoff.MemoryStream)
	if !ok {
		return nil, fmt.Errorf("%w: conformance: a grant on a stream that cannot write remote memory", handoff.ErrProtocol)
	}
	rw, err := ms.OpenRemote(desc, memBytes)
	if err != nil {
		return nil, err
	}
	return &watchedWriter{RemoteWriter: rw, w: s.w}, nil
}

type watchedWriter struct {
	handoff.RemoteWriter
	w *watch
}

func (ww *watchedWriter) Write(puts []handoff.RemotePut) (func() error, error) {
	var pages [][]byte
	for _, p := range puts {
		pages = append(pages, p.Src...)
	}
	ww.w.op(pages)
	return ww.RemoteWriter.Write(puts)
}
