package tcpx

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// watchReadv has every readv report its count on the channel it returns,
// for the rest of the test.
func watchReadv(t *testing.T) <-chan int {
	readvs := make(chan int, 1<<12)
	readvHook = func(n int) { readvs <- n }
	t.Cleanup(func() { readvHook = nil })
	return readvs
}

// A readv fills what has arrived, which may end in the middle of a
// buffer, or at a zero-length one: the next readv must begin exactly
// there. The sender here writes each piece only once a readv has taken
// some of the one before, so the reads are partial whatever the timing,
// and they are readv's: plain TCP takes it.
func TestPlacedReadvAdvancesPastPartialReads(t *testing.T) {
	readvs := watchReadv(t)
	w, r := tcpPair(t)
	g := newGuarded(5, 0, 11, 7, 0, 3, 20, 0)
	pieces := []int{2, 4, 9, 1, 13, 17}
	const headLen = 4
	msg := randomBytes(headLen+g.size(), 8)
	sent := make(chan error, 1)
	go func() {
		b := frame(msg)
		if _, err := w.Write(b[:prefixLen+headLen]); err != nil {
			sent <- err
			return
		}
		b = b[prefixLen+headLen:]
		for _, k := range pieces {
			if _, err := w.Write(b[:k]); err != nil {
				sent <- err
				return
			}
			b = b[k:]
			select {
			case <-readvs:
			case <-time.After(10 * time.Second):
				sent <- os.ErrDeadlineExceeded
				return
			}
		}
		sent <- nil
	}()
	fr := placedReader(r, DefaultMaxMessageBytes)
	_, placed, err := fr.nextPlaced(placeAfter(t, headLen, msg, g.bufs))
	require.NoError(t, err)
	require.NoError(t, <-sent, "a readv for every piece")
	assert.True(t, placed)
	g.check(t, msg[headLen:])
}

// InterruptRecv ends a RecvPlaced whose readv has filled part of its
// buffers and waits for the rest.
func TestInterruptRecvEndsAPlacedReadvMidway(t *testing.T) {
	readvs := watchReadv(t)
	w, r := tcpPair(t)
	msg := randomBytes(100000, 9)
	_, err := w.Write(frame(msg)[:prefixLen+30000]) // and the rest never
	require.NoError(t, err)
	e := placedEnd(r, time.Hour)
	go func() {
		<-readvs
		time.Sleep(10 * time.Millisecond) // most likely in the wait; either way it must end
		e.InterruptRecv()
	}()
	got := make(chan error, 1)
	go func() {
		_, _, err := e.RecvPlaced(placeAfter(t, 8, msg, [][]byte{make([]byte, len(msg)-8)}))
		got <- err
	}()
	select {
	case err := <-got:
		assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
	case <-time.After(10 * time.Second):
		t.Fatal("RecvPlaced still waits 10 s after InterruptRecv")
	}
}
