package kvcache

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/kvfence/kvfence/cudaops"
)

// This file is the decode side of a handoff: an import (Incoming) that
// receives a prompt's units, in every cache group (units.go), into a
// lease admitted fail-closed, and hands the lease out only once every
// unit arrived and the checksum matches. See phase.go for the state
// machine and its invariants.

// Incoming is an import in progress on the decode side. Its lease holds
// every page the request needs in every group (prompt + max new tokens)
// but is not handed out until Complete has verified the transfer.
type Incoming struct {
	pool    *Pool
	lease   *Lease
	seq     uint64 // the lease incarnation this import belongs to
	extents []HandoffExtent
	units   []handoffUnit
	want    uint32

	mu struct {
		sync.Mutex
		sums     []uint64
		got      []bool // the unit's bytes are claimed: being written, or landed
		received int    // units whose bytes have all landed
		// The unit received in ranges, if any (ranged.unit ≥ 0): its
		// ranges come one at a time, in order.
		ranged rangedUnit
	}
}

// rangedUnit is the state of a unit an import receives in ranges.
type rangedUnit struct {
	unit    int   // -1: none
	claimed int64 // bytes claimed by range writes: the next range starts here
	busy    bool  // a range write is in flight
	sum     UnitSummer
	asm     regionAssembly
}

// testHookBeforeImportAdmit, if set (by tests only), runs in BeginImport
// just before the admission.
var testHookBeforeImportAdmit func()

// BeginImport admits req fail-closed (as Admit does: the same errors, the
// same waiting on ctx, nothing allocated on refusal) for the cache of a
// prompt arriving from a prefill pool of the same cache spec, computed in
// sharing domain domain, whose content checksum is checksum. The
// returned import receives the prompt's units, in every cache group
// (Extents), with WriteUnits and WriteUnitRangeFrom, and becomes a usable
// lease only through Complete.
//
// An import shares nothing: a request that carries prefix material
// (TokenIDs, PageKeys) is refused with ErrImportPrefix; give the tokens to
// the delivered lease with AttachTokens. The tenant must be in domain in
// this pool when the admission is decided (else ErrDomainMismatch, nothing
// allocated), so that KV never enters another domain than the one it was
// computed in. Domain names are the operator's: the pools on both sides
// must name a shared domain alike (a tenant's own domain is
// isolation.PrivateDomainPrefix + its name everywhere).
func (p *Pool) BeginImport(ctx context.Context, req Request, domain string, checksum uint32) (*Incoming, error) {
	return p.beginImport(&admission{ctx: ctx, req: req, wait: true, importFrom: domain}, checksum)
}

// TryBeginImport is BeginImport that never waits, as TryAdmit: a busy
// pool or a full quota is refused at once.
func (p *Pool) TryBeginImport(req Request, domain string, checksum uint32) (*Incoming, error) {
	return p.beginImport(&admission{ctx: context.Background(), req: req, importFrom: domain}, checksum)
}

func (p *Pool) beginImport(a *admission, checksum uint32) (*Incoming, error) {
	req, domain := a.req, a.importFrom
	if domain == "" {
		return nil, fmt.Errorf("%w: import of request %q names no sharing domain", ErrInvalidArgument, req.ID)
	}
	if len(req.TokenIDs) > 0 || len(req.PageKeys) > 0 {
		return nil, fmt.Errorf("%w: request %q carries %d token IDs and %d page keys", ErrImportPrefix, req.ID, len(req.TokenIDs), len(req.PageKeys))
	}
	if testHookBeforeImportAdmit != nil {
		testHookBeforeImportAdmit()
	}
	l := new(Lease)
	a.l = l
	if err := p.admit(a); err != nil {
		return nil, err
	}
	es := p.lay.handoffExtents(req.PromptTokens)
	in := &Incoming{pool: p, lease: l, extents: es, want: checksum}
	p.mu.Lock()
	// The lease is importing, so nothing but an abort or Close can have
	// ended it since the admission; its incarnation is read with its
	// holds.
	in.seq = l.seq
	if l.state.Load() == leaseLive {
		in.units = p.leaseUnitsLocked(l, es)
	}
	p.mu.Unlock()
	in.mu.sums = make([]uint64, len(in.units))
	in.mu.got = make([]bool, len(in.units))
	in.mu.ranged.unit = -1
	return in, nil
}

// domainMismatch is the error of an import whose tenant is in another
// domain here than the one its KV was computed in.
func domainMismatch(req *Request, from, here string) error {
	return fmt.Errorf("%w: request %q of tenant %q was computed in domain %q, the tenant is in %q here",
		ErrDomainMismatch, req.ID, req.Tenant, from, here)
}

// Units is the number of units the import expects, every group's.
func (in *Incoming) Units() int { return len(in.units) }

// Extents returns the import's extents, one per cache group (a copy).
func (in *Incoming) Extents() []HandoffExtent { return slices.Clone(in.extents) }

// UnitBytes is the size of unit u; 0 for a unit out of range.
func (in *Incoming) UnitBytes(u int) int64 {
	if u < 0 || u >= len(in.units) {
		return 0
	}
	return in.pool.groups[in.units[u].group].pageBytes
}

// PageBytes is one page of the per-token group over all its regions.
func (in *Incoming) PageBytes() int64 { return in.pool.PageBytes() }

// RequestID is the imported request's ID.
func (in *Incoming) RequestID() string { return in.lease.id }

func (in *Incoming) owns() bool {
	l := in.lease
	return l.state.Load() == leaseLive && l.seq == in.seq && l.importing()
}

// fail aborts the import and returns err.
func (in *Incoming) fail(err error) error {
	in.Abort()
	return err
}

// WriteUnits writes received units first, first+1, … from src, whole,
// each unit's regions in order and one unit after the other; src must end
// at a unit's end. A range outside the import is refused with
// ErrInvalidArgument and changes nothing: the import stays usable. Any
// other error aborts the import: a unit received twice
// (ErrDuplicatePage), an import that has already ended (ErrStaleTransfer:
// nothing is written), a device failure.
func (in *Incoming) WriteUnits(first int, src []byte) error {
	return in.WriteUnitsFrom(first, [][]byte{src})
}

// WriteUnitsFrom is WriteUnits for units that arrived in pieces: parts,
// concatenated, are the units (a gRPC message, for one, is a list of
// 16 KiB buffers). On a device that writes parts of pages in place
// (cudaops.PartWriter) the bytes go from the parts to the pages without
// another copy; on one that copies through page-locked staging
// (cudaops.StagedCopier: CUDA) they are gathered from the parts straight
// into it.
func (in *Incoming) WriteUnitsFrom(first int, parts [][]byte) error {
	p := in.pool
	total := 0
	for _, part := range parts {
		total += len(part)
	}
	n := p.unitsFor(in.units, first, total)
	if n < 1 {
		return fmt.Errorf("%w: write of %d bytes at unit %d of %d does not end at a unit's end",
			ErrInvalidArgument, total, first, len(in.units))
	}
	in.mu.Lock()
	for u := first; u < first+n; u++ {
		if in.mu.got[u] {
			in.mu.Unlock()
			return in.fail(fmt.Errorf("%w: unit %d of request %q", ErrDuplicatePage, u, in.lease.id))
		}
	}
	for u := first; u < first+n; u++ {
		in.mu.got[u] = true
	}
	in.mu.Unlock()

	us := in.units[first : first+n]
	if err := in.pin(us); err != nil {
		return in.fail(err)
	}
	sums := make([]uint64, n)
	err := p.writeUnits(us, parts, sums)
	p.unpin(in.lease)
	if err != nil {
		return in.fail(err)
	}
	// Counted only once the bytes have landed, so that Complete never
	// vouches for a unit still being written.
	in.mu.Lock()
	copy(in.mu.sums[first:], sums)
	in.mu.received += n
	in.mu.Unlock()
	return nil
}

// WriteUnitRangeFrom writes bytes [off, off+n) of unit u, which arrived
// as parts (n bytes in all), for a transfer that sends a unit in ranges
// (a state slot larger than a message). A unit's ranges are written one
// at a time and in order: the first at offset 0, each next one where the
// last ended, every one but the last a multiple of UnitRangeAlign long;
// and one unit's at a time. A range that breaks this, or lies outside the
// unit, is refused with ErrInvalidArgument and changes nothing; a range
// of a unit already received whole aborts the import (ErrDuplicatePage),
// as do the errors of WriteUnits. The unit counts as received once its
// last range has landed.
func (in *Incoming) WriteUnitRangeFrom(u int, off int64, parts [][]byte) error {
	p := in.pool
	var n int64
	for _, part := range parts {
		n += int64(len(part))
	}
	ub := in.UnitBytes(u)
	if u < 0 || u >= len(in.units) || n < 1 || off < 0 || off > ub-n || off%UnitRangeAlign != 0 ||
		(off+n < ub && n%UnitRangeAlign != 0) {
		return fmt.Errorf("%w: write of %d bytes at offset %d of unit %d of %d (%d bytes; ranges start at multiples of %d and end there or at the unit's end)",
			ErrInvalidArgument, n, off, u, len(in.units), ub, UnitRangeAlign)
	}
	in.mu.Lock()
	r := &in.mu.ranged
	switch {
	case in.mu.got[u] && r.unit != u:
		in.mu.Unlock()
		return in.fail(fmt.Errorf("%w: a range of unit %d of request %q, received already", ErrDuplicatePage, u, in.lease.id))
	case r.unit >= 0 && r.unit != u:
		in.mu.Unlock()
		return fmt.Errorf("%w: a range of unit %d while unit %d is received in ranges: one unit at a time", ErrInvalidArgument, u, r.unit)
	case r.busy:
		in.mu.Unlock()
		return fmt.Errorf("%w: a range of unit %d while another is being written: one at a time", ErrInvalidArgument, u)
	case r.unit < 0 && off != 0, r.unit == u && off != r.claimed:
		want := r.claimed
		if r.unit < 0 {
			want = 0
		}
		in.mu.Unlock()
		return fmt.Errorf("%w: a range of unit %d at offset %d, the next one starts at %d: in order", ErrInvalidArgument, u, off, want)
	}
	if r.unit < 0 {
		*r = rangedUnit{unit: u, sum: UnitSummer{sums: r.sum.sums[:0], block: r.sum.block}, asm: r.asm}
		in.mu.got[u] = true
	}
	r.busy, r.claimed = true, off+n
	in.mu.Unlock()

	us := in.units[u : u+1]
	err := in.pin(us)
	if err == nil {
		// Only this call touches r's sums and assembly while busy is set.
		r.sum.AddParts(parts)
		err = p.writeUnitRange(us[0], off, parts, &r.asm)
		p.unpin(in.lease)
	}
	if err != nil {
		return in.fail(err)
	}
	in.mu.Lock()
	r.busy = false
	if off+n == ub {
		in.mu.sums[u] = r.sum.Sum()
		in.mu.received++
		r.unit = -1
	}
	in.mu.Unlock()
	return nil
}

// pin vets the import and pins its lease for a write of us.
func (in *Incoming) pin(us []handoffUnit) error {
	p := in.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stateErrLocked(); err != nil {
		return err
	}
	if !in.owns() || in.lease.draining {
		return fmt.Errorf("%w: import of request %q has ended", ErrStaleTransfer, in.lease.id)
	}
	return p.pinUnitsLocked(in.lease, us, true)
}

// writeUnits writes units us, whole, from the concatenation of parts, and
// sets sums[i] to the checksum of unit i's bytes; the caller has pinned
// them. A run of units of one group is written by writeGroupUnits.
func (p *Pool) writeUnits(us []handoffUnit, parts [][]byte, sums []uint64) error {
	cur := partCursor{parts: parts}
	for len(us) > 0 {
		gi := us[0].group
		k := 1
		for k < len(us) && us[k].group == gi {
			k++
		}
		var run [][]byte // the run's bytes, as parts
		for rest := int(p.groups[gi].pageBytes) * k; rest > 0; {
			seg := cur.next(rest)
			run = append(run, seg)
			rest -= len(seg)
		}
		if err := p.writeGroupUnits(gi, us[:k], run, sums[:k]); err != nil {
			return err
		}
		us, sums = us[k:], sums[k:]
	}
	return nil
}

// writeGroupUnits writes units us of group gi, region by region, from the
// concatenation of parts, and sets sums[i] to the checksum of unit i's
// bytes. Each unit is summed just before it is written, while its bytes
// are in cache, so the bytes written are the bytes summed. A region that
// lies in one part is written from it; one split across parts is written
// in pieces on a cudaops.PartWriter and assembled in scratch memory
// elsewhere. A cudaops.StagedCopier takes writeStaged.
func (p *Pool) writeGroupUnits(gi int, us []handoffUnit, parts [][]byte, sums []uint64) error {
	if sc, ok := p.dev.(cudaops.StagedCopier); ok {
		return p.writeStaged(sc, gi, us, parts, sums)
	}
	g := &p.groups[gi]
	partial, _ := p.dev.(cudaops.PartWriter)
	cur := partCursor{parts: parts}
	var block, region, blockSums []byte // scratch
	for i, u := range us {
		ahead := cur // sums the unit, ahead of the writes
		sums[i], blockSums = ahead.pageSum(int(g.pageBytes), &block, blockSums, nil)
		for r := g.first; r < g.first+g.count; r++ {
			rb := int(p.lay.regions[r].PageBytes)
			var err error
			if partial != nil {
				for off := 0; off < rb && err == nil; {
					seg := cur.next(rb - off)
					err = partial.WritePagePart(r, u.handle.Page, off, seg)
					off += len(seg)
				}
			} else {
				err = p.dev.WritePage(r, u.handle.Page, cur.take(rb, &region))
			}
			if err != nil {
				return fmt.Errorf("%w: page %d of group %q region %d: %w", ErrDevice, u.handle.Page, g.name, r, err)
			}
		}
	}
	return nil
}

// writeStaged is writeGroupUnits on a device that copies through
// page-locked staging (CUDA): every region of every unit in one call, one
// DMA per run of adjacent pages per region and one wait per staging
// buffer's worth. Each unit's regions are gathered from the parts
// straight into their places in staging (the one host copy a write from
// Go memory takes, so no region is assembled in scratch first) and the
// unit is then summed over its staged bytes, while they are in cache:
// those are exactly the bytes the DMA carries, so what is summed is what
// lands on the device.
func (p *Pool) writeStaged(sc cudaops.StagedCopier, gi int, us []handoffUnit, parts [][]byte, sums []uint64) error {
	g := &p.groups[gi]
	ub := int(g.pageBytes)
	regions, pages := p.groupRegions(gi), unitPages(us)
	cur := partCursor{parts: parts}
	unit := make([][]byte, len(regions)) // a staged unit's regions
	var block, blockSums []byte          // scratch of pageSum
	err := sc.WriteStaged(regions, pages, func(first int, staged [][]byte) {
		n := len(staged[0]) / int(p.lay.regions[regions[0]].PageBytes)
		for j := range n {
			for k, r := range regions {
				rb := int(p.lay.regions[r].PageBytes)
				dst := staged[k][j*rb : (j+1)*rb]
				for d := dst; len(d) > 0; {
					d = d[copy(d, cur.next(len(d))):]
				}
				unit[k] = dst
			}
			landing := partCursor{parts: unit}
			sums[first+j], blockSums = landing.pageSum(ub, &block, blockSums, nil)
		}
	})
	if err != nil {
		return fmt.Errorf("%w: writing %d pages of group %q: %w", ErrDevice, len(us), g.name, err)
	}
	return nil
}

// regionAssembly holds the region page a unit's ranges cover in part, on
// a device that cannot write part of a page: written whole once its last
// byte arrived.
type regionAssembly struct {
	region int // -1 or 0 before the first: see buf
	buf    []byte
	filled int64
}

// writeUnitRange writes bytes [off, off+n) of unit u from parts; the
// caller has pinned it. A region the range covers whole is written whole;
// one it covers in part is written in part on a cudaops.PartWriter, and
// assembled in asm elsewhere, until its last byte arrives.
func (p *Pool) writeUnitRange(u handoffUnit, off int64, parts [][]byte, asm *regionAssembly) error {
	g := &p.groups[u.group]
	partial, _ := p.dev.(cudaops.PartWriter)
	cur := partCursor{parts: parts}
	var n int64
	for _, part := range parts {
		n += int64(len(part))
	}
	var scratch []byte
	return p.eachRegionPart(u.group, off, n, func(r int, roff, k, _ int64) error {
		rb := p.lay.regions[r].PageBytes
		var err error
		switch {
		case roff == 0 && k == rb:
			err = p.dev.WritePage(r, u.handle.Page, cur.take(int(k), &scratch))
		case partial != nil:
			for done := int64(0); done < k && err == nil; {
				seg := cur.next(int(k - done))
				err = partial.WritePagePart(r, u.handle.Page, int(roff+done), seg)
				done += int64(len(seg))
			}
		default:
			if roff == 0 {
				if int64(cap(asm.buf)) < rb {
					asm.buf = make([]byte, rb)
				}
				asm.region, asm.buf, asm.filled = r, asm.buf[:rb], 0
			}
			for done := int64(0); done < k; {
				seg := cur.next(int(k - done))
				copy(asm.buf[roff+done:], seg)
				done += int64(len(seg))
			}
			if asm.filled += k; asm.filled == rb {
				err = p.dev.WritePage(r, u.handle.Page, asm.buf)
			}
		}
		if err != nil {
			return fmt.Errorf("%w: page %d of group %q region %d: %w", ErrDevice, u.handle.Page, g.name, r, err)
		}
		return nil
	})
}

// Complete verifies that every unit arrived and that the content checksum
// matches, then makes the lease usable: prefilled, written watermark =
// prompt tokens, each sliding window starting where the prompt's window
// does. On failure the import is aborted (its pages scrubbed, in every
// group) and the error wraps ErrIncompleteTransfer or
// ErrChecksumMismatch: a transfer that lacks any group's units is
// incomplete, never a lease with a silently empty state.
func (in *Incoming) Complete() (*Lease, error) { return in.complete(in.want) }

// CompleteWithChecksum is Complete for an import whose content checksum
// arrived after its units (a sender sums the units as it sends them, and
// seals the sum in the transfer's last message): checksum is checked
// instead of the one BeginImport was given.
func (in *Incoming) CompleteWithChecksum(checksum uint32) (*Lease, error) {
	return in.complete(checksum)
}

func (in *Incoming) complete(want uint32) (*Lease, error) {
	in.mu.Lock()
	received := in.mu.received
	sum := ContentChecksum(in.mu.sums)
	missing := in.missingLocked()
	in.mu.Unlock()
	if received != len(in.units) {
		return nil, in.fail(fmt.Errorf("%w: request %q received %d of %d units%s",
			ErrIncompleteTransfer, in.lease.id, received, len(in.units), missing))
	}
	if sum != want {
		return nil, in.fail(fmt.Errorf("%w: request %q content checksum %08x, the sender's is %08x",
			ErrChecksumMismatch, in.lease.id, sum, want))
	}
	p := in.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stateErrLocked(); err != nil {
		return nil, err
	}
	if !in.owns() || in.lease.draining {
		// draining: an abort has begun and waits for Pool.mu again.
		return nil, fmt.Errorf("%w: import of request %q has ended", ErrStaleTransfer, in.lease.id)
	}
	l := in.lease
	for gi, e := range in.extents {
		if e.Kind == GroupSlidingWindow {
			l.holds[gi].first = e.First // the ring's pages before it hold nothing: they slid out on the prefill side
		}
	}
	l.written.Store(int64(l.prompt)) // unsealed: decode commits generated tokens
	l.phase.Store(uint32(PhasePrefilled))
	return l, nil
}

// missingLocked names, for an incomplete import, the first group some of
// whose units did not arrive.
func (in *Incoming) missingLocked() string {
	u := 0
	for _, e := range in.extents {
		got := 0
		for j := range e.Units {
			if in.mu.got[u+j] {
				got++
			}
		}
		if got < e.Units {
			return fmt.Sprintf(" (cache group %q: %d of %d)", e.Group, got, e.Units)
		}
		u += e.Units
	}
	return ""
}

// Abort ends the import: its pages go through the scrubber, in every
// group. Aborting an import that already ended does nothing.
func (in *Incoming) Abort() error {
	_, err := in.pool.endLease(in.lease, in.owns, PhaseAborted, cudaops.Ordering{})
	return err
}
