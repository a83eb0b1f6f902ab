package kvcache

import (
	"fmt"
	"sync"
	"unsafe"
)

// This file lets a transport write an import's units itself, out of band
// (RDMA, UCX's remote memory access), instead of handing their bytes to
// WriteUnits: the import lends its units' memory (LendPages), the
// transport exposes it to the sender, and the units are summed and
// counted received where they landed (PageLoan.Landed) before Complete
// can vouch for them.

// PageLoan is the memory of an import's units, every group's, lent to a
// transport that writes them out of band: from LendPages until Return
// the lease is pinned, so the units stay the import's, in use at the
// generations it was admitted with, and every end of the import (Abort,
// the receiver's timeout, Close) waits for Return before it scrubs them.
type PageLoan struct {
	in   *Incoming
	runs []PageRun
	// unitParts[u] is unit u's memory, one slice per region of its group,
	// in order: a unit is summed over its regions, as WriteUnits sums it.
	unitParts [][][]byte
	// watch, once Watch has set it, has the scan's block sums (landing.go).
	watch *landingWatch

	mu struct {
		sync.Mutex
		landed   []bool
		returned bool
	}
}

// PageRun is a run of an import's units whose pages in one region lie
// one after the other in memory: units First … First+Units-1 of the
// import (numbered across groups, as HandoffExtents orders them), all of
// the group that region Region of the pool belongs to, whose pages in
// that region are Mem, Units × the region's page bytes long, unit First's
// first.
type PageRun struct {
	Region int
	First  int
	Units  int
	Mem    []byte
}

// Lendable reports whether LendPages can lend the import's units: the
// pool's pages are host memory. Otherwise write them with WriteUnits.
func (in *Incoming) Lendable() bool {
	_, ok := in.pool.dev.(pageViewer)
	return ok
}

// LendPages lends the memory of every unit of the import, in every
// group, for a transport to write the units' bytes into it: Runs lists
// it, region by region, adjacent pages in one run. It must come before
// any unit was received; from then on the units are claimed (WriteUnits
// of any of them fails with ErrDuplicatePage) until Landed counts them
// received or Return gives back those that never landed.
//
// The units are vetted and the lease pinned under Pool.mu exactly as
// WriteUnits does for a write: the import live and not being aborted,
// each unit in use at the generation the import was admitted with, held
// by this import alone and published nowhere. Errors are WriteUnits':
// ErrStaleTransfer for an import that has ended or a unit that is not its
// own, ErrDuplicatePage for one with units received (or lent) already,
// the pool's state (ErrPoolClosed, ErrPoolFaulted), ErrInvalidArgument on
// a pool whose pages are not host memory (see Lendable). None of them
// aborts the import, and on each nothing is lent or pinned.
func (in *Incoming) LendPages() (*PageLoan, error) {
	p := in.pool
	pv, ok := p.dev.(pageViewer)
	if !ok {
		return nil, fmt.Errorf("%w: the pool's device (%s) has no host memory to lend: write the units with WriteUnits", ErrInvalidArgument, p.dev.Name())
	}
	// The units are claimed first (in.mu is not held while Pool.mu is
	// taken: no lock order between the two), and given back if the loan
	// is refused.
	in.mu.Lock()
	for u, got := range in.mu.got {
		if got {
			in.mu.Unlock()
			return nil, fmt.Errorf("%w: unit %d of request %q was received before the units were lent", ErrDuplicatePage, u, in.lease.id)
		}
	}
	for u := range in.mu.got {
		in.mu.got[u] = true // claimed: lent, not received
	}
	in.mu.Unlock()
	unclaim := func() {
		in.mu.Lock()
		clear(in.mu.got)
		in.mu.Unlock()
	}
	if err := in.pin(in.units); err != nil {
		unclaim()
		return nil, err
	}
	l := &PageLoan{in: in, unitParts: make([][][]byte, len(in.units))}
	for u, unit := range in.units {
		g := &p.groups[unit.group]
		for r := g.first; r < g.first+g.count; r++ {
			rb := int(p.lay.regions[r].PageBytes)
			v := pv.PageBytes(r, unit.handle.Page)
			if len(v) != rb {
				p.unpin(in.lease)
				unclaim()
				return nil, fmt.Errorf("%w: page %d of group %q region %d: no memory to lend", ErrDevice, unit.handle.Page, g.name, r)
			}
			l.unitParts[u] = append(l.unitParts[u], v[:rb:rb]) // nothing past the page
		}
	}
	// Runs, region by region: a region's units are its group's, which
	// are numbered one after the other (HandoffExtents' order).
	first := 0
	for gi, e := range in.extents {
		g := &p.groups[gi]
		for k := range g.count {
			r := g.first + k
			rb := int(p.lay.regions[r].PageBytes)
			for u := first; u < first+e.Units; u++ {
				v := l.unitParts[u][k]
				if n := len(l.runs); n > 0 && l.runs[n-1].Region == r && follows(l.runs[n-1].Mem, v) {
					l.runs[n-1].Mem = extend(l.runs[n-1].Mem, rb)
					l.runs[n-1].Units++
					continue
				}
				l.runs = append(l.runs, PageRun{Region: r, First: u, Units: 1, Mem: v})
			}
		}
		first += e.Units
	}
	l.mu.landed = make([]bool, len(in.units))
	return l, nil
}

// follows reports whether b begins where a ends.
func follows(a, b []byte) bool {
	return len(a) > 0 && len(b) > 0 && uintptr(unsafe.Pointer(unsafe.SliceData(a)))+uintptr(len(a)) == uintptr(unsafe.Pointer(unsafe.SliceData(b)))
}

// extend returns a grown by n bytes of the memory that follows it: the
// caller knows it is the next page of the same region (follows), so of
// the same allocation.
func extend(a []byte, n int) []byte {
	return unsafe.Slice(unsafe.SliceData(a), len(a)+n)
}

// Runs lists the lent memory: every unit's page in every region of its
// group exactly once, region by region in the pool's order, each region's
// units in order, adjacent pages of a region in one run. The caller must
// not write the runs' memory after Return, nor use it for anything but
// the units' bytes.
func (l *PageLoan) Runs() []PageRun { return l.runs }

// Landed sums import units first … first+n-1 over the memory they were
// written into and counts them received: the transport says their bytes
// have landed, and what Complete checks is what the memory holds now. A
// unit lands once; a range outside the import is ErrInvalidArgument, a
// unit landed twice ErrDuplicatePage, a loan returned ErrStaleTransfer.
// None of them aborts the import (its abort would wait for Return): the
// caller returns the loan and then aborts. Landed may run concurrently
// with Landed of other units.
func (l *PageLoan) Landed(first, n int) error {
	in := l.in
	if first < 0 || n < 1 || first > len(in.units) || n > len(in.units)-first {
		return fmt.Errorf("%w: units [%d, %d) of an import of %d", ErrInvalidArgument, first, first+n, len(in.units))
	}
	l.mu.Lock()
	if l.mu.returned {
		l.mu.Unlock()
		return fmt.Errorf("%w: the units of request %q were given back", ErrStaleTransfer, in.lease.id)
	}
	for u := first; u < first+n; u++ {
		if l.mu.landed[u] {
			l.mu.Unlock()
			return fmt.Errorf("%w: unit %d of request %q landed twice", ErrDuplicatePage, u, in.lease.id)
		}
	}
	for u := first; u < first+n; u++ {
		l.mu.landed[u] = true
	}
	w := l.watch
	l.mu.Unlock()
	// Summed without a lock: the units are the import's until Return,
	// which is called only after the caller's last Landed has returned.
	sums := make([]uint64, n)
	for i := range sums {
		var known func(b int) (uint64, bool)
		if w != nil {
			known = w.known(first + i)
		}
		sums[i] = pageChecksumOf(l.unitParts[first+i], known)
	}
	in.mu.Lock()
	copy(in.mu.sums[first:], sums)
	in.mu.received += n
	in.mu.Unlock()
	return nil
}

// Return ends the loan: the transport no longer writes the memory (the
// caller has made sure of that: see the transport's revoke) and the lease
// is unpinned, so the import may end. Units that never landed are no
// longer claimed. Later calls do nothing; the caller must not call it
// while one of its Landed calls runs.
func (l *PageLoan) Return() {
	l.mu.Lock()
	if l.mu.returned {
		l.mu.Unlock()
		return
	}
	l.mu.returned = true
	landed := l.mu.landed
	if l.watch != nil {
		l.watch.stopped.Store(true)
	}
	l.mu.Unlock()
	in := l.in
	in.mu.Lock()
	for u, ok := range landed {
		if !ok {
			in.mu.got[u] = false
		}
	}
	in.mu.Unlock()
	in.pool.unpin(in.lease)
}
