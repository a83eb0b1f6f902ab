// Package allocator owns the page space of a kvfence pool: the integers
// [0, N) that name KV-cache pages. It knows nothing of devices, tenants or
// policy; it only keeps every page in exactly one state and moves pages
// between states on request, in O(1) per page whatever N is.
//
// # Model
//
// Each page is in one of five states:
//
//	Free ──Alloc──▶ InUse ──Release (last ref)──▶ Quarantined ──Clean──▶ Free
//	                  ▲  │                            │
//	             Retain  └──Park (last ref)──▶ Cached └──Retire──▶ Retired
//	                  └──────────Retain───────────┘ │
//	                                                └──Evict──▶ Quarantined
//
// Free pages sit on a stack of page IDs (an array, not a list threaded
// through the metadata: popping n pages reads n consecutive IDs, whose
// metadata loads are independent of each other and overlap, where a linked
// list makes each load wait for the one before). A page's generation
// changes every time it leaves InUse, so a Handle kept past its release is
// detected as stale. Every page has an owner tag (the last owner stays
// recorded while the page is quarantined, for audit reports) and a
// reference count for pages shared by several holders.
//
// # Invariants (checked by Check)
//
//   - free + inUse + cached + quarantined + retired = N;
//   - the free stack holds exactly the Free pages, each once;
//   - InUse pages have refs ≥ 1; every other state has refs = 0;
//   - InUse and Cached pages have a non-zero owner.
//
// # Concurrency
//
// An Allocator is not safe for concurrent use: its owner (a kvcache pool)
// serialises calls under its own lock. Batch operations check and apply
// each page in one pass over the metadata, and undo what they applied when
// a page fails its check, so an error leaves the allocator exactly as it
// was.
//
// Each page's metadata is its generation, its owner and one word that
// packs its state, reference count and a one-call mark, so that the batch
// loops check a page with three compares (generation, owner, word) and
// move it with one store; the loops call nothing, and build an error only
// after the page that failed. That is 12 bytes per page plus 4 for its
// slot on the free stack, and steady-state calls do not allocate.
package allocator

import (
	"fmt"
	"math"
	"slices"
)

// State is the lifecycle state of a page.
type State uint8

const (
	Free State = iota
	InUse
	Cached
	Quarantined
	Retired
	numStates
)

func (s State) String() string {
	switch s {
	case Free:
		return "free"
	case InUse:
		return "in use"
	case Cached:
		return "cached"
	case Quarantined:
		return "quarantined"
	case Retired:
		return "retired"
	}
	return fmt.Sprintf("State(%d)", uint8(s))
}

// Owner tags who holds a page. Zero means nobody and is never a valid owner
// of an allocation.
type Owner uint32

// MaxPages is the largest page space an Allocator can address: page IDs are
// int32 because paged-attention kernels read int32 block tables.
const MaxPages = math.MaxInt32

// MaxRefs is the largest reference count a page can carry.
const MaxRefs = math.MaxUint16

// Handle names one allocation of one page. It goes stale when the page is
// released.
type Handle struct {
	Page int32
	Gen  uint32
}

// PageInfo is a snapshot of one page's metadata.
type PageInfo struct {
	State State
	Owner Owner // the holder, or the last holder for a page no longer in use
	Gen   uint32
	Refs  int
}

// pageMeta is the per-page record: 12 bytes. The fields a batch checks
// and changes together share one word, so that a page is checked with
// three compares and moved with one store.
type pageMeta struct {
	gen   uint32
	owner Owner
	// word packs the rest: the reference count in bits 0–15, the state in
	// bits 16–23, and in bit 24 the mark, scratch of one call: a shared
	// page already seen in this Release or Park batch, or a page of an
	// Unclean batch or of Check's walk of the free stack. The mark is 0
	// between calls, and bits 25–31 always are.
	word uint32
}

const (
	refsMask   = 1<<16 - 1
	stateShift = 16
	markBit    = 1 << 24
)

// packed is the word of a page in state s with refs references, unmarked.
func packed(s State, refs uint16) uint32 { return uint32(s)<<stateShift | uint32(refs) }

func (m *pageMeta) state() State { return State(uint8(m.word >> stateShift)) }
func (m *pageMeta) refs() uint16 { return uint16(m.word & refsMask) }
func (m *pageMeta) marked() bool { return m.word&markBit != 0 }

// Allocator is the page space [0, N).
type Allocator struct {
	pages []pageMeta
	free  []int32 // the Free pages; Alloc pops from the end. Capacity N.
	// count is the pages in each state but Free: the free stack's length
	// is the free count, so count[Free] stays 0.
	count [numStates]int
}

// New returns an allocator of n pages, all free. Alloc hands out low page
// IDs first.
func New(n int) (*Allocator, error) {
	if n <= 0 || n > MaxPages {
		return nil, fmt.Errorf("%w: page count %d, want 1..%d", ErrInvalidArgument, n, MaxPages)
	}
	a := &Allocator{pages: make([]pageMeta, n), free: make([]int32, n)}
	for i := range a.free {
		a.free[i] = int32(n - 1 - i)
	}
	return a, nil
}

// Len returns N, the number of pages.
func (a *Allocator) Len() int { return len(a.pages) }

// Count returns how many pages are in state s.
func (a *Allocator) Count(s State) int {
	switch {
	case s == Free:
		return len(a.free)
	case s >= numStates:
		return 0
	}
	return a.count[s]
}

// Info returns the metadata of page p.
func (a *Allocator) Info(p int32) (PageInfo, error) {
	if err := a.checkID(p); err != nil {
		return PageInfo{}, err
	}
	m := &a.pages[p]
	return PageInfo{State: m.state(), Owner: m.owner, Gen: m.gen, Refs: int(m.refs())}, nil
}

func (a *Allocator) checkID(p int32) error {
	if p < 0 || int(p) >= len(a.pages) {
		return fmt.Errorf("%w: page %d outside [0, %d)", ErrInvalidArgument, p, len(a.pages))
	}
	return nil
}

// Alloc takes n free pages for owner, appends their handles to dst and
// returns the extended slice. It takes all n or none.
func (a *Allocator) Alloc(dst []Handle, n int, owner Owner) ([]Handle, error) {
	dst, _, err := a.alloc(dst, nil, n, owner, false)
	return dst, err
}

// AllocIDs is Alloc that also appends the pages' IDs, in the same order,
// to ids (a block table), in the same pass.
func (a *Allocator) AllocIDs(dst []Handle, ids []int32, n int, owner Owner) ([]Handle, []int32, error) {
	return a.alloc(dst, ids, n, owner, true)
}

func (a *Allocator) alloc(dst []Handle, ids []int32, n int, owner Owner, withIDs bool) ([]Handle, []int32, error) {
	if n < 0 || owner == 0 {
		return dst, ids, fmt.Errorf("%w: alloc of %d pages for owner %d", ErrInvalidArgument, n, owner)
	}
	top := len(a.free)
	if n > top {
		return dst, ids, fmt.Errorf("%w: need %d, have %d of %d", ErrNoSpace, n, top, len(a.pages))
	}
	base := len(dst)
	dst = slices.Grow(dst, n)[:base+n]
	out, meta := dst[base:], a.pages
	// The top of the stack first.
	taken := a.free[top-n : top]
	if withIDs {
		ib := len(ids)
		ids = slices.Grow(ids, n)[:ib+n]
		allocRunIDs(meta, taken, out, ids[ib:], owner)
	} else {
		allocRun(meta, taken, out, owner)
	}
	a.free = a.free[:top-n]
	a.count[InUse] += n
	return dst, ids, nil
}

// AllocOne takes the one page Alloc(dst, 1, owner) would take and returns
// its handle. It reports false, and changes nothing, when no page is free
// or owner is zero. It is small enough to inline into a one-page growth,
// which Alloc's batch machinery would double.
func (a *Allocator) AllocOne(owner Owner) (h Handle, ok bool) {
	n := len(a.free)
	if n == 0 || owner == 0 {
		return Handle{}, false
	}
	p := a.free[n-1]
	a.free = a.free[:n-1]
	m := &a.pages[p]
	m.owner, m.word = owner, packed(InUse, 1)
	a.count[InUse]++
	return Handle{Page: p, Gen: m.gen}, true
}

// allocRun gives each page of taken, from its end, to owner, and puts its
// handle in out (as long as taken). Like dropRun it calls nothing, and it
// is kept out of line (go:noinline): inlined into its caller, its loop
// state spills to the stack, which made it a third slower.
//
//go:noinline
func allocRun(meta []pageMeta, taken []int32, out []Handle, owner Owner) {
	out = out[:len(taken)]
	for k, i := 0, len(taken)-1; i >= 0; k, i = k+1, i-1 {
		p := taken[i]
		m := &meta[p]
		m.owner, m.word = owner, packed(InUse, 1)
		out[k] = Handle{Page: p, Gen: m.gen}
	}
}

// allocRunIDs is allocRun that also puts each page's ID in ids.
//
//go:noinline
func allocRunIDs(meta []pageMeta, taken []int32, out []Handle, ids []int32, owner Owner) {
	out, ids = out[:len(taken)], ids[:len(taken)]
	for k, i := 0, len(taken)-1; i >= 0; k, i = k+1, i-1 {
		p := taken[i]
		m := &meta[p]
		m.owner, m.word = owner, packed(InUse, 1)
		out[k] = Handle{Page: p, Gen: m.gen}
		ids[k] = p
	}
}

// PeekFree appends to dst the first n pages Alloc would hand out next (or
// all free pages if fewer), without changing anything.
func (a *Allocator) PeekFree(dst []int32, n int) []int32 {
	top := len(a.free)
	for k := top - 1; k >= max(0, top-n); k-- {
		dst = append(dst, a.free[k])
	}
	return dst
}

// heldErr says why handle h fails Release's and Park's check: the page
// is in use by owner at the handle's generation, and not already dropped
// by this batch (a private page's first drop changed its state; a shared
// page's set its mark). Only a failing handle gets here: the loop tests
// the same conditions inline.
func (a *Allocator) heldErr(h Handle, owner Owner) error {
	if err := a.checkID(h.Page); err != nil {
		return err
	}
	m := &a.pages[h.Page]
	switch {
	case m.marked():
		return fmt.Errorf("%w: page %d appears twice in one batch", ErrDoubleFree, h.Page)
	case m.state() != InUse:
		return fmt.Errorf("%w: page %d is %s", ErrDoubleFree, h.Page, m.state())
	case m.gen != h.Gen:
		return fmt.Errorf("%w: page %d handle generation %d, page generation %d", ErrStaleHandle, h.Page, h.Gen, m.gen)
	case m.owner != owner:
		return fmt.Errorf("%w: page %d owned by %d, released by %d", ErrNotOwner, h.Page, m.owner, owner)
	}
	return fmt.Errorf("%w: page %d in use with %d references", ErrCorrupt, h.Page, m.refs())
}

// drop drops owner's reference on each page of hs, checking and applying
// each page in one pass: a page whose last reference goes moves to to
// (Quarantined, its generation advancing, or Cached) and is appended to
// out. A page that fails its check undoes the batch so far.
func (a *Allocator) drop(out []int32, hs []Handle, owner Owner, to State) ([]int32, error) {
	start := len(out)
	out = slices.Grow(out, len(hs))
	moved := out[start : start+len(hs)]
	pages := a.pages
	var inc uint32 // the generation's step
	if to == Quarantined {
		inc = 1
	}
	applied, k := dropRun(pages, hs, moved, owner, packed(to, 0), inc)
	if applied < len(hs) {
		err := a.heldErr(hs[applied], owner)
		a.undoDrop(hs[:applied], to, inc)
		return out[:start], err
	}
	shared := k < applied
	a.count[InUse] -= k
	a.count[to] += k
	if shared { // only then is there a mark to clear
		for _, h := range hs {
			pages[h.Page].word &^= markBit
		}
	}
	return out[:start+k], nil
}

// dropRun is drop's pass: it drops a reference on each page of hs, in
// order, until one fails its check, and returns how many it dropped and
// how many of them moved (appended to moved[:k], whose length is at least
// len(hs)). A page whose last reference goes gets word gone and its
// generation advanced by inc; a shared page loses a reference and is
// marked. The common batch, every page held once, is dropPrivateRun's;
// this loop takes over at the first page that is not.
//
//go:noinline
func dropRun(pages []pageMeta, hs []Handle, moved []int32, owner Owner, gone, inc uint32) (applied, k int) {
	k = dropPrivateRun(pages, hs, moved, owner, gone, inc)
	if k == len(hs) {
		return k, k
	}
	moved = moved[:len(hs)]
	for i := k; i < len(hs); i++ {
		h := hs[i]
		p := uint(h.Page) // a negative page is a huge uint: out of range too
		if p >= uint(len(pages)) {
			return i, k
		}
		m := &pages[p]
		if m.gen != h.Gen || m.owner != owner {
			return i, k
		}
		if w := m.word; w == packed(InUse, 1) {
			m.word = gone
			m.gen += inc
			moved[k] = h.Page
			k++
		} else if w&^refsMask == packed(InUse, 0) && w&refsMask > 1 { // shared, first seen
			m.word = (w - 1) | markBit
		} else {
			return i, k
		}
	}
	return len(hs), k
}

// dropPrivateRun moves the pages of hs, in order, while each is in use
// by owner at the handle's generation with one reference, and returns how
// many it moved (moved[i] = hs[i].Page for each). Every moved page is one
// applied, so the loop keeps one index where dropRun keeps two, and one
// compare of the word tells a private page from all else: it calls
// nothing and is a third shorter than dropRun's loop.
func dropPrivateRun(pages []pageMeta, hs []Handle, moved []int32, owner Owner, gone, inc uint32) int {
	moved = moved[:len(hs)]
	for i, h := range hs {
		p := uint(h.Page)
		if p >= uint(len(pages)) {
			return i
		}
		m := &pages[p]
		if m.gen != h.Gen || m.owner != owner || m.word != packed(InUse, 1) {
			return i
		}
		m.word = gone
		m.gen += inc
		moved[i] = h.Page
	}
	return len(hs)
}

// undoDrop restores the pages of hs, which drop has just applied.
func (a *Allocator) undoDrop(hs []Handle, to State, inc uint32) {
	for i := len(hs) - 1; i >= 0; i-- {
		m := &a.pages[hs[i].Page]
		if m.marked() { // a shared page: one reference fewer
			m.word = (m.word &^ markBit) + 1
		} else { // its last reference went in this batch
			m.word = packed(InUse, 1)
			m.gen -= inc
		}
	}
}

// Release drops owner's reference on each page. Pages whose last reference
// goes are quarantined (their generation advances) and appended to
// quarantined, which is returned. On error nothing changes.
func (a *Allocator) Release(quarantined []int32, hs []Handle, owner Owner) ([]int32, error) {
	return a.drop(quarantined, hs, owner, Quarantined)
}

// Retain adds a reference to a page that is in use or cached, for the same
// owner (pages are shared only inside one owner), and returns its current
// handle. A cached page becomes in use again.
func (a *Allocator) Retain(p int32, owner Owner) (Handle, error) {
	if err := a.checkID(p); err != nil {
		return Handle{}, err
	}
	m := &a.pages[p]
	switch s := m.state(); {
	case s != InUse && s != Cached:
		return Handle{}, fmt.Errorf("%w: retain of page %d, which is %s", ErrWrongState, p, s)
	case m.owner != owner || owner == 0:
		return Handle{}, fmt.Errorf("%w: page %d owned by %d, retained by %d", ErrNotOwner, p, m.owner, owner)
	case m.refs() == MaxRefs:
		return Handle{}, fmt.Errorf("%w: page %d has %d", ErrRefOverflow, p, m.refs())
	case s == Cached:
		a.count[Cached]--
		a.count[InUse]++
	}
	m.word = packed(InUse, m.refs()+1)
	return Handle{Page: p, Gen: m.gen}, nil
}

// Park drops owner's reference on each page like Release, but a page whose
// last reference goes becomes Cached (kept, immutable, still owned) instead
// of quarantined. Pages that became cached are appended to parked.
func (a *Allocator) Park(parked []int32, hs []Handle, owner Owner) ([]int32, error) {
	return a.drop(parked, hs, owner, Cached)
}

// Evict quarantines cached pages (their generation advances). All pages
// must be cached: on error nothing changes.
func (a *Allocator) Evict(pages []int32) error {
	return a.transition(pages, Cached, Quarantined, "evict")
}

// Clean returns quarantined pages to the free list once their scrub has
// completed. All pages must be quarantined: on error nothing changes.
// Pages are pushed in reverse, so that Alloc hands them out again in the
// order given: a sorted batch comes back sorted, and fills coalesce.
func (a *Allocator) Clean(pages []int32) error {
	meta := a.pages
	top := len(a.free)
	if len(pages) > cap(a.free)-top { // more pages than are not free: one must fail
		return a.transition(pages, Quarantined, Free, "clean")
	}
	stack := a.free[top : top+len(pages)] // the stack's capacity is every page
	q := packed(Quarantined, 0)
	bad := -1
	for i := len(pages) - 1; i >= 0; i-- {
		p := uint(pages[i]) // a negative page is a huge uint: out of range too
		if p >= uint(len(meta)) || meta[p].word != q {
			bad = i
			break
		}
		meta[p].word = packed(Free, 0)
		stack[len(pages)-1-i] = int32(p)
	}
	if bad >= 0 {
		err := a.transitionErr(pages[bad:], Quarantined, Free, "clean")
		for _, p := range pages[bad+1:] {
			meta[p].word = q
		}
		return err
	}
	a.free = a.free[:top+len(pages)]
	a.count[Quarantined] -= len(pages)
	return nil
}

// Retire takes quarantined pages out of service for good (their scrub
// failed, or an audit found them written after free).
func (a *Allocator) Retire(pages []int32) error {
	return a.transition(pages, Quarantined, Retired, "retire")
}

// Unclean takes specific free pages back into quarantine, for a pool that
// must scrub them again (for example after a canary audit found another
// page of the same batch corrupt). All pages must be free. It is rare and
// walks the free stack: O(free pages).
func (a *Allocator) Unclean(pages []int32) error {
	for i, p := range pages {
		var err error
		switch {
		case a.checkID(p) != nil:
			err = a.checkID(p)
		case a.pages[p].marked():
			err = fmt.Errorf("%w: unclean: page %d appears twice in one batch", ErrInvalidArgument, p)
		case a.pages[p].state() != Free:
			err = fmt.Errorf("%w: unclean of page %d, which is %s, not %s", ErrWrongState, p, a.pages[p].state(), Free)
		}
		if err != nil {
			for _, q := range pages[:i] {
				a.pages[q].word &^= markBit
			}
			return err
		}
		a.pages[p].word |= markBit
	}
	kept := a.free[:0]
	for _, p := range a.free {
		if m := &a.pages[p]; m.marked() {
			m.word = packed(Quarantined, 0)
			continue
		}
		kept = append(kept, p)
	}
	a.free = kept
	a.count[Quarantined] += len(pages)
	return nil
}

// transition moves pages from state from to state to, checking and
// applying each page in one pass, in reverse (see Clean). A page that
// fails its check undoes the batch so far (a page given twice fails the
// second time: the first moved it out of from).
func (a *Allocator) transition(pages []int32, from, to State, op string) error {
	meta := a.pages
	var inc uint32
	if to == Quarantined {
		inc = 1
	}
	wf, wt := packed(from, 0), packed(to, 0)
	top := len(a.free)
	for i := len(pages) - 1; i >= 0; i-- {
		p := pages[i]
		if uint(p) >= uint(len(meta)) || meta[p].word != wf {
			err := a.transitionErr(pages[i:], from, to, op)
			for _, q := range pages[i+1:] {
				meta[q].word = wf
				meta[q].gen -= inc
			}
			if to == Free {
				a.free = a.free[:top]
			}
			return err
		}
		m := &meta[p]
		m.word = wt
		m.gen += inc
		if to == Free {
			a.free = append(a.free, p) // within capacity: every page
		}
	}
	a.count[from] -= len(pages)
	if to != Free { // the free stack's length is the free count
		a.count[to] += len(pages)
	}
	return nil
}

// transitionErr says why pages[0] fails transition's check; pages[1:]
// are the pages of the batch already moved.
func (a *Allocator) transitionErr(pages []int32, from, to State, op string) error {
	p := pages[0]
	if err := a.checkID(p); err != nil {
		return err
	}
	if s := a.pages[p].state(); s != to || !slices.Contains(pages[1:], p) {
		return fmt.Errorf("%w: %s of page %d, which is %s, not %s", ErrWrongState, op, p, s, from)
	}
	return fmt.Errorf("%w: %s: page %d appears twice in one batch", ErrInvalidArgument, op, p)
}

// Check verifies the accounting invariants listed in the package doc. It
// walks every page: O(N).
func (a *Allocator) Check() error {
	var seen [numStates]int
	for i := range a.pages {
		m := &a.pages[i]
		s, refs := m.state(), m.refs()
		switch {
		case s >= numStates || m.word>>25 != 0:
			return fmt.Errorf("%w: page %d has state word %#x", ErrCorrupt, i, m.word)
		case m.marked():
			return fmt.Errorf("%w: page %d left marked", ErrCorrupt, i)
		case s == InUse && refs == 0:
			return fmt.Errorf("%w: page %d in use with no references", ErrCorrupt, i)
		case s != InUse && refs != 0:
			return fmt.Errorf("%w: page %d is %s with %d references", ErrCorrupt, i, s, refs)
		case (s == InUse || s == Cached) && m.owner == 0:
			return fmt.Errorf("%w: page %d is %s without owner", ErrCorrupt, i, s)
		}
		seen[s]++
	}
	total := 0
	for s := range numStates {
		if seen[s] != a.Count(s) {
			return fmt.Errorf("%w: %d pages %s, counter says %d", ErrCorrupt, seen[s], s, a.Count(s))
		}
		total += seen[s]
	}
	if total != len(a.pages) {
		return fmt.Errorf("%w: states sum to %d of %d pages", ErrCorrupt, total, len(a.pages))
	}
	// Walk the free stack, marking to catch duplicates.
	var err error
	n := 0
	for _, p := range a.free {
		if p < 0 || int(p) >= len(a.pages) {
			err = fmt.Errorf("%w: free stack holds page %d", ErrCorrupt, p)
			break
		}
		m := &a.pages[p]
		if m.marked() {
			err = fmt.Errorf("%w: page %d twice on the free stack", ErrCorrupt, p)
			break
		}
		if m.state() != Free {
			err = fmt.Errorf("%w: page %d on the free stack is %s", ErrCorrupt, p, m.state())
			break
		}
		m.word |= markBit
		n++
	}
	for _, p := range a.free[:n] {
		a.pages[p].word &^= markBit
	}
	return err
}
