package kvevents_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
)

// TestBadPeersAreRefusedCountedAndHarmless: over NULL and over CURVE, on
// the PUB and the replay socket, peers that send what they should not are
// each refused and counted by kind (Stats), while a subscriber that
// behaves, connected all along, gets every batch published meanwhile, in
// order:
//   - a peer that never completes its handshake (HandshakeTimeouts);
//   - a frame over its limit: a subscription, a replay request
//     (OversizedFrames);
//   - a replay of a sequence number out of range (OutOfRange);
//   - over CURVE: a client with a wrong server key, a client whose key is
//     not let in, a NULL peer, a message that does not open (AuthFailures);
//     a client that stops after HELLO (HandshakeTimeouts).
func TestBadPeersAreRefusedCountedAndHarmless(t *testing.T) {
	for _, secure := range []bool{false, true} {
		name := map[bool]string{false: "null", true: "curve"}[secure]
		t.Run(name, func(t *testing.T) {
			p := newPoolWith(t, 256, kvcache.PrefixConfig{EventBuffer: 1024, EventTokens: true})
			cfg := kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", WriteTimeout: 300 * time.Millisecond, BufferSteps: 4}
			var server, goodSec kvevents.CurveKey
			if secure {
				goodPub, sec, err := kvevents.NewCurveKeyPair()
				require.NoError(t, err)
				goodSec = sec
				var serverSec kvevents.CurveKey
				server, serverSec, err = kvevents.NewCurveKeyPair()
				require.NoError(t, err)
				cfg.Curve = &kvevents.CurveConfig{SecretKey: serverSec, Clients: []kvevents.CurveKey{goodPub}}
			}
			pub := publisher(t, p, cfg)
			dial := func(addr, sockType string, secret kvevents.CurveKey, stop kvevents.CurveClientStop) (*kvevents.Peer, error) {
				if !secure {
					return kvevents.DialPeer(addr, sockType, 5*time.Second)
				}
				return kvevents.DialCurvePeer(addr, sockType, server, secret, stop, 5*time.Second)
			}
			good, err := dial(pub.Addr().String(), "SUB", goodSec, kvevents.CurveComplete)
			require.NoError(t, err)
			defer good.Conn().Close()
			require.NoError(t, good.Send([]byte{1}))
			waitSubscribed(t, pub, 1)

			// Publishing goes on throughout, one batch after each bad peer.
			round := 0
			next := func() {
				round++
				publish(t, p, fmt.Sprintf("r%d", round), "a", tokens(1000*round, 8), false)
				waitPublished(t, p, pub)
			}
			waitCount := func(what string, get func(kvevents.Stats) uint64, want uint64) {
				t.Helper()
				require.Eventually(t, func() bool { return get(pub.Stats()) >= want }, 10*time.Second, time.Millisecond,
					"%s: %+v", what, pub.Stats())
				next()
			}
			timeouts := func(s kvevents.Stats) uint64 { return s.HandshakeTimeouts }
			oversized := func(s kvevents.Stats) uint64 { return s.OversizedFrames }
			auth := func(s kvevents.Stats) uint64 { return s.AuthFailures }

			// Never completes the handshake: a greeting and nothing else.
			for _, addr := range []string{pub.Addr().String(), pub.ReplayAddr().String()} {
				c, err := net.Dial("tcp", addr)
				require.NoError(t, err)
				defer c.Close()
				_, err = c.Write([]byte{0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f})
				require.NoError(t, err)
			}
			waitCount("silent peers", timeouts, 2)

			// Oversized frames, after a complete handshake.
			sub, err := dial(pub.Addr().String(), "SUB", goodSec, kvevents.CurveComplete)
			require.NoError(t, err)
			defer sub.Conn().Close()
			require.NoError(t, sub.Send(append([]byte{1}, bytes.Repeat([]byte("x"), 2<<10)...)))
			rep, err := dial(pub.ReplayAddr().String(), "DEALER", goodSec, kvevents.CurveComplete)
			require.NoError(t, err)
			defer rep.Conn().Close()
			require.NoError(t, rep.Send(make([]byte, 4<<10)))
			waitCount("oversized frames", oversized, 2)

			// A replay out of range, then one in range on the same socket.
			rep, err = dial(pub.ReplayAddr().String(), "DEALER", goodSec, kvevents.CurveComplete)
			require.NoError(t, err)
			defer rep.Conn().Close()
			require.NoError(t, rep.Send(beBytes(1<<40)))
			msg, err := rep.Message()
			require.NoError(t, err)
			require.Equal(t, [][]byte{beBytes(^uint64(0)), {}}, msg, "the end marker alone")
			assert.Equal(t, uint64(1), pub.Stats().OutOfRange)
			last := pub.Stats().Batches - 1
			require.NoError(t, rep.Send(beBytes(last)))
			msg, err = rep.Message()
			require.NoError(t, err)
			assert.Equal(t, beBytes(last), msg[0], "the client is served after its refused request")
			next()

			if secure {
				_, otherSec, err := kvevents.NewCurveKeyPair()
				require.NoError(t, err)
				otherServer, _, err := kvevents.NewCurveKeyPair()
				require.NoError(t, err)
				for _, addr := range []string{pub.Addr().String(), pub.ReplayAddr().String()} {
					_, err := kvevents.DialCurvePeer(addr, "SUB", otherServer, goodSec, kvevents.CurveComplete, 5*time.Second)
					require.Error(t, err, "a wrong server key")
					_, err = kvevents.DialCurvePeer(addr, "DEALER", server, otherSec, kvevents.CurveComplete, 5*time.Second)
					require.Error(t, err, "a key not let in")
					_, err = kvevents.DialPeer(addr, "SUB", 5*time.Second)
					require.Error(t, err, "a NULL peer")
				}
				waitCount("wrong keys, NULL peers", auth, 6)

				tampered, err := dial(pub.Addr().String(), "SUB", goodSec, kvevents.CurveComplete)
				require.NoError(t, err)
				defer tampered.Conn().Close()
				require.NoError(t, tampered.SendTampered([]byte{1}))
				waitCount("a message that does not open", auth, 7)

				stalled, err := kvevents.DialCurvePeer(pub.Addr().String(), "SUB", server, goodSec, kvevents.CurveAfterHello, 5*time.Second)
				require.NoError(t, err)
				defer stalled.Conn().Close()
				waitCount("a client that stops after HELLO", timeouts, 3)
			}

			last = pub.Stats().Batches - 1
			for seq := uint64(0); seq <= last; seq++ {
				good.Conn().SetReadDeadline(time.Now().Add(10 * time.Second))
				msg, err := good.Message()
				require.NoError(t, err)
				require.Len(t, msg, 3)
				require.Equal(t, seq, beUint64(msg[1]), "the subscriber that behaves gets every batch, in order")
			}
			s := pub.Stats()
			assert.Zero(t, s.SubscriberDrops)
			assert.Equal(t, 1, s.Subscribers, "only the subscriber that behaves is left")
			assert.Equal(t, s.Disconnects, s.AuthFailures+s.HandshakeTimeouts+s.OversizedFrames, "every refusal of a kind")
		})
	}
}

func beBytes(n uint64) []byte { return binary.BigEndian.AppendUint64(nil, n) }
