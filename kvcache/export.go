package kvcache

import (
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
)

// This file is the prefill side of a handoff: an exported lease (Outgoing)
// whose prompt pages are read for a transfer. See phase.go for the state
// machine and its invariants.

// Outgoing is an exported lease: the prompt's pages pinned for a transfer
// until Ack, Abort or the reclaim deadline.
type Outgoing struct {
	pool    *Pool
	lease   *Lease
	seq     uint64 // the lease incarnation this export belongs to
	handles []allocator.Handle
	// timer reclaims the pages at the deadline. Set under Pool.mu before
	// Export returns; the lease's end stops it.
	timer *time.Timer

	checksum struct {
		sync.Mutex
		done  bool
		value uint32
	}
}

// Export pins a prefilled lease's prompt pages for a transfer. The pages
// stay pinned until Ack or Abort, or until reclaimAt, when they are
// released through the scrubber whatever the transfer's state. A lease
// that is not prefilled, or whose watermark is not its prompt, is refused
// with ErrLeasePhase and left as it was. Export reads no page: the content
// checksum comes from Checksum (one pass over the pages) or from a sender
// that sums the pages as it reads them to send them.
func (l *Lease) Export(reclaimAt time.Time) (*Outgoing, error) {
	if err := l.live(); err != nil {
		return nil, err
	}
	p := l.pool
	if err := p.handoffSupported(); err != nil {
		return nil, err
	}
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
	n := p.pagesFor(l.prompt)
	o := &Outgoing{pool: p, lease: l, seq: l.seq, handles: append([]allocator.Handle(nil), l.holds[0].handles[:n]...)}
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

// PromptTokens is the number of tokens whose KV the pages hold.
func (o *Outgoing) PromptTokens() int { return o.lease.prompt }

// Pages is the number of exported pages: those that hold the prompt.
func (o *Outgoing) Pages() int { return len(o.handles) }

// Generations appends each exported page's generation to dst.
func (o *Outgoing) Generations(dst []uint32) []uint32 {
	for _, h := range o.handles {
		dst = append(dst, h.Gen)
	}
	return dst
}

// Checksum returns the content checksum of the exported pages, reading
// each once on the first call (in parallel: see pageSums); later calls
// return the same value. It fails as ReadPages does once the export has
// ended, unless the sum was already known.
func (o *Outgoing) Checksum() (uint32, error) {
	o.checksum.Lock()
	defer o.checksum.Unlock()
	if !o.checksum.done {
		sums, err := o.pageSums()
		if err != nil {
			return 0, err
		}
		o.checksum.value, o.checksum.done = ContentChecksum(sums), true
	}
	return o.checksum.value, nil
}

// pageSums reads every exported page once and returns its checksum. The
// pages are split among up to GOMAXPROCS workers in contiguous runs: a
// manifest that carries the checksum cannot leave before this pass ends,
// and the reads run in parallel (ReadPages pins the lease, it does not
// hold the pool lock while copying).
func (o *Outgoing) pageSums() ([]uint64, error) {
	n := len(o.handles)
	sums := make([]uint64, n)
	pb := int(o.pool.PageBytes())
	batch := max(1, (1<<20)/pb) // pages read at a time, into a cache-sized buffer
	workers := min(runtime.GOMAXPROCS(0), 8, (n+batch-1)/batch)
	per := (n + workers - 1) / workers
	var g errgroup.Group
	for lo := 0; lo < n; lo += per {
		hi := min(n, lo+per)
		g.Go(func() error {
			buf := make([]byte, pb*min(batch, hi-lo))
			for i := lo; i < hi; {
				k := min(hi-i, batch)
				if err := o.ReadPages(i, buf[:k*pb]); err != nil {
					return err
				}
				for j := range k {
					sums[i+j] = PageChecksum(buf[j*pb : (j+1)*pb])
				}
				i += k
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

// PageBytes is one exported page over all its regions.
func (o *Outgoing) PageBytes() int64 { return o.pool.PageBytes() }

// handoffSupported refuses a handoff from or to a pool with side groups:
// its pages alone would be half of the request's state.
func (p *Pool) handoffSupported() error {
	if p.lay.perLeaseGroups() {
		return fmt.Errorf("%w: the pool has the %s cache group(s), which handoffs do not move: only pools of one per-token group export and import",
			ErrInvalidArgument, p.lay.perLeaseNames())
	}
	return nil
}

// Live reports whether the pages are still pinned for this export.
func (o *Outgoing) Live() bool {
	o.pool.mu.Lock()
	defer o.pool.mu.Unlock()
	return !o.pool.mu.closed && o.owns()
}

// ReadPages copies exported pages first, first+1, … into dst, each page
// PageBytes long with its regions in order; len(dst) must be a multiple of
// PageBytes. A range outside the export is refused (ErrInvalidArgument)
// and copies nothing; so does an export that has ended (ErrReclaimed).
// Reads may run concurrently with each other and with the pool's other
// work: the pool lock is held only while the read is vetted, and the lease
// cannot be released until it is done.
func (o *Outgoing) ReadPages(first int, dst []byte) error {
	p := o.pool
	pb := int(p.PageBytes())
	n := len(dst) / pb
	if !pageRangeOK(first, n, len(dst), pb, len(o.handles)) {
		return fmt.Errorf("%w: read of %d bytes at page %d of %d (pages are %d bytes)",
			ErrInvalidArgument, len(dst), first, len(o.handles), pb)
	}
	hs := o.handles[first : first+n]
	p.mu.Lock()
	err := o.checkLocked()
	if err == nil {
		err = p.pinPagesLocked(o.lease, 0, hs, false)
	}
	p.mu.Unlock()
	if err != nil {
		return err
	}
	defer p.unpin(o.lease)
	return p.readPages(hs, dst)
}

// pageViewer is a device whose pages are host memory a copy can read in
// place (cudaops.Host, and devices built on it).
type pageViewer interface {
	PageBytes(r int, p int32) []byte
}

// Viewable reports whether PageViews can lend the exported pages' memory
// (the pool's pages are host memory); otherwise copy them with ReadPages.
func (o *Outgoing) Viewable() bool {
	_, ok := o.pool.dev.(pageViewer)
	return ok
}

// PageViews is ReadPages without the copy, for a transport that sends
// the pages' memory itself: it appends to views the live memory of
// exported pages first … first+n-1, one view per page per region, each
// page's regions in order, and pins the lease until done is called.
// While pinned, the pages are the export's as ReadPages checks them (in
// use, at the generations exported), and every end of the lease (Ack,
// Abort, the reclaim deadline, Close) waits for done. The caller must
// call done exactly once, when nothing will read the views again, and
// must not write them; later calls of done do nothing. Errors are
// ReadPages' (nothing is pinned then), and ErrInvalidArgument on a pool
// whose pages are not host memory (see Viewable).
func (o *Outgoing) PageViews(first, n int, views [][]byte) (_ [][]byte, done func(), err error) {
	p := o.pool
	pv, ok := p.dev.(pageViewer)
	if !ok {
		return views, nil, fmt.Errorf("%w: the pool's device (%s) has no host memory to view: copy with ReadPages", ErrInvalidArgument, p.dev.Name())
	}
	pb := int(p.PageBytes())
	if n > len(o.handles) || !pageRangeOK(first, n, n*pb, pb, len(o.handles)) {
		return views, nil, fmt.Errorf("%w: view of %d pages at page %d of %d", ErrInvalidArgument, n, first, len(o.handles))
	}
	hs := o.handles[first : first+n]
	p.mu.Lock()
	err = o.checkLocked()
	if err == nil {
		err = p.pinPagesLocked(o.lease, 0, hs, false)
	}
	p.mu.Unlock()
	if err != nil {
		return views, nil, err
	}
	var once atomic.Bool
	done = func() {
		if once.CompareAndSwap(false, true) {
			p.unpin(o.lease)
		}
	}
	start := len(views)
	for _, h := range hs {
		for r := range p.groups[0].count {
			v := pv.PageBytes(r, h.Page)
			if len(v) != int(p.lay.regions[r].PageBytes) {
				done()
				return views[:start], nil, fmt.Errorf("%w: page %d region %d: no memory to view", ErrDevice, h.Page, r)
			}
			views = append(views, v[:len(v):len(v)]) // nothing past the page
		}
	}
	return views, done, nil
}

// pageRangeOK reports whether n ≥ 1 whole pages of pageBytes (bytes in
// all) starting at page first lie within [0, pages). It is written so that
// no sum can overflow, whatever first is.
func pageRangeOK(first, n, bytes, pageBytes, pages int) bool {
	return n > 0 && bytes%pageBytes == 0 && first >= 0 && first <= pages && n <= pages-first
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

// pinPagesLocked checks that each page of group gi is still in use at
// its handle's generation (and, for a write, held by l alone and
// published nowhere) and, if so, pins l for one copy; unpin ends it.
func (p *Pool) pinPagesLocked(l *Lease, gi int, hs []allocator.Handle, write bool) error {
	p.assertHeld()
	for _, h := range hs {
		info, err := p.groups[gi].alloc.Info(h.Page)
		if err != nil || info.State != allocator.InUse || info.Gen != h.Gen {
			return fmt.Errorf("%w: page %d is at generation %d (%v), transfer expects %d",
				ErrStaleTransfer, h.Page, info.Gen, info.State, h.Gen)
		}
		if write && (info.Refs != 1 || gi == 0 && p.mu.prefix.byPage[h.Page] != nil) {
			// An import's pages are its own (it shares nothing); a page
			// held elsewhere or published is someone else's KV.
			return fmt.Errorf("%w: page %d is shared (%d references) or published; an import writes only its own pages",
				ErrStaleTransfer, h.Page, info.Refs)
		}
	}
	l.pins++
	p.mu.pins++
	return nil
}

// readPages copies whole pages into buf; the caller has pinned them.
func (p *Pool) readPages(hs []allocator.Handle, buf []byte) error {
	if sc, ok := p.dev.(cudaops.StagedCopier); ok {
		return p.readStaged(sc, hs, buf)
	}
	off := 0
	for _, h := range hs {
		for r := range p.groups[0].count {
			rb := int(p.lay.regions[r].PageBytes)
			if err := p.dev.ReadPage(r, h.Page, buf[off:off+rb]); err != nil {
				return fmt.Errorf("%w: page %d region %d: %w", ErrDevice, h.Page, r, err)
			}
			off += rb
		}
	}
	return nil
}

// readStaged is readPages on a device that copies through page-locked
// staging (CUDA): every region of every page in one call, one DMA per run
// of adjacent pages per region and one wait per staging buffer's worth,
// instead of a synchronous copy per page per region. Staging holds a batch
// region by region, and buf is page-major, so each page region is copied
// from staging to its place in buf: the copy out of page-locked memory
// that any read into Go memory takes (the driver makes it itself for a
// synchronous copy), and the only one, as neither a per-region scratch
// nor a second pass is needed.
func (p *Pool) readStaged(sc cudaops.StagedCopier, hs []allocator.Handle, buf []byte) error {
	pb := int(p.PageBytes())
	regions, pages := p.handoffRegions(), pageIDs(hs)
	err := sc.ReadStaged(regions, pages, func(first int, staged [][]byte) {
		at := first * pb // where the region's first page of the batch goes in buf
		for k, r := range regions {
			rb := int(p.lay.regions[r].PageBytes)
			for j, dst := 0, at; j*rb < len(staged[k]); j, dst = j+1, dst+pb {
				copy(buf[dst:dst+rb], staged[k][j*rb:])
			}
			at += rb
		}
	})
	if err != nil {
		return fmt.Errorf("%w: reading %d pages: %w", ErrDevice, len(hs), err)
	}
	return nil
}

// handoffRegions lists the device regions a handoff copies: the
// per-token group's, the first on the device, each page's in order.
func (p *Pool) handoffRegions() []int {
	regions := make([]int, p.groups[0].count)
	for k := range regions {
		regions[k] = p.groups[0].first + k
	}
	return regions
}

// pageIDs returns the pages of handles.
func pageIDs(hs []allocator.Handle) []int32 {
	pages := make([]int32, len(hs))
	for i, h := range hs {
		pages[i] = h.Page
	}
	return pages
}

// Ack ends the export after the receiver confirmed the import: the pages
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
// retried): the pages are released through the scrubber. Aborting an
// export that already ended, or a later export of the same Lease, does
// nothing.
func (o *Outgoing) Abort() error {
	_, err := o.end(PhaseAborted)
	return err
}
