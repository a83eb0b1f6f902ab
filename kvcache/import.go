package kvcache

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
)

// This file is the decode side of a handoff: an import (Incoming) that
// receives a prompt's pages into a lease admitted fail-closed, and hands
// the lease out only once every page arrived and the checksum matches. See
// phase.go for the state machine and its invariants.

// Incoming is an import in progress on the decode side. Its lease holds
// every page the request needs (prompt + max new tokens) but is not
// handed out until Complete has verified the transfer. Each prompt page
// is received once, copied in (WritePages, WritePagesFrom) or read by a
// transport straight into its memory (PageViews), and summed as it lands.
type Incoming struct {
	pool    *Pool
	lease   *Lease
	seq     uint64 // the lease incarnation this import belongs to
	pages   int    // prompt pages to receive
	want    uint32
	pageLen int

	mu struct {
		sync.Mutex
		sums     []uint64
		got      []bool
		received int
	}
}

// testHookBeforeImportAdmit, if set (by tests only), runs in BeginImport
// just before the admission.
var testHookBeforeImportAdmit func()

// BeginImport admits req fail-closed (as Admit does: the same errors, the
// same waiting on ctx, nothing allocated on refusal) for the KV of a
// prompt arriving from a prefill pool, computed in sharing domain domain,
// whose content checksum is checksum. The returned import receives the
// prompt's pages with WritePages, WritePagesFrom or PageViews and becomes
// a usable lease only through Complete.
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
	if err := p.handoffSupported(); err != nil {
		return nil, err
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
	in := &Incoming{pool: p, lease: l, seq: l.seq, pages: p.pagesFor(req.PromptTokens),
		want: checksum, pageLen: int(p.PageBytes())}
	in.mu.sums = make([]uint64, in.pages)
	in.mu.got = make([]bool, in.pages)
	return in, nil
}

// domainMismatch is the error of an import whose tenant is in another
// domain here than the one its KV was computed in.
func domainMismatch(req *Request, from, here string) error {
	return fmt.Errorf("%w: request %q of tenant %q was computed in domain %q, the tenant is in %q here",
		ErrDomainMismatch, req.ID, req.Tenant, from, here)
}

// Pages is the number of pages the import expects.
func (in *Incoming) Pages() int { return in.pages }

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

// WritePages writes received pages first, first+1, … from src, each page
// PageBytes long with its regions in order. A range outside the import is
// refused with ErrInvalidArgument and changes nothing: the import stays
// usable. Any other error aborts the import: a page received twice
// (ErrDuplicatePage), an import that has already ended (ErrStaleTransfer:
// nothing is written), a device failure.
func (in *Incoming) WritePages(first int, src []byte) error {
	return in.WritePagesFrom(first, [][]byte{src})
}

// WritePagesFrom is WritePages for pages that arrived in pieces: parts,
// concatenated, are the pages (a gRPC message, for one, is a list of
// 16 KiB buffers). On a device that writes parts of pages in place
// (cudaops.PartWriter) the bytes go from the parts to the pages without
// another copy; on one that copies through page-locked staging
// (cudaops.StagedCopier: CUDA) they are gathered from the parts straight
// into it.
func (in *Incoming) WritePagesFrom(first int, parts [][]byte) error {
	pb := in.pageLen
	total := 0
	for _, part := range parts {
		total += len(part)
	}
	n := total / pb
	if !pageRangeOK(first, n, total, pb, in.pages) {
		return fmt.Errorf("%w: write of %d bytes at page %d of %d (pages are %d bytes)",
			ErrInvalidArgument, total, first, in.pages, pb)
	}
	hs, err := in.receive(first, n)
	if err != nil {
		return err
	}
	p := in.pool
	sums := make([]uint64, n)
	err = p.writeParts(hs, parts, sums)
	p.unpin(in.lease)
	if err != nil {
		return in.fail(err)
	}
	// Counted only once the bytes have landed, so that Complete never
	// vouches for a page still being written.
	in.count(first, sums)
	return nil
}

// receive marks import pages first … first+n-1 received, once and for
// all, so that no mix of WritePagesFrom and PageViews writes a page
// twice, and pins the lease for writing them, returning their handles;
// the caller unpins. Any error aborts the import: a page already
// received (ErrDuplicatePage), an import that has ended
// (ErrStaleTransfer), a pool closed or faulted.
func (in *Incoming) receive(first, n int) ([]allocator.Handle, error) {
	in.mu.Lock()
	for i := first; i < first+n; i++ {
		if in.mu.got[i] {
			in.mu.Unlock()
			return nil, in.fail(fmt.Errorf("%w: page %d of request %q", ErrDuplicatePage, i, in.lease.id))
		}
		in.mu.got[i] = true
	}
	in.mu.Unlock()

	p := in.pool
	var hs []allocator.Handle
	p.mu.Lock()
	err := p.stateErrLocked()
	if err == nil && (!in.owns() || in.lease.draining) {
		err = fmt.Errorf("%w: import of request %q has ended", ErrStaleTransfer, in.lease.id)
	}
	if err == nil {
		// Read under Pool.mu, once the import is known live: the lease's
		// end resets its handles.
		hs = in.lease.handles[first : first+n]
		err = p.pinPagesLocked(in.lease, hs, true)
	}
	p.mu.Unlock()
	if err != nil {
		return nil, in.fail(err)
	}
	return hs, nil
}

// count records the sums of pages first, first+1, … whose bytes have
// landed.
func (in *Incoming) count(first int, sums []uint64) {
	in.mu.Lock()
	copy(in.mu.sums[first:], sums)
	in.mu.received += len(sums)
	in.mu.Unlock()
}

// writeParts writes pages hs, region by region, from the concatenation
// of parts, and sets sums[i] to the checksum of page i's bytes; the caller
// has pinned the pages. Each page is summed just before it is written,
// while its bytes are in cache, so the bytes written are the bytes summed.
// A region that lies in one part is written from it; one split across
// parts is written in pieces on a cudaops.PartWriter and assembled in
// scratch memory elsewhere. A cudaops.StagedCopier takes writeStaged.
func (p *Pool) writeParts(hs []allocator.Handle, parts [][]byte, sums []uint64) error {
	if sc, ok := p.dev.(cudaops.StagedCopier); ok {
		return p.writeStaged(sc, hs, parts, sums)
	}
	partial, _ := p.dev.(cudaops.PartWriter)
	cur := partCursor{parts: parts}
	var block, region, blockSums []byte // scratch
	for i, h := range hs {
		ahead := cur // sums the page, ahead of the writes
		sums[i], blockSums = ahead.pageSum(int(p.PageBytes()), &block, blockSums)
		for r := range p.lay.primary.count {
			rb := int(p.lay.regions[r].PageBytes)
			var err error
			if partial != nil {
				for off := 0; off < rb && err == nil; {
					seg := cur.next(rb - off)
					err = partial.WritePagePart(r, h.Page, off, seg)
					off += len(seg)
				}
			} else {
				err = p.dev.WritePage(r, h.Page, cur.take(rb, &region))
			}
			if err != nil {
				return fmt.Errorf("%w: page %d region %d: %w", ErrDevice, h.Page, r, err)
			}
		}
	}
	return nil
}

// writeStaged is writeParts on a device that copies through page-locked
// staging (CUDA): every region of every page in one call, one DMA per run
// of adjacent pages per region and one wait per staging buffer's worth.
// Each page's regions are gathered from the parts straight into their
// places in staging (the one host copy a write from Go memory takes, so
// no region is assembled in scratch first) and the page is then summed
// over its staged bytes, while they are in cache: those are exactly the
// bytes the DMA carries, so what is summed is what lands on the device.
func (p *Pool) writeStaged(sc cudaops.StagedCopier, hs []allocator.Handle, parts [][]byte, sums []uint64) error {
	pb := int(p.PageBytes())
	regions, pages := p.handoffRegions(), pageIDs(hs)
	cur := partCursor{parts: parts}
	page := make([][]byte, len(regions)) // a staged page's regions
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
				page[k] = dst
			}
			landing := partCursor{parts: page}
			sums[first+j], blockSums = landing.pageSum(pb, &block, blockSums)
		}
	})
	if err != nil {
		return fmt.Errorf("%w: writing %d pages: %w", ErrDevice, len(hs), err)
	}
	return nil
}

// Viewable reports whether PageViews can lend the import's pages' memory
// (the pool's pages are host memory); otherwise write them with
// WritePagesFrom.
func (in *Incoming) Viewable() bool {
	_, ok := in.pool.dev.(pageViewer)
	return ok
}

// PageViews is WritePagesFrom without the copy, for a transport that
// reads the pages' bytes from its connection straight into their memory:
// it appends to views the live memory of import pages first …
// first+n-1, one view per page per region, each page's regions in order
// (the concatenation of the views is the byte layout WritePagesFrom
// takes), marks the pages received as WritePagesFrom does, and pins the
// lease until landed is called.
//
// landed(true) says the views hold the pages' bytes: each page is summed
// over what its memory holds when landed runs (not over the views slice,
// which the caller may reuse once it has read into it), and counted
// received, so the caller must not write the views after it. landed(false) says they
// do not (a read failed part way): the import is aborted. landed must be
// called exactly once, from any goroutine; later calls do nothing and
// return nil. Every end of the import waits for landed (Abort, Close, a
// receiver's transfer timeout, and the abort of a failing WritePages,
// PageViews or Complete of this import), so the caller must call it
// before it waits on anything that may end the import.
//
// Errors are WritePagesFrom's, and ErrInvalidArgument on a pool whose
// pages are not host memory (see Viewable), which also leaves the import
// usable; ErrDevice for a page the device lends less of than a region,
// which aborts it. On an error nothing is pinned and views is returned
// unextended.
func (in *Incoming) PageViews(first, n int, views [][]byte) (_ [][]byte, landed func(ok bool) error, err error) {
	p := in.pool
	pv, ok := p.dev.(pageViewer)
	if !ok {
		return views, nil, fmt.Errorf("%w: the pool's device (%s) has no host memory to write in place: write with WritePagesFrom", ErrInvalidArgument, p.dev.Name())
	}
	pb := in.pageLen
	if n > in.pages || !pageRangeOK(first, n, n*pb, pb, in.pages) {
		return views, nil, fmt.Errorf("%w: views of %d pages at page %d of %d", ErrInvalidArgument, n, first, in.pages)
	}
	hs, err := in.receive(first, n)
	if err != nil {
		return views, nil, err
	}
	start := len(views)
	for _, h := range hs {
		for r := range p.lay.primary.count {
			v := pv.PageBytes(r, h.Page)
			if len(v) != int(p.lay.regions[r].PageBytes) {
				p.unpin(in.lease) // first: the abort waits for the pin
				return views[:start], nil, in.fail(fmt.Errorf("%w: page %d region %d: no memory to write in place", ErrDevice, h.Page, r))
			}
			views = append(views, v[:len(v):len(v)]) // nothing past the page
		}
	}
	var done atomic.Bool
	landed = func(ok bool) error {
		if !done.CompareAndSwap(false, true) {
			return nil
		}
		if !ok {
			p.unpin(in.lease) // first: the abort waits for the pin
			in.Abort()
			return nil
		}
		// Summed over the pages' own memory, not over the caller's views
		// slice, which it may have reused by now: what is vouched for is
		// what the engine will read.
		sums := make([]uint64, n)
		page := make([][]byte, p.lay.primary.count)
		for i, h := range hs {
			for r := range page {
				page[r] = pv.PageBytes(r, h.Page)
			}
			sums[i] = PageChecksumOf(page)
		}
		in.count(first, sums)
		p.unpin(in.lease)
		return nil
	}
	return views, landed, nil
}

// Complete verifies that every page arrived and that the content checksum
// matches, then makes the lease usable: prefilled, written watermark =
// prompt tokens. On failure the import is aborted (its pages scrubbed) and
// the error wraps ErrIncompleteTransfer or ErrChecksumMismatch.
func (in *Incoming) Complete() (*Lease, error) { return in.complete(in.want) }

// CompleteWithChecksum is Complete for an import whose content checksum
// arrived after its pages (a sender sums the pages as it sends them, and
// seals the sum in the transfer's last message): checksum is checked
// instead of the one BeginImport was given.
func (in *Incoming) CompleteWithChecksum(checksum uint32) (*Lease, error) {
	return in.complete(checksum)
}

func (in *Incoming) complete(want uint32) (*Lease, error) {
	in.mu.Lock()
	received := in.mu.received
	sum := ContentChecksum(in.mu.sums)
	in.mu.Unlock()
	if received != in.pages {
		return nil, in.fail(fmt.Errorf("%w: request %q received %d of %d pages",
			ErrIncompleteTransfer, in.lease.id, received, in.pages))
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
	in.lease.written.Store(int64(in.lease.prompt)) // unsealed: decode commits generated tokens
	in.lease.phase.Store(uint32(PhasePrefilled))
	return in.lease, nil
}

// Abort ends the import: its pages go through the scrubber. Aborting an
// import that already ended does nothing.
func (in *Incoming) Abort() error {
	_, err := in.pool.endLease(in.lease, in.owns, PhaseAborted, cudaops.Ordering{})
	return err
}
