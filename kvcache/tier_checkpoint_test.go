package kvcache

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

// hybridConfigLayout is the layout of hybridConfig's cache.
func hybridConfigLayout(t testing.TB) *layout {
	t.Helper()
	lay, err := hybridSpec().layout()
	require.NoError(t, err)
	return lay
}

// h0PageBytes is a per-token page of hybridConfig's cache, every region.
func h0PageBytes(t testing.TB) int64 { return hybridConfigLayout(t).groups[0].pageBytes }

// tierCheckpointConfig is checkpointConfig (no room beside maxLeases for
// checkpoints) with a host tier of pages pages and ckpts checkpoints.
func tierCheckpointConfig(pages, maxLeases, tierPages, ckpts int, tenants ...TenantConfig) Config {
	cfg := checkpointConfig(pages, maxLeases, 0, tenants...)
	cfg.HostTier = HostTierConfig{Pages: tierPages, Checkpoints: ckpts}
	cfg.Scrub = ScrubPolicy{Kind: isolation.ScrubPoison}
	return cfg
}

// checkpointed admits a request of prompt tokens for tenant, prefills it
// to n (its state tagged id@n), checkpoints it there and releases it.
func checkpointed(t testing.TB, p *Pool, id, tenant string, tokens []int32, n int) {
	t.Helper()
	l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: len(tokens), TokenIDs: tokens})
	require.NoError(t, err)
	prefillTo(t, p, l, id, n)
	require.NoError(t, l.CheckpointState(n, cudaops.Ordering{}))
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())
}

// A checkpoint the device evicts for its slot goes to the host tier, and
// an admission of the same prompt in the same domain restores it from
// there byte for byte (its state slot and window pages), the pages below
// it shared from the device, or onloaded from the tier when the device
// evicted them too; another domain finds nothing. Every slot and page
// the tier and the device let go is scrubbed.
func TestTierKeepsEvictedCheckpoints(t *testing.T) {
	p := newPool(t, tierCheckpointConfig(24, 2, 32, 2))
	ck0, ck1 := promptTokens(0, 20, 0, 20), promptTokens(1, 20, 1, 20)
	checkpointed(t, p, "ck0", "a", ck0, 16)
	checkpointed(t, p, "ck1", "a", ck1, 16) // takes ck0's slot: ck0 goes to the tier
	c, ts := p.Stats().Checkpoints, tierSlotsSum(t, p)
	require.Equal(t, 1, c.Live)
	require.EqualValues(t, 1, c.Evicted)
	require.EqualValues(t, 1, ts.CheckpointsStored)
	require.Equal(t, 1, ts.Checkpoints)

	// The device holds ck0's pages still, the tier its state.
	l, err := p.TryAdmit(Request{ID: "again0", Tenant: "a", PromptTokens: 20, TokenIDs: ck0})
	require.NoError(t, err)
	require.Equal(t, 16, l.HitTokens())
	require.Equal(t, 16, l.Written())
	require.NoError(t, stateErr(p, l, "ck0@16", 16))
	ts = tierSlotsSum(t, p)
	require.EqualValues(t, 1, ts.CheckpointsRestored)
	require.Positive(t, ts.CheckpointRestoreBytes)
	require.NoError(t, l.Release())

	// Another domain: nothing, from either.
	o, err := p.TryAdmit(Request{ID: "other", Tenant: "b", PromptTokens: 20, TokenIDs: ck0})
	require.NoError(t, err)
	require.Zero(t, o.HitTokens())
	require.NoError(t, stateErr(p, o, "", 0))
	require.NoError(t, o.Release())

	// The device evicts every page and checkpoint: both prompts live on
	// in the tier, pages and state, and come back whole.
	flushDevice(t, p, "b")
	require.Zero(t, p.Stats().Checkpoints.Live)
	ts = tierSlotsSum(t, p)
	require.Equal(t, 2, ts.Checkpoints)
	for i, tokens := range [][]int32{ck0, ck1} {
		l, err := p.TryAdmit(Request{ID: fmt.Sprint("back", i), Tenant: "a", PromptTokens: 20, TokenIDs: tokens})
		require.NoError(t, err)
		require.Equal(t, 16, l.HitTokens(), "prompt %d", i)
		require.NoError(t, stateErr(p, l, fmt.Sprintf("ck%d@16", i), 16))
		require.NoError(t, l.Release())
		require.NoError(t, p.Check())
	}
	ts = tierSlotsSum(t, p)
	require.EqualValues(t, 3, ts.CheckpointsRestored)
	require.Positive(t, ts.Onloads)
	for _, d := range p.Stats().Prefix.Domains {
		if d.Name == "tenant:a" {
			require.EqualValues(t, 3, d.TierCheckpointHits)
			require.EqualValues(t, 2, d.TierCheckpointsStored)
		}
	}

	// Cleared: every slot back, filled.
	require.NoError(t, p.ClearPrefixCache())
	ts = tierSlotsSum(t, p)
	require.Equal(t, ts.Slots, ts.Free)
	_, err = p.AuditFreePages()
	require.NoError(t, err)
}

// The tier keeps at most its checkpoint slots, least recently used
// evicted first, scrubbed; a checkpoint whose page leaves the cache (the
// tier had no room for the page) goes with it.
func TestTierCheckpointEviction(t *testing.T) {
	p := newPool(t, tierCheckpointConfig(24, 2, 32, 2))
	var prompts [][]int32
	for i := range 4 {
		prompts = append(prompts, promptTokens(i, 20, i, 20))
		checkpointed(t, p, fmt.Sprint("ck", i), "a", prompts[i], 16)
	}
	// Device: ck3 (one slot beside a lease's); tier: ck1, ck2 (ck0 the
	// least recently used, evicted for ck2).
	ts := tierSlotsSum(t, p)
	require.Equal(t, 2, ts.Checkpoints)
	require.EqualValues(t, 3, ts.CheckpointsStored)
	require.EqualValues(t, 1, ts.CheckpointsEvicted)
	hits := map[int]int{0: 0, 1: 16, 2: 16, 3: 16}
	for i, want := range hits {
		l, err := p.TryAdmit(Request{ID: fmt.Sprint("q", i), Tenant: "a", PromptTokens: 20, TokenIDs: prompts[i]})
		require.NoError(t, err)
		require.Equal(t, want, l.HitTokens(), "prompt %d", i)
		if want > 0 {
			require.NoError(t, stateErr(p, l, fmt.Sprintf("ck%d@16", i), 16))
		} else {
			require.NoError(t, stateErr(p, l, "", 0))
		}
		require.NoError(t, l.Release())
		require.NoError(t, p.Check())
	}
	_, err := p.AuditFreePages()
	require.NoError(t, err)

	// A tier of one page: ck's pages cannot all stay, so neither can its
	// checkpoint.
	q := newPool(t, tierCheckpointConfig(24, 2, 1, 2))
	checkpointed(t, q, "ck0", "a", prompts[0], 16)
	flushDevice(t, q, "a")
	ts = tierSlotsSum(t, q)
	require.Zero(t, ts.Checkpoints)
	l, err := q.TryAdmit(Request{ID: "q", Tenant: "a", PromptTokens: 20, TokenIDs: prompts[0]})
	require.NoError(t, err)
	require.Zero(t, l.HitTokens())
	require.NoError(t, l.Release())
	require.NoError(t, q.Check())
	_, err = q.AuditFreePages()
	require.NoError(t, err)
}

// A checkpoint whose copy into the tier fails is not kept (its state
// units are scrubbed as any evicted ones); one whose copy back fails
// refuses the admission with ErrOnloadFailed, nothing handed out, the
// checkpoint dropped from the tier and its slot scrubbed. Either way the
// pool stays whole and the next admission computes afresh.
func TestTierCheckpointCopyFails(t *testing.T) {
	p, d := newTierDevicePool(t, tierCheckpointConfig(24, 2, 32, 2))
	ck0, ck1 := promptTokens(0, 20, 0, 20), promptTokens(1, 20, 1, 20)
	checkpointed(t, p, "ck0", "a", ck0, 16)
	d.failToHost, d.halfway = errors.New("injected: DtoH failed"), true // some units copied, not all
	checkpointed(t, p, "ck1", "a", ck1, 16)
	d.failToHost, d.halfway = nil, false
	ts := tierSlotsSum(t, p)
	require.EqualValues(t, 1, ts.CheckpointsFailed)
	require.Zero(t, ts.Checkpoints)
	l, err := p.TryAdmit(Request{ID: "l", Tenant: "a", PromptTokens: 20, TokenIDs: ck0})
	require.NoError(t, err)
	require.Zero(t, l.HitTokens(), "its copy failed: nothing to restore")
	require.NoError(t, l.Release())

	// ck1's checkpoint goes to the tier now (l's checkpoint-less release
	// left the slots as they were: evict it with a new checkpoint).
	checkpointed(t, p, "ck2", "a", promptTokens(2, 20, 2, 20), 16)
	ts = tierSlotsSum(t, p)
	require.Equal(t, 1, ts.Checkpoints)
	d.failFromHost = errors.New("injected: HtoD failed")
	_, err = p.TryAdmit(Request{ID: "m", Tenant: "a", PromptTokens: 20, TokenIDs: ck1})
	d.failFromHost = nil
	require.ErrorIs(t, err, ErrOnloadFailed)
	require.ErrorIs(t, err, ErrDevice)
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	require.Equal(t, "m", ae.RequestID)
	ts = tierSlotsSum(t, p)
	require.EqualValues(t, 1, ts.CheckpointRestoresFailed)
	require.Zero(t, ts.Checkpoints, "dropped: its copy failed")
	require.Zero(t, p.Stats().LiveLeases)
	m, err := p.TryAdmit(Request{ID: "m", Tenant: "a", PromptTokens: 20, TokenIDs: ck1})
	require.NoError(t, err)
	require.Zero(t, m.HitTokens())
	require.NoError(t, stateErr(p, m, "", 0))
	require.NoError(t, m.Release())
	require.NoError(t, p.Check())
	_, err = p.AuditFreePages()
	require.NoError(t, err)
}

// A tenant's tier share bounds its domain's checkpoints in the tier as
// it bounds its pages: the same share of the checkpoint slots.
func TestTierCheckpointShare(t *testing.T) {
	p := newPool(t, tierCheckpointConfig(32, 2, 32, 4, TenantConfig{Name: "a", TierPages: 8}, TenantConfig{Name: "b"}))
	for i := range 5 {
		checkpointed(t, p, fmt.Sprint("ck", i), "a", promptTokens(i, 20, i, 20), 16)
	}
	ts := tierSlotsSum(t, p)
	require.Equal(t, 1, ts.Checkpoints, "a's share: 8 of 32 pages, 1 of 4 checkpoints")
	for i := range 5 {
		checkpointed(t, p, fmt.Sprint("b", i), "b", promptTokens(10+i, 20, 10+i, 20), 16)
	}
	ts = tierSlotsSum(t, p)
	require.Equal(t, 4, ts.Checkpoints, "b, unbounded, fills the tier: a's is the least recently used")
	require.NoError(t, p.Check())
	doms := map[string]DomainStats{}
	for _, d := range p.Stats().Prefix.Domains {
		doms[d.Name] = d
	}
	a, b := doms["tenant:a"], doms["tenant:b"]
	require.Equal(t, 1, a.TierCheckpointBound)
	require.Zero(t, a.TierCheckpoints)
	require.EqualValues(t, 5, a.TierCheckpointsStored, "ck0..ck4 went to the tier, each evicting the one before, the last for b's")
	require.EqualValues(t, 5, a.TierCheckpointsEvicted)
	require.Equal(t, 4, b.TierCheckpointBound)
	require.Equal(t, 4, b.TierCheckpoints)
	require.EqualValues(t, 4, b.TierCheckpointsStored)
	require.Zero(t, a.TierCheckpointHits+b.TierCheckpointHits)
}

// A checkpoint in the tier is its domain's: a tenant moved to another
// domain while it sits there finds nothing, the tenants of the domain
// find it, and keys crafted from another domain's prompt reach nothing.
func TestTierCheckpointIsolation(t *testing.T) {
	p := newPool(t, tierCheckpointConfig(24, 2, 32, 2, TenantConfig{Name: "a", Domain: "x"}, TenantConfig{Name: "b", Domain: "x"},
		TenantConfig{Name: "c", Domain: "y"}))
	ck0 := promptTokens(0, 20, 0, 20)
	checkpointed(t, p, "ck0", "a", ck0, 16)
	checkpointed(t, p, "ck1", "a", promptTokens(1, 20, 1, 20), 16) // ck0 to the tier
	flushDevice(t, p, "c")
	require.Equal(t, 2, tierSlotsSum(t, p).Checkpoints, "both in the tier")

	require.NoError(t, p.UpdateTenant(TenantConfig{Name: "a", Domain: "z"}))
	l, err := p.TryAdmit(Request{ID: "moved", Tenant: "a", PromptTokens: 20, TokenIDs: ck0})
	require.NoError(t, err)
	require.Zero(t, l.HitTokens(), "a moved out of x: x's checkpoint is not its")
	require.NoError(t, stateErr(p, l, "", 0))
	require.NoError(t, l.Release())

	// Keys derived in x, presented by a tenant of y: the lookup is y's.
	keys, err := p.PageKeys("b", "", ck0, nil)
	require.NoError(t, err)
	l, err = p.TryAdmit(Request{ID: "crafted", Tenant: "c", PromptTokens: 20, PageKeys: keys})
	require.NoError(t, err)
	require.Zero(t, l.HitTokens())
	require.NoError(t, stateErr(p, l, "", 0))
	require.NoError(t, l.Release())

	l, err = p.TryAdmit(Request{ID: "b", Tenant: "b", PromptTokens: 20, TokenIDs: ck0})
	require.NoError(t, err)
	require.Equal(t, 16, l.HitTokens(), "b shares x")
	require.NoError(t, stateErr(p, l, "ck0@16", 16))
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())
	_, err = p.AuditFreePages()
	require.NoError(t, err)
}

// Close waits for a restore from the tier in flight; the admission ends
// refused or its lease with the pool, and nothing is left behind.
func TestTierCheckpointCloseWithRestoreInFlight(t *testing.T) {
	p, d := newTierDevicePool(t, tierCheckpointConfig(24, 2, 32, 2))
	ck0 := promptTokens(0, 20, 0, 20)
	checkpointed(t, p, "ck0", "a", ck0, 16)
	checkpointed(t, p, "ck1", "a", promptTokens(1, 20, 1, 20), 16)
	err := closeWithCopyHeld(t, p, d, Request{ID: "again", Tenant: "a", PromptTokens: 20, TokenIDs: ck0}) // its restore held
	require.ErrorIs(t, err, ErrPoolClosed)
	s := p.Stats()
	require.Equal(t, s.Tier.Slots, s.Tier.Free, "a closed pool's tier keeps nothing")
	require.NoError(t, p.Check())
	_, err = p.AuditFreePages()
	require.NoError(t, err)
}

// A hybrid pool's Preempt keeps what its checkpoint covers and swaps
// nothing: private pages are of no use without the state at their end.
func TestTierHybridPreemptDoesNotSwap(t *testing.T) {
	p := newPool(t, tierCheckpointConfig(24, 2, 32, 2))
	tokens := promptTokens(0, 22, 0, 22)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 22, MaxNewTokens: 4, TokenIDs: tokens})
	require.NoError(t, err)
	prefillTo(t, p, l, "r", 22)
	kept, err := l.Preempt(tokens)
	require.NoError(t, err)
	require.Zero(t, kept, "22 tokens end inside a page: no checkpoint, nothing a resumed request can use")
	s := tierSlotsSum(t, p)
	require.Zero(t, s.SwapsOut)
	require.Zero(t, s.Swapped)
	l, err = p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 22, MaxNewTokens: 4, TokenIDs: tokens})
	require.NoError(t, err)
	require.Zero(t, l.HitTokens())
	require.NoError(t, stateErr(p, l, "", 0))
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())
}
