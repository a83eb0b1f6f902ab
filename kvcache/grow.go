package kvcache

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

// This file is growth and preemption: how a lease sized on demand gets
// pages as its request generates, and how a running request gives its
// pages back to be admitted again later.
//
// A lease admitted under SizeOnDemand holds its whole prompt (never less:
// the incident's placeholder cannot come back through this door) and a
// headroom of output tokens. Before the engine writes past its capacity it
// calls Grow; growth is decided by the same rule as admission
// (isolation.Decide) and is all or nothing, but it passes the queue of
// waiting admissions and may use the pages the growth watermark keeps
// from them. A refused growth is an *AdmissionError whose Err says what
// binds (ErrPoolExhausted, ErrExceedsQuota, ErrExceedsMaxContext,
// ErrExceedsCapacity): the engine finishes or preempts the request.
//
// A decode step grows by one page, so growth has two paths. The fast one
// (growFastLocked) grants, in one pass under Pool.mu, a growth that free
// pages cover without a claim, an eviction or a canary check, and that the
// tenant's charge allows (tenancy.Registry.TryChargeGrowth, which is
// Decide for a growth); it changes nothing otherwise. Everything else, and
// every refusal, takes the general path (growLocked), which is the
// admission loop's: claims, evictions, waits and the refusal's numbers.
//
// Preempt ends a running lease but keeps what it computed where the
// prefix cache can find it: the full pages of its written tokens are
// published in its domain, the rest is scrubbed. Admitting the request
// again with all its tokens as the prompt shares those pages back
// (HitTokens), so only the last page is computed again.
//
// With a host tier (Config.HostTier), Preempt also swaps the pages it
// does not publish (the partial last page; every written page with prefix
// caching off) to the tier, all of them or none (tier_offload.go), and
// the request's next admission in the same domain copies them back into
// its fresh pages before the lease is handed out (tier_onload.go), so
// that nothing it wrote is computed again.

// Grow makes room for tokens more tokens after the written watermark: on
// success CapacityTokens() ≥ Written() + tokens. It adds the pages that
// takes, all or none, charged to the tenant, and does nothing if the lease
// already has the room. Like Admit, it waits for pages or quota until ctx
// is done (TryGrow never waits), and refuses at once what no release can
// cure: more than the request's prompt + max new tokens
// (ErrExceedsMaxContext), than the pool or the tenant's quota can hold. A
// lease whose pages are sealed (exported, importing) refuses with
// ErrLeasePhase. The block table and SlotMapping include the new pages
// once Grow returns.
func (l *Lease) Grow(ctx context.Context, tokens int) error {
	return l.grow(ctx, true, tokens)
}

// TryGrow is Grow that never waits: a busy pool or a full quota is refused
// at once.
func (l *Lease) TryGrow(tokens int) error {
	return l.grow(nil, false, tokens)
}

func (l *Lease) grow(ctx context.Context, wait bool, tokens int) error {
	if !l.isLive() {
		if err := l.live(); err != nil {
			return err
		}
		// Live on the second look (admitted meanwhile): grow it.
	}
	p := l.pool
	w := l.written.Load() // written tokens, unless sealed
	if tokens < 0 || w&writeSealed != 0 || tokens > l.prompt+l.maxNew-int(w) || wait && ctx.Err() != nil {
		return l.growRefused(ctx, wait, tokens)
	}
	target := int(w) + tokens
	need := p.pagesFor(target)
	if need <= l.Pages() {
		return nil // room enough: no lock taken
	}
	p.mu.Lock()
	if p.growFastLocked(l, need) {
		p.mu.Unlock()
		return nil
	}
	return p.growLocked(l.growth(ctx, wait, target))
}

// growRefused is the refusal of a growth that fails the checks made
// before Pool.mu: tokens negative, ctx done, the lease sealed, or more
// than the request's prompt + max new tokens.
//
//go:noinline
func (l *Lease) growRefused(ctx context.Context, wait bool, tokens int) error {
	if tokens < 0 {
		return fmt.Errorf("%w: Grow of lease %q by %d tokens", ErrInvalidArgument, l.id, tokens)
	}
	if wait {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("%w: growth of request %q: %w", ErrContextDone, l.id, err)
		}
	}
	w := l.written.Load()
	if w&writeSealed != 0 {
		return l.sealedErr("growth")
	}
	written, limit := int(w), l.prompt+l.maxNew
	if tokens <= limit-written {
		// Sealed, or a context ended, since the caller looked: try again.
		return l.grow(ctx, wait, tokens)
	}
	return l.pool.refuse(l.growth(ctx, wait, written+tokens),
		&AdmissionError{Err: ErrExceedsMaxContext, Need: written + tokens, Limit: limit})
}

// growth is the admission that grows l to hold target tokens: built only
// off the fast path, since it is most of a growth's stack.
func (l *Lease) growth(ctx context.Context, wait bool, target int) *admission {
	if ctx == nil {
		ctx = context.Background() // TryGrow's: it cannot be done
	}
	a := &admission{ctx: ctx, wait: wait, l: l, growing: true, target: target}
	a.req.ID, a.req.Tenant = l.id, l.Tenant() // named by a refusal
	return a
}

// growLocked is the general growth, entered with Pool.mu held: one that
// may claim, evict, verify canaries, wait or be refused.
//
// The admission it is given is built in its caller's frame (l.growth
// inlines), so growLocked stays out of line lest the fast path pay for
// that frame.
//
//go:noinline
func (p *Pool) growLocked(a *admission) error {
	p.assertHeld()
	if p.mu.closed {
		p.mu.Unlock()
		return ErrPoolClosed
	}
	a.seq, a.claimEpoch = a.l.seq, p.mu.claimEpoch
	// The first attempt, without runLocked's bookkeeping: a growth that
	// is granted (or refused) at once with no claim made and no place in
	// the queue has nothing for endAdmissionLocked to undo, and never
	// let go of the lock, so Close had nothing to wait for.
	st := p.growAttemptLocked(a)
	if st == stepDone && a.claims[0] == 0 && a.w == nil {
		p.mu.Unlock()
		return a.err
	}
	p.mu.admitting++
	return p.stepsLocked(a, st)
}

// growFastLocked grants a growth of live lease l to need pages in one
// pass when nothing stands in its way: the pool open and healthy, l live
// and unsealed, free pages enough without evicting or waiting, no canary
// to verify, and the tenant's charge granted by the one rule
// (tenancy.Registry.TryChargeGrowth is Decide for this case). That is
// almost every growth of a running request. Otherwise it changes nothing
// and returns false, and growLocked decides, refuses or waits.
func (p *Pool) growFastLocked(l *Lease, need int) bool {
	p.assertHeld()
	g, h := &p.groups[0], &l.holds[0]
	have := len(h.pages)
	fresh := need - have
	free := g.alloc.Count(allocator.Free)
	switch {
	case p.mu.closed, l.state.Load() != leaseLive, l.written.Load()&writeSealed != 0,
		p.q.FaultLocked() != nil, p.q.NeedsVerify(),
		fresh > free, g.claimed+fresh > free+g.evicting:
		return false
	}
	// The lease's own bounds need no check here: its pages are in service
	// and charged to its tenant, so fresh pages that are free and within
	// the tenant's quota left keep it within the pool (ErrExceedsCapacity)
	// and within the quota (ErrExceedsQuota).
	supply := free + g.evicting + p.evictableLocked(0) - g.claimed
	if !g.tenants.TryChargeGrowth(l.tenant, fresh, supply) { // also when fresh < 1
		return false
	}
	if fresh > 1 {
		p.grantGrowthLocked(l, fresh)
		return true
	}
	// A decode step's growth: grantGrowthLocked for one page, written out
	// here: calling it made a one-page growth about a tenth slower (in 5 of
	// 6 paired runs).
	hd, ok := g.alloc.AllocOne(l.domain.ID)
	if !ok {
		panic("kvcache: a page granted and free, but the allocator refused it")
	}
	h.handles = append(h.handles, hd)
	h.pages = append(h.pages, hd.Page)
	l.publishTable(h.pages)
	p.mu.growth.Grown++
	p.mu.growth.PagesGrown++
	p.assertLocked("grow")
	return true
}

// grantGrowthLocked gives l fresh pages the tenant has been charged for,
// in the lease's domain (which the tenant may have left since). Nothing
// can fail here.
func (p *Pool) grantGrowthLocked(l *Lease, fresh int) {
	h := &l.holds[0]
	handles, table, err := p.groups[0].alloc.AllocIDs(h.handles, h.pages, fresh, l.domain.ID)
	if err != nil {
		panic(fmt.Sprintf("kvcache: %d pages granted and free, but the allocator refused: %v", fresh, err))
	}
	h.handles, h.pages = handles, table
	l.publishTable(table)
	p.mu.growth.Grown++
	p.mu.growth.PagesGrown += uint64(fresh)
	p.assertLocked("grow")
}

// growAttemptLocked decides a growth once (see attemptLocked, of which it
// is the twin for a live lease).
func (p *Pool) growAttemptLocked(a *admission) step {
	p.assertHeld()
	l := a.l
	switch {
	case p.mu.closed:
		a.err = ErrPoolClosed
		return stepDone
	case l.state.Load() != leaseLive || l.seq != a.seq:
		a.err = ErrLeaseReleased
		return stepDone
	case l.written.Load()&writeSealed != 0:
		a.err = l.sealedErr("growth")
		return stepDone
	}
	if f := p.q.FaultLocked(); f != nil {
		return p.refuseLocked(a, &AdmissionError{Err: ErrPoolFaulted, Cause: f})
	}
	// Leases grow in the per-token group only: a window's ring and a
	// state slot are sized at admission for the whole request.
	t, g := l.tenant, &p.groups[0]
	have := len(l.holds[0].pages)
	fresh := p.pagesFor(a.target) - have
	if fresh <= 0 {
		a.err = nil
		return stepDone
	}
	inService := g.inServiceLocked()
	group, kind := p.refusalGroup(g)
	if total := have + fresh; total > inService {
		return p.refuseLocked(a, &AdmissionError{Err: ErrExceedsCapacity, Group: group, GroupKind: kind, Need: total,
			Have: g.alloc.Count(allocator.Free), Limit: inService, NeedTokens: a.target, LimitTokens: inService * p.tpp})
	} else if total > t.Quota {
		return p.refuseLocked(a, &AdmissionError{Err: ErrExceedsQuota, Group: group, GroupKind: kind, Need: total,
			Have: max(0, t.Quota-t.Used), Limit: t.Quota})
	}
	supply := g.alloc.Count(allocator.Free) + g.evicting + p.evictableLocked(0) - (g.claimed - a.claims[0])
	// A running lease passes the queue and the watermark: those are what
	// keep new admissions from starving it.
	dec := g.tenants.Decide(t, isolation.Demand{Charge: fresh, Take: fresh},
		isolation.Supply{Pages: supply, InService: inService})
	if dec.Verdict != isolation.Grant {
		p.releaseClaimLocked(a)
		return p.blockedLocked(a, t, dec, g, inService)
	}
	a.take[0], a.growLimit = fresh, dec.Limit
	if st, ready := p.claimLocked(a, t, nil); !ready {
		return st
	}

	// Nothing can fail from here on.
	g.tenants.Apply(t, dec)
	p.endClaimLocked(a, 0)
	p.grantGrowthLocked(l, fresh)
	p.dequeueLocked(a)
	a.err = nil
	return stepDone
}

// Preempt gives a running request's pages back, keeping what it computed
// for its next admission: tokens are the IDs of its written tokens
// (len(tokens) == Written(): the prompt, then what it generated), and the
// full pages they fill are published to the prefix cache of the lease's
// domain; every other page is scrubbed. The lease ends (PhaseReleased).
// It returns the tokens kept: the full pages published or already shared,
// or, when the pool has a host tier that took the rest of its written
// pages (a swap, all of them or none; HostTierConfig.NoSwap turns it off;
// a lease with extra key material, Request.PageExtra, or of a pool with
// window or state groups, is not swapped),
// every written token. To resume, admit the request again, with the same
// ID, tenant and adapter, with TokenIDs = tokens (and the rest of its
// output budget): HitTokens then says how much prefill to skip. A swap
// the tier had no room for, or whose copy failed, is counted in
// TierStats (SwapsFull, SwapsFailed) and the preemption keeps what the
// prefix cache holds, as it does without a tier.
//
// With prefix caching off and no swap, or tokens nil, Preempt is Release
// and keeps nothing. An exported or importing lease refuses with ErrLeasePhase, and
// tokens that contradict the TokenIDs the lease was admitted with (its
// prompt) with ErrInvalidArgument: the lease stays live either way.
func (l *Lease) Preempt(tokens []int32) (kept int, err error) {
	if err := l.live(); err != nil {
		return 0, err
	}
	p := l.pool
	written := l.Written()
	if len(tokens) > 0 && len(tokens) != written {
		return 0, fmt.Errorf("%w: Preempt of lease %q with %d token IDs, %d tokens written", ErrInvalidArgument, l.id, len(tokens), written)
	}
	// Hashed outside Pool.mu: keys for the written full pages the lease
	// has none for, chained on from its last key (the domain and adapter
	// never change while it lives).
	var extra []BlockKey
	keep := !p.prefixDisabled && len(tokens) > 0
	p.mu.Lock()
	have, seq, admitted := len(l.keys), l.seq, l.tokens
	var parent BlockKey
	if have > 0 {
		parent = l.keys[have-1]
	}
	p.mu.Unlock()
	// The lease's keys and its admitted prompt's pages were derived from
	// the token IDs it was admitted with: tokens that say otherwise would
	// have the cache index this KV under a prompt it was not computed
	// for. (Read outside the lock like CachePrefix's: a live lease's
	// tokens do not change, and seq is checked again below.)
	if keep && len(admitted) > 0 {
		if i := firstDifference(tokens, admitted); i >= 0 {
			return 0, fmt.Errorf("%w: Preempt of lease %q: token %d is %d, but the lease was admitted with %d there",
				ErrInvalidArgument, l.id, i, tokens[i], admitted[i])
		}
	}
	tpp := p.tpp
	full := written / tpp
	if keep && p.hybrid() && written >= tpp && written%tpp == 0 {
		// The state reflects every written token: a checkpoint there lets
		// the resumed request restore it. Without room for one, the
		// preemption keeps what earlier checkpoints cover.
		switch err := l.checkpoint(written, cudaops.Ordering{}, tokens); {
		case errors.Is(err, ErrLeaseReleased), errors.Is(err, ErrPoolClosed), errors.Is(err, ErrPoolFaulted):
			return 0, err
		case err != nil:
			p.log.LogAttrs(context.Background(), slog.LevelDebug, "kvcache: no state checkpoint for a preempted lease",
				slog.String("request", l.id), slog.Int("tokens", written), slog.Any("error", err))
		}
		p.mu.Lock()
		have = len(l.keys)
		if have > 0 {
			parent = l.keys[have-1]
		}
		p.mu.Unlock()
	}
	if keep && full > have {
		if have == 0 {
			parent = prefixRoot(l.Domain(), l.adapter)
		}
		extra = l.appendLeaseKeys(nil, parent, tpp, have, tokens[have*tpp:full*tpp])
	}

	p.mu.Lock()
	for {
		if p.mu.closed {
			p.mu.Unlock()
			return 0, ErrPoolClosed
		}
		if l.state.Load() != leaseLive || l.seq != seq {
			p.mu.Unlock()
			return 0, ErrLeaseReleased
		}
		if !p.drainLocked(l) {
			break
		}
	}
	if l.written.Load()&writeSealed != 0 {
		err := l.sealedErr("preemption")
		p.mu.Unlock()
		return 0, err
	}
	if keep && len(l.keys) == have {
		l.keys = append(l.keys, extra...)
		if l.keysFor == nil {
			l.keysFor = l.domain
		}
		// The trie takes the written tokens for the pages past the
		// prompt; entries copy them, and the lease's own buffer comes
		// back before the lock is let go (tokens is the caller's).
		own := l.tokens
		l.tokens = tokens
		p.publishLocked(l, min(full, len(l.keys)))
		l.tokens = own
		kept = l.published * tpp
		if p.hybrid() {
			kept = p.checkpointedLocked(l) * tpp // what a resumed request can use
		}
	}
	// The rest of the written pages, to the host tier: copied after the
	// lease has left the books (its pages quarantined, not yet filled),
	// before the scrub.
	var sw tierWrite
	var swap *tierItem
	if t := p.tier; t != nil && t.swapOn && len(tokens) > 0 && len(l.extra) == 0 && p.planSwapOutLocked(l, tokens, &sw) {
		swap = sw.items[0]
	}
	p.mu.events.emitRemovedLocked(tpp) // what the swap evicted from the tier
	p.beginTierWriteLocked(&sw)
	l.phase.Store(uint32(PhaseReleased))
	l.state.Store(leaseReleased)
	p.mu.growth.Preempted++
	p.mu.growth.PreemptKeptPages += uint64(kept / tpp)
	b := p.detachOwnLocked(l)
	p.fills.Add(1)
	p.mu.Unlock()
	if !sw.empty() {
		p.runTierWrite(&sw)
		p.mu.Lock()
		if swap != nil && sw.err == nil && !swap.doomed {
			kept = written // the swap lands whole: every written token comes back
		}
		fill := p.finishTierWriteLocked(&sw, nil)
		p.mu.Unlock()
		p.scrubTier(fill)
	}
	return kept, p.scrub(b, cudaops.Ordering{})
}

// GrowthStats counts growth and preemption.
type GrowthStats struct {
	Grown            uint64   // growths that added pages
	PagesGrown       uint64   // pages they added
	Refused          Refusals // refused growths, by reason
	Preempted        uint64   // leases preempted
	PreemptKeptPages uint64   // pages their preemption kept in the prefix cache
}

// firstDifference is the first index below both lengths at which a and b
// differ, or -1 if none does.
func firstDifference(a, b []int32) int {
	n := min(len(a), len(b))
	if tokensEqual(a[:n], b[:n]) {
		return -1
	}
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return -1 // unreachable: tokensEqual said they differ
}
