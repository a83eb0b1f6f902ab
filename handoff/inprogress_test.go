package handoff_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
)

// TestInProgressDuplicateLooksLikeReplay: a manifest whose request ID is
// being imported (a concurrent duplicate, or a retry that races the first
// attempt's cleanup) may succeed later; one whose request ID has been
// imported never will. The sender must be able to tell them apart, by
// reason code and label, on the wire and in the counters.
func TestInProgressDuplicateLooksLikeReplay(t *testing.T) {
	ctx := context.Background()
	prefill := pool(t, testkit.PoolConfig{Pages: 64})
	decode := pool(t, testkit.PoolConfig{Pages: 64})
	recv := receiver(t, decode)
	inproc := handoff.NewInProcess(recv)
	l, err := testkit.Prefill(prefill, "twice", "victim", 40)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 0)
	require.NoError(t, err)

	// The first attempt holds the claim while it runs.
	first, err := recv.Begin(ctx, mustManifest(t, exp))
	require.NoError(t, err)
	_, err = recv.Begin(ctx, mustManifest(t, exp))
	require.Error(t, err)
	assert.Equal(t, "in_progress", handoff.ReasonName(err), "a direct duplicate: %v", err)
	assert.ErrorIs(t, err, handoff.ErrInProgress)
	assert.ErrorIs(t, err, handoff.ErrReplay, "what it was before it had a sentinel of its own")
	err = exp.Send(ctx, inproc)
	inproc.Wait()
	var re *handoff.RefusedError
	require.ErrorAs(t, err, &re, "got %v", err)
	assert.Equal(t, "manifest", re.Stage)
	assert.Equal(t, "in_progress", handoff.ReasonName(err), "a duplicate over a transport: %v", err)
	assert.ErrorIs(t, err, handoff.ErrInProgress)
	assert.ErrorIs(t, err, handoff.ErrReplay)
	assert.Equal(t, uint64(2), recv.Stats().RefusedBy[indexOf(t, "in_progress")], "refusals: %v", recv.Stats().RefusedBy)
	assert.True(t, exp.Live(), "a refused export stays pinned for a retry")

	// Once the first attempt has ended, the retry the reason invited works,
	require.NoError(t, first.Abort())
	require.NoError(t, exp.Send(ctx, inproc))
	dl, ok := recv.Take("twice")
	require.True(t, ok)
	require.NoError(t, dl.Release())

	// and after it, the same request is a replay: refused for good.
	l, err = testkit.Prefill(prefill, "twice", "victim", 40)
	require.NoError(t, err)
	again, err := sender(t).Export(l, 0)
	require.NoError(t, err)
	err = again.Send(ctx, inproc)
	inproc.Wait()
	require.ErrorAs(t, err, &re, "got %v", err)
	assert.ErrorIs(t, err, handoff.ErrReplay)
	assert.NotErrorIs(t, err, handoff.ErrInProgress)
	assert.Equal(t, "replay", handoff.ReasonName(err))
	require.NoError(t, again.Abort())
	sweep(t, prefill, decode)
}
