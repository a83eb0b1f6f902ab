package kvcache

import (
	"encoding/binary"
	"fmt"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

// This file is how a caller reaches page memory: through a lease, for
// the pages that lease holds, or as a description of the regions for an
// engine whose kernels address them. The pool's device itself is never
// handed out: a caller holding it could fill, write or close pages that
// other leases hold, or that wait in quarantine, behind the books.

// Regions returns a copy of the device's region table, in device order:
// the per-token group's regions first (for a pool made from a Geometry,
// layer l's K is region 2l and its V 2l+1), then each other group's. It
// describes where pages are (Base, Stride, PageBytes) for an engine's
// kernels, which write only the pages of the leases the engine holds.
func (p *Pool) Regions() []cudaops.Region { return p.dev.Regions() }

// DeviceStats returns the figures of a CUDA device (fill mode, fences
// pending, staging waits); ok is false for a device that keeps none.
func (p *Pool) DeviceStats() (s cudaops.Stats, ok bool) {
	d, ok := p.dev.(interface{ Stats() cudaops.Stats })
	if !ok {
		return cudaops.Stats{}, false
	}
	return d.Stats(), true
}

// ReadPage copies into dst region region (counted within the group, in
// the spec's order) of entry index of the lease's table in cache group
// group, as GroupTable lists it: page index of the block table for the
// per-token group, the index-th page from the oldest one in a window, the
// slot (index 0) of a state group. len(dst) must be that region's page
// size. It is ordered after the fills and copies already issued.
//
// ReadPage and WritePage are for engines that do not address pages with
// kernels of their own (host pools, tests, audits) and run outside the
// pool lock, the lease pinned as a handoff's copies are.
func (l *Lease) ReadPage(group string, index, region int, dst []byte) error {
	return l.copyPage(group, index, region, dst, false)
}

// WritePage copies src into the lease's page as ReadPage names it. The
// lease must take writes: not exported or importing (ErrLeasePhase), and
// the page neither shared nor published in the prefix cache, whose pages
// are immutable (ErrInvalidArgument).
func (l *Lease) WritePage(group string, index, region int, src []byte) error {
	return l.copyPage(group, index, region, src, true)
}

func (l *Lease) copyPage(group string, index, region int, buf []byte, write bool) error {
	if err := l.live(); err != nil {
		return err
	}
	p := l.pool
	gi, err := p.groupIndex(group)
	if err != nil {
		return err
	}
	g := &p.groups[gi]
	if region < 0 || region >= g.count {
		return fmt.Errorf("%w: region %d of cache group %q, which has %d", ErrInvalidArgument, region, g.name, g.count)
	}
	ri := g.first + region
	if want := p.lay.regions[ri].PageBytes; int64(len(buf)) != want {
		return fmt.Errorf("%w: %d bytes for region %d of cache group %q, whose pages are %d bytes", ErrInvalidArgument, len(buf), region, g.name, want)
	}
	what := "read"
	if write {
		what = "write"
	}
	p.mu.Lock()
	err = p.stateErrLocked()
	if err == nil && (l.state.Load() != leaseLive || l.draining) {
		err = ErrLeaseReleased
	}
	var page int32
	if err == nil {
		h := &l.holds[gi]
		switch {
		case index < 0 || index >= len(h.pages):
			err = fmt.Errorf("%w: %s of entry %d of lease %q's table in cache group %q, which has %d", ErrInvalidArgument, what, index, l.id, g.name, len(h.pages))
		case write && l.written.Load()&writeSealed != 0:
			err = l.sealedErr("page write")
		case write && gi == 0 && index < l.published:
			err = fmt.Errorf("%w: page %d of lease %q is shared or published in the prefix cache, and immutable", ErrInvalidArgument, index, l.id)
		default:
			page = h.pages[(h.first+index)%len(h.pages)]
			err = p.pinUnitsLocked(l, []handoffUnit{{group: gi, handle: h.handles[(h.first+index)%len(h.pages)]}}, false)
		}
	}
	p.mu.Unlock()
	if err != nil {
		return err
	}
	defer p.unpin(l)
	if write {
		err = p.dev.WritePage(ri, page, buf)
	} else {
		err = p.dev.ReadPage(ri, page, buf)
	}
	if err != nil {
		return fmt.Errorf("%w: %s of page %d region %d: %w", ErrDevice, what, page, ri, err)
	}
	return nil
}

// AuditFreePages reads every free page of every cache group, and every
// free slot of the host tier, and checks that it holds exactly what the
// scrub policy writes (the page's or slot's fill word,
// FillSpec().WordFor, in every 4-byte word of every region): that no
// tenant's KV, and no half-scrubbed page, waits in the free lists. It
// returns the pages read, and for the first page that holds anything
// else an error wrapping ErrCanaryMismatch, an *isolation.CanaryError
// that names the page, its group's first region it differs in, the
// offset, and the sharing domain that last held it. It changes nothing:
// a finding retires nothing and faults nothing, it is the operator's to
// act on.
//
// It holds the pool lock while it reads, so nothing is admitted or
// released meanwhile: it is for tests, audits and incident drills, not
// for a serving path.
func (p *Pool) AuditFreePages() (pages int, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	spec := p.q.Spec()
	books := p.tenantsLocked()
	var buf []byte
	for gi := range p.groups {
		g := &p.groups[gi]
		free := g.alloc.PeekFree(nil, g.alloc.Count(allocator.Free))
		for _, pg := range free {
			want := spec.WordFor(pg)
			for r := g.first; r < g.first+g.count; r++ {
				n := int(p.lay.regions[r].PageBytes)
				if cap(buf) < n {
					buf = make([]byte, n)
				}
				b := buf[:n]
				if err := p.dev.ReadPage(r, pg, b); err != nil {
					return pages, fmt.Errorf("%w: audit of page %d region %d: %w", ErrDevice, pg, r, err)
				}
				for off := 0; off < n; off += 4 {
					if got := binary.LittleEndian.Uint32(b[off:]); got != want {
						info, _ := g.alloc.Info(pg)
						return pages, fmt.Errorf("free page %d of cache group %q: %w", pg, g.name, &isolation.CanaryError{
							Page: pg, Region: r, Offset: int64(off), Want: want, Got: got, PrevOwner: books.OwnerName(info.Owner), Gen: info.Gen})
					}
				}
			}
			pages++
		}
	}
	if t := p.tier; t != nil {
		for si := range t.sp {
			for _, s := range t.sp[si].free {
				if err := t.checkCanary(s, books.OwnerName(t.meta[s].owner)); err != nil {
					return pages, fmt.Errorf("free host-tier slot %d: %w", s, err)
				}
				pages++
			}
		}
	}
	return pages, nil
}
