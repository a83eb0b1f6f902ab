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

	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
)

// geometry keeps pages tiny: 4 tokens, 64 bytes per region.
var geometry = kvcache.Geometry{TokensPerPage: 4, Layers: 1, KVHeads: 1, HeadDim: 8, DType: kvcache.BF16}

// newPool has tenant a in its own domain and tenants b and c sharing the
// domain "team".
func newPool(t testing.TB, pages, eventBuffer int) *kvcache.Pool {
	t.Helper()
	return newPoolWith(t, pages, kvcache.PrefixConfig{EventBuffer: eventBuffer})
}

// newPoolWith is newPool with a prefix config of its own (EventTokens).
func newPoolWith(t testing.TB, pages int, prefix kvcache.PrefixConfig) *kvcache.Pool {
	t.Helper()
	p, err := kvcache.New(kvcache.Config{
		Geometry: geometry, Pages: pages, MaxContextTokens: pages * geometry.TokensPerPage,
		Tenants: []kvcache.TenantConfig{{Name: "a"}, {Name: "b", Domain: "team"}, {Name: "c", Domain: "team"}},
		Prefix:  prefix,
	})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

func publisher(t testing.TB, p *kvcache.Pool, cfg kvevents.Config) *kvevents.Publisher {
	t.Helper()
	if cfg.Endpoint == "" {
		cfg.Endpoint = "tcp://127.0.0.1:0"
	}
	pub, err := kvevents.New(p, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { pub.Close() })
	return pub
}

func tokens(start, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(start + i)
	}
	return out
}

// publish admits a prompt, "prefills" it and publishes its full pages;
// the lease stays live if keep.
func publish(t testing.TB, p *kvcache.Pool, id, tenant string, toks []int32, keep bool) []kvcache.BlockKey {
	t.Helper()
	return publishUnder(t, p, id, tenant, "", toks, keep)
}

// publishUnder is publish under an adapter.
func publishUnder(t testing.TB, p *kvcache.Pool, id, tenant, adapter string, toks []int32, keep bool) []kvcache.BlockKey {
	t.Helper()
	l, err := p.TryAdmit(kvcache.Request{ID: id, Tenant: tenant, PromptTokens: len(toks), TokenIDs: toks, Adapter: adapter})
	require.NoError(t, err)
	require.NoError(t, l.Commit(len(toks)))
	_, err = l.CachePrefix(len(toks))
	require.NoError(t, err)
	if !keep {
		require.NoError(t, l.Release())
	}
	keys, err := p.PageKeys(tenant, adapter, toks, nil)
	require.NoError(t, err)
	return keys
}

// script runs stores, sharing, a cross-domain prompt, a clear, an
// eviction of everything cached and a final round on a 64-page pool, and
// returns what the pool's cache holds at its end, per domain.
func script(t testing.TB, p *kvcache.Pool) mirror {
	t.Helper()
	publish(t, p, "a1", "a", tokens(0, 32), false)
	publish(t, p, "b1", "b", tokens(100, 24), false)
	// c shares b's domain: its first 6 pages are hits, 2 new ones follow.
	publish(t, p, "c1", "c", append(tokens(100, 24), tokens(200, 8)...), false)
	// b sends a's tokens: another domain, other keys.
	publish(t, p, "b2", "b", tokens(0, 32), false)
	require.NoError(t, p.ClearPrefixCache())

	publish(t, p, "a2", "a", tokens(300, 64), false)
	hog, err := p.TryAdmit(kvcache.Request{ID: "hog", Tenant: "b", PromptTokens: p.Pages() * geometry.TokensPerPage})
	require.NoError(t, err, "the whole pool: every cached page is evicted")
	require.NoError(t, hog.Release())

	live := publish(t, p, "a3", "a", tokens(400, 16), true)
	shared := publish(t, p, "c2", "c", tokens(500, 16), false)
	require.NoError(t, p.Check())
	return mirror{"tenant:a": hashesOf(live), "team": hashesOf(shared)}
}

// assertMirrorsPool checks a router's mirror against what the script
// says and what the pool's own index counts.
func assertMirrorsPool(t *testing.T, p *kvcache.Pool, want, got mirror) {
	t.Helper()
	assert.Equal(t, want, got)
	for _, d := range p.Stats().Prefix.Domains {
		assert.Equal(t, d.IndexedPages, len(got[d.Name]), "domain %s", d.Name)
	}
}

// goSubscriber is a router's receiving side over go-zeromq, an
// independent ZMTP implementation: a SUB socket, and a DEALER for
// replays, used as vLLM's example subscriber does on a gap.
type goSubscriber struct {
	t      *testing.T
	sub    zmq4.Socket
	replay zmq4.Socket
	next   uint64 // next sequence number expected
	mirror mirror
	// media: the pool has a host tier, whose pages a mirror of domains
	// alone cannot follow (a page stored on two media, removed from one):
	// only decode (the test mirrors media, tier_test.go).
	media  bool
	seen   []decodedBatch
	gaps   int
	missed uint64 // batches it saw gaps for: the publisher's drops for it
}

func dialSubscriber(t *testing.T, pub *kvevents.Publisher, topic string) *goSubscriber {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s := &goSubscriber{t: t, sub: zmq4.NewSub(ctx), mirror: mirror{}}
	t.Cleanup(func() { s.sub.Close() })
	require.NoError(t, s.sub.SetOption(zmq4.OptionSubscribe, topic))
	require.NoError(t, s.sub.Dial("tcp://"+pub.Addr().String()))
	if a := pub.ReplayAddr(); a != nil {
		s.replay = zmq4.NewDealer(ctx)
		t.Cleanup(func() { s.replay.Close() })
		require.NoError(t, s.replay.Dial("tcp://"+a.String()))
	}
	return s
}

// waitSubscribed waits until n subscribers' subscriptions have reached
// the publisher.
func waitSubscribed(t *testing.T, pub *kvevents.Publisher, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return pub.Subscribed() == n }, 10*time.Second, time.Millisecond)
}

// recv handles one live message, replaying first what it missed.
func (s *goSubscriber) recv() uint64 {
	seq, err := s.recvOrClosed()
	require.NoError(s.t, err)
	return seq
}

// recvOrClosed is recv for a reader whose socket may be closed under it.
func (s *goSubscriber) recvOrClosed() (uint64, error) {
	t := s.t
	msg, err := s.sub.Recv()
	if err != nil {
		return 0, err
	}
	require.Len(t, msg.Frames, 3, "topic, sequence, payload")
	seq := binary.BigEndian.Uint64(msg.Frames[1])
	if seq < s.next {
		return seq, nil // already replayed
	}
	if seq > s.next {
		s.gaps++
		s.missed += seq - s.next
		s.replayFrom(s.next, seq)
	}
	s.apply(seq, msg.Frames[2])
	return seq, nil
}

// replayFrom asks for every batch from start and applies those before
// upTo; it returns the sequence numbers it got.
func (s *goSubscriber) replayFrom(start, upTo uint64) []uint64 {
	t := s.t
	require.NotNil(t, s.replay, "a gap, and no replay socket")
	var seqb [8]byte
	binary.BigEndian.PutUint64(seqb[:], start)
	require.NoError(t, s.replay.Send(zmq4.NewMsgFrom([]byte{}, seqb[:])))
	var got []uint64
	for {
		msg, err := s.replay.Recv()
		require.NoError(t, err)
		require.Len(t, msg.Frames, 3, "delimiter, sequence, payload")
		require.Empty(t, msg.Frames[0])
		seq := binary.BigEndian.Uint64(msg.Frames[1])
		if seq == ^uint64(0) {
			require.Empty(t, msg.Frames[2], "the end marker has an empty payload")
			return got
		}
		got = append(got, seq)
		if seq >= s.next && seq < upTo {
			s.apply(seq, msg.Frames[2])
		}
	}
}

func (s *goSubscriber) apply(seq uint64, payload []byte) {
	require.Equal(s.t, s.next, seq, "batches apply in order")
	b := decodeBatch(s.t, payload)
	if !s.media {
		s.mirror.apply(s.t, b)
	}
	s.seen = append(s.seen, b)
	s.next = seq + 1
}

// until receives until batch last has been applied.
func (s *goSubscriber) until(last uint64) {
	for s.next <= last {
		s.recv()
	}
}

// waitPublished waits until the publisher has published every event the
// pool sent and returns the last batch's sequence number.
func waitPublished(t *testing.T, p *kvcache.Pool, pub *kvevents.Publisher) uint64 {
	t.Helper()
	sent := p.Stats().Prefix.EventsSent
	require.Eventually(t, func() bool { return pub.Stats().Events == sent }, 30*time.Second, time.Millisecond)
	return pub.Stats().Batches - 1
}

// TestGoSubscriberMirrorsPoolCachePerDomain: a router that decodes the
// batches with vLLM's schema ends up with exactly the pool's cached keys
// in each sharing domain, in every encoding.
func TestGoSubscriberMirrorsPoolCachePerDomain(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  kvevents.Config
	}{
		{"array", kvevents.Config{Encoding: kvevents.ArrayEvents}},
		{"map", kvevents.Config{Encoding: kvevents.MapEvents}},
		{"array/full-hashes", kvevents.Config{Encoding: kvevents.ArrayEvents, FullHashes: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPool(t, 64, 1024)
			tc.cfg.ReplayEndpoint = "tcp://127.0.0.1:0"
			tc.cfg.Topic = "kv@pod-0@model"
			tc.cfg.DataParallelRank = 3
			pub := publisher(t, p, tc.cfg)
			sub := dialSubscriber(t, pub, "kv@")
			waitSubscribed(t, pub, 1)
			want := script(t, p)
			last := waitPublished(t, p, pub)
			sub.until(last)
			assertMirrorsPool(t, p, want, sub.mirror)

			// What every event says, besides its keys.
			var stored, removed, cleared int
			for _, b := range sub.seen {
				assert.Equal(t, 3, b.rank)
				assert.InDelta(t, float64(time.Now().Unix()), b.ts, 60)
				for _, e := range b.events {
					switch e.tag {
					case kvevents.TagBlockStored:
						stored++
						assert.Equal(t, 4, e.blockSize)
						assert.Empty(t, e.tokenIDs, "the pool carries no tokens unless configured to")
						assert.Equal(t, "GPU", e.medium)
						assert.Nil(t, e.loraName)
					case kvevents.TagBlockRemoved:
						removed++
						assert.Equal(t, "GPU", e.medium)
					case kvevents.TagAllBlocksCleared:
						cleared++
					}
				}
			}
			assert.Equal(t, 7, stored, "a1, b1, c1's two new pages, b2, a2, a3, c2")
			assert.Equal(t, 3, removed, "the clear evicted both domains' cached pages (one event each), the hog a2's")
			assert.Equal(t, 1, cleared)
			assert.Zero(t, pub.Stats().Lost)
		})
	}
}

// TestStoredEventsChainToTheirParent: a run of pages published after a
// shared prefix names the prefix's last key as its parent, so a router
// can extend the chain it already has.
func TestStoredEventsChainToTheirParent(t *testing.T) {
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0"})
	sub := dialSubscriber(t, pub, "")
	waitSubscribed(t, pub, 1)
	first := publish(t, p, "b1", "b", tokens(100, 24), false)
	second := publish(t, p, "c1", "c", append(tokens(100, 24), tokens(200, 8)...), false)
	sub.until(waitPublished(t, p, pub))
	var events []decodedEvent
	for _, b := range sub.seen {
		events = append(events, b.events...)
	}
	require.Len(t, events, 2)
	assert.Nil(t, events[0].parent, "a prompt's first page has no parent")
	require.NotNil(t, events[1].parent)
	assert.Equal(t, kvevents.BlockHash(first[5]), *events[1].parent)
	assert.Equal(t, []uint64{kvevents.BlockHash(second[6]), kvevents.BlockHash(second[7])}, events[1].hashes)
	assert.Empty(t, events[1].salt, "a continuation names no salt: its parent is in the domain")
}

// TestReplayAfterGapReturnsMissedBatches: a subscriber that was away sees
// the sequence jump, asks the replay socket from the first batch it
// missed, and gets exactly the batches it missed, then the end marker.
func TestReplayAfterGapReturnsMissedBatches(t *testing.T) {
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0"})
	away := dialSubscriber(t, pub, "")
	waitSubscribed(t, pub, 1)
	publish(t, p, "r0", "a", tokens(0, 8), false)
	away.until(waitPublished(t, p, pub))
	require.Equal(t, uint64(1), away.next)
	away.sub.Close() // it goes away
	require.Eventually(t, func() bool { return pub.Stats().Subscribers == 0 }, 10*time.Second, time.Millisecond)

	for i := range 5 {
		publish(t, p, fmt.Sprintf("r%d", i+1), "a", tokens(1000*(i+1), 8), false)
		waitPublished(t, p, pub) // one batch each
	}
	back := dialSubscriber(t, pub, "")
	back.next, back.mirror = away.next, away.mirror // it remembers where it was
	waitSubscribed(t, pub, 1)
	publish(t, p, "r6", "b", tokens(50000, 8), false)
	seq := back.recv()
	require.Equal(t, 1, back.gaps)
	require.Equal(t, uint64(6), seq)
	// The replay filled batches 1..seq-1, in order: apply checked it.
	assert.Equal(t, seq+1, back.next)
	assert.Len(t, back.mirror["tenant:a"], 6*2, "r0..r5, two pages each")
	assert.Len(t, back.mirror["team"], 2, "r6")

	// A replay from a given point sends what is buffered from there.
	assert.Equal(t, []uint64{2, 3, 4, 5, 6}, back.replayFrom(2, 0))
	assert.Equal(t, uint64(2), pub.Stats().Replays)
}

// TestReplayBufferIsBounded: only the latest BufferSteps batches can be
// replayed; a replay from before them is refused.
func TestReplayBufferIsBounded(t *testing.T) {
	p := newPool(t, 64, 64)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0", BufferSteps: 3})
	sub := dialSubscriber(t, pub, "")
	for i := range 6 {
		publish(t, p, fmt.Sprintf("r%d", i), "a", tokens(100*i, 8), false)
		waitPublished(t, p, pub)
	}
	assert.Equal(t, []uint64{3, 4, 5}, sub.replayFrom(3, 0))
	assert.Empty(t, sub.replayFrom(0, 0))
	assert.Equal(t, uint64(1), pub.Stats().OutOfRange)
}

// TestResyncAfterPoolDroppedEvents: when the pool's event channel
// overflowed before the publisher read it, the publisher counts the loss
// and sends AllBlocksCleared before the next event, so that a router
// drops a view that misses stores or removals.
func TestResyncAfterPoolDroppedEvents(t *testing.T) {
	p := newPool(t, 64, 2)
	// The pool fills its channel of 2 before the publisher exists.
	for i := range 5 {
		publish(t, p, fmt.Sprintf("r%d", i), "a", tokens(100*i, 8), false)
	}
	dropped := p.Stats().Prefix.EventsDropped
	require.Equal(t, uint64(3), dropped)
	pub := publisher(t, p, kvevents.Config{ReplayEndpoint: "tcp://127.0.0.1:0"})
	sub := dialSubscriber(t, pub, "")
	waitSubscribed(t, pub, 1)
	last := publish(t, p, "after", "a", tokens(9000, 8), false)
	sub.until(waitPublished(t, p, pub))
	s := pub.Stats()
	assert.Equal(t, dropped, s.Lost)
	assert.Equal(t, uint64(1), s.Resyncs)
	// Events 1 and 2 were delivered, 3-5 lost: the router's view is
	// cleared and holds only what came after.
	assert.Equal(t, mirror{"tenant:a": hashesOf(last)}, sub.mirror)
}

// TestPublisherRefusesBadConfig: a config the publisher cannot run with is
// refused with a specific error and binds nothing.
func TestPublisherRefusesBadConfig(t *testing.T) {
	p := newPool(t, 16, 4)
	noEvents, err := kvcache.New(kvcache.Config{Geometry: geometry, Pages: 16, MaxContextTokens: 64,
		Tenants: []kvcache.TenantConfig{{Name: "a"}}})
	require.NoError(t, err)
	defer noEvents.Close()
	for name, tc := range map[string]struct {
		pool *kvcache.Pool
		cfg  kvevents.Config
		want error
	}{
		"nil pool":        {nil, kvevents.Config{Endpoint: "tcp://127.0.0.1:0"}, kvevents.ErrInvalidConfig},
		"pool w/o events": {noEvents, kvevents.Config{Endpoint: "tcp://127.0.0.1:0"}, kvevents.ErrInvalidConfig},
		"no endpoint":     {p, kvevents.Config{}, kvevents.ErrInvalidConfig},
		"udp":             {p, kvevents.Config{Endpoint: "udp://127.0.0.1:0"}, kvevents.ErrInvalidConfig},
		"negative":        {p, kvevents.Config{Endpoint: "tcp://127.0.0.1:0", SubscriberQueue: -1}, kvevents.ErrInvalidConfig},
		"encoding":        {p, kvevents.Config{Endpoint: "tcp://127.0.0.1:0", Encoding: 7}, kvevents.ErrInvalidConfig},
		"bad address":     {p, kvevents.Config{Endpoint: "tcp://127.0.0.1:99999"}, kvevents.ErrListen},
		"bad replay":      {p, kvevents.Config{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://256.0.0.1:1"}, kvevents.ErrListen},
	} {
		pub, err := kvevents.New(tc.pool, tc.cfg)
		assert.ErrorIs(t, err, tc.want, name)
		assert.Nil(t, pub, name)
	}
}
