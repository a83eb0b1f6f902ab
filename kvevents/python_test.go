package kvevents_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
)

// python returns an interpreter that has Debian's python3-zmq and
// python3-msgpack, or skips the test (fails it under KVF_REQUIRE_ALL=1,
// as CI runs it). KVF_PYTHON names one explicitly.
func python(t *testing.T) string {
	t.Helper()
	candidates := []string{os.Getenv("KVF_PYTHON"), "/usr/bin/python3", "python3"}
	for _, c := range candidates {
		if c == "" {
			continue
		}
		if err := exec.Command(c, "-c", "import zmq, msgpack").Run(); err == nil {
			return c
		}
	}
	if os.Getenv("KVF_REQUIRE_ALL") == "1" {
		t.Fatal("no python3 with zmq and msgpack (apt-get install python3-zmq python3-msgpack)")
	}
	t.Skip("no python3 with zmq and msgpack (apt-get install python3-zmq python3-msgpack)")
	return ""
}

// pythonCurve skips (or fails, under KVF_REQUIRE_ALL=1) unless py's libzmq
// speaks CURVE.
func pythonCurve(t *testing.T, py string) {
	t.Helper()
	if err := exec.Command(py, "-c", "import zmq, sys; sys.exit(0 if zmq.has('curve') else 1)").Run(); err != nil {
		if os.Getenv("KVF_REQUIRE_ALL") == "1" {
			t.Fatal("python3-zmq's libzmq has no CURVE")
		}
		t.Skip("python3-zmq's libzmq has no CURVE")
	}
}

type pythonView struct {
	Error           string              `json:"error"`
	Live            bool                `json:"live"`
	Replay          bool                `json:"replay"`
	LastLive        uint64              `json:"last_live"`
	Replayed        int                 `json:"replayed"`
	ReplayIdentical bool                `json:"replay_identical"`
	Counts          map[string]int      `json:"counts"`
	StoredBlocks    int                 `json:"stored_blocks"`
	Rederived       int                 `json:"rederived"`
	WithoutTokens   int                 `json:"without_tokens"`
	RemovedBlocks   int                 `json:"removed_blocks"`
	Mirror          map[string][]uint64 `json:"mirror"`
	Derived         [][]uint64          `json:"derived"`
}

type promptSpec struct {
	Domain    string  `json:"domain"`
	Adapter   string  `json:"adapter"`
	BlockSize int     `json:"block_size"`
	Tokens    []int32 `json:"tokens"`
}

// pythonSubscriber starts testdata/subscriber.py with args and returns
// once it has subscribed; report waits for its JSON line and its exit.
func pythonSubscriber(t *testing.T, py string, args ...string) (report func() pythonView) {
	t.Helper()
	raw := pythonSubscriberRaw(t, py, args...)
	return func() pythonView {
		t.Helper()
		view, err := raw()
		require.Empty(t, view.Error)
		require.NoError(t, err)
		return view
	}
}

// pythonSubscriberRaw is pythonSubscriber for a subscriber that may fail:
// report returns its view and its exit.
func pythonSubscriberRaw(t *testing.T, py string, args ...string) (report func() (pythonView, error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	cmd := exec.CommandContext(ctx, py, append([]string{"testdata/subscriber.py"}, args...)...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	lines := bufio.NewScanner(out)
	lines.Buffer(nil, 16<<20)
	require.True(t, lines.Scan())
	require.Equal(t, "subscribed", lines.Text())
	return func() (pythonView, error) {
		t.Helper()
		require.True(t, lines.Scan(), "the subscriber's report")
		var view pythonView
		require.NoError(t, json.Unmarshal(lines.Bytes(), &view), lines.Text())
		return view, cmd.Wait()
	}
}

// TestPythonFullHashesBreakIntegerTypedConsumers: with FullHashes, vLLM's
// schema (hashes bytes | int) decodes every batch and indexes every block,
// and a consumer typed as vLLM's example subscriber is (list[int]) refuses
// the first batch with a block hash in it, as the package doc says.
func TestPythonFullHashesBreakIntegerTypedConsumers(t *testing.T) {
	py := python(t)
	p := newPoolWith(t, 64, kvcache.PrefixConfig{EventBuffer: 64, EventTokens: true})
	pub := publisher(t, p, kvevents.Config{FullHashes: true, ReplayEndpoint: "tcp://127.0.0.1:0"})
	for i, typ := range []string{"any", "int"} {
		next := pub.Stats().Batches
		report := pythonSubscriberRaw(t, py, "--pub", "tcp://"+pub.Addr().String(), "--replay", "tcp://"+pub.ReplayAddr().String(),
			"--form", "array", "--hash-type", typ, "--until", jsonInt(next))
		waitSubscribed(t, pub, 1)
		publish(t, p, "r"+typ, "a", tokens(100*i, 8), false)
		waitPublished(t, p, pub)
		view, err := report()
		if typ == "any" {
			require.NoError(t, err)
			require.Empty(t, view.Error)
			assert.Equal(t, 2, view.StoredBlocks)
			assert.Equal(t, 2, view.Rederived)
		} else {
			require.Error(t, err)
			assert.Contains(t, view.Error, "block_hashes")
		}
		require.Eventually(t, func() bool { return pub.Stats().Subscribers == 0 }, 10*time.Second, time.Millisecond)
	}
}

// TestPythonSubscriberIndexesEveryBlock: a subscriber in Python (libzmq
// through pyzmq, msgpack) decodes every batch strictly with vLLM's schema
// in the form it is sent, fills the gap before its first live batch from
// the replay socket, which sends the very bytes it sent live, and ends up
// with exactly the pool's cached blocks per domain: every stored block
// indexed (its hash re-derived from the token_ids and lora_name the event
// carries, in the domain its cache salt or its parent names), every
// removal applied. It does so over NULL and over CURVE (with its key let
// in), and its key chain derives the hashes the pool publishes.
func TestPythonSubscriberIndexesEveryBlock(t *testing.T) {
	py := python(t)
	for _, tc := range []struct {
		name  string
		enc   kvevents.Encoding
		curve bool
	}{
		{"array/null", kvevents.ArrayEvents, false},
		{"map/null", kvevents.MapEvents, false},
		{"array/curve", kvevents.ArrayEvents, true},
		{"map/curve", kvevents.MapEvents, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPoolWith(t, 64, kvcache.PrefixConfig{EventBuffer: 1024, EventTokens: true})
			cfg := kvevents.Config{Encoding: tc.enc, Topic: "kv@pod-0@model", ReplayEndpoint: "tcp://127.0.0.1:0"}
			var args []string
			if tc.curve {
				pythonCurve(t, py)
				serverPub, serverSec, err := kvevents.NewCurveKeyPair()
				require.NoError(t, err)
				clientPub, clientSec, err := kvevents.NewCurveKeyPair()
				require.NoError(t, err)
				cfg.Curve = &kvevents.CurveConfig{SecretKey: serverSec, Clients: []kvevents.CurveKey{clientPub}}
				args = []string{"--server-key", hex.EncodeToString(serverPub[:]), "--client-secret", hex.EncodeToString(clientSec[:])}
			}
			pub := publisher(t, p, cfg)
			want := script(t, p)
			waitPublished(t, p, pub)

			final := append(tokens(700, 8), tokens(900, 4)...) // after the subscriber joins
			prompts := []promptSpec{
				{Domain: "team", BlockSize: 4, Tokens: final},
				{Domain: "tenant:a", BlockSize: 4, Tokens: tokens(400, 16)},
				{Domain: "tenant:a", Adapter: "lora-7", BlockSize: 4, Tokens: tokens(400, 16)},
			}
			spec, err := json.Marshal(prompts)
			require.NoError(t, err)
			next := pub.Stats().Batches + 1 // the two batches below
			report := pythonSubscriber(t, py, append(args, "--pub", "tcp://"+pub.Addr().String(),
				"--replay", "tcp://"+pub.ReplayAddr().String(), "--topic", "kv@pod-0@model", "--form", tc.enc.String(),
				"--until", jsonInt(next), "--prompts", string(spec))...)
			waitSubscribed(t, pub, 1)
			keys := publish(t, p, "final", "c", final, false)
			for h := range hashesOf(keys) {
				want["team"][h] = true
			}
			last := waitPublished(t, p, pub)
			lora := publishUnder(t, p, "lora", "a", "lora-7", tokens(400, 16), false)
			for h := range hashesOf(lora) {
				want["tenant:a"][h] = true
			}
			last = waitPublished(t, p, pub)
			require.Equal(t, next, last)

			view := report()
			assert.Equal(t, last, view.LastLive)
			assert.Equal(t, int(last)+1, view.Replayed, "the whole buffer replayed")
			assert.True(t, view.ReplayIdentical, "replayed batches are the bytes sent live")
			got := mirror{}
			for d, hs := range view.Mirror {
				got[d] = map[uint64]bool{}
				for _, h := range hs {
					got[d][h] = true
				}
			}
			assertMirrorsPool(t, p, want, got)
			assert.Equal(t, map[string]int{"BlockStored": 9, "BlockRemoved": 3, "AllBlocksCleared": 1}, view.Counts)
			var stored, evicted int
			for _, d := range p.Stats().Prefix.Domains {
				stored += int(d.StoredPages)
				evicted += int(d.EvictedPages)
			}
			assert.Equal(t, stored, view.StoredBlocks, "every stored block")
			assert.Equal(t, stored, view.Rederived, "every stored block re-derived from its token_ids")
			assert.Zero(t, view.WithoutTokens)
			assert.Equal(t, evicted, view.RemovedBlocks, "every removal applied")

			// The Python derivation of the keys matches the pool's.
			require.Len(t, view.Derived, len(prompts))
			for i, pr := range prompts {
				tenant := map[string]string{"team": "c", "tenant:a": "a"}[pr.Domain]
				k, err := p.PageKeys(tenant, pr.Adapter, pr.Tokens, nil)
				require.NoError(t, err)
				assert.Equal(t, hashList(k), view.Derived[i], "prompt %d (%s, adapter %q)", i, pr.Domain, pr.Adapter)
			}
			assert.Equal(t, view.Derived[0][:2], hashList(keys[:2]), "the final prompt's keys as published")
			assert.Equal(t, view.Derived[2], hashList(lora), "the adapter's keys as published")
			if tc.curve {
				assert.Zero(t, pub.Stats().AuthFailures)
			}
		})
	}
}

// TestPythonSubscriberWithoutTheKeyGetsNothing: over CURVE, a libzmq
// subscriber and replay client with another server key, or with the right
// one but a key of their own that is not let in, get no batch and no
// replay; each of their connections is refused and counted, and a
// subscriber with the key, connected all along, gets every batch.
func TestPythonSubscriberWithoutTheKeyGetsNothing(t *testing.T) {
	py := python(t)
	pythonCurve(t, py)
	p := newPoolWith(t, 64, kvcache.PrefixConfig{EventBuffer: 1024, EventTokens: true})
	_, serverSec, err := kvevents.NewCurveKeyPair()
	require.NoError(t, err)
	goodPub, goodSec, err := kvevents.NewCurveKeyPair()
	require.NoError(t, err)
	otherPub, _, err := kvevents.NewCurveKeyPair()
	require.NoError(t, err)
	_, strangerSec, err := kvevents.NewCurveKeyPair()
	require.NoError(t, err)
	serverPub := serverSec.Public()
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", WriteTimeout: time.Second,
		Curve: &kvevents.CurveConfig{SecretKey: serverSec, Clients: []kvevents.CurveKey{goodPub}}})
	good, err := kvevents.DialCurvePeer(pub.Addr().String(), "SUB", serverPub, goodSec, kvevents.CurveComplete, 5*time.Second)
	require.NoError(t, err)
	defer good.Conn().Close()
	require.NoError(t, good.Send(append([]byte{1}, ""...)))
	waitSubscribed(t, pub, 1)

	endpoints := []string{"--pub", "tcp://" + pub.Addr().String(), "--replay", "tcp://" + pub.ReplayAddr().String(), "--form", "array", "--expect-nothing"}
	for name, args := range map[string][]string{
		"wrong server key": {"--server-key", hex.EncodeToString(otherPub[:])},
		"key not let in":   {"--server-key", hex.EncodeToString(serverPub[:]), "--client-secret", hex.EncodeToString(strangerSec[:])},
	} {
		before := pub.Stats().AuthFailures
		report := pythonSubscriber(t, py, append(args, endpoints...)...)
		for i := range 3 { // batches it must not see
			publish(t, p, name+jsonInt(uint64(i)), "a", tokens(1000*i, 8), false)
		}
		view := report()
		assert.False(t, view.Live, "%s: a live batch", name)
		assert.False(t, view.Replay, "%s: a replay", name)
		assert.GreaterOrEqual(t, pub.Stats().AuthFailures-before, uint64(2), "%s: both sockets refused it, counted", name)
	}
	last := waitPublished(t, p, pub)
	for seq := uint64(0); seq <= last; seq++ {
		msg, err := good.Message()
		require.NoError(t, err)
		require.Len(t, msg, 3)
		assert.Equal(t, seq, beUint64(msg[1]), "the subscriber with the key gets every batch")
	}
}

func hashList(keys []kvcache.BlockKey) []uint64 {
	var out []uint64
	for _, k := range keys {
		out = append(out, kvevents.BlockHash(k))
	}
	return out
}

func jsonInt(n uint64) string { return strconv.FormatUint(n, 10) }

func beUint64(b []byte) uint64 { return binary.BigEndian.Uint64(b) }
