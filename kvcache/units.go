package kvcache

import (
	"fmt"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
)

// Handoff units.
//
// A handoff moves a prompt's whole cache, every group of it, as a
// sequence of units: the pages (slots) of each group that hold the
// prompt's state, group by group in the spec's order (HandoffExtents):
//
//   - the per-token group: the prompt's pages, in token order;
//   - a sliding-window group: the ring pages still inside the window at
//     the prompt's end, oldest first, from logical page First on (pages
//     that slid out hold nothing the decode side needs);
//   - a state group: the lease's slot, one unit of every region.
//
// A unit's bytes are its page (slot) in every region of its group, in
// region order, UnitBytes long. Units are numbered from 0 across groups,
// and the content checksum folds one checksum per unit, in unit order
// (checksum.go). Both sides derive the extents from the prompt's length
// and the cache spec alone, so a sender and a receiver of the same spec
// agree on them; a handoff manifest carries them so that a receiver can
// refuse one that does not.
//
// Units move whole (ReadUnits, WriteUnits) or, a unit larger than a
// transport's message (a state slot is tens or hundreds of MiB), in
// ranges (ReadUnitRange, WriteUnitRangeFrom): a unit's ranges arrive in
// order, each starting at a multiple of UnitRangeAlign, so that the
// receiver sums the unit as its bytes land.

// UnitRangeAlign is the alignment of a unit range's offset: the block
// the content checksum hashes units in, so that a unit received in
// ranges is summed as it lands, each block once.
const UnitRangeAlign = checksumBlock

// HandoffExtent is one cache group's part of a handoff.
type HandoffExtent struct {
	Group string
	Kind  GroupKind
	// First is the logical page the first unit holds: 0 for the
	// per-token group (unit i holds tokens [i·TokensPerPage,
	// (i+1)·TokensPerPage)) and for a state group; for a sliding-window
	// group, the oldest page still inside the window at the prompt's end.
	First int
	// Units is the number of units; UnitBytes one unit over the group's
	// regions.
	Units     int
	UnitBytes int64
}

// HandoffExtents returns the extents of a handoff of a prompt of prompt
// tokens (≥ 1) between pools of spec s, one per group in the spec's
// order; nil for a spec that is not valid or a prompt below one token.
func (s CacheSpec) HandoffExtents(prompt int) []HandoffExtent {
	lay, err := s.layout()
	if err != nil || prompt < 1 {
		return nil
	}
	return lay.handoffExtents(prompt)
}

func (l *layout) handoffExtents(prompt int) []HandoffExtent {
	es := make([]HandoffExtent, len(l.groups))
	for i, g := range l.groups {
		e := HandoffExtent{Group: g.name, Kind: g.kind, UnitBytes: g.pageBytes}
		switch g.kind {
		case GroupPerToken:
			e.Units = (prompt + g.tpp - 1) / g.tpp
		case GroupSlidingWindow:
			// The window at the prompt's end: its tokens [prompt − W,
			// prompt), as SlideWindows keeps them once prompt tokens are
			// written.
			e.First = max(0, (prompt-g.window)/g.tpp)
			e.Units = (prompt+g.tpp-1)/g.tpp - e.First
		case GroupState:
			e.Units = 1
		}
		es[i] = e
	}
	return es
}

// handoffUnit is one unit of a handoff as a pool holds it: its group and
// its page (slot) there, at the generation the transfer expects.
type handoffUnit struct {
	group  int
	handle allocator.Handle
}

// leaseUnitsLocked returns the units of a handoff of l's prompt in l's
// pages, per the extents es: group g's unit j is the page of logical
// position es[g].First+j in its hold (a window's ring index wraps).
func (p *Pool) leaseUnitsLocked(l *Lease, es []HandoffExtent) []handoffUnit {
	p.assertHeld()
	n := 0
	for _, e := range es {
		n += e.Units
	}
	units := make([]handoffUnit, 0, n)
	for gi, e := range es {
		h := &l.holds[gi]
		for j := range e.Units {
			units = append(units, handoffUnit{group: gi, handle: h.handles[(e.First+j)%len(h.handles)]})
		}
	}
	return units
}

// unitsFor returns how many units from first on fill exactly bytes bytes,
// or -1 if no whole number of them does (or fewer than one).
func (p *Pool) unitsFor(us []handoffUnit, first int, bytes int) int {
	if first < 0 || first > len(us) {
		return -1
	}
	var b int64
	for k, u := range us[first:] {
		b += p.groups[u.group].pageBytes
		if b == int64(bytes) {
			return k + 1
		}
		if b > int64(bytes) {
			return -1
		}
	}
	return -1
}

// pinUnitsLocked checks that each unit is still in use at its
// generation (and, for a write, held by l alone and published nowhere)
// and, if so, pins l for one copy; unpin ends it.
func (p *Pool) pinUnitsLocked(l *Lease, us []handoffUnit, write bool) error {
	p.assertHeld()
	for _, u := range us {
		if err := p.unitHeldLocked(u, write); err != nil {
			return err
		}
	}
	l.pins++
	p.mu.pins++
	return nil
}

// unitHeldLocked checks that unit u is in use at its handle's generation
// and, for a write, held once and published nowhere.
func (p *Pool) unitHeldLocked(u handoffUnit, write bool) error {
	g := &p.groups[u.group]
	info, err := g.alloc.Info(u.handle.Page)
	if err != nil || info.State != allocator.InUse || info.Gen != u.handle.Gen {
		return fmt.Errorf("%w: page %d of group %q is at generation %d (%v), transfer expects %d",
			ErrStaleTransfer, u.handle.Page, g.name, info.Gen, info.State, u.handle.Gen)
	}
	if write && (info.Refs != 1 || u.group == 0 && p.mu.prefix.byPage[u.handle.Page] != nil) {
		// An import's pages are its own (it shares nothing); a page
		// held elsewhere or published is someone else's KV.
		return fmt.Errorf("%w: page %d of group %q is shared (%d references) or published; an import writes only its own pages",
			ErrStaleTransfer, u.handle.Page, g.name, info.Refs)
	}
	return nil
}

// readUnits copies units us, whole, into buf (each unit's regions in
// order, one unit after another); the caller has pinned them. A run of
// units of one group on a cudaops.StagedCopier goes in one staged read.
func (p *Pool) readUnits(us []handoffUnit, buf []byte) error {
	for len(us) > 0 {
		gi := us[0].group
		k := 1
		for k < len(us) && us[k].group == gi {
			k++
		}
		n := int(p.groups[gi].pageBytes) * k
		if err := p.readGroupUnits(gi, us[:k], buf[:n]); err != nil {
			return err
		}
		us, buf = us[k:], buf[n:]
	}
	return nil
}

// readGroupUnits is readUnits of units of group gi.
func (p *Pool) readGroupUnits(gi int, us []handoffUnit, buf []byte) error {
	g := &p.groups[gi]
	if sc, ok := p.dev.(cudaops.StagedCopier); ok {
		return p.readStaged(sc, gi, us, buf)
	}
	off := 0
	for _, u := range us {
		for r := g.first; r < g.first+g.count; r++ {
			rb := int(p.lay.regions[r].PageBytes)
			if err := p.dev.ReadPage(r, u.handle.Page, buf[off:off+rb]); err != nil {
				return fmt.Errorf("%w: page %d of group %q region %d: %w", ErrDevice, u.handle.Page, g.name, r, err)
			}
			off += rb
		}
	}
	return nil
}

// readStaged is readGroupUnits on a device that copies through
// page-locked staging (CUDA): every region of every unit in one call, one
// DMA per run of adjacent pages per region and one wait per staging
// buffer's worth, instead of a synchronous copy per page per region.
// Staging holds a batch region by region, and buf is unit-major, so each
// unit's region is copied from staging to its place in buf: the copy out
// of page-locked memory that any read into Go memory takes (the driver
// makes it itself for a synchronous copy), and the only one.
func (p *Pool) readStaged(sc cudaops.StagedCopier, gi int, us []handoffUnit, buf []byte) error {
	g := &p.groups[gi]
	ub := int(g.pageBytes)
	regions, pages := p.groupRegions(gi), unitPages(us)
	err := sc.ReadStaged(regions, pages, func(first int, staged [][]byte) {
		at := first * ub // where the region's first page of the batch goes in buf
		for k, r := range regions {
			rb := int(p.lay.regions[r].PageBytes)
			for j, dst := 0, at; j*rb < len(staged[k]); j, dst = j+1, dst+ub {
				copy(buf[dst:dst+rb], staged[k][j*rb:])
			}
			at += rb
		}
	})
	if err != nil {
		return fmt.Errorf("%w: reading %d pages of group %q: %w", ErrDevice, len(us), g.name, err)
	}
	return nil
}

// groupRegions lists the device regions of group gi, in order.
func (p *Pool) groupRegions(gi int) []int {
	g := &p.groups[gi]
	regions := make([]int, g.count)
	for k := range regions {
		regions[k] = g.first + k
	}
	return regions
}

// unitPages returns the pages of us.
func unitPages(us []handoffUnit) []int32 {
	pages := make([]int32, len(us))
	for i, u := range us {
		pages[i] = u.handle.Page
	}
	return pages
}

// readUnitRange copies bytes [off, off+len(dst)) of unit u into dst; the
// caller has pinned it. A region the range covers in part is read in part
// on a cudaops.PartReader, else whole into scratch.
func (p *Pool) readUnitRange(u handoffUnit, off int64, dst []byte) error {
	g := &p.groups[u.group]
	partial, _ := p.dev.(cudaops.PartReader)
	var scratch []byte
	return p.eachRegionPart(u.group, off, int64(len(dst)), func(r int, roff, n, at int64) error {
		rb := p.lay.regions[r].PageBytes
		var err error
		switch {
		case roff == 0 && n == rb:
			err = p.dev.ReadPage(r, u.handle.Page, dst[at:at+n])
		case partial != nil:
			err = partial.ReadPagePart(r, u.handle.Page, int(roff), dst[at:at+n])
		default:
			if int64(cap(scratch)) < rb {
				scratch = make([]byte, rb)
			}
			if err = p.dev.ReadPage(r, u.handle.Page, scratch[:rb]); err == nil {
				copy(dst[at:at+n], scratch[roff:roff+n])
			}
		}
		if err != nil {
			return fmt.Errorf("%w: page %d of group %q region %d: %w", ErrDevice, u.handle.Page, g.name, r, err)
		}
		return nil
	})
}

// eachRegionPart calls f for each region of group gi that bytes [off,
// off+n) of a unit cover: region r, the offset roff in its page, the k
// bytes covered there, and where they start in the range (at).
func (p *Pool) eachRegionPart(gi int, off, n int64, f func(r int, roff, k, at int64) error) error {
	g := &p.groups[gi]
	var start, at int64 // of region r in the unit; of the next byte in the range
	for r := g.first; r < g.first+g.count && n > 0; r++ {
		rb := p.lay.regions[r].PageBytes
		if off < start+rb {
			roff := off - start
			k := min(rb-roff, n)
			if err := f(r, roff, k, at); err != nil {
				return err
			}
			off, n, at = off+k, n-k, at+k
		}
		start += rb
	}
	return nil
}
