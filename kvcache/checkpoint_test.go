package kvcache

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/internal/testlog"
	"github.com/kvfence/kvfence/isolation"
)

// checkpointConfig is hybridConfig (pages of 4 tokens, a window of 8, a
// state slot) with room for slots checkpoints beside maxLeases leases.
func checkpointConfig(pages, maxLeases, slots int, tenants ...TenantConfig) Config {
	cfg := hybridConfig(pages, maxLeases, tenants...)
	cfg.Prefix.CheckpointSlots = slots
	return cfg
}

// promptTokens is a prompt of n tokens whose first shared tokens are
// common to every prompt of the same base, and the rest seeded by seed.
func promptTokens(base, shared, seed, n int) []int32 {
	t := make([]int32, n)
	for i := range t {
		if i < shared {
			t[i] = int32(base*100_000 + i)
		} else {
			t[i] = int32(seed*100_000 + 50_000 + i)
		}
	}
	return t
}

// stateBytes is what the test engine writes into region r of logical
// page lp of group g (its state slot, a window page) when its state
// reflects tag.
func stateBytes(tag, g string, lp, r int, n int64) []byte {
	return bytes.Repeat([]byte(fmt.Sprintf("%s|%s|%d|%d;", tag, g, lp, r)), int(n))[:n]
}

// writeState writes, into l's units of a handoff of n tokens in every
// group but the per-token one, the bytes of tag: its state at n tokens.
func writeState(t testing.TB, p *Pool, l *Lease, tag string, n int) {
	t.Helper()
	spec := p.Spec()
	for gi, e := range spec.HandoffExtents(n) {
		if gi == 0 {
			continue
		}
		first, _, err := l.GroupTable(e.Group, nil)
		require.NoError(t, err)
		for j := range e.Units {
			for r, reg := range spec.Groups[gi].Regions {
				require.NoError(t, l.WritePage(e.Group, e.First+j-first, r, stateBytes(tag, e.Group, e.First+j, r, reg.PageBytes)))
			}
		}
	}
}

// stateErr returns an error unless l holds tag's state at n tokens in
// its units of every group but the per-token one, starting its windows
// where a handoff of n tokens does, and every other page of those groups
// it holds is scrubbed.
func stateErr(p *Pool, l *Lease, tag string, n int) error {
	spec := p.Spec()
	fill := p.FillSpec()
	for gi, e := range spec.HandoffExtents(max(n, 1)) {
		if gi == 0 {
			continue
		}
		first, table, err := l.GroupTable(e.Group, nil)
		if err != nil {
			return err
		}
		if n > 0 && first != e.First {
			return fmt.Errorf("group %q starts at logical page %d, the checkpoint's at %d", e.Group, first, e.First)
		}
		for i, page := range table {
			lp := first + i
			restored := n > 0 && lp >= e.First && lp < e.First+e.Units
			var word [4]byte
			binary.LittleEndian.PutUint32(word[:], fill.WordFor(page))
			for r, reg := range spec.Groups[gi].Regions {
				got := make([]byte, reg.PageBytes)
				if err := l.ReadPage(e.Group, i, r, got); err != nil {
					return err
				}
				want := bytes.Repeat(word[:], len(got)/4)
				if restored {
					want = stateBytes(tag, e.Group, lp, r, reg.PageBytes)
				}
				if !bytes.Equal(got, want) {
					return fmt.Errorf("lease %q, group %q logical page %d region %d holds %q, want %q",
						l.ID(), e.Group, lp, r, got[:min(24, len(got))], want[:min(24, len(want))])
				}
			}
		}
	}
	return nil
}

// prefillTo runs l's prefill to n tokens as an engine with state does:
// commit, slide the windows, and write the state at n.
func prefillTo(t testing.TB, p *Pool, l *Lease, tag string, n int) {
	t.Helper()
	require.NoError(t, l.Commit(n))
	_, err := l.SlideWindows(cudaops.Ordering{})
	require.NoError(t, err)
	writeState(t, p, l, fmt.Sprintf("%s@%d", tag, n), n)
}

// A checkpoint taken at the last page boundary of a prefill is restored
// into the next request of the domain with the same prompt: it shares
// the pages below, starts with its written watermark there, and holds
// exactly the checkpoint's state and window pages, every other unit
// scrubbed. Another domain, and a prompt too short to reach the
// checkpoint, hit nothing and are counted as a miss where pages matched.
func TestCheckpointHitRestoresState(t *testing.T) {
	p := newPool(t, checkpointConfig(64, 4, 4))
	tokens := promptTokens(1, 30, 1, 30)
	a, err := p.TryAdmit(Request{ID: "a", Tenant: "a", PromptTokens: 30, MaxNewTokens: 8, TokenIDs: tokens})
	require.NoError(t, err)
	require.Equal(t, 28, a.PrefillCheckpoint())
	require.NoError(t, a.BeginPrefill())
	prefillTo(t, p, a, "a", 28)
	require.NoError(t, a.CheckpointState(28, cudaops.Ordering{}))
	require.NoError(t, a.CheckpointState(28, cudaops.Ordering{}), "one at n already: kept")
	prefillTo(t, p, a, "a", 30) // the state moves on; the checkpoint does not
	s := p.Stats().Checkpoints
	require.Equal(t, 1, s.Live)
	require.EqualValues(t, 1, s.Taken)
	require.EqualValues(t, 1, s.Existing)
	require.Positive(t, s.StateBytes)
	require.NoError(t, p.Check())
	require.NoError(t, a.Release())

	b, err := p.TryAdmit(Request{ID: "b", Tenant: "a", PromptTokens: 30, MaxNewTokens: 8, TokenIDs: tokens})
	require.NoError(t, err)
	require.Equal(t, 28, b.HitTokens())
	require.Equal(t, 28, b.Written(), "the restored state reflects 28 tokens")
	require.NoError(t, stateErr(p, b, "a@28", 28))
	require.NoError(t, p.Check())
	s = p.Stats().Checkpoints
	require.EqualValues(t, 1, s.Hits)
	require.EqualValues(t, 28, s.HitTokens)
	// The engine goes on from there.
	require.NoError(t, b.BeginPrefill())
	prefillTo(t, p, b, "b", 30)
	require.NoError(t, b.Release())

	other, err := p.TryAdmit(Request{ID: "other", Tenant: "b", PromptTokens: 30, TokenIDs: tokens})
	require.NoError(t, err)
	require.Zero(t, other.HitTokens(), "another domain's checkpoint")
	require.NoError(t, stateErr(p, other, "", 0))
	require.NoError(t, other.Release())

	short, err := p.TryAdmit(Request{ID: "short", Tenant: "a", PromptTokens: 20, TokenIDs: tokens[:20]})
	require.NoError(t, err)
	require.Zero(t, short.HitTokens(), "its 4 matched pages end before the checkpoint")
	require.NoError(t, stateErr(p, short, "", 0))
	s = p.Stats().Checkpoints
	require.EqualValues(t, 1, s.Misses)
	require.EqualValues(t, 16, s.MissTokens)
	require.NoError(t, short.Release())
	require.NoError(t, p.Check())
	_, err = p.AuditFreePages()
	require.NoError(t, err)
}

// A checkpoint at the end of a shared system prompt serves every prompt
// that starts with it, each restoring the same state; the deepest
// checkpoint a prompt reaches wins.
func TestCheckpointAtASharedSystemPrompt(t *testing.T) {
	p := newPool(t, checkpointConfig(128, 4, 4))
	first := promptTokens(7, 12, 1, 30)
	l, err := p.TryAdmit(Request{ID: "first", Tenant: "a", PromptTokens: 30, TokenIDs: first})
	require.NoError(t, err)
	require.NoError(t, l.BeginPrefill())
	prefillTo(t, p, l, "sys", 12) // the system prompt's end
	require.NoError(t, l.CheckpointState(12, cudaops.Ordering{}))
	prefillTo(t, p, l, "first", 28)
	require.NoError(t, l.CheckpointState(28, cudaops.Ordering{}))
	require.NoError(t, l.Release())
	for i := 2; i < 5; i++ {
		id := fmt.Sprint("user", i)
		u, err := p.TryAdmit(Request{ID: id, Tenant: "a", PromptTokens: 25, TokenIDs: promptTokens(7, 12, i, 25)})
		require.NoError(t, err)
		require.Equal(t, 12, u.HitTokens())
		require.NoError(t, stateErr(p, u, "sys@12", 12))
		require.NoError(t, u.Release())
	}
	again, err := p.TryAdmit(Request{ID: "again", Tenant: "a", PromptTokens: 30, TokenIDs: first})
	require.NoError(t, err)
	require.Equal(t, 28, again.HitTokens())
	require.NoError(t, stateErr(p, again, "first@28", 28))
	require.NoError(t, again.Release())
	require.NoError(t, p.Check())
}

// Bad checkpoints each get their own error and change nothing.
func TestCheckpointBadInput(t *testing.T) {
	p := newPool(t, checkpointConfig(64, 4, 2, TenantConfig{Name: "a", MaxCheckpoints: 1}, TenantConfig{Name: "b"}))
	tokens := promptTokens(1, 30, 1, 30)
	l, err := p.TryAdmit(Request{ID: "l", Tenant: "a", PromptTokens: 30, MaxNewTokens: 8, TokenIDs: tokens})
	require.NoError(t, err)
	require.NoError(t, l.BeginPrefill())
	prefillTo(t, p, l, "l", 12)
	before := p.Stats()
	for _, tc := range []struct {
		name string
		n    int
		err  error
	}{
		{"not at a page boundary", 6, ErrInvalidArgument},
		{"zero", 0, ErrInvalidArgument},
		{"negative", -4, ErrInvalidArgument},
		{"beyond the written tokens", 16, ErrInvalidArgument},
		{"beyond the prompt", 32, ErrInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.ErrorIs(t, l.CheckpointState(tc.n, cudaops.Ordering{}), tc.err)
			require.Equal(t, before, p.Stats())
			require.NoError(t, p.Check())
		})
	}
	t.Run("over the tenant's bound", func(t *testing.T) {
		require.NoError(t, l.CheckpointState(12, cudaops.Ordering{}))
		prefillTo(t, p, l, "l", 16)
		held := p.Stats()
		err := l.CheckpointState(16, cudaops.Ordering{})
		require.ErrorIs(t, err, ErrCheckpointCapacity)
		require.ErrorContains(t, err, "MaxCheckpoints is 1")
		after := p.Stats()
		require.Equal(t, held.Checkpoints.CapacitySkips+1, after.Checkpoints.CapacitySkips, "counted")
		after.Checkpoints.CapacitySkips = held.Checkpoints.CapacitySkips
		require.Equal(t, held, after)
		require.NoError(t, p.Check())
	})
	t.Run("the window slid past it", func(t *testing.T) {
		m, err := p.TryAdmit(Request{ID: "m", Tenant: "b", PromptTokens: 30, TokenIDs: tokens})
		require.NoError(t, err)
		require.NoError(t, m.BeginPrefill())
		prefillTo(t, p, m, "m", 24)
		held := p.Stats()
		require.ErrorIs(t, m.CheckpointState(8, cudaops.Ordering{}), ErrInvalidArgument)
		require.Equal(t, held, p.Stats())
		require.NoError(t, m.Release())
	})
	t.Run("no tokens or keys", func(t *testing.T) {
		m, err := p.TryAdmit(Request{ID: "m", Tenant: "b", PromptTokens: 30})
		require.NoError(t, err)
		require.NoError(t, m.Commit(8))
		held := p.Stats()
		require.ErrorIs(t, m.CheckpointState(8, cudaops.Ordering{}), ErrInvalidArgument)
		require.Equal(t, held, p.Stats())
		require.NoError(t, m.Release())
	})
	t.Run("a released lease", func(t *testing.T) {
		m, err := p.TryAdmit(Request{ID: "m", Tenant: "b", PromptTokens: 30, TokenIDs: tokens})
		require.NoError(t, err)
		require.NoError(t, m.Commit(8))
		require.NoError(t, m.Release())
		held := p.Stats()
		require.ErrorIs(t, m.CheckpointState(8, cudaops.Ordering{}), ErrLeaseReleased)
		require.Equal(t, held, p.Stats())
	})
	t.Run("a pool without a state group", func(t *testing.T) {
		q := newPool(t, Config{Geometry: Geometry{TokensPerPage: 4, Layers: 1, KVHeads: 1, HeadDim: 8, DType: BF16}, Pages: 16, MaxContextTokens: 64, Tenants: []TenantConfig{{Name: "a"}}})
		m, err := q.TryAdmit(Request{ID: "m", Tenant: "a", PromptTokens: 30, TokenIDs: tokens})
		require.NoError(t, err)
		require.NoError(t, m.Commit(8))
		held := q.Stats()
		require.ErrorIs(t, m.CheckpointState(8, cudaops.Ordering{}), ErrNoStateGroup)
		require.Equal(t, held, q.Stats())
		require.NoError(t, q.Check())
	})
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())
}

// The pool's bound on checkpoints refuses beyond it, counted, logged
// once per tenant.
func TestCheckpointPoolBound(t *testing.T) {
	cfg := checkpointConfig(128, 4, 4)
	cfg.Prefix.MaxCheckpoints = 2
	var log testlog.Buffer
	cfg.Logger = log.Logger()
	p := newPool(t, cfg)
	for i := range 4 {
		l, err := p.TryAdmit(Request{ID: fmt.Sprint(i), Tenant: "a", PromptTokens: 20, TokenIDs: promptTokens(i, 20, i, 20)})
		require.NoError(t, err)
		prefillTo(t, p, l, fmt.Sprint(i), 16)
		err = l.CheckpointState(16, cudaops.Ordering{})
		if i < 2 {
			require.NoError(t, err)
		} else {
			require.ErrorIs(t, err, ErrCheckpointCapacity)
			require.ErrorContains(t, err, "Prefix.MaxCheckpoints is 2")
		}
		require.NoError(t, l.Release())
	}
	s := p.Stats().Checkpoints
	require.Equal(t, 2, s.Live)
	require.EqualValues(t, 2, s.CapacitySkips)
	require.NoError(t, p.Check())
	var warned []map[string]any
	for _, r := range log.Records(t) {
		if r["msg"] == "kvcache: state checkpoint not taken for lack of room; later ones of the tenant are counted, not logged" {
			warned = append(warned, r)
		}
	}
	require.Len(t, warned, 1, "logged once for the tenant")
	require.Equal(t, "a", warned[0]["tenant"])
}

// A prompt of one page and a token hits its page; identical prompts of
// any length reuse; keys crafted after another domain's, and a request
// of another domain whose keys collide with them, hit nothing of it.
func TestCheckpointHitsEveryPromptPastAPage(t *testing.T) {
	p := newPool(t, checkpointConfig(256, 4, 8))
	for _, n := range []int{5, 8, 9, 17, 64} {
		tokens := promptTokens(n, n, n, n)
		for i := range 2 {
			l, err := p.TryAdmit(Request{ID: fmt.Sprint(n, "-", i), Tenant: "a", PromptTokens: n, TokenIDs: tokens})
			require.NoError(t, err)
			want := (n - 1) / 4 * 4
			if i == 0 {
				want = 0
			}
			require.Equal(t, want, l.HitTokens(), "prompt of %d, admission %d", n, i)
			if i == 0 {
				prefillTo(t, p, l, "x", l.PrefillCheckpoint())
				require.NoError(t, l.CheckpointState(l.PrefillCheckpoint(), cudaops.Ordering{}))
			}
			require.NoError(t, l.Release())
		}
	}
	// Tenant b forges tenant a's keys for a prompt a checkpointed.
	tokens := promptTokens(64, 64, 64, 64)
	keys, err := p.PageKeys("a", "", tokens, nil)
	require.NoError(t, err)
	forged, err := p.TryAdmit(Request{ID: "forged", Tenant: "b", PromptTokens: 64, PageKeys: keys})
	require.NoError(t, err)
	require.Zero(t, forged.HitTokens(), "another domain's keys")
	require.NoError(t, stateErr(p, forged, "", 0))
	require.NoError(t, forged.Release())
	require.NoError(t, p.Check())
}

// checkpointBehindScrubs sets up a checkpoint whose only room is units
// still being scrubbed (a lease released just before, its fence pending
// as on a GPU): lease a, prefilled to 28 of its tokens, calls
// CheckpointState(28) while the pool's other window ring and state slot
// are in quarantine; it returns once the call waits in the queue, with
// the call's result to come on done. dev.complete ends the scrubs.
func checkpointBehindScrubs(t *testing.T) (p *Pool, dev *scriptedDevice, a *Lease, done <-chan error) {
	t.Helper()
	dev = newScripted()
	t.Cleanup(func() { dev.Close() }) // after the pool's Close
	cfg := checkpointConfig(64, 2, 0)
	cfg.Device = dev
	p = newPool(t, cfg)
	x, err := p.TryAdmit(Request{ID: "x", Tenant: "a", PromptTokens: 30, TokenIDs: promptTokens(2, 30, 2, 30)})
	require.NoError(t, err)
	a, err = p.TryAdmit(Request{ID: "a", Tenant: "a", PromptTokens: 30, TokenIDs: promptTokens(1, 30, 1, 30)})
	require.NoError(t, err)
	require.NoError(t, a.BeginPrefill())
	prefillTo(t, p, a, "a", 28)

	dev.mu.Lock()
	dev.mu.hold = true
	dev.mu.Unlock()
	t.Cleanup(dev.complete) // before the pool's Close, which waits for fills
	require.NoError(t, x.Release())
	for _, g := range p.Stats().Groups[1:] {
		require.Zero(t, g.Free, "group %q: x's units must be the only room, in quarantine", g.Name)
		require.Positive(t, g.Quarantined, "group %q", g.Name)
	}
	result := make(chan error, 1)
	go func() { result <- a.CheckpointState(28, cudaops.Ordering{}) }()
	returned, early := false, error(nil)
	require.Eventually(t, func() bool {
		select {
		case early = <-result:
			returned = true
			return true
		default:
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.mu.waiters.len == 1
	}, 10*time.Second, time.Millisecond, "the checkpoint never waited")
	require.False(t, returned, "the checkpoint returned (%v) while the units it needs were still being scrubbed", early)
	return p, dev, a, result
}

// A checkpoint whose only room is units still being scrubbed waits for
// those scrubs and is taken, instead of being refused for capacity.
func TestCheckpointWaitsForUnitsBeingScrubbed(t *testing.T) {
	p, dev, a, done := checkpointBehindScrubs(t)
	require.NoError(t, p.Check())
	dev.complete()
	require.NoError(t, <-done)
	s := p.Stats().Checkpoints
	require.Equal(t, 1, s.Live)
	require.Zero(t, s.CapacitySkips)
	require.NoError(t, p.Check())
	require.NoError(t, a.Release())

	b, err := p.TryAdmit(Request{ID: "b", Tenant: "a", PromptTokens: 30, TokenIDs: promptTokens(1, 30, 1, 30)})
	require.NoError(t, err)
	require.Equal(t, 28, b.HitTokens())
	require.NoError(t, stateErr(p, b, "a@28", 28))
	require.NoError(t, b.Release())
	require.NoError(t, p.Check())
}

// A lease released while its checkpoint waits for scrubs: the pool stays
// consistent meanwhile, and the checkpoint ends with ErrLeaseReleased
// when they do, taking nothing.
func TestCheckpointWaitingForScrubsOfAReleasedLease(t *testing.T) {
	p, dev, a, done := checkpointBehindScrubs(t)
	require.NoError(t, a.Release())
	require.NoError(t, p.Check())
	dev.complete()
	require.ErrorIs(t, <-done, ErrLeaseReleased)
	require.Zero(t, p.Stats().Checkpoints.Live)
	require.Eventually(t, func() bool { return p.Stats().QuarantinedPages == 0 }, 10*time.Second, time.Millisecond)
	require.NoError(t, p.Check())
	_, err := p.AuditFreePages()
	require.NoError(t, err)
}

// Checkpoints take the slots leases leave; an admission that needs a
// checkpoint's slot evicts it (least recently used first), and the slot
// it gets is scrubbed; the pages the checkpoint pinned join the LRU list.
func TestCheckpointEvictedForASlotIsScrubbed(t *testing.T) {
	cfg := checkpointConfig(64, 2, 0)
	cfg.Scrub = ScrubPolicy{Kind: isolation.ScrubPoison}
	p := newPool(t, cfg)
	for i := range 2 {
		l, err := p.TryAdmit(Request{ID: fmt.Sprint("ck", i), Tenant: "a", PromptTokens: 20, TokenIDs: promptTokens(i, 20, i, 20)})
		require.NoError(t, err)
		prefillTo(t, p, l, fmt.Sprint("ck", i), 16)
		// The second lease's checkpoint takes the first one's slot: its
		// own and that one are all there are.
		require.NoError(t, l.CheckpointState(16, cudaops.Ordering{}))
		require.NoError(t, l.Release())
	}
	s := p.Stats().Checkpoints
	require.Equal(t, 1, s.Live)
	require.EqualValues(t, 1, s.Evicted)
	x, err := p.TryAdmit(Request{ID: "x", Tenant: "b", PromptTokens: 20})
	require.NoError(t, err)
	y, err := p.TryAdmit(Request{ID: "y", Tenant: "b", PromptTokens: 20})
	require.NoError(t, err, "the checkpoint's slot is evicted for it")
	s = p.Stats().Checkpoints
	require.Zero(t, s.Live)
	require.EqualValues(t, 2, s.Evicted)
	require.NoError(t, stateErr(p, x, "", 0))
	require.NoError(t, stateErr(p, y, "", 0))
	require.NoError(t, p.Check())
	require.NoError(t, x.Release())
	require.NoError(t, y.Release())
	_, err = p.AuditFreePages()
	require.NoError(t, err)
}

// A page below a live checkpoint stays: pages no checkpoint needs are
// evicted first, and only then a checkpoint with the pages it pinned.
func TestCheckpointPinsItsPrefix(t *testing.T) {
	p := newPool(t, checkpointConfig(16, 4, 4))
	ck, err := p.TryAdmit(Request{ID: "ck", Tenant: "a", PromptTokens: 20, TokenIDs: promptTokens(1, 20, 1, 20)})
	require.NoError(t, err)
	prefillTo(t, p, ck, "ck", 8)
	require.NoError(t, ck.CheckpointState(8, cudaops.Ordering{})) // pins pages 0-1
	prefillTo(t, p, ck, "ck", 16)
	require.NoError(t, ck.Release()) // pages 2-3 were never published
	loose, err := p.TryAdmit(Request{ID: "loose", Tenant: "a", PromptTokens: 20, TokenIDs: promptTokens(2, 20, 2, 20)})
	require.NoError(t, err)
	require.NoError(t, loose.Commit(14))
	n, err := loose.CachePrefix(14)
	require.NoError(t, err)
	require.Zero(t, n, "a hybrid pool caches pages with their state: no checkpoint within a page")
	require.NoError(t, loose.Release())
	st := p.Stats()
	require.Equal(t, 1, st.Checkpoints.Live)
	// 16 pages: 2 pinned by the checkpoint; the others free or cached.
	big, err := p.TryAdmit(Request{ID: "big", Tenant: "b", PromptTokens: 14 * 4})
	require.NoError(t, err, "takes every page but the pinned two")
	require.Equal(t, 1, p.Stats().Checkpoints.Live, "its pages stayed")
	require.NoError(t, p.Check())
	require.NoError(t, big.Release())
	bigger, err := p.TryAdmit(Request{ID: "bigger", Tenant: "b", PromptTokens: 16 * 4})
	require.NoError(t, err, "evicts the checkpoint for its pages")
	require.Zero(t, p.Stats().Checkpoints.Live)
	require.NoError(t, p.Check())
	require.NoError(t, bigger.Release())
	_, err = p.AuditFreePages()
	require.NoError(t, err)
}

// Preemption on a hybrid pool checkpoints the state at the written
// tokens when they end a page: the request resumed with them and its
// next token restores it.
func TestPreemptCheckpointsTheState(t *testing.T) {
	p := newPool(t, checkpointConfig(64, 4, 4))
	tokens := promptTokens(3, 20, 3, 29)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 20, MaxNewTokens: 12, TokenIDs: tokens[:20]})
	require.NoError(t, err)
	require.NoError(t, l.BeginPrefill())
	prefillTo(t, p, l, "r", 20)
	require.NoError(t, l.FinishPrefill())
	prefillTo(t, p, l, "r", 28) // decoding
	kept, err := l.Preempt(tokens[:28])
	require.NoError(t, err)
	require.Equal(t, 28, kept)
	resumed, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 29, MaxNewTokens: 4, TokenIDs: tokens})
	require.NoError(t, err)
	require.Equal(t, 28, resumed.HitTokens())
	require.NoError(t, stateErr(p, resumed, "r@28", 28))
	require.NoError(t, resumed.Release())
	require.NoError(t, p.Check())
}

// ClearPrefixCache and Close drop the checkpoints, their slots scrubbed.
func TestClearDropsCheckpoints(t *testing.T) {
	p := newPool(t, checkpointConfig(64, 4, 4))
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 20, TokenIDs: promptTokens(1, 20, 1, 20)})
	require.NoError(t, err)
	prefillTo(t, p, l, "r", 16)
	require.NoError(t, l.CheckpointState(16, cudaops.Ordering{}))
	require.NoError(t, p.ClearPrefixCache())
	require.Zero(t, p.Stats().Checkpoints.Live)
	require.NoError(t, p.Check())
	require.ErrorIs(t, l.CheckpointState(16, cudaops.Ordering{}), ErrInvalidArgument, "its pages left the cache")
	require.NoError(t, l.Release())
	_, err = p.AuditFreePages()
	require.NoError(t, err)
}

// Checkpoints taken, restored, evicted and cleared from many goroutines
// at once: every restored unit holds its checkpoint's bytes or the scrub
// pattern, never another prompt's, and the books balance at the end.
func TestCheckpointsConcurrently(t *testing.T) {
	cfg := checkpointConfig(256, 6, 3)
	p := newPool(t, cfg)
	prompts := make([][]int32, 4)
	for i := range prompts {
		prompts[i] = promptTokens(i+1, 24, 0, 24)
	}
	const workers = 6
	errs := make(chan error, workers+1)
	done := make(chan struct{})
	for w := range workers {
		go func() {
			for i := range 150 {
				k := (w + i) % len(prompts)
				id := fmt.Sprintf("w%d-%d", w, i)
				l, err := p.Admit(t.Context(), Request{ID: id, Tenant: []string{"a", "b"}[w%2], PromptTokens: 24, TokenIDs: prompts[k]})
				if err != nil {
					errs <- err
					return
				}
				// Whatever it restored, it is the prompt's own state at the
				// hit (every checkpoint of prompt k at n holds "pk@n").
				if err := stateErr(p, l, fmt.Sprintf("p%d@%d", k, l.HitTokens()), l.HitTokens()); err != nil {
					errs <- err
					return
				}
				if l.HitTokens() < 20 {
					if err := l.Commit(20); err == nil {
						if _, err := l.SlideWindows(cudaops.Ordering{}); err != nil {
							errs <- err
							return
						}
						writeStateNoT(p, l, fmt.Sprintf("p%d@20", k), 20)
						if err := l.CheckpointState(20, cudaops.Ordering{}); err != nil && !errors.Is(err, ErrCheckpointCapacity) && !errors.Is(err, ErrInvalidArgument) {
							errs <- err
							return
						}
					}
				}
				if err := l.Release(); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	go func() {
		for {
			select {
			case <-done:
				errs <- nil
				return
			default:
			}
			if err := p.ClearPrefixCache(); err != nil {
				errs <- err
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	for range workers {
		require.NoError(t, <-errs)
	}
	close(done)
	require.NoError(t, <-errs)
	require.NoError(t, p.Check())
	_, err := p.AuditFreePages()
	require.NoError(t, err)
	t.Logf("%+v", p.Stats().Checkpoints)
}

// writeStateNoT is writeState for goroutines that must not fail t.
func writeStateNoT(p *Pool, l *Lease, tag string, n int) {
	spec := p.Spec()
	for gi, e := range spec.HandoffExtents(n) {
		if gi == 0 {
			continue
		}
		first, _, err := l.GroupTable(e.Group, nil)
		if err != nil {
			return
		}
		for j := range e.Units {
			for r, reg := range spec.Groups[gi].Regions {
				_ = l.WritePage(e.Group, e.First+j-first, r, stateBytes(tag, e.Group, e.First+j, r, reg.PageBytes))
			}
		}
	}
}

// A checkpoint publishes the pages below it as CachePrefix does (one
// KVStored event of their keys), and its eviction removes them (KVRemoved)
// once the pages it pinned are evicted.
func TestCheckpointPagesAreEvents(t *testing.T) {
	cfg := checkpointConfig(16, 4, 2)
	cfg.Prefix.EventBuffer = 64
	p := newPool(t, cfg)
	tokens := promptTokens(1, 20, 1, 20)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 20, TokenIDs: tokens})
	require.NoError(t, err)
	prefillTo(t, p, l, "r", 16)
	require.NoError(t, l.CheckpointState(16, cudaops.Ordering{}))
	keys, err := p.PageKeys("a", "", tokens[:16], nil)
	require.NoError(t, err)
	stored := <-p.Events()
	require.Equal(t, KVStored, stored.Kind)
	require.Equal(t, keys, stored.Keys)
	require.NoError(t, l.Release())
	big, err := p.TryAdmit(Request{ID: "big", Tenant: "b", PromptTokens: 16 * 4})
	require.NoError(t, err, "evicts the checkpoint and its pages")
	removed := <-p.Events()
	require.Equal(t, KVRemoved, removed.Kind)
	require.ElementsMatch(t, keys, removed.Keys)
	require.NoError(t, big.Release())
	require.NoError(t, p.Check())
}

// A lease whose checkpoint chained onto another lease's copy of its
// pages checkpoints again after that copy was evicted: its own pages are
// published in their place (they hold the same KV), and CachePrefix
// reports the checkpointed prefix through either copy.
func TestCheckpointAfterTheChainsOtherCopyWasEvicted(t *testing.T) {
	p := newPool(t, checkpointConfig(8, 4, 1))
	tokens := promptTokens(1, 16, 1, 16)
	a, err := p.TryAdmit(Request{ID: "a", Tenant: "a", PromptTokens: 16, TokenIDs: tokens})
	require.NoError(t, err)
	require.NoError(t, a.Commit(10))
	_, err = a.Preempt(tokens[:10]) // pages 0-1 published, no checkpoint (10 tokens end no page)
	require.NoError(t, err)
	b, err := p.TryAdmit(Request{ID: "b", Tenant: "a", PromptTokens: 16, TokenIDs: tokens})
	require.NoError(t, err)
	require.Zero(t, b.HitTokens(), "no checkpoint to hit")
	prefillTo(t, p, b, "b", 8)
	n, err := b.CachePrefix(8) // chains onto a's pages 0-1
	require.NoError(t, err)
	require.Equal(t, 8, n)
	c, err := p.TryAdmit(Request{ID: "c", Tenant: "b", PromptTokens: 16})
	require.NoError(t, err, "evicts b's checkpoint and a's pages")
	require.Zero(t, p.Stats().Checkpoints.Live)
	prefillTo(t, p, b, "b", 12)
	n, err = b.CachePrefix(12)
	require.NoError(t, err)
	require.Equal(t, 12, n)
	require.NoError(t, p.Check())
	require.NoError(t, c.Release())
	require.NoError(t, b.Release())
	again, err := p.TryAdmit(Request{ID: "again", Tenant: "a", PromptTokens: 16, TokenIDs: tokens})
	require.NoError(t, err)
	require.Equal(t, 12, again.HitTokens())
	require.NoError(t, stateErr(p, again, "b@12", 12))
	require.NoError(t, again.Release())
	require.NoError(t, p.Check())
}
