package handoff_test

import (
	"context"
	"errors"
	"fmt"
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

// failingViews is a ViewStream over InProcess whose SendViews fails at
// its failAt'th call (counting from 1), giving that frame's views back at
// once and closing the stream under it, as a broken connection would;
// it counts the views lent and given back.
type failingViews struct {
	handoff.Stream
	failAt        int
	calls         int
	lent, givenUp int
}

func (s *failingViews) SendViews(head []byte, views [][]byte, done func()) error {
	s.calls++
	s.lent++
	defer func() { s.givenUp++; done() }()
	if s.calls == s.failAt {
		s.Stream.Close() // as a broken connection: both ends see it
		return errors.New("failingViews: the connection broke")
	}
	msg := append([]byte(nil), head...)
	for _, v := range views {
		msg = append(msg, v...)
	}
	return s.Stream.Send(msg)
}

type failingViewsTransport struct {
	inner  handoff.Transport
	failAt int
	last   *failingViews
}

func (t *failingViewsTransport) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := t.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	t.last = &failingViews{Stream: st, failAt: t.failAt}
	return t.last, nil
}

// A stream that breaks in the middle of the data frames, while the
// sender has the next frame's pages lent to it (it sums a frame ahead of
// the stream), leaves no page pinned: Send reports the transport's
// error, the export can still be aborted at once, and the prefill pool
// holds nothing afterwards. Each failing frame is tried: the first, one
// in the middle, and the last.
func TestStreamThatBreaksMidTransferLeavesNoPagePinned(t *testing.T) {
	const pages, perFrame = 40, 4 // 10 frames of 4 pages
	for _, failAt := range []int{1, 5, 10} {
		t.Run(fmt.Sprint("frame=", failAt), func(t *testing.T) {
			prefill := pool(t, testkit.PoolConfig{Pages: 256})
			decode := pool(t, testkit.PoolConfig{Pages: 256})
			recv := receiver(t, decode)
			pb := int(prefill.PageBytes())
			s := sender(t, func(c *handoff.SenderConfig) { c.FrameBytes = perFrame*(pb+4) + 64 })
			inner := handoff.NewInProcess(recv)
			tr := &failingViewsTransport{inner: inner, failAt: failAt}

			l, err := testkit.Prefill(prefill, "broken", "victim", pages*16)
			require.NoError(t, err)
			exp, err := s.Export(l, 0)
			require.NoError(t, err)
			err = exp.Send(context.Background(), tr)
			require.ErrorIs(t, err, handoff.ErrTransport)
			assert.Equal(t, failAt, tr.last.calls, "frames offered to the stream")
			assert.Equal(t, tr.last.lent, tr.last.givenUp)

			aborted := make(chan error, 1)
			go func() { aborted <- exp.Abort() }()
			select {
			case err := <-aborted:
				require.NoError(t, err)
			case <-time.After(5 * time.Second):
				t.Fatal("Abort still waits for lent pages after the stream broke")
			}
			assert.False(t, exp.Live())
			assert.Zero(t, prefill.Stats().InUsePages)
			require.NoError(t, testkit.Sweep(prefill))
			inner.Wait() // the receiver has seen the break and dropped its import
			require.NoError(t, testkit.Sweep(decode))
		})
	}
}
