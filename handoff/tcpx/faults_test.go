package tcpx_test

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/handoff/tcpx"
	"github.com/kvfence/kvfence/kvcache"
)

// dataFixed is the length of a data frame's head before its generations
// (handoff's frames.go: kind, transfer ID, first page, page count).
const dataFixed = 1 + 16 + 4 + 4

// viewGeometry has 8 KiB pages (two 4 KiB regions), so that a test moves
// megabytes in a thousand pages.
var viewGeometry = kvcache.Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 128, DType: kvcache.FP16}

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

// refusedBy is how many transfers recv refused for the reason named
// name (handoff.ReasonNames).
func refusedBy(recv *handoff.Receiver, name string) uint64 {
	for code, n := range handoff.ReasonNames {
		if n == name {
			return recv.Stats().RefusedBy[code]
		}
	}
	panic("no reason " + name)
}

// endAndSweep aborts exp (a failed transfer leaves the pages pinned for a
// retry) and audits both pools once the decode side has let go.
func endAndSweep(t *testing.T, exp *handoff.Export, prefill, decode *kvcache.Pool) {
	t.Helper()
	require.NoError(t, exp.Abort())
	assert.False(t, exp.Live())
	require.Eventually(t, func() bool { return decode.Stats().InUsePages == 0 }, 10*time.Second, time.Millisecond)
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
}

// The receiver's refusals reach the sender as *handoff.RefusedError with
// the receiver's reason, before any page moved and while pages are still
// flowing; in both cases the pools end clean.
func TestReceiverRefusalReachesTheSender(t *testing.T) {
	ctx := context.Background()
	t.Run("at the manifest", func(t *testing.T) {
		prefill, decode := newPool(t, 512), newPool(t, 64)
		srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
		exp := export(t, newSender(t, time.Minute), prefill, "too-big", 200*16)
		err := exp.Send(ctx, dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{}))
		requireRefused(t, err, "manifest", kvcache.ErrExceedsMaxContext)
		endAndSweep(t, exp, prefill, decode)
	})
	t.Run("while pages flow", func(t *testing.T) {
		// Frame 2 carries a generation the manifest does not name: the
		// receiver refuses it and ends the transfer, and the sender stops
		// at its next frame instead of sending the other few hundred.
		prefill, decode := newPool(t, 4096), newPool(t, 4096)
		srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
		s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), FrameBytes: 4 << 10}) // 7 pages a frame
		require.NoError(t, err)
		exp := export(t, s, prefill, "forged", 3000*16)
		frames := (3000 + 6) / 7
		w := &watch{inner: dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{}), hook: func(n int, _ handoff.Stream, head []byte) {
			switch {
			case n == 2:
				head[dataFixed] ^= 0xff
			case n == 3:
				// The receiver answers once it has scrubbed the import,
				// which takes a while under the race detector.
				require.Eventually(t, func() bool { return srv.recv.Stats().Refused == 1 }, 10*time.Second, time.Millisecond)
			case n > 3:
				time.Sleep(time.Millisecond) // time for the verdict to arrive
			}

		}}
		err = exp.Send(ctx, w)
		requireRefused(t, err, "import", handoff.ErrProtocol)
		lent, back := w.counts()
		assert.Less(t, lent, frames, "the sender went on to the end")
		assert.Equal(t, lent, back, "every lent frame was given back")
		assert.Equal(t, uint64(1), refusedBy(srv.recv, "protocol"))
		endAndSweep(t, exp, prefill, decode)
	})
	t.Run("a page changed after it was summed", func(t *testing.T) {
		host := cudaops.NewHost() // the test's, to change a page behind the lease
		prefill, err := testkit.NewPool(testkit.PoolConfig{Geometry: testkit.Geometry, Pages: 512, Tenants: tenants, Device: host})
		require.NoError(t, err)
		t.Cleanup(func() { prefill.Close() })
		decode := newPool(t, 1024)
		srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
		l, err := testkit.Prefill(prefill, "torn", "victim", 300*16)
		require.NoError(t, err)
		table, err := l.BlockTable()
		require.NoError(t, err)
		exp, err := newSender(t, time.Minute).Export(l, 0)
		require.NoError(t, err)
		victim := host.PageBytes(1, table[70]) // in frame 2 (63 pages a frame)
		w := &watch{inner: dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{}), hook: func(n int, _ handoff.Stream, _ []byte) {
			if n == 2 {
				victim[100] ^= 0xff
			}
		}}
		err = exp.Send(ctx, w)
		requireRefused(t, err, "import", kvcache.ErrChecksumMismatch)
		_, ok := srv.recv.Take("torn")
		assert.False(t, ok)
		endAndSweep(t, exp, prefill, decode)
	})
}

// A connection that breaks under a transfer, however it breaks, fails the
// sender's Send with handoff.ErrTransport, leaves the export pinned for a
// retry (every lent frame given back), and the receiver aborts the import
// through the scrubber.
func TestConnectionDroppedMidTransfer(t *testing.T) {
	ctx := context.Background()
	cases := []struct {
		name string
		// cut breaks the connection of st, a transfer to srv over tr.
		cut func(srv *server, tr *tcpx.Transport, st handoff.Stream)
	}{
		{"reset under the sender", func(_ *server, _ *tcpx.Transport, st handoff.Stream) {
			raw := tcpx.RawConn(st).(*net.TCPConn)
			raw.SetLinger(0) // close with a reset
			raw.Close()
		}},
		{"the server closed", func(srv *server, _ *tcpx.Transport, _ handoff.Stream) { srv.srv.Close() }},
		{"the transport closed", func(_ *server, tr *tcpx.Transport, _ handoff.Stream) { tr.Close() }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			prefill, decode := newPool(t, 1024), newPool(t, 2048)
			srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
			tr := dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{})
			exp := export(t, newSender(t, time.Minute), prefill, "cut", 1000*16)
			w := &watch{inner: tr, hook: func(n int, st handoff.Stream, _ []byte) {
				if n == 4 {
					tc.cut(srv, tr, st)
				}
			}}
			err := exp.Send(ctx, w)
			assert.ErrorIs(t, err, handoff.ErrTransport)
			assert.True(t, exp.Live(), "the pages stay pinned for a retry")
			lent, back := w.counts()
			assert.Equal(t, lent, back, "every lent frame was given back")
			require.Eventually(t, func() bool { return refusedBy(srv.recv, "transport") == 1 }, 10*time.Second, time.Millisecond,
				"the receiver failed the transfer as a transport failure")
			_, ok := srv.recv.Take("cut")
			assert.False(t, ok)
			endAndSweep(t, exp, prefill, decode)
		})
	}
	t.Run("the server closed: Close returns once the import ended", func(t *testing.T) {
		prefill, decode := newPool(t, 1024), newPool(t, 2048)
		srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
		exp := export(t, newSender(t, time.Minute), prefill, "closed", 1000*16)
		var inUse int
		w := &watch{inner: dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{}), hook: func(n int, _ handoff.Stream, _ []byte) {
			if n == 4 {
				require.NoError(t, srv.srv.Close())
				inUse = decode.Stats().InUsePages
			}
		}}
		assert.ErrorIs(t, exp.Send(ctx, w), handoff.ErrTransport)
		assert.Zero(t, inUse, "decode pages in use when Close returned")
		assert.ErrorIs(t, <-srv.done, tcpx.ErrServerClosed)
		endAndSweep(t, exp, prefill, decode)
	})
}

// Cancelling the sender's context mid-transfer closes the connection: Send
// fails with handoff.ErrTransport naming the cancellation, and the
// receiver aborts the import. A context already done opens nothing.
func TestContextCancelledMidTransfer(t *testing.T) {
	prefill, decode := newPool(t, 1024), newPool(t, 2048)
	srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{})
	tr := dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{})
	exp := export(t, newSender(t, time.Minute), prefill, "cancel", 1000*16)
	ctx, cancel := context.WithCancel(context.Background())
	w := &watch{inner: tr, hook: func(n int, _ handoff.Stream, _ []byte) {
		if n == 4 {
			cancel()
		}
	}}
	err := exp.Send(ctx, w)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.ErrorIs(t, err, context.Canceled)
	lent, back := w.counts()
	assert.Equal(t, lent, back, "every lent frame was given back")
	require.Eventually(t, func() bool { return srv.recv.Stats().Refused == 1 }, 10*time.Second, time.Millisecond)

	_, err = tr.Open(ctx)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.ErrorIs(t, err, context.Canceled)
	endAndSweep(t, exp, prefill, decode)
}

// A sender that stalls mid-transfer holds the receiver's import no longer
// than the server's MessageTimeout: the import is aborted, and the sender
// hears why when it wakes up.
func TestStalledSenderReleasesTheImport(t *testing.T) {
	prefill, decode := newPool(t, 1024), newPool(t, 2048)
	srv := serve(t, handoff.ReceiverConfig{Pool: decode}, tcpx.Insecure(), tcpx.Options{MessageTimeout: 200 * time.Millisecond})
	exp := export(t, newSender(t, time.Minute), prefill, "stalled", 1000*16)
	w := &watch{inner: dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{}), hook: func(n int, _ handoff.Stream, _ []byte) {
		if n == 2 {
			require.Eventually(t, func() bool { return decode.Stats().InUsePages == 0 }, 10*time.Second, time.Millisecond,
				"the receiver still holds the import of a stalled sender")
		}
	}}
	err := exp.Send(context.Background(), w)
	refused := requireRefused(t, err, "import", handoff.ErrTransport)
	assert.Contains(t, refused.Message, "timeout")
	endAndSweep(t, exp, prefill, decode)
}

// fakeServer accepts connections on a loopback port and runs handle on
// each, on its own goroutine; handle's connection is closed after it.
func fakeServer(t *testing.T, handle func(c net.Conn)) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(c)
			}()
		}
	}()
	return ln.Addr().String()
}

// frame is a message as tcpx puts it on the wire.
func frame(body []byte) []byte {
	return append(binary.LittleEndian.AppendUint32(nil, uint32(len(body))), body...)
}

var tcpxHello = []byte("KVFTCPX\x01")

// A receiver that accepts the manifest and then stops reading pins the
// sender's pages no longer than the sender's MessageTimeout: the blocked
// write gives up, every lent frame comes back, and the export can end.
func TestStalledReceiverReleasesThePages(t *testing.T) {
	stop := make(chan struct{})
	defer close(stop)
	addr := fakeServer(t, func(c net.Conn) {
		c.(*net.TCPConn).SetReadBuffer(4 << 10)
		var prefix [4]byte
		if _, err := io.ReadFull(c, make([]byte, len(tcpxHello))); err != nil { // the client's hello
			return
		}
		c.Write(tcpxHello)
		if _, err := io.ReadFull(c, prefix[:]); err != nil {
			return
		}
		if _, err := io.ReadFull(c, make([]byte, binary.LittleEndian.Uint32(prefix[:]))); err != nil { // the manifest
			return
		}
		c.Write(frame([]byte{'V', 1, 0})) // accepted: pages may flow
		<-stop                            // and never read again
	})
	prefill := newPoolOf(t, viewGeometry, 1100)
	exp := export(t, newSender(t, time.Hour), prefill, "pinned", 1024*16) // 8 MiB: more than the sockets buffer
	w := &watch{inner: dial(t, addr, tcpx.Insecure(), tcpx.Options{MessageTimeout: 200 * time.Millisecond})}
	err := exp.Send(context.Background(), w)
	assert.ErrorIs(t, err, handoff.ErrTransport)
	assert.ErrorContains(t, err, "timeout")
	lent, back := w.counts()
	assert.Positive(t, lent)
	assert.Equal(t, lent, back, "every lent frame was given back")
	require.NoError(t, exp.Abort())
	require.NoError(t, testkit.Sweep(prefill))
}
