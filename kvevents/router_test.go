package kvevents_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/internal/routerindex"
	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
)

// TestRouterIndexKeepsDomainsApart: two pods, each a pool publishing with
// token IDs, and a router whose index derives its own keys from tokens and
// extra keys as llm-d's indexer does (internal/routerindex), subscribed to
// both over NULL (go-zeromq's SUB) or over CURVE. Every stored block is
// indexed and every removal applied; a request of domain acme scores the
// pod that holds acme's prefix and not the pod holding the same prompt for
// another domain, and a request of a third domain scores no pod; an
// adapter's prompt is found under its adapter only.
func TestRouterIndexKeepsDomainsApart(t *testing.T) {
	for _, secure := range []bool{false, true} {
		t.Run(map[bool]string{false: "null", true: "curve"}[secure], func(t *testing.T) {
			idx := routerindex.New(geometry.TokensPerPage, "")
			var serverPub, serverSec, clientSec kvevents.CurveKey
			if secure {
				var err error
				serverPub, serverSec, err = kvevents.NewCurveKeyPair()
				require.NoError(t, err)
				_, clientSec, err = kvevents.NewCurveKeyPair()
				require.NoError(t, err)
			}
			type pod struct {
				pool *kvcache.Pool
				pub  *kvevents.Publisher
			}
			pods := map[string]pod{}
			received := make(chan error, 16)
			for _, name := range []string{"pod-a", "pod-b"} {
				p, err := kvcache.New(kvcache.Config{
					Geometry: geometry, Pages: 64, MaxContextTokens: 64 * geometry.TokensPerPage,
					Tenants: []kvcache.TenantConfig{{Name: "acme-1", Domain: "acme"}, {Name: "acme-2", Domain: "acme"}, {Name: "globex"}},
					Prefix:  kvcache.PrefixConfig{EventBuffer: 1024, EventTokens: true},
				})
				require.NoError(t, err)
				t.Cleanup(func() { p.Close() })
				cfg := kvevents.Config{Topic: "kv@" + name + "@model"}
				if secure {
					cfg.Curve = &kvevents.CurveConfig{SecretKey: serverSec}
				}
				pub := publisher(t, p, cfg)
				pods[name] = pod{p, pub}
				go func() { received <- subscribeRouter(t, pub, idx, secure, serverPub, clientSec) }()
				waitSubscribed(t, pub, 1)
			}

			prompt := tokens(5000, 40) // 10 pages
			run := func(podName, id, tenant, adapter string, toks []int32) {
				po := pods[podName]
				publishUnder(t, po.pool, id, tenant, adapter, toks, false)
				waitPublished(t, po.pool, po.pub)
			}
			run("pod-a", "a1", "acme-1", "", prompt)
			run("pod-b", "b1", "globex", "", prompt)                             // the same prompt, another domain
			run("pod-b", "b2", "acme-2", "lora-7", prompt)                       // acme's, under an adapter
			run("pod-a", "a2", "acme-2", "", append(prompt, tokens(9000, 8)...)) // continues acme's prompt: 2 pages with a parent
			waitIndexed(t, idx, pods["pod-a"].pub, pods["pod-b"].pub)

			salted := func(domain string) []uint64 {
				return idx.Keys(u32(prompt), "model", kvevents.CacheSalt(domain))
			}
			assert.Equal(t, map[string]int{"pod-a": 10}, idx.Score(salted("acme")), "acme's prompt is on pod-a only")
			assert.Equal(t, map[string]int{"pod-b": 10}, idx.Score(salted("tenant:globex")), "globex's on pod-b only")
			assert.Empty(t, idx.Score(salted("tenant:initech")), "another domain finds no pod")
			assert.Empty(t, idx.Score(idx.Keys(u32(prompt), "model", "")), "nor does a request without a domain")
			assert.Equal(t, map[string]int{"pod-b": 10},
				idx.Score(idx.Keys(u32(prompt), "lora-7", kvevents.CacheSalt("acme"))), "the adapter's blocks, on pod-b")
			longer := idx.Keys(u32(append(prompt, tokens(9000, 8)...)), "model", kvevents.CacheSalt("acme"))
			best, blocks := idx.Best(longer)
			assert.Equal(t, "pod-a", best)
			assert.Equal(t, 12, blocks, "the continuation indexed under its parent's key")

			// Evict everything cached on pod-a: its entries go, pod-b's stay.
			a := pods["pod-a"]
			hog, err := a.pool.TryAdmit(kvcache.Request{ID: "hog", Tenant: "globex", PromptTokens: 64 * geometry.TokensPerPage})
			require.NoError(t, err)
			require.NoError(t, hog.Release())
			waitPublished(t, a.pool, a.pub)
			waitIndexed(t, idx, pods["pod-a"].pub, pods["pod-b"].pub)
			assert.Empty(t, idx.Score(salted("acme")), "pod-a's blocks are gone from the index")
			assert.Equal(t, map[string]int{"pod-b": 10}, idx.Score(salted("tenant:globex")))

			var stored, evicted uint64
			for _, po := range pods {
				for _, d := range po.pool.Stats().Prefix.Domains {
					stored += d.StoredPages
					evicted += d.EvictedPages
				}
			}
			s := idx.Stats()
			assert.Equal(t, stored, s.Indexed, "every stored block indexed")
			assert.Zero(t, s.Skipped)
			assert.Equal(t, evicted, s.Removed, "every removal applied")
			assert.Zero(t, s.Unknown)
			select {
			case err := <-received:
				require.NoError(t, err)
			default:
			}
		})
	}
}

func u32(toks []int32) []uint32 {
	out := make([]uint32, len(toks))
	for i, t := range toks {
		out[i] = uint32(t)
	}
	return out
}

// waitIndexed waits until idx has applied every batch the publishers have
// published.
func waitIndexed(t *testing.T, idx *routerindex.Index, pubs ...*kvevents.Publisher) {
	t.Helper()
	require.Eventually(t, func() bool {
		var total uint64
		for _, p := range pubs {
			total += p.Stats().Batches
		}
		return idx.Stats().Batches == total
	}, 10*time.Second, time.Millisecond)
}

// subscribeRouter feeds idx the batches of pub until the test ends: over
// go-zeromq's SUB, or over CURVE with the package's DialSubscriber.
func subscribeRouter(t *testing.T, pub *kvevents.Publisher, idx *routerindex.Index, secure bool, server, secret kvevents.CurveKey) error {
	var recv func() ([][]byte, error)
	if secure {
		sub, err := kvevents.DialSubscriber("tcp://"+pub.Addr().String(), "", &kvevents.ClientCurve{ServerKey: server, SecretKey: secret}, 5*time.Second)
		if err != nil {
			return err
		}
		t.Cleanup(func() { sub.Close() })
		recv = func() ([][]byte, error) {
			topic, seq, payload, err := sub.Recv()
			return [][]byte{[]byte(topic), binary.BigEndian.AppendUint64(nil, seq), payload}, err
		}
	} else {
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		sub := zmq4.NewSub(ctx)
		t.Cleanup(func() { sub.Close() })
		if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
			return err
		}
		if err := sub.Dial("tcp://" + pub.Addr().String()); err != nil {
			return err
		}
		recv = func() ([][]byte, error) {
			m, err := sub.Recv()
			return m.Frames, err
		}
	}
	for {
		frames, err := recv()
		if err != nil {
			return nil // closed at the test's end
		}
		if len(frames) != 3 {
			return fmt.Errorf("a message of %d frames", len(frames))
		}
		if err := idx.Apply(string(frames[0]), frames[2]); err != nil {
			return err
		}
	}
}

// TestRouterIndexFollowsHostTier: a pod with a host tier, and a router
// whose index keeps a pod's hold on a block per device tier, as llm-d's
// does (PodEntry{pod, tier}, from each event's medium). When the pod's
// device evicts a domain's prompt into its tier, the router still sends
// the domain's requests there (the prefix is on the pod, in "cpu"); once
// an admission onloads it, it is on both; another domain still finds
// nothing; and when the tier evicts it too, the pod holds nothing of it.
func TestRouterIndexFollowsHostTier(t *testing.T) {
	idx := routerindex.New(geometry.TokensPerPage, "")
	p, err := kvcache.New(kvcache.Config{
		Geometry: geometry, Pages: 16, MaxContextTokens: 16 * geometry.TokensPerPage,
		Tenants:  []kvcache.TenantConfig{{Name: "acme-1", Domain: "acme"}, {Name: "globex"}},
		Prefix:   kvcache.PrefixConfig{EventBuffer: 1024, EventTokens: true},
		HostTier: kvcache.HostTierConfig{Pages: 8},
	})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	pub := publisher(t, p, kvevents.Config{Topic: "kv@pod-a@model"})
	received := make(chan error, 1)
	go func() { received <- subscribeRouter(t, pub, idx, false, kvevents.CurveKey{}, kvevents.CurveKey{}) }()
	waitSubscribed(t, pub, 1)
	sync := func() {
		t.Helper()
		waitPublished(t, p, pub)
		waitIndexed(t, idx, pub)
	}
	hog := func() {
		t.Helper()
		l, err := p.TryAdmit(kvcache.Request{ID: "hog", Tenant: "globex", PromptTokens: 16 * geometry.TokensPerPage})
		require.NoError(t, err)
		require.NoError(t, l.Release())
	}
	prompt := tokens(5000, 6*geometry.TokensPerPage+1)
	acme := idx.Keys(u32(prompt), "model", kvevents.CacheSalt("acme"))[:6]
	publish(t, p, "a1", "acme-1", prompt, false)
	sync()
	assert.Equal(t, map[string]int{"pod-a": 6}, idx.Score(acme))
	assert.Equal(t, map[string][]string{"pod-a": {"gpu"}}, idx.Tiers(acme[5]))

	hog()
	sync()
	assert.Equal(t, map[string]int{"pod-a": 6}, idx.Score(acme), "the prefix is still on pod-a, in its tier")
	assert.Equal(t, map[string][]string{"pod-a": {"cpu"}}, idx.Tiers(acme[5]))
	assert.Empty(t, idx.Score(idx.Keys(u32(prompt), "model", kvevents.CacheSalt("tenant:globex"))), "another domain finds nothing")

	l, err := p.TryAdmit(kvcache.Request{ID: "a2", Tenant: "acme-1", PromptTokens: len(prompt), TokenIDs: prompt})
	require.NoError(t, err)
	require.Equal(t, 6*geometry.TokensPerPage, l.HitTokens())
	require.NoError(t, l.Release())
	sync()
	assert.Equal(t, map[string][]string{"pod-a": {"cpu", "gpu"}}, idx.Tiers(acme[5]), "onloaded: on both")

	// globex's own prompts take the device and the tier.
	publish(t, p, "g1", "globex", tokens(9000, 8*geometry.TokensPerPage), false)
	hog()
	publish(t, p, "g2", "globex", tokens(19000, 8*geometry.TokensPerPage), false)
	hog()
	sync()
	assert.Empty(t, idx.Score(acme), "evicted from the tier too: pod-a holds none of it")
	assert.Zero(t, idx.Stats().Unknown, "every removal names a block the router holds on that tier")
	select {
	case err := <-received:
		require.NoError(t, err)
	default:
	}
}
