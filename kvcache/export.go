package kvcache

import (
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvfence/kvfence/cudaops"
)

// This file is the prefill side of a handoff: an exported lease (Outgoing)
// whose prompt's units, in every cache group (units.go), are read for a
// transfer. See phase.go for the state machine and its invariants.

// Outgoing is an exported lease: the prompt's units pinned for a transfer
// until Ack, Abort or the reclaim deadline.
type Outgoing struct {
	pool    *Pool
	lease   *Lease
	seq     uint64 // the lease incarnation this export belongs to
	extents []HandoffExtent
	units   []handoffUnit
	// timer reclaims the pages at the deadline. Set under Pool.mu before
	// Export returns; the lease's end stops it.
	timer *time.Timer

	checksum struct {
		sync.Mutex
		done  bool
		value uint32
	}
}

// Export pins a prefilled lease's prompt units, in every cache group, for
// a transfer. They stay pinned until Ack or Abort, or until reclaimAt,
// when they are released through the scrubber whatever the transfer's
// state. A lease that is not prefilled, or whose watermark is not its
// prompt, is refused with ErrLeasePhase and left as it was. Export reads
// no page: the content checksum comes from Checksum (one pass over the
// units) or from a sender that sums the units as it reads them to send
// them.
//
// A sliding window must hold the prompt's window: the pages a lease that
// slid past it scrubbed are gone. A lease exported at its prompt cannot
// have (SlideWindows slides to the written watermark), so this always
// holds.
func (l *Lease) Export(reclaimAt time.Time) (*Outgoing, error) {
	if err := l.live(); err != nil {
		return nil, err
	}
	p := l.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stateErrLocked(); err != nil {
		return nil, err
	}
	if err := l.live(); err != nil {
		return nil, err
	}
	// Sealing the watermark at exactly the prompt both checks it and stops
	// every later Commit: the pages are read and summed from here on.
	if ph := l.Phase(); ph != PhasePrefilled || !l.written.CompareAndSwap(int64(l.prompt), int64(l.prompt)|writeSealed) {
		return nil, fmt.Errorf("%w: lease %q is %v with %d of %d prompt tokens written; only a prefilled lease can be exported",
			ErrLeasePhase, l.id, ph, l.Written(), l.prompt)
	}
	l.phase.Store(uint32(PhaseExported))
	es := p.lay.handoffExtents(l.prompt)
	o := &Outgoing{pool: p, lease: l, seq: l.seq, extents: es, units: p.leaseUnitsLocked(l, es)}
	// The callback runs in its own goroutine and takes Pool.mu itself; it
	// ends only this export (o.owns), never a later incarnation.
	o.timer = time.AfterFunc(time.Until(reclaimAt), func() {
		p.endLease(l, o.owns, PhaseAborted, cudaops.Ordering{})
	})
	l.export = o
	return o, nil
}

// owns reports, under Pool.mu, whether the lease is still this export.
func (o *Outgoing) owns() bool {
	l := o.lease
	return l.state.Load() == leaseLive && l.seq == o.seq && Phase(l.phase.Load()) == PhaseExported
}

func (o *Outgoing) end(phase Phase) (bool, error) {
	o.timer.Stop()
	return o.pool.endLease(o.lease, o.owns, phase, cudaops.Ordering{})
}

// RequestID is the exported request's ID.
func (o *Outgoing) RequestID() string { return o.lease.id }

// Tenant is the exporting lease's tenant.
func (o *Outgoing) Tenant() string { return o.lease.Tenant() }

// Domain is the sharing domain the exporting lease was admitted in: the
// domain its pages belong to, whatever the tenant's domain is now.
func (o *Outgoing) Domain() string { return o.lease.Domain() }

// PromptTokens is the number of tokens whose KV the units hold.
func (o *Outgoing) PromptTokens() int { return o.lease.prompt }

// Extents returns the export's extents, one per cache group (a copy).
func (o *Outgoing) Extents() []HandoffExtent { return slices.Clone(o.extents) }

// Units is the number of exported units, every group's.
func (o *Outgoing) Units() int { return len(o.units) }

// UnitBytes is the size of unit u (over its group's regions); 0 for a
// unit out of range.
func (o *Outgoing) UnitBytes(u int) int64 {
	if u < 0 || u >= len(o.units) {
		return 0
	}
	return o.pool.groups[o.units[u].group].pageBytes
}

// Bytes is the size of every unit, summed: what a transfer moves.
func (o *Outgoing) Bytes() int64 {
	var b int64
	for _, e := range o.extents {
		b += int64(e.Units) * e.UnitBytes
	}
	return b
}

// Generations appends each exported unit's generation to dst, in unit
// order.
func (o *Outgoing) Generations(dst []uint32) []uint32 {
	for _, u := range o.units {
		dst = append(dst, u.handle.Gen)
	}
	return dst
}

// Checksum returns the content checksum of the exported units, reading
// each once on the first call (in parallel: see unitSums); later calls
// return the same value. It fails as ReadUnits does once the export has
// ended, unless the sum was already known.
func (o *Outgoing) Checksum() (uint32, error) {
	o.checksum.Lock()
	defer o.checksum.Unlock()
	if !o.checksum.done {
		sums, err := o.unitSums()
		if err != nil {
			return 0, err
		}
		o.checksum.value, o.checksum.done = ContentChecksum(sums), true
	}
	return o.checksum.value, nil
}

// unitSums reads every exported unit once and returns its checksum. The
// units are split among up to GOMAXPROCS workers in contiguous runs: a
// manifest that carries the checksum cannot leave before this pass ends,
// and the reads run in parallel (ReadUnits pins the lease, it does not
// hold the pool lock while copying). A unit larger than the read buffer
// is read in ranges and summed block by block.
func (o *Outgoing) unitSums() ([]uint64, error) {
	n := len(o.units)
	sums := make([]uint64, n)
	workers := min(runtime.GOMAXPROCS(0), 8, max(1, n))
	per := (n + workers - 1) / workers
	var g errgroup.Group
	for lo := 0; lo < n; lo += per {
		hi := min(n, lo+per)
		g.Go(func() error {
			var buf []byte
			var s UnitSummer
			for u := lo; u < hi; u++ {
				ub := o.UnitBytes(u)
				const chunk = 1 << 20 // a multiple of UnitRangeAlign
				if int64(cap(buf)) < min(ub, chunk) {
					buf = make([]byte, min(ub, chunk))
				}
				for off := int64(0); off < ub; {
					k := min(ub-off, chunk)
					b := buf[:k]
					var err error
					if k == ub {
						err = o.ReadUnits(u, b)
					} else {
						err = o.ReadUnitRange(u, off, b)
					}
					if err != nil {
						return err
					}
					s.Add(b)
					off += k
				}
				sums[u] = s.Sum()
			}
			return nil
		})
	}
	return sums, g.Wait()
}

// Geometry is the page geometry of the exporting pool; zero for a pool
// made from a CacheSpec.
func (o *Outgoing) Geometry() Geometry { return o.pool.geom }

// Spec is the cache spec of the exporting pool.
func (o *Outgoing) Spec() CacheSpec { return o.pool.Spec() }

// PageBytes is one page of the per-token group over all its regions.
func (o *Outgoing) PageBytes() int64 { return o.pool.PageBytes() }

// Live reports whether the units are still pinned for this export.
func (o *Outgoing) Live() bool {
	o.pool.mu.Lock()
	defer o.pool.mu.Unlock()
	return !o.pool.mu.closed && o.owns()
}

// ReadUnits copies exported units first, first+1, … into dst, whole, each
// unit's regions in order and one unit after the other, until dst is
// full: dst must end at a unit's end. A range outside the export, or a
// dst that ends inside a unit, is refused (ErrInvalidArgument) and copies
// nothing; so does an export that has ended (ErrReclaimed). Reads may run
// concurrently with each other and with the pool's other work: the pool
// lock is held only while the read is vetted, and the lease cannot be
// released until it is done.
func (o *Outgoing) ReadUnits(first int, dst []byte) error {
	p := o.pool
	n := p.unitsFor(o.units, first, len(dst))
	if n < 1 {
		return fmt.Errorf("%w: read of %d bytes at unit %d of %d does not end at a unit's end",
			ErrInvalidArgument, len(dst), first, len(o.units))
	}
	us := o.units[first : first+n]
	if err := o.pin(us); err != nil {
		return err
	}
	defer p.unpin(o.lease)
	return p.readUnits(us, dst)
}

// ReadUnitRange copies bytes [off, off+len(dst)) of exported unit u into
// dst, for a transfer that sends a unit in ranges (a state slot larger
// than a message). Errors are ReadUnits'; a range outside the unit, or
// empty, is ErrInvalidArgument.
func (o *Outgoing) ReadUnitRange(u int, off int64, dst []byte) error {
	p := o.pool
	if u < 0 || u >= len(o.units) || len(dst) == 0 || off < 0 || off > o.UnitBytes(u)-int64(len(dst)) {
		return fmt.Errorf("%w: read of %d bytes at offset %d of unit %d of %d (%d bytes)",
			ErrInvalidArgument, len(dst), off, u, len(o.units), o.UnitBytes(u))
	}
	us := o.units[u : u+1]
	if err := o.pin(us); err != nil {
		return err
	}
	defer p.unpin(o.lease)
	return p.readUnitRange(us[0], off, dst)
}

// pin vets the export and pins its lease for a read of us.
func (o *Outgoing) pin(us []handoffUnit) error {
	p := o.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := o.checkLocked(); err != nil {
		return err
	}
	return p.pinUnitsLocked(o.lease, us, false)
}

// pageViewer is a device whose pages are host memory a copy can read in
// place (cudaops.Host, and devices built on it).
type pageViewer interface {
	PageBytes(r int, p int32) []byte
}

// Viewable reports whether UnitViews can lend the exported units' memory
// (the pool's pages are host memory); otherwise copy them with ReadUnits.
func (o *Outgoing) Viewable() bool {
	_, ok := o.pool.dev.(pageViewer)
	return ok
}

// UnitViews is ReadUnits without the copy, for a transport that sends
// the units' memory itself: it appends to views the live memory of
// exported units first … first+n-1, one view per region of each unit, in
// order, and pins the lease until done is called. While pinned, the
// units are the export's as ReadUnits checks them (in use, at the
// generations exported), and every end of the lease (Ack, Abort, the
// reclaim deadline, Close) waits for done. The caller must call done
// exactly once, when nothing will read the views again, and must not
// write them; later calls of done do nothing. Errors are ReadUnits'
// (nothing is pinned then), and ErrInvalidArgument on a pool whose pages
// are not host memory (see Viewable).
func (o *Outgoing) UnitViews(first, n int, views [][]byte) (_ [][]byte, done func(), err error) {
	if first < 0 || n < 1 || first > len(o.units) || n > len(o.units)-first {
		return views, nil, fmt.Errorf("%w: view of %d units at unit %d of %d", ErrInvalidArgument, n, first, len(o.units))
	}
	return o.views(o.units[first:first+n], 0, -1, views)
}

// UnitRangeViews is UnitViews of bytes [off, off+n) of unit u: the views
// of the parts of its regions the range covers, in order.
func (o *Outgoing) UnitRangeViews(u int, off, n int64, views [][]byte) (_ [][]byte, done func(), err error) {
	if u < 0 || u >= len(o.units) || n < 1 || off < 0 || off > o.UnitBytes(u)-n {
		return views, nil, fmt.Errorf("%w: view of %d bytes at offset %d of unit %d of %d (%d bytes)",
			ErrInvalidArgument, n, off, u, len(o.units), o.UnitBytes(u))
	}
	return o.views(o.units[u:u+1], off, n, views)
}

// views lends the memory of us (bytes [off, off+n) of the one unit in us
// when n ≥ 0).
func (o *Outgoing) views(us []handoffUnit, off, n int64, views [][]byte) (_ [][]byte, done func(), err error) {
	p := o.pool
	pv, ok := p.dev.(pageViewer)
	if !ok {
		return views, nil, fmt.Errorf("%w: the pool's device (%s) has no host memory to view: copy with ReadUnits", ErrInvalidArgument, p.dev.Name())
	}
	if err := o.pin(us); err != nil {
		return views, nil, err
	}
	var once atomic.Bool
	done = func() {
		if once.CompareAndSwap(false, true) {
			p.unpin(o.lease)
		}
	}
	start := len(views)
	view := func(u handoffUnit, r int, roff, k int64) bool {
		v := pv.PageBytes(r, u.handle.Page)
		if int64(len(v)) != p.lay.regions[r].PageBytes {
			return false
		}
		v = v[roff : roff+k]
		views = append(views, v[:len(v):len(v)]) // nothing past the view
		return true
	}
	for _, u := range us {
		g := &p.groups[u.group]
		if n < 0 {
			for r := g.first; r < g.first+g.count; r++ {
				if !view(u, r, 0, p.lay.regions[r].PageBytes) {
					done()
					return views[:start], nil, fmt.Errorf("%w: page %d region %d: no memory to view", ErrDevice, u.handle.Page, r)
				}
			}
			continue
		}
		err := p.eachRegionPart(u.group, off, n, func(r int, roff, k, _ int64) error {
			if !view(u, r, roff, k) {
				return fmt.Errorf("%w: page %d region %d: no memory to view", ErrDevice, u.handle.Page, r)
			}
			return nil
		})
		if err != nil {
			done()
			return views[:start], nil, err
		}
	}
	return views, done, nil
}

func (o *Outgoing) checkLocked() error {
	o.pool.assertHeld()
	if o.pool.mu.closed {
		return ErrPoolClosed
	}
	if !o.owns() || o.lease.draining {
		return fmt.Errorf("%w: request %q", ErrReclaimed, o.lease.id)
	}
	return nil
}

// Ack ends the export after the receiver confirmed the import: the units
// are released through the scrubber. It returns ErrReclaimed if they had
// already been reclaimed.
func (o *Outgoing) Ack() error {
	ended, err := o.end(PhaseReleased)
	if err == nil && !ended {
		return fmt.Errorf("%w: request %q before its ack", ErrReclaimed, o.lease.id)
	}
	return err
}

// Abort ends the export now (the transfer failed and will not be
// retried): the units are released through the scrubber. Aborting an
// export that already ended, or a later export of the same Lease, does
// nothing.
func (o *Outgoing) Abort() error {
	_, err := o.end(PhaseAborted)
	return err
}
