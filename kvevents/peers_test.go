package kvevents_test

import (
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/internal/testlog"
	"github.com/kvfence/kvfence/kvevents"
)

func dialPeer(t *testing.T, addr, sockType string) *kvevents.Peer {
	t.Helper()
	p, err := kvevents.DialPeer(addr, sockType, 10*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { p.Conn().Close() })
	return p
}

// requireClosedByPublisher reads from p until the publisher closes the
// connection, which it must do within 10 s.
func requireClosedByPublisher(t *testing.T, p *kvevents.Peer) {
	t.Helper()
	p.Conn().SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		_, _, _, err := p.Frame()
		if err != nil {
			require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "the publisher kept the connection open")
			return
		}
	}
}

// TestSubscriberProtocolErrorCountsAsDisconnect: a subscriber that breaks
// the protocol (here, a message over the size of a subscription) is cut
// off, counted in Stats.Disconnects and logged with what it did, as one
// that stops reading is; one that just goes away is not counted.
func TestSubscriberProtocolErrorCountsAsDisconnect(t *testing.T) {
	log := &testlog.Buffer{}
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{Logger: log.Logger()})
	gone := dialPeer(t, pub.Addr().String(), "SUB")
	require.NoError(t, gone.Send([]byte{1}))
	waitSubscribed(t, pub, 1)
	gone.Conn().Close()
	require.Eventually(t, func() bool { return pub.Stats().Subscribers == 0 }, 10*time.Second, time.Millisecond)

	bad := dialPeer(t, pub.Addr().String(), "SUB")
	require.NoError(t, bad.Send([]byte{1}))
	waitSubscribed(t, pub, 1)
	require.NoError(t, bad.Send(make([]byte, 2000)))
	requireClosedByPublisher(t, bad)
	log.WaitFor(t, "frame of 2000 bytes")
	assert.Equal(t, uint64(1), pub.Stats().Disconnects, "the subscriber that broke the protocol, not the one that left")
}

// TestReplayProtocolErrorCountsAsDisconnect: the same for a replay client.
func TestReplayProtocolErrorCountsAsDisconnect(t *testing.T) {
	log := &testlog.Buffer{}
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", Logger: log.Logger()})
	bad := dialPeer(t, pub.ReplayAddr().String(), "DEALER")
	require.NoError(t, bad.Send(make([]byte, 100)))
	requireClosedByPublisher(t, bad)
	log.WaitFor(t, "frame of 100 bytes")
	assert.Equal(t, uint64(1), pub.Stats().Disconnects)
}

// TestSubscriberWithEndlessSubscriptionsIsCutOff: every subscription a
// subscriber sends is kept (ZMQ counts them) and scanned for every batch
// under the publisher's lock, so their number is bounded: a subscriber
// that sends one after another, without end, is cut off rather than
// growing the publisher's memory and its cost per batch without bound.
func TestSubscriberWithEndlessSubscriptionsIsCutOff(t *testing.T) {
	log := &testlog.Buffer{}
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{Logger: log.Logger()})
	sub := dialPeer(t, pub.Addr().String(), "SUB")
	var subs []byte
	for i := range 10_000 {
		subs = append(subs, 0, 101, 1)
		subs = append(subs, fmt.Sprintf("%0100d", i)...)
	}
	go sub.Conn().Write(subs) // fails once the publisher has hung up
	requireClosedByPublisher(t, sub)
	log.WaitFor(t, "more than 256 subscriptions")
	assert.Equal(t, uint64(1), pub.Stats().Disconnects)
}

// TestPingAfterIdleSpellGetsPong: a subscriber's heartbeat (a PING, which
// libzmq sends with ZMQ_HEARTBEAT_IVL set) is answered with a PONG
// however long the publisher has been quiet: the write deadline of the
// last batch, long past, must not fail the PONG, and so the subscriber.
func TestPingAfterIdleSpellGetsPong(t *testing.T) {
	const timeout = 200 * time.Millisecond
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{WriteTimeout: timeout})
	sub := dialPeer(t, pub.Addr().String(), "SUB")
	require.NoError(t, sub.Send([]byte{1}))
	waitSubscribed(t, pub, 1)
	publish(t, p, "a1", "a", tokens(0, 8), false)
	msg, err := sub.Message()
	require.NoError(t, err)
	require.Len(t, msg, 3)

	time.Sleep(3 * timeout) // quiet, past the batch's write deadline
	require.NoError(t, sub.Command("PING", []byte{0, 10, 'c', 't', 'x'}))
	sub.Conn().SetReadDeadline(time.Now().Add(10 * time.Second))
	body, _, cmd, err := sub.Frame()
	require.NoError(t, err, "no PONG")
	assert.True(t, cmd)
	assert.Equal(t, "\x04PONGctx", string(body))
	assert.Equal(t, 1, pub.Stats().Subscribers)
	assert.Zero(t, pub.Stats().Disconnects)
}

// requireClosedAtOnce dials addr and requires the publisher to close the
// connection without a byte, well before any timeout of its own.
func requireClosedAtOnce(t *testing.T, addr string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(c)
	require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "the connection over MaxPeers was kept open")
	assert.Empty(t, got, "the connection over MaxPeers was greeted")
}

// TestConnectionsOverMaxPeersClosedAtOnce: MaxPeers bounds connections,
// not just those past the handshake: a connection over it is closed at
// once (Config's doc), and connections still in their handshake count,
// so that peers that connect and say nothing cannot hold an unbounded
// number of connections and goroutines for WriteTimeout each.
func TestConnectionsOverMaxPeersClosedAtOnce(t *testing.T) {
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", MaxPeers: 1, WriteTimeout: 30 * time.Second})

	sub := dialPeer(t, pub.Addr().String(), "SUB")
	require.NoError(t, sub.Send([]byte{1}))
	waitSubscribed(t, pub, 1)
	requireClosedAtOnce(t, pub.Addr().String())

	// A replay client that connects and says nothing holds the one slot.
	silent, err := net.Dial("tcp", pub.ReplayAddr().String())
	require.NoError(t, err)
	defer silent.Close()
	var greeting [64]byte
	_, err = io.ReadFull(silent, greeting[:]) // its handshake has begun
	require.NoError(t, err)
	requireClosedAtOnce(t, pub.ReplayAddr().String())
	require.Eventually(t, func() bool { return pub.Stats().Disconnects == 2 }, 10*time.Second, time.Millisecond)
}

// TestCloseCutsShortStalledHandshake: Close does not wait for a peer that
// connected and says nothing to reach its handshake timeout, on either
// socket.
func TestCloseCutsShortStalledHandshake(t *testing.T) {
	p := newPool(t, 64, 64)
	pub, err := kvevents.New(p, kvevents.Config{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0",
		WriteTimeout: time.Minute})
	require.NoError(t, err)
	for _, addr := range []string{pub.Addr().String(), pub.ReplayAddr().String()} {
		silent, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		defer silent.Close()
		var greeting [64]byte
		_, err = io.ReadFull(silent, greeting[:]) // its handshake has begun
		require.NoError(t, err)
	}
	closed := make(chan error, 1)
	go func() { closed <- pub.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Close waited for stalled handshakes")
	}
	assert.Zero(t, pub.Stats().Disconnects, "a handshake Close cut short is no peer cut off")
}

// TestReplayClientPinsNoEvictedBatch: a replay client that has been
// served and stays connected, as REQ and DEALER sockets do, holds none of
// the batches it was sent: once the replay buffer lets one go, it is
// freed. Otherwise each of MaxPeers idle clients could keep a whole
// buffer's worth (BufferBytes) alive past its bound.
func TestReplayClientPinsNoEvictedBatch(t *testing.T) {
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 1})
	publish(t, p, "r0", "a", tokens(0, 8), false)
	waitPublished(t, p, pub)
	first := pub.NewestBatch()

	client := dialPeer(t, pub.ReplayAddr().String(), "DEALER")
	require.NoError(t, client.Send(binary.BigEndian.AppendUint64(nil, 0)))
	var seqs []uint64
	for {
		msg, err := client.Message()
		require.NoError(t, err)
		require.Len(t, msg, 2, "a DEALER's reply: sequence, payload")
		seq := binary.BigEndian.Uint64(msg[0])
		if seq == ^uint64(0) {
			break
		}
		seqs = append(seqs, seq)
	}
	require.Equal(t, []uint64{0}, seqs)

	publish(t, p, "r1", "a", tokens(100, 8), false) // batch 1 takes batch 0's place
	waitPublished(t, p, pub)
	require.Eventually(t, func() bool {
		runtime.GC()
		return first.Value() == nil
	}, 5*time.Second, 10*time.Millisecond, "batch 0 is still held after leaving the replay buffer")
}

// replay asks for the batches from start, as a REQ socket does (an empty
// delimiter, then the sequence), and returns the sequence numbers of the
// reply up to its end marker, which it requires.
func replay(t *testing.T, client *kvevents.Peer, start uint64) []uint64 {
	t.Helper()
	require.NoError(t, client.Send([]byte{}, binary.BigEndian.AppendUint64(nil, start)))
	client.Conn().SetReadDeadline(time.Now().Add(10 * time.Second))
	seqs := []uint64{}
	for {
		msg, err := client.Message()
		require.NoError(t, err, "no end marker")
		require.Len(t, msg, 3, "delimiter, sequence, payload")
		require.Empty(t, msg[0])
		seq := binary.BigEndian.Uint64(msg[1])
		if seq == ^uint64(0) {
			require.Empty(t, msg[2], "the end marker's payload")
			return seqs
		}
		require.NotEmpty(t, msg[2])
		seqs = append(seqs, seq)
	}
}

// TestReplayStartOutOfRangeIsRefused: a start in the buffer, or at the
// next batch's number, gets the buffered batches from there on (possibly
// none), then the end marker; a start before the buffer (batches gone that
// no replay can give back) or past the next batch gets the end marker
// alone, counted in OutOfRange and logged; a malformed request is counted
// and answered with nothing. The connection serves the next request
// after each.
func TestReplayStartOutOfRangeIsRefused(t *testing.T) {
	log := &testlog.Buffer{}
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 3, Logger: log.Logger()})
	client := dialPeer(t, pub.ReplayAddr().String(), "REQ")
	assert.Empty(t, replay(t, client, 0), "nothing published yet")
	for i := range 5 {
		publish(t, p, fmt.Sprintf("r%d", i), "a", tokens(100*i, 8), false)
		waitPublished(t, p, pub) // one batch each: 0..4, 2..4 buffered
	}
	refused := 0
	for _, tc := range []struct {
		start uint64
		want  []uint64
	}{
		{0, nil}, {1, nil}, // gone
		{2, []uint64{2, 3, 4}}, {4, []uint64{4}}, {5, []uint64{}},
		{6, nil}, {1 << 40, nil}, {math.MaxUint64 - 1, nil}, {math.MaxUint64, nil}, // not yet
	} {
		got := replay(t, client, tc.start)
		if tc.want == nil {
			refused++
			assert.Empty(t, got, "from %d: refused", tc.start)
		} else {
			assert.Equal(t, tc.want, got, "from %d", tc.start)
		}
	}
	require.NoError(t, client.Send([]byte{}, []byte{0, 0, 0, 1}))
	assert.Equal(t, []uint64{3, 4}, replay(t, client, 3), "after a malformed request")
	s := pub.Stats()
	assert.Equal(t, uint64(1), s.BadRequests)
	assert.Equal(t, uint64(refused), s.OutOfRange)
	assert.Equal(t, uint64(11), s.Replays)
	log.WaitFor(t, "replay request out of range")
}

// TestSilentPeerCutOffAtHandshakeTimeout: a peer that connects and never
// finishes its handshake, on either socket, is cut off once the handshake
// timeout (WriteTimeout) has passed, counted and logged, rather than
// holding its connection, goroutine and MaxPeers slot for good.
func TestSilentPeerCutOffAtHandshakeTimeout(t *testing.T) {
	log := &testlog.Buffer{}
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", WriteTimeout: 100 * time.Millisecond,
		Logger: log.Logger()})
	for _, addr := range []string{pub.Addr().String(), pub.ReplayAddr().String()} {
		silent, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		defer silent.Close()
		silent.SetReadDeadline(time.Now().Add(10 * time.Second))
		got, err := io.ReadAll(silent)
		require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "the publisher kept a silent peer past its handshake timeout")
		assert.Len(t, got, 64, "the greeting, then nothing")
	}
	require.Eventually(t, func() bool { return pub.Stats().Disconnects == 2 }, 10*time.Second, time.Millisecond)
	log.WaitFor(t, "reading the greeting")
}

// TestSubscriberThatWantsNothingIsCutOffWhenIdle: a subscriber with no
// subscription that matches the topic (none at all, another topic's, or
// one it cancelled) will never be sent anything, so it holds a MaxPeers
// slot, a goroutine and a queue for nothing: it is cut off after
// IdleTimeout, counted and logged. A subscriber that wants the topic is
// kept however quiet the pool is.
func TestSubscriberThatWantsNothingIsCutOffWhenIdle(t *testing.T) {
	const idle = 100 * time.Millisecond
	log := &testlog.Buffer{}
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{Topic: "kv@pod@model", IdleTimeout: idle, Logger: log.Logger()})
	wants := dialPeer(t, pub.Addr().String(), "SUB")
	require.NoError(t, wants.Send(append([]byte{1}, "kv@"...)))
	waitSubscribed(t, pub, 1)

	silent := dialPeer(t, pub.Addr().String(), "SUB")
	other := dialPeer(t, pub.Addr().String(), "SUB")
	require.NoError(t, other.Send(append([]byte{1}, "metrics@"...)))
	cancelled := dialPeer(t, pub.Addr().String(), "SUB")
	require.NoError(t, cancelled.Send(append([]byte{1}, "kv@pod"...)))
	waitSubscribed(t, pub, 3)
	require.NoError(t, cancelled.Send(append([]byte{0}, "kv@pod"...)))
	for _, s := range []*kvevents.Peer{silent, other, cancelled} {
		requireClosedByPublisher(t, s)
	}
	require.Eventually(t, func() bool { return pub.Stats().Disconnects == 3 }, 10*time.Second, time.Millisecond)
	log.WaitFor(t, "idle")

	// The one that wants the topic has been quiet as long, and stays.
	assert.Equal(t, 1, pub.Stats().Subscribers)
	publish(t, p, "a1", "a", tokens(0, 8), false)
	wants.Conn().SetReadDeadline(time.Now().Add(10 * time.Second))
	msg, err := wants.Message()
	require.NoError(t, err, "the subscriber that wants the topic was cut off")
	assert.Equal(t, "kv@pod@model", string(msg[0]))
}

// TestIdleReplayClientIsCutOff: a replay client that sends no request for
// IdleTimeout after its last answer holds a MaxPeers slot for nothing: it
// is cut off, counted and logged; a malformed request does not keep it.
func TestIdleReplayClientIsCutOff(t *testing.T) {
	const idle = 100 * time.Millisecond
	log := &testlog.Buffer{}
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", IdleTimeout: idle, Logger: log.Logger()})
	client := dialPeer(t, pub.ReplayAddr().String(), "REQ")
	assert.Empty(t, replay(t, client, 0))
	require.NoError(t, client.Send([]byte{}, []byte{0, 0, 0, 1}))
	requireClosedByPublisher(t, client)
	require.Eventually(t, func() bool { return pub.Stats().Disconnects == 1 }, 10*time.Second, time.Millisecond)
	log.WaitFor(t, "idle")
	assert.Equal(t, uint64(1), pub.Stats().Replays)
	assert.Equal(t, uint64(1), pub.Stats().BadRequests)
}

// TestNegativeIdleTimeoutNeverCutsIdlePeers: a negative IdleTimeout turns
// the idle cut-off off (it must not become a deadline in the past, which
// would cut every peer off at once).
func TestNegativeIdleTimeoutNeverCutsIdlePeers(t *testing.T) {
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", IdleTimeout: -1})
	silent := dialPeer(t, pub.Addr().String(), "SUB")
	client := dialPeer(t, pub.ReplayAddr().String(), "DEALER")
	require.NoError(t, client.Send(binary.BigEndian.AppendUint64(nil, 0)))
	client.Conn().SetReadDeadline(time.Now().Add(10 * time.Second))
	msg, err := client.Message()
	require.NoError(t, err, "no end marker")
	require.Equal(t, binary.BigEndian.AppendUint64(nil, ^uint64(0)), msg[0])

	wants := dialPeer(t, pub.Addr().String(), "SUB")
	require.NoError(t, wants.Send([]byte{1}))
	waitSubscribed(t, pub, 1)
	publish(t, p, "a1", "a", tokens(0, 8), false)
	_, err = wants.Message()
	require.NoError(t, err)
	assert.Equal(t, 2, pub.Stats().Subscribers, "the silent subscriber was cut off")
	require.NoError(t, client.Send(binary.BigEndian.AppendUint64(nil, 0)))
	_, err = client.Message()
	require.NoError(t, err, "the replay client was cut off")
	assert.Zero(t, pub.Stats().Disconnects)
	silent.Conn().Close()
}
