package kvevents_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
)

// mediaMirror is a router's view of where a pool's pages are: per medium
// (vLLM's "GPU", "CPU"), the block hashes stored there and not removed.
type mediaMirror map[string]map[uint64]bool

func (m mediaMirror) apply(b decodedBatch) {
	for _, e := range b.events {
		switch e.tag {
		case kvevents.TagAllBlocksCleared:
			clear(m)
		case kvevents.TagBlockStored:
			if m[e.medium] == nil {
				m[e.medium] = map[uint64]bool{}
			}
			for _, h := range e.hashes {
				m[e.medium][h] = true
			}
		case kvevents.TagBlockRemoved:
			for _, h := range e.hashes {
				delete(m[e.medium], h)
			}
		}
	}
}

// TestHostTierMedium: a pool with a host tier reports, with vLLM's
// schema, where each page lives: published on the device ("GPU"), stored
// in the tier ("CPU") when the device evicts it and only then removed
// from the device (so that a router never sees a page whose parent is
// nowhere), stored on the device again when an admission onloads it, and
// removed from the tier when the tier evicts it. The Go subscriber's
// strict decoding (mirror_test.go) checks every field.
func TestHostTierMedium(t *testing.T) {
	for _, form := range []kvevents.Encoding{kvevents.ArrayEvents, kvevents.MapEvents} {
		t.Run(map[kvevents.Encoding]string{kvevents.ArrayEvents: "array", kvevents.MapEvents: "map"}[form], func(t *testing.T) {
			p, err := kvcache.New(kvcache.Config{
				Geometry: geometry, Pages: 16, MaxContextTokens: 16 * geometry.TokensPerPage,
				Tenants:  []kvcache.TenantConfig{{Name: "a"}, {Name: "b"}},
				Prefix:   kvcache.PrefixConfig{EventBuffer: 1024, EventTokens: true},
				HostTier: kvcache.HostTierConfig{Pages: 8},
			})
			require.NoError(t, err)
			t.Cleanup(func() { p.Close() })
			pub := publisher(t, p, kvevents.Config{Encoding: form, ReplayEndpoint: "tcp://127.0.0.1:0", Topic: "kv@pod@m"})
			sub := dialSubscriber(t, pub, "kv@")
			sub.media = true
			waitSubscribed(t, pub, 1)
			media := mediaMirror{}
			step := func() {
				t.Helper()
				n := len(sub.seen)
				sub.until(waitPublished(t, p, pub))
				for _, b := range sub.seen[n:] {
					media.apply(b)
				}
			}
			toks := tokens(700, 6*geometry.TokensPerPage+1)
			keys := publish(t, p, "a1", "a", toks, false)
			hashes := hashesOf(keys)
			step()
			assert.Equal(t, hashes, media["GPU"], "published on the device")
			assert.Empty(t, media["CPU"])

			hog, err := p.TryAdmit(kvcache.Request{ID: "hog", Tenant: "b", PromptTokens: 16 * geometry.TokensPerPage})
			require.NoError(t, err)
			require.NoError(t, hog.Release())
			step()
			assert.Empty(t, media["GPU"], "evicted from the device")
			assert.Equal(t, hashes, media["CPU"], "into the tier")
			var order []string
			for _, b := range sub.seen {
				for _, e := range b.events {
					order = append(order, e.tag+"/"+e.medium)
				}
			}
			assert.Equal(t, []string{"BlockStored/GPU", "BlockStored/CPU", "BlockRemoved/GPU"}, order,
				"stored in the tier before removed from the device")

			l, err := p.TryAdmit(kvcache.Request{ID: "a2", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
			require.NoError(t, err)
			require.Equal(t, 6*geometry.TokensPerPage, l.HitTokens())
			require.NoError(t, l.Release())
			step()
			assert.Equal(t, hashes, media["GPU"], "onloaded: on the device again")
			assert.Equal(t, hashes, media["CPU"], "and still in the tier")

			// Another domain's prompt fills the tier: a's pages leave it.
			publish(t, p, "b1", "b", tokens(900, 8*geometry.TokensPerPage), false)
			hog, err = p.TryAdmit(kvcache.Request{ID: "hog", Tenant: "b", PromptTokens: 16 * geometry.TokensPerPage})
			require.NoError(t, err)
			require.NoError(t, hog.Release())
			step()
			for h := range hashes {
				assert.False(t, media["GPU"][h], "a's pages left the device")
			}
			cpu := 0
			for h := range hashes {
				if media["CPU"][h] {
					cpu++
				}
			}
			s := p.Stats()
			assert.Equal(t, s.Tier.Cached, len(media["CPU"]), "the router's view of the tier is the tier")
			assert.Equal(t, s.Prefix.Domains[0].TierPages, cpu)
		})
	}
}
