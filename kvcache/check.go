package kvcache

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/internal/invariants"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// Check verifies the pool's accounting and returns every inconsistency it
// finds, joined (errors.Join), each wrapping ErrCorrupt; nil when the
// books are sound. It checks the allocator's invariants, the registry's,
// the quarantine's and the prefix index's own, and then that they agree:
//
//   - every page of a live lease is in use by the lease's domain at the
//     lease's generation, and its block table, as its lock-free readers
//     see it too, matches its handles; only its first published pages
//     (hits and what it published) are in the prefix index, which is all
//     its release looks up;
//   - a live lease's written watermark is within its request and its
//     capacity, its pages are sealed exactly while it is exported or
//     imported, and each sliding window starts no later than the
//     watermark lets it (SlideWindows);
//   - each page's refcount is the number of live leases holding it, and a
//     page without an index entry is held by at most one;
//   - each entry's per-tenant counts are its leases' tenants, and each
//     tenant is charged once per page it holds;
//   - every indexed page is owned by its entry's domain and is Cached
//     exactly when it is on the LRU list; every Cached page has an entry;
//   - the pages promised to admissions (claims) are free or being
//     scrubbed for them, the page copies in flight are the live leases'
//     pins, and the waiting queue is well formed;
//   - the host tier's slots add up (free + cached + in flight +
//     quarantined + retired = its slots), each held by one item, and
//     every entry it holds is indexed like those the device holds (see
//     tier.go).
//
// Check is O(pages + leases' pages).
func (p *Pool) Check() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.checkLocked()
}

// assertLocked runs checkLocked after a state change when expensive
// self-checks are on (build tag invariants, or -race) and panics with what
// it found: a broken invariant is a kvfence bug that no caller can handle.
func (p *Pool) assertLocked(after string) {
	if !invariants.Enabled {
		return
	}
	if err := p.checkLocked(); err != nil {
		panic(fmt.Sprintf("kvcache: invariant broken after %s: %v", after, err))
	}
}

// maxProblems bounds what one Check reports: past it, the rest is counted.
const maxProblems = 32

// checker collects a Check's problems.
type checker struct {
	errs []error
	more int
}

func (c *checker) add(err error) {
	if err == nil {
		return
	}
	if len(c.errs) == maxProblems {
		c.more++
		return
	}
	if !errors.Is(err, ErrCorrupt) {
		err = fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	c.errs = append(c.errs, err)
}

func (c *checker) failf(format string, args ...any) {
	if len(c.errs) == maxProblems {
		c.more++
		return
	}
	c.errs = append(c.errs, fmt.Errorf("%w: "+format, append([]any{ErrCorrupt}, args...)...))
}

func (c *checker) err() error {
	if c.more > 0 {
		c.errs = append(c.errs, fmt.Errorf("%w: and %d more problems", ErrCorrupt, c.more))
	}
	return errors.Join(c.errs...)
}

func (p *Pool) checkLocked() error {
	p.assertHeld()
	var c checker
	c.add(p.q.CheckLocked())
	p.mu.prefix.check(&c, p.tierOnlyLocked())
	p.checkTierLocked(&c)
	p.checkLeasesLocked(&c)
	// Each unit's holders: the live leases, and the state checkpoints.
	refs := make([][]int, len(p.groups))
	for gi := range p.groups {
		refs[gi] = make([]int, p.groups[gi].pages)
	}
	p.checkCheckpointsLocked(&c, refs)
	for gi := range p.groups {
		p.checkGroupLocked(&c, gi, refs[gi])
	}
	p.checkAdmissionsLocked(&c)
	p.checkMatchesLocked(&c)
	return c.err()
}

// checkMatchesLocked checks the prefix matches that leases hold between
// attempts (admitted leases, and admissions waiting in the queue): a
// match still valid at the index's epoch, which an attempt would use as
// it is, holds only entries in the index, never a spare one (see
// prefixIndex.recycle). A waiting growth's or checkpoint's lease is live
// and checked in the lease table, or it has ended and may be in the
// middle of its next admission, which resets the match outside Pool.mu:
// it is skipped.
func (p *Pool) checkMatchesLocked(c *checker) {
	p.assertHeld()
	x := &p.mu.prefix
	check := func(l *Lease) {
		m := &l.match
		if !m.valid || m.epoch != x.epoch {
			return
		}
		for i, e := range m.entries {
			if e.spare || e.detached || !e.matchable() || e.page >= 0 && (int(e.page) >= len(x.byPage) || x.byPage[e.page] != e) ||
				e.page < 0 && e.tier.entry != e {
				c.failf("lease %q: entry %d of its current prefix match is not in the index (spare %v)", l.id, i, e.spare)
				return
			}
		}
	}
	for _, l := range p.mu.leases {
		check(l)
	}
	for w := p.mu.waiters.head; w != nil; w = w.next {
		if !w.growth && !w.checkpoint {
			check(w.lease)
		}
	}
}

// checkLeasesLocked checks the lease table, the pins of page copies in
// flight, and what each live lease says of itself.
func (p *Pool) checkLeasesLocked(c *checker) {
	p.assertHeld()
	pins := 0
	for id, l := range p.mu.leases {
		if l.id != id || l.state.Load() != leaseLive {
			c.failf("lease table entry %q holds lease %q in state %d", id, l.id, l.state.Load())
			continue
		}
		pins += l.pins
		if len(l.holds) != len(p.groups) {
			c.failf("lease %q holds pages in %d cache groups, the pool has %d", id, len(l.holds), len(p.groups))
			continue
		}
		p.checkLeaseLocked(c, l)
	}
	if pins != p.mu.pins {
		c.failf("%d page copies in flight, the live leases hold %d pins", p.mu.pins, pins)
	}
}

// checkGroupLocked checks cache group gi's books against its allocator,
// the leases and the prefix index (see Check): every page a lease holds
// is in use by its domain at its generation, each page's refcount is the
// number of live leases holding it, and each tenant is charged once per
// page it holds. Only the per-token group's pages can be in the prefix
// index; in every other group each page is held by one lease or state
// checkpoint at most and none is cached, and a lease holds what its
// request needs there. refs holds the checkpoints' references already.
func (p *Pool) checkGroupLocked(c *checker, gi int, refs []int) {
	p.assertHeld()
	g, x := &p.groups[gi], &p.mu.prefix
	a := g.alloc
	c.add(a.Check())
	_, err := g.tenants.Check()
	c.add(err)
	if n, m := len(g.tenants.Tenants()), len(p.tenantsLocked().Tenants()); n != m {
		c.failf("group %q has %d tenants, the pool %d", g.name, n, m)
		return
	}
	var byPage []*cacheEntry // the index's entries by page: the per-token group's
	if gi == 0 {
		byPage = x.byPage
		if lru, pinned := x.lruLen, p.mu.ckpts.pinnedCached; lru+pinned != a.Count(allocator.Cached) {
			c.failf("LRU list holds %d pages and checkpoints pin %d more, the allocator has %d cached", lru, pinned, a.Count(allocator.Cached))
		}
	}
	charged := make(map[*tenancy.Tenant]int) // by the pool's tenant
	type tenantPage struct {
		t    *tenancy.Tenant
		page int32
	}
	entryRefs := make(map[tenantPage]int)
	for id, l := range p.mu.leases {
		if l.id != id || l.state.Load() != leaseLive || len(l.holds) != len(p.groups) {
			continue // reported by checkLeasesLocked
		}
		h := &l.holds[gi]
		if len(h.pages) != len(h.handles) {
			c.failf("lease %q has %d handles, %d pages in group %q", id, len(h.handles), len(h.pages), g.name)
			continue
		}
		if g.kind != GroupPerToken {
			if want := g.group.perLease(l.prompt + l.maxNew); len(h.handles) != want {
				c.failf("lease %q holds %d pages of group %q, its request needs %d", id, len(h.handles), g.name, want)
			}
		}
		if first := max(0, l.Written()-g.window) / max(1, g.tpp); h.first < 0 || h.first > first ||
			(g.kind != GroupSlidingWindow && h.first != 0) {
			c.failf("lease %q: its window of group %q starts at page %d; %d tokens written let it start at page %d at most",
				id, g.name, h.first, l.Written(), first)
		}
		for i, hd := range h.handles {
			info, err := a.Info(hd.Page)
			if err != nil {
				c.add(err)
				continue
			}
			if info.State != allocator.InUse || info.Owner != l.domain.ID || info.Gen != hd.Gen || h.pages[i] != hd.Page {
				c.failf("lease %q page %d of group %q: %+v, want in use by domain %q at generation %d", id, hd.Page, g.name, info, l.domain.Name, hd.Gen)
			}
			refs[hd.Page]++
			var e *cacheEntry
			if byPage != nil {
				e = byPage[hd.Page]
			}
			if e != nil && i >= l.published {
				// releasePagesLocked looks pages up in the index only up to
				// published: this one would be released as private.
				c.failf("lease %q page %d (its %dth) is in the prefix index, past the %d pages it published or shared", id, hd.Page, i, l.published)
			}
			if e == nil {
				charged[l.tenant]++
			} else if entryRefs[tenantPage{l.tenant, hd.Page}]++; entryRefs[tenantPage{l.tenant, hd.Page}] == 1 {
				charged[l.tenant]++
			}
		}
	}
	for page := range int32(g.pages) {
		info, _ := a.Info(page)
		if info.Refs != refs[page] {
			c.failf("page %d of group %q has %d references, %d live leases and checkpoints hold it", page, g.name, info.Refs, refs[page])
		}
		var e *cacheEntry
		if byPage != nil {
			e = byPage[page]
		}
		if e == nil {
			if info.State == allocator.Cached {
				c.failf("page %d of group %q is cached without an index entry", page, g.name)
			}
			if refs[page] > 1 {
				c.failf("unpublished page %d of group %q held by %d leases", page, g.name, refs[page])
			}
			continue
		}
		if info.Owner != e.dom.ID {
			c.failf("index entry of page %d is in domain %q, page owner is %d", page, e.dom.Name, info.Owner)
		}
		switch {
		case info.State == allocator.Cached && !e.inLRU && e.pins == 0,
			info.State == allocator.InUse && e.inLRU,
			info.State != allocator.Cached && info.State != allocator.InUse,
			e.detached && info.State != allocator.InUse:
			c.failf("indexed page %d is %s (LRU %v, detached %v)", page, info.State, e.inLRU, e.detached)
		}
		total := 0
		for _, r := range e.tenants {
			if r.refs <= 0 || entryRefs[tenantPage{r.t, page}] != r.refs {
				c.failf("page %d counts %d leases of tenant %q, %d hold it", page, r.refs, r.t.Name, entryRefs[tenantPage{r.t, page}])
			}
			total += r.refs
		}
		if total != refs[page] || e.leases != refs[page] {
			c.failf("page %d: tenant counts sum to %d, entry counts %d leases, %d hold it", page, total, e.leases, refs[page])
		}
	}
	for _, t := range p.tenantsLocked().Tenants() {
		if mt := g.mirror(t); mt.Used != charged[t] {
			c.failf("tenant %q charged %d pages of group %q, holds %d", t.Name, mt.Used, g.name, charged[t])
		}
	}
}

// checkLeaseLocked checks what live lease l says of itself: the block
// table its readers see, its written watermark and seal, and how much of
// it is shared or published.
func (p *Pool) checkLeaseLocked(c *checker, l *Lease) {
	p.assertHeld()
	table := l.holds[0].pages
	if v := l.tableView(); !slices.Equal(v, table) {
		c.failf("lease %q: the block table its readers see holds %d pages, not its %d", l.id, len(v), len(table))
	}
	written, sealed := l.Written(), l.written.Load()&writeSealed != 0
	if limit := min(l.prompt+l.maxNew, len(table)*p.tpp); written < 0 || written > limit {
		c.failf("lease %q: written watermark %d, outside the %d tokens it may hold", l.id, written, limit)
	}
	if ph := Phase(l.phase.Load()); sealed != (ph == PhaseExported || ph == PhaseImporting) {
		c.failf("lease %q is %v, and its pages sealed is %v", l.id, ph, sealed)
	}
	if l.hitPages < 0 || l.hitPages > l.published || l.published > len(l.holds[0].handles) {
		c.failf("lease %q shares %d hits and has published %d of its %d pages", l.id, l.hitPages, l.published, len(l.holds[0].handles))
	}
}

// checkAdmissionsLocked checks the claims of admissions in progress and
// the waiting queue.
func (p *Pool) checkAdmissionsLocked(c *checker) {
	p.assertHeld()
	for gi := range p.groups {
		g := &p.groups[gi]
		free, quarantined := g.alloc.Count(allocator.Free), g.alloc.Count(allocator.Quarantined)
		switch {
		case g.claimed < 0 || g.evicting < 0 || g.evicting > quarantined:
			c.failf("group %q: %d pages claimed, %d being evicted for claims, %d quarantined", g.name, g.claimed, g.evicting, quarantined)
		case g.claimed > free+g.evicting:
			c.failf("group %q: %d pages claimed, only %d free and %d on their way", g.name, g.claimed, free, g.evicting)
		}
	}
	if p.mu.admitting < 0 {
		c.failf("%d admissions in progress", p.mu.admitting)
	}
	n, pool := 0, 0
	var prev *waiter
	for w := p.mu.waiters.head; w != nil; w = w.next {
		if n++; n > p.mu.waiters.len || !w.queued || w.prev != prev || w.lease == nil {
			c.failf("waiting queue broken at position %d", n)
			return
		}
		if w.reason == waitPool {
			pool++
		}
		prev = w
	}
	if n != p.mu.waiters.len || p.mu.waiters.tail != prev || pool != p.mu.poolWaiters {
		c.failf("waiting queue holds %d admissions (%d for pages), counters say %d (%d)", n, pool, p.mu.waiters.len, p.mu.poolWaiters)
	}
}
