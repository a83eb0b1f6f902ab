package kvcache

import (
	"errors"
	"fmt"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// This file is a pool's cache groups (see CacheSpec) as the pool runs
// them. Every group is an ordinary group: a page space with its own
// allocator, its own tenant books and its own quarantine space, and a
// lease holds pages (slots) in each. What differs between kinds is how
// much a lease needs, never the code that takes, releases, scrubs or
// checks it:
//
//	kind            a lease of T tokens holds             grows  cached
//	per-token (0)   ceil(T / TokensPerPage) pages          yes    prefix cache
//	sliding window  min(ring, ceil(T / TokensPerPage))    no     no
//	state           1 slot                                no     no
//
// Admission decides every group in one attempt (attemptLocked: the
// permanent refusals of each group, then isolation.Decide for each, then
// the claims), takes them all (takeLocked), or takes none. The end of a
// lease releases every group's pages into one scrub batch
// (releaseGroupLocked), which the quarantine fills with one device
// operation. Check covers every group the same way.
//
// The per-token group is group 0. It alone sizes admission in tokens,
// grows (grow.go) and is shared by the prefix cache (prefix.go): only its
// leading pages can be published, so only group 0's books ever hold
// shared or cached pages. The other groups' pages are each held by one
// lease.

// group is one cache group of a pool.
type group struct {
	groupLayout
	index int // in Pool.groups, and its quarantine space
	pages int // N_g: pages (slots) in the group
	// alloc numbers the group's pages; tenants are the pool's tenants at
	// their share of this group (shareOf; group 0's are the pool's own
	// books, where the sharing domains are). Both are set once in New
	// and guarded by Pool.mu.
	alloc   *allocator.Allocator
	tenants *tenancy.Registry
	// claimed and evicting are the group's pages promised to granted
	// admissions and growths, and the pages evicted for them whose fill
	// has not finished (see admission.claims); guarded by Pool.mu.
	// claimed ≤ free + evicting: every promised page is free or on its
	// way.
	claimed, evicting int
}

// hold is what a lease holds in one cache group.
type hold struct {
	handles []allocator.Handle
	// pages are the handles' pages in the group's order: the block table
	// of the per-token group (page i holds tokens [i·tpp, (i+1)·tpp)); a
	// window's ring, where logical page i is pages[i mod len(pages)]; a
	// state group's one slot.
	pages []int32
	// first is a window's oldest logical page still in the window:
	// SlideWindows scrubbed the ring pages of every page before it.
	first int
	dec   isolation.Decision // scratch of the admission in progress
}

// need is the pages (slots) a lease whose request holds tokens tokens
// takes in g at admission, given tokenPages, the per-token pages its
// sizing reserves.
func (g *group) need(tokenPages, tokens int) int {
	if g.kind == GroupPerToken {
		return tokenPages
	}
	return g.group.perLease(tokens)
}

// inServiceLocked is the group's pages that are not retired.
func (g *group) inServiceLocked() int { return g.pages - g.alloc.Count(allocator.Retired) }

// mirror is t's record in g's books.
func (g *group) mirror(t *tenancy.Tenant) *tenancy.Tenant { return g.tenants.Tenants()[t.ID-1] }

// shareOf is n pages of the per-token group as the same share of group
// g, rounded up (see CacheSpec: quotas and reservations are shares); n
// itself in the per-token group.
func (p *Pool) shareOf(g *group, n int) int {
	return int(min((int64(n)*int64(g.pages)+int64(p.total)-1)/int64(p.total), int64(g.pages)))
}

// mirrorConfig is tenant c (with its quota resolved against the pool) as
// group g's books hold it.
func (p *Pool) mirrorConfig(g *group, c TenantConfig) TenantConfig {
	quota := c.QuotaPages
	if quota == 0 || quota > p.total {
		quota = p.total
	}
	c.QuotaPages, c.ReservedPages = p.shareOf(g, quota), p.shareOf(g, c.ReservedPages)
	return c
}

// tenantsLocked is the pool's tenant books: group 0's, where tenants are
// looked up and their sharing domains kept.
func (p *Pool) tenantsLocked() *tenancy.Registry {
	p.assertHeld()
	return p.groups[0].tenants
}

// checkTenantLocked returns the error adding (or updating) tenant c would
// meet in any group, changing nothing.
func (p *Pool) checkTenantLocked(c TenantConfig, update bool) error {
	p.assertHeld()
	// The tenant's own numbers first: its shares of the other groups are
	// derived from them (a negative quota would round to zero there).
	if _, err := isolation.ValidateTenant(c, p.total); err != nil {
		return err
	}
	check := (*tenancy.Registry).CheckAdd
	if update {
		check = (*tenancy.Registry).CheckUpdate
	}
	for i := range p.groups {
		g := &p.groups[i]
		if err := check(g.tenants, p.mirrorConfig(g, c)); err != nil {
			if i == 0 {
				return err // the tenant's own numbers
			}
			return fmt.Errorf("in cache group %q: %w", g.name, err)
		}
	}
	return nil
}

// addTenantLocked registers c in every group, or in none.
func (p *Pool) addTenantLocked(c TenantConfig) error {
	p.assertHeld()
	if err := p.checkTenantLocked(c, false); err != nil {
		return err
	}
	for i := range p.groups {
		g := &p.groups[i]
		if _, err := g.tenants.Add(p.mirrorConfig(g, c)); err != nil {
			panic(fmt.Sprintf("kvcache: tenant %q checked, then refused in group %q: %v", c.Name, g.name, err))
		}
	}
	p.setTierPagesLocked(c)
	return nil
}

// updateTenantLocked updates c in every group, or in none.
func (p *Pool) updateTenantLocked(c TenantConfig) error {
	p.assertHeld()
	if err := p.checkTenantLocked(c, true); err != nil {
		return err
	}
	for i := range p.groups {
		g := &p.groups[i]
		if err := g.tenants.Update(p.mirrorConfig(g, c)); err != nil {
			panic(fmt.Sprintf("kvcache: tenant %q update checked, then refused in group %q: %v", c.Name, g.name, err))
		}
	}
	p.setTierPagesLocked(c)
	return nil
}

// refusalGroup is how a refusal names group g: not at all in a pool of
// one group, by name and kind otherwise.
func (p *Pool) refusalGroup(g *group) (string, GroupKind) {
	if len(p.groups) == 1 {
		return "", 0
	}
	return g.name, g.kind
}

// releaseGroupLocked gives back everything l holds in group gi: pages
// still published or shared are parked in the prefix cache or stay with
// their other holders (releasePagesLocked; only group 0's can be), the
// others go into quarantine, appended to pages, which the caller scrubs;
// the tenant is uncharged.
func (p *Pool) releaseGroupLocked(l *Lease, gi int, pages []int32) []int32 {
	p.assertHeld()
	before := len(pages)
	pages = p.releasePagesLocked(l, gi, pages)
	p.q.BeginLocked(gi, len(pages)-before)
	h := &l.holds[gi]
	h.handles, h.pages, h.first = h.handles[:0], h.pages[:0], 0
	return pages
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

// groupStatsLocked is every group's figures, the per-token group first.
func (p *Pool) groupStatsLocked() []GroupStats {
	p.assertHeld()
	gs := make([]GroupStats, len(p.groups))
	for i := range p.groups {
		g := &p.groups[i]
		a := g.alloc
		gs[i] = GroupStats{Name: g.name, Kind: g.kind, Pages: g.pages, PageBytes: g.pageBytes,
			Free: a.Count(allocator.Free), InUse: a.Count(allocator.InUse), Cached: a.Count(allocator.Cached),
			Quarantined: a.Count(allocator.Quarantined), Retired: a.Count(allocator.Retired)}
	}
	return gs
}

// groupIndex finds cache group name.
func (p *Pool) groupIndex(name string) (int, error) {
	for i := range p.groups {
		if p.groups[i].name == name {
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
	if gi == 0 {
		// The block table, which its lock-free view serves.
		return 0, append(dst, l.tableView()...), nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if l.state.Load() != leaseLive {
		return 0, dst, ErrLeaseReleased
	}
	h := &l.holds[gi]
	for i := range h.pages {
		dst = append(dst, h.pages[(h.first+i)%len(h.pages)])
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
	batches := make([][]int32, len(p.groups))
	n := 0
	for gi := range p.groups {
		g, h := &p.groups[gi], &l.holds[gi]
		if g.kind != GroupSlidingWindow || len(h.pages) == 0 {
			continue
		}
		first := max(0, (written-g.window)/g.tpp)
		for lp := h.first; lp < first && lp < h.first+len(h.pages); lp++ {
			batches[gi] = append(batches[gi], h.pages[lp%len(h.pages)])
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
	fence, err := p.q.Issue(batches, after)
	if errors.Is(err, cudaops.ErrBadOrdering) && !after.IsZero() {
		// Gone bad since checkOrdering: the engine's mistake, not a
		// failed fill (see scrub). Wait for all the engine's work instead.
		fence, err = p.q.Issue(batches, cudaops.Ordering{})
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
