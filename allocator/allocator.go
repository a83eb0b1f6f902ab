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
// Free pages sit on an intrusive LIFO list threaded through the per-page
// metadata, so Alloc and Clean are a pop and a push. A page's generation
// changes every time it leaves InUse, so a Handle kept past its release is
// detected as stale. Every page has an owner tag (the last owner stays
// recorded while the page is quarantined, for audit reports) and a
// reference count for pages shared by several holders.
//
// # Invariants (checked by Check)
//
//   - free + inUse + cached + quarantined + retired = N;
//   - the free list holds exactly the Free pages, each once;
//   - InUse pages have refs ≥ 1; every other state has refs = 0;
//   - InUse and Cached pages have a non-zero owner.
//
// # Concurrency
//
// An Allocator is not safe for concurrent use: its owner (a kvcache pool)
// serialises calls under its own lock. Batch operations validate the whole
// batch before changing anything, so an error leaves the allocator exactly
// as it was.
//
// Metadata is 16 bytes per page and steady-state calls do not allocate.
package allocator

import (
	"fmt"
	"math"
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

const noPage = -1

// pageMeta is the per-page record: 16 bytes.
type pageMeta struct {
	gen   uint32
	owner Owner
	next  int32 // free-list link, noPage at the end
	refs  uint16
	state State
	mark  uint8 // scratch for duplicate detection inside one call; 0 between calls
}

// Allocator is the page space [0, N).
type Allocator struct {
	pages    []pageMeta
	freeHead int32
	count    [numStates]int
}

// New returns an allocator of n pages, all free. Alloc hands out low page
// IDs first.
func New(n int) (*Allocator, error) {
	if n <= 0 || n > MaxPages {
		return nil, fmt.Errorf("%w: page count %d, want 1..%d", ErrInvalidArgument, n, MaxPages)
	}
	a := &Allocator{pages: make([]pageMeta, n), freeHead: 0}
	for i := range a.pages {
		a.pages[i].next = int32(i + 1)
	}
	a.pages[n-1].next = noPage
	a.count[Free] = n
	return a, nil
}

// Len returns N, the number of pages.
func (a *Allocator) Len() int { return len(a.pages) }

// Count returns how many pages are in state s.
func (a *Allocator) Count(s State) int {
	if s >= numStates {
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
	return PageInfo{State: m.state, Owner: m.owner, Gen: m.gen, Refs: int(m.refs)}, nil
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
	if n < 0 || owner == 0 {
		return dst, fmt.Errorf("%w: alloc of %d pages for owner %d", ErrInvalidArgument, n, owner)
	}
	if n > a.count[Free] {
		return dst, fmt.Errorf("%w: need %d, have %d of %d", ErrNoSpace, n, a.count[Free], len(a.pages))
	}
	for range n {
		p := a.freeHead
		m := &a.pages[p]
		a.freeHead = m.next
		m.next = noPage
		m.state = InUse
		m.owner = owner
		m.refs = 1
		dst = append(dst, Handle{Page: p, Gen: m.gen})
	}
	a.count[Free] -= n
	a.count[InUse] += n
	return dst, nil
}

// PeekFree appends to dst the first n pages Alloc would hand out next (or
// all free pages if fewer), without changing anything.
func (a *Allocator) PeekFree(dst []int32, n int) []int32 {
	for p := a.freeHead; p != noPage && n > 0; p = a.pages[p].next {
		dst = append(dst, p)
		n--
	}
	return dst
}

// validateHeld checks that every handle names a page in use by owner at the
// handle's generation, each page at most once. On error it leaves no marks
// behind; on success every page of hs is marked, and the caller's apply
// loop clears each mark as it passes (one pass less over the metadata).
func (a *Allocator) validateHeld(hs []Handle, owner Owner) error {
	var err error
	i := 0
	for ; i < len(hs); i++ {
		h := hs[i]
		if err = a.checkID(h.Page); err != nil {
			break
		}
		m := &a.pages[h.Page]
		switch {
		case m.mark != 0:
			err = fmt.Errorf("%w: page %d appears twice in one batch", ErrDoubleFree, h.Page)
		case m.state != InUse:
			err = fmt.Errorf("%w: page %d is %s", ErrDoubleFree, h.Page, m.state)
		case m.gen != h.Gen:
			err = fmt.Errorf("%w: page %d handle generation %d, page generation %d", ErrStaleHandle, h.Page, h.Gen, m.gen)
		case m.owner != owner:
			err = fmt.Errorf("%w: page %d owned by %d, released by %d", ErrNotOwner, h.Page, m.owner, owner)
		}
		if err != nil {
			break
		}
		m.mark = 1
	}
	if err != nil {
		for _, h := range hs[:i] {
			a.pages[h.Page].mark = 0
		}
	}
	return err
}

// Release drops owner's reference on each page. Pages whose last reference
// goes are quarantined (their generation advances) and appended to
// quarantined, which is returned. The batch is validated first: on error
// nothing changes.
func (a *Allocator) Release(quarantined []int32, hs []Handle, owner Owner) ([]int32, error) {
	if err := a.validateHeld(hs, owner); err != nil {
		return quarantined, err
	}
	for _, h := range hs {
		m := &a.pages[h.Page]
		m.mark = 0
		m.refs--
		if m.refs == 0 {
			m.state = Quarantined
			m.gen++
			a.count[InUse]--
			a.count[Quarantined]++
			quarantined = append(quarantined, h.Page)
		}
	}
	return quarantined, nil
}

// Retain adds a reference to a page that is in use or cached, for the same
// owner (pages are shared only inside one owner), and returns its current
// handle. A cached page becomes in use again.
func (a *Allocator) Retain(p int32, owner Owner) (Handle, error) {
	if err := a.checkID(p); err != nil {
		return Handle{}, err
	}
	m := &a.pages[p]
	switch {
	case m.state != InUse && m.state != Cached:
		return Handle{}, fmt.Errorf("%w: retain of page %d, which is %s", ErrWrongState, p, m.state)
	case m.owner != owner || owner == 0:
		return Handle{}, fmt.Errorf("%w: page %d owned by %d, retained by %d", ErrNotOwner, p, m.owner, owner)
	case m.refs == MaxRefs:
		return Handle{}, fmt.Errorf("%w: page %d has %d", ErrRefOverflow, p, m.refs)
	}
	if m.state == Cached {
		m.state = InUse
		a.count[Cached]--
		a.count[InUse]++
	}
	m.refs++
	return Handle{Page: p, Gen: m.gen}, nil
}

// Park drops owner's reference on each page like Release, but a page whose
// last reference goes becomes Cached (kept, immutable, still owned) instead
// of quarantined. Pages that became cached are appended to parked.
func (a *Allocator) Park(parked []int32, hs []Handle, owner Owner) ([]int32, error) {
	if err := a.validateHeld(hs, owner); err != nil {
		return parked, err
	}
	for _, h := range hs {
		m := &a.pages[h.Page]
		m.mark = 0
		m.refs--
		if m.refs == 0 {
			m.state = Cached
			a.count[InUse]--
			a.count[Cached]++
			parked = append(parked, h.Page)
		}
	}
	return parked, nil
}

// Evict quarantines cached pages (their generation advances). All pages
// must be cached: on error nothing changes.
func (a *Allocator) Evict(pages []int32) error {
	return a.transition(pages, Cached, Quarantined, "evict")
}

// Clean returns quarantined pages to the free list once their scrub has
// completed.
func (a *Allocator) Clean(pages []int32) error {
	return a.transition(pages, Quarantined, Free, "clean")
}

// Retire takes quarantined pages out of service for good (their scrub
// failed, or an audit found them written after free).
func (a *Allocator) Retire(pages []int32) error {
	return a.transition(pages, Quarantined, Retired, "retire")
}

// Unclean takes specific free pages back into quarantine, for a pool that
// must scrub them again (for example after a canary audit found another
// page of the same batch corrupt). All pages must be free.
func (a *Allocator) Unclean(pages []int32) error {
	if err := a.validateState(pages, Free, "unclean"); err != nil {
		return err
	}
	// validateState marked the pages: unlink them from the free list in
	// one pass, clearing the marks.
	prev := int32(noPage)
	for p := a.freeHead; p != noPage; {
		next := a.pages[p].next
		if a.pages[p].mark != 0 {
			if prev == noPage {
				a.freeHead = next
			} else {
				a.pages[prev].next = next
			}
			m := &a.pages[p]
			m.mark, m.next, m.state = 0, noPage, Quarantined
		} else {
			prev = p
		}
		p = next
	}
	a.count[Free] -= len(pages)
	a.count[Quarantined] += len(pages)
	return nil
}

// validateState checks that every page is in state from, each at most
// once. Like validateHeld it leaves the pages marked on success only.
func (a *Allocator) validateState(pages []int32, from State, op string) error {
	var err error
	i := 0
	for ; i < len(pages); i++ {
		p := pages[i]
		if err = a.checkID(p); err != nil {
			break
		}
		m := &a.pages[p]
		if m.mark != 0 {
			err = fmt.Errorf("%w: %s: page %d appears twice in one batch", ErrInvalidArgument, op, p)
			break
		}
		if m.state != from {
			err = fmt.Errorf("%w: %s of page %d, which is %s, not %s", ErrWrongState, op, p, m.state, from)
			break
		}
		m.mark = 1
	}
	if err != nil {
		for _, p := range pages[:i] {
			a.pages[p].mark = 0
		}
	}
	return err
}

func (a *Allocator) transition(pages []int32, from, to State, op string) error {
	if err := a.validateState(pages, from, op); err != nil {
		return err
	}
	// Push freed pages in reverse so that Alloc hands them out again in the
	// order given: a sorted batch comes back sorted, and fills coalesce.
	for i := len(pages) - 1; i >= 0; i-- {
		p := pages[i]
		m := &a.pages[p]
		m.mark = 0
		m.state = to
		switch to {
		case Free:
			m.next = a.freeHead
			a.freeHead = p
		case Quarantined:
			m.gen++
		}
	}
	a.count[from] -= len(pages)
	a.count[to] += len(pages)
	return nil
}

// Check verifies the accounting invariants listed in the package doc. It
// walks every page: O(N).
func (a *Allocator) Check() error {
	var seen [numStates]int
	for i := range a.pages {
		m := &a.pages[i]
		if m.state >= numStates {
			return fmt.Errorf("%w: page %d has state %d", ErrCorrupt, i, m.state)
		}
		if m.mark != 0 {
			return fmt.Errorf("%w: page %d left marked", ErrCorrupt, i)
		}
		seen[m.state]++
		switch m.state {
		case InUse:
			if m.refs == 0 {
				return fmt.Errorf("%w: page %d in use with no references", ErrCorrupt, i)
			}
		default:
			if m.refs != 0 {
				return fmt.Errorf("%w: page %d is %s with %d references", ErrCorrupt, i, m.state, m.refs)
			}
		}
		if (m.state == InUse || m.state == Cached) && m.owner == 0 {
			return fmt.Errorf("%w: page %d is %s without owner", ErrCorrupt, i, m.state)
		}
	}
	total := 0
	for s := range numStates {
		if seen[s] != a.count[s] {
			return fmt.Errorf("%w: %d pages %s, counter says %d", ErrCorrupt, seen[s], s, a.count[s])
		}
		total += seen[s]
	}
	if total != len(a.pages) {
		return fmt.Errorf("%w: states sum to %d of %d pages", ErrCorrupt, total, len(a.pages))
	}
	// Walk the free list, marking to catch cycles and duplicates.
	n, err := 0, error(nil)
	for p := a.freeHead; p != noPage; p = a.pages[p].next {
		if p < 0 || int(p) >= len(a.pages) {
			err = fmt.Errorf("%w: free list links to %d", ErrCorrupt, p)
			break
		}
		m := &a.pages[p]
		if m.mark != 0 {
			err = fmt.Errorf("%w: page %d twice on the free list", ErrCorrupt, p)
			break
		}
		if m.state != Free {
			err = fmt.Errorf("%w: page %d on the free list is %s", ErrCorrupt, p, m.state)
			break
		}
		m.mark = 1
		n++
	}
	for p := a.freeHead; p != noPage && p >= 0 && int(p) < len(a.pages) && a.pages[p].mark != 0; p = a.pages[p].next {
		a.pages[p].mark = 0
	}
	if err != nil {
		return err
	}
	if n != a.count[Free] {
		return fmt.Errorf("%w: free list has %d pages, counter says %d", ErrCorrupt, n, a.count[Free])
	}
	return nil
}
