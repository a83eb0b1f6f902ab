package kvcache

import (
	"fmt"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// Reads out of the host tier into an admission's pages: match → onload,
// and the swap back of a preempted request. The match (matchLocked) walks
// the prefix index as ever; an entry whose page only the tier holds ends
// the walk no sooner than one the device holds. Admission decides and
// takes the whole request as it always does, all or nothing: a matched
// entry the device holds is shared, one only the tier holds gets a fresh
// page of the lease (onloadRunLocked), counted in what the admission
// takes and charges. Then, before the lease is handed out, the admission
// copies the tier's slots into those pages outside Pool.mu (stepOnload,
// the items pinned: no eviction or clear reuses their slots meanwhile),
// and only then finishes: the onloaded pages join their entries (the
// device holds them again, shared like any hit) and count as hits. A copy
// that fails ends the lease before anyone saw it (its pages scrubbed,
// the items it read dropped from the tier and their slots filled) and
// the admission is refused with ErrOnloadFailed.
//
// The hook is the entry, as for offload: a second cacheable group's
// entries would be onloaded into its own fresh pages the same way.

// tierRead is an admission's copies out of the tier, kept in its Lease
// (Lease.onload) so that a recycled Lease onloads without allocating.
type tierRead struct {
	// Per copy: the matched entry whose page it onloads and the item it
	// reads (both nil for a page of the swap), the lease's fresh page and
	// the slot.
	entries      []*cacheEntry
	items        []*tierItem
	pages, slots []int32
	// swap is the swap being restored (pinned), restored the tokens it
	// gives back (HitTokens) once it lands.
	swap     *tierItem
	restored int
	// fill is tier slots to fill once the admission ends (a stale swap
	// found and dropped).
	fill []int32
	err  error
}

func (r *tierRead) reset() {
	clear(r.entries)
	clear(r.items)
	*r = tierRead{entries: r.entries[:0], items: r.items[:0], pages: r.pages[:0], slots: r.slots[:0], fill: r.fill[:0]}
}

// pending reports whether the admission has copies to run or slots to
// fill before it ends.
func (r *tierRead) pending() bool { return r != nil && (len(r.pages) > 0 || len(r.fill) > 0) }

// tierRead returns l's onload scratch, made on first use: a Lease that
// never meets a tier does without.
func (l *Lease) tierRead() *tierRead {
	if l.onload == nil {
		l.onload = new(tierRead)
	}
	return l.onload
}

// onloadRunLocked gives lease l a fresh page for each of entries, a run
// of its matched entries that only the tier holds, in one allocation,
// appends their handles and pages to handles and table, and records
// their copies: the pages are among those the admission was granted (its
// take counts them), so the allocator has them. It pins the entries'
// items until the copy ends.
func (p *Pool) onloadRunLocked(l *Lease, entries []*cacheEntry, owner allocator.Owner, handles []allocator.Handle, table []int32) ([]allocator.Handle, []int32) {
	base := len(table)
	handles, table, err := p.groups[0].alloc.AllocIDs(handles, table, len(entries), owner)
	if err != nil {
		panic(fmt.Sprintf("kvcache: %d pages granted for onloads, but the allocator refused them: %v", len(entries), err))
	}
	t, r := p.tier, l.tierRead()
	r.pages = append(r.pages, table[base:]...)
	for _, e := range entries {
		it := e.tier
		t.pin(it)
		r.entries = append(r.entries, e)
		r.items = append(r.items, it)
		r.slots = append(r.slots, it.slots[0])
	}
	return handles, table
}

// planSwapInLocked restores, into the fresh pages of l just admitted for
// req, the swap of req's request ID in l's domain: if the tenant, the
// adapter and the written tokens are the same (req's prompt begins with
// them), and the pages before the swap's are l's hits. A swap that does
// not fit is dropped: it would never fit this request again.
func (p *Pool) planSwapInLocked(l *Lease, req *Request) {
	t := p.tier
	if t == nil || len(t.swaps) == 0 {
		return
	}
	it := t.swaps[swapKey{dom: l.domain, id: l.id}]
	if it == nil || it.pins > 0 {
		return
	}
	sw, r := it.swap, l.tierRead()
	to := sw.first + len(it.slots)
	if sw.tenant != l.tenant || sw.adapter != req.Adapter || len(req.PageExtra) > 0 ||
		len(req.TokenIDs) < sw.written || !tokensEqual(req.TokenIDs[:sw.written], sw.tokens) ||
		l.hitPages < sw.first || to > len(l.holds[0].pages) {
		r.fill = p.dropItemLocked(it, r.fill)
		t.stats.SwapsEvicted++
		return
	}
	// The engine computes the last prompt token again (it needs its
	// logits): the pages that hold only tokens from there on are not
	// worth a copy.
	restored := min(sw.written, l.prompt-1)
	from, to := max(l.hitPages, sw.first), min(to, p.pagesFor(restored))
	if from >= to {
		r.fill = p.dropItemLocked(it, r.fill) // the hits cover all it is worth
		return
	}
	t.pin(it)
	r.swap = it
	for i := from; i < to; i++ {
		r.entries = append(r.entries, nil)
		r.items = append(r.items, nil)
		r.pages = append(r.pages, l.holds[0].pages[i])
		r.slots = append(r.slots, it.slots[i-sw.first])
	}
	r.restored = restored
}

// runTierRead copies r's slots into its pages outside Pool.mu, timed, in
// the lease's order: fresh pages come off the free list in order and a
// prompt's pages went into the tier in order, so runs of adjacent pages
// and slots copy as one without a sort.
func (p *Pool) runTierRead(r *tierRead) {
	if len(r.pages) == 0 {
		return
	}
	t := p.tier
	start := monoNow()
	r.err = t.copy(spacePages, 0, r.pages, r.slots, false, cudaops.Ordering{})
	if r.err == nil {
		t.onloadLatency.record(monoNow() - start)
	}
}

// onloadLocked runs an admitted lease's copies out of the tier (the step
// stepOnload, entered with Pool.mu held), finishes the admission and
// returns its outcome, with Pool.mu released.
func (p *Pool) onloadLocked(a *admission) error {
	l := a.l
	r := l.onload
	t := p.tier
	t.busy++
	p.mu.Unlock()
	p.runTierRead(r)
	p.mu.Lock()
	b, ended := p.finishTierReadLocked(a)
	fill := r.fill
	r.fill = nil
	p.tierIdleLocked(1)
	err := p.endAdmissionLocked(a)
	if ended {
		_ = p.scrub(b, cudaops.Ordering{}) // a failed fill faults the pool itself
	}
	p.scrubTier(fill)
	r.fill = fill[:0]
	return err
}

// finishTierReadLocked ends an admission's copies out of the tier. When
// they landed and the pool is still open, the onloaded pages join their
// entries, where no other page did meanwhile (shared from now on, like
// any hit), the swap is consumed and its tokens restored. Otherwise the
// lease ends before it was handed out (ended: b is its scrub, counted in
// p.fills) and the admission is refused: ErrOnloadFailed with the copy's
// error, ErrPoolClosed if Close came meanwhile; the items a failed copy
// read leave the tier, their slots filled.
func (p *Pool) finishTierReadLocked(a *admission) (b scrubBatch, ended bool) {
	l, t := a.l, p.tier
	r := l.onload
	ok := r.err == nil && !p.mu.closed
	onloaded := 0
	if ok {
		x, events := &p.mu.prefix, p.mu.events.enabled()
		attached := 0
		var stored []*cacheEntry // for the events
		for i, e := range r.entries {
			if e == nil {
				continue
			}
			onloaded++
			if it := r.items[i]; it.entry != e || it.doomed || e.page >= 0 || e.detached || e.dom != l.domain {
				continue // gone from the tier, or on the device again: the page stays the lease's own
			}
			// attachOnloadedLocked's work, the counts once for all.
			e.page, x.byPage[r.pages[i]] = r.pages[i], e
			e.leases = 1
			e.tenants = append(e.tenants[:0], tenantRef{t: l.tenant, refs: 1})
			attached++
			if events {
				stored = append(stored, e)
			}
		}
		x.counters(l.domain).entries += attached
		x.epoch++
		if events {
			p.emitStoredLocked(stored, MediumDevice) // on the device again, one event a chain
		}
		t.domain(l.domain).hitPages += uint64(onloaded)
		t.stats.Onloads += uint64(len(r.pages))
		t.stats.OnloadBytes += uint64(len(r.pages)) * uint64(t.sp[spacePages].slotBytes)
		if r.swap != nil {
			l.restored = r.restored
			t.stats.SwapsIn++
			t.stats.SwapInPages += uint64(len(r.pages) - onloaded)
		}
	}
	n := len(r.pages)
	for i, it := range r.items {
		if it == nil {
			continue
		}
		doomed := it.doomed
		r.fill = p.unpinTierLocked(it, r.fill) // it is gone if it was doomed
		if r.err != nil && !doomed {
			r.fill = p.dropItemLocked(it, r.fill) // its onload failed: filled before reuse
		}
		r.items[i] = nil
	}
	if sw := r.swap; sw != nil {
		doomed := sw.doomed
		r.fill = p.unpinTierLocked(sw, r.fill)
		if !doomed {
			r.fill = p.dropItemLocked(sw, r.fill) // consumed, or failed: filled either way
		}
		r.swap = nil
	}
	clear(r.entries)
	r.entries, r.items, r.pages, r.slots = r.entries[:0], r.items[:0], r.pages[:0], r.slots[:0]
	p.mu.events.emitRemovedLocked(p.tpp) // what a failed copy dropped from the tier
	if ok {
		return scrubBatch{}, false
	}
	// The lease ends before anyone saw it: not an admission after all.
	if r.err != nil {
		t.stats.OnloadsFailed += uint64(n)
		a.err = &AdmissionError{Err: ErrOnloadFailed, Cause: fmt.Errorf("%w: %w", ErrDevice, r.err), RequestID: a.req.ID, Tenant: a.req.Tenant}
	} else {
		a.err = ErrPoolClosed
	}
	r.err = nil
	l.restored = 0
	p.mu.admitted--
	p.mu.perTenant.of(l.tenant).admitted--
	l.phase.Store(uint32(PhaseAborted))
	l.state.Store(leaseReleased)
	b = p.detachOwnLocked(l)
	p.fills.Add(1)
	return b, true
}

// attachOnloadedLocked makes page, which l holds alone and which now
// holds e's KV (onloaded, or computed and published by l), e's device
// page: shared and published like any hit, with a KVStored event of the
// device medium.
func (p *Pool) attachOnloadedLocked(l *Lease, e *cacheEntry, page int32) {
	x := &p.mu.prefix
	x.attachPage(e, page)
	e.leases = 1
	e.tenants = append(e.tenants[:0], tenantRef{t: l.tenant, refs: 1})
	if p.mu.events.enabled() {
		ev := KVEvent{Kind: KVStored, Domain: e.dom.Name, Parent: e.parent, Adapter: x.adapters[e.adapter],
			Keys: append(p.mu.events.keysLocked(1), e.key), Tokens: p.tpp}
		if e.tokens != nil {
			ev.TokenIDs = p.mu.events.tokensLocked(e.tokens)
		}
		p.mu.events.emitLocked(ev)
	}
}

// matchable reports whether a match may take e: the device holds its
// page, or the host tier has written it.
func (e *cacheEntry) matchable() bool {
	return e.page >= 0 || e.tier != nil && e.tier.ready && !e.tier.doomed
}

// tierDomainStatsLocked fills the tier's part of a domain's figures.
func (p *Pool) tierDomainStatsLocked(d *tenancy.Domain, s *DomainStats) {
	t := p.tier
	if t == nil {
		return
	}
	td := t.domain(d)
	s.TierPages, s.TierBound = td.sp[spacePages].used, td.sp[spacePages].bound
	s.TierHitPages, s.TierStoredPages, s.TierEvictedPages = td.hitPages, td.storedPages, td.evictedPages
	s.TierCheckpoints, s.TierCheckpointBound = td.sp[spaceCheckpoints].used, td.sp[spaceCheckpoints].bound
	s.TierCheckpointsStored, s.TierCheckpointHits, s.TierCheckpointsEvicted = td.storedCkpts, td.hitCkpts, td.evictedCkpts
	s.TierHitTokens = td.hitPages * uint64(p.tpp)
}
