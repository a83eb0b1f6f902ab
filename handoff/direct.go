package handoff

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/kvfence/kvfence/kvcache"
)

// Transport-free handoff. Send and Serve drive a whole transfer over a
// Transport; an engine that already has its own channel between the
// prefill and decode nodes (or a foreign-language binding, such as the C
// ABI) moves the bytes itself instead:
//
//	prefill:  e := sender.Export(lease, maxNew)
//	          ship e.ManifestBytes(); for each run of units: e.ReadUnits(first, buf), ship buf
//	          (a unit too large to ship whole, in ranges: e.ReadUnitRange(u, off, buf))
//	          after the decode side confirmed: e.Ack()   (or e.Abort())
//	decode:   in := receiver.Begin(ctx, manifestBytes)   (verify, claim, admit fail-closed)
//	          for each run received: in.WriteUnits(first, buf)  (ranges: in.WriteUnitRange)
//	          lease := in.Complete()                      (every unit, checksum verified)
//
// Units are kvcache's handoff units: the pages (slots) of every cache
// group that hold the prompt's state, group by group (Extents); in a pool
// of one per-token group, its pages.
//
// The checks are the same as Serve's (MAC, expiry, geometry, domain,
// replay, fail-closed admission, checksum); only the per-frame transfer ID
// and generation checks have no frames to apply to, and the content
// checksum over every page still catches misplaced or foreign bytes.

// ManifestBytes returns the signed, encoded manifest to hand to the
// decode side's Receiver.Begin, with the content checksum in it: the
// first call reads every page once to compute it (kvcache.ErrReclaimed if
// the pages are no longer pinned). The slice is the export's: do not
// modify it.
func (e *Export) ManifestBytes() ([]byte, error) {
	if e == nil {
		return nil, errNilExport
	}
	e.full.Lock()
	defer e.full.Unlock()
	if e.full.wire == nil {
		sum, err := e.out.Checksum()
		if err != nil {
			return nil, err
		}
		m := e.m
		m.Checksum, m.ChecksumSealed = sum, false
		if e.full.wire, err = m.AppendEncode(nil, e.s.cfg.Key); err != nil {
			return nil, err
		}
	}
	return e.full.wire, nil
}

// Checksum returns the content checksum of the exported pages, reading
// each once on the first call (as ManifestBytes does); kvcache.ErrReclaimed
// if it was not known yet and the pages are no longer pinned.
func (e *Export) Checksum() (uint32, error) {
	if e == nil {
		return 0, errNilExport
	}
	return e.out.Checksum()
}

// PageBytes is the size of one page of the per-token group, all
// regions; 0 for a nil export.
func (e *Export) PageBytes() int {
	if e == nil {
		return 0
	}
	return int(e.out.PageBytes())
}

// Extents returns the export's extents, one per cache group (nil for a
// nil export).
func (e *Export) Extents() []kvcache.HandoffExtent {
	if e == nil {
		return nil
	}
	return e.out.Extents()
}

// UnitBytes is the size of unit u; 0 for a unit out of range or a nil
// export.
func (e *Export) UnitBytes(u int) int64 {
	if e == nil {
		return 0
	}
	return e.out.UnitBytes(u)
}

// ReadUnits copies exported units first, first+1, … into dst (whole
// units, each's regions in order; dst ends at a unit's end). It fails
// with kvcache.ErrReclaimed once the units are no longer pinned, and then
// copies nothing.
func (e *Export) ReadUnits(first int, dst []byte) error {
	if e == nil {
		return errNilExport
	}
	return e.out.ReadUnits(first, dst)
}

// ReadUnitRange copies bytes [off, off+len(dst)) of unit u into dst, for
// a unit shipped in ranges; errors are ReadUnits'.
func (e *Export) ReadUnitRange(u int, off int64, dst []byte) error {
	if e == nil {
		return errNilExport
	}
	return e.out.ReadUnitRange(u, off, dst)
}

// Ack ends the export once the decode side has confirmed the import: the
// pages are released through the scrubber. kvcache.ErrReclaimed means the
// reclaim deadline (or an Abort) came first; the pages are scrubbed
// either way.
func (e *Export) Ack() error {
	if e == nil {
		return errNilExport
	}
	return e.out.Ack()
}

// Import is a transfer the caller moves itself, begun by Receiver.Begin.
// Its methods may be called from any goroutine; WritePages calls may run
// concurrently for disjoint pages.
type Import struct {
	r     *Receiver
	in    *kvcache.Incoming
	m     Manifest
	pb    int
	timer *time.Timer
	// mu serialises Complete and Abort, so that exactly one of them
	// decides the request ID's claim. Lock order: mu → Receiver.mu, and
	// mu → Pool.mu.
	mu struct {
		sync.Mutex
		ended bool // completed or aborted
	}
}

// Begin verifies an encoded manifest (the MAC first, then expiry,
// geometry, sharing domain and replay, exactly as Serve does), claims its
// request ID and admits the import fail-closed in the receiver's pool. On
// any error nothing stays allocated or claimed. The import aborts itself
// if it has not completed within the receiver's TransferTimeout. A nil
// receiver or context is ErrInvalidArgument, checked before the manifest is
// read, so it claims nothing and does not count as a refused transfer.
func (r *Receiver) Begin(ctx context.Context, manifest []byte) (*Import, error) {
	switch {
	case r == nil:
		return nil, errNilReceiver
	case ctx == nil:
		return nil, fmt.Errorf("%w: Begin with a nil context", ErrInvalidArgument)
	}
	m, err := r.vet(manifest)
	if err != nil {
		r.refused(err)
		return nil, err
	}
	if m.ChecksumSealed {
		r.unclaim(m.RequestID)
		err := fmt.Errorf("%w: request %q has its checksum sealed after the pages, which only a transfer over a Transport carries; "+
			"a direct import takes the manifest of Export.ManifestBytes", ErrProtocol, m.RequestID)
		r.refused(err)
		return nil, err
	}
	in, err := r.admit(ctx, &m)
	if err != nil {
		r.unclaim(m.RequestID)
		r.refused(err)
		return nil, err
	}
	imp := &Import{r: r, in: in, m: m, pb: int(r.cfg.Pool.PageBytes())} // the fingerprints matched
	// Under mu, so that a timer firing at once finds imp.timer set.
	imp.mu.Lock()
	imp.timer = time.AfterFunc(r.cfg.TransferTimeout, func() { imp.Abort() })
	imp.mu.Unlock()
	return imp, nil
}

// errNilImport is what the methods of a nil *Import return: the caller
// went on with the result of a Begin that failed.
var errNilImport = fmt.Errorf("%w: nil Import (Receiver.Begin failed?)", ErrInvalidArgument)

// Manifest is the verified manifest of the import (zero for a nil import).
func (imp *Import) Manifest() Manifest {
	if imp == nil {
		return Manifest{}
	}
	return imp.m
}

// Units is the number of units to write, every group's; 0 for a nil
// import.
func (imp *Import) Units() int {
	if imp == nil {
		return 0
	}
	return imp.in.Units()
}

// Extents returns the import's extents, one per cache group (nil for a
// nil import).
func (imp *Import) Extents() []kvcache.HandoffExtent {
	if imp == nil {
		return nil
	}
	return imp.in.Extents()
}

// UnitBytes is the size of unit u; 0 for a unit out of range or a nil
// import.
func (imp *Import) UnitBytes(u int) int64 {
	if imp == nil {
		return 0
	}
	return imp.in.UnitBytes(u)
}

// PageBytes is the size of one page of the per-token group, all regions.
func (imp *Import) PageBytes() int {
	if imp == nil {
		return 0
	}
	return imp.pb
}

// WriteUnits writes received units first, first+1, … from src (whole
// units, each's regions in order; src ends at a unit's end). Any error
// aborts the import.
func (imp *Import) WriteUnits(first int, src []byte) error {
	if imp == nil {
		return errNilImport
	}
	return imp.written(imp.in.WriteUnits(first, src))
}

// WriteUnitRange writes bytes [off, off+len(src)) of unit u, for a unit
// received in ranges: a unit's ranges one at a time and in order, from
// offset 0, each but the last a multiple of kvcache.UnitRangeAlign long.
// Any error aborts the import.
func (imp *Import) WriteUnitRange(u int, off int64, src []byte) error {
	if imp == nil {
		return errNilImport
	}
	return imp.written(imp.in.WriteUnitRangeFrom(u, off, [][]byte{src}))
}

// written ends the import for a write's error, if any.
func (imp *Import) written(err error) error {
	if err != nil {
		// The Incoming aborted itself (but for a range outside it); this
		// ends it, settles the claim and counts the refusal under err.
		imp.abortFor(err)
		return err
	}
	return nil
}

// Complete verifies that every page arrived and the content checksum
// matches and returns the usable lease (prefilled, written = prompt
// tokens). On failure the import is aborted.
func (imp *Import) Complete() (*kvcache.Lease, error) {
	if imp == nil {
		return nil, errNilImport
	}
	imp.mu.Lock()
	defer imp.mu.Unlock()
	if imp.mu.ended {
		return nil, fmt.Errorf("%w: import of request %q has ended", kvcache.ErrStaleTransfer, imp.m.RequestID)
	}
	l, err := imp.in.Complete()
	if err != nil {
		imp.abortLocked(err)
		return nil, err
	}
	imp.mu.ended = true
	imp.timer.Stop()
	r := imp.r
	r.mu.Lock()
	r.mu.claims[imp.m.RequestID] = claim{done: true, expires: imp.m.Expires}
	r.mu.stats.Imported++
	r.mu.Unlock()
	return l, nil
}

// Abort ends an import that has not completed: its pages go through the
// scrubber and its request ID may be imported again. After Complete (or a
// first Abort) it does nothing: a completed lease is the caller's to
// release.
func (imp *Import) Abort() error {
	if imp == nil {
		return errNilImport
	}
	return imp.abortFor(fmt.Errorf("%w: import of request %q aborted (by its caller or its TransferTimeout) before it completed",
		kvcache.ErrIncompleteTransfer, imp.m.RequestID))
}

// abortFor ends the import for cause unless it has ended already.
func (imp *Import) abortFor(cause error) error {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	if imp.mu.ended {
		return nil
	}
	return imp.abortLocked(cause)
}

// abortLocked ends the import for cause, which the receiver counts and
// logs as the refusal's reason.
func (imp *Import) abortLocked(cause error) error {
	imp.mu.ended = true
	imp.timer.Stop()
	err := imp.in.Abort()
	imp.r.unclaim(imp.m.RequestID)
	imp.r.refused(cause)
	if err != nil {
		// err is the decode pool's (kvcache.ErrPoolClosed, or the
		// scrub's failure), which the package's contract passes on.
		return fmt.Errorf("%w (aborting the import of %q)", err, imp.m.RequestID)
	}
	return nil
}

// Ended reports whether the import has completed or been aborted (by the
// caller, a failed write or check, or the transfer timeout). A nil import
// never began, so it has nothing left to do: true.
func (imp *Import) Ended() bool {
	if imp == nil {
		return true
	}
	imp.mu.Lock()
	defer imp.mu.Unlock()
	return imp.mu.ended
}
