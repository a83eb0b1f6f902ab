package kvcache

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvfence/kvfence/cudaops"
)

// This file is the way back: a lease ends (Release, Abort, an export's
// ack or reclaim deadline, an aborted import, Close), its pages leave the
// books under Pool.mu, and the scrub fills them outside it and returns
// them to the free list once the fill has completed.

// endLease ends live lease l, if owns (nil: any incarnation) still holds,
// both decided under Pool.mu so that nothing can release or recycle the
// lease in between. A non-zero phase is recorded as the lease's final
// phase. The pages are scrubbed after the engine work named by after.
func (p *Pool) endLease(l *Lease, owns func() bool, phase Phase, after cudaops.Ordering) (ended bool, err error) {
	p.mu.Lock()
	for {
		if p.mu.closed {
			p.mu.Unlock()
			return false, ErrPoolClosed
		}
		if l.state.Load() != leaseLive || (owns != nil && !owns()) {
			p.mu.Unlock()
			return false, nil
		}
		if !p.drainLocked(l) {
			break
		}
	}
	if phase != 0 {
		l.phase.Store(uint32(phase))
	}
	l.state.Store(leaseReleased)
	pages := p.detachLocked(l, l.scrub[:0])
	l.scrub = pages[:0]
	p.fills.Add(1)
	p.mu.Unlock()
	return true, p.scrub(pages, after)
}

// detachLocked takes a lease that has just stopped being live off the
// books: out of the lease table, its export's reclaim timer stopped, its
// shared pages back to the prefix cache and its private ones into
// quarantine (appended to pages, which the caller must scrub), its tenant
// uncharged and woken.
func (p *Pool) detachLocked(l *Lease, pages []int32) []int32 {
	p.assertHeld()
	delete(p.mu.leases, l.id)
	if l.export != nil {
		l.export.timer.Stop()
		l.export = nil
	}
	before := len(pages)
	pages = p.releasePagesLocked(l, pages) // shared pages may stay cached
	p.q.BeginLocked(len(pages) - before)
	p.wakeTenantLocked(l.tenant)
	p.assertLocked("release")
	return pages
}

// scrub fills pages (already quarantined and counted in flight, with
// p.fills.Add(1) done under Pool.mu) and, once the fill has completed,
// returns them to the free list; then it calls p.fills.Done. pages may be
// reused by the caller once scrub returns.
func (p *Pool) scrub(pages []int32, after cudaops.Ordering) error {
	if len(pages) == 0 {
		p.fills.Done()
		return nil
	}
	if !slices.IsSorted(pages) {
		slices.Sort(pages) // adjacent IDs coalesce into one run per region
	}
	fence, err := p.q.Issue(pages, after)
	if errors.Is(err, cudaops.ErrBadOrdering) && !after.IsZero() {
		// The ordering passed checkOrdering but went bad since (the engine
		// destroyed its stream): the caller's mistake, not a failed fill.
		// Wait for all the engine's work instead.
		fence, err = p.q.Issue(pages, cudaops.Ordering{})
	}
	if err == nil {
		var done bool
		if done, err = fence.Done(); !done {
			batch := slices.Clone(pages)
			go func() {
				defer p.fills.Done()
				p.finishScrub(batch, fence.Wait())
			}()
			return nil
		}
	}
	err = p.finishScrub(pages, err)
	p.fills.Done()
	return err
}

// checkOrdering refuses, before a lease gives up its pages, an ordering
// the device cannot wait for (a stream or event that does not exist, of
// another context, capturing a CUDA graph): that is the caller's error,
// the lease stays live, and it never becomes a failed scrub that faults
// the pool.
func (p *Pool) checkOrdering(after cudaops.Ordering) error {
	c, ok := p.dev.(cudaops.OrderingChecker)
	if !ok || after.IsZero() {
		return nil
	}
	if err := c.CheckOrdering(after); err != nil {
		return fmt.Errorf("%w: release ordering: %w", ErrInvalidArgument, err)
	}
	return nil
}

// fillAndWait fills pages and waits for the fill, for an admission that
// evicted them and needs them clean before it can go on.
func (p *Pool) fillAndWait(pages []int32) error {
	slices.Sort(pages)
	fence, err := p.q.Issue(pages, cudaops.Ordering{})
	if err == nil {
		err = fence.Wait()
	}
	return err
}

func (p *Pool) finishScrub(pages []int32, fillErr error) error {
	p.mu.Lock()
	err := p.finishScrubLocked(pages, fillErr)
	p.mu.Unlock()
	return err
}

// finishScrubLocked ends a scrub with its fill's result: clean pages go to
// the free list, a failed fill retires its pages and faults the pool.
func (p *Pool) finishScrubLocked(pages []int32, fillErr error) error {
	p.assertHeld()
	err := p.q.FinishLocked(pages, fillErr)
	if err != nil {
		p.faultedLocked()
	} else {
		p.wakePagesLocked()
	}
	p.assertLocked("scrub")
	if err != nil {
		return fmt.Errorf("%w: %w", ErrPoolFaulted, err)
	}
	return nil
}

// Page copies between a lease's pages and host memory (handoff reads and
// writes) run outside Pool.mu, so that a handoff moving hundreds of MiB
// neither serializes its own readers nor stalls admissions. A copy is
// vetted and pinned under Pool.mu; every end of the lease first waits, in
// drainLocked, until its pins are gone, and from then on refuses new ones.
// So a copy only ever touches pages that the vetted lease still holds: none
// is scrubbed, reused or closed under it.

// drainLocked is called by an end of live lease l with Pool.mu held. If
// copies are in flight on l's pages it refuses new ones, waits for them
// (releasing Pool.mu meanwhile) and returns true: the caller must then
// look at the lease again, as anything may have happened to it.
func (p *Pool) drainLocked(l *Lease) bool {
	p.assertHeld()
	if l.pins == 0 {
		return false
	}
	l.draining = true
	for l.pins > 0 {
		p.quiet.Wait()
	}
	return true
}

// unpin ends one copy on l's pages.
func (p *Pool) unpin(l *Lease) {
	p.mu.Lock()
	l.pins--
	p.mu.pins--
	if l.pins == 0 && (l.draining || p.mu.closed) {
		p.quiet.Broadcast()
	}
	p.mu.Unlock()
}
