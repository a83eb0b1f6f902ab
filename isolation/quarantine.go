package isolation

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/internal/invariants"
)

// Quarantine cleans released pages before they can be reused:
//
//	released (allocator: Quarantined) ──Issue: one batched Fill──▶ filling
//	filling ──fence done, no error──▶ FinishLocked: Clean ──▶ Free
//	filling ──fill or fence error──▶ FinishLocked: Retire, pool faulted
//
// A page is never returned to the free list before its fill's fence has
// completed without error. A failed fill retires its pages (they never come
// back) and faults the quarantine: every admission must then fail closed
// until the operator clears the fault.
//
// Methods ending in Locked must be called with the owning pool's lock held,
// the same lock that guards the Allocator and the Registry (under the
// invariants build tag they assert it). Issue needs no lock: it only
// touches the device, which is why a pool can fill outside its lock.
type Quarantine struct {
	alloc        *allocator.Allocator
	dev          cudaops.Device
	reg          *Registry
	lock         *sync.Mutex // the owner's lock, for assertions
	spec         cudaops.FillSpec
	policy       ScrubPolicy
	bytesPerPage int64 // over all regions
	regions      []cudaops.Region

	// Guarded by the owner's lock.
	inFlight  int // pages released and not yet cleaned or retired
	fault     error
	stats     ScrubStats
	verifyBuf []byte
}

// ScrubStats are running totals of a quarantine.
type ScrubStats struct {
	Fills          uint64 // batches filled
	PagesScrubbed  uint64
	BytesScrubbed  uint64
	FillErrors     uint64
	PagesRetired   uint64
	CanaryChecks   uint64 // pages verified on allocation
	CanaryFailures uint64
}

// NewQuarantine returns the quarantine of a pool whose pages live in dev's
// regions. The policy is validated against dtype. lock is the owner's lock
// that guards alloc and reg; the Locked methods must be called with it
// held.
func NewQuarantine(alloc *allocator.Allocator, dev cudaops.Device, reg *Registry, lock *sync.Mutex, policy ScrubPolicy, dtype DType) (*Quarantine, error) {
	spec, err := policy.FillSpec(dtype)
	if err != nil {
		return nil, err
	}
	q := &Quarantine{alloc: alloc, dev: dev, reg: reg, lock: lock, spec: spec, policy: policy}
	q.regions = dev.Regions()
	maxPage := int64(0)
	for _, r := range q.regions {
		q.bytesPerPage += r.PageBytes
		maxPage = max(maxPage, r.PageBytes)
	}
	if policy.Kind == ScrubCanary {
		q.verifyBuf = make([]byte, maxPage)
	}
	return q, nil
}

// ScrubAllFree fills every free page and waits for the fill. A pool calls
// it once at creation: fresh or adopted device memory holds whatever an
// earlier process or the engine left there, and no lease may see that. It
// must run before any page is handed out.
func (q *Quarantine) ScrubAllFree() error {
	pages := q.alloc.PeekFree(nil, q.alloc.Count(allocator.Free))
	slices.Sort(pages)
	f, err := q.Issue(pages, cudaops.Ordering{})
	if err == nil {
		err = f.Wait()
	}
	if err != nil {
		return fmt.Errorf("%w: initial scrub of %d pages: %w", ErrScrubFailed, len(pages), err)
	}
	q.stats.Fills++
	q.stats.PagesScrubbed += uint64(len(pages))
	q.stats.BytesScrubbed += uint64(len(pages)) * uint64(q.bytesPerPage)
	return nil
}

// assertHeld panics, under the invariants build tag, if the owner's lock
// is not held. TryLock cannot tell who holds it, but a Locked method
// called without any lock is the bug this catches.
func (q *Quarantine) assertHeld() {
	if invariants.Enabled && q.lock != nil && q.lock.TryLock() {
		q.lock.Unlock()
		panic("isolation: Quarantine Locked method called without the pool lock")
	}
}

// Spec returns the fill the policy implies.
func (q *Quarantine) Spec() cudaops.FillSpec { return q.spec }

// Policy returns the scrub policy.
func (q *Quarantine) Policy() ScrubPolicy { return q.policy }

// BeginLocked records that n pages just entered quarantine and will be
// passed to Issue.
func (q *Quarantine) BeginLocked(n int) {
	q.assertHeld()
	q.inFlight += n
}

// Issue starts the fill of pages, ordered after the engine work named by
// after. It returns the fill's fence; an error means the fill never
// started, and the caller must pass it to FinishLocked.
func (q *Quarantine) Issue(pages []int32, after cudaops.Ordering) (cudaops.Fence, error) {
	if len(pages) == 0 {
		return cudaops.Completed(nil), nil
	}
	f, err := q.dev.Fill(pages, q.spec, after)
	if err != nil {
		return nil, fmt.Errorf("%w: fill of %d pages: %w", ErrScrubFailed, len(pages), err)
	}
	return f, nil
}

// FinishLocked ends the scrub of pages with the fence's (or Issue's)
// result: cleaned pages go to the free list, failed ones are retired and
// the quarantine faults. It returns the fault it recorded, or nil.
func (q *Quarantine) FinishLocked(pages []int32, fillErr error) error {
	q.assertHeld()
	q.inFlight -= len(pages)
	if fillErr == nil {
		if err := q.alloc.Clean(pages); err != nil {
			panic(fmt.Sprintf("isolation: cleaning scrubbed pages: %v", err)) // pages were quarantined by us
		}
		q.stats.Fills++
		q.stats.PagesScrubbed += uint64(len(pages))
		q.stats.BytesScrubbed += uint64(len(pages)) * uint64(q.bytesPerPage)
		return nil
	}
	if err := q.alloc.Retire(pages); err != nil {
		panic(fmt.Sprintf("isolation: retiring pages of a failed fill: %v", err))
	}
	q.stats.FillErrors++
	q.stats.PagesRetired += uint64(len(pages))
	if !errors.Is(fillErr, ErrScrubFailed) {
		fillErr = fmt.Errorf("%w: %w", ErrScrubFailed, fillErr)
	}
	err := fmt.Errorf("%w (%d pages retired)", fillErr, len(pages))
	if q.fault == nil {
		q.fault = err
	}
	return err
}

// FaultLocked returns the recorded fault, nil while healthy.
func (q *Quarantine) FaultLocked() error {
	q.assertHeld()
	return q.fault
}

// ClearFaultLocked forgets the fault. Retired pages stay retired.
func (q *Quarantine) ClearFaultLocked() {
	q.assertHeld()
	q.fault = nil
}

// StatsLocked returns running totals.
func (q *Quarantine) StatsLocked() ScrubStats {
	q.assertHeld()
	return q.stats
}

// NeedsVerify reports whether pages must pass VerifyLocked before they
// are handed out (the canary policy).
func (q *Quarantine) NeedsVerify() bool { return q.policy.Kind == ScrubCanary }

// VerifyLocked checks that free pages about to be handed out still hold
// their canary in every byte of every region. Pages found written are
// retired and the quarantine faults; the first mismatch is returned as a
// *CanaryError, with the number of pages retired.
func (q *Quarantine) VerifyLocked(pages []int32) (retired int, err error) {
	q.assertHeld()
	var first error
	var bad []int32
	for _, p := range pages {
		q.stats.CanaryChecks++
		if err := q.verifyPage(p); err != nil {
			if first == nil {
				first = err
			}
			bad = append(bad, p)
		}
	}
	if len(bad) == 0 {
		return 0, nil
	}
	if err := q.alloc.Unclean(bad); err != nil {
		panic(fmt.Sprintf("isolation: taking corrupt free pages back: %v", err))
	}
	if err := q.alloc.Retire(bad); err != nil {
		panic(fmt.Sprintf("isolation: retiring corrupt pages: %v", err))
	}
	q.stats.CanaryFailures += uint64(len(bad))
	q.stats.PagesRetired += uint64(len(bad))
	if q.fault == nil {
		q.fault = fmt.Errorf("%w (%d pages retired)", first, len(bad))
	}
	return len(bad), first
}

func (q *Quarantine) verifyPage(p int32) error {
	want := q.spec.WordFor(p)
	for ri, r := range q.regions {
		buf := q.verifyBuf[:r.PageBytes]
		if err := q.dev.ReadPage(ri, p, buf); err != nil {
			return fmt.Errorf("%w: reading page %d of region %d: %w", ErrCanaryMismatch, p, ri, err)
		}
		for off := 0; off < len(buf); off += 4 {
			if got := binary.LittleEndian.Uint32(buf[off:]); got != want {
				info, _ := q.alloc.Info(p)
				return &CanaryError{Page: p, Region: ri, Offset: int64(off), Want: want, Got: got,
					PrevOwner: ownerName(q.reg, info.Owner), Gen: info.Gen}
			}
		}
	}
	return nil
}

// CheckLocked verifies that every quarantined page is accounted for by a
// scrub in flight.
func (q *Quarantine) CheckLocked() error {
	q.assertHeld()
	if n := q.alloc.Count(allocator.Quarantined); n != q.inFlight {
		return fmt.Errorf("%w: %d pages quarantined, %d in flight", ErrCorrupt, n, q.inFlight)
	}
	return nil
}
