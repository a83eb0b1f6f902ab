package kvcache

import (
	"context"
	"fmt"
	"sync"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
)

// This file is the decode side of a handoff: an import (Incoming) that
// receives a prompt's pages into a lease admitted fail-closed, and hands
// the lease out only once every page arrived and the checksum matches. See
// phase.go for the state machine and its invariants.

// Incoming is an import in progress on the decode side. Its lease holds
// every page the request needs (prompt + max new tokens) but is not
// handed out until Complete has verified the transfer.
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
// prompt's pages with WritePages and becomes a usable lease only through
// Complete.
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
	in.mu.Lock()
	for i := first; i < first+n; i++ {
		if in.mu.got[i] {
			in.mu.Unlock()
			return in.fail(fmt.Errorf("%w: page %d of request %q", ErrDuplicatePage, i, in.lease.id))
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
		hs = in.lease.holds[0].handles[first : first+n]
		err = p.pinPagesLocked(in.lease, 0, hs, true)
	}
	p.mu.Unlock()
	sums := make([]uint64, n)
	if err == nil {
		err = p.writeParts(hs, parts, sums)
		p.unpin(in.lease)
	}
	if err != nil {
		return in.fail(err)
	}
	// Counted only once the bytes have landed, so that Complete never
	// vouches for a page still being written.
	in.mu.Lock()
	copy(in.mu.sums[first:], sums)
	in.mu.received += n
	in.mu.Unlock()
	return nil
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
		for r := range p.groups[0].count {
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
