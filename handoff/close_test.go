package handoff_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// tap is a Transport whose streams call at before the sender's first
// message of kind kind after skip of them, and offer SendViews when the
// inner stream does.
type tap struct {
	inner handoff.Transport
	kind  byte
	skip  int
	at    func()
}

func (tp *tap) Open(ctx context.Context) (handoff.Stream, error) {
	st, err := tp.inner.Open(ctx)
	if err != nil {
		return nil, err
	}
	ts := &tapStream{Stream: st, tp: tp}
	if vs, ok := st.(handoff.ViewStream); ok {
		return &tapViewStream{tapStream: ts, vs: vs}, nil
	}
	return ts, nil
}

type tapStream struct {
	handoff.Stream
	tp   *tap
	seen int
}

func (s *tapStream) saw(msg []byte) {
	if len(msg) > 0 && msg[0] == s.tp.kind {
		if s.seen == s.tp.skip {
			s.tp.at()
		}
		s.seen++
	}
}

func (s *tapStream) Send(msg []byte) error { s.saw(msg); return s.Stream.Send(msg) }

type tapViewStream struct {
	*tapStream
	vs handoff.ViewStream
}

func (s *tapViewStream) SendViews(head []byte, views [][]byte, done func()) error {
	s.saw(head)
	return s.vs.SendViews(head, views, done)
}

// TestPoolClosedDuringTransfer: either pool closed during a transfer,
// its pages staged or lent to the stream, ends it. Closed before every
// page was read and written, the transfer fails with the closed pool's
// error (the receiver's verdict when it was the decode pool) and
// delivers nothing. The prefill pool closed once every page was read
// (before the seal) takes nothing from the receiver, which verifies the
// pages and delivers the lease: Send succeeds, as it does when the
// reclaim deadline scrubbed the pages before the ack (it returned the
// prefill pool's ErrPoolClosed for a transfer that had succeeded). The
// pool still open passes its sweep either way.
func TestPoolClosedDuringTransfer(t *testing.T) {
	for _, tc := range []struct {
		side      string
		kind      byte // the message before which the pool closes
		skip      int
		delivered bool
	}{
		{"prefill", 'D', 1, false},
		{"prefill", 'S', 0, true},
		{"decode", 'D', 1, false},
		{"decode", 'S', 0, false},
	} {
		for _, lend := range []bool{false, true} {
			name := fmt.Sprintf("%s closed before %c %d", tc.side, tc.kind, tc.skip)
			if lend {
				name += ", pages lent"
			}
			t.Run(name, func(t *testing.T) {
				prefill := pool(t, testkit.PoolConfig{Pages: 128})
				decode := pool(t, testkit.PoolConfig{Pages: 128})
				recv := receiver(t, decode)
				inproc := handoff.NewInProcess(recv)
				closing, open := prefill, decode
				if tc.side == "decode" {
					closing, open = decode, prefill
				}
				var inner handoff.Transport = inproc
				var lt *lending
				if lend {
					lt = &lending{inner: inproc}
					inner = lt
				}
				closeErr := make(chan error, 1)
				via := &tap{inner: inner, kind: tc.kind, skip: tc.skip, at: func() {
					// On its own goroutine: Close waits for the pages lent to
					// the stream, which this test gives back after Send.
					go func() { closeErr <- closing.Close() }()
					require.Eventually(t, func() bool { return closing.Stats().Closed }, 5*time.Second, time.Millisecond)
				}}
				l, err := testkit.Prefill(prefill, "r", "victim", 60*16)
				require.NoError(t, err)
				exp, err := sender(t, func(c *handoff.SenderConfig) { c.FrameBytes = 8 << 10 }).Export(l, 16)
				require.NoError(t, err)
				sent := make(chan error, 1)
				go func() { sent <- exp.Send(context.Background(), via) }()
				select {
				case err = <-sent:
				case <-time.After(10 * time.Second):
					t.Fatal("Send did not return after a pool closed under it")
				}
				if lt != nil {
					lt.giveBack()
				}
				require.NoError(t, <-closeErr)
				inproc.Wait()
				dl, ok := recv.Take("r")
				if tc.delivered {
					require.NoError(t, err)
					require.True(t, ok)
					require.NoError(t, testkit.VerifyContent(decode, dl, "r"))
					require.NoError(t, dl.Release())
				} else {
					require.ErrorIs(t, err, kvcache.ErrPoolClosed)
					t.Logf("send: %v", err)
					assert.False(t, ok, "a decode lease was delivered")
				}
				if tc.side == "decode" {
					require.NoError(t, exp.Abort())
				}
				require.NoError(t, testkit.Sweep(open))
			})
		}
	}
}
