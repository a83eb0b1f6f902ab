package kvevents_test

import (
	"bytes"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvevents"
)

// logBuffer is a Logger's output, safe for the publisher's goroutines.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *logBuffer) logger() *slog.Logger { return slog.New(slog.NewTextHandler(l, nil)) }

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
	log := &logBuffer{}
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{Logger: log.logger()})
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
	require.Eventually(t, func() bool { return pub.Stats().Subscribers == 0 }, 10*time.Second, time.Millisecond)
	assert.Equal(t, uint64(1), pub.Stats().Disconnects, "the subscriber that broke the protocol, not the one that left")
	assert.Contains(t, log.String(), "frame of 2000 bytes")
}

// TestReplayProtocolErrorCountsAsDisconnect: the same for a replay client.
func TestReplayProtocolErrorCountsAsDisconnect(t *testing.T) {
	log := &logBuffer{}
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", Logger: log.logger()})
	bad := dialPeer(t, pub.ReplayAddr().String(), "DEALER")
	require.NoError(t, bad.Send(make([]byte, 100)))
	requireClosedByPublisher(t, bad)
	require.Eventually(t, func() bool { return pub.Stats().Disconnects == 1 }, 10*time.Second, time.Millisecond)
	assert.Contains(t, log.String(), "frame of 100 bytes")
}
