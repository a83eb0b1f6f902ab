package grpcx_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/grpcx"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
)

// A sender that sends its manifest and then nothing, on a stream it keeps
// open, must not hold the handler's goroutine, the stream and its request
// ID once the receiver's TransferTimeout has aborted the import: gRPC has
// no read deadline of its own, so nothing else would ever end the wait for
// the next frame. The sender hears incomplete_transfer, and the request
// may be sent again.
func TestSilentSenderHoldsTheStreamForever(t *testing.T) {
	const bound = 10 * time.Second // generous: without the fix, it would wait for ever
	prefill, decode := newPool(t, 512), newPool(t, 1024)
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: testkit.Key(), TransferTimeout: 50 * time.Millisecond})
	require.NoError(t, err)
	srv, err := grpcx.NewServer(recv, insecure.NewCredentials())
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	tr, err := grpcx.Dial(ln.Addr().String(), insecure.NewCredentials())
	require.NoError(t, err)
	defer tr.Close()

	l, err := testkit.Prefill(prefill, "silent", "victim", 40*16)
	require.NoError(t, err)
	exp, err := newSender(t, time.Minute).Export(l, 16)
	require.NoError(t, err)
	manifest, err := exp.ManifestBytes()
	require.NoError(t, err)
	st, err := tr.Open(context.Background())
	require.NoError(t, err)
	defer st.Close()
	require.NoError(t, st.Send(append([]byte{'M'}, manifest...)))
	assert.Equal(t, []byte{'V', 1, 0}, testkit.RecvWithin(t, st, bound, "verdict on the manifest"))
	v := testkit.RecvWithin(t, st, bound, "verdict after the transfer timeout")
	require.GreaterOrEqual(t, len(v), 3)
	assert.Equal(t, []byte{'V', 2}, v[:2], "an import-stage verdict")
	assert.Equal(t, "incomplete_transfer", handoff.ReasonNames[v[2]], "verdict %q", v)
	code := 0
	for i, n := range handoff.ReasonNames {
		if n == "incomplete_transfer" {
			code = i
		}
	}
	require.Eventually(t, func() bool { return recv.Stats().RefusedBy[code] == 1 }, bound, time.Millisecond,
		"Serve did not return: refusals %v", recv.Stats().RefusedBy)
	_, ok := recv.Take("silent")
	assert.False(t, ok)
	require.NoError(t, decode.Check())
	st.Close()

	// The claim went with the import.
	require.NoError(t, exp.Send(context.Background(), tr))
	dl, ok := recv.Take("silent")
	require.True(t, ok)
	require.NoError(t, testkit.VerifyContent(decode, dl, "silent"))
	require.NoError(t, dl.Release())
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
}
