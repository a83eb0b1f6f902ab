package handoff_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
)

// stallBound is how long a test waits for what a stalled transfer's
// watchdog sets off. It is generous (the race detector on a loaded
// machine), and far below anything that would end the transfer without
// the watchdog: nothing else does, over InProcess.
const stallBound = 10 * time.Second

// TestSilentSenderAfterManifestPinsServe: a sender that sends its
// manifest, hears it accepted, and then sends nothing must not keep the
// receiver waiting for its next frame once the TransferTimeout has
// aborted the import. Serve returns, the sender hears why
// (incomplete_transfer), the request ID may be imported again, and the
// decode pool is as it was before the manifest.
func TestSilentSenderAfterManifestPinsServe(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	recv := receiver(t, decode, func(c *handoff.ReceiverConfig) { c.TransferTimeout = 50 * time.Millisecond })
	inproc := handoff.NewInProcess(recv)
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); inproc.Wait() }() // a failed test's Serve still ends
	before := decode.Stats()

	l, err := testkit.Prefill(prefill, "silent", "victim", 20*16)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 16)
	require.NoError(t, err)
	st, err := inproc.Open(ctx)
	require.NoError(t, err)
	defer st.Close()
	require.NoError(t, st.Send(append([]byte{'M'}, mustManifest(t, exp)...)))
	assert.Equal(t, []byte{'V', 1, 0}, testkit.RecvWithin(t, st, stallBound, "verdict on the manifest"))

	// Silence. The watchdog's abort must reach the sender as a verdict.
	v := testkit.RecvWithin(t, st, stallBound, "verdict after the transfer timeout")
	require.GreaterOrEqual(t, len(v), 3)
	assert.Equal(t, []byte{'V', 2}, v[:2], "an import-stage verdict")
	assert.Equal(t, "incomplete_transfer", handoff.ReasonNames[v[2]], "verdict %q", v)
	assert.Contains(t, string(v[3:]), "50ms", "the verdict names the timeout")

	served := make(chan struct{})
	go func() { inproc.Wait(); close(served) }()
	select {
	case <-served:
	case <-time.After(stallBound):
		t.Fatal("Serve still waits on a transfer its watchdog ended")
	}
	assert.Equal(t, uint64(1), recv.Stats().RefusedBy[indexOf(t, "incomplete_transfer")], "refusals: %v", recv.Stats().RefusedBy)
	assertNoImport(t, recv, decode, "silent")
	after := decode.Stats()
	assert.Equal(t, before.LiveLeases, after.LiveLeases)
	assert.Equal(t, before.InUsePages, after.InUsePages)

	// The claim went with the import: the same export imports now.
	require.NoError(t, exp.Send(context.Background(), inproc))
	dl, ok := recv.Take("silent")
	require.True(t, ok)
	require.NoError(t, testkit.VerifyContent(decode, dl, "silent"))
	require.NoError(t, dl.Release())
	sweep(t, prefill, decode)
}
