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
