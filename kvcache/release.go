package kvcache

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
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
	b := p.detachOwnLocked(l)
	p.fills.Add(1)
	p.mu.Unlock()
	return true, p.scrub(b, after)
}

// scrubBatch is what one release (or Close, or an eviction) frees and
// scrubs in one fill: spaces[g] are pages of cache group g (quarantine
// space g), one entry per group of the pool.
type scrubBatch struct {
	spaces [][]int32
	// owner is the lease whose scratch (Lease.scrub) the arrays are
	// (detachOwnLocked sets it): finishScrubLocked gives them back to it
	// once the scrub no longer reads them.
	owner *Lease
}

// batchFor returns b emptied for a release in p: its arrays kept for
// reuse, one per group (made anew for scratch of a lease that last lived
// in a pool of other groups, or none yet).
func (b scrubBatch) batchFor(p *Pool) scrubBatch {
	if len(b.spaces) != len(p.groups) {
		b.spaces = make([][]int32, len(p.groups))
	}
	for i := range b.spaces {
		b.spaces[i] = b.spaces[i][:0]
	}
	return b
}

// scratch is what the lease whose release b is keeps as its scratch (in
// Lease.scrub) while b is scrubbed outside Pool.mu: nothing, for the scrub
// reads b's arrays until finishScrubLocked gives them back, and the lease
// may be admitted again and released meanwhile (an export's reclaim
// deadline, or a Release racing an Abort, ends it on another goroutine
// than the engine's). A batch with nothing to scrub, which scrub does not
// read, leaves its arrays with the lease at once.
func (b scrubBatch) scratch() scrubBatch {
	if b.len() == 0 {
		return scrubBatch{spaces: b.spaces}
	}
	return scrubBatch{}
}

// giveBackLocked returns the arrays of b, whose scrub has ended, to the
// lease they are the scratch of, unless it has other scratch by now.
func (b scrubBatch) giveBackLocked() {
	l := b.owner
	if l == nil || l.scrub.spaces != nil {
		return
	}
	l.scrub = scrubBatch{spaces: b.spaces}
}

func (b scrubBatch) len() int {
	n := 0
	for _, s := range b.spaces {
		n += len(s)
	}
	return n
}

// detachOwnLocked is detachLocked of l into its own scratch arrays, which
// the batch it returns carries until its scrub ends and finishScrubLocked
// gives them back (l keeps none meanwhile: see scratch).
func (p *Pool) detachOwnLocked(l *Lease) scrubBatch {
	b := p.detachLocked(l, l.scrub.batchFor(p))
	b.owner = l
	l.scrub = b.scratch()
	return b
}

// detachLocked takes a lease that has just stopped being live off the
// books: out of the lease table, its export's reclaim timer stopped, its
// shared pages back to the prefix cache and its private ones, in every
// group, into quarantine (appended to b, which the caller must scrub; b
// has an array per group), its tenant uncharged and woken.
func (p *Pool) detachLocked(l *Lease, b scrubBatch) scrubBatch {
	p.assertHeld()
	delete(p.mu.leases, l.id)
	if l.export != nil {
		l.export.timer.Stop()
		l.export = nil
	}
	for gi := range p.groups {
		b.spaces[gi] = p.releaseGroupLocked(l, gi, b.spaces[gi])
	}
	p.wakeTenantLocked(l.tenant)
	p.assertLocked("release")
	return b
}

// scrub fills the pages of b (already quarantined and counted in flight,
// with p.fills.Add(1) done under Pool.mu), in every group with one fill,
// and, once the fill has completed, returns them to the free lists; then
// it calls p.fills.Done. b is scrub's from then on: a fill that completes
// later reads it on its own goroutine, which finishScrubLocked ends by
// giving b's arrays back to their owner.
func (p *Pool) scrub(b scrubBatch, after cudaops.Ordering) error {
	if b.len() == 0 {
		p.fills.Done()
		return nil
	}
	// Adjacent IDs coalesce into one run per region.
	for _, s := range b.spaces {
		if !slices.IsSorted(s) {
			slices.Sort(s)
		}
	}
	start := monoNow()
	fence, err := p.q.Issue(b.spaces, after)
	if errors.Is(err, cudaops.ErrBadOrdering) && !after.IsZero() {
		// The ordering passed checkOrdering but went bad since (the engine
		// destroyed its stream): the caller's mistake, not a failed fill.
		// Wait for all the engine's work instead.
		fence, err = p.q.Issue(b.spaces, cudaops.Ordering{})
	}
	if err == nil {
		var done bool
		if done, err = fence.Done(); !done {
			go func() {
				defer p.fills.Done()
				err := fence.Wait()
				p.timeFill(start, err)
				p.finishScrub(b, err)
			}()
			return nil
		}
	}
	p.timeFill(start, err)
	err = p.finishScrub(b, err)
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

// fillAndWait fills the pages of b and waits for the fill, for an
// admission that evicted them and needs them clean before it can go on.
func (p *Pool) fillAndWait(b scrubBatch) error {
	for _, s := range b.spaces {
		slices.Sort(s)
	}
	start := monoNow()
	fence, err := p.q.Issue(b.spaces, cudaops.Ordering{})
	if err == nil {
		err = fence.Wait()
	}
	p.timeFill(start, err)
	return err
}

// timeFill records the latency of a fill that succeeded, started at
// monoNow() = start.
func (p *Pool) timeFill(start time.Duration, fillErr error) {
	if fillErr == nil {
		p.fillLatency.record(monoNow() - start)
	}
}

// monoEpoch is what monoNow counts from.
var monoEpoch = time.Now()

// monoNow is a reading of the monotonic clock: one clock read, where
// time.Now takes two (the wall clock too). Every release times its fill,
// and on bench/README.md's VM a clock read costs about 100 ns.
func monoNow() time.Duration { return time.Since(monoEpoch) }

func (p *Pool) finishScrub(b scrubBatch, fillErr error) error {
	p.mu.Lock()
	err := p.finishScrubLocked(b, fillErr)
	p.mu.Unlock()
	return err
}

// finishScrubLocked ends a scrub with its fill's result: clean pages go to
// the free lists, a failed fill retires its pages and faults the pool.
func (p *Pool) finishScrubLocked(b scrubBatch, fillErr error) error {
	p.assertHeld()
	err := p.q.FinishLocked(b.spaces, fillErr)
	if err != nil {
		p.faultedLocked()
		p.log.LogAttrs(context.Background(), slog.LevelError, "kvcache: scrub fill failed; its pages are retired and the pool is faulted until ClearFault",
			slog.Int("pages_retired", b.len()), slog.Int("retired_pages_total", p.groups[0].alloc.Count(allocator.Retired)),
			slog.Int("total_pages", p.total), slog.Any("error", err))
	} else {
		p.wakePagesLocked()
	}
	b.giveBackLocked()
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
	p.unpinLocked(l)
	p.mu.Unlock()
}

// unpinLocked is unpin with Pool.mu held.
func (p *Pool) unpinLocked(l *Lease) {
	l.pins--
	p.mu.pins--
	if l.pins == 0 && (l.draining || p.mu.closed) {
		p.quiet.Broadcast()
	}
}

// logCanaryLocked logs a canary audit that found free pages written: they
// are retired and the pool is faulted. The first mismatch names the page,
// its last owner domain and what it held.
func (p *Pool) logCanaryLocked(retired int, err error) {
	p.assertHeld()
	attrs := []slog.Attr{slog.Int("pages_retired", retired),
		slog.Int("retired_pages_total", p.groups[0].alloc.Count(allocator.Retired)), slog.Int("total_pages", p.total)}
	var ce *isolation.CanaryError
	if errors.As(err, &ce) {
		attrs = append(attrs, slog.Int("page", int(ce.Page)), slog.Int("region", ce.Region), slog.Int64("offset", ce.Offset),
			slog.String("last_owner_domain", ce.PrevOwner), slog.Uint64("want", uint64(ce.Want)), slog.Uint64("got", uint64(ce.Got)))
	}
	attrs = append(attrs, slog.Any("error", err))
	p.log.LogAttrs(context.Background(), slog.LevelError, "kvcache: canary mismatch in free pages; they are retired and the pool is faulted until ClearFault", attrs...)
}
