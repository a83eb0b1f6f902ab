package kvcache

import (
	"context"
	"fmt"
	"log/slog"
	"slices"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// Writes into the host tier: eviction → offload, and the swap of a
// preemption. Both are planned under Pool.mu (slots taken, items made,
// not yet findable), run outside it (fill the recycled slots, copy the
// device pages in, one HostCopier call), and finish under it (the items
// become findable, or, if the copy failed, their slots, already filled
// again, return to the free list). The device pages they read are ones
// no lease holds any more and no fill has touched yet: evicted cached
// pages, or a preempted lease's, both quarantined until their own scrub,
// which the caller issues only after the copy.
//
// The hook is the eviction itself (evictLocked): an entry whose device
// page is evicted stays in the prefix index if the tier holds it, or is
// written to the tier (placeOffloadLocked), and leaves the index only if
// neither. A state checkpoint the device evicts (checkpoint.go) is
// offered the same way (offerCheckpointLocked): it stays on its page,
// unusable until its copy lands in a slot of the checkpoint space, and
// leaves it if the tier has no room or the copy fails.

// tierWrite is one batch of writes into the tier.
type tierWrite struct {
	// cands are evicted entries not yet in the tier, with their device
	// pages (candPages), before placeOffloadLocked takes slots for them.
	cands     []*cacheEntry
	candPages []int32
	// items are the items being written; pages[i] is copied into slots[i]
	// (one device page per slot, over every region of the per-token
	// group).
	items        []*tierItem
	pages, slots []int32
	// ckCands are state checkpoints the device evicted, not yet in the
	// tier (their units, released and quarantined already, are read by
	// the copy before their scrub). A placed one is an item of items
	// whose slot is in ckSlots; ckFrom[g] are the device units of group g
	// the copy reads, ckTo[g] the unit indices of the checkpoint space's
	// slabs of g it writes.
	ckCands      []*checkpoint
	ckSlots      []int32
	ckFrom, ckTo [MaxCacheGroups][]int32
	// drop is slots of checkpoints dropped from the tier because their
	// page left the index: quarantined, filled with fill and then freed.
	drop []int32
	// fill is the recycled slots to fill before the copy (items' slots
	// and surplus), surplus those of them no item uses, freed once filled.
	fill, surplus []int32
	fillOwners    []string // the domain that held each of fill last
	// after orders the copy after the engine's work (the zero Ordering:
	// all of it, as the scrub of evicted pages is).
	after cudaops.Ordering
	// err is the copy's outcome, set by runTierWrite; bad the recycled
	// slots that did not hold their canary once filled (the canary
	// policy checks every slot before anything is written to it), which
	// fail the whole write before it copies anything.
	err error
	bad []int32
}

func (w *tierWrite) reset() {
	clear(w.cands)
	clear(w.items)
	clear(w.ckCands)
	*w = tierWrite{cands: w.cands[:0], candPages: w.candPages[:0], items: w.items[:0], pages: w.pages[:0],
		slots: w.slots[:0], fill: w.fill[:0], surplus: w.surplus[:0], bad: w.bad[:0], fillOwners: w.fillOwners[:0],
		ckCands: w.ckCands[:0], ckSlots: w.ckSlots[:0], drop: w.drop[:0], ckFrom: w.ckFrom, ckTo: w.ckTo}
	for gi := range w.ckFrom {
		w.ckFrom[gi], w.ckTo[gi] = w.ckFrom[gi][:0], w.ckTo[gi][:0]
	}
}

// empty reports whether w has nothing to run.
func (w *tierWrite) empty() bool { return len(w.items) == 0 && len(w.fill) == 0 && len(w.drop) == 0 }

// offerLocked is the eviction hook: e's device page is being evicted.
// It reports whether e stays in the prefix index, its device page gone
// from it: the tier holds it already (it becomes the tier's most
// recently used) or is writing it, or w takes it as a candidate to write
// (placeOffloadLocked decides). Without a tier, or with w nil (the cache
// is being cleared), e leaves, and the caller drops it.
func (p *Pool) offerLocked(e *cacheEntry, w *tierWrite) bool {
	t := p.tier
	if t == nil || w == nil {
		return false
	}
	if it := e.tier; it != nil {
		t.touch(it)
	} else {
		w.cands = append(w.cands, e)
		w.candPages = append(w.candPages, e.page)
	}
	p.mu.prefix.detachPage(e)
	return true
}

// placeOffloadLocked takes a slot for each of w's candidates, in device
// page order (so that adjacent pages go to adjacent slots and copy as
// one run), and makes it an item being written: its entry stays in the
// index, unusable by a match until the write lands. A candidate the tier
// cannot take (its domain at its bound with nothing to evict, everything
// else pinned or being written) leaves the index.
func (p *Pool) placeOffloadLocked(w *tierWrite) {
	p.placeCheckpointsLocked(w)
	if len(w.cands) == 0 {
		return
	}
	t := p.tier
	order := make([]int, len(w.cands))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return int(w.candPages[a] - w.candPages[b]) })
	start, first := len(w.slots), len(w.items) // one slot an item from here
	for _, i := range order {
		e, page := w.cands[i], w.candPages[i]
		slots, ok := p.takeSlotsLocked(spacePages, e.dom, 1, w)
		if !ok {
			t.stats.OffloadsDropped++
			if p.mu.events.enabled() {
				p.mu.events.gatherRemovedLocked(e.dom.Name, e.key, MediumDevice)
			}
			w.drop = p.dropEntryLocked(e, w.drop)
			continue
		}
		it := t.newItem(e.dom)
		it.entry, it.slot0[0] = e, slots[0]
		it.slots = it.slot0[:]
		e.tier = it
		w.items = append(w.items, it)
		w.pages = append(w.pages, page)
		w.slots = append(w.slots, slots[0])
	}
	// The slots came off the free stack one by one, in the order frees
	// left them there (a clear frees in LRU order, so a batch taken again
	// would come out reversed): hand them out ascending, in page order,
	// so that adjacent pages still copy into adjacent slots as one run,
	// here and when an admission copies the chain back.
	if placed := w.slots[start:]; !slices.IsSorted(placed) {
		slices.Sort(placed)
		for i, s := range placed {
			it := w.items[first+i]
			it.slot0[0] = s
			t.meta[s].owner = it.dom.ID // all writing: only their owners move
		}
	}
	clear(w.cands)
	w.cands, w.candPages = w.cands[:0], w.candPages[:0]
}

// offerCheckpointLocked is the eviction hook of a state checkpoint: the
// device evicts c (off the book, its pages unpinned, its units released
// into quarantine by the caller after this). With a checkpoint space in
// the tier and w, c becomes a candidate of w, still on its page but
// unusable until its copy lands (placeCheckpointsLocked decides), and it
// reports true; else false, and the caller takes it off its page.
func (p *Pool) offerCheckpointLocked(c *checkpoint, w *tierWrite) bool {
	if t := p.tier; t == nil || w == nil || t.sp[spaceCheckpoints].n == 0 {
		return false
	}
	w.ckCands = append(w.ckCands, c)
	return true
}

// placeCheckpointsLocked takes a checkpoint slot for each of w's
// checkpoint candidates and makes it an item being written, the copies
// of its units recorded; a candidate the tier cannot take (its domain at
// its bound with nothing to evict, everything else read) leaves its page.
func (p *Pool) placeCheckpointsLocked(w *tierWrite) {
	t := p.tier
	for _, c := range w.ckCands {
		units := c.units
		c.units = make([][]allocator.Handle, len(p.groups)) // the device's no more
		c.chain = nil                                       // it pins no page any more
		if c.last.ckpt != c {
			continue // its page left the index meanwhile (dropEntryLocked)
		}
		slots, ok := p.takeSlotsLocked(spaceCheckpoints, c.dom, 1, w)
		if !ok {
			t.stats.CheckpointsDropped++
			c.last.ckpt = nil
			p.mu.prefix.epoch++
			continue
		}
		it := t.newItem(c.dom)
		it.space, it.ckpt, it.slot0[0] = spaceCheckpoints, c, slots[0]
		it.slots = it.slot0[:]
		c.tier = it
		w.items = append(w.items, it)
		w.ckSlots = append(w.ckSlots, slots[0])
		local := int(slots[0] - t.sp[spaceCheckpoints].base)
		for gi, hs := range units {
			for j, h := range hs {
				w.ckFrom[gi] = append(w.ckFrom[gi], h.Page)
				w.ckTo[gi] = append(w.ckTo[gi], int32(local*t.ckptUnits[gi]+j))
			}
		}
	}
	clear(w.ckCands)
	w.ckCands = w.ckCands[:0]
}

// beginTierWriteLocked counts w, if it has anything to run, as work in
// flight until finishTierWriteLocked.
func (p *Pool) beginTierWriteLocked(w *tierWrite) {
	if p.tier != nil && !w.empty() {
		p.tier.busy++
	}
}

// runTierWrite fills w's recycled slots and copies its device pages into
// its slots, outside Pool.mu. A copy that fails (even half-way) leaves
// its slots filled again, unwritten: nothing half-copied stays.
func (p *Pool) runTierWrite(w *tierWrite) {
	t := p.tier
	t.fill(w.fill)
	t.fill(w.drop)
	if t.canary {
		for i, s := range w.fill {
			owner := ""
			if i < len(w.fillOwners) {
				owner = w.fillOwners[i]
			}
			if err := t.checkCanary(s, owner); err != nil {
				if w.bad = append(w.bad, s); w.err == nil {
					w.err = fmt.Errorf("a recycled host-tier slot was not filled: %w", err)
				}
			}
		}
	}
	if len(w.items) == 0 {
		return
	}
	if w.err != nil {
		t.fill(w.slots) // nothing was copied; the slots go back filled
		t.fill(w.ckSlots)
		return
	}
	start := monoNow()
	if len(w.pages) > 0 {
		w.err = t.copy(spacePages, 0, w.pages, w.slots, true, w.after)
	}
	for gi := range w.ckFrom {
		if w.err == nil && len(w.ckFrom[gi]) > 0 {
			w.err = t.copy(spaceCheckpoints, gi, w.ckFrom[gi], w.ckTo[gi], true, w.after)
		}
	}
	if w.err != nil {
		t.fill(w.slots)
		t.fill(w.ckSlots)
		return
	}
	t.offloadLatency.record(monoNow() - start)
}

// copy copies device pages of group gi to the unit indices units of
// space si's slabs of the group (toHost), or back: for the page space a
// unit is a slot, for the checkpoint space unit j of local slot s is
// s·checkpointUnits + j (tierSlab).
func (t *hostTier) copy(si, gi int, pages, units []int32, toHost bool, after cudaops.Ordering) error {
	sp := &t.sp[si]
	c := cudaops.HostCopy{Regions: sp.regions[gi], Host: sp.host[gi], Pages: pages, Slots: units}
	if toHost {
		return t.dev.CopyToHost(c, after)
	}
	return t.dev.CopyFromHost(c)
}

// finishTierWriteLocked ends w: each item whose copy landed becomes
// findable (its entry usable in the tier, its swap in the table), on the
// LRU lists, a cached page with a KVStored event of the host medium; the
// others' slots, filled again, return to the free list, and their
// entries leave the index. An item dropped meanwhile (ClearPrefixCache,
// Close) is quarantined instead, appended to fill for the caller to fill.
// It returns fill.
func (p *Pool) finishTierWriteLocked(w *tierWrite, fill []int32) []int32 {
	t := p.tier
	if t == nil || w.empty() {
		return fill
	}
	if len(w.bad) > 0 {
		// A fill that did not happen: the slots are retired and the pool
		// faulted, as a device page whose canary is gone.
		p.retireSlotsLocked(w)
	}
	p.freeFilledLocked(w.surplus)
	if len(w.drop) > 0 {
		p.freeFilledLocked(w.drop)
		p.tierIdleLocked(len(w.drop))
	}
	events := p.mu.events.enabled()
	failed := 0
	var stored []*cacheEntry // landed, for the events
	for i, it := range w.items {
		w.items[i] = nil
		if e := it.entry; e != nil && !it.doomed && events {
			// Its device page was evicted: reported once its tier copy is
			// (or, failing, at once), see evictLocked.
			p.mu.events.gatherRemovedLocked(e.dom.Name, e.key, MediumDevice)
		}
		switch {
		case it.doomed:
			fill = p.releaseItemLocked(it, fill)
		case w.err != nil:
			failed += len(it.slots)
			switch {
			case it.swap != nil:
				t.stats.SwapsFailed++
			case it.ckpt != nil:
				t.stats.CheckpointsFailed++
			}
			fill = p.failedWriteLocked(it, fill)
		default:
			it.ready = true
			t.setState(it.slots, tierWriting, tierCached, 0)
			t.lruPush(it)
			if it.ckpt != nil {
				p.mu.prefix.epoch++ // usable now: a match may restore it
				t.domain(it.dom).storedCkpts++
				t.stats.CheckpointsStored++
				break
			}
			if e := it.entry; e != nil {
				p.mu.prefix.epoch++ // usable now: a match may reach further
				t.domain(it.dom).storedPages++
				t.stats.Offloads++
				t.stats.OffloadBytes += uint64(t.sp[spacePages].slotBytes)
				if events {
					stored = append(stored, e)
				}
				break
			}
			if old := t.swaps[it.swap.key]; old != nil {
				fill = p.dropItemLocked(old, fill)
			}
			t.swaps[it.swap.key] = it
			t.stats.SwapsOut++
			t.stats.SwapOutPages += uint64(len(it.slots))
		}
	}
	if w.err != nil && len(w.bad) == 0 {
		t.stats.OffloadsFailed += uint64(failed)
		p.log.LogAttrs(context.Background(), slog.LevelError, "kvcache: a copy into the host tier failed; its pages were not kept there",
			slog.Int("pages", failed), slog.Any("error", fmt.Errorf("%w: %w", ErrOffloadFailed, w.err)))
	}
	if events {
		p.emitStoredLocked(stored, MediumHost) // stored in the tier, then removed from the device
		p.mu.events.emitRemovedLocked(p.tpp)
	}
	p.tierIdleLocked(1)
	return fill
}

// failedWriteLocked ends an item whose copy failed: its slots were
// filled again (runTierWrite) and return to the free list (but for those
// retireSlotsLocked retired); it leaves the tier. An item its leaving
// drops (a checkpoint on its page) is appended to fill.
func (p *Pool) failedWriteLocked(it *tierItem, fill []int32) []int32 {
	t := p.tier
	it.doomed = true
	fill = p.unlinkItemLocked(it, fill)
	n := 0
	for _, s := range it.slots {
		if t.meta[s].state == tierWriting {
			it.slots[n] = s
			n++
		}
	}
	t.setState(it.slots[:n], tierWriting, tierQuarantined, 0)
	p.freeFilledLocked(it.slots[:n])
	t.domain(it.dom).sp[it.space].used -= len(it.slots)
	t.freeItem(it)
	return fill
}

// retireSlotsLocked retires w's recycled slots that failed their canary
// check (w.bad), whether an item of w was to hold them or they were
// surplus, and faults the pool.
func (p *Pool) retireSlotsLocked(w *tierWrite) {
	t := p.tier
	for _, s := range w.bad {
		switch t.meta[s].state {
		case tierWriting:
			t.setState([]int32{s}, tierWriting, tierRetired, 0)
		case tierQuarantined:
			t.setState([]int32{s}, tierQuarantined, tierRetired, 0)
			if i := slices.Index(w.surplus, s); i >= 0 {
				w.surplus = slices.Delete(w.surplus, i, i+1)
			}
		}
		t.stats.RetiredSlots++
	}
	p.q.RecordFaultLocked(w.err)
	p.faultedLocked()
	p.log.LogAttrs(context.Background(), slog.LevelError, "kvcache: canary mismatch in a filled host-tier slot; it is retired and the pool is faulted until ClearFault",
		slog.Int("slots_retired", len(w.bad)), slog.Any("error", w.err))
}

// emitStoredLocked reports entries stored on medium (the host tier, or
// the device again after an onload), in the order given: a KVStored event
// per run of pages that chain (each the parent of the next, of one domain
// and adapter, all with tokens or none).
func (p *Pool) emitStoredLocked(entries []*cacheEntry, medium Medium) {
	s := &p.mu.events
	for i := 0; i < len(entries); {
		j := i + 1
		for j < len(entries) && entries[j].parent == entries[j-1].key && entries[j].dom == entries[i].dom &&
			entries[j].adapter == entries[i].adapter && (entries[j].tokens == nil) == (entries[i].tokens == nil) {
			j++
		}
		run := entries[i:j]
		e := run[0]
		ev := KVEvent{Kind: KVStored, Medium: medium, Domain: e.dom.Name, Parent: e.parent, Adapter: p.mu.prefix.adapters[e.adapter],
			Keys: s.keysLocked(len(run)), Tokens: len(run) * p.tpp}
		var toks []int32
		for _, r := range run {
			ev.Keys = append(ev.Keys, r.key)
			toks = append(toks, r.tokens...)
		}
		if e.tokens != nil {
			ev.TokenIDs = s.tokensLocked(toks)
		}
		s.emitLocked(ev)
		i = j
	}
}

// swapKey names a swap: a request, in the domain it was preempted in.
type swapKey struct {
	dom *tenancy.Domain
	id  string
}

// tierSwap is a preempted request's private pages in the tier: its lease
// pages [first, first+len(slots)), which held its written tokens up to
// written, under the tenant, adapter and token IDs it was preempted with.
type tierSwap struct {
	key     swapKey
	tenant  *tenancy.Tenant
	adapter string
	first   int
	written int
	tokens  []int32 // the written tokens, tokens[:written]
}

// planSwapOutLocked plans Preempt's swap of l's private written pages
// (those from l.published up to the page holding token written − 1) to
// the tier, all or none, within its domain's bound, into w: the swap
// becomes findable when its write lands. It returns false, counting why,
// when the tier cannot take them all; w may then still hold fills to run
// (slots it recycled for nothing). tokens are the lease's written tokens.
func (p *Pool) planSwapOutLocked(l *Lease, tokens []int32, w *tierWrite) bool {
	t := p.tier
	written := len(tokens)
	first, to := l.published, p.pagesFor(written)
	if to <= first {
		return false // the prefix cache holds every written page
	}
	key := swapKey{dom: l.domain, id: l.id}
	if old := t.swaps[key]; old != nil {
		// An older swap of the same request: stale now. Its slots are
		// filled with the write's recycled ones and freed after.
		n := len(w.fill)
		w.fill = p.dropItemLocked(old, w.fill)
		w.surplus = append(w.surplus, w.fill[n:]...)
		for range len(w.fill) - n {
			w.fillOwners = append(w.fillOwners, l.domain.Name)
		}
		p.tierIdleLocked(len(w.fill) - n) // the write's work from here
		t.stats.SwapsEvicted++
	}
	slots, ok := p.takeSlotsLocked(spacePages, l.domain, to-first, w)
	if !ok {
		t.stats.SwapsFull++
		return false
	}
	it := t.newItem(l.domain)
	it.slots = slots
	it.swap = &tierSwap{key: key, tenant: l.tenant, adapter: l.adapter, first: first, written: written,
		tokens: slices.Clone(tokens)}
	w.items = append(w.items, it)
	for i, s := range slots {
		w.pages = append(w.pages, l.holds[0].pages[first+i])
		w.slots = append(w.slots, s)
	}
	return true
}
