package kvcache

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

// A lease reads and writes exactly the pages it holds, in every group, at
// the entries GroupTable lists: what it writes lands in the device page
// GroupTable names, and reads back.
func TestLeasePageIOReachesItsOwnPages(t *testing.T) {
	p := newPool(t, hybridConfig(64, 2))
	h := hostOf(t, p)
	l := admit(t, p, "r", "a", 30)
	require.NoError(t, l.Commit(20))
	_, err := l.SlideWindows(cudaops.Ordering{}) // the window moves: its table starts later
	require.NoError(t, err)
	for gi, g := range p.Spec().Groups {
		first, table, err := l.GroupTable(g.Name, nil)
		require.NoError(t, err)
		if g.Kind == GroupSlidingWindow {
			require.Positive(t, first, "the window slid")
		}
		for i, pg := range table {
			for r, reg := range g.Regions {
				src := bytes.Repeat([]byte{byte(gi*50 + i*7 + r + 1)}, int(reg.PageBytes))
				require.NoError(t, l.WritePage(g.Name, i, r, src))
				assert.Equal(t, src, h.PageBytes(p.groups[gi].first+r, pg), "group %q entry %d region %d", g.Name, i, r)
				got := make([]byte, reg.PageBytes)
				require.NoError(t, l.ReadPage(g.Name, i, r, got))
				assert.Equal(t, src, got)
			}
		}
	}
	require.NoError(t, p.Check())
}

// Every bad page access gets its own error and touches nothing: an
// unknown group, a region or entry out of range, a buffer of the wrong
// size, a write into a sealed (exported) lease or a published page, and
// any access through a released lease.
func TestLeasePageIORefusesWhatItDoesNotHold(t *testing.T) {
	cfg := tinyConfig(16)
	p := newPool(t, cfg)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 12, TokenIDs: make([]int32, 12)})
	require.NoError(t, err)
	page := make([]byte, tinyGeometry.RegionPageBytes())
	before := state(p)
	for _, tc := range []struct {
		name string
		err  error
		do   func() error
	}{
		{"unknown group", ErrInvalidArgument, func() error { return l.WritePage("nope", 0, 0, page) }},
		{"region past the group", ErrInvalidArgument, func() error { return l.WritePage("kv", 0, 4, page) }},
		{"negative region", ErrInvalidArgument, func() error { return l.ReadPage("kv", 0, -1, page) }},
		{"entry past the table", ErrInvalidArgument, func() error { return l.WritePage("kv", 3, 0, page) }},
		{"negative entry", ErrInvalidArgument, func() error { return l.ReadPage("kv", -1, 0, page) }},
		{"short buffer", ErrInvalidArgument, func() error { return l.WritePage("kv", 0, 0, page[:8]) }},
		{"long buffer", ErrInvalidArgument, func() error { return l.ReadPage("kv", 0, 0, append(page, 0)) }},
	} {
		require.ErrorIs(t, tc.do(), tc.err, tc.name)
		assert.Equal(t, before, state(p), tc.name)
	}
	// A published page is immutable: the prefix cache shares it.
	require.NoError(t, l.Commit(12))
	_, err = l.CachePrefix(8)
	require.NoError(t, err)
	require.ErrorIs(t, l.WritePage("kv", 1, 0, page), ErrInvalidArgument)
	require.NoError(t, l.WritePage("kv", 2, 0, page), "the page past the published ones takes writes")
	require.NoError(t, l.ReadPage("kv", 0, 0, page), "a published page still reads")
	// An exported lease takes no writes.
	require.NoError(t, l.BeginPrefill())
	require.NoError(t, l.FinishPrefill())
	o, err := l.Export(time.Now().Add(time.Minute))
	require.NoError(t, err)
	require.ErrorIs(t, l.WritePage("kv", 2, 0, page), ErrLeasePhase)
	require.NoError(t, l.ReadPage("kv", 2, 0, page))
	require.NoError(t, o.Abort())
	require.ErrorIs(t, l.ReadPage("kv", 0, 0, page), ErrLeaseReleased)
	var nilLease *Lease
	require.ErrorIs(t, nilLease.WritePage("kv", 0, 0, page), ErrInvalidArgument)
	require.NoError(t, p.Check())
}

// AuditFreePages finds a free page that holds anything but its fill, in
// any group, and names it; on a clean pool it reads every free page.
func TestAuditFreePagesCatchesADirtyFreePage(t *testing.T) {
	cfg := hybridConfig(32, 2)
	cfg.Scrub = ScrubPolicy{Kind: ScrubPoison}
	p := newPool(t, cfg)
	h := hostOf(t, p)
	l := admit(t, p, "r", "a", 8)
	require.NoError(t, l.Release())
	n, err := p.AuditFreePages()
	require.NoError(t, err)
	total := 0
	for _, g := range p.Stats().Groups {
		total += g.Free
	}
	assert.Equal(t, total, n, "every free page of every group is read")

	// A stray write into a free state slot.
	g := &p.groups[2]
	p.mu.Lock()
	free := g.alloc.PeekFree(nil, 1)[0]
	p.mu.Unlock()
	h.PageBytes(g.first+1, free)[12] ^= 0x5a
	before := state(p)
	_, err = p.AuditFreePages()
	require.ErrorIs(t, err, ErrCanaryMismatch)
	var ce *isolation.CanaryError
	require.True(t, errors.As(err, &ce))
	assert.Equal(t, free, ce.Page)
	assert.Equal(t, g.first+1, ce.Region)
	assert.Equal(t, int64(12), ce.Offset)
	assert.Contains(t, err.Error(), `cache group "state"`)
	assert.Equal(t, before, state(p), "an audit changes nothing")
}

// FillLatencyBounds hands out a copy: nobody can move the buckets.
func TestFillLatencyBoundsIsACopy(t *testing.T) {
	b := FillLatencyBounds()
	require.NotEmpty(t, b)
	b[0] = time.Hour
	assert.Equal(t, time.Microsecond, FillLatencyBounds()[0])
}
