package kvcache

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"slices"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/internal/memfill"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// This file is the host tier: a second page space in host memory under
// the pool (Config.HostTier), where cached pages the device's LRU evicts
// are kept instead of dropped, and where Preempt swaps a request's private
// pages. tier_offload.go writes pages into it (eviction → offload, and the
// swap of a preemption), tier_onload.go copies them back into fresh device
// pages of an admission (match → onload, and the swap back).
//
// # Model
//
// The tier holds pages of the per-token group, in slots numbered
// [0, HostTierConfig pages), laid out region by region in memory the
// device allocated for its copies (cudaops.HostCopier: page-locked on
// CUDA, Go memory on the Host). A slot is in one state:
//
//	free ──take──▶ writing ──copy landed──▶ cached ──evict──▶ quarantined ──fill──▶ free
//	                  │                       │ ▲                                  └─canary──▶ retired
//	                  └──copy failed: fill────┤ └─ read by onloads (pinned)
//	                                          └──recycled: fill, then writing
//
// What holds slots is an item (tierItem): a cached page's one slot, under
// the entry of the prefix index it was published as (the same cacheEntry:
// its domain, key, parent and tokens), or a preempted request's swapped
// pages (tierSwap). Items that are written are on the tier's LRU list
// and on their domain's; eviction takes the least recently used item no
// copy reads, of the domain that is at its bound first
// (TenantConfig.TierPages), else of any domain. A slot an eviction frees
// is filled with the pool's scrub policy before anything else is written
// to it or it returns to the free list, and under the canary policy a
// free slot is verified before it is taken: the same rule as the
// device's, in the same words (FillSpec.WordFor of the slot).
//
// # Isolation
//
// A cached page is found in the tier only through its entry in the
// prefix index, whose every lookup and trie walk is scoped by domain and
// compares the full key or the tokens: a tier page is never matched in
// another domain, nor under a key it was not written under, forged or
// colliding. An entry stays in the index while the device or the tier
// holds its page (cacheEntry.page, cacheEntry.tier) and leaves it when
// neither does. A swap is found by its domain and request ID and is
// swapped back only for the same tenant, adapter and written tokens.
//
// # Invariants (checkLocked)
//
//   - free + writing + cached + quarantined + retired = slots, and the
//     free stack holds exactly the free slots;
//   - every cached slot belongs to one written item and every writing slot
//     to one item or copy in flight; quarantined slots are fills in flight;
//   - an item is on the LRU lists exactly when it is written and not
//     dropped (eviction passes over those copies read); each domain's use
//     is the slots of its items;
//   - an entry's tier item names it back, in its domain; a swap is in
//     the swap table under its own key.
//
// All of it is guarded by Pool.mu; copies and fills run outside it, on
// slots no one else may touch in their state, counted in busy, which
// Close waits for.

// HostTierConfig configures the host tier. Set Pages (slots of one
// per-token page each) or Bytes (host memory, from which the slots are
// derived), or neither for no tier.
type HostTierConfig struct {
	Pages int
	Bytes int64
	// NoSwap keeps Preempt from swapping a request's private pages to the
	// tier: it then keeps only what the prefix cache holds.
	NoSwap bool
}

// enabled reports whether the config asks for a tier.
func (c HostTierConfig) enabled() bool { return c.Pages != 0 || c.Bytes != 0 }

// maxTierSlots bounds the tier's slots as the allocator bounds pages.
const maxTierSlots = allocator.MaxPages

// slots validates c for pages of pageBytes and returns its slots.
func (c HostTierConfig) slots(pageBytes int64) (int, error) {
	switch {
	case c.Pages != 0 && c.Bytes != 0:
		return 0, fmt.Errorf("%w: HostTier: set Pages (%d) or Bytes (%d), not both", ErrInvalidConfig, c.Pages, c.Bytes)
	case c.Pages < 0 || c.Bytes < 0:
		return 0, fmt.Errorf("%w: HostTier: negative size (Pages %d, Bytes %d)", ErrInvalidConfig, c.Pages, c.Bytes)
	}
	n := int64(c.Pages)
	if c.Bytes != 0 {
		n = c.Bytes / pageBytes
		if n == 0 {
			return 0, fmt.Errorf("%w: HostTier.Bytes %d holds no page of %d bytes", ErrInvalidConfig, c.Bytes, pageBytes)
		}
	}
	if n > maxTierSlots {
		return 0, fmt.Errorf("%w: HostTier of %d pages, above %d", ErrInvalidConfig, n, maxTierSlots)
	}
	return int(n), nil
}

// tierState is a slot's state.
type tierState uint8

const (
	tierFree tierState = iota
	tierWriting
	tierCached
	tierQuarantined
	tierRetired
	numTierStates
)

// tierSlot is a slot's metadata: its state and the domain whose page it
// holds or last held (for canary reports).
type tierSlot struct {
	state tierState
	owner allocator.Owner
}

// tierItem holds slots: a cached page's one (entry set) or a swap's
// (swap set). Guarded by Pool.mu.
type tierItem struct {
	prev, next   *tierItem // the tier's LRU list, least recently used first
	dprev, dnext *tierItem // its domain's
	aprev, anext *tierItem // every live item, for Check
	dom          *tenancy.Domain
	entry        *cacheEntry
	swap         *tierSwap
	slots        []int32
	slot0        [1]int32 // slots' array for a cached page
	// pins counts copies reading the item (onloads); ready is set once
	// its slots are written; doomed marks an item dropped while copies
	// still read or write it: the last of them frees it.
	pins          int
	ready, doomed bool
	inLRU         bool
}

// tierDomain is one domain's part of the tier, indexed by domain ID − 1.
type tierDomain struct {
	head, tail                          *tierItem // its LRU list
	lruSlots                            int       // slots of the items on it
	used                                int       // slots its items hold, written or being written
	bound                               int       // the most it may hold: the sum of its tenants' TierPages, the tier when none sets one
	hitPages, storedPages, evictedPages uint64
}

// hostTier is the pool's host tier; nil in a pool without one.
type hostTier struct {
	// Set once in newHostTier.
	dev       cudaops.HostCopier
	slots     int
	regions   []int   // the per-token group's device regions
	rpb       []int64 // their page bytes
	pageBytes int64
	mem       []byte   // from dev.AllocHost
	slabs     [][]byte // slabs[k]: region regions[k] of every slot
	swapOn    bool
	spec      cudaops.FillSpec
	canary    bool

	// Guarded by Pool.mu.
	meta           []tierSlot
	free           []int32 // a stack: the next slot taken is last
	count          [numTierStates]int
	head, tail     *tierItem // the LRU list
	lruSlots       int
	all            *tierItem // every live item
	items          int
	reading        int // slots of items copies read
	doms           []tierDomain
	tenantPages    map[*tenancy.Tenant]int // TierPages of each tenant that sets it
	swaps          map[swapKey]*tierItem
	spare          *tierItem
	busy           int     // copies and fills outside Pool.mu; Close waits for none
	pending        []int32 // slots a clear quarantined, for its caller to fill (takeTierPendingLocked)
	closed         bool
	stats          TierStats // counters only; states are counted at Stats
	offloadLatency fillHistogram
	onloadLatency  fillHistogram
	// testSkipFill, if set (by tests only), returns the slots a fill
	// writes of those it was given: a tier that skips scrubs.
	testSkipFill func(slots []int32) []int32
}

// newHostTier builds the tier of slots slots for p (group 0's regions),
// or returns an error wrapping ErrTierUnsupported.
func newHostTier(p *Pool, c HostTierConfig, slots int) (*hostTier, error) {
	hc, ok := p.dev.(cudaops.HostCopier)
	if !ok {
		return nil, fmt.Errorf("%w: %w: the device (%s) cannot copy pages to host memory (cudaops.HostCopier)", ErrInvalidConfig, ErrTierUnsupported, p.dev.Name())
	}
	g := &p.groups[0]
	t := &hostTier{dev: hc, slots: slots, pageBytes: g.pageBytes, swapOn: !c.NoSwap,
		spec: p.q.Spec(), canary: p.q.NeedsVerify(),
		tenantPages: make(map[*tenancy.Tenant]int), swaps: make(map[swapKey]*tierItem)}
	for k := range g.count {
		t.regions = append(t.regions, g.first+k)
		t.rpb = append(t.rpb, p.lay.regions[g.first+k].PageBytes)
	}
	mem, err := hc.AllocHost(int64(slots) * g.pageBytes)
	if err != nil {
		return nil, fmt.Errorf("%w: host tier of %d pages (%d bytes): %w", ErrInvalidConfig, slots, int64(slots)*g.pageBytes, err)
	}
	t.mem = mem
	off := int64(0)
	for _, rb := range t.rpb {
		n := int64(slots) * rb
		t.slabs = append(t.slabs, mem[off:off+n:off+n])
		off += n
	}
	t.meta = make([]tierSlot, slots)
	t.free = make([]int32, slots)
	for i := range t.free {
		t.free[i] = int32(slots - 1 - i) // slot 0 is taken first
	}
	t.count[tierFree] = slots
	// Host memory is whatever it was: fill every slot once, as a new
	// pool scrubs every page, so that a canary check of a free slot holds.
	all := make([]int32, slots)
	for i := range all {
		all[i] = int32(i)
	}
	t.fill(all)
	return t, nil
}

// slot returns region k's bytes of slot s.
func (t *hostTier) slot(k int, s int32) []byte {
	return t.slabs[k][int64(s)*t.rpb[k]:][:t.rpb[k]]
}

// fill writes the scrub pattern over slots, outside Pool.mu: they are
// quarantined or being recycled, no one else's.
func (t *hostTier) fill(slots []int32) {
	if t.testSkipFill != nil {
		slots = t.testSkipFill(slots)
	}
	for _, s := range slots {
		w := t.spec.WordFor(s)
		for k := range t.slabs {
			b := t.slot(k, s)
			if len(b) >= streamingFillBytes {
				memfill.WordsStreaming(b, w)
			} else {
				memfill.Words(b, w)
			}
		}
	}
}

// streamingFillBytes is the slot region from which a fill bypasses the
// cache: a filled slot is next written by a copy, not read.
const streamingFillBytes = 64 << 10

// verifyTierLocked checks, under the canary policy, that free slots
// about to be taken (still free) hold their canary in every byte: a slot
// written while free (a fill skipped, a stray write) is retired and the
// pool faulted. It returns the slots that passed, in slots' array.
func (p *Pool) verifyTierLocked(slots []int32) []int32 {
	t := p.tier
	if !t.canary {
		return slots
	}
	ok := slots[:0]
	var first error
	for _, s := range slots {
		if err := t.checkCanary(s, p.tenantsLocked().OwnerName(t.meta[s].owner)); err != nil {
			t.setState([]int32{s}, tierFree, tierRetired, 0)
			t.stats.RetiredSlots++
			if first == nil {
				first = err
			}
			continue
		}
		ok = append(ok, s)
	}
	if first != nil {
		err := fmt.Errorf("a free host-tier slot was written: %w", first)
		p.q.RecordFaultLocked(err)
		p.faultedLocked()
		p.log.LogAttrs(context.Background(), slog.LevelError, "kvcache: canary mismatch in a free host-tier slot; it is retired and the pool is faulted until ClearFault",
			slog.Int("slots_retired", len(slots)-len(ok)), slog.Any("error", err))
	}
	return ok
}

// checkCanary compares slot s with its canary, under Pool.mu or by the
// copy that owns the slot. A mismatch is an *isolation.CanaryError that
// names owner, the domain that held the slot last.
func (t *hostTier) checkCanary(s int32, owner string) error {
	want := t.spec.WordFor(s)
	for k := range t.slabs {
		b := t.slot(k, s)
		for off := 0; off < len(b); off += 4 {
			if got := binary.LittleEndian.Uint32(b[off:]); got != want {
				return &isolation.CanaryError{Page: s, Region: t.regions[k], Offset: int64(off), Want: want, Got: got,
					PrevOwner: owner}
			}
		}
	}
	return nil
}

// move counts n slots going from state a to b.
func (t *hostTier) move(a, b tierState, n int) {
	t.count[a] -= n
	t.count[b] += n
}

// setState moves slots from state from to state to (their metadata and
// the counts), owned by owner.
func (t *hostTier) setState(slots []int32, from, to tierState, owner allocator.Owner) {
	for _, s := range slots {
		m := &t.meta[s]
		if m.state != from {
			panic(fmt.Sprintf("kvcache: host-tier slot %d is %d, want %d", s, m.state, from))
		}
		m.state = to
		if owner != 0 {
			m.owner = owner
		}
	}
	t.move(from, to, len(slots))
}

// popFree takes n free slots off the stack, ascending (so that a batch's
// copies run over adjacent slots where it can).
func (t *hostTier) popFree(dst []int32, n int) []int32 {
	start := len(dst)
	for range n {
		s := t.free[len(t.free)-1]
		t.free = t.free[:len(t.free)-1]
		dst = append(dst, s)
	}
	slices.Sort(dst[start:])
	return dst
}

// pushFree returns filled slots to the free stack, the first listed on
// top.
func (t *hostTier) pushFree(slots []int32) {
	for i := len(slots) - 1; i >= 0; i-- {
		t.free = append(t.free, slots[i])
	}
}

// domain returns d's part of the tier, growing the table for a new one.
func (t *hostTier) domain(d *tenancy.Domain) *tierDomain {
	for int(d.ID) > len(t.doms) {
		t.doms = append(t.doms, tierDomain{bound: t.slots})
	}
	return &t.doms[d.ID-1]
}

// newItem returns a cleared item of dom, linked into the live list.
func (t *hostTier) newItem(dom *tenancy.Domain) *tierItem {
	it := t.spare
	if it == nil {
		it = new(tierItem)
	} else {
		t.spare = it.anext
		*it = tierItem{}
	}
	it.dom = dom
	it.anext = t.all
	if t.all != nil {
		t.all.aprev = it
	}
	t.all = it
	t.items++
	return it
}

// freeItem unlinks it from the live list and keeps it for reuse.
func (t *hostTier) freeItem(it *tierItem) {
	if it.aprev != nil {
		it.aprev.anext = it.anext
	} else {
		t.all = it.anext
	}
	if it.anext != nil {
		it.anext.aprev = it.aprev
	}
	t.items--
	*it = tierItem{anext: t.spare}
	t.spare = it
}

// lruPush makes it the most recently used item of the tier and of its
// domain.
func (t *hostTier) lruPush(it *tierItem) {
	it.prev, it.next, it.inLRU = t.tail, nil, true
	if t.tail != nil {
		t.tail.next = it
	} else {
		t.head = it
	}
	t.tail = it
	d := t.domain(it.dom)
	it.dprev, it.dnext = d.tail, nil
	if d.tail != nil {
		d.tail.dnext = it
	} else {
		d.head = it
	}
	d.tail = it
	t.lruSlots += len(it.slots)
	d.lruSlots += len(it.slots)
}

func (t *hostTier) lruRemove(it *tierItem) {
	if it.prev != nil {
		it.prev.next = it.next
	} else {
		t.head = it.next
	}
	if it.next != nil {
		it.next.prev = it.prev
	} else {
		t.tail = it.prev
	}
	d := t.domain(it.dom)
	if it.dprev != nil {
		it.dprev.dnext = it.dnext
	} else {
		d.head = it.dnext
	}
	if it.dnext != nil {
		it.dnext.dprev = it.dprev
	} else {
		d.tail = it.dprev
	}
	it.prev, it.next, it.dprev, it.dnext, it.inLRU = nil, nil, nil, nil, false
	t.lruSlots -= len(it.slots)
	d.lruSlots -= len(it.slots)
}

// touch makes a listed item the most recently used.
func (t *hostTier) touch(it *tierItem) {
	if it.inLRU {
		t.lruRemove(it)
		t.lruPush(it)
	}
}

// pin marks it read by one more copy. It keeps its place on the LRU
// lists (eviction passes over it while it is read): a page onloaded is
// the device's again, and its tier copy becomes the most recently used
// when the device evicts it next (offerLocked), not now.
func (t *hostTier) pin(it *tierItem) {
	if it.pins == 0 {
		t.reading += len(it.slots)
	}
	it.pins++
}

// unpinTierLocked ends a copy's read of it; once no copy reads it, if it
// was dropped meanwhile, its slots are quarantined and appended to fill
// (see releaseItemLocked).
func (p *Pool) unpinTierLocked(it *tierItem, fill []int32) []int32 {
	t := p.tier
	if it.pins--; it.pins > 0 {
		return fill
	}
	t.reading -= len(it.slots)
	if it.doomed {
		return p.releaseItemLocked(it, fill)
	}
	return fill
}

// evictable reports whether eviction may take it: no copy reads it and
// its entry is not matched by the admission that evicts.
func (it *tierItem) evictable() bool {
	return it.pins == 0 && (it.entry == nil || !it.entry.pinned)
}

// unlinkItemLocked takes it out of what finds it: its entry no longer in
// the tier (and out of the prefix index if the device holds no copy
// either: then no lookup or walk reaches it), its swap out of the table.
// A cached page that was written leaves with a KVRemoved event.
func (p *Pool) unlinkItemLocked(it *tierItem) {
	t, x := p.tier, &p.mu.prefix
	if e := it.entry; e != nil {
		e.tier = nil
		x.epoch++ // a match holding e is stale: e is no longer in the tier
		if it.ready && p.mu.events.enabled() {
			p.mu.events.gatherRemovedLocked(e.dom.Name, e.key, MediumHost) // the caller emits
		}
		if e.page < 0 {
			x.drop(e) // neither the device nor the tier holds it
		}
		it.entry = nil
	}
	if sw := it.swap; sw != nil && t.swaps[sw.key] == it {
		delete(t.swaps, sw.key)
	}
}

// dropItemLocked takes it out of the tier (unlinkItemLocked). Its slots
// go into quarantine, appended to fill for the caller to fill
// (scrubTier), unless copies still read or write them: then the last of
// those does (unpinTierLocked, finishTierWriteLocked).
func (p *Pool) dropItemLocked(it *tierItem, fill []int32) []int32 {
	if it.doomed {
		return fill
	}
	it.doomed = true
	if it.inLRU {
		p.tier.lruRemove(it)
	}
	p.unlinkItemLocked(it)
	if it.pins > 0 || !it.ready {
		return fill
	}
	return p.releaseItemLocked(it, fill)
}

// releaseItemLocked ends a dropped item no copy uses any more: its slots
// are quarantined, appended to fill and counted in busy until the
// caller's fill ends (cleanTierLocked); its domain's use shrinks.
func (p *Pool) releaseItemLocked(it *tierItem, fill []int32) []int32 {
	t := p.tier
	from := tierCached
	if !it.ready {
		from = tierWriting
	}
	t.setState(it.slots, from, tierQuarantined, 0)
	t.domain(it.dom).used -= len(it.slots)
	fill = append(fill, it.slots...)
	t.busy += len(it.slots)
	t.freeItem(it)
	return fill
}

// scrubTier fills quarantined slots (counted in busy) outside Pool.mu and
// returns them to the free list.
func (p *Pool) scrubTier(slots []int32) {
	if len(slots) == 0 {
		return
	}
	p.tier.fill(slots)
	p.mu.Lock()
	p.cleanTierLocked(slots)
	p.mu.Unlock()
}

// cleanTierLocked returns filled slots to the free list and ends their
// fill, counted in busy.
func (p *Pool) cleanTierLocked(slots []int32) {
	p.freeFilledLocked(slots)
	p.tierIdleLocked(len(slots))
}

// freeFilledLocked returns quarantined slots, filled, to the free list.
func (p *Pool) freeFilledLocked(slots []int32) {
	t := p.tier
	t.setState(slots, tierQuarantined, tierFree, 0)
	t.pushFree(slots)
	t.stats.ScrubbedSlots += uint64(len(slots))
}

// tierIdleLocked ends n units of work counted in busy.
func (p *Pool) tierIdleLocked(n int) {
	t := p.tier
	if t.busy -= n; t.busy == 0 && p.mu.closed {
		p.quiet.Broadcast()
	}
}

// takeSlotsLocked takes n slots for a new item of dom, or none (ok
// false): free slots (verified under the canary policy) and the slots of
// the least recently used items it evicts (recycled: appended to w.fill,
// to be filled before anything is written to them). It evicts from dom
// while dom would pass its bound, then from any domain, and never an
// item whose entry is pinned (matched by the admission that evicts). The
// slots it returns are writing, owned by dom and counted in its use;
// recycled slots it does not use go to w.surplus, quarantined, which the
// caller frees once w.fill has run. A refusal changes nothing unless
// everything it could evict was pinned, or a canary check failed: then
// the items it evicted are gone, their slots surplus.
func (p *Pool) takeSlotsLocked(dom *tenancy.Domain, n int, w *tierWrite) (slots []int32, ok bool) {
	t := p.tier
	d := t.domain(dom)
	over := d.used + n - d.bound
	if n < 1 || n > t.slots || over > d.lruSlots || n > len(t.free)+t.lruSlots {
		return nil, false // no eviction can make room
	}
	start := len(w.fill)
	for over > 0 {
		it := d.head
		for it != nil && !it.evictable() {
			it = it.dnext
		}
		if it == nil {
			break
		}
		over -= len(it.slots)
		w.fill = p.recycleItemLocked(it, w.fill)
	}
	for len(w.fill)-start+len(t.free) < n {
		it := t.head
		for it != nil && !it.evictable() {
			it = it.next
		}
		if it == nil {
			break
		}
		w.fill = p.recycleItemLocked(it, w.fill)
	}
	rec := w.fill[start:]
	for _, s := range rec {
		w.fillOwners = append(w.fillOwners, p.tenantsLocked().OwnerName(t.meta[s].owner))
	}
	slots = t.popFree(nil, min(max(n-len(rec), 0), len(t.free)))
	slots = p.verifyTierLocked(slots)
	t.setState(slots, tierFree, tierWriting, dom.ID)
	if len(rec)+len(slots) < n || over > 0 {
		t.setState(slots, tierWriting, tierFree, 0)
		t.pushFree(slots)
		t.setState(rec, tierWriting, tierQuarantined, 0)
		w.surplus = append(w.surplus, rec...)
		return nil, false
	}
	use := min(len(rec), n)
	t.setState(rec[:use], tierWriting, tierWriting, dom.ID)
	t.setState(rec[use:], tierWriting, tierQuarantined, 0)
	w.surplus = append(w.surplus, rec[use:]...)
	slots = append(slots, rec[:use]...)
	slices.Sort(slots)
	d.used += n
	return slots, true
}

// recycleItemLocked evicts it, an item on the LRU lists, for its slots:
// they are appended to rec, writing and no longer its domain's, for the
// caller to fill before it writes them.
func (p *Pool) recycleItemLocked(it *tierItem, rec []int32) []int32 {
	t := p.tier
	t.domain(it.dom).evictedPages += uint64(len(it.slots))
	t.stats.EvictedSlots += uint64(len(it.slots))
	if it.swap != nil {
		t.stats.SwapsEvicted++
	}
	t.lruRemove(it)
	p.unlinkItemLocked(it)
	rec = append(rec, it.slots...)
	t.setState(it.slots, tierCached, tierWriting, 0)
	t.domain(it.dom).used -= len(it.slots)
	t.freeItem(it)
	return rec
}

// updateTierBoundsLocked recomputes every domain's bound from its
// tenants' TierPages: their sum, or the whole tier while one of them sets
// none.
func (p *Pool) updateTierBoundsLocked() {
	t := p.tier
	if t == nil {
		return
	}
	sums := make(map[*tenancy.Domain]int)
	unbounded := make(map[*tenancy.Domain]bool)
	for _, tn := range p.tenantsLocked().Tenants() {
		if n, ok := t.tenantPages[tn]; ok {
			sums[tn.Domain] += n
		} else {
			unbounded[tn.Domain] = true
		}
	}
	for _, dom := range p.tenantsLocked().Domains() {
		d := t.domain(dom)
		d.bound = t.slots
		if !unbounded[dom] && dom.Tenants > 0 {
			d.bound = min(t.slots, sums[dom])
		}
	}
}

// setTierPagesLocked records tenant c's TierPages (after the tenant was
// added or updated).
func (p *Pool) setTierPagesLocked(c TenantConfig) {
	t := p.tier
	if t == nil {
		return
	}
	tn, err := p.tenantsLocked().Lookup(c.Name)
	if err != nil {
		return
	}
	if c.TierPages > 0 {
		t.tenantPages[tn] = c.TierPages
	} else {
		delete(t.tenantPages, tn)
	}
	p.updateTierBoundsLocked()
}

// clearTierLocked drops every item (ClearPrefixCache, Close) and returns
// the slots to fill.
func (p *Pool) clearTierLocked(fill []int32) []int32 {
	t := p.tier
	if t == nil {
		return fill
	}
	for it := t.all; it != nil; {
		next := it.anext
		if !it.doomed {
			t.stats.EvictedSlots += uint64(len(it.slots))
			t.domain(it.dom).evictedPages += uint64(len(it.slots))
			fill = p.dropItemLocked(it, fill)
		}
		it = next
	}
	return fill
}

// takeTierPendingLocked returns the slots clearLocked quarantined, for
// the caller to fill (scrubTier) once it lets go of Pool.mu.
func (p *Pool) takeTierPendingLocked() []int32 {
	t := p.tier
	if t == nil {
		return nil
	}
	fill := t.pending
	t.pending = nil
	return fill
}

// tierOnlyLocked lists the entries only the tier holds, for Check.
func (p *Pool) tierOnlyLocked() []*cacheEntry {
	t := p.tier
	if t == nil {
		return nil
	}
	var out []*cacheEntry
	for it := t.all; it != nil; it = it.anext {
		if e := it.entry; e != nil && e.page < 0 {
			out = append(out, e)
		}
	}
	return out
}

// closeTier frees the tier's memory once nothing uses it: Close calls it
// with every copy and fill ended, before the device closes.
func (p *Pool) closeTier() error {
	t := p.tier
	if t == nil || t.closed {
		return nil
	}
	t.closed = true
	if err := t.dev.FreeHost(t.mem); err != nil && !errors.Is(err, cudaops.ErrClosed) {
		return fmt.Errorf("%w: freeing the host tier: %w", ErrDevice, err)
	}
	return nil
}

// TierStats are the host tier's figures (Stats.Tier); Enabled is false,
// and the rest zero, in a pool without one.
type TierStats struct {
	Enabled bool
	// Slots is the tier's size in per-token pages, SlotBytes one slot.
	// Slots = Free + Cached + Swapped + InFlight + Quarantined + Retired.
	Slots     int
	SlotBytes int64
	Free      int
	Cached    int // cached pages no copy reads
	Swapped   int // slots of preempted requests' swaps no copy reads
	// InFlight is the slots copies write (offloads, swaps) or read
	// (onloads, swaps back).
	InFlight    int
	Quarantined int
	Retired     int
	// Offloads count the pages written into the tier (OffloadBytes their
	// bytes) by evictions; OffloadsDropped the evicted pages the tier had
	// no room for (everything pinned or being written, or their domain at
	// its bound with nothing to evict), OffloadsFailed those whose copy
	// failed. Onloads count the pages copied back into admissions' fresh
	// pages (OnloadBytes), OnloadsFailed those of admissions whose copy
	// failed (refused with ErrOnloadFailed).
	Offloads, OffloadBytes, OffloadsDropped, OffloadsFailed uint64
	Onloads, OnloadBytes, OnloadsFailed                     uint64
	// Swaps: preemptions that swapped (SwapsOut, SwapOutPages), those
	// refused for want of room (SwapsFull) or whose copy failed
	// (SwapsFailed), admissions that swapped a request back (SwapsIn,
	// SwapInPages), and swaps evicted or dropped unused (SwapsEvicted:
	// the tier needed the room, or the request came back with other
	// tokens, in another domain, or for another tenant).
	SwapsOut, SwapOutPages, SwapsFull, SwapsFailed uint64
	SwapsIn, SwapInPages, SwapsEvicted             uint64
	// EvictedSlots, ScrubbedSlots and RetiredSlots count slots the tier
	// evicted, filled with the scrub policy and retired (a canary
	// mismatch).
	EvictedSlots, ScrubbedSlots, RetiredSlots uint64
	// OffloadLatency and OnloadLatency time each batch's copy (bucket
	// bounds: FillLatencyBounds).
	OffloadLatency, OnloadLatency FillLatency
}

// tierStatsLocked returns the tier's figures.
func (p *Pool) tierStatsLocked() TierStats {
	t := p.tier
	if t == nil {
		return TierStats{}
	}
	s := t.stats
	s.Enabled, s.Slots, s.SlotBytes = true, t.slots, t.pageBytes
	s.Free, s.Quarantined, s.Retired = t.count[tierFree], t.count[tierQuarantined], t.count[tierRetired]
	s.InFlight = t.count[tierWriting] + t.reading
	for it := t.all; it != nil; it = it.anext {
		if it.ready && it.pins == 0 && !it.doomed {
			if it.swap != nil {
				s.Swapped += len(it.slots)
			} else {
				s.Cached += len(it.slots)
			}
		}
	}
	s.OffloadLatency, s.OnloadLatency = t.offloadLatency.snapshot(), t.onloadLatency.snapshot()
	return s
}

// checkTierLocked verifies the tier's invariants (see the model above).
func (p *Pool) checkTierLocked(c *checker) {
	t := p.tier
	if t == nil {
		return
	}
	var count [numTierStates]int
	for s, m := range t.meta {
		if m.state >= numTierStates {
			c.failf("host tier: slot %d in state %d", s, m.state)
			continue
		}
		count[m.state]++
	}
	if count != t.count {
		c.failf("host tier: slots by state %v, counted %v", count, t.count)
	}
	sum := 0
	for _, n := range t.count {
		sum += n
	}
	if sum != t.slots {
		c.failf("host tier: free + writing + cached + quarantined + retired = %d, the tier has %d slots", sum, t.slots)
	}
	seen := make([]bool, t.slots)
	for _, s := range t.free {
		if s < 0 || int(s) >= t.slots || seen[s] || t.meta[s].state != tierFree {
			c.failf("host tier: free stack holds slot %d twice or not free", s)
			break
		}
		seen[s] = true
	}
	if len(t.free) != t.count[tierFree] {
		c.failf("host tier: free stack holds %d slots, %d are free", len(t.free), t.count[tierFree])
	}
	clear(seen)
	cached, writing, reading, items, lru := 0, 0, 0, 0, 0
	used := make([]int, len(t.doms))
	for it := t.all; it != nil; it = it.anext {
		if items++; items > t.items {
			c.failf("host tier: the item list cycles")
			break
		}
		if it.doomed && it.pins == 0 && it.ready {
			c.failf("host tier: a dropped item no copy uses still holds %d slots", len(it.slots))
		}
		want := tierCached
		if !it.ready {
			want = tierWriting
			writing += len(it.slots)
		} else {
			cached += len(it.slots)
		}
		if it.pins > 0 {
			reading += len(it.slots)
		}
		for _, s := range it.slots {
			if s < 0 || int(s) >= t.slots || seen[s] {
				c.failf("host tier: slot %d held twice", s)
				continue
			}
			seen[s] = true
			if m := t.meta[s]; m.state != want || m.owner != it.dom.ID {
				c.failf("host tier: slot %d of an item of domain %q is %d, owner %d", s, it.dom.Name, m.state, m.owner)
			}
		}
		if d := int(it.dom.ID) - 1; d < len(used) {
			used[d] += len(it.slots)
		}
		if it.inLRU != (it.ready && !it.doomed) {
			c.failf("host tier: an item of domain %q is on the LRU list %v, ready %v, dropped %v", it.dom.Name, it.inLRU, it.ready, it.doomed)
		}
		if it.inLRU {
			lru += len(it.slots)
		}
		switch {
		case (it.entry == nil) == (it.swap == nil) && !it.doomed:
			c.failf("host tier: an item of domain %q holds a cached page and a swap, or neither", it.dom.Name)
		case it.entry != nil && (it.entry.tier != it || it.entry.dom != it.dom || it.entry.spare || len(it.slots) != 1):
			c.failf("host tier: an item's entry (page %d) does not name it back in domain %q", it.entry.page, it.dom.Name)
		case it.swap != nil && it.ready && !it.doomed && t.swaps[it.swap.key] != it:
			c.failf("host tier: the swap of request %q is not in the swap table", it.swap.key.id)
		}
	}
	if items != t.items {
		c.failf("host tier: %d live items, counted %d", items, t.items)
	}
	if cached != t.count[tierCached] {
		c.failf("host tier: items hold %d written slots, %d are cached", cached, t.count[tierCached])
	}
	if writing > t.count[tierWriting] {
		c.failf("host tier: items being written hold %d slots, only %d are writing", writing, t.count[tierWriting])
	}
	if reading != t.reading {
		c.failf("host tier: copies read %d slots, counted %d", reading, t.reading)
	}
	if lru != t.lruSlots {
		c.failf("host tier: the LRU list holds %d slots, counted %d", lru, t.lruSlots)
	}
	for i := range t.doms {
		d := &t.doms[i]
		if i < len(used) && d.used != used[i] {
			c.failf("host tier: domain %d uses %d slots, its items hold %d", i+1, d.used, used[i])
		}
		n, prev := 0, (*tierItem)(nil)
		for it := d.head; it != nil; it = it.dnext {
			if it.dprev != prev || int(it.dom.ID) != i+1 || !it.inLRU {
				c.failf("host tier: domain %d's LRU list broken", i+1)
				break
			}
			n += len(it.slots)
			prev = it
		}
		if n != d.lruSlots || d.tail != prev {
			c.failf("host tier: domain %d's LRU list holds %d slots, counted %d", i+1, n, d.lruSlots)
		}
	}
	for k, it := range t.swaps {
		if it.swap == nil || it.swap.key != k || it.doomed {
			c.failf("host tier: swap table entry %q holds another item", k.id)
		}
	}
	if t.busy < 0 {
		c.failf("host tier: %d copies and fills in flight", t.busy)
	}
}
