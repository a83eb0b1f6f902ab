package kvevents_test

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
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

type pythonView struct {
	Error    string              `json:"error"`
	LiveSeq  uint64              `json:"live_seq"`
	Replayed int                 `json:"replayed"`
	Counts   map[string]int      `json:"counts"`
	Mirror   map[string][]uint64 `json:"mirror"`
	Derived  [][]uint64          `json:"derived"`
}

type promptSpec struct {
	Domain    string  `json:"domain"`
	Adapter   string  `json:"adapter"`
	BlockSize int     `json:"block_size"`
	Tokens    []int32 `json:"tokens"`
}

// TestPythonSubscriberMirrorsPoolCachePerDomain: a subscriber in Python
// (libzmq through pyzmq, msgpack) decodes the batches with vLLM's schema,
// fills the gap before its first live batch from the replay socket, and
// ends up with exactly the pool's cached keys per domain; from the key
// chain the package doc gives, it derives the same block hashes the pool
// publishes.
func TestPythonSubscriberMirrorsPoolCachePerDomain(t *testing.T) {
	py := python(t)
	for _, enc := range []kvevents.Encoding{kvevents.ArrayEvents, kvevents.MapEvents} {
		t.Run(enc.String(), func(t *testing.T) {
			p := newPool(t, 64, 1024)
			pub := publisher(t, p, kvevents.Config{Encoding: enc, Topic: "kv@pod-0@model", ReplayEndpoint: "tcp://127.0.0.1:0"})
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
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, py, "testdata/subscriber.py",
				"--pub", "tcp://"+pub.Addr().String(), "--replay", "tcp://"+pub.ReplayAddr().String(),
				"--topic", "kv@pod-0@model", "--prompts", string(spec))
			cmd.Stderr = os.Stderr
			out, err := cmd.StdoutPipe()
			require.NoError(t, err)
			require.NoError(t, cmd.Start())
			lines := bufio.NewScanner(out)
			lines.Buffer(nil, 1<<20)
			require.True(t, lines.Scan())
			require.Equal(t, "subscribed", lines.Text())
			waitSubscribed(t, pub, 1)
			keys := publish(t, p, "final", "c", final, false)
			for h := range hashesOf(keys) {
				want["team"][h] = true
			}
			last := waitPublished(t, p, pub)

			require.True(t, lines.Scan(), "the subscriber's report")
			var view pythonView
			require.NoError(t, json.Unmarshal(lines.Bytes(), &view), lines.Text())
			require.NoError(t, cmd.Wait())
			require.Empty(t, view.Error)
			assert.Equal(t, last, view.LiveSeq)
			assert.Equal(t, int(last), view.Replayed, "every batch before the live one came from the replay socket")
			got := mirror{}
			for d, hs := range view.Mirror {
				got[d] = map[uint64]bool{}
				for _, h := range hs {
					got[d][h] = true
				}
			}
			assertMirrorsPool(t, p, want, got)
			assert.Equal(t, map[string]int{"BlockStored": 8, "BlockRemoved": 3, "AllBlocksCleared": 1}, view.Counts)

			// The Python derivation of the keys matches the pool's.
			require.Len(t, view.Derived, len(prompts))
			for i, pr := range prompts {
				tenant := map[string]string{"team": "c", "tenant:a": "a"}[pr.Domain]
				k, err := p.PageKeys(tenant, pr.Adapter, pr.Tokens, nil)
				require.NoError(t, err)
				var hs []uint64
				for _, key := range k {
					hs = append(hs, kvevents.BlockHash(key))
				}
				assert.Equal(t, hs, view.Derived[i], "prompt %d (%s, adapter %q)", i, pr.Domain, pr.Adapter)
			}
			assert.Equal(t, view.Derived[0][:2], hashList(keys[:2]), "the final prompt's keys as published")
		})
	}
}

func hashList(keys []kvcache.BlockKey) []uint64 {
	var out []uint64
	for _, k := range keys {
		out = append(out, kvevents.BlockHash(k))
	}
	return out
}
