package handoff_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/internal/testlog"
	"github.com/kvfence/kvfence/kvcache"
)

func TestReasonNamesCoverEveryReasonCode(t *testing.T) {
	seen := map[string]bool{}
	for code, name := range handoff.ReasonNames {
		require.NotEmpty(t, name, "code %d", code)
		require.False(t, seen[name], "duplicate label %q", name)
		seen[name] = true
	}
	assert.Equal(t, "ok", handoff.ReasonName(nil))
	assert.Equal(t, "bad_mac", handoff.ReasonName(handoff.ErrBadMAC))
	assert.Equal(t, "pool_exhausted", handoff.ReasonName(&handoff.RefusedError{Reason: kvcache.ErrPoolExhausted}))
	assert.Equal(t, "internal", handoff.ReasonName(assert.AnError))
}

// TestTransferOutcomesCountedOnBothSidesByReason: a transfer that works
// counts once as sent and once as imported; a refused one counts on both
// sides under the receiver's reason, and is logged once on each side with
// its numbers.
func TestTransferOutcomesCountedOnBothSidesByReason(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	// The decode pool is too small for the second request: pool_exhausted.
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	var sendLog, recvLog testlog.Buffer
	recv := receiver(t, decode, func(c *handoff.ReceiverConfig) {
		c.Logger = recvLog.Logger()
	})
	s := sender(t, func(c *handoff.SenderConfig) { c.Logger = sendLog.Logger() })
	ctx := context.Background()

	l, err := testkit.Prefill(prefill, "ok", "victim", 100)
	require.NoError(t, err)
	exp, err := s.Export(l, 10)
	require.NoError(t, err)
	inproc := handoff.NewInProcess(recv)
	require.NoError(t, exp.Send(ctx, inproc))
	inproc.Wait()
	dl, ok := recv.Take("ok")
	require.True(t, ok)

	// Hold most of the decode pool so that the next import cannot fit.
	hog, err := decode.TryAdmit(kvcache.Request{ID: "hog", Tenant: "other", PromptTokens: 50 * 16})
	require.NoError(t, err)
	l2, err := testkit.Prefill(prefill, "big", "victim", 300)
	require.NoError(t, err)
	exp2, err := s.Export(l2, 10)
	require.NoError(t, err)
	err = exp2.Send(ctx, inproc)
	require.ErrorIs(t, err, kvcache.ErrPoolExhausted)
	inproc.Wait()
	require.NoError(t, exp2.Abort())

	rs := recv.Stats()
	assert.Equal(t, uint64(1), rs.Imported)
	assert.Equal(t, uint64(1), rs.Refused)
	code := indexOf(t, "pool_exhausted")
	assert.Equal(t, uint64(1), rs.RefusedBy[code])
	ss := s.Stats()
	assert.Equal(t, uint64(1), ss.Sent)
	assert.Equal(t, uint64(1), ss.Failed)
	assert.Equal(t, uint64(1), ss.FailedBy[code])

	for side, buf := range map[string]*testlog.Buffer{"receiver": &recvLog, "sender": &sendLog} {
		recs := buf.Records(t)
		require.Len(t, recs, 1, "%s: one record for the one refusal", side)
		assert.Equal(t, "pool_exhausted", recs[0]["reason"], side)
		assert.Equal(t, "WARN", recs[0]["level"], side)
		assert.Contains(t, recs[0]["error"], "big", "%s: the error names the request", side)
	}
	require.NoError(t, dl.Release())
	require.NoError(t, hog.Release())
	sweep(t, prefill, decode)
}

func TestDirectImportOutcomesCountedByReason(t *testing.T) {
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	now := time.Now()
	recv := receiver(t, decode, func(c *handoff.ReceiverConfig) { c.Now = func() time.Time { return now.Add(time.Hour) } })
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	l, err := testkit.Prefill(prefill, "late", "victim", 40)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 0)
	require.NoError(t, err)
	wire, err := exp.ManifestBytes()
	require.NoError(t, err)

	_, err = recv.Begin(context.Background(), wire)
	require.ErrorIs(t, err, handoff.ErrExpired)
	tampered := bytes.Clone(wire)
	tampered[len(tampered)-1] ^= 1
	_, err = recv.Begin(context.Background(), tampered)
	require.ErrorIs(t, err, handoff.ErrBadMAC)
	rs := recv.Stats()
	assert.Equal(t, uint64(2), rs.Refused)
	assert.Equal(t, uint64(1), rs.RefusedBy[indexOf(t, "expired")])
	assert.Equal(t, uint64(1), rs.RefusedBy[indexOf(t, "bad_mac")])
	require.NoError(t, exp.Abort())
	sweep(t, prefill, decode)
}

func indexOf(t *testing.T, name string) int {
	t.Helper()
	for i, n := range handoff.ReasonNames {
		if n == name {
			return i
		}
	}
	t.Fatalf("no reason %q", name)
	return 0
}

// TestTransferTimeoutReportedAsIncomplete: a sender too slow for the
// receiver's TransferTimeout has its import aborted; both sides then say
// so, incomplete_transfer, as a direct import's timeout does, not
// stale_transfer, the reason of KV landing in pages that were reused,
// which is what the next write into the aborted import found.
func TestTransferTimeoutReportedAsIncomplete(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	recv := receiver(t, decode, func(c *handoff.ReceiverConfig) { c.TransferTimeout = 20 * time.Millisecond })
	inproc := handoff.NewInProcess(recv)
	for _, before := range []byte{'D', 'S'} { // stalls before a data frame (a write fails), before the seal (Complete does)
		t.Run(string(before), func(t *testing.T) {
			id := "slow-" + string(before)
			l, err := testkit.Prefill(prefill, id, "victim", 40*16)
			require.NoError(t, err)
			exp, err := sender(t, func(c *handoff.SenderConfig) { c.FrameBytes = 1 }).Export(l, 0)
			require.NoError(t, err)
			stalled := false
			err = exp.Send(context.Background(), &hooked{inner: inproc, send: func(st handoff.Stream, n int, msg []byte) error {
				if msg[0] == before && !stalled && (before == 'S' || n > 2) {
					stalled = true
					require.Eventually(t, func() bool { return decode.Stats().LiveLeases == 0 }, 5*time.Second, time.Millisecond,
						"the import outlived its TransferTimeout")
				}
				return st.Send(msg)
			}})
			inproc.Wait()
			var re *handoff.RefusedError
			require.ErrorAs(t, err, &re, "got %v", err)
			assert.ErrorIs(t, err, kvcache.ErrIncompleteTransfer)
			assert.Equal(t, "incomplete_transfer", handoff.ReasonName(err))
			assert.Contains(t, re.Message, "20ms", "the receiver's error names its timeout")
			assertNoImport(t, recv, decode, id)
			require.NoError(t, exp.Abort())
			// The aborted import's pages are scrubbed after its lease ended
			// (which the hook waited for), outside the pool's lock: the next
			// case needs them free, or its import is refused for pages.
			require.Eventually(t, func() bool { return decode.Stats().FreePages == decode.Pages() }, 10*time.Second, time.Millisecond)
		})
	}
	rs := recv.Stats()
	assert.Equal(t, uint64(2), rs.RefusedBy[indexOf(t, "incomplete_transfer")], "refusals by reason: %v", rs.RefusedBy)
	sweep(t, prefill, decode)
}

// TestDirectImportWriteFailureCountedByItsReason: a direct import whose
// write fails (a page written twice, one out of range) is aborted, and
// the receiver counts and logs it under the write's reason, not as an
// import its caller abandoned (incomplete_transfer, "aborted by its
// caller or its TransferTimeout"), which it said before.
func TestDirectImportWriteFailureCountedByItsReason(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	var recvLog testlog.Buffer
	recv := receiver(t, decode, func(c *handoff.ReceiverConfig) { c.Logger = recvLog.Logger() })
	for _, tc := range []struct {
		name   string
		write  func(imp *handoff.Import, page []byte) error
		reason string
	}{
		{"page written twice", func(imp *handoff.Import, page []byte) error {
			if err := imp.WriteUnits(0, page); err != nil {
				return err
			}
			return imp.WriteUnits(0, page)
		}, "duplicate_page"},
		{"page out of range", func(imp *handoff.Import, page []byte) error {
			return imp.WriteUnits(imp.Units(), page)
		}, "internal"}, // kvcache.ErrInvalidArgument has no reason code of its own
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := recv.Stats()
			id := "w-" + tc.name
			l, err := testkit.Prefill(prefill, id, "victim", 40)
			require.NoError(t, err)
			exp, err := sender(t).Export(l, 0)
			require.NoError(t, err)
			imp, err := recv.Begin(context.Background(), mustManifest(t, exp))
			require.NoError(t, err)
			page := make([]byte, imp.PageBytes())
			require.NoError(t, exp.ReadUnits(0, page))
			err = tc.write(imp, page)
			require.Error(t, err)
			assert.Equal(t, tc.reason, handoff.ReasonName(err), "the write's own error: %v", err)
			assert.True(t, imp.Ended())
			after := recv.Stats()
			assert.Equal(t, before.Refused+1, after.Refused)
			code := indexOf(t, tc.reason)
			assert.Equal(t, before.RefusedBy[code]+1, after.RefusedBy[code], "counted by reason: %v", after.RefusedBy)
			recs := recvLog.Records(t)
			require.NotEmpty(t, recs)
			assert.Equal(t, tc.reason, recs[len(recs)-1]["reason"])
			assertNoImport(t, recv, decode, id)
			require.NoError(t, exp.Abort())
		})
	}
	sweep(t, prefill, decode)
}
