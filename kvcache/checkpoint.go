package kvcache

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// State checkpoints: the prefix cache of a hybrid model.
//
// A pool with sliding-window or state groups caches a prefix only with
// the state at its end: a request's cached KV is useless without the
// recurrent state that summarises it, and the window's pages there. A
// checkpoint is that state, taken when a lease's state reflects exactly
// n tokens, n at a page boundary: for every group but the per-token one,
// the lease's units of a handoff of n tokens (units.go: a state slot;
// the window's pages inside the window at n) copied on the device into
// units the prefix cache owns (Lease.CheckpointState). It hangs off the
// cache entry of the prompt's page n/TokensPerPage − 1, in the lease's
// sharing domain, published with the pages below n.
//
// A hybrid admission's hit is the longest cached prefix whose end has a
// checkpoint, never past the page holding the last prompt token: it
// shares those pages like any hit, takes fresh units in the other groups,
// and copies the checkpoint into them (restore) before Admit returns, so
// the engine never receives a slot that holds anything but that
// checkpoint or a scrubbed slot. Matched pages past the last checkpoint
// are not shared: without the state there, they cannot be used.
//
// A checkpoint pins its prefix: the pages below it stay in the cache
// while it lives (a cache entry counts the checkpoints that need it,
// cacheEntry.pins), Cached but off the page LRU list, so that there is
// never a checkpoint whose pages are gone. Checkpoints are evicted least
// recently used (taken or restored) first: for units of their groups
// when an admission needs them, and for pages when the page LRU list is
// empty and pages are pinned (their pages then join that list). Every
// evicted checkpoint's units go through the quarantine like any freed
// page, scrubbed before reuse.
//
// Capacity is the operator's: at most Prefix.MaxCheckpoints checkpoints
// in the pool and each tenant's TenantConfig.MaxCheckpoints (0: the
// pool's, or the groups' room). A checkpoint that would pass either is
// not taken: ErrCheckpointCapacity, counted, and logged once per tenant.

// checkpoint is one state checkpoint (see above). Guarded by Pool.mu.
type checkpoint struct {
	tokens int
	// chain is the cache entries of pages [0, tokens/tpp), each pinned
	// by the checkpoint while the device holds it; the last one holds it
	// (last). In the host tier (tier set: the device evicted it) it pins
	// nothing, and chain is nil.
	chain []*cacheEntry
	last  *cacheEntry
	tier  *tierItem
	// units are its units in each group (nil for the per-token group),
	// in the order of a handoff of tokens tokens.
	units  [][]allocator.Handle
	dom    *tenancy.Domain
	tenant *tenancy.Tenant // whose capacity it counts against
	// restoring counts restores in flight from it, outside Pool.mu: its
	// units are not evicted meanwhile. copying: it is being taken (its
	// copy runs outside Pool.mu). dropped: the cache was cleared during
	// either; the last restore to end, or the copy, releases its units.
	restoring  int
	copying    bool
	dropped    bool
	prev, next *checkpoint // the LRU list, least recently used first
}

// checkpointBook is the pool's checkpoints. Guarded by Pool.mu.
type checkpointBook struct {
	lruHead, lruTail *checkpoint
	n                int
	// units[g] is the units of group g checkpoints hold; free[g] of them
	// are evictable (their checkpoint not restoring).
	units, evictable []int
	// pinnedCached is the per-token pages no lease holds that stay off
	// the LRU list because checkpoints pin them: evictable by evicting
	// checkpoints.
	pinnedCached int
	// loose is the checkpoints off the book whose units are held still:
	// being copied (not published yet), or dropped while restoring.
	loose     map[*checkpoint]struct{}
	perTenant []tenantCheckpoints // by tenant ID − 1
	stats     CheckpointStats
}

// tenantCheckpoints is one tenant's checkpoints on the book.
type tenantCheckpoints struct {
	n      int
	units  [MaxCacheGroups]int
	logged bool // a capacity skip was logged
}

// CheckpointStats are a hybrid pool's state checkpoint figures.
type CheckpointStats struct {
	Live       int    // checkpoints held now
	Restoring  int    // of them, being copied into an admitted lease now
	StateBytes int64  // device bytes they hold, every group
	Taken      uint64 // checkpoints taken
	Existing   uint64 // CheckpointState calls that found one at n already
	Hits       uint64 // admissions that restored a checkpoint
	HitTokens  uint64 // tokens those admissions shared
	// Misses counts admissions that matched cached pages past their last
	// checkpoint (or with none), MissTokens the tokens of those pages: the
	// hit lost for want of a checkpoint.
	Misses        uint64
	MissTokens    uint64
	Evicted       uint64 // checkpoints evicted (their units scrubbed)
	CapacitySkips uint64 // checkpoints not taken for lack of room (ErrCheckpointCapacity)
	RestoreNanos  uint64 // time spent copying checkpoints into admitted leases
	CopyNanos     uint64 // time spent copying leases' state into checkpoints
}

// ErrCheckpointCapacity, ErrNoStateGroup: see errors.go.

// hybrid reports whether the pool has groups beyond the per-token one,
// whose prefixes need checkpoints.
func (p *Pool) hybrid() bool { return len(p.groups) > 1 }

// CheckpointState takes a state checkpoint of the lease at n tokens: the
// engine says its state (and windows) reflect exactly the first n tokens
// (after a chunk of prefill, or at the end of a shared system prompt).
// kvfence publishes the full pages below n in the lease's sharing domain
// (as CachePrefix(n)) and copies the lease's state slot and the window
// pages at n, on the device, after the engine work named by after (the
// zero Ordering: all work of the context), into units the prefix cache
// owns; a later admission in the domain whose prompt starts with those n
// tokens, and has at least one more, shares the pages and receives the
// state. It returns when the copy has completed.
//
// n must be a positive multiple of TokensPerPage within the written
// watermark and the prompt, the lease's windows must still hold their
// pages at n (not slid, nor written past, beyond them), and the lease
// must carry its prompt's tokens or keys: else ErrInvalidArgument, and
// nothing changes. A pool without window or state groups has nothing to
// checkpoint (ErrNoStateGroup). A checkpoint at n that exists already is
// kept (nil). One the pool's or the tenant's bound would pass, or for
// which its groups have no units free or held by other checkpoints, is
// not taken (ErrCheckpointCapacity, counted and logged once per tenant).
// Least recently used checkpoints are evicted for its units, scrubbed
// first. Where only units still being scrubbed (a lease released just
// before, on a GPU) can make its room, it waits for those scrubs to end.
func (l *Lease) CheckpointState(n int, after cudaops.Ordering) error {
	if err := l.live(); err != nil {
		return err
	}
	if n > l.prompt {
		return fmt.Errorf("%w: a checkpoint at %d tokens, past lease %q's prompt of %d (Preempt checkpoints what it generated)",
			ErrInvalidArgument, n, l.id, l.prompt)
	}
	return l.checkpoint(n, after, nil)
}

// PrefillCheckpoint is where, in a pool with window or state groups, the
// engine should checkpoint the lease's prefill (CheckpointState) so that
// a later request with the same prompt reuses all it can: the last page
// boundary before the prompt's last token, the deepest a hit can reach
// (a request computes at least its last prompt token). The engine ends a
// prefill chunk there, checkpoints, and prefills the rest. It is 0 for a
// prompt within one page, and in any other pool.
func (l *Lease) PrefillCheckpoint() int {
	if l == nil || l.pool == nil || !l.pool.hybrid() || l.prompt == 0 {
		return 0
	}
	return maxHitPages(Request{PromptTokens: l.prompt}, l.pool.tpp) * l.pool.tpp
}

// checkpoint takes the checkpoint of l at n tokens (CheckpointState),
// whose tokens are tokens (nil: the prompt's, l.tokens).
func (l *Lease) checkpoint(n int, after cudaops.Ordering, tokens []int32) error {
	p := l.pool
	if !p.hybrid() {
		return fmt.Errorf("%w: the pool's only cache group is per-token: nothing to checkpoint", ErrNoStateGroup)
	}
	mover, ok := p.dev.(cudaops.PageMover)
	if !ok {
		return fmt.Errorf("%w: the pool's device (%s) cannot copy pages on the device (cudaops.PageMover)", ErrInvalidArgument, p.dev.Name())
	}
	tpp := p.tpp
	switch {
	case p.prefixDisabled:
		return fmt.Errorf("%w: the pool's prefix cache is disabled", ErrInvalidArgument)
	case n < tpp || n%tpp != 0:
		return fmt.Errorf("%w: a checkpoint at %d tokens: not a positive multiple of the page size, %d", ErrInvalidArgument, n, tpp)
	case n > l.Written():
		return fmt.Errorf("%w: a checkpoint at %d tokens of lease %q, which has %d written", ErrInvalidArgument, n, l.id, l.Written())
	}
	if err := p.checkOrdering(after); err != nil {
		return err
	}
	if err := l.prepareKeys(n/tpp, tokens); err != nil {
		return err
	}
	var wait scrubWait
	for {
		done, err := p.checkpointAttempt(l, n, after, tokens, mover, &wait)
		if done || err != nil {
			return err
		}
	}
}

// scrubWait is how long a checkpoint waits for the units in quarantine
// it needs: a release's units stay there until their scrub's fence
// completes (microseconds after the engine's work on a GPU), and a
// checkpoint taken just after a release, as an engine's next prefill
// chunk takes it, would otherwise find no room. until[gi] is the count
// of group gi's units out of quarantine (Quarantine.EndedLocked) at which
// every unit in quarantine when it first waited has had its turn; 0
// before it waits.
// Past it, the checkpoint waits no longer and is refused as without the
// wait, so a pool whose releases keep the quarantine full cannot hold it
// forever.
type scrubWait struct {
	until [MaxCacheGroups]uint64
}

// errScrubsPending: the checkpoint's room is in quarantine; wait for a
// scrub to end and try again.
var errScrubsPending = errors.New("kvcache: the checkpoint's units are being scrubbed")

// prepareKeys derives, outside Pool.mu, the keys of l's first pages full
// pages it lacks, from tokens (nil: its prompt's), as CachePrefix does.
func (l *Lease) prepareKeys(pages int, tokens []int32) error {
	p := l.pool
	p.mu.Lock()
	seq, have := l.seq, len(l.keys)
	if tokens == nil {
		tokens = l.tokens
	}
	var parent BlockKey
	if have > 0 {
		parent = l.keys[have-1]
	}
	p.mu.Unlock()
	if have >= pages {
		return nil
	}
	if len(tokens) < pages*p.tpp {
		if have == 0 && len(tokens) == 0 {
			return fmt.Errorf("%w: lease %q carries no prompt tokens or keys to publish its pages under", ErrInvalidArgument, l.id)
		}
		return fmt.Errorf("%w: lease %q has the keys of %d pages and the tokens of %d, a checkpoint at %d pages needs them all",
			ErrInvalidArgument, l.id, have, len(tokens)/p.tpp, pages)
	}
	if have == 0 {
		parent = prefixRoot(l.Domain(), l.adapter)
	}
	extra := l.appendLeaseKeys(nil, parent, p.tpp, have, tokens[have*p.tpp:pages*p.tpp])
	p.mu.Lock()
	defer p.mu.Unlock()
	if l.seq != seq || l.state.Load() != leaseLive {
		return ErrLeaseReleased
	}
	if len(l.keys) == have {
		l.keys = append(l.keys, extra...)
		if l.keysFor == nil {
			l.keysFor = l.domain
		}
	}
	return nil
}

// checkpointAttempt takes the checkpoint once: done, or it evicted units
// for it (scrubbed here, and done is false: the caller tries again).
func (p *Pool) checkpointAttempt(l *Lease, n int, after cudaops.Ordering, tokens []int32, mover cudaops.PageMover, wait *scrubWait) (done bool, err error) {
	p.mu.Lock()
	var w tierWrite
	c, b, err := p.prepareCheckpointLocked(l, n, tokens, &w, wait)
	switch {
	case err == errScrubsPending:
		p.awaitScrubLocked(l)
		return false, nil
	case err != nil:
		p.mu.Unlock()
		return true, err
	case b.len() > 0:
		p.fills.Add(1)
		err := p.scrubEvictedLocked(b, &w)
		p.finishScrubLocked(b, err)
		p.fills.Done()
		p.mu.Unlock()
		return false, nil // the checks again, with the units clean
	case c == nil: // there is one at n already
		p.mu.Unlock()
		return true, nil
	}
	spans := p.checkpointSpansLocked(c, l, false)
	l.pins++
	p.mu.pins++
	p.mu.Unlock()

	start := monoNow()
	fence, err := mover.MovePages(spans, after)
	if err == nil {
		err = fence.Wait()
	}
	took := monoNow() - start

	p.mu.Lock()
	defer p.mu.Unlock()
	p.unpinLocked(l)
	c.copying = false
	last := c.chain[len(c.chain)-1]
	if err == nil && (c.dropped || last.ckpt != nil || p.mu.closed || !p.chainIndexedLocked(c)) {
		err = errCheckpointRace
	}
	if err != nil {
		// Nothing was published: the units are scrubbed, the pins let go
		// (a cache clear let them go already).
		b := scrubBatch{}.batchFor(p)
		delete(p.mu.ckpts.loose, c)
		p.dropCheckpointUnitsLocked(c, &b)
		if !c.dropped {
			p.unpinChainLocked(c)
		}
		p.fills.Add(1)
		go p.scrub(b, cudaops.Ordering{})
		switch {
		case errors.Is(err, errCheckpointRace):
			return true, nil // another took it, or the cache was cleared: nothing lost
		case errors.Is(err, cudaops.ErrBadOrdering):
			return true, fmt.Errorf("%w: checkpoint ordering: %w", ErrInvalidArgument, err)
		}
		return true, fmt.Errorf("%w: copying lease %q's state at %d tokens: %w", ErrDevice, l.id, n, err)
	}
	delete(p.mu.ckpts.loose, c)
	last.ckpt = c
	p.linkCheckpointLocked(c)
	p.mu.prefix.epoch++ // matches made before may now reach deeper
	p.mu.ckpts.stats.Taken++
	p.mu.ckpts.stats.CopyNanos += uint64(took)
	p.assertLocked("checkpoint")
	return true, nil
}

// prepareCheckpointLocked checks and prepares l's checkpoint at n: it
// publishes the pages below n, and returns the checkpoint with its units
// taken and its pages pinned, loose (not on the book yet); or units
// evicted for it, in b, for the caller to scrub before it tries again;
// or errScrubsPending, nothing changed, where only the units in
// quarantine can make its room (within wait's bound); or nothing where
// the checkpoint exists already; or why not.
func (p *Pool) prepareCheckpointLocked(l *Lease, n int, tokens []int32, w *tierWrite, wait *scrubWait) (*checkpoint, scrubBatch, error) {
	p.assertHeld()
	var b scrubBatch
	if err := p.stateErrLocked(); err != nil {
		return nil, b, err
	}
	if l.state.Load() != leaseLive || l.draining {
		return nil, b, ErrLeaseReleased
	}
	if l.written.Load()&writeSealed != 0 {
		return nil, b, l.sealedErr("state checkpoint")
	}
	if n > l.Written() {
		return nil, b, fmt.Errorf("%w: a checkpoint at %d tokens of lease %q, which has %d written", ErrInvalidArgument, n, l.id, l.Written())
	}
	pages := n / p.tpp
	es := p.lay.handoffExtents(n)
	// The windows must still hold their pages at n: not scrubbed by a
	// slide past them, and not overwritten by the tokens after them.
	for gi, e := range es {
		h := &l.holds[gi]
		if e.Kind != GroupSlidingWindow || e.Units == 0 {
			continue
		}
		if h.first > e.First || l.Written() > (e.First+len(h.pages))*p.tpp {
			return nil, b, fmt.Errorf("%w: lease %q's window of group %q has moved past its pages at %d tokens (logical pages %d on)",
				ErrInvalidArgument, l.id, e.Group, n, e.First)
		}
	}
	if len(l.keys) < pages {
		return nil, b, fmt.Errorf("%w: lease %q has the keys of %d pages, a checkpoint at %d pages needs them", ErrInvalidArgument, l.id, len(l.keys), pages)
	}
	if last := p.chainEntryLocked(l, pages-1); last != nil && last.ckpt != nil {
		p.mu.ckpts.stats.Existing++
		if it := last.ckpt.tier; it != nil {
			p.tier.touch(it) // being written, or in the tier
		} else {
			p.touchCheckpointLocked(last.ckpt)
		}
		return nil, b, nil
	}
	// Room first: a checkpoint not taken publishes nothing.
	if err := p.checkpointRoomLocked(l.tenant, es); err != nil {
		return nil, b, err
	}
	// Units in every group but the per-token one: free ones (verified
	// under the canary policy), or evicted for it, in every group or none.
	// Units in quarantine are free once their scrub ends: where eviction
	// cannot make the room and they can, wait for them (scrubWait).
	var short [MaxCacheGroups]int
	pending := false
	for gi := 1; gi < len(p.groups); gi++ {
		g := &p.groups[gi]
		free := g.alloc.Count(allocator.Free) - g.claimed
		evictable, scrubbing := p.mu.ckpts.evictable[gi], g.alloc.Count(allocator.Quarantined)
		if short[gi] = es[gi].Units - free; short[gi] <= evictable {
			continue
		}
		if short[gi] <= evictable+scrubbing {
			ended := p.q.EndedLocked(gi)
			if wait.until[gi] == 0 {
				wait.until[gi] = ended + uint64(scrubbing)
			}
			if ended < wait.until[gi] {
				pending = true
				continue
			}
		}
		p.countCapacityLocked(l.tenant, fmt.Sprintf("group %q has no %d units free or held by evictable checkpoints", g.name, es[gi].Units))
		return nil, b, fmt.Errorf("%w: group %q has %d units free for the checkpoint's %d, checkpoints to evict hold %d, and %d are being scrubbed",
			ErrCheckpointCapacity, g.name, free, es[gi].Units, evictable, scrubbing)
	}
	if pending {
		return nil, b, errScrubsPending
	}
	for gi := 1; gi < len(p.groups); gi++ {
		if short[gi] <= 0 {
			continue
		}
		if len(b.spaces) == 0 {
			b = b.batchFor(p)
		}
		p.evictCheckpointsLocked(&b, gi, short[gi], w)
	}
	if p.tier != nil {
		p.placeOffloadLocked(w) // the checkpoints evicted go to the tier
	}
	if b.len() > 0 {
		return nil, b, nil
	}
	// A page of l's that another lease's copy stood for, since evicted
	// (from the device: the host tier may hold it still), is published
	// again from l's own page (it holds the same KV): publication goes on
	// from the first such page, as far as before. A checkpoint pins pages
	// the device holds.
	upTo := pages
	for i := l.hitPages; i < min(pages, l.published); i++ {
		if e := p.chainEntryLocked(l, i); e == nil || e.page < 0 {
			upTo = max(pages, l.published)
			l.published = i
			break
		}
	}
	if tokens != nil {
		// The trie takes the pages' tokens from the lease (as Preempt's).
		own := l.tokens
		l.tokens = tokens
		p.publishLocked(l, upTo)
		l.tokens = own
	} else {
		p.publishLocked(l, upTo)
	}
	// The chain: each page's entry, l's own or the one of the same
	// content another lease published first.
	chain := make([]*cacheEntry, pages)
	for i := range pages {
		e := p.chainEntryLocked(l, i)
		if i >= l.published || e == nil || e.detached || e.page < 0 {
			return nil, b, fmt.Errorf("%w: lease %q's page %d is not in the prefix cache (cleared since it was admitted?)", ErrInvalidArgument, l.id, i)
		}
		chain[i] = e
	}
	if p.q.NeedsVerify() {
		for gi := 1; gi < len(p.groups); gi++ {
			peek := p.groups[gi].alloc.PeekFree(nil, es[gi].Units)
			if retired, err := p.q.VerifyLocked(gi, peek); err != nil {
				p.faultedLocked()
				p.logCanaryLocked(retired, err)
				return nil, b, fmt.Errorf("%w: %w", ErrPoolFaulted, err)
			}
		}
	}
	c := &checkpoint{tokens: n, chain: chain, last: chain[len(chain)-1], dom: l.domain, tenant: l.tenant, units: make([][]allocator.Handle, len(p.groups))}
	for gi := 1; gi < len(p.groups); gi++ {
		g := &p.groups[gi]
		hs, err := g.alloc.Alloc(nil, es[gi].Units, l.domain.ID)
		if err != nil {
			panic(fmt.Sprintf("kvcache: %d units of group %q free, but the allocator refused: %v", es[gi].Units, g.name, err))
		}
		c.units[gi] = hs
	}
	p.pinChainLocked(c)
	c.copying = true
	p.mu.ckpts.loose[c] = struct{}{}
	return c, b, nil
}

// checkpointSpansLocked is the copies between c's units and l's units of
// a handoff of c.tokens tokens, in every group but the per-token one:
// from l into c, or, restore, from c into l.
func (p *Pool) checkpointSpansLocked(c *checkpoint, l *Lease, restore bool) []cudaops.MoveSpan {
	es := p.lay.handoffExtents(c.tokens)
	spans := make([]cudaops.MoveSpan, 0, len(p.groups)-1)
	for gi := 1; gi < len(p.groups); gi++ {
		g, e, h := &p.groups[gi], es[gi], &l.holds[gi]
		span := cudaops.MoveSpan{First: g.first, Count: g.count, Moves: make([]cudaops.PageMove, e.Units)}
		for j := range e.Units {
			own, kept := h.handles[(e.First+j)%len(h.handles)].Page, c.units[gi][j].Page
			if restore {
				span.Moves[j] = cudaops.PageMove{From: kept, To: own}
			} else {
				span.Moves[j] = cudaops.PageMove{From: own, To: kept}
			}
		}
		spans = append(spans, span)
	}
	return spans
}

// chainEntryLocked is the index entry of l's page i: its own, or, where
// another lease published the same content first, that one's; nil if
// neither.
func (p *Pool) chainEntryLocked(l *Lease, i int) *cacheEntry {
	x := &p.mu.prefix
	if e := x.byPage[l.holds[0].pages[i]]; e != nil {
		return e
	}
	if i < len(l.keys) {
		return x.lookup(l.domain, l.keys[i])
	}
	return nil
}

// chainIndexedLocked reports whether every page of c is in the index
// still (none left it in a ClearPrefixCache).
func (p *Pool) chainIndexedLocked(c *checkpoint) bool {
	for _, e := range c.chain {
		if e.detached {
			return false
		}
	}
	return true
}

// errCheckpointRace: the checkpoint's page left the cache, or got a
// checkpoint, while the copy ran.
var errCheckpointRace = errors.New("kvcache: checkpoint raced")

// checkpointRoomLocked refuses a checkpoint of t with extents es beyond
// the pool's bound or t's (its MaxCheckpoints, and in each group its
// quota: checkpoints count against the tenant's share of their groups),
// counting and logging the skip.
func (p *Pool) checkpointRoomLocked(t *tenancy.Tenant, es []HandoffExtent) error {
	p.assertHeld()
	b := &p.mu.ckpts
	if max := p.maxCheckpoints; max > 0 && b.n >= max {
		p.countCapacityLocked(t, fmt.Sprintf("the pool holds %d checkpoints, its bound", b.n))
		return fmt.Errorf("%w: the pool holds %d checkpoints, Prefix.MaxCheckpoints is %d", ErrCheckpointCapacity, b.n, max)
	}
	tc := b.tenant(t)
	if max := t.MaxCheckpoints; max > 0 && tc.n >= max {
		p.countCapacityLocked(t, fmt.Sprintf("tenant %q holds %d checkpoints, its bound", t.Name, tc.n))
		return fmt.Errorf("%w: tenant %q holds %d checkpoints, its MaxCheckpoints is %d", ErrCheckpointCapacity, t.Name, tc.n, max)
	}
	for gi := 1; gi < len(p.groups); gi++ {
		g := &p.groups[gi]
		if quota := g.mirror(t).Quota; tc.units[gi]+es[gi].Units > quota {
			p.countCapacityLocked(t, fmt.Sprintf("tenant %q's checkpoints hold %d units of group %q, its quota there", t.Name, tc.units[gi], g.name))
			return fmt.Errorf("%w: tenant %q's checkpoints hold %d units of group %q, a checkpoint takes %d more, its quota there is %d",
				ErrCheckpointCapacity, t.Name, tc.units[gi], g.name, es[gi].Units, quota)
		}
	}
	return nil
}

// tenant is t's entry in the book, made on first use.
func (b *checkpointBook) tenant(t *tenancy.Tenant) *tenantCheckpoints {
	i := int(t.ID) - 1
	for len(b.perTenant) <= i {
		b.perTenant = append(b.perTenant, tenantCheckpoints{})
	}
	return &b.perTenant[i]
}

// countCapacityLocked counts a checkpoint not taken for lack of room and
// logs the first of each tenant's.
func (p *Pool) countCapacityLocked(t *tenancy.Tenant, why string) {
	p.assertHeld()
	b := &p.mu.ckpts
	b.stats.CapacitySkips++
	if tc := b.tenant(t); !tc.logged {
		tc.logged = true
		p.log.LogAttrs(context.Background(), slog.LevelWarn, "kvcache: state checkpoint not taken for lack of room; later ones of the tenant are counted, not logged",
			slog.String("tenant", t.Name), slog.String("why", why), slog.Int("checkpoints", b.n))
	}
}

// pinChainLocked pins c's pages: each entry counts c, and a Cached page
// leaves the LRU list for the pinned ones.
func (p *Pool) pinChainLocked(c *checkpoint) {
	x := &p.mu.prefix
	for _, e := range c.chain {
		if e.pins++; e.pins == 1 && e.inLRU {
			x.lruRemove(e)
			p.mu.ckpts.pinnedCached++
		}
	}
}

// unpinChainLocked lets c's pages go: a Cached page no checkpoint pins
// any more joins the LRU list, deepest first (it is evicted first). A
// pinned page that no lease holds is never detached (a cache clear drops
// the checkpoints before it detaches pages), so each such page has an
// index entry to go back to.
func (p *Pool) unpinChainLocked(c *checkpoint) {
	x := &p.mu.prefix
	freed := false
	for i := len(c.chain) - 1; i >= 0; i-- {
		e := c.chain[i]
		if e.pins--; e.pins == 0 && e.leases == 0 {
			x.lruPush(e)
			p.mu.ckpts.pinnedCached--
			freed = true
		}
	}
	if freed {
		p.wakePagesLocked() // evictable pages are pages for whoever waits
	}
}

// linkCheckpointLocked puts c on the book, at the LRU list's tail.
func (p *Pool) linkCheckpointLocked(c *checkpoint) {
	b := &p.mu.ckpts
	b.lruAppend(c)
	b.n++
	tc := b.tenant(c.tenant)
	tc.n++
	for gi, hs := range c.units {
		b.units[gi] += len(hs)
		b.evictable[gi] += len(hs)
		tc.units[gi] += len(hs)
	}
}

// unlinkCheckpointLocked takes c off the book and the LRU list.
func (p *Pool) unlinkCheckpointLocked(c *checkpoint) {
	b := &p.mu.ckpts
	b.lruRemove(c)
	b.n--
	tc := b.tenant(c.tenant)
	tc.n--
	for gi, hs := range c.units {
		b.units[gi] -= len(hs)
		tc.units[gi] -= len(hs)
		if c.restoring == 0 {
			b.evictable[gi] -= len(hs)
		}
	}
}

// touchCheckpointLocked moves c, on the book, to the LRU list's tail: it
// was just used.
func (p *Pool) touchCheckpointLocked(c *checkpoint) {
	b := &p.mu.ckpts
	if b.lruTail != c {
		b.lruRemove(c)
		b.lruAppend(c)
	}
}

// lruAppend puts c at the LRU list's tail.
func (b *checkpointBook) lruAppend(c *checkpoint) {
	c.prev, c.next = b.lruTail, nil
	if b.lruTail != nil {
		b.lruTail.next = c
	} else {
		b.lruHead = c
	}
	b.lruTail = c
}

// lruRemove takes c off the LRU list.
func (b *checkpointBook) lruRemove(c *checkpoint) {
	if c.prev != nil {
		c.prev.next = c.next
	} else {
		b.lruHead = c.next
	}
	if c.next != nil {
		c.next.prev = c.prev
	} else {
		b.lruTail = c.prev
	}
	c.prev, c.next = nil, nil
}

// dropCheckpointUnitsLocked releases c's units into quarantine, appended
// to b for the caller to scrub.
func (p *Pool) dropCheckpointUnitsLocked(c *checkpoint, b *scrubBatch) {
	for gi, hs := range c.units {
		if len(hs) == 0 {
			continue
		}
		g := &p.groups[gi]
		before := len(b.spaces[gi])
		var err error
		if b.spaces[gi], err = g.alloc.Release(b.spaces[gi], hs, c.dom.ID); err != nil {
			panic(fmt.Sprintf("kvcache: a checkpoint's units of group %q the allocator refuses: %v", g.name, err))
		}
		p.q.BeginLocked(gi, len(b.spaces[gi])-before)
	}
}

// dropCheckpointLocked ends c on the device: off the book and the LRU
// list, its pages unpinned, and its units into b (quarantined), or, while
// a restore from it runs, when the last restore ends (loose meanwhile).
// An eviction's c, with a tier write w, goes to the host tier
// (offerCheckpointLocked) and stays on its page; otherwise it leaves it.
func (p *Pool) dropCheckpointLocked(c *checkpoint, b *scrubBatch, w *tierWrite) {
	p.assertHeld()
	if c.last.ckpt == c && (c.restoring > 0 || !p.offerCheckpointLocked(c, w)) {
		c.last.ckpt = nil
	}
	p.unlinkCheckpointLocked(c)
	p.unpinChainLocked(c)
	p.mu.prefix.epoch++
	if c.restoring > 0 {
		c.dropped = true
		p.mu.ckpts.loose[c] = struct{}{}
		return
	}
	p.dropCheckpointUnitsLocked(c, b)
}

// evictCheckpointsLocked evicts least recently used checkpoints with
// units of group gi until at least n of those are freed, or none is left
// to evict, their units (every group's) appended to b. It returns the
// units of gi freed. A checkpoint being restored, or the one at the end
// of the evicting admission's match (its page marked pinned by the
// caller: about to be restored), stays. With a tier write off, the host
// tier takes what it evicts (dropCheckpointLocked).
func (p *Pool) evictCheckpointsLocked(b *scrubBatch, gi, n int, off *tierWrite) (freed int) {
	p.assertHeld()
	if p.mu.ckpts.evictable[gi] == 0 {
		return 0
	}
	for c := p.mu.ckpts.lruHead; c != nil && freed < n; {
		next := c.next
		if p.evictableCheckpoint(c) && len(c.units[gi]) > 0 {
			freed += len(c.units[gi])
			p.dropCheckpointLocked(c, b, off)
			p.mu.ckpts.stats.Evicted++
		}
		c = next
	}
	return freed
}

// evictCheckpointLocked evicts the least recently used checkpoint that
// can be, for the pages it pins, and returns it (nil: none can be). The
// caller has marked its keep entries pinned.
func (p *Pool) evictCheckpointLocked(b *scrubBatch, off *tierWrite) *checkpoint {
	for c := p.mu.ckpts.lruHead; c != nil; c = c.next {
		if p.evictableCheckpoint(c) {
			p.dropCheckpointLocked(c, b, off)
			p.mu.ckpts.stats.Evicted++
			return c
		}
	}
	return nil
}

// evictableCheckpoint reports whether c may be evicted now: no restore
// from it in flight, and not the checkpoint of an evicting admission's
// match (its last entry marked pinned).
func (p *Pool) evictableCheckpoint(c *checkpoint) bool {
	return c.restoring == 0 && !c.last.pinned
}

// usable reports whether an admission may restore c: the device holds it,
// or the host tier has written it.
func (c *checkpoint) usable() bool {
	return c.tier == nil || c.tier.ready && !c.tier.doomed
}

// matchCheckpointLocked cuts l's prefix match, in a hybrid pool, back to
// its deepest page with a checkpoint, which it keeps for the admission's
// restore (l.match.ckpt); the pages cut are added to l.match.cut, a
// checkpoint miss once the admission is granted.
func (p *Pool) matchCheckpointLocked(l *Lease) {
	m := &l.match
	k := len(m.entries)
	for k > 0 && (m.entries[k-1].ckpt == nil || !m.entries[k-1].ckpt.usable()) {
		k--
	}
	m.cut += len(m.entries) - k
	m.entries = m.entries[:k]
	m.ckpt = nil
	if k > 0 {
		m.ckpt = m.entries[k-1].ckpt
	}
}

// restore copies the checkpoint l was admitted with (l.restore) into its
// units in the other groups, before the lease is handed out, and sets
// its written watermark to the checkpoint's tokens (its windows starting
// where they did there); on failure it ends the lease (its pages
// scrubbed) and returns the error. The checkpoint (restoring) and the
// lease (pins) are pinned from the grant on (beginRestoreLocked): no end
// of the lease, eviction or Close comes between.
func (p *Pool) restore(l *Lease) error {
	p.mu.Lock()
	c := l.restore
	if c.tier != nil {
		return p.restoreFromTierLocked(l, c)
	}
	spans := p.checkpointSpansLocked(c, l, true)
	p.mu.Unlock()
	// The checkpoint's units and the lease's fresh ones are the pool's
	// own: no engine work touches them.
	start := monoNow()
	fence, err := p.dev.(cudaops.PageMover).MovePages(spans, cudaops.Ordering{Own: true})
	if err == nil {
		err = fence.Wait()
	}
	took := monoNow() - start
	p.mu.Lock()
	p.unpinLocked(l)
	l.restore = nil
	b := p.endRestoreLocked(c)
	if err == nil && l.state.Load() == leaseLive {
		p.mu.ckpts.stats.RestoreNanos += uint64(took)
		p.restoredLocked(l, c.tokens)
	}
	p.unlockScrub(b)
	if err == nil {
		return nil
	}
	// Handed out to nobody: the lease ends, its pages scrubbed.
	l.Abort()
	return fmt.Errorf("%w: restoring a state checkpoint of %d tokens into request %q: %w", ErrDevice, c.tokens, l.id, err)
}

// beginRestoreLocked pins c, and l, for a restore of c into l: on the
// device, c's units are not evicted meanwhile; in the host tier, its
// item is read (no eviction or clear reuses its slot).
func (p *Pool) beginRestoreLocked(l *Lease, c *checkpoint) {
	l.pins++
	p.mu.pins++
	l.restore = c
	if it := c.tier; it != nil {
		p.tier.pin(it)
		p.tier.touch(it)
		return
	}
	if c.restoring++; c.restoring == 1 {
		for gi, hs := range c.units {
			p.mu.ckpts.evictable[gi] -= len(hs)
		}
	}
	p.touchCheckpointLocked(c)
}

// cancelRestore lets go of the checkpoint an admission was granted with
// (beginRestoreLocked) and did not restore: it was refused after the
// grant (its onload failed, or Close came), its lease ended.
func (p *Pool) cancelRestore(l *Lease) {
	p.mu.Lock()
	c := l.restore
	l.restore = nil
	p.unpinLocked(l)
	var b scrubBatch
	var fill []int32
	if it := c.tier; it != nil {
		fill = p.unpinTierLocked(it, nil)
	} else {
		b = p.endRestoreLocked(c)
	}
	p.unlockScrub(b)
	p.scrubTier(fill)
}

// unlockScrub lets go of Pool.mu and scrubs b (a checkpoint's units a
// restore's end released), if it holds any.
func (p *Pool) unlockScrub(b scrubBatch) {
	if b.len() == 0 {
		p.mu.Unlock()
		return
	}
	p.fills.Add(1)
	p.mu.Unlock()
	_ = p.scrub(b, cudaops.Ordering{}) // a failed fill faults the pool itself
}

// restoreFromTierLocked is restore of c, a checkpoint in the host tier,
// entered with Pool.mu held: its slot is copied into l's units (one copy
// per group), and, failing, l ends and its admission is refused with
// ErrOnloadFailed, the checkpoint dropped from the tier (filled before
// its slot is reused), as a failed onload of pages is.
func (p *Pool) restoreFromTierLocked(l *Lease, c *checkpoint) error {
	t, it := p.tier, c.tier
	es := p.lay.handoffExtents(c.tokens)
	local := int(it.slots[0] - t.sp[spaceCheckpoints].base)
	var pages, units [MaxCacheGroups][]int32
	bytes := 0
	for gi := 1; gi < len(p.groups); gi++ {
		e, h := es[gi], &l.holds[gi]
		for j := range e.Units {
			pages[gi] = append(pages[gi], h.handles[(e.First+j)%len(h.handles)].Page)
			units[gi] = append(units[gi], int32(local*t.ckptUnits[gi]+j))
		}
		bytes += e.Units * int(p.groups[gi].pageBytes)
	}
	t.busy++
	p.mu.Unlock()
	start := monoNow()
	var err error
	for gi := 1; gi < len(p.groups) && err == nil; gi++ {
		if len(pages[gi]) > 0 {
			err = t.copy(spaceCheckpoints, gi, pages[gi], units[gi], false, cudaops.Ordering{})
		}
	}
	took := monoNow() - start
	p.mu.Lock()
	p.unpinLocked(l)
	l.restore = nil
	doomed := it.doomed
	fill := p.unpinTierLocked(it, nil)
	switch {
	case err != nil:
		t.stats.CheckpointRestoresFailed++
		if !doomed {
			fill = p.dropItemLocked(it, fill) // filled before its slot is reused
		}
	case l.state.Load() == leaseLive:
		p.mu.ckpts.stats.RestoreNanos += uint64(took)
		t.stats.CheckpointsRestored++
		t.stats.CheckpointRestoreBytes += uint64(bytes)
		t.domain(c.dom).hitCkpts++
		p.restoredLocked(l, c.tokens)
	}
	p.tierIdleLocked(1)
	p.mu.Unlock()
	p.scrubTier(fill)
	if err == nil {
		return nil
	}
	l.Abort() // handed out to nobody: its pages are scrubbed
	return &AdmissionError{Err: ErrOnloadFailed, RequestID: l.id, Tenant: l.tenant.Name,
		Cause: fmt.Errorf("%w: restoring a state checkpoint of %d tokens from the host tier: %w", ErrDevice, c.tokens, err)}
}

// restoredLocked sets l's watermark to the tokens of the checkpoint
// restored into it, its windows starting where they did there.
func (p *Pool) restoredLocked(l *Lease, tokens int) {
	for gi, e := range p.lay.handoffExtents(tokens) {
		if e.Kind == GroupSlidingWindow {
			l.holds[gi].first = e.First
		}
	}
	l.written.Store(int64(tokens))
	p.assertLocked("restore")
}

// awaitScrubLocked waits, with Pool.mu unlocked, until a scrub ends or
// units become evictable (or a fault or Close): it queues as a fill
// waiter that holds no claim, which wakePagesLocked wakes and nobody
// waits behind. It returns with Pool.mu unlocked.
func (p *Pool) awaitScrubLocked(l *Lease) {
	p.assertHeld()
	w := &waiter{lease: l, checkpoint: true, reason: waitFill, wake: make(chan struct{}, 1)}
	p.mu.waiters.push(w)
	p.mu.Unlock()
	<-w.wake
	p.mu.Lock()
	p.mu.waiters.remove(w)
	p.mu.Unlock()
}

// endRestoreLocked lets c be evicted again once its last restore ended,
// or, dropped meanwhile, returns its units for the caller to scrub.
func (p *Pool) endRestoreLocked(c *checkpoint) scrubBatch {
	var b scrubBatch
	if c.restoring--; c.restoring > 0 {
		return b
	}
	if c.dropped {
		delete(p.mu.ckpts.loose, c)
		b = b.batchFor(p)
		p.dropCheckpointUnitsLocked(c, &b)
		return b
	}
	for gi, hs := range c.units {
		p.mu.ckpts.evictable[gi] += len(hs)
	}
	p.wakePagesLocked() // its units are evictable again
	return b
}

// checkpointStatsLocked is the book's figures.
func (p *Pool) checkpointStatsLocked() CheckpointStats {
	b := &p.mu.ckpts
	s := b.stats
	s.Live = b.n
	for c := b.lruHead; c != nil; c = c.next {
		if c.restoring > 0 {
			s.Restoring++
		}
	}
	for gi := 1; gi < len(p.groups); gi++ {
		s.StateBytes += int64(b.units[gi]) * p.groups[gi].pageBytes
	}
	return s
}

// eachCheckpointLocked calls f for every checkpoint holding units: those
// on the book, then the loose ones.
func (p *Pool) eachCheckpointLocked(f func(c *checkpoint, onBook bool)) {
	for c := p.mu.ckpts.lruHead; c != nil; c = c.next {
		f(c, true)
	}
	for c := range p.mu.ckpts.loose {
		f(c, false)
	}
}

// checkCheckpointsLocked checks the book against the checkpoints, their
// entries and pins, and counts their units as holders in refs[g] (part
// of Check).
func (p *Pool) checkCheckpointsLocked(c *checker, refs [][]int) {
	b := &p.mu.ckpts
	n, listed := 0, 0
	units := make([]int, len(p.groups))
	evictable := make([]int, len(p.groups))
	pins := map[*cacheEntry]int{}
	perTenant := map[int]tenantCheckpoints{}
	for k := b.lruHead; k != nil && listed <= b.n; k = k.next {
		listed++
	}
	if listed != b.n {
		c.failf("checkpoints: %d or more on the LRU list, the book counts %d", listed, b.n)
		return
	}
	p.eachCheckpointLocked(func(k *checkpoint, onBook bool) {
		n++
		if len(k.chain) == 0 || len(k.chain)*p.tpp != k.tokens || len(k.units) != len(p.groups) {
			c.failf("checkpoint of %d tokens has %d pages and units in %d groups", k.tokens, len(k.chain), len(k.units))
			return
		}
		if held := k.last.ckpt == k && k.last == k.chain[len(k.chain)-1]; held != onBook || onBook && k.dropped {
			c.failf("checkpoint of %d tokens: on the book %v, held by its last page %v, dropped %v", k.tokens, onBook, held, k.dropped)
		}
		if !onBook && k.dropped && k.restoring == 0 && !k.copying {
			c.failf("checkpoint of %d tokens dropped with no restore or copy in flight, its units held", k.tokens)
		}
		if onBook && k.copying || !onBook && !k.copying && !k.dropped {
			c.failf("checkpoint of %d tokens: on the book %v, copying %v, dropped %v", k.tokens, onBook, k.copying, k.dropped)
		}
		if onBook || !k.dropped {
			for _, e := range k.chain {
				pins[e]++
			}
		}
		for gi, hs := range k.units {
			if onBook {
				units[gi] += len(hs)
				if k.restoring == 0 {
					evictable[gi] += len(hs)
				}
				tc := perTenant[int(k.tenant.ID)-1]
				tc.units[gi] += len(hs)
				perTenant[int(k.tenant.ID)-1] = tc
			}
			for _, h := range hs {
				info, err := p.groups[gi].alloc.Info(h.Page)
				if err != nil || info.State != allocator.InUse || info.Gen != h.Gen || info.Owner != k.dom.ID {
					c.failf("checkpoint of %d tokens: unit %d of group %q is %+v", k.tokens, h.Page, p.groups[gi].name, info)
				}
				if int(h.Page) < len(refs[gi]) {
					refs[gi][h.Page]++
				}
			}
		}
		if onBook {
			tc := perTenant[int(k.tenant.ID)-1]
			tc.n++
			perTenant[int(k.tenant.ID)-1] = tc
		}
	})
	for gi := range p.groups {
		if units[gi] != b.units[gi] || evictable[gi] != b.evictable[gi] {
			c.failf("checkpoints hold %d units of group %q (%d evictable), the book says %d (%d)",
				units[gi], p.groups[gi].name, evictable[gi], b.units[gi], b.evictable[gi])
		}
	}
	for i, k := range b.perTenant {
		if w := perTenant[i]; k.n != w.n || k.units != w.units {
			c.failf("tenant %d counts %d checkpoints holding %v units, holds %d holding %v", i+1, k.n, k.units, w.n, w.units)
		}
	}
	pinnedCached := 0
	for _, e := range p.mu.prefix.byPage {
		if e == nil {
			continue
		}
		if int(e.pins) != pins[e] {
			c.failf("page %d counts %d checkpoint pins, %d checkpoints need it", e.page, e.pins, pins[e])
		}
		if e.pins > 0 && e.leases == 0 {
			pinnedCached++
			if e.inLRU || e.detached {
				c.failf("page %d, pinned by %d checkpoints and held by no lease, is on the LRU list (%v) or detached (%v)", e.page, e.pins, e.inLRU, e.detached)
			}
		}
		if k := e.ckpt; k != nil && (e.detached || k.last != e || k.tier == nil && (k.chain[len(k.chain)-1] != e || k.dropped)) {
			c.failf("page %d (detached %v) holds a checkpoint of %d tokens ending at page %d (dropped %v, restoring %d, in the host tier %v)",
				e.page, e.detached, k.tokens, k.last.page, k.dropped, k.restoring, k.tier != nil)
		}
	}
	if pinnedCached != b.pinnedCached {
		c.failf("%d cached pages pinned by checkpoints, the book says %d", pinnedCached, b.pinnedCached)
	}
}

// countCheckpointMatchLocked records a granted hybrid admission's match:
// a hit on its checkpoint, which it restores before the lease is handed
// out (admit calls restore), and the matched pages lost for want of one.
func (p *Pool) countCheckpointMatchLocked(l *Lease) {
	m, s := &l.match, &p.mu.ckpts.stats
	if m.ckpt != nil {
		s.Hits++
		s.HitTokens += uint64(m.ckpt.tokens)
		p.beginRestoreLocked(l, m.ckpt)
	}
	if m.cut > 0 {
		s.Misses++
		s.MissTokens += uint64(m.cut * p.tpp)
	}
}

// cacheHybridPrefix is CachePrefix(n) in a hybrid pool (see there).
func (l *Lease) cacheHybridPrefix(n int) (int, error) {
	p := l.pool
	switch w := l.Written(); {
	case n < 0 || n > w:
		return 0, fmt.Errorf("%w: CachePrefix(%d) with %d tokens written", ErrInvalidArgument, n, w)
	case n > l.prompt:
		return 0, fmt.Errorf("%w: CachePrefix(%d) past the prompt of %d tokens", ErrInvalidArgument, n, l.prompt)
	}
	p.mu.Lock()
	carries := len(l.keys) > 0 || len(l.tokens) > 0
	p.mu.Unlock()
	if p.prefixDisabled || !carries {
		return 0, nil
	}
	if n >= p.tpp && n%p.tpp == 0 {
		if err := l.checkpoint(n, cudaops.Ordering{}, nil); err != nil {
			return 0, err
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := l.live(); err != nil {
		return 0, err
	}
	return p.checkpointedLocked(l) * p.tpp, nil
}

// checkpointedLocked is the pages of l's prefix up to its deepest page
// in the cache with a checkpoint (its own copy of the page, or the one
// of another lease that stands for it): what a later request can use.
func (p *Pool) checkpointedLocked(l *Lease) int {
	for i := l.published; i > 0; i-- {
		if e := p.chainEntryLocked(l, i-1); e != nil && e.ckpt != nil {
			return i
		}
	}
	return 0
}
