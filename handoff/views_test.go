package handoff_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// lending is a Transport whose streams are ViewStreams over InProcess:
// SendViews copies the views into one message at once, as a transport
// that reads the pages where they lie would send them, but gives them
// back (done) only when the test says so, as a transport that still
// holds them in its queues would.
type lending struct {
	inner   handoff.Transport
	mu      sync.Mutex
	held    []func()
	views   int
	corrupt bool // flip a byte of the first page sent (in the message, not the pool)
}

func (l *lending) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := l.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	return &lendingStream{Stream: st, l: l}, nil
}

// giveBack calls every done held so far and reports how many.
func (l *lending) giveBack() int {
	l.mu.Lock()
	held := l.held
	l.held = nil
	l.mu.Unlock()
	for _, done := range held {
		done()
	}
	return len(held)
}

type lendingStream struct {
	handoff.Stream
	l *lending
}

func (s *lendingStream) SendViews(head []byte, views [][]byte, done func()) error {
	msg := append([]byte(nil), head...)
	for _, v := range views {
		msg = append(msg, v...)
	}
	s.l.mu.Lock()
	if s.l.corrupt {
		msg[len(head)] ^= 0xff
		s.l.corrupt = false
	}
	s.l.held = append(s.l.held, done)
	s.l.views += len(views)
	s.l.mu.Unlock()
	return s.Stream.Send(msg)
}

// A sender on a ViewStream lends the pages themselves, and they stay the
// export's until the stream gives them back: the transfer completes (the
// receiver has every byte), but the export's end — here the ack that
// ends a successful Send, then Abort and the reclaim deadline of a second
// export — waits for the stream's done, and no page is scrubbed or
// reused before.
func TestExportEndsOnlyWhenTheStreamGivesThePagesBack(t *testing.T) {
	prefill := pool(t, testkit.PoolConfig{Pages: 1024})
	decode := pool(t, testkit.PoolConfig{Pages: 1024})
	recv := receiver(t, decode)
	lt := &lending{inner: handoff.NewInProcess(recv)}
	s := sender(t, func(c *handoff.SenderConfig) { c.ReclaimAfter = 50 * time.Millisecond })

	l, err := testkit.Prefill(prefill, "lent", "victim", 100*16)
	require.NoError(t, err)
	exp, err := s.Export(l, 0)
	require.NoError(t, err)
	sent := make(chan error, 1)
	go func() { sent <- exp.Send(context.Background(), lt) }()
	select {
	case err := <-sent:
		t.Fatalf("Send returned (%v) while the stream held the pages", err)
	case <-time.After(200 * time.Millisecond): // the receiver has verified them; the ack waits
	}
	assert.Equal(t, 100, prefill.Stats().InUsePages, "the exported pages left the lease while lent")
	assert.Positive(t, lt.giveBack())
	require.NoError(t, <-sent)
	lt.mu.Lock()
	assert.Equal(t, 100*testkit.Geometry.Regions(), lt.views, "every page's every region was lent, none staged")
	lt.mu.Unlock()
	dl, ok := recv.Take("lent")
	require.True(t, ok)
	require.NoError(t, testkit.VerifyContent(decode, dl, "lent"))
	require.NoError(t, dl.Release())
	assert.False(t, exp.Live())

	// A refused transfer (a byte corrupted on the way: the checksum does
	// not match) leaves its pages lent; neither Abort nor the reclaim
	// deadline ends the export before the stream gives them back.
	l2, err := testkit.Prefill(prefill, "lent2", "victim", 30*16)
	require.NoError(t, err)
	exp2, err := s.Export(l2, 0)
	require.NoError(t, err)
	lt.mu.Lock()
	lt.corrupt = true
	lt.mu.Unlock()
	err = exp2.Send(context.Background(), lt)
	assert.ErrorIs(t, err, kvcache.ErrChecksumMismatch)
	aborted := make(chan error, 1)
	go func() { aborted <- exp2.Abort() }()
	time.Sleep(150 * time.Millisecond) // past the reclaim deadline too
	select {
	case err := <-aborted:
		t.Fatalf("Abort returned (%v) while the stream held the pages", err)
	default:
	}
	assert.True(t, exp2.Live(), "the export ended while its pages were lent")
	assert.Equal(t, 30, prefill.Stats().InUsePages, "the pages left the lease while lent")
	assert.Positive(t, lt.giveBack())
	require.NoError(t, <-aborted)
	assert.False(t, exp2.Live())
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
}
