package kvevents_test

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvevents"
)

// message reads one message of the raw subscriber as its frames.
func (s *rawSub) message(t *testing.T) [][]byte {
	t.Helper()
	var frames [][]byte
	for {
		f, more, cmd, err := s.frame()
		require.NoError(t, err)
		require.False(t, cmd)
		frames = append(frames, f)
		if !more {
			return frames
		}
	}
}

// TestMessagesFrameShortAndLongPayloads: the payload is encoded in place
// after the topic and sequence frames, whichever header its size takes (a
// short one up to 255 bytes, a long one beyond), and the frames read back
// as vLLM's [topic, seq, payload].
func TestMessagesFrameShortAndLongPayloads(t *testing.T) {
	p := newPool(t, 64, 64)
	const topic = "kv@pod-0@model"
	pub := publisher(t, p, kvevents.Config{Topic: topic})
	sub := dialRaw(t, pub.Addr().String(), 0)
	waitSubscribed(t, pub, 1)

	require.NoError(t, p.ClearPrefixCache()) // nothing cached: one AllBlocksCleared
	waitPublished(t, p, pub)
	keys := publish(t, p, "a1", "a", tokens(0, 128), false) // 32 pages
	waitPublished(t, p, pub)

	short := sub.message(t)
	require.Len(t, short, 3)
	assert.Equal(t, topic, string(short[0]))
	assert.Equal(t, uint64(0), binary.BigEndian.Uint64(short[1]))
	assert.Less(t, len(short[2]), 256, "a short frame")
	b := decodeBatch(t, short[2])
	require.Len(t, b.events, 1)
	assert.Equal(t, kvevents.TagAllBlocksCleared, b.events[0].tag)

	long := sub.message(t)
	require.Len(t, long, 3)
	assert.Equal(t, topic, string(long[0]))
	assert.Equal(t, uint64(1), binary.BigEndian.Uint64(long[1]))
	assert.Greater(t, len(long[2]), 255, "a long frame")
	b = decodeBatch(t, long[2])
	require.Len(t, b.events, 1)
	assert.Equal(t, kvevents.TagBlockStored, b.events[0].tag)
	assert.Equal(t, "tenant:a", b.events[0].salt)
	for i, k := range keys {
		assert.Equal(t, kvevents.BlockHash(k), b.events[0].hashes[i])
	}
}

// TestBatchWindowGathersEvents: an event after a quiet spell is published
// on its own; events that arrive while the publisher waits out the window
// after it go out together, in one message.
func TestBatchWindowGathersEvents(t *testing.T) {
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{BatchWindow: time.Second})
	sub := dialSubscriber(t, pub, "")
	waitSubscribed(t, pub, 1)

	publish(t, p, "a1", "a", tokens(0, 8), false)
	require.Equal(t, uint64(0), waitPublished(t, p, pub), "the first event, alone")
	// The publisher is now in (or about to enter) its window: these two
	// wait in the pool's channel until it ends, though a publisher without
	// one would have had the time to publish the first alone.
	publish(t, p, "b1", "b", tokens(100, 8), false)
	time.Sleep(50 * time.Millisecond)
	publish(t, p, "c1", "c", tokens(200, 8), false)
	last := waitPublished(t, p, pub)
	assert.Equal(t, uint64(1), last, "the two events of the window, in one batch")
	sub.until(last)
	require.Len(t, sub.seen, 2)
	assert.Len(t, sub.seen[0].events, 1)
	assert.Len(t, sub.seen[1].events, 2)
	assert.Equal(t, uint64(3), pub.Stats().Events)
}

// TestCloseEndsBatchWindow: Close does not wait for the window to end.
func TestCloseEndsBatchWindow(t *testing.T) {
	p := newPool(t, 64, 64)
	pub, err := kvevents.New(p, kvevents.Config{Endpoint: "tcp://127.0.0.1:0", BatchWindow: time.Hour})
	require.NoError(t, err)
	publish(t, p, "a1", "a", tokens(0, 8), false)
	waitPublished(t, p, pub)
	publish(t, p, "b1", "b", tokens(100, 8), false) // waits for the window, which Close ends
	done := make(chan error, 1)
	go func() { done <- pub.Close() }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Close waited for the batch window")
	}
	assert.Equal(t, uint64(1), pub.Stats().Events, "the event in the channel is not published (Close's doc)")
}
