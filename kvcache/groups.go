package kvcache

import (
	"errors"
	"fmt"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

// This file is a pool's cache groups beyond the per-token one: sliding
// windows and state slots (see CacheSpec). Each is a page space of its
// own, with its own allocator and its own tenant books, taken all or
// nothing with the per-token pages at admission (attemptLocked calls
// decideSideLocked, then takeSideLocked), given back with them at the end
// of the lease (detachLocked calls releaseSideLocked) and scrubbed in the
// same fill (scrub, as quarantine spaces 1, 2, …).
//
// What a lease holds in such a group is fixed for its life: one slot of
// a state group; a ring of min(window pages + 1, pages of its tokens) of
// a sliding-window group. So the groups never grow, are never shared or
// cached, and have nothing to evict.

// sideGroup is a sliding-window or state group of a pool.
type sideGroup struct {
	groupLayout
	pages int // N_g, pages (slots) in the group
	space int // its quarantine space (1 + index)
	// alloc numbers the group's pages; tenants mirrors the pool's tenants
	// at their share of this group (shareOf). Both guarded by Pool.mu.
	alloc   *allocator.Allocator
	tenants *isolation.Registry
}

// sideHold is what a lease holds in one side group.
type sideHold struct {
	handles []allocator.Handle
	// ring is the pages in ring order: logical page i of the request (its
	// tokens [i·tpp, (i+1)·tpp)) is ring[i mod len(ring)]. A state
	// group's ring is its one slot.
	ring []int32
	// first is a window's oldest logical page still in the window:
	// SlideWindows scrubbed the ring pages of every page before it.
	first int
	dec   isolation.Decision // scratch of the admission in progress
}

// shareOf is n pages of the per-token group as the same share of group
// g, rounded up (see CacheSpec: quotas and reservations are shares).
func (p *Pool) shareOf(g *sideGroup, n int) int {
	return int(min((int64(n)*int64(g.pages)+int64(p.total)-1)/int64(p.total), int64(g.pages)))
}

// mirrorConfig is tenant c (with its quota resolved against the pool) as
// group g's registry holds it.
func (p *Pool) mirrorConfig(g *sideGroup, c TenantConfig) TenantConfig {
	quota := c.QuotaPages
	if quota == 0 || quota > p.total {
		quota = p.total
	}
	return TenantConfig{Name: c.Name, QuotaPages: p.shareOf(g, quota), ReservedPages: p.shareOf(g, c.ReservedPages)}
}

// checkTenantLocked returns the error adding (or updating) tenant c would
// meet in any group, changing nothing.
func (p *Pool) checkTenantLocked(c TenantConfig, update bool) error {
	p.assertHeld()
	check := (*isolation.Registry).CheckAdd
	if update {
		check = (*isolation.Registry).CheckUpdate
	}
	if err := check(p.mu.tenants, c); err != nil {
		return err
	}
	for _, g := range p.side {
		if err := check(g.tenants, p.mirrorConfig(g, c)); err != nil {
			return fmt.Errorf("in cache group %q: %w", g.name, err)
		}
	}
	return nil
}

// addTenantLocked registers c in every group, or in none.
func (p *Pool) addTenantLocked(c TenantConfig) (*isolation.Tenant, error) {
	p.assertHeld()
	if err := p.checkTenantLocked(c, false); err != nil {
		return nil, err
	}
	t, err := p.mu.tenants.Add(c)
	if err != nil {
		panic(fmt.Sprintf("kvcache: tenant %q checked, then refused: %v", c.Name, err))
	}
	for _, g := range p.side {
		if _, err := g.tenants.Add(p.mirrorConfig(g, c)); err != nil {
			panic(fmt.Sprintf("kvcache: tenant %q checked, then refused in group %q: %v", c.Name, g.name, err))
		}
	}
	return t, nil
}

// updateTenantLocked updates c in every group, or in none.
func (p *Pool) updateTenantLocked(c TenantConfig) error {
	p.assertHeld()
	if err := p.checkTenantLocked(c, true); err != nil {
		return err
	}
	if err := p.mu.tenants.Update(c); err != nil {
		panic(fmt.Sprintf("kvcache: tenant %q update checked, then refused: %v", c.Name, err))
	}
	for _, g := range p.side {
		if err := g.tenants.Update(p.mirrorConfig(g, c)); err != nil {
			panic(fmt.Sprintf("kvcache: tenant %q update checked, then refused in group %q: %v", c.Name, g.name, err))
		}
	}
	return nil
}

// mirror is t's record in group g.
func (g *sideGroup) mirror(t *isolation.Tenant) *isolation.Tenant {
	return g.tenants.Tenants()[t.ID-1]
}

// decideSideLocked decides an admission's share of every side group, all
// before anything is taken: ok means every group grants (the decisions
// are in l.side[i].dec, the pages verified under the canary policy);
// otherwise st is the refusal or the wait.
func (p *Pool) decideSideLocked(a *admission, t *isolation.Tenant) (st step, ok bool) {
	p.assertHeld()
	l := a.l
	if len(l.side) != len(p.side) {
		l.side = make([]sideHold, len(p.side))
	}
	tokens := a.req.Tokens()
	queued := p.queuedAheadLocked(a)
	for i, g := range p.side {
		need := g.group.perLease(tokens)
		mt := g.mirror(t)
		inService := g.pages - g.alloc.Count(allocator.Retired)
		free := g.alloc.Count(allocator.Free)
		switch {
		case need > inService:
			return p.refuseLocked(a, &AdmissionError{Err: ErrExceedsCapacity, Group: g.name, GroupKind: g.kind, Need: need, Have: free, Limit: inService}), false
		case need > mt.Quota:
			return p.refuseLocked(a, &AdmissionError{Err: ErrExceedsQuota, Group: g.name, GroupKind: g.kind, Need: need, Have: max(0, mt.Quota-mt.Used), Limit: mt.Quota}), false
		}
		dec := g.tenants.Decide(mt, isolation.Demand{Charge: need, Take: need},
			isolation.Supply{Pages: free, InService: inService, Queued: queued})
		if dec.Verdict != isolation.Grant {
			p.releaseClaimLocked(a)
			return p.blockedGroupLocked(a, t, dec, g.name, g.kind, inService), false
		}
		l.side[i].dec = dec
	}
	if p.q.NeedsVerify() {
		for i, g := range p.side {
			peek := g.alloc.PeekFree(l.scrub.pages[:0], l.side[i].dec.Demand.Take)
			l.scrub.pages = peek[:0]
			if retired, err := p.q.VerifySpaceLocked(g.space, peek); err != nil {
				p.faultedLocked()
				p.logCanaryLocked(retired, err)
				return p.refuseLocked(a, &AdmissionError{Err: ErrPoolFaulted, Group: g.name, GroupKind: g.kind, Cause: err}), false
			}
		}
	}
	return stepDone, true
}

// takeSideLocked applies the decisions of decideSideLocked and gives l its
// pages in every side group. Nothing can fail.
func (p *Pool) takeSideLocked(l *Lease, t *isolation.Tenant) {
	p.assertHeld()
	for i, g := range p.side {
		h := &l.side[i]
		g.tenants.Apply(g.mirror(t), h.dec)
		var err error
		h.handles, err = g.alloc.Alloc(h.handles[:0], h.dec.Demand.Take, t.Domain.ID)
		if err != nil {
			panic(fmt.Sprintf("kvcache: %d pages of group %q granted and free, but the allocator refused: %v", h.dec.Demand.Take, g.name, err))
		}
		h.ring = h.ring[:0]
		for _, hd := range h.handles {
			h.ring = append(h.ring, hd.Page)
		}
		h.first = 0
	}
}

// releaseSideLocked gives back everything l holds in the side groups:
// its pages into quarantine (appended to b.side, which the caller
// scrubs), its tenant uncharged.
func (p *Pool) releaseSideLocked(l *Lease, b scrubBatch) scrubBatch {
	p.assertHeld()
	if len(b.side) != len(p.side) {
		b.side = make([][]int32, len(p.side))
		b.all = make([][]int32, 0, 1+len(p.side))
	}
	for i, g := range p.side {
		h := &l.side[i]
		if len(h.handles) == 0 {
			continue
		}
		before := len(b.side[i])
		var err error
		b.side[i], err = g.alloc.Release(b.side[i], h.handles, l.domain.ID)
		if err != nil {
			panic(fmt.Sprintf("kvcache: releasing lease %q's pages of group %q: %v", l.id, g.name, err))
		}
		g.tenants.Uncharge(g.mirror(l.tenant), len(h.handles))
		p.q.BeginSpaceLocked(g.space, len(b.side[i])-before)
		h.handles, h.ring = h.handles[:0], h.ring[:0]
	}
	return b
}

// checkSideLocked checks every side group's books against its allocator
// and the leases (part of Check).
func (p *Pool) checkSideLocked(c *checker) {
	p.assertHeld()
	for i, g := range p.side {
		c.add(g.alloc.Check())
		_, err := g.tenants.Check()
		c.add(err)
		held := 0
		charged := make(map[int]int) // tenant index → pages
		for id, l := range p.mu.leases {
			if len(l.side) != len(p.side) {
				c.failf("lease %q holds %d side groups, the pool has %d", id, len(l.side), len(p.side))
				continue
			}
			h := l.side[i]
			want := g.group.perLease(l.prompt + l.maxNew)
			if len(h.handles) != want || len(h.ring) != want {
				c.failf("lease %q holds %d pages (%d in its ring) of group %q, its request needs %d", id, len(h.handles), len(h.ring), g.name, want)
			}
			if first := max(0, l.Written()-g.window) / max(1, g.tpp); h.first < 0 || h.first > first ||
				(g.kind != GroupSlidingWindow && h.first != 0) {
				c.failf("lease %q: its window of group %q starts at page %d; %d tokens written let it start at page %d at most",
					id, g.name, h.first, l.Written(), first)
			}
			for j, hd := range h.handles {
				info, err := g.alloc.Info(hd.Page)
				if err != nil {
					c.add(err)
					continue
				}
				if info.State != allocator.InUse || info.Owner != l.domain.ID || info.Gen != hd.Gen || info.Refs != 1 ||
					j >= len(h.ring) || h.ring[j] != hd.Page {
					c.failf("lease %q page %d of group %q: %+v, want held once by domain %q at generation %d", id, hd.Page, g.name, info, l.domain.Name, hd.Gen)
				}
			}
			held += len(h.handles)
			charged[int(l.tenant.ID)-1] += len(h.handles)
		}
		if n := g.alloc.Count(allocator.InUse); n != held {
			c.failf("group %q has %d pages in use, live leases hold %d", g.name, n, held)
		}
		if n := g.alloc.Count(allocator.Cached); n != 0 {
			c.failf("group %q has %d cached pages: nothing caches them", g.name, n)
		}
		for ti, mt := range g.tenants.Tenants() {
			if mt.Used != charged[ti] {
				c.failf("tenant %q charged %d pages of group %q, holds %d", mt.Name, mt.Used, g.name, charged[ti])
			}
		}
		if n, m := len(g.tenants.Tenants()), len(p.mu.tenants.Tenants()); n != m {
			c.failf("group %q has %d tenants, the pool %d", g.name, n, m)
		}
	}
}

// GroupStats are one cache group's figures.
type GroupStats struct {
	Name string
	Kind GroupKind
	// Pages is the group's size in pages (slots for a state group);
	// PageBytes one page over all the group's regions.
	Pages       int
	PageBytes   int64
	Free        int
	InUse       int
	Cached      int
	Quarantined int
	Retired     int
}

func groupStats(name string, kind GroupKind, pages int, pageBytes int64, a *allocator.Allocator) GroupStats {
	return GroupStats{Name: name, Kind: kind, Pages: pages, PageBytes: pageBytes,
		Free: a.Count(allocator.Free), InUse: a.Count(allocator.InUse), Cached: a.Count(allocator.Cached),
		Quarantined: a.Count(allocator.Quarantined), Retired: a.Count(allocator.Retired)}
}

// groupStatsLocked is every group's figures, the per-token group first.
func (p *Pool) groupStatsLocked() []GroupStats {
	p.assertHeld()
	gs := []GroupStats{groupStats(p.lay.primary.name, GroupPerToken, p.total, p.lay.primary.pageBytes, p.mu.alloc)}
	for _, g := range p.side {
		gs = append(gs, groupStats(g.name, g.kind, g.pages, g.pageBytes, g.alloc))
	}
	return gs
}

// groupIndex finds side group name; -1 for the per-token group.
func (p *Pool) groupIndex(name string) (int, error) {
	if name == p.lay.primary.name {
		return -1, nil
	}
	for i, g := range p.side {
		if g.name == name {
			return i, nil
		}
	}
	return 0, fmt.Errorf("%w: no cache group %q", ErrInvalidArgument, name)
}

// GroupTable appends to dst the pages (slots) the lease holds in cache
// group name, and returns the logical page the first of them holds:
//
//   - the per-token group: the block table, first = 0;
//   - a sliding-window group: the ring in logical order, from the oldest
//     page still in the window (first) on: entry i holds the request's
//     tokens [(first+i)·TokensPerPage, (first+i+1)·TokensPerPage);
//   - a state group: the lease's one slot, first = 0.
func (l *Lease) GroupTable(name string, dst []int32) (first int, table []int32, err error) {
	if err := l.live(); err != nil {
		return 0, dst, err
	}
	p := l.pool
	gi, err := p.groupIndex(name)
	if err != nil {
		return 0, dst, err
	}
	if gi < 0 {
		return 0, append(dst, l.tableView()...), nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if l.state.Load() != leaseLive {
		return 0, dst, ErrLeaseReleased
	}
	h := l.side[gi]
	if len(h.ring) == 0 {
		return h.first, dst, nil
	}
	for i := range h.ring {
		dst = append(dst, h.ring[(h.first+i)%len(h.ring)])
	}
	return h.first, dst, nil
}

// SlideWindows moves the lease's sliding windows to its written
// watermark (Commit): in every sliding-window group, the pages whose
// tokens all lie before Written() − WindowTokens leave the window, are
// filled with the pool's scrub pattern, and become the ring pages of the
// next tokens. The fill is ordered after the engine work named by after
// and completes before SlideWindows returns (on CUDA it waits for that
// work: name work that is done, or the stream the next step runs on, and
// do not write the ring's new pages before SlideWindows returns). It
// returns the pages scrubbed. A fill that fails faults the pool
// (ErrPoolFaulted), as a failed release does.
func (l *Lease) SlideWindows(after cudaops.Ordering) (int, error) {
	if err := l.live(); err != nil {
		return 0, err
	}
	p := l.pool
	if err := p.checkOrdering(after); err != nil {
		return 0, err
	}
	p.mu.Lock()
	if err := p.stateErrLocked(); err != nil {
		p.mu.Unlock()
		return 0, err
	}
	if l.state.Load() != leaseLive {
		p.mu.Unlock()
		return 0, ErrLeaseReleased
	}
	if l.draining {
		p.mu.Unlock()
		return 0, fmt.Errorf("%w: lease %q is ending", ErrLeasePhase, l.id)
	}
	written := l.Written()
	batches := make([][]int32, 1+len(p.side))
	n := 0
	for i, g := range p.side {
		h := &l.side[i]
		if g.kind != GroupSlidingWindow || len(h.ring) == 0 {
			continue
		}
		first := max(0, (written-g.window)/g.tpp)
		for lp := h.first; lp < first && lp < h.first+len(h.ring); lp++ {
			batches[g.space] = append(batches[g.space], h.ring[lp%len(h.ring)])
			n++
		}
		h.first = max(h.first, first)
	}
	if n == 0 {
		p.mu.Unlock()
		return 0, nil
	}
	// The pages stay the lease's: pinned like a page copy, so that no end
	// of the lease releases them while they are filled.
	l.pins++
	p.mu.pins++
	p.mu.Unlock()
	fence, err := p.q.IssueSpaces(batches, after)
	if errors.Is(err, cudaops.ErrBadOrdering) && !after.IsZero() {
		// Gone bad since checkOrdering: the engine's mistake, not a
		// failed fill (see scrub). Wait for all the engine's work instead.
		fence, err = p.q.IssueSpaces(batches, cudaops.Ordering{})
	}
	if err == nil {
		err = fence.Wait()
	}
	p.unpin(l)
	if err != nil {
		p.mu.Lock()
		p.q.RecordFaultLocked(fmt.Errorf("%w: scrubbing %d pages that slid out of lease %q's windows: %w", ErrScrubFailed, n, l.id, err))
		p.faultedLocked()
		p.mu.Unlock()
		return 0, fmt.Errorf("%w: %w", ErrPoolFaulted, err)
	}
	return n, nil
}
