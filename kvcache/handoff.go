package kvcache

// Handoff: the page-level half of disaggregated prefill → decode.
//
// A lease moves through phases that say what its pages hold:
//
//	admitted ──BeginPrefill──▶ prefilling ──FinishPrefill──▶ prefilled ──Export──▶ exported ──Ack──▶ released
//	   │                           │       (written = prompt)     │                     │
//	   └───────────────────────────┴────────── Abort ─────────────┴─────────────────────┴──▶ aborted
//	                                                            (reclaim deadline = Abort)
//
// and, on the decode side, an import:
//
//	BeginImport: admitted fail-closed ──▶ importing ──every page written, checksum matches──▶ prefilled
//	                                          └──────────── any failure, Abort ─────────────▶ aborted
//
// Invariants:
//
//   - Only a prefilled lease (written watermark = prompt tokens) can be
//     exported. A refused request has no lease, so there is nothing to
//     export: no placeholder can travel.
//   - An exported lease takes no writes: Export seals its watermark at the
//     prompt, and Commit and SlotMapping then fail with ErrLeasePhase, so
//     every read of the pages, for the checksum or for the transfer,
//     sees the same bytes. An import's lease is sealed until Complete,
//     which leaves the decode lease open to commits of generated tokens.
//   - An import is admitted only in the sharing domain its KV was computed
//     in (the exporting lease's, Outgoing.Domain): BeginImport refuses with
//     ErrDomainMismatch when the tenant is in another domain here, before
//     and in the admission. The decode lease then belongs to that domain
//     and, given its tokens (AttachTokens), publishes there like any lease.
//   - An exported lease's pages are read only while the lease still holds
//     them: each read checks, under Pool.mu, that the lease is exported,
//     still this export's (its first handle's generation), and that every
//     page is at the handle's generation, and pins the lease for the copy,
//     which then runs without the lock. Every release of a lease waits
//     for its pins and refuses new ones from when it starts (drainLocked),
//     so no read overlaps a release, and no byte of a reused page is ever
//     sent.
//   - An importing lease is never handed out: BeginImport returns an
//     *Incoming, not the *Lease. The Lease exists (its pages are in use,
//     charged to the tenant, counted by Check) but no engine can see its
//     block table until Complete has verified that every page arrived and
//     the content checksum matches. Any failure aborts the import: the
//     pages go through the scrubber.
//   - Writes into an import check, under Pool.mu, that the import is live
//     and each page still at its generation, and pin it as reads do, so a
//     late (stale) transfer never lands in a page that was released and
//     reused (SGLang 24578).
//
// The content checksum folds, in page order, one 64-bit XXH3 hash per page
// (PageChecksum: over its bytes in every region, region 0 first, in 4 KiB
// blocks): the XXH3 of the little-endian per-page hashes, its two halves
// XORed into 32 bits. Being computed per page, it lets pages arrive in any
// order and on several streams, and lets a sender sum each page as it
// reads it to send it (PageChecksum, ContentChecksum) instead of reading
// every page once more beforehand (Outgoing.Checksum); the decode side
// checks either with Complete or CompleteWithChecksum. It guards integrity (corruption,
// truncation, misplaced or stale pages); authenticity comes from the
// manifest's MAC and the transport (TLS). Every byte of a handoff is summed
// twice, once on each side, so speed matters: XXH3 (github.com/zeebo/xxh3)
// runs at about 2.6 times CRC32C's speed on the same core (68 against 26
// GB/s on cached data, bench/README.md's machine), and a cryptographic hash
// of every byte would cap the handoff at one core's SHA-256 speed.

import (
	"context"
	"encoding/binary"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/zeebo/xxh3"
	"golang.org/x/sync/errgroup"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
)

// Phase is a lease's place in the handoff state machine.
type Phase uint32

const (
	PhaseAdmitted   Phase = iota // admitted, nothing written yet
	PhasePrefilling              // the engine is writing the prompt's KV
	PhasePrefilled               // the prompt's KV is complete: written = prompt tokens
	PhaseExported                // pinned for a transfer; released on ack or at the reclaim deadline
	PhaseImporting               // decode side: receiving page bytes; not usable
	PhaseReleased                // ended normally
	PhaseAborted                 // ended by a failure, an abort or the reclaim deadline
)

var phaseNames = [...]string{"admitted", "prefilling", "prefilled", "exported", "importing", "released", "aborted"}

func (ph Phase) String() string {
	if int(ph) < len(phaseNames) {
		return phaseNames[ph]
	}
	return fmt.Sprintf("Phase(%d)", uint32(ph))
}

// Phase returns the lease's handoff phase.
func (l *Lease) Phase() Phase {
	ph := Phase(l.phase.Load())
	switch l.state.Load() {
	case leaseLive:
		return ph
	case leaseReleased:
		if ph == PhaseAborted {
			return ph
		}
		return PhaseReleased
	}
	return PhaseAdmitted
}

// advance moves a live lease from one phase to the next.
func (l *Lease) advance(from, to Phase) error {
	if err := l.live(); err != nil {
		return err
	}
	if !l.phase.CompareAndSwap(uint32(from), uint32(to)) {
		return fmt.Errorf("%w: lease %q is %v, %v needs %v", ErrLeasePhase, l.id, l.Phase(), to, from)
	}
	return nil
}

// BeginPrefill records that the engine starts writing the prompt's KV.
func (l *Lease) BeginPrefill() error { return l.advance(PhaseAdmitted, PhasePrefilling) }

// FinishPrefill records that prefill is complete. The written watermark
// must equal the prompt: a prefill that stopped short (or a placeholder
// that wrote one token) cannot become exportable.
func (l *Lease) FinishPrefill() error {
	if err := l.live(); err != nil {
		return err
	}
	if w := l.Written(); w != l.prompt {
		return fmt.Errorf("%w: lease %q has %d of %d prompt tokens written", ErrLeasePhase, l.id, w, l.prompt)
	}
	return l.advance(PhasePrefilling, PhasePrefilled)
}

// Abort ends the lease from any phase, releasing its pages through the
// scrubber, and records it as aborted.
func (l *Lease) Abort() error {
	if l.pool == nil {
		return fmt.Errorf("%w: lease was never admitted", ErrInvalidArgument)
	}
	ended, err := l.pool.endIf(l, func() bool { return true }, PhaseAborted)
	if err == nil && !ended {
		return ErrLeaseReleased
	}
	return err
}

// endIf releases l through the scrubber if it is live and owned() holds,
// both decided under Pool.mu so that nothing can release or recycle the
// lease in between. It records phase as the lease's final phase.
func (p *Pool) endIf(l *Lease, owned func() bool, phase Phase) (ended bool, err error) {
	p.mu.Lock()
	for {
		if p.mu.closed {
			p.mu.Unlock()
			return false, ErrPoolClosed
		}
		if l.state.Load() != leaseLive || !owned() {
			p.mu.Unlock()
			return false, nil
		}
		if !p.drainLocked(l) {
			break
		}
	}
	l.phase.Store(uint32(phase))
	l.state.Store(leaseReleased)
	pages := p.detachLocked(l, l.scrub[:0])
	l.scrub = pages[:0]
	p.mu.Unlock()
	return true, p.scrub(pages, cudaops.Ordering{})
}

// testHookBeforeImportAdmit, if set (by tests only), runs in BeginImport
// between the domain pre-check and the admission.
var testHookBeforeImportAdmit func()

// checksumBlock is the unit pages are hashed in (PageChecksum).
const checksumBlock = 4 << 10

// PageChecksum is the per-page term of a content checksum: the XXH3-64 of
// the little-endian XXH3-64s of the page's 4 KiB blocks (the last one may
// be shorter), over its bytes in every region, region 0 first. Hashed in
// blocks, a page that arrived in pieces (a gRPC message is a list of
// 16 KiB buffers) is summed where it lies, but for the few blocks that
// straddle two pieces, instead of being streamed through a hasher that
// copies every byte.
func PageChecksum(page []byte) uint64 {
	var small [64 * 8]byte // the block sums of a page up to 256 KiB
	cur := partCursor{parts: [][]byte{page}}
	sum, _ := cur.pageSum(len(page), nil, small[:0])
	return sum
}

// ContentChecksum folds per-page checksums, in page order, into the
// content checksum of a transfer.
func ContentChecksum(pageSums []uint64) uint32 {
	h := xxh3.New()
	var buf [256]byte
	for len(pageSums) > 0 {
		n := min(len(pageSums), len(buf)/8)
		for i, s := range pageSums[:n] {
			binary.LittleEndian.PutUint64(buf[8*i:], s)
		}
		h.Write(buf[:8*n])
		pageSums = pageSums[n:]
	}
	sum := h.Sum64()
	return uint32(sum) ^ uint32(sum>>32)
}

// Outgoing is an exported lease: the prompt's pages pinned for a transfer
// until Ack, Abort or the reclaim deadline.
type Outgoing struct {
	pool    *Pool
	lease   *Lease
	first   allocator.Handle // identifies this export of the lease
	handles []allocator.Handle
	timer   *time.Timer

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
	p := l.pool
	if p == nil {
		return nil, fmt.Errorf("%w: lease was never admitted", ErrInvalidArgument)
	}
	p.mu.Lock()
	if err := p.stateErrLocked(); err != nil {
		p.mu.Unlock()
		return nil, err
	}
	if err := l.live(); err != nil {
		p.mu.Unlock()
		return nil, err
	}
	// Sealing the watermark at exactly the prompt both checks it and stops
	// every later Commit: the pages are read and summed from here on.
	if ph := l.Phase(); ph != PhasePrefilled || !l.written.CompareAndSwap(int64(l.prompt), int64(l.prompt)|writeSealed) {
		p.mu.Unlock()
		return nil, fmt.Errorf("%w: lease %q is %v with %d of %d prompt tokens written; only a prefilled lease can be exported",
			ErrLeasePhase, l.id, ph, l.Written(), l.prompt)
	}
	l.phase.Store(uint32(PhaseExported))
	n := p.geom.PagesFor(l.prompt)
	o := &Outgoing{pool: p, lease: l, first: l.handles[0], handles: append([]allocator.Handle(nil), l.handles[:n]...)}
	p.mu.Unlock()
	// The callback must not touch o.timer: it may fire before the
	// assignment when reclaimAt has passed.
	o.timer = time.AfterFunc(time.Until(reclaimAt), func() { p.endIf(l, o.owns, PhaseAborted) })
	return o, nil
}

// pageSums reads every exported page once and returns its checksum. The
// pages are split among up to GOMAXPROCS workers in contiguous runs: a
// manifest that carries the checksum cannot leave before this pass ends,
// and the reads run in parallel (ReadPages pins the lease, it does not
// hold the pool lock while copying).
func (o *Outgoing) pageSums() ([]uint64, error) {
	n := len(o.handles)
	sums := make([]uint64, n)
	pb := int(o.pool.geom.PageBytes())
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

// owns reports, under Pool.mu, whether the lease is still this export.
func (o *Outgoing) owns() bool {
	l := o.lease
	return l.state.Load() == leaseLive && Phase(l.phase.Load()) == PhaseExported && l.handles[0] == o.first
}

func (o *Outgoing) end(phase Phase) (bool, error) {
	if o.timer != nil {
		o.timer.Stop()
	}
	return o.pool.endIf(o.lease, o.owns, phase)
}

// RequestID, Tenant, PromptTokens and Pages describe what is exported.
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

// Geometry is the page geometry of the exporting pool.
func (o *Outgoing) Geometry() Geometry { return o.pool.geom }

// Live reports whether the pages are still pinned.
func (o *Outgoing) Live() bool {
	o.pool.mu.Lock()
	defer o.pool.mu.Unlock()
	return !o.pool.mu.closed && o.owns()
}

// ReadPages copies exported pages first, first+1, … into dst, each page
// PageBytes long with its regions in order; len(dst) must be a multiple of
// PageBytes. It fails with ErrReclaimed once the pages are no longer this
// export's, and then copies nothing. Reads may run concurrently with each
// other and with the pool's other work: the pool lock is held only while
// the read is vetted, and the lease cannot be released until it is done.
func (o *Outgoing) ReadPages(first int, dst []byte) error {
	p := o.pool
	pb := int(p.geom.PageBytes())
	n := len(dst) / pb
	if n == 0 || len(dst)%pb != 0 || first < 0 || first+n > len(o.handles) {
		return fmt.Errorf("%w: read of %d bytes at page %d of %d (pages are %d bytes)",
			ErrInvalidArgument, len(dst), first, len(o.handles), pb)
	}
	hs := o.handles[first : first+n]
	p.mu.Lock()
	err := o.checkLocked()
	if err == nil {
		err = p.pinPagesLocked(o.lease, hs)
	}
	p.mu.Unlock()
	if err != nil {
		return err
	}
	defer p.unpin(o.lease)
	return p.readPages(hs, dst)
}

func (o *Outgoing) checkLocked() error {
	if o.pool.mu.closed {
		return ErrPoolClosed
	}
	if !o.owns() || o.lease.draining {
		return fmt.Errorf("%w: request %q", ErrReclaimed, o.lease.id)
	}
	return nil
}

// Page copies between a lease's pages and host memory run outside
// Pool.mu, so that a handoff moving hundreds of MiB neither serializes its
// own readers nor stalls admissions. A copy is vetted and pinned under
// Pool.mu; every release of the lease (Release, Abort, the reclaim
// deadline, Close) first waits, in drainLocked, until its pins are gone,
// and from then on refuses new ones. So a copy only ever touches pages
// that the vetted lease still holds: none is scrubbed, reused or closed
// under it.

// pinPagesLocked checks that each page is still in use at its handle's
// generation and, if so, pins l for one copy; unpin ends it.
func (p *Pool) pinPagesLocked(l *Lease, hs []allocator.Handle) error {
	for _, h := range hs {
		info, err := p.mu.alloc.Info(h.Page)
		if err != nil || info.State != allocator.InUse || info.Gen != h.Gen {
			return fmt.Errorf("%w: page %d is at generation %d (%v), transfer expects %d",
				ErrStaleTransfer, h.Page, info.Gen, info.State, h.Gen)
		}
	}
	l.pins++
	p.mu.pins++
	return nil
}

func (p *Pool) unpin(l *Lease) {
	p.mu.Lock()
	l.pins--
	p.mu.pins--
	if l.pins == 0 && (l.draining || p.mu.closed) {
		p.unpinned.Broadcast()
	}
	p.mu.Unlock()
}

// drainLocked is called by a release of live lease l with Pool.mu held.
// If copies are in flight on l's pages it refuses new ones, waits for
// them (releasing Pool.mu meanwhile) and returns true: the caller must
// then look at the lease again, as anything may have happened to it.
func (p *Pool) drainLocked(l *Lease) bool {
	if l.pins == 0 {
		return false
	}
	l.draining = true
	for l.pins > 0 {
		p.unpinned.Wait()
	}
	return true
}

// readPages copies whole pages into buf; the caller has pinned them.
func (p *Pool) readPages(hs []allocator.Handle, buf []byte) error {
	rb := int(p.geom.RegionPageBytes())
	off := 0
	for _, h := range hs {
		for r := range p.geom.Regions() {
			if err := p.dev.ReadPage(r, h.Page, buf[off:off+rb]); err != nil {
				return fmt.Errorf("kvcache: page %d region %d: %w", h.Page, r, err)
			}
			off += rb
		}
	}
	return nil
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
// export that already ended does nothing.
func (o *Outgoing) Abort() error {
	_, err := o.end(PhaseAborted)
	return err
}

// Incoming is an import in progress on the decode side. Its lease holds
// every page the request needs (prompt + max new tokens) but is not
// handed out until Complete has verified the transfer.
type Incoming struct {
	pool    *Pool
	lease   *Lease
	first   allocator.Handle
	pages   int // prompt pages to receive
	want    uint32
	pageLen int

	mu struct {
		sync.Mutex
		sums     []uint64
		got      []bool
		received int
	}
}

// BeginImport admits req fail-closed (exactly as Admit: the same errors,
// nothing allocated on refusal) for the KV of a prompt arriving from a
// prefill pool, computed in sharing domain domain, whose content checksum
// is checksum. The returned import receives the prompt's pages with
// WritePages and becomes a usable lease only through Complete.
//
// The tenant must be in domain in this pool, both before admission (else
// ErrDomainMismatch with nothing allocated) and in the admission itself (a
// tenant moved meanwhile: the pages just admitted are scrubbed and the
// error is ErrDomainMismatch), so that KV never enters another domain than
// the one it was computed in. Domain names are the operator's: the pools
// on both sides must name a shared domain alike (a tenant's own domain is
// isolation.PrivateDomainPrefix + its name everywhere).
func (p *Pool) BeginImport(ctx context.Context, req Request, domain string, checksum uint32) (*Incoming, error) {
	if domain == "" {
		return nil, fmt.Errorf("%w: import of request %q names no sharing domain", ErrInvalidArgument, req.ID)
	}
	mismatch := func(have, when string) error {
		return fmt.Errorf("%w: request %q of tenant %q was computed in domain %q, the tenant is in %q here%s",
			ErrDomainMismatch, req.ID, req.Tenant, domain, have, when)
	}
	// An unknown tenant is left to the admission, which refuses it with
	// its usual error and count.
	if have, err := p.TenantDomain(req.Tenant); err == nil && have != domain {
		return nil, mismatch(have, "")
	}
	if testHookBeforeImportAdmit != nil {
		testHookBeforeImportAdmit()
	}
	l := new(Lease)
	if err := p.AdmitInto(ctx, req, l); err != nil {
		return nil, err
	}
	// Sealed at zero: nothing may write the pages but WritePages, and the
	// watermark is set only by Complete.
	l.written.Store(writeSealed)
	l.phase.Store(uint32(PhaseImporting))
	if have := l.Domain(); have != domain {
		l.Abort()
		return nil, mismatch(have, " (moved during admission)")
	}
	in := &Incoming{pool: p, lease: l, first: l.handles[0], pages: p.geom.PagesFor(req.PromptTokens),
		want: checksum, pageLen: int(p.geom.PageBytes())}
	in.mu.sums = make([]uint64, in.pages)
	in.mu.got = make([]bool, in.pages)
	return in, nil
}

// Pages is the number of pages the import expects.
func (in *Incoming) Pages() int { return in.pages }

// RequestID is the imported request's ID.
func (in *Incoming) RequestID() string { return in.lease.id }

func (in *Incoming) owns() bool {
	l := in.lease
	return l.state.Load() == leaseLive && Phase(l.phase.Load()) == PhaseImporting && l.handles[0] == in.first
}

// fail aborts the import and returns err.
func (in *Incoming) fail(err error) error {
	in.Abort()
	return err
}

// WritePages writes received pages first, first+1, … from src, each page
// PageBytes long with its regions in order. Any error aborts the import:
// a malformed range, a page received twice, or an import that has already
// ended (ErrStaleTransfer: nothing is written).
func (in *Incoming) WritePages(first int, src []byte) error {
	return in.WritePagesFrom(first, [][]byte{src})
}

// WritePagesFrom is WritePages for pages that arrived in pieces: parts,
// concatenated, are the pages (a gRPC message, for one, is a list of
// 16 KiB buffers). On a device that writes parts of pages in place
// (cudaops.PartWriter) the bytes go from the parts to the pages without
// another copy.
func (in *Incoming) WritePagesFrom(first int, parts [][]byte) error {
	pb := in.pageLen
	total := 0
	for _, part := range parts {
		total += len(part)
	}
	n := total / pb
	if n == 0 || total%pb != 0 || first < 0 || first+n > in.pages {
		return in.fail(fmt.Errorf("%w: write of %d bytes at page %d of %d (pages are %d bytes)",
			ErrInvalidArgument, total, first, in.pages, pb))
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
	hs := in.lease.handles[first : first+n]
	p.mu.Lock()
	err := p.stateErrLocked()
	if err == nil && (!in.owns() || in.lease.draining) {
		err = fmt.Errorf("%w: import of request %q has ended", ErrStaleTransfer, in.lease.id)
	}
	if err == nil {
		err = p.pinPagesLocked(in.lease, hs)
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

// partCursor walks the concatenation of parts.
type partCursor struct {
	parts [][]byte
	off   int // into parts[0]
}

// next returns the next contiguous run of at most max bytes and moves
// past it; the caller asks for no more than is left.
func (c *partCursor) next(max int) []byte {
	for len(c.parts[0]) == c.off {
		c.parts, c.off = c.parts[1:], 0
	}
	seg := c.parts[0][c.off:min(len(c.parts[0]), c.off+max)]
	c.off += len(seg)
	return seg
}

// take returns the next n bytes, contiguous: a slice of the part that
// holds them, or, when they straddle parts, a copy in *scratch (grown as
// needed).
func (c *partCursor) take(n int, scratch *[]byte) []byte {
	seg := c.next(n)
	if len(seg) == n {
		return seg
	}
	if len(*scratch) < n {
		*scratch = make([]byte, n)
	}
	b := (*scratch)[:n]
	for k := copy(b, seg); k < n; {
		k += copy(b[k:], c.next(n-k))
	}
	return b
}

// pageSum is PageChecksum of the next pageBytes bytes, which straddle
// parts anywhere: each block is hashed where it lies, or stitched in
// *block first. sums is scratch for the block sums, returned for reuse.
func (c *partCursor) pageSum(pageBytes int, block *[]byte, sums []byte) (uint64, []byte) {
	sums = sums[:0]
	for off := 0; off < pageBytes; off += checksumBlock {
		sums = binary.LittleEndian.AppendUint64(sums, xxh3.Hash(c.take(min(checksumBlock, pageBytes-off), block)))
	}
	return xxh3.Hash(sums), sums
}

// writeParts writes pages hs, region by region, from the concatenation
// of parts, and sets sums[i] to the checksum of page i's bytes; the caller
// has pinned the pages. Each page is summed just before it is written,
// while its bytes are in cache, so the bytes written are the bytes summed.
// A region that lies in one part is written from it; one split across
// parts is written in pieces on a cudaops.PartWriter and assembled in
// scratch memory elsewhere.
func (p *Pool) writeParts(hs []allocator.Handle, parts [][]byte, sums []uint64) error {
	rb := int(p.geom.RegionPageBytes())
	partial, _ := p.dev.(cudaops.PartWriter)
	cur := partCursor{parts: parts}
	var block, region, blockSums []byte // scratch
	for i, h := range hs {
		ahead := cur // sums the page, ahead of the writes
		sums[i], blockSums = ahead.pageSum(rb*p.geom.Regions(), &block, blockSums)
		for r := range p.geom.Regions() {
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
				return fmt.Errorf("kvcache: page %d region %d: %w", h.Page, r, err)
			}
		}
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
	if !in.owns() {
		return nil, fmt.Errorf("%w: import of request %q has ended", ErrStaleTransfer, in.lease.id)
	}
	in.lease.written.Store(int64(in.lease.prompt)) // unsealed: decode commits generated tokens
	in.lease.phase.Store(uint32(PhasePrefilled))
	return in.lease, nil
}

// Abort ends the import: its pages go through the scrubber. Aborting an
// import that already ended does nothing.
func (in *Incoming) Abort() error {
	_, err := in.pool.endIf(in.lease, in.owns, PhaseAborted)
	return err
}
