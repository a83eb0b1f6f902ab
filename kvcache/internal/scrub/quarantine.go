// Package scrub is the quarantine of a kvfence pool: how a freed page
// becomes clean before anyone else can receive it. It is kvcache's
// machinery; the rules (what a page is filled with) are isolation's
// ScrubPolicy.
//
//	released (allocator: Quarantined) ──Issue: one batched fill──▶ filling
//	filling ──fence done, no error──▶ FinishLocked: Clean ──▶ Free
//	filling ──fill or fence error──▶ FinishLocked: Retire, pool faulted
//
// # Invariants (checked by CheckLocked)
//
//   - a page is never returned to the free list before its fill's fence
//     has completed without error;
//   - every quarantined page belongs to a fill in flight, and pages leave
//     quarantine only through FinishLocked (clean, or retired on error);
//   - a failed fill retires its pages (they never come back) and faults
//     the quarantine: every admission must then fail closed until the
//     operator clears the fault.
package scrub

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/internal/invariants"
	"github.com/kvfence/kvfence/isolation"
)

// Quarantine scrubs one or more page spaces (Space): a pool's cache
// groups, each numbered from zero by its own allocator and living in its
// own device regions. Every method takes its pages per space: batches[s]
// are pages of space s. A release that frees pages of several spaces
// scrubs them with one device operation (cudaops.SpanFiller.FillSpans;
// cudaops.Device.Fill where one space covers every region).
//
// Methods ending in Locked must be called with the owning pool's lock
// held, the same lock that guards the allocators (under the invariants
// build tag they assert it). Issue needs no lock: it only touches the
// device, which is why a pool can fill outside its lock.
type Quarantine struct {
	spaces []space
	dev    cudaops.Device
	// whole is set when space 0 is the only space and covers every
	// device region: Issue then uses Fill, which every device has.
	whole     bool
	ownerName func(allocator.Owner) string // for canary reports; called under the lock
	lock      *sync.Mutex                  // the owner's lock, for assertions
	spec      cudaops.FillSpec
	policy    isolation.ScrubPolicy

	// Guarded by the owner's lock.
	// ended[s] counts space s's pages cleaned or retired since New; beside
	// spaces rather than in them, which keeps a space one cache line.
	ended     []uint64
	fault     error
	stats     isolation.ScrubStats
	verifyBuf []byte
}

// Space is one page space a Quarantine scrubs: its allocator, and the
// device regions [First, First+Count) that hold its pages.
type Space struct {
	Alloc        *allocator.Allocator
	First, Count int
}

type space struct {
	Space
	regions      []cudaops.Region
	bytesPerPage int64 // over the space's regions
	inFlight     int   // guarded by the owner's lock: pages released and not yet cleaned or retired
}

// New returns the quarantine of spaces on dev, whose regions hold the
// element types dtypes (isolation.ScrubPolicy.FillSpecFor). The spaces'
// regions must not overlap; a device that must fill more than one space,
// or a space that is not all of its regions, must implement
// cudaops.SpanFiller. lock is the owner's lock that guards the
// allocators; the Locked methods must be called with it held. ownerName
// names a page's last owner in canary reports.
func New(spaces []Space, dev cudaops.Device, lock *sync.Mutex, policy isolation.ScrubPolicy,
	ownerName func(allocator.Owner) string, dtypes ...isolation.DType) (*Quarantine, error) {
	spec, err := policy.FillSpecFor(dtypes...)
	if err != nil {
		return nil, err
	}
	regions := dev.Regions()
	q := &Quarantine{dev: dev, ownerName: ownerName, lock: lock, spec: spec, policy: policy}
	spans := make([]cudaops.Span, len(spaces))
	maxPage := int64(0)
	for i, sp := range spaces {
		if sp.Alloc == nil || sp.Count < 1 || sp.First < 0 || sp.First > len(regions)-sp.Count {
			return nil, fmt.Errorf("%w: page space %d names regions [%d, %d+%d) of %d", isolation.ErrInvalidPolicy, i, sp.First, sp.First, sp.Count, len(regions))
		}
		s := space{Space: sp, regions: regions[sp.First : sp.First+sp.Count]}
		for _, r := range s.regions {
			s.bytesPerPage += r.PageBytes
			maxPage = max(maxPage, r.PageBytes)
		}
		q.spaces = append(q.spaces, s)
		spans[i] = cudaops.Span{First: sp.First, Count: sp.Count}
	}
	if err := cudaops.CheckSpans(regions, spans); err != nil {
		return nil, fmt.Errorf("%w: page spaces: %w", isolation.ErrInvalidPolicy, err)
	}
	q.ended = make([]uint64, len(spaces))
	q.whole = len(spaces) == 1 && spaces[0].First == 0 && spaces[0].Count == len(regions)
	if _, ok := dev.(cudaops.SpanFiller); !ok && !q.whole {
		return nil, fmt.Errorf("%w: %s cannot fill %d page spaces (or part of its regions) in one operation: it does not implement cudaops.SpanFiller",
			isolation.ErrInvalidPolicy, dev.Name(), len(spaces))
	}
	if policy.Kind == isolation.ScrubCanary {
		q.verifyBuf = make([]byte, maxPage)
	}
	return q, nil
}

// ScrubAllFree fills every free page of every space and waits for the
// fill. A pool calls it once at creation: fresh or adopted device memory
// holds whatever an earlier process or the engine left there, and no
// lease may see that. It must run before any page is handed out.
func (q *Quarantine) ScrubAllFree() error {
	batches := make([][]int32, len(q.spaces))
	n := 0
	for i, s := range q.spaces {
		batches[i] = s.Alloc.PeekFree(nil, s.Alloc.Count(allocator.Free))
		slices.Sort(batches[i])
		n += len(batches[i])
	}
	f, err := q.Issue(batches, cudaops.Ordering{})
	if err == nil {
		err = f.Wait()
	}
	if err != nil {
		return fmt.Errorf("%w: initial scrub of %d pages: %w", isolation.ErrScrubFailed, n, err)
	}
	q.stats.Fills++
	for i, s := range q.spaces {
		q.stats.PagesScrubbed += uint64(len(batches[i]))
		q.stats.BytesScrubbed += uint64(len(batches[i])) * uint64(s.bytesPerPage)
	}
	return nil
}

// assertHeld panics, under the invariants build tag, if the owner's lock
// is not held. TryLock cannot tell who holds it, but a Locked method
// called without any lock is the bug this catches.
func (q *Quarantine) assertHeld() {
	if invariants.Enabled && q.lock != nil && q.lock.TryLock() {
		q.lock.Unlock()
		panic("scrub: Quarantine Locked method called without the pool lock")
	}
}

// Spec returns the fill the policy implies.
func (q *Quarantine) Spec() cudaops.FillSpec { return q.spec }

// Policy returns the scrub policy.
func (q *Quarantine) Policy() isolation.ScrubPolicy { return q.policy }

// Spaces returns the number of page spaces.
func (q *Quarantine) Spaces() int { return len(q.spaces) }

// BeginLocked records that n pages of space s just entered quarantine and
// will be passed to Issue.
func (q *Quarantine) BeginLocked(s, n int) {
	q.assertHeld()
	q.spaces[s].inFlight += n
}

// Issue starts the fill of pages, batches[s] of space s (len(batches) ≤
// Spaces(); empty ones are skipped), all in one device operation with one
// fence, ordered after the engine work named by after. An error means the
// fill never started, and the caller must pass it to FinishLocked.
func (q *Quarantine) Issue(batches [][]int32, after cudaops.Ordering) (cudaops.Fence, error) {
	if q.whole {
		// One space, every region: Fill, which every device has.
		if len(batches) == 0 || len(batches[0]) == 0 {
			return cudaops.Completed(nil), nil
		}
		f, err := q.dev.Fill(batches[0], q.spec, after)
		if err != nil {
			return nil, fmt.Errorf("%w: fill of %d pages: %w", isolation.ErrScrubFailed, len(batches[0]), err)
		}
		return f, nil
	}
	buf := spanBufs.Get().(*[]cudaops.Span)
	defer spanBufs.Put(buf)
	spans := (*buf)[:0]
	defer func() { clear(spans); *buf = spans[:0] }() // no page list outlives the fill in the pool
	n := 0
	for i, b := range batches {
		if len(b) > 0 {
			// Through a pointer: a copy of the space would read its
			// counters, which the pool writes under its lock while this
			// runs outside it; First and Count never change.
			s := &q.spaces[i]
			spans = append(spans, cudaops.Span{First: s.First, Count: s.Count, Pages: b})
			n += len(b)
		}
	}
	if n == 0 {
		return cudaops.Completed(nil), nil
	}
	f, err := q.dev.(cudaops.SpanFiller).FillSpans(spans, q.spec, after)
	if err != nil {
		return nil, fmt.Errorf("%w: fill of %d pages in %d page spaces: %w", isolation.ErrScrubFailed, n, len(spans), err)
	}
	return f, nil
}

// spanBufs recycles Issue's span lists: releases run concurrently,
// outside the pool lock, and a list handed to an interface method would
// otherwise be allocated by every release.
var spanBufs = sync.Pool{New: func() any { return new([]cudaops.Span) }}

// FinishLocked ends the scrub of a batch of Issue with the fence's (or
// Issue's) result: cleaned pages go to the free lists, failed ones are
// retired and the quarantine faults. It returns the fault it recorded, or
// nil.
func (q *Quarantine) FinishLocked(batches [][]int32, fillErr error) error {
	q.assertHeld()
	n := 0
	for s, pages := range batches {
		if fillErr == nil {
			q.cleanLocked(s, pages)
		} else {
			q.retireLocked(s, pages)
		}
		n += len(pages)
	}
	if fillErr == nil {
		q.stats.Fills++
		return nil
	}
	return q.failedLocked(n, fillErr)
}

func (q *Quarantine) cleanLocked(s int, pages []int32) {
	if len(pages) == 0 {
		return
	}
	sp := &q.spaces[s]
	sp.inFlight -= len(pages)
	q.ended[s] += uint64(len(pages))
	if err := sp.Alloc.Clean(pages); err != nil {
		panic(fmt.Sprintf("scrub: cleaning scrubbed pages: %v", err)) // pages were quarantined by us
	}
	q.stats.PagesScrubbed += uint64(len(pages))
	q.stats.BytesScrubbed += uint64(len(pages)) * uint64(sp.bytesPerPage)
}

func (q *Quarantine) retireLocked(s int, pages []int32) {
	if len(pages) == 0 {
		return
	}
	sp := &q.spaces[s]
	sp.inFlight -= len(pages)
	q.ended[s] += uint64(len(pages))
	if err := sp.Alloc.Retire(pages); err != nil {
		panic(fmt.Sprintf("scrub: retiring pages of a failed fill: %v", err))
	}
	q.stats.PagesRetired += uint64(len(pages))
}

// EndedLocked returns how many pages of space s have left quarantine,
// cleaned or retired, since New: a count that only grows, for a caller
// that waits until the pages in quarantine when it looked have had their
// turn.
func (q *Quarantine) EndedLocked(s int) uint64 {
	q.assertHeld()
	return q.ended[s]
}

// failedLocked records a failed fill of n pages (already retired).
func (q *Quarantine) failedLocked(n int, fillErr error) error {
	q.stats.FillErrors++
	if !errors.Is(fillErr, isolation.ErrScrubFailed) {
		fillErr = fmt.Errorf("%w: %w", isolation.ErrScrubFailed, fillErr)
	}
	err := fmt.Errorf("%w (%d pages retired)", fillErr, n)
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

// RecordFaultLocked faults the quarantine with err (if it is not faulted
// already): a fill of pages that stay held (a sliding window's) failed,
// so the device can no longer be trusted to scrub.
func (q *Quarantine) RecordFaultLocked(err error) {
	q.assertHeld()
	q.stats.FillErrors++
	if q.fault == nil {
		q.fault = err
	}
}

// ClearFaultLocked forgets the fault. Retired pages stay retired.
func (q *Quarantine) ClearFaultLocked() {
	q.assertHeld()
	q.fault = nil
}

// StatsLocked returns running totals.
func (q *Quarantine) StatsLocked() isolation.ScrubStats {
	q.assertHeld()
	return q.stats
}

// NeedsVerify reports whether pages must pass VerifyLocked before they
// are handed out (the canary policy).
func (q *Quarantine) NeedsVerify() bool { return q.policy.Kind == isolation.ScrubCanary }

// VerifyLocked checks that free pages of space s about to be handed out
// still hold their canary in every byte of every region. Pages found
// written are retired and the quarantine faults; the first mismatch is
// returned as an *isolation.CanaryError, with the number of pages
// retired.
func (q *Quarantine) VerifyLocked(s int, pages []int32) (retired int, err error) {
	q.assertHeld()
	sp := &q.spaces[s]
	var first error
	var bad []int32
	for _, p := range pages {
		q.stats.CanaryChecks++
		if err := q.verifyPage(sp, p); err != nil {
			if first == nil {
				first = err
			}
			bad = append(bad, p)
		}
	}
	if len(bad) == 0 {
		return 0, nil
	}
	if err := sp.Alloc.Unclean(bad); err != nil {
		panic(fmt.Sprintf("scrub: taking corrupt free pages back: %v", err))
	}
	if err := sp.Alloc.Retire(bad); err != nil {
		panic(fmt.Sprintf("scrub: retiring corrupt pages: %v", err))
	}
	q.stats.CanaryFailures += uint64(len(bad))
	q.stats.PagesRetired += uint64(len(bad))
	if q.fault == nil {
		q.fault = fmt.Errorf("%w (%d pages retired)", first, len(bad))
	}
	return len(bad), first
}

func (q *Quarantine) verifyPage(sp *space, p int32) error {
	want := q.spec.WordFor(p)
	for i, r := range sp.regions {
		ri := sp.First + i
		buf := q.verifyBuf[:r.PageBytes]
		if err := q.dev.ReadPage(ri, p, buf); err != nil {
			return fmt.Errorf("%w: reading page %d of region %d: %w", isolation.ErrCanaryMismatch, p, ri, err)
		}
		for off := 0; off < len(buf); off += 4 {
			if got := binary.LittleEndian.Uint32(buf[off:]); got != want {
				info, _ := sp.Alloc.Info(p)
				owner := fmt.Sprintf("owner#%d", info.Owner)
				if q.ownerName != nil {
					owner = q.ownerName(info.Owner)
				}
				return &isolation.CanaryError{Page: p, Region: ri, Offset: int64(off), Want: want, Got: got,
					PrevOwner: owner, Gen: info.Gen}
			}
		}
	}
	return nil
}

// CheckLocked verifies that every quarantined page of every space is
// accounted for by a scrub in flight.
func (q *Quarantine) CheckLocked() error {
	q.assertHeld()
	var errs []error
	for i, sp := range q.spaces {
		if n := sp.Alloc.Count(allocator.Quarantined); n != sp.inFlight {
			errs = append(errs, fmt.Errorf("%w: page space %d: %d pages quarantined, %d in flight", isolation.ErrCorrupt, i, n, sp.inFlight))
		}
	}
	return errors.Join(errs...)
}
