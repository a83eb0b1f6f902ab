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
// The tier holds pages of the per-token group in the slots of its page
// space, numbered [0, HostTierConfig pages), and, in a pool with window
// or state groups, state checkpoints in the slots of its checkpoint
// space, numbered after them: a slot there holds a whole checkpoint, its
// units in every group but the per-token one. Each space is laid out
// region by region (tierSlab) in memory the device allocated for its
// copies (cudaops.HostCopier: page-locked on CUDA, Go memory on the
// Host), so that a run of adjacent pages of a region is one copy. The
// spaces share everything but their free stacks and LRU lists: states,
// items, fills, canary checks and the domains' bounds. A slot is in one
// state:
//
//	free ──take──▶ writing ──copy landed──▶ cached ──evict──▶ quarantined ──fill──▶ free
//	                  │                       │ ▲                                  └─canary──▶ retired
//	                  └──copy failed: fill────┤ └─ read by onloads (pinned)
//	                                          └──recycled: fill, then writing
//
// What holds slots is an item (tierItem): a cached page's one slot, under
// the entry of the prefix index it was published as (the same cacheEntry:
// its domain, key, parent and tokens), a preempted request's swapped
// pages (tierSwap), or a state checkpoint's one slot, on the entry of its
// last page (checkpoint.tier). Items that are written are on their
// space's LRU list and on their domain's there; eviction takes the least
// recently used item of the space no copy reads, of the domain that is at
// its bound first (TenantConfig.TierPages: the same share of each space),
// else of any domain. A slot an eviction frees
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
// neither does, taking a checkpoint in the tier at it along
// (dropEntryLocked): a checkpoint is reached only by a match that walked
// its whole prefix in its domain. A swap is found by its domain and
// request ID and is swapped back only for the same tenant, adapter and
// written tokens.
//
// # Invariants (checkLocked)
//
//   - free + writing + cached + quarantined + retired = slots, and the
//     free stacks hold exactly the free slots, each its space's;
//   - every cached slot belongs to one written item and every writing slot
//     to one item or copy in flight; quarantined slots are fills in flight;
//   - an item is on the LRU lists exactly when it is written and not
//     dropped (eviction passes over those copies read); each domain's use
//     is the slots of its items;
//   - an entry's tier item names it back, in its domain; a swap is in
//     the swap table under its own key; a checkpoint's item is the one
//     its page's entry holds, and that entry's page is on the device or
//     in the tier.
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
	// Checkpoints is, in a pool with sliding-window or state groups (and
	// only there), how many state checkpoints the tier keeps: at least
	// one, since a cached prefix of a hybrid model is of no use without
	// its checkpoint. Each takes a checkpoint's most units in every group
	// but the per-token one (Stats.Tier.CheckpointSlotBytes); with Bytes
	// they come first and the pages take the rest.
	Checkpoints int
	// NoSwap keeps Preempt from swapping a request's private pages to the
	// tier: it then keeps only what the prefix cache holds. A pool with
	// window or state groups never swaps: pages are of no use without the
	// state at their end, which Preempt keeps in a checkpoint, at a page
	// boundary, in the prefix cache.
	NoSwap bool
}

// enabled reports whether the config asks for a tier.
func (c HostTierConfig) enabled() bool { return c.Pages != 0 || c.Bytes != 0 || c.Checkpoints != 0 }

// maxTierSlots bounds the tier's slots as the allocator bounds pages.
const maxTierSlots = allocator.MaxPages

// slots validates c for a pool of layout lay and returns its page and
// checkpoint slots.
func (c HostTierConfig) slots(lay *layout) (pages, ckpts int, err error) {
	pageBytes, hybrid := lay.groups[0].pageBytes, lay.perLeaseGroups()
	switch {
	case c.Pages != 0 && c.Bytes != 0:
		return 0, 0, fmt.Errorf("%w: HostTier: set Pages (%d) or Bytes (%d), not both", ErrInvalidConfig, c.Pages, c.Bytes)
	case c.Pages < 0 || c.Bytes < 0 || c.Checkpoints < 0:
		return 0, 0, fmt.Errorf("%w: HostTier: negative size (Pages %d, Bytes %d, Checkpoints %d)", ErrInvalidConfig, c.Pages, c.Bytes, c.Checkpoints)
	case c.Pages == 0 && c.Bytes == 0:
		return 0, 0, fmt.Errorf("%w: HostTier: Checkpoints %d with no size: set Pages or Bytes", ErrInvalidConfig, c.Checkpoints)
	case !hybrid && c.Checkpoints != 0:
		return 0, 0, fmt.Errorf("%w: HostTier.Checkpoints = %d, but the pool has no window or state group to checkpoint", ErrInvalidConfig, c.Checkpoints)
	case hybrid && c.Checkpoints == 0:
		return 0, 0, fmt.Errorf("%w: %w: the host tier of a pool with the %s group(s) keeps the state checkpoints of its prefixes: "+
			"set HostTier.Checkpoints, how many it holds (%d bytes each)", ErrInvalidConfig, ErrTierUnsupported, lay.perLeaseNames(), checkpointSlotBytes(lay))
	case c.Checkpoints > maxTierSlots:
		return 0, 0, fmt.Errorf("%w: HostTier of %d checkpoints, above %d", ErrInvalidConfig, c.Checkpoints, maxTierSlots)
	}
	n := int64(c.Pages)
	if c.Bytes != 0 {
		ckptBytes := satMul(int64(c.Checkpoints), checkpointSlotBytes(lay))
		if n = (c.Bytes - min(ckptBytes, c.Bytes)) / pageBytes; n == 0 {
			return 0, 0, fmt.Errorf("%w: HostTier.Bytes %d holds no page of %d bytes beside %d checkpoints of %d",
				ErrInvalidConfig, c.Bytes, pageBytes, c.Checkpoints, checkpointSlotBytes(lay))
		}
	}
	if n+int64(c.Checkpoints) > maxTierSlots {
		return 0, 0, fmt.Errorf("%w: HostTier of %d pages and %d checkpoints, above %d slots", ErrInvalidConfig, n, c.Checkpoints, maxTierSlots)
	}
	return int(n), c.Checkpoints, nil
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

// The tier's slot spaces. A slot of spacePages holds one per-token page
// (every region of group 0); a slot of spaceCheckpoints one state
// checkpoint: its units in every group but the per-token one, as many as
// a checkpoint takes at most in each (checkpointUnits). Slots are
// numbered across spaces: spacePages's first, then spaceCheckpoints's.
const (
	spacePages = iota
	spaceCheckpoints
	numTierSpaces
)

// tierSlab is the host memory of one device region in a space: slot
// after slot, each units units of unitBytes (the region's PageBytes):
// unit j of local slot s at (s·units + j)·unitBytes, the layout of a
// cudaops.HostCopy whose slots are those unit indices.
type tierSlab struct {
	group, region int
	unitBytes     int64
	units         int
	mem           []byte
}

// part returns the slab's bytes of local slot s.
func (b *tierSlab) part(s int32) []byte {
	n := int64(b.units) * b.unitBytes
	return b.mem[int64(s)*n:][:n]
}

// tierSpace is one space's slots [base, base+n). Its free stack and LRU
// list are guarded by Pool.mu.
type tierSpace struct {
	base      int32
	n         int
	slotBytes int64
	slabs     []tierSlab
	// regions[g] and host[g] are the device regions of group g and its
	// slabs' memory, the Regions and Host of a cudaops.HostCopy of the
	// group's units (tierSlab; nil for a group not in the space).
	regions  [][]int
	host     [][][]byte
	free     []int32   // a stack: the next slot taken is last
	head     *tierItem // the LRU list, least recently used first
	tail     *tierItem
	lruSlots int
}

// tierSlot is a slot's metadata: its state and the domain whose page it
// holds or last held (for canary reports).
type tierSlot struct {
	state tierState
	owner allocator.Owner
}

// tierItem holds slots of one space: a cached page's one (entry set), a
// swap's (swap set), or a state checkpoint's one (ckpt set). Guarded by
// Pool.mu.
type tierItem struct {
	prev, next   *tierItem // its space's LRU list, least recently used first
	dprev, dnext *tierItem // its domain's in the space
	aprev, anext *tierItem // every live item, for Check
	dom          *tenancy.Domain
	entry        *cacheEntry
	swap         *tierSwap
	ckpt         *checkpoint
	slots        []int32
	slot0        [1]int32 // slots' array for a cached page or a checkpoint
	space        uint8
	// pins counts copies reading the item (onloads, restores); ready is
	// set once its slots are written; doomed marks an item dropped while
	// copies still read or write it: the last of them frees it.
	pins          int
	ready, doomed bool
	inLRU         bool
}

// tierDomain is one domain's part of the tier, indexed by domain ID − 1.
type tierDomain struct {
	sp                                  [numTierSpaces]domainSpace
	hitPages, storedPages, evictedPages uint64
	// checkpoints stored, restored (hits) and evicted
	storedCkpts, hitCkpts, evictedCkpts uint64
}

// domainSpace is a domain's part of one space.
type domainSpace struct {
	head, tail *tierItem // its LRU list
	lruSlots   int       // slots of the items on it
	used       int       // slots its items hold, written or being written
	bound      int       // the most it may hold (updateTierBoundsLocked)
}

// hostTier is the pool's host tier; nil in a pool without one.
type hostTier struct {
	// Set once in newHostTier.
	dev       cudaops.HostCopier
	mem       []byte // from dev.AllocHost: every space's slabs
	ckptUnits []int  // per group: the units a checkpoint slot holds (checkpointUnits)
	swapOn    bool
	spec      cudaops.FillSpec
	canary    bool

	// Guarded by Pool.mu.
	sp             [numTierSpaces]tierSpace
	meta           []tierSlot // every space's slots
	count          [numTierStates]int
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

// checkpointUnits is, per cache group, the units a state checkpoint takes
// at most there (a handoff's extents at a checkpoint past every window):
// 0 for the per-token group.
func checkpointUnits(lay *layout) []int {
	n := 0
	for _, g := range lay.groups {
		n = max(n, g.window)
	}
	n = (n/lay.tpp + 1) * lay.tpp // a page boundary past every window
	units := make([]int, len(lay.groups))
	for gi, e := range lay.handoffExtents(n) {
		if gi > 0 {
			units[gi] = e.Units
		}
	}
	return units
}

// checkpointSlotBytes is the host memory one checkpoint slot takes.
func checkpointSlotBytes(lay *layout) int64 {
	var n int64
	for gi, u := range checkpointUnits(lay) {
		n += int64(u) * lay.groups[gi].pageBytes
	}
	return n
}

// newHostTier builds the tier of pages page slots and ckpts checkpoint
// slots for p, or returns an error wrapping ErrTierUnsupported.
func newHostTier(p *Pool, c HostTierConfig, pages, ckpts int) (*hostTier, error) {
	hc, ok := p.dev.(cudaops.HostCopier)
	if !ok {
		return nil, fmt.Errorf("%w: %w: the device (%s) cannot copy pages to host memory (cudaops.HostCopier)", ErrInvalidConfig, ErrTierUnsupported, p.dev.Name())
	}
	t := &hostTier{dev: hc, swapOn: !c.NoSwap && !p.hybrid(),
		spec: p.q.Spec(), canary: p.q.NeedsVerify(), ckptUnits: checkpointUnits(p.lay),
		tenantPages: make(map[*tenancy.Tenant]int), swaps: make(map[swapKey]*tierItem)}
	t.sp[spacePages] = tierSpace{n: pages, slotBytes: p.groups[0].pageBytes}
	t.sp[spaceCheckpoints] = tierSpace{base: int32(pages), n: ckpts, slotBytes: checkpointSlotBytes(p.lay)}
	var total int64
	for si := range t.sp {
		total += int64(t.sp[si].n) * t.sp[si].slotBytes
	}
	mem, err := hc.AllocHost(total)
	if err != nil {
		return nil, fmt.Errorf("%w: host tier of %d pages and %d checkpoints (%d bytes): %w", ErrInvalidConfig, pages, ckpts, total, err)
	}
	t.mem = mem
	off := int64(0)
	for gi := range p.groups {
		g := &p.groups[gi]
		si, units := spacePages, 1
		if gi > 0 {
			si, units = spaceCheckpoints, t.ckptUnits[gi]
		}
		sp := &t.sp[si]
		if sp.n == 0 || units == 0 {
			continue
		}
		for k := range g.count {
			r := g.first + k
			rb := p.lay.regions[r].PageBytes
			n := int64(sp.n) * int64(units) * rb
			sp.slabs = append(sp.slabs, tierSlab{group: gi, region: r, unitBytes: rb, units: units, mem: mem[off : off+n : off+n]})
			off += n
		}
	}
	for si := range t.sp {
		sp := &t.sp[si]
		sp.regions, sp.host = make([][]int, len(p.groups)), make([][][]byte, len(p.groups))
		for _, b := range sp.slabs {
			sp.regions[b.group] = append(sp.regions[b.group], b.region)
			sp.host[b.group] = append(sp.host[b.group], b.mem)
		}
	}
	slots := pages + ckpts
	t.meta = make([]tierSlot, slots)
	for si := range t.sp {
		sp := &t.sp[si]
		sp.free = make([]int32, sp.n)
		for i := range sp.free {
			sp.free[i] = sp.base + int32(sp.n-1-i) // the space's first slot is taken first
		}
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

// space returns the space of slot s.
func (t *hostTier) space(s int32) *tierSpace {
	if s >= t.sp[spaceCheckpoints].base {
		return &t.sp[spaceCheckpoints]
	}
	return &t.sp[spacePages]
}

// parts calls f with each slab's bytes of slot s (the slab's index k in
// its space).
func (t *hostTier) parts(s int32, f func(k int, b []byte) bool) {
	sp := t.space(s)
	for k := range sp.slabs {
		if !f(k, sp.slabs[k].part(s-sp.base)) {
			return
		}
	}
}

// fill writes the scrub pattern over slots, outside Pool.mu: they are
// quarantined or being recycled, no one else's.
func (t *hostTier) fill(slots []int32) {
	if t.testSkipFill != nil {
		slots = t.testSkipFill(slots)
	}
	for _, s := range slots {
		w := t.spec.WordFor(s)
		t.parts(s, func(_ int, b []byte) bool {
			if len(b) >= streamingFillBytes {
				memfill.WordsStreaming(b, w)
			} else {
				memfill.Words(b, w)
			}
			return true
		})
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
	sp := t.space(s)
	var err error
	t.parts(s, func(k int, b []byte) bool {
		for off := 0; off < len(b); off += 4 {
			if got := binary.LittleEndian.Uint32(b[off:]); got != want {
				err = &isolation.CanaryError{Page: s, Region: sp.slabs[k].region, Offset: int64(off), Want: want, Got: got,
					PrevOwner: owner}
				return false
			}
		}
		return true
	})
	return err
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

// popFree takes n free slots of sp off its stack, ascending (so that a
// batch's copies run over adjacent slots where it can).
func (sp *tierSpace) popFree(dst []int32, n int) []int32 {
	start := len(dst)
	for range n {
		s := sp.free[len(sp.free)-1]
		sp.free = sp.free[:len(sp.free)-1]
		dst = append(dst, s)
	}
	slices.Sort(dst[start:])
	return dst
}

// pushFree returns filled slots to their spaces' free stacks, the first
// listed on top.
func (t *hostTier) pushFree(slots []int32) {
	for i := len(slots) - 1; i >= 0; i-- {
		sp := t.space(slots[i])
		sp.free = append(sp.free, slots[i])
	}
}

// domain returns d's part of the tier, growing the table for a new one.
func (t *hostTier) domain(d *tenancy.Domain) *tierDomain {
	for int(d.ID) > len(t.doms) {
		var td tierDomain
		for si := range td.sp {
			td.sp[si].bound = t.sp[si].n
		}
		t.doms = append(t.doms, td)
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

// lruPush makes it the most recently used item of its space and of its
// domain there.
func (t *hostTier) lruPush(it *tierItem) {
	sp := &t.sp[it.space]
	it.prev, it.next, it.inLRU = sp.tail, nil, true
	if sp.tail != nil {
		sp.tail.next = it
	} else {
		sp.head = it
	}
	sp.tail = it
	d := &t.domain(it.dom).sp[it.space]
	it.dprev, it.dnext = d.tail, nil
	if d.tail != nil {
		d.tail.dnext = it
	} else {
		d.head = it
	}
	d.tail = it
	sp.lruSlots += len(it.slots)
	d.lruSlots += len(it.slots)
}

func (t *hostTier) lruRemove(it *tierItem) {
	sp := &t.sp[it.space]
	if it.prev != nil {
		it.prev.next = it.next
	} else {
		sp.head = it.next
	}
	if it.next != nil {
		it.next.prev = it.prev
	} else {
		sp.tail = it.prev
	}
	d := &t.domain(it.dom).sp[it.space]
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
	sp.lruSlots -= len(it.slots)
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
// its entry (a checkpoint's page) is not matched by the admission that
// evicts.
func (it *tierItem) evictable() bool {
	switch {
	case it.pins > 0:
		return false
	case it.entry != nil:
		return !it.entry.pinned
	case it.ckpt != nil:
		return !it.ckpt.last.pinned
	}
	return true
}

// unlinkItemLocked takes it out of what finds it: its entry no longer in
// the tier (and out of the prefix index if the device holds no copy
// either: then no lookup or walk reaches it, and a checkpoint in the tier
// at it goes too, its slot appended to fill), its swap out of the table,
// its checkpoint off its page. A cached page that was written leaves
// with a KVRemoved event.
func (p *Pool) unlinkItemLocked(it *tierItem, fill []int32) []int32 {
	t, x := p.tier, &p.mu.prefix
	if e := it.entry; e != nil {
		e.tier = nil
		x.epoch++ // a match holding e is stale: e is no longer in the tier
		if it.ready && p.mu.events.enabled() {
			p.mu.events.gatherRemovedLocked(e.dom.Name, e.key, MediumHost) // the caller emits
		}
		if e.page < 0 {
			fill = p.dropEntryLocked(e, fill) // neither the device nor the tier holds it
		}
		it.entry = nil
	}
	if sw := it.swap; sw != nil && t.swaps[sw.key] == it {
		delete(t.swaps, sw.key)
	}
	if c := it.ckpt; c != nil {
		if c.last.ckpt == c {
			c.last.ckpt = nil
		}
		x.epoch++     // a match holding c is stale
		it.ckpt = nil // c.tier stays: a restore that pinned it still reads it
	}
	return fill
}

// dropEntryLocked takes e, which neither the device nor the tier holds a
// page of any more, out of the prefix index, and with it a checkpoint in
// the tier at it (no match can reach it): its slot is appended to fill,
// quarantined, for the caller to fill (see releaseItemLocked).
func (p *Pool) dropEntryLocked(e *cacheEntry, fill []int32) []int32 {
	if c := e.ckpt; c != nil {
		if c.tier != nil {
			p.tier.domain(c.dom).evictedCkpts++
			p.tier.stats.CheckpointsEvicted++
			fill = p.dropItemLocked(c.tier, fill)
		}
		e.ckpt = nil // a checkpoint on its way to the tier stays off it
	}
	p.mu.prefix.drop(e) // last: e is a spare from here on
	return fill
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
	fill = p.unlinkItemLocked(it, fill)
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
	t.domain(it.dom).sp[it.space].used -= len(it.slots)
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

// takeSlotsLocked takes n slots of space si for a new item of dom, or
// none (ok false): free slots (verified under the canary policy) and the
// slots of the least recently used items of the space it evicts
// (recycled: appended to w.fill, to be filled before anything is written
// to them). It evicts from dom while dom would pass its bound in the
// space, then from any domain, and never an item whose entry is pinned
// (matched by the admission that evicts). The slots it returns are
// writing, owned by dom and counted in its use; recycled slots it does
// not use go to w.surplus, quarantined, which the caller frees once
// w.fill has run. A refusal changes nothing unless everything it could
// evict was pinned, or a canary check failed: then the items it evicted
// are gone, their slots surplus.
func (p *Pool) takeSlotsLocked(si int, dom *tenancy.Domain, n int, w *tierWrite) (slots []int32, ok bool) {
	t := p.tier
	sp, d := &t.sp[si], &t.domain(dom).sp[si]
	over := d.used + n - d.bound
	if n < 1 || n > sp.n || over > d.lruSlots || n > len(sp.free)+sp.lruSlots {
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
		w.fill = p.recycleItemLocked(it, w.fill, w)
	}
	for len(w.fill)-start+len(sp.free) < n {
		it := sp.head
		for it != nil && !it.evictable() {
			it = it.next
		}
		if it == nil {
			break
		}
		w.fill = p.recycleItemLocked(it, w.fill, w)
	}
	rec := w.fill[start:]
	for _, s := range rec {
		w.fillOwners = append(w.fillOwners, p.tenantsLocked().OwnerName(t.meta[s].owner))
	}
	slots = sp.popFree(nil, min(max(n-len(rec), 0), len(sp.free)))
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
// caller to fill before it writes them. A checkpoint whose page leaves
// the index with it goes too, its slot into w.drop.
func (p *Pool) recycleItemLocked(it *tierItem, rec []int32, w *tierWrite) []int32 {
	t := p.tier
	td := t.domain(it.dom)
	if it.ckpt != nil {
		td.evictedCkpts++
		t.stats.CheckpointsEvicted++
	} else {
		td.evictedPages += uint64(len(it.slots))
	}
	if it.swap != nil {
		t.stats.SwapsEvicted++
	}
	t.stats.EvictedSlots += uint64(len(it.slots))
	t.lruRemove(it)
	w.drop = p.unlinkItemLocked(it, w.drop)
	rec = append(rec, it.slots...)
	t.setState(it.slots, tierCached, tierWriting, 0)
	td.sp[it.space].used -= len(it.slots)
	t.freeItem(it)
	return rec
}

// updateTierBoundsLocked recomputes every domain's bounds from its
// tenants' TierPages: in the page space their sum, or the whole space
// while one of them sets none; in the checkpoint space the same share of
// its slots, rounded up.
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
		for si := range d.sp {
			d.sp[si].bound = t.sp[si].n
		}
		if !unbounded[dom] && dom.Tenants > 0 {
			all := t.sp[spacePages].n
			pages := min(all, sums[dom])
			d.sp[spacePages].bound = pages
			if all > 0 {
				n := t.sp[spaceCheckpoints].n
				d.sp[spaceCheckpoints].bound = int((int64(pages)*int64(n) + int64(all) - 1) / int64(all))
			}
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
	// Checkpoints first: a page leaving the index takes its checkpoint
	// with it, which must not be the next item of this walk.
	for _, ckpts := range []bool{true, false} {
		for it := t.all; it != nil; {
			next := it.anext
			if !it.doomed && (it.ckpt != nil) == ckpts {
				t.stats.EvictedSlots += uint64(len(it.slots))
				if ckpts {
					t.domain(it.dom).evictedCkpts++
					t.stats.CheckpointsEvicted++
				} else {
					t.domain(it.dom).evictedPages += uint64(len(it.slots))
				}
				fill = p.dropItemLocked(it, fill)
			}
			it = next
		}
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
	// Slots is the tier's size in slots: per-token pages (SlotBytes each)
	// and, in a pool with window or state groups, CheckpointSlots state
	// checkpoints (CheckpointSlotBytes each).
	// Slots = Free + Cached + Swapped + Checkpoints + InFlight +
	// Quarantined + Retired.
	Slots               int
	SlotBytes           int64
	CheckpointSlots     int
	CheckpointSlotBytes int64
	Free                int
	Cached              int // cached pages no copy reads
	Swapped             int // slots of preempted requests' swaps no copy reads
	Checkpoints         int // state checkpoints no copy reads
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
	// State checkpoints (a hybrid pool's): those the device evicted that
	// the tier stored (CheckpointsStored), had no room for
	// (CheckpointsDropped) or whose copy failed (CheckpointsFailed);
	// admissions that restored one from the tier (CheckpointsRestored,
	// CheckpointRestoreBytes), those whose copy failed
	// (CheckpointRestoresFailed: refused with ErrOnloadFailed), and the
	// checkpoints the tier evicted or dropped (CheckpointsEvicted: for
	// room, or their page left the cache).
	CheckpointsStored, CheckpointsDropped, CheckpointsFailed              uint64
	CheckpointsRestored, CheckpointRestoreBytes, CheckpointRestoresFailed uint64
	CheckpointsEvicted                                                    uint64
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
	s.Enabled, s.Slots, s.SlotBytes = true, len(t.meta), t.sp[spacePages].slotBytes
	s.CheckpointSlots, s.CheckpointSlotBytes = t.sp[spaceCheckpoints].n, t.sp[spaceCheckpoints].slotBytes
	s.Free, s.Quarantined, s.Retired = t.count[tierFree], t.count[tierQuarantined], t.count[tierRetired]
	s.InFlight = t.count[tierWriting] + t.reading
	for it := t.all; it != nil; it = it.anext {
		if it.ready && it.pins == 0 && !it.doomed {
			switch {
			case it.swap != nil:
				s.Swapped += len(it.slots)
			case it.ckpt != nil:
				s.Checkpoints += len(it.slots)
			default:
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
	slots := len(t.meta)
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
	if sum != slots || t.sp[spacePages].n+t.sp[spaceCheckpoints].n != slots {
		c.failf("host tier: free + writing + cached + quarantined + retired = %d, the tier has %d slots (%d pages, %d checkpoints)",
			sum, slots, t.sp[spacePages].n, t.sp[spaceCheckpoints].n)
	}
	seen := make([]bool, slots)
	free := 0
	for si := range t.sp {
		sp := &t.sp[si]
		for _, s := range sp.free {
			if s < sp.base || int(s) >= int(sp.base)+sp.n || seen[s] || t.meta[s].state != tierFree {
				c.failf("host tier: space %d's free stack holds slot %d: twice, not free, or not the space's", si, s)
				break
			}
			seen[s] = true
		}
		free += len(sp.free)
	}
	if free != t.count[tierFree] {
		c.failf("host tier: free stacks hold %d slots, %d are free", free, t.count[tierFree])
	}
	clear(seen)
	cached, writing, reading, items := 0, 0, 0, 0
	var lru [numTierSpaces]int
	used := make([][numTierSpaces]int, len(t.doms))
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
		if int(it.space) >= numTierSpaces {
			c.failf("host tier: an item of domain %q in space %d", it.dom.Name, it.space)
			continue
		}
		for _, s := range it.slots {
			if s < 0 || int(s) >= slots || seen[s] {
				c.failf("host tier: slot %d held twice", s)
				continue
			}
			seen[s] = true
			if m := t.meta[s]; m.state != want || m.owner != it.dom.ID || t.space(s) != &t.sp[it.space] {
				c.failf("host tier: slot %d of an item of domain %q in space %d is %d, owner %d", s, it.dom.Name, it.space, m.state, m.owner)
			}
		}
		if d := int(it.dom.ID) - 1; d < len(used) {
			used[d][it.space] += len(it.slots)
		}
		if it.inLRU != (it.ready && !it.doomed) {
			c.failf("host tier: an item of domain %q is on the LRU list %v, ready %v, dropped %v", it.dom.Name, it.inLRU, it.ready, it.doomed)
		}
		if it.inLRU {
			lru[it.space] += len(it.slots)
		}
		holders := 0
		for _, b := range []bool{it.entry != nil, it.swap != nil, it.ckpt != nil} {
			if b {
				holders++
			}
		}
		switch {
		case holders != 1 && !(it.doomed && holders == 0):
			c.failf("host tier: an item of domain %q holds %d of a cached page, a swap and a checkpoint", it.dom.Name, holders)
		case (it.ckpt != nil) != (it.space == spaceCheckpoints) && !it.doomed:
			c.failf("host tier: an item of domain %q in space %d, a checkpoint %v", it.dom.Name, it.space, it.ckpt != nil)
		case it.entry != nil && (it.entry.tier != it || it.entry.dom != it.dom || it.entry.spare || len(it.slots) != 1):
			c.failf("host tier: an item's entry (page %d) does not name it back in domain %q", it.entry.page, it.dom.Name)
		case it.swap != nil && it.ready && !it.doomed && t.swaps[it.swap.key] != it:
			c.failf("host tier: the swap of request %q is not in the swap table", it.swap.key.id)
		case it.ckpt != nil:
			k := it.ckpt
			if k.tier != it || k.last == nil || k.last.ckpt != k || k.last.spare || k.last.dom != it.dom || k.dom != it.dom || len(it.slots) != 1 {
				c.failf("host tier: a checkpoint of %d tokens in domain %q is not the one its page holds", k.tokens, it.dom.Name)
			} else if k.last.page < 0 && (k.last.tier == nil || k.last.tier.doomed) {
				c.failf("host tier: a checkpoint of %d tokens in domain %q hangs off a page neither the device nor the tier holds", k.tokens, it.dom.Name)
			}
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
	for si := range t.sp {
		sp := &t.sp[si]
		if lru[si] != sp.lruSlots {
			c.failf("host tier: space %d's LRU list holds %d slots, counted %d", si, lru[si], sp.lruSlots)
		}
	}
	for i := range t.doms {
		for si := range t.doms[i].sp {
			d := &t.doms[i].sp[si]
			if i < len(used) && d.used != used[i][si] {
				c.failf("host tier: domain %d uses %d slots of space %d, its items hold %d", i+1, d.used, si, used[i][si])
			}
			n, prev := 0, (*tierItem)(nil)
			for it := d.head; it != nil; it = it.dnext {
				if it.dprev != prev || int(it.dom.ID) != i+1 || !it.inLRU || int(it.space) != si {
					c.failf("host tier: domain %d's LRU list of space %d broken", i+1, si)
					break
				}
				n += len(it.slots)
				prev = it
			}
			if n != d.lruSlots || d.tail != prev {
				c.failf("host tier: domain %d's LRU list of space %d holds %d slots, counted %d", i+1, si, n, d.lruSlots)
			}
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
