package tcpx_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/handoff/tcpx"
)

// A sender that sends its manifest and then nothing holds the server's
// goroutine, its connection and its request ID no longer than the
// receiver's TransferTimeout, not until the (much longer) MessageTimeout:
// the watchdog's abort ends the wait for the next frame, the sender hears
// incomplete_transfer, and the request may be sent again.
func TestSilentSenderHeldUntilMessageTimeout(t *testing.T) {
	const bound = 10 * time.Second // generous; MessageTimeout is far longer
	prefill, decode := newPool(t, 512), newPool(t, 1024)
	srv := serve(t, handoff.ReceiverConfig{Pool: decode, TransferTimeout: 50 * time.Millisecond},
		tcpx.Insecure(), tcpx.Options{MessageTimeout: 10 * time.Minute})
	tr := dial(t, srv.addr, tcpx.Insecure(), tcpx.Options{})
	exp := export(t, newSender(t, time.Minute), prefill, "silent", 40*16)
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
	require.Eventually(t, func() bool { return refusedBy(srv.recv, "incomplete_transfer") == 1 }, bound, time.Millisecond,
		"Serve did not return: refusals %v", srv.recv.Stats().RefusedBy)
	_, ok := srv.recv.Take("silent")
	assert.False(t, ok)
	require.NoError(t, decode.Check())
	st.Close()

	// The claim went with the import.
	require.NoError(t, exp.Send(context.Background(), tr))
	takeVerified(t, srv, decode, "silent")
	endAndSweep(t, exp, prefill, decode)
}
