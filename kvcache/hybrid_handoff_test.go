package kvcache

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// prefillHybrid admits a prompt of prompt tokens on p, writes a distinct
// marker into every region of every page (slot) it holds in every group
// (seeded by id), slides its windows to the prompt and walks it to
// prefilled.
func prefillHybrid(t testing.TB, p *Pool, id, tenant string, prompt int) *Lease {
	t.Helper()
	l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: prompt})
	require.NoError(t, err)
	require.NoError(t, l.BeginPrefill())
	// As an engine leaves them: the windows slid to the prompt's end,
	// each ring page holding the logical page GroupTable names.
	require.NoError(t, l.Commit(prompt))
	_, err = l.SlideWindows(cudaops.Ordering{})
	require.NoError(t, err)
	for _, g := range p.Spec().Groups {
		first, table, err := l.GroupTable(g.Name, nil)
		require.NoError(t, err)
		for i := range table {
			for r, reg := range g.Regions {
				require.NoError(t, l.WritePage(g.Name, i, r, unitMarker(id, g.Name, first+i, r, reg.PageBytes)))
			}
		}
	}
	require.NoError(t, l.FinishPrefill())
	return l
}

// unitMarker is what prefillHybrid writes into region r of logical page
// lp of group g of request id.
func unitMarker(id, g string, lp, r int, n int64) []byte {
	return bytes.Repeat([]byte(fmt.Sprintf("%s/%s/%d/%d|", id, g, lp, r)), int(n))[:n]
}

// requireHybridContent checks that l holds, in every unit of a handoff
// of its prompt, what prefillHybrid wrote for request id.
func requireHybridContent(t testing.TB, p *Pool, l *Lease, id string) {
	t.Helper()
	for _, e := range p.Spec().HandoffExtents(l.PromptTokens()) {
		first, table, err := l.GroupTable(e.Group, nil)
		require.NoError(t, err)
		require.Equal(t, e.First, first, "group %q starts where the prompt's window does", e.Group)
		var regions []CacheRegion
		for _, g := range p.Spec().Groups {
			if g.Name == e.Group {
				regions = g.Regions
			}
		}
		for j := range e.Units {
			for r, reg := range regions {
				got := make([]byte, reg.PageBytes)
				require.NoError(t, l.ReadPage(e.Group, j, r, got))
				require.Equal(t, unitMarker(id, e.Group, e.First+j, r, reg.PageBytes), got, "group %q unit %d region %d", e.Group, j, r)
			}
		}
		require.GreaterOrEqual(t, len(table), e.Units)
	}
}

func TestHandoffExtentsFollowTheWindow(t *testing.T) {
	s := hybridSpec() // pages of 4 tokens; a window of 8 tokens
	for _, tc := range []struct {
		prompt            int
		kv, first, window int
	}{
		{1, 1, 0, 1}, {4, 1, 0, 1}, {8, 2, 0, 2}, {9, 3, 0, 3}, {12, 3, 1, 2}, {30, 8, 5, 3}, {32, 8, 6, 2},
	} {
		es := s.HandoffExtents(tc.prompt)
		require.Len(t, es, 3)
		assert.Equal(t, HandoffExtent{Group: "kv", Kind: GroupPerToken, Units: tc.kv, UnitBytes: s.Groups[0].bytes()}, es[0], "prompt %d", tc.prompt)
		assert.Equal(t, HandoffExtent{Group: "swa", Kind: GroupSlidingWindow, First: tc.first, Units: tc.window, UnitBytes: s.Groups[1].bytes()}, es[1], "prompt %d", tc.prompt)
		assert.Equal(t, HandoffExtent{Group: "state", Kind: GroupState, Units: 1, UnitBytes: s.Groups[2].bytes()}, es[2], "prompt %d", tc.prompt)
		// The window's units are the pages of its tokens [prompt-8, prompt).
		assert.Equal(t, (tc.prompt-1)/4, es[1].First+es[1].Units-1)
		assert.LessOrEqual(t, es[1].Units, s.Groups[1].windowPages())
	}
	assert.Nil(t, s.HandoffExtents(0))
	assert.Nil(t, CacheSpec{}.HandoffExtents(4))
}

// bigStateConfig is hybridConfig with state slots of several checksum
// blocks (2 layers of 4 heads × 32 × 32 fp32: 32 KiB of state).
func bigStateConfig() Config {
	cfg := hybridConfig(64, 4)
	cfg.Cache = hybridSpec()
	cfg.Cache.Groups[2].Regions = LinearAttentionState([]int{0, 4}, 8, 4, BF16, 4, 32, 32, FP32)
	return cfg
}

// A hybrid prompt moves whole, every group: the per-token pages, the
// window's pages at the prompt's end (into a decode ring of another
// size) and the state slot, the slot in ranges; the decode lease holds
// exactly what prefill wrote, starts its window where the prompt's did,
// and both pools balance.
func TestHybridHandoffMovesEveryGroup(t *testing.T) {
	for _, prompt := range []int{3, 9, 30} {
		t.Run(fmt.Sprint(prompt), func(t *testing.T) {
			src, dst := newPool(t, bigStateConfig()), newPool(t, bigStateConfig())
			l := prefillHybrid(t, src, "r", "a", prompt)
			out, err := l.Export(time.Now().Add(time.Minute))
			require.NoError(t, err)
			in, err := dst.TryBeginImport(Request{ID: "r", Tenant: "a", PromptTokens: prompt, MaxNewTokens: 40}, l.Domain(), 0)
			require.NoError(t, err)
			require.Equal(t, out.Extents(), in.Extents())
			require.Equal(t, out.Units(), in.Units())
			for u := 0; u < out.Units(); u++ {
				ub := out.UnitBytes(u)
				require.Equal(t, ub, in.UnitBytes(u))
				buf := make([]byte, ub)
				if ub <= UnitRangeAlign {
					require.NoError(t, out.ReadUnits(u, buf))
					require.NoError(t, in.WriteUnits(u, buf))
					continue
				}
				for off := int64(0); off < ub; off += UnitRangeAlign { // the slot, in ranges
					k := min(ub-off, UnitRangeAlign)
					require.NoError(t, out.ReadUnitRange(u, off, buf[off:off+k]))
					require.NoError(t, in.WriteUnitRangeFrom(u, off, [][]byte{buf[off : off+k]}))
				}
			}
			sum, err := out.Checksum()
			require.NoError(t, err)
			dl, err := in.CompleteWithChecksum(sum)
			require.NoError(t, err)
			requireHybridContent(t, dst, dl, "r")
			require.NoError(t, out.Ack())
			require.NoError(t, src.Check())
			require.NoError(t, dst.Check())
			// The decode lease slides on from the prompt's window.
			require.NoError(t, dl.Commit(prompt+12))
			_, err = dl.SlideWindows(cudaops.Ordering{})
			require.NoError(t, err)
			require.NoError(t, dl.Release())
			_, err = src.AuditFreePages()
			require.NoError(t, err)
			_, err = dst.AuditFreePages()
			require.NoError(t, err)
		})
	}
}

// An import that lacks one group's units is incomplete, names the group,
// and hands out nothing: its pages in every group are scrubbed.
func TestHybridImportMissingAGroupIsIncomplete(t *testing.T) {
	src, dst := newPool(t, hybridConfig(64, 4)), newPool(t, hybridConfig(64, 4))
	l := prefillHybrid(t, src, "r", "a", 30)
	out, err := l.Export(time.Now().Add(time.Minute))
	require.NoError(t, err)
	in, err := dst.TryBeginImport(Request{ID: "r", Tenant: "a", PromptTokens: 30}, l.Domain(), 0)
	require.NoError(t, err)
	state := out.Units() - 1
	for u := 0; u < state; u++ {
		buf := make([]byte, out.UnitBytes(u))
		require.NoError(t, out.ReadUnits(u, buf))
		require.NoError(t, in.WriteUnits(u, buf))
	}
	sum, err := out.Checksum()
	require.NoError(t, err)
	_, err = in.CompleteWithChecksum(sum)
	require.ErrorIs(t, err, ErrIncompleteTransfer)
	assert.ErrorContains(t, err, `cache group "state": 0 of 1`)
	s := dst.Stats()
	assert.Zero(t, s.LiveLeases)
	for _, g := range s.Groups {
		assert.Zero(t, g.InUse, "group %q", g.Name)
	}
	require.NoError(t, dst.Check())
	require.NoError(t, out.Abort())
	require.NoError(t, src.Check())
}

// A unit's ranges come one at a time and in order, at aligned offsets;
// anything else is refused and changes nothing, and a range of a unit
// received whole aborts the import.
func TestUnitRangesComeInOrder(t *testing.T) {
	src, dst := newPool(t, bigStateConfig()), newPool(t, bigStateConfig())
	l := prefillHybrid(t, src, "r", "a", 9)
	out, err := l.Export(time.Now().Add(time.Minute))
	require.NoError(t, err)
	defer out.Abort()
	in, err := dst.TryBeginImport(Request{ID: "r", Tenant: "a", PromptTokens: 9}, l.Domain(), 0)
	require.NoError(t, err)
	slot := in.Units() - 1
	ub := in.UnitBytes(slot)
	require.Greater(t, ub, int64(2*UnitRangeAlign), "the test's slot spans several ranges")
	buf := make([]byte, ub)
	require.NoError(t, out.ReadUnits(slot, buf))
	a := int64(UnitRangeAlign)
	before := state(dst)
	for _, tc := range []struct {
		name      string
		u         int
		off, n    int64
		wantError error
	}{
		{"not at the start", slot, a, a, ErrInvalidArgument},
		{"unaligned", slot, 0, a - 4, ErrInvalidArgument},
		{"past the unit", slot, ub - a + 4, a, ErrInvalidArgument},
		{"empty", slot, 0, 0, ErrInvalidArgument},
		{"a unit out of range", slot + 1, 0, a, ErrInvalidArgument},
	} {
		err := in.WriteUnitRangeFrom(tc.u, tc.off, [][]byte{make([]byte, tc.n)})
		require.ErrorIs(t, err, tc.wantError, tc.name)
		assert.Equal(t, before, state(dst), tc.name)
	}
	require.NoError(t, in.WriteUnitRangeFrom(slot, 0, [][]byte{buf[:a]}))
	require.ErrorIs(t, in.WriteUnitRangeFrom(slot, 2*a, [][]byte{buf[2*a : 3*a]}), ErrInvalidArgument, "a gap")
	require.ErrorIs(t, in.WriteUnitRangeFrom(slot, 0, [][]byte{buf[:a]}), ErrInvalidArgument, "a range again")
	require.ErrorIs(t, in.WriteUnitRangeFrom(0, 0, [][]byte{make([]byte, in.UnitBytes(0))}), ErrInvalidArgument, "another unit's range meanwhile")
	// The rest in one range, split over parts at odd places.
	rest := buf[a:]
	require.NoError(t, in.WriteUnitRangeFrom(slot, a, [][]byte{rest[:7], rest[7:4099], rest[4099:]}))
	require.NoError(t, dst.Check())
	// A range of the unit now received whole is a duplicate: the import
	// is aborted.
	require.ErrorIs(t, in.WriteUnitRangeFrom(slot, 0, [][]byte{buf[:a]}), ErrDuplicatePage)
	assert.Zero(t, dst.Stats().LiveLeases)
	require.NoError(t, dst.Check())
}
