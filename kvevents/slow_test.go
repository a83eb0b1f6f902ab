package kvevents_test

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
)

// rawSub is a SUB socket written out by hand (ZMTP 3.0, NULL), so that a
// test controls exactly when it reads: a subscriber that stops reading.
type rawSub struct {
	c net.Conn
	r *bufio.Reader
}

func dialRaw(t *testing.T, addr string, readBuffer int) *rawSub {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	if readBuffer > 0 {
		require.NoError(t, c.(*net.TCPConn).SetReadBuffer(readBuffer))
	}
	s := &rawSub{c: c, r: bufio.NewReader(c)}
	var g [64]byte
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:], "NULL")
	_, err = c.Write(g[:])
	require.NoError(t, err)
	ready := append([]byte{5}, "READY"...)
	ready = append(ready, 11)
	ready = append(ready, "Socket-Type"...)
	ready = binary.BigEndian.AppendUint32(ready, 3)
	ready = append(ready, "SUB"...)
	_, err = c.Write(append([]byte{0x04, byte(len(ready))}, ready...))
	require.NoError(t, err)
	_, err = io.ReadFull(s.r, g[:])
	require.NoError(t, err)
	_, more, cmd, err := s.frame()
	require.NoError(t, err)
	require.True(t, cmd && !more, "READY")
	_, err = c.Write([]byte{0x00, 1, 1}) // subscribe to everything
	require.NoError(t, err)
	return s
}

func (s *rawSub) frame() (body []byte, more, cmd bool, err error) {
	flags, err := s.r.ReadByte()
	if err != nil {
		return nil, false, false, err
	}
	var n uint64
	if flags&0x02 != 0 {
		var b [8]byte
		if _, err := io.ReadFull(s.r, b[:]); err != nil {
			return nil, false, false, err
		}
		n = binary.BigEndian.Uint64(b[:])
	} else {
		b, err := s.r.ReadByte()
		if err != nil {
			return nil, false, false, err
		}
		n = uint64(b)
	}
	body = make([]byte, n)
	_, err = io.ReadFull(s.r, body)
	return body, flags&0x01 != 0, flags&0x04 != 0, err
}

// sequences reads messages until the publisher closes the connection and
// returns their sequence numbers.
func (s *rawSub) sequences(t *testing.T) []uint64 {
	t.Helper()
	var seqs []uint64
	for {
		var frames [][]byte
		for {
			f, more, _, err := s.frame()
			if err == io.EOF && len(frames) == 0 {
				return seqs
			}

			require.NoError(t, err)
			frames = append(frames, f)
			if !more {
				break
			}
		}
		require.Len(t, frames, 3)
		seqs = append(seqs, binary.BigEndian.Uint64(frames[1]))

	}
}

// TestSlowSubscriberNeverSlowsAdmission: a subscriber that stops reading
// holds up neither the pool (no event is lost between the pool and the
// publisher, every admission completes) nor the other subscribers; what
// it lost is exactly what the publisher counts as dropped for it, and it
// can tell from the gaps in the sequence numbers.
func TestSlowSubscriberNeverSlowsAdmission(t *testing.T) {
	const cycles = 2500
	p := newPoolWith(t, 64, kvcache.PrefixConfig{EventBuffer: 1 << 16, EventTokens: true})
	pub := publisher(t, p, kvevents.Config{SubscriberQueue: 4, FullHashes: true, WriteTimeout: 5 * time.Minute,
		ReplayEndpoint: "tcp://127.0.0.1:0"})
	// A fixed receive buffer (no autotuning) of a few segments: the
	// stall fills it, and the publisher's send buffer, quickly.
	stalled := dialRaw(t, pub.Addr().String(), 256<<10)
	live := dialSubscriber(t, pub, "")
	waitSubscribed(t, pub, 2)

	// Each cycle publishes a 60-page prompt in tenant a's domain, which
	// evicts the previous one: two events of 60 keys (full hashes) and
	// the prompt's 240 token IDs, ~5 KiB a cycle, 12 MiB in all, far more
	// than the stalled subscriber's socket buffers hold.
	liveDone := make(chan mirror)
	var target atomic.Uint64 // the last batch, once known
	target.Store(math.MaxUint64)
	go func() {
		// The live subscriber keeps up (replaying what it misses). Its
		// queue is as short as the stalled one's, so it too may lose
		// batches, the last ones included: then nothing more arrives,
		// and it replays the tail once its socket is closed below.
		for live.next <= target.Load() {
			if _, err := live.recvOrClosed(); err != nil {
				break
			}
		}
		if last := target.Load(); live.next <= last {
			live.missed += last + 1 - live.next
			live.replayFrom(live.next, last+1)
		}
		liveDone <- live.mirror
	}()
	var last []kvcache.BlockKey
	for i := range cycles {
		last = publish(t, p, fmt.Sprintf("r%d", i), "a", tokens(1000*i, 240), false)
	}
	lastSeq := waitPublished(t, p, pub)
	target.Store(lastSeq)
	require.Zero(t, p.Stats().Prefix.EventsDropped, "the publisher read every event the pool produced")
	var got mirror
	select {
	case got = <-liveDone:
	case <-time.After(3 * time.Second): // the tail was dropped for it too
		live.sub.Close()
		got = <-liveDone
	}
	// The pool keeps the latest prompt and what its admission did not
	// need to evict of the one before.
	for h := range hashesOf(last) {
		require.True(t, got["tenant:a"][h], "the subscriber that reads mirrors the pool")
	}
	require.Equal(t, p.Stats().Prefix.Domains[0].IndexedPages, len(got["tenant:a"]))
	require.Len(t, got, 1)
	// SubscriberDrops counts every subscriber's; the live one's are the
	// batches it saw gaps for.
	drops := pub.Stats().SubscriberDrops - live.missed
	require.Positive(t, drops, "the stalled subscriber's queue overflowed")

	live.sub.Close() // it stops reading now: it must not hold up Close

	// Close flushes what is queued; the stalled subscriber now reads.
	closed := make(chan error)
	go func() { closed <- pub.Close() }()
	seqs := stalled.sequences(t)
	require.NoError(t, <-closed)
	total := pub.Stats().Batches
	require.Equal(t, lastSeq+1, total)
	assert.Equal(t, total, uint64(len(seqs))+drops, "delivered + dropped = published")
	missing := uint64(0)
	prev := int64(-1)
	for _, s := range seqs {
		require.Greater(t, int64(s), prev, "in order")
		missing += s - uint64(prev+1)
		prev = int64(s)
	}
	missing += total - uint64(prev+1)
	assert.Equal(t, drops, missing, "the gaps are the drops")
}

// TestSlowSubscribersCannotStretchClose: Close flushes what is queued for
// each subscriber, and a subscriber that reads just fast enough to meet
// each write's deadline must not make that flush take a WriteTimeout per
// write: Close ends within about one WriteTimeout however many writes the
// slow subscribers' queues hold, and a subscriber that keeps up still gets
// every batch.
func TestSlowSubscribersCannotStretchClose(t *testing.T) {
	const timeout = time.Second
	// A Unix socket buffers a fixed ~200 KiB, where loopback TCP's
	// autotuned buffers would take in the whole queue at once.
	endpoint := "ipc://" + ipcPath(t)
	p := newPool(t, 64, 1<<16)
	pub := publisher(t, p, kvevents.Config{Endpoint: endpoint, WriteTimeout: timeout, SubscriberQueue: 8192, MaxBatchEvents: 1})
	var slowDone sync.WaitGroup
	for range 3 {
		// 4 KiB per 20 ms: each write of 64 queued batches (about 20 KiB)
		// ends well within its deadline, the whole queue in seconds.
		slow := dialPeer(t, endpoint, "SUB")
		require.NoError(t, slow.Send([]byte{1}))
		slowDone.Go(func() {
			buf := make([]byte, 4<<10)
			for {
				if _, err := slow.Conn().Read(buf); err != nil {
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
	}
	stalled := dialPeer(t, endpoint, "SUB") // never reads
	require.NoError(t, stalled.Send([]byte{1}))
	fast := dialPeer(t, endpoint, "SUB")
	require.NoError(t, fast.Send([]byte{1}))
	waitSubscribed(t, pub, 5)
	got := make(chan uint64, 1<<16)
	go func() {
		defer close(got)
		for {
			msg, err := fast.Message()
			if err != nil {
				return
			}
			got <- binary.BigEndian.Uint64(msg[1])
		}
	}()
	next := uint64(0)
	receive := func(last uint64) {
		for ; next <= last; next++ {
			select {
			case seq := <-got:
				require.Equal(t, next, seq, "the subscriber that keeps up misses nothing")
			case <-time.After(30 * time.Second):
				t.Fatalf("batch %d never reached the subscriber that keeps up", next)
			}
		}
	}
	for i := range 4000 {
		publish(t, p, fmt.Sprintf("r%d", i), "a", tokens(1000*i, 32), false)
	}
	receive(waitPublished(t, p, pub))
	// Queued for the fast subscriber too when Close begins.
	for i := range 20 {
		publish(t, p, fmt.Sprintf("tail%d", i), "b", tokens(1000*i, 32), false)
	}
	last := waitPublished(t, p, pub)
	require.Zero(t, pub.Stats().SubscriberDrops, "every queue holds every batch")

	start := time.Now()
	require.NoError(t, pub.Close())
	took := time.Since(start)
	receive(last)
	_, open := <-got
	assert.False(t, open, "nothing after the last batch")
	assert.Less(t, took, 4*timeout, "Close waited for the slow subscribers' writes one after another")
	slowDone.Wait()
}
