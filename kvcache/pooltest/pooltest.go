// Package pooltest runs a hybrid model's pool through its device: the
// paths that copy pages rather than fill them. A backend's tests call Run
// with a constructor, as they call cudaops/devicetest's conformance suite
// for the device alone; the Host device runs it in kvcache's tests, the
// CUDA backend over the simulated driver in cudaops', and a real GPU in
// scripts/gpu-check.sh.
//
// The pool is Spec's: a per-token group (MLA latents and indexer keys), a
// sliding window of two pages and a recurrent state slot of several
// checksum blocks, poisoned on free. The suite checks, byte for byte:
//
//   - Handoff: a prompt moves from one pool to another, every group, the
//     small units in one staged read and write across groups, the state
//     slot in ranges; the decode lease holds what prefill wrote.
//   - Checkpoints: a state checkpoint taken mid-prefill (a copy within
//     the device) is restored into the next admission of the same prompt
//     in the same domain, and into no other domain's.
//   - HostTier: pages and a checkpoint the device evicts are copied to
//     page-locked host memory and back into a new admission's pages.
//
// Throughout, every unit a lease holds either carries the bytes the
// scenario wrote for it (a pseudo-random pattern seeded by request,
// group, logical page and region, so a page copied into the wrong place
// is caught) or the scrub pattern: a page handed to a new owner never
// holds an earlier owner's bytes. Each pool ends balanced (Check) with
// every free page holding the scrub pattern (AuditFreePages).
package pooltest

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// TokensPerPage is the page size of Spec's per-token and window groups.
const TokensPerPage = 4

// Spec is the hybrid cache the suite runs: a per-token group "kv" (the
// MLA latents and indexer keys of layers 1 and 3), a sliding window
// "swa" of 8 tokens (layer 2's K and V) and a state group "state" (the
// linear-attention state of layers 0 and 4: 32 KiB, several checksum
// blocks, so that a handoff moves it in ranges).
func Spec() kvcache.CacheSpec {
	return kvcache.CacheSpec{Model: "pooltest-hybrid", Groups: []kvcache.CacheGroup{
		{Name: "kv", Kind: kvcache.GroupPerToken, TokensPerPage: TokensPerPage, Regions: append(
			kvcache.MLALatent([]int{1, 3}, 12, 4, kvcache.BF16, TokensPerPage),
			kvcache.IndexerKeys([]int{1, 3}, 16, TokensPerPage)...)},
		{Name: "swa", Kind: kvcache.GroupSlidingWindow, TokensPerPage: TokensPerPage, WindowTokens: 8,
			Regions: kvcache.AttentionKVOf([]int{2}, 1, 8, kvcache.BF16, TokensPerPage)},
		{Name: "state", Kind: kvcache.GroupState,
			Regions: kvcache.LinearAttentionState([]int{0, 4}, 8, 4, kvcache.BF16, 4, 32, 32, kvcache.FP32)},
	}}
}

// Run runs the suite; open returns a new device with no regions, which
// the suite closes after the pool it backs.
func Run(t *testing.T, open func(t *testing.T) cudaops.Device) {
	t.Run("Handoff", func(t *testing.T) { testHandoff(t, open) })
	t.Run("Checkpoints", func(t *testing.T) { testCheckpoints(t, open) })
	t.Run("HostTier", func(t *testing.T) { testHostTier(t, open) })
}

// config is a pool of Spec over pages pages for tenants a and b, each in
// a domain of its own, poisoned on free.
func config(pages, maxLeases int) kvcache.Config {
	return kvcache.Config{Cache: Spec(), Pages: pages, MaxLeases: maxLeases,
		MaxContextTokens: pages * TokensPerPage,
		Tenants:          []kvcache.TenantConfig{{Name: "a"}, {Name: "b"}},
		Scrub:            kvcache.ScrubPolicy{Kind: isolation.ScrubPoison}}
}

// newPool opens a device and a pool of cfg on it. At the test's end the
// pool must be balanced and its free pages scrubbed; then both close.
func newPool(t *testing.T, open func(t *testing.T) cudaops.Device, cfg kvcache.Config) *kvcache.Pool {
	t.Helper()
	d := open(t)
	t.Cleanup(func() { require.NoError(t, d.Close()) })
	cfg.Device = d
	p, err := kvcache.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, p.Close())
	})
	t.Cleanup(func() {
		if t.Failed() {
			return
		}
		require.NoError(t, p.Check())
		pages, err := p.AuditFreePages()
		require.NoError(t, err, "a free page holds something other than the scrub pattern")
		require.Positive(t, pages)
	})
	return p
}

// unit is what the scenario's engine writes into region r of logical
// page lp of group g for tag: the tag's label, then bytes seeded by all
// four, so that every page of every region differs from every other.
func unit(tag, g string, lp, r int, n int64) []byte {
	h := fnv.New64a()
	fmt.Fprintf(h, "%s|%s|%d|%d", tag, g, lp, r)
	rng := rand.New(rand.NewPCG(h.Sum64(), uint64(n)))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	copy(b, fmt.Sprintf("%s|%s|%d|%d;", tag, g, lp, r))
	return b
}

// tagOf is the tag of a group's units for a prompt at n tokens: a
// per-token page's KV depends on the prompt alone, a window page or
// the state on how far the prompt has been computed.
func tagOf(kind kvcache.GroupKind, prompt string, n int) string {
	if kind == kvcache.GroupPerToken {
		return prompt
	}
	return fmt.Sprintf("%s@%d", prompt, n)
}

// compute runs l's prefill from token from to n as an engine does:
// commit, slide the windows, write the new per-token pages and every
// unit of the windows and the state at n.
func compute(t *testing.T, p *kvcache.Pool, l *kvcache.Lease, prompt string, from, n int) {
	t.Helper()
	require.NoError(t, l.Commit(n))
	_, err := l.SlideWindows(cudaops.Ordering{})
	require.NoError(t, err)
	spec := p.Spec()
	for gi, e := range spec.HandoffExtents(n) {
		first, _, err := l.GroupTable(e.Group, nil)
		require.NoError(t, err)
		for j := range e.Units {
			lp := e.First + j
			if e.Kind == kvcache.GroupPerToken && lp < from/TokensPerPage {
				continue // written before, and maybe shared since
			}
			for r, reg := range spec.Groups[gi].Regions {
				require.NoError(t, l.WritePage(e.Group, lp-first, r,
					unit(tagOf(e.Kind, prompt, n), e.Group, lp, r, reg.PageBytes)))
			}
		}
	}
}

// holds returns an error unless l holds prompt's units at n tokens (n =
// 0: none): the units of a handoff of n tokens carry what compute wrote
// for them, and every other page l holds in any group the scrub pattern.
func holds(p *kvcache.Pool, l *kvcache.Lease, prompt string, n int) error {
	spec := p.Spec()
	var extents []kvcache.HandoffExtent
	if n > 0 {
		extents = spec.HandoffExtents(n)
	}
	fill := p.FillSpec()
	for gi, g := range spec.Groups {
		first, table, err := l.GroupTable(g.Name, nil)
		if err != nil {
			return err
		}
		for i, page := range table {
			lp := first + i
			written := false
			if extents != nil {
				e := extents[gi]
				written = lp >= e.First && lp < e.First+e.Units
			}
			var word [4]byte
			binary.LittleEndian.PutUint32(word[:], fill.WordFor(page))
			for r, reg := range g.Regions {
				got := make([]byte, reg.PageBytes)
				if err := l.ReadPage(g.Name, i, r, got); err != nil {
					return err
				}
				what, want := "the scrub pattern", bytes.Repeat(word[:], len(got)/4)
				if written {
					what, want = fmt.Sprintf("%s's unit at %d tokens", prompt, n), unit(tagOf(g.Kind, prompt, n), g.Name, lp, r, reg.PageBytes)
				}
				if at := firstDiff(got, want); at >= 0 {
					return fmt.Errorf("lease %q, group %q, logical page %d (page %d), region %d: byte %d is %#x, want %#x of %s (it begins %q)",
						l.ID(), g.Name, lp, page, r, at, got[at], want[at], what, got[:min(16, len(got))])
				}
			}
		}
	}
	return nil
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

// waiting is the context of an admission: an engine waits for pages
// whose scrub a device has queued but not finished (a GPU's, or CUDA's
// over the simulated driver), where TryAdmit would refuse.
func waiting(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// admit is Pool.Admit within waiting's time.
func admit(t *testing.T, p *kvcache.Pool, req kvcache.Request) (*kvcache.Lease, error) {
	return p.Admit(waiting(t), req)
}

// scrubbed waits until no page of p waits for its scrub to complete.
func scrubbed(t *testing.T, p *kvcache.Pool) {
	t.Helper()
	require.Eventually(t, func() bool { return p.Stats().QuarantinedPages == 0 }, 10*time.Second, time.Millisecond)
}

// prefill admits prompt tokens for id and computes them whole.
func prefill(t *testing.T, p *kvcache.Pool, id string, prompt int, maxNew int) *kvcache.Lease {
	t.Helper()
	l, err := admit(t, p, kvcache.Request{ID: id, Tenant: "a", PromptTokens: prompt, MaxNewTokens: maxNew})
	require.NoError(t, err)
	require.NoError(t, holds(p, l, id, 0), "a fresh lease")
	require.NoError(t, l.BeginPrefill())
	compute(t, p, l, id, 0, prompt)
	require.NoError(t, l.FinishPrefill())
	require.NoError(t, holds(p, l, id, prompt), "what prefill wrote, read back")
	return l
}

// testHandoff moves prompts of one page, of a window and a half, and of
// several windows from one pool to another: the per-token and window
// units in one staged read and one write from uneven parts (out of
// order: the second half first), the state slot range by range.
func testHandoff(t *testing.T, open func(t *testing.T) cudaops.Device) {
	for _, prompt := range []int{3, 13, 30} {
		t.Run(fmt.Sprint(prompt), func(t *testing.T) {
			src, dst := newPool(t, open, config(32, 4)), newPool(t, open, config(24, 3))
			// Free pages in two places, so that a long prompt's are not
			// one run: each run is a copy of its own.
			var hold []*kvcache.Lease
			for i := range 3 {
				hold = append(hold, prefill(t, src, fmt.Sprint("hold", i), 2*TokensPerPage, 0))
			}
			require.NoError(t, hold[1].Release())
			scrubbed(t, src)
			l := prefill(t, src, "r", prompt, 0)
			if _, table, err := l.GroupTable("kv", nil); err == nil && len(table) > 2 {
				require.False(t, slices.IsSorted(table) && int(table[len(table)-1]-table[0]) == len(table)-1,
					"the prompt's pages %v are one run", table)
			}
			require.NoError(t, hold[0].Release())
			require.NoError(t, hold[2].Release())
			out, err := l.Export(time.Now().Add(time.Minute))
			require.NoError(t, err)
			sum, err := out.Checksum()
			require.NoError(t, err)
			in, err := dst.BeginImport(waiting(t), kvcache.Request{ID: "r", Tenant: "a", PromptTokens: prompt, MaxNewTokens: 12}, out.Domain(), sum)
			require.NoError(t, err)
			require.Equal(t, out.Extents(), in.Extents())
			require.Equal(t, out.Units(), in.Units())

			rng := rand.New(rand.NewPCG(uint64(prompt), 34))
			for u := 0; u < out.Units(); {
				ub := out.UnitBytes(u)
				if ub > kvcache.UnitRangeAlign {
					buf := make([]byte, ub)
					for off := int64(0); off < ub; off += kvcache.UnitRangeAlign {
						part := buf[off:min(ub, off+kvcache.UnitRangeAlign)]
						require.NoError(t, out.ReadUnitRange(u, off, part))
						require.NoError(t, in.WriteUnitRangeFrom(u, off, [][]byte{part}))
					}
					u++
					continue
				}
				end := u
				var n int64
				for end < out.Units() && out.UnitBytes(end) <= kvcache.UnitRangeAlign {
					n += out.UnitBytes(end)
					end++
				}
				buf := make([]byte, n)
				require.NoError(t, out.ReadUnits(u, buf))
				half, at := (end-u)/2, int64(0)
				for k := u; k < u+half; k++ {
					at += out.UnitBytes(k)
				}
				require.NoError(t, in.WriteUnitsFrom(u+half, parts(buf[at:], rng)))
				require.NoError(t, in.WriteUnitsFrom(u, parts(buf[:at], rng)))
				u = end
			}
			dl, err := in.Complete()
			require.NoError(t, err)
			require.NoError(t, holds(dst, dl, "r", prompt), "the decode lease")
			require.NoError(t, out.Ack())

			// Decode goes on from the prompt's window.
			require.NoError(t, dl.Commit(prompt+12))
			_, err = dl.SlideWindows(cudaops.Ordering{})
			require.NoError(t, err)
			require.NoError(t, dl.Release())
		})
	}
}

// parts cuts b into pieces of uneven sizes, some empty, as a transfer
// delivers them.
func parts(b []byte, rng *rand.Rand) [][]byte {
	var ps [][]byte
	for len(b) > 0 {
		n := min(len(b), []int{1000, 96, 0, 4096, 7}[rng.IntN(5)])
		ps = append(ps, b[:n])
		b = b[n:]
	}
	return ps
}

// testCheckpoints checkpoints a prefill at its last page boundary (28 of
// 30 tokens) and computes on; the next admission of the prompt in the
// domain starts at 28 with the checkpoint's state and windows, another
// domain's starts from nothing.
func testCheckpoints(t *testing.T, open func(t *testing.T) cudaops.Device) {
	cfg := config(48, 3)
	cfg.Prefix.CheckpointSlots = 2
	p := newPool(t, open, cfg)
	tokens := promptTokens(1, 30)

	a, err := admit(t, p, kvcache.Request{ID: "a", Tenant: "a", PromptTokens: 30, MaxNewTokens: 4, TokenIDs: tokens})
	require.NoError(t, err)
	require.Equal(t, 28, a.PrefillCheckpoint())
	require.NoError(t, a.BeginPrefill())
	compute(t, p, a, "a", 0, 28)
	require.NoError(t, a.CheckpointState(28, cudaops.Ordering{}))
	compute(t, p, a, "a", 28, 30) // the state moves on; the checkpoint does not
	require.NoError(t, a.FinishPrefill())
	require.NoError(t, holds(p, a, "a", 30))
	require.NoError(t, a.Release())
	require.Equal(t, 1, p.Stats().Checkpoints.Live)

	b, err := admit(t, p, kvcache.Request{ID: "b", Tenant: "a", PromptTokens: 30, MaxNewTokens: 4, TokenIDs: tokens})
	require.NoError(t, err)
	require.Equal(t, 28, b.HitTokens())
	require.NoError(t, holds(p, b, "a", 28), "restored from the checkpoint")
	require.NoError(t, b.BeginPrefill())
	compute(t, p, b, "a", 28, 30)
	require.NoError(t, b.FinishPrefill())
	require.NoError(t, b.Release())

	other, err := admit(t, p, kvcache.Request{ID: "other", Tenant: "b", PromptTokens: 30, TokenIDs: tokens})
	require.NoError(t, err)
	require.Zero(t, other.HitTokens(), "another domain's checkpoint")
	require.NoError(t, holds(p, other, "", 0))
	require.NoError(t, other.Release())
	require.EqualValues(t, 1, p.Stats().Checkpoints.Hits)
}

// promptTokens is a prompt of n token IDs seeded by seed.
func promptTokens(seed, n int) []int32 {
	ts := make([]int32, n)
	for i := range ts {
		ts[i] = int32(seed*100_000 + i)
	}
	return ts
}

// testHostTier checkpoints two prompts on a device with one checkpoint
// to spare and a host tier: the second checkpoint sends the first's to
// the tier; a request that takes every page of the device sends both
// prompts' pages and checkpoints there; each prompt then comes back
// whole, its pages and state copied in from the tier, and another
// domain finds neither.
func testHostTier(t *testing.T, open func(t *testing.T) cudaops.Device) {
	cfg := config(24, 2)
	cfg.HostTier = kvcache.HostTierConfig{Pages: 32, Checkpoints: 2}
	p := newPool(t, open, cfg)
	prompts := [][]int32{promptTokens(1, 20), promptTokens(2, 20)}
	ids := []string{"ck0", "ck1"}
	for i, tokens := range prompts {
		l, err := admit(t, p, kvcache.Request{ID: ids[i], Tenant: "a", PromptTokens: 20, TokenIDs: tokens})
		require.NoError(t, err)
		require.NoError(t, l.BeginPrefill())
		compute(t, p, l, ids[i], 0, 16)
		require.NoError(t, l.CheckpointState(16, cudaops.Ordering{}))
		compute(t, p, l, ids[i], 16, 20)
		require.NoError(t, l.FinishPrefill())
		require.NoError(t, l.Release())
	}
	require.Equal(t, 1, p.Stats().Tier.Checkpoints, "the first checkpoint went to the tier")

	flush, err := admit(t, p, kvcache.Request{ID: "flush", Tenant: "b", PromptTokens: p.Pages() * TokensPerPage})
	require.NoError(t, err)
	require.NoError(t, holds(p, flush, "", 0), "every page of the device, each scrubbed")
	require.NoError(t, flush.Release())
	s := p.Stats()
	require.Zero(t, s.Checkpoints.Live)
	require.Equal(t, 2, s.Tier.Checkpoints)
	require.Positive(t, s.Tier.Offloads)

	other, err := admit(t, p, kvcache.Request{ID: "other", Tenant: "b", PromptTokens: 20, TokenIDs: prompts[0]})
	require.NoError(t, err)
	require.Zero(t, other.HitTokens(), "another domain's tier")
	require.NoError(t, holds(p, other, "", 0))
	require.NoError(t, other.Release())

	for i, tokens := range prompts {
		l, err := admit(t, p, kvcache.Request{ID: fmt.Sprint("back", i), Tenant: "a", PromptTokens: 20, TokenIDs: tokens})
		require.NoError(t, err)
		require.Equal(t, 16, l.HitTokens(), "prompt %d", i)
		require.NoError(t, holds(p, l, ids[i], 16), "prompt %d, back from the tier", i)
		require.NoError(t, l.Release())
	}
	s = p.Stats()
	require.Positive(t, s.Tier.Onloads)
	require.EqualValues(t, 2, s.Tier.CheckpointsRestored)
}
