package kvcache

import (
	"context"
	"fmt"
	"math"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// This file is admission, from Admit to a lease's pages: the request's own
// checks, the attempt (one decision under Pool.mu), and the waiting queue.
// The package doc's "Admission" section is the overview.

// MaxIDLen bounds request IDs and tenant names.
const MaxIDLen = 256

// Request is what an engine asks to run.
type Request struct {
	ID     string // unique among live leases; 1..MaxIDLen bytes of UTF-8 without a NUL
	Tenant string
	// PromptTokens ≥ 1. MaxNewTokens ≥ 0 (0 for a prefill-only request,
	// as on the prefill side of a disaggregated deployment).
	PromptTokens int
	MaxNewTokens int
	// Prefix material, optional. TokenIDs are the prompt's token IDs
	// (len = PromptTokens); PageKeys, instead, the keys Pool.PageKeys
	// derived for its full pages. With either, Admit shares the longest
	// prefix cached in the tenant's sharing domain (Lease.HitTokens).
	// Adapter names the weights the KV is computed with (a LoRA ID) and
	// is part of every key. The domain is the tenant's: a request cannot
	// name one.
	TokenIDs []int32
	PageKeys []BlockKey
	Adapter  string
	// PageExtra is extra key material of the prompt's pages, with
	// TokenIDs: PageExtra[i] (nil for none) enters page i's key and so
	// every key after it, for pages whose KV depends on more than their
	// tokens (a multimodal prompt's placeholders; see pageextra.go).
	PageExtra [][]byte
	// Sizing overrides the tenant's (and the pool's) sizing of this
	// request's lease; the zero value inherits it.
	Sizing Sizing
}

// Tokens is the most tokens the request can hold: prompt plus output.
func (r Request) Tokens() int { return r.PromptTokens + r.MaxNewTokens }

// maxRequestTokens keeps token arithmetic (and slot numbers) far from
// overflow on every platform.
const maxRequestTokens = 1 << 40

// Admit reserves every page req can need and returns its lease, or an
// error with nothing allocated: an *AdmissionError with the numbers, or
// ErrPoolClosed.
//
// Admit follows golang.org/x/sync/semaphore's Acquire: it waits, first
// come first served, for pages or quota to free up until ctx is done, and
// then returns the refusal that kept it waiting. A context that is done
// already never admits (ErrContextDone). A context that never ends
// (context.Background) waits as long as it takes; use TryAdmit to be
// refused at once. Refusals that no release can cure (an invalid request,
// more than the pool or the tenant's quota can ever hold, a faulted pool)
// never wait.
func (p *Pool) Admit(ctx context.Context, req Request) (*Lease, error) {
	l := new(Lease)
	if err := p.AdmitInto(ctx, req, l); err != nil {
		return nil, err
	}
	return l, nil
}

// AdmitInto is Admit into a Lease the caller provides, so that an engine
// which recycles its request structs admits without allocating. l must be
// a zero Lease or one that has been released; it must not be in use by
// anyone else.
func (p *Pool) AdmitInto(ctx context.Context, req Request, l *Lease) error {
	return p.admit(&admission{ctx: ctx, req: req, l: l, wait: true})
}

// TryAdmit is Admit that never waits: a busy pool or a full quota is
// refused at once (ErrPoolExhausted, ErrExceedsQuota). It may still wait
// for the scrub of cached pages it evicts, which is its own.
func (p *Pool) TryAdmit(req Request) (*Lease, error) {
	l := new(Lease)
	if err := p.TryAdmitInto(req, l); err != nil {
		return nil, err
	}
	return l, nil
}

// TryAdmitInto is TryAdmit into a Lease the caller provides (see
// AdmitInto).
func (p *Pool) TryAdmitInto(req Request, l *Lease) error {
	return p.admit(&admission{ctx: context.Background(), req: req, l: l})
}

// admission is one call of Admit, TryAdmit or BeginImport, from its start
// to its verdict. Its scratch (keys, matched entries, the waiter) lives in
// the Lease, so that a recycled Lease admits without allocating.
type admission struct {
	ctx  context.Context
	req  Request
	l    *Lease
	need int  // pages for prompt + max new tokens
	wait bool // Admit: wait while ctx lives; TryAdmit: never
	// importFrom is, for BeginImport, the sharing domain the KV was
	// computed in; the tenant must be in it here.
	importFrom string
	// take is the pages it takes in each group once granted, and claims
	// the pages promised to it meanwhile while it waits for the scrub of
	// pages it evicted (see group.claimed), made in claim epoch
	// claimEpoch: a fault voids every claim.
	take, claims [MaxCacheGroups]int
	claimEpoch   uint64
	// hashFor is the domain to derive the request's keys for, outside
	// Pool.mu (step stepHash).
	hashFor *tenancy.Domain
	// evicted is the pages this attempt evicted, to scrub outside Pool.mu
	// (step stepEvict), and offload the host tier's write of those it
	// keeps, run before the scrub.
	evicted scrubBatch
	offload tierWrite
	// growing marks a growth of live lease l (Grow), of incarnation seq,
	// to hold target tokens, instead of an admission.
	growing bool
	seq     uint64
	target  int
	// growLimit is a growth's pages in service, the Limit of its wait.
	growLimit int
	// w is its place in the queue once it has waited (waitLocked): its
	// Lease's own waiter for an admission, one of its own for a growth.
	w *waiter
	// blocked is the refusal that keeps a waiting admission waiting;
	// returned if its context ends.
	blocked AdmissionError
	// err is the final outcome of a stepDone attempt: nil when admitted.
	err error
}

// testHookDeriveKeys, if set (by tests only), runs each time an
// admission derives its page keys.
var testHookDeriveKeys func()

// step is what an attempt needs next.
type step uint8

const (
	stepDone   step = iota // admitted, or refused: admission.err
	stepHash               // derive the page keys for hashFor, then try again
	stepEvict              // scrub the evicted pages, then try again
	stepWait               // wait for a wake-up or the end of ctx, then try again
	stepOnload             // admitted: copy its pages out of the host tier, then done
)

// admit runs one admission to its end: the request's own checks, then
// runLocked.
func (p *Pool) admit(a *admission) error {
	l := a.l
	if l == nil {
		return fmt.Errorf("%w: nil lease", ErrInvalidArgument)
	}
	if l.state.Load() == leaseLive {
		return fmt.Errorf("%w: lease %q is still live", ErrInvalidArgument, l.id)
	}
	if err := validateRequest(a.req, p.tpp); err != nil {
		return p.refuse(a, &AdmissionError{Err: ErrInvalidRequest, Cause: err})
	}
	if a.req.Tokens() > p.maxContext {
		return p.refuse(a, &AdmissionError{Err: ErrExceedsMaxContext, Need: a.req.Tokens(), Limit: p.maxContext})
	}
	if err := a.ctx.Err(); err != nil {
		return fmt.Errorf("%w: request %q: %w", ErrContextDone, a.req.ID, err)
	}
	l.keys, l.keysFor, l.match.valid, l.tokens = l.keys[:0], nil, false, l.tokens[:0]
	if !p.prefixDisabled {
		// Copied: the caller may reuse its buffers (the C ABI passes C
		// memory), and CachePrefix derives the published pages' keys from
		// these tokens later.
		l.keys = append(l.keys, a.req.PageKeys...)
		l.tokens = append(l.tokens, a.req.TokenIDs...)
		l.extra = copyPageExtra(l.extra, a.req.PageExtra)
	} else {
		l.extra = l.extra[:0]
	}
	p.mu.Lock()
	err := p.runLocked(a)
	if l.restore != nil {
		if err == nil {
			// A hybrid hit: the state at its end goes into the lease
			// before the engine sees it.
			err = p.restore(l)
		} else {
			p.cancelRestore(l) // granted, then its onload failed
		}
	}
	return err
}

// runLocked runs an admission or a growth (a.growing) to its end, with
// Pool.mu held on entry; it returns with Pool.mu released. Everything
// about pages, quota and reservation is decided by the attempt under the
// lock; here only what must not hold it (hashing, scrubbing evicted
// pages, waiting) happens, and then the attempt runs again.
func (p *Pool) runLocked(a *admission) error {
	p.assertHeld()
	if p.mu.closed {
		p.mu.Unlock()
		return ErrPoolClosed
	}
	p.mu.admitting++
	return p.stepsLocked(a, p.attemptLocked(a))
}

// stepsLocked carries an admission in progress (counted in
// Pool.mu.admitting) from step st, its last attempt's, to its end: it does
// what st asks outside the lock, attempts again, and so on until done. It
// returns with Pool.mu released.
func (p *Pool) stepsLocked(a *admission, st step) error {
	p.assertHeld()
	l := a.l
	for ; ; st = p.attemptLocked(a) {
		switch st {
		case stepHash:
			dom := a.hashFor
			p.mu.Unlock()
			// Once per request: again only if the tenant moves to another
			// domain meanwhile.
			if testHookDeriveKeys != nil {
				testHookDeriveKeys()
			}
			l.keys = l.appendLeaseKeys(l.keys[:0], prefixRoot(dom.Name, a.req.Adapter), p.tpp, 0, l.tokens)
			p.mu.Lock()
			l.keysFor, l.match.valid = dom, false
		case stepEvict:
			b := a.evicted
			err := p.scrubEvictedLocked(b, &a.offload)
			for gi := range p.groups {
				p.groups[gi].evicting -= len(b.spaces[gi])
			}
			p.finishScrubLocked(b, err) // a failed fill faults the pool: the next attempt refuses
			p.fills.Done()
			a.evicted = b.batchFor(p)
		case stepWait:
			p.mu.Unlock()
			select {
			case <-a.w.wake:
			case <-a.ctx.Done():
			}
			p.mu.Lock()
			if err := a.ctx.Err(); err != nil && !p.mu.closed {
				// The wait ended: refuse with what kept it waiting, and why
				// it stopped.
				e := a.blocked
				if e.Cause == nil {
					e.Cause = err
				} else {
					e.Cause = fmt.Errorf("%w; %w", e.Cause, err)
				}
				p.refuseLocked(a, &e)
				return p.endAdmissionLocked(a)
			}
		case stepOnload:
			return p.onloadLocked(a)
		case stepDone:
			return p.endAdmissionLocked(a)
		}
	}
}

// scrubEvictedLocked runs, with Pool.mu released meanwhile, what an
// eviction left (counted in p.fills by the caller, who then finishes the
// scrub): the host tier's write w of what it keeps (before the scrub: it
// reads the evicted pages and units), then the fill of b. It returns the
// fill's error.
func (p *Pool) scrubEvictedLocked(b scrubBatch, w *tierWrite) error {
	p.beginTierWriteLocked(w)
	p.mu.Unlock()
	if !w.empty() {
		p.runTierWrite(w)
	}
	err := p.fillAndWait(b)
	p.mu.Lock()
	if fill := p.finishTierWriteLocked(w, nil); len(fill) > 0 {
		p.mu.Unlock()
		p.scrubTier(fill)
		p.mu.Lock()
	}
	w.reset()
	return err
}

// endAdmissionLocked ends an admission in progress, unlocks Pool.mu and
// returns its outcome.
func (p *Pool) endAdmissionLocked(a *admission) error {
	p.assertHeld()
	p.dequeueLocked(a)
	p.releaseClaimLocked(a)
	if p.mu.admitting--; p.mu.closed {
		p.quiet.Broadcast()
	}
	p.mu.Unlock()
	return a.err
}

// attemptLocked decides the admission once, with everything it depends on
// read under the same lock: the pool's state, the tenant, the cached
// prefix, every group's pages and the queue. It either grants and
// allocates (stepDone, a.err nil), refuses (stepDone, a.err set), or says
// what must happen outside the lock before it can decide.
//
// Every cache group goes through the same three steps, each for all
// groups before the next: refusals no release can cure (more than the
// group holds in service, or than the tenant's share of it), the one
// quota and reservation rule (isolation.Decide), and the claims of pages
// that cached pages must be evicted for or fills must free (claimLocked).
// The prefix match comes between the first two: it lowers what the
// per-token group takes.
func (p *Pool) attemptLocked(a *admission) step {
	p.assertHeld()
	if a.claimEpoch != p.mu.claimEpoch { // a fault voided the claims
		a.claims, a.claimEpoch = [MaxCacheGroups]int{}, p.mu.claimEpoch
	}
	if a.growing {
		return p.growAttemptLocked(a)
	}
	req, l := &a.req, a.l
	if p.mu.closed {
		a.err = ErrPoolClosed
		return stepDone
	}
	if f := p.q.FaultLocked(); f != nil {
		return p.refuseLocked(a, &AdmissionError{Err: ErrPoolFaulted, Cause: f})
	}
	t, err := p.tenantsLocked().Lookup(req.Tenant)
	if err != nil {
		return p.refuseLocked(a, &AdmissionError{Err: ErrUnknownTenant, Cause: err})
	}
	if p.mu.leases[req.ID] != nil {
		return p.refuseLocked(a, &AdmissionError{Err: ErrDuplicateRequest})
	}
	// The whole prompt, always; of the output, what the sizing reserves.
	sizing := req.Sizing.Or(t.Sizing).Or(p.sizing)
	a.need = p.pagesFor(req.PromptTokens + sizing.OutputTokens(req.MaxNewTokens))
	holds := l.holdsFor(p)
	for gi := range p.groups {
		g := &p.groups[gi]
		need, inService, mt := g.need(a.need, req.Tokens()), g.inServiceLocked(), g.mirror(t)
		group, kind := p.refusalGroup(g)
		switch {
		case need > inService:
			e := &AdmissionError{Err: ErrExceedsCapacity, Group: group, GroupKind: kind, Need: need,
				Have: g.alloc.Count(allocator.Free), Limit: inService}
			if g.kind == GroupPerToken {
				e.NeedTokens, e.LimitTokens = req.Tokens(), inService*p.tpp
			}
			return p.refuseLocked(a, e)
		case need > mt.Quota:
			return p.refuseLocked(a, &AdmissionError{Err: ErrExceedsQuota, Group: group, GroupKind: kind, Need: need,
				Have: max(0, mt.Quota-mt.Used), Limit: mt.Quota})
		}
		holds[gi].dec.Demand = isolation.Demand{Charge: need, Take: need}
	}
	if a.importFrom != "" && t.Domain.Name != a.importFrom {
		a.err = domainMismatch(req, a.importFrom, t.Domain.Name)
		return stepDone
	}
	// The prefix: matched once per attempt, reused while the index has
	// not changed (its epoch), and worth only what the tenant may share.
	// A request with tokens walks the trie; only while its domain holds
	// pages published by keys alone, or when its pages have extra key
	// material the trie does not compare, does it derive its keys (once)
	// and match by them.
	sharing := p.sharing(req)
	byKeys := len(l.tokens) == 0 || len(l.extra) > 0 || p.mu.prefix.counters(t.Domain).keyOnly > 0
	if sharing && len(l.tokens) > 0 && byKeys && l.keysFor != t.Domain {
		a.hashFor = t.Domain
		return stepHash
	}
	var newToTenant, cachedHits, onload int
	if sharing {
		p.matchLocked(l, t.Domain, req.Adapter, maxHitPages(*req, p.tpp), byKeys)
		newToTenant, cachedHits, onload = p.weighMatchLocked(l, t)
	} else {
		l.match.entries = l.match.entries[:0]
	}
	// The matched pages the device holds are shared, not taken: the
	// per-token group takes the rest (those only the host tier holds
	// among them: they are onloaded), and its tenant is charged for those
	// it holds no other lease on.
	tok := &holds[0].dec.Demand
	tok.Take -= len(l.match.entries) - onload
	tok.Charge = tok.Take + newToTenant
	queued := p.queuedAheadLocked(a)
	for gi := range p.groups {
		g := &p.groups[gi]
		inService := g.inServiceLocked()
		cached := 0
		if gi == 0 {
			cached = cachedHits
		}
		if c := l.match.ckpt; gi > 0 && c != nil && c.restoring == 0 {
			cached = len(c.units[gi]) // the match's checkpoint is not evicted for it
		}
		supply := g.alloc.Count(allocator.Free) + g.evicting + p.evictableLocked(gi) - cached - (g.claimed - a.claims[gi])
		dec := g.tenants.Decide(g.mirror(t), holds[gi].dec.Demand,
			isolation.Supply{Pages: supply, InService: inService, Queued: queued, Keep: p.keepLocked(g, inService)})
		if dec.Verdict != isolation.Grant {
			p.releaseClaimLocked(a)
			return p.blockedLocked(a, t, dec, g, inService)
		}
		holds[gi].dec = dec
		a.take[gi] = dec.Demand.Take
	}
	if st, ready := p.claimLocked(a, t, l.match.entries); !ready {
		return st
	}

	// Nothing can fail from here on.
	hits := len(l.match.entries)
	p.takeLocked(l, t, a)
	p.mu.seq++
	l.reset(p, *req, t, p.mu.seq)
	l.hitPages, l.published = hits, hits
	if a.importFrom != "" {
		// Sealed at zero: nothing may write the pages but WritePages, and
		// the watermark is set only by Complete.
		l.written.Store(writeSealed)
		l.phase.Store(uint32(PhaseImporting))
	}
	if sharing {
		looked := len(l.keys)
		if !byKeys {
			// Matched in the trie: the lease knows the hits' keys, and
			// CachePrefix derives the others from its tokens.
			l.keys = l.keys[:0]
			for _, e := range l.match.entries {
				l.keys = append(l.keys, e.key)
			}
			looked = req.PromptTokens / p.tpp
		}
		p.countMatchLocked(req, t.Domain, looked, hits)
		if p.hybrid() {
			p.countCheckpointMatchLocked(l)
		}
	}
	l.match.entries, l.match.ckpt = l.match.entries[:0], nil
	l.match.valid = false
	p.mu.leases[req.ID] = l
	p.mu.admitted++
	p.countAdmittedLocked(t)
	if p.dequeueLocked(a) {
		p.wakePagesLocked() // the next in line may fit too
	}
	a.err = nil
	p.assertLocked("admit")
	if p.tier != nil {
		if a.importFrom == "" {
			p.planSwapInLocked(l, req)
		}
		if l.onload.pending() {
			return stepOnload // not handed out before its pages hold what the tier has
		}
	}
	return stepDone
}

// takeLocked applies the decisions of a granted admission into l (in
// l.holds[g].dec) and gives l its pages in every group: the matched
// prefix shared, the rest allocated. It ends a's claims. Nothing can fail.
func (p *Pool) takeLocked(l *Lease, t *tenancy.Tenant, a *admission) {
	p.assertHeld()
	for gi := range p.groups {
		g, h := &p.groups[gi], &l.holds[gi]
		g.tenants.Apply(g.mirror(t), h.dec)
		handles, pages := p.shareMatchedLocked(l, t, gi, h.handles[:0], h.pages[:0])
		fresh := h.dec.Demand.Take
		if gi == 0 && p.tier != nil {
			if l.onload != nil {
				fresh -= len(l.onload.pages) // allocated for the onloads already
			}
		}
		var err error
		h.handles, h.pages, err = g.alloc.AllocIDs(handles, pages, fresh, t.Domain.ID)
		if err != nil {
			panic(fmt.Sprintf("kvcache: %d pages of group %q granted and free, but the allocator refused: %v", fresh, g.name, err))
		}
		h.first = 0
		p.endClaimLocked(a, gi)
	}
}

// endClaimLocked ends a's claim in group gi: the pages it promised are
// taken, or given back.
func (p *Pool) endClaimLocked(a *admission, gi int) {
	if a.claimEpoch == p.mu.claimEpoch {
		p.groups[gi].claimed -= a.claims[gi]
	}
	a.claims[gi] = 0
}

// claimLocked promises to a granted admission or growth, in every group,
// the fresh pages it takes (a.take). Where free pages and fills in flight
// cannot cover every promise of a group, it evicts the difference (never
// a page of keep) for the caller to scrub (stepEvict); where other
// admissions' evictions already cover it, the caller waits for their
// fills (stepWait). ready means the pages are free now in every group,
// and (under the canary policy) verified: take them.
func (p *Pool) claimLocked(a *admission, t *tenancy.Tenant, keep []*cacheEntry) (st step, ready bool) {
	p.assertHeld()
	for gi := range p.groups {
		g, fresh := &p.groups[gi], a.take[gi]
		g.claimed += fresh - a.claims[gi]
		a.claims[gi] = fresh
		if short := g.claimed - (g.alloc.Count(allocator.Free) + g.evicting); short > 0 {
			if len(a.evicted.spaces) != len(p.groups) {
				a.evicted = a.evicted.batchFor(p)
			}
			p.evictLocked(gi, &a.evicted, short, keep, &a.offload)
		}
	}
	// Whatever was evicted, in any group (a checkpoint's units are in
	// several), is on its way to the claims.
	if n := a.evicted.len(); n > 0 {
		for gi := range p.groups {
			p.groups[gi].evicting += len(a.evicted.spaces[gi])
		}
		p.fills.Add(1)
		return stepEvict, false
	}
	for gi := range p.groups {
		g, fresh := &p.groups[gi], a.take[gi]
		if free := g.alloc.Count(allocator.Free); free < fresh {
			group, kind := p.refusalGroup(g)
			a.blocked = AdmissionError{Err: ErrPoolExhausted, Group: group, GroupKind: kind, Need: fresh, Have: free, Limit: a.l.holds[gi].dec.Limit}
			if a.growing {
				a.blocked.Limit = a.growLimit
			}
			return p.waitLocked(a, t, waitFill), false
		}
	}
	if p.q.NeedsVerify() {
		scratch := &a.l.scrub
		for gi := range p.groups {
			g := &p.groups[gi]
			if len(scratch.spaces) != len(p.groups) {
				*scratch = scratch.batchFor(p)
			}
			peek := g.alloc.PeekFree(scratch.spaces[gi][:0], a.take[gi])
			scratch.spaces[gi] = peek[:0]
			if retired, err := p.q.VerifyLocked(gi, peek); err != nil {
				p.faultedLocked()
				p.logCanaryLocked(retired, err)
				group, kind := p.refusalGroup(g)
				return p.refuseLocked(a, &AdmissionError{Err: ErrPoolFaulted, Group: group, GroupKind: kind, Cause: err}), false
			}
		}
	}
	return stepDone, true
}

// evictableLocked is the pages of group gi that eviction can free: the
// per-token group's cached pages, which no lease holds (the prefix
// cache's LRU list, and the pages state checkpoints pin); in the other
// groups, the units of checkpoints not being restored.
func (p *Pool) evictableLocked(gi int) int {
	if gi == 0 {
		return p.mu.prefix.lruLen + p.mu.ckpts.pinnedCached
	}
	return p.mu.ckpts.evictable[gi]
}

// keepLocked is the pages of group g new admissions leave free for the
// growth of running leases: the growth watermark's share of the pages in
// service, in the group leases grow in (the per-token one).
func (p *Pool) keepLocked(g *group, inService int) int {
	if p.watermark == 0 || g.kind != GroupPerToken {
		return 0
	}
	return int(math.Ceil(p.watermark * float64(inService)))
}

// sharing reports whether req takes part in prefix sharing.
func (p *Pool) sharing(req *Request) bool {
	return !p.prefixDisabled && (len(req.TokenIDs) > 0 || len(req.PageKeys) > 0)
}

// blockedLocked turns a decision other than Grant in group g, which has
// inService pages in service, into a refusal, or, for an admission that
// waits, into a wait.
func (p *Pool) blockedLocked(a *admission, t *tenancy.Tenant, dec isolation.Decision, g *group, inService int) step {
	p.assertHeld()
	group, kind := p.refusalGroup(g)
	e := AdmissionError{Err: ErrPoolExhausted, Group: group, GroupKind: kind, Need: dec.Demand.Take, Have: dec.Have, Limit: dec.Limit}
	reason := waitPool
	switch dec.Verdict {
	case isolation.OverQuota:
		e = AdmissionError{Err: ErrExceedsQuota, Group: group, GroupKind: kind, Need: dec.Demand.Charge, Have: dec.Have, Limit: dec.Limit}
		reason = waitQuota
	case isolation.Reserved, isolation.KeptForGrowth:
		e.Cause, e.Limit = dec.Err(t.Name), inService
	}
	if !a.wait {
		return p.refuseLocked(a, &e)
	}
	a.blocked = e
	return p.waitLocked(a, t, reason)
}

// refuse counts and returns a refusal decided without Pool.mu.
func (p *Pool) refuse(a *admission, e *AdmissionError) error {
	p.mu.Lock()
	p.refuseLocked(a, e)
	p.mu.Unlock()
	return a.err
}

// refuseLocked is the one place where refusals are counted: each refused
// call once, with its final reason (a waiting admission counts only the
// refusal it ends with).
func (p *Pool) refuseLocked(a *admission, e *AdmissionError) step {
	p.assertHeld()
	e.RequestID, e.Tenant = a.req.ID, a.req.Tenant
	if a.growing {
		p.mu.growth.Refused.count(e.Err)
	} else {
		p.mu.refused.count(e.Err)
		p.countRefusedLocked(a.req.Tenant, e.Err)
	}
	p.releaseClaimLocked(a)
	a.err = e
	return stepDone
}

// releaseClaimLocked gives back pages promised to a that it will not take.
func (p *Pool) releaseClaimLocked(a *admission) {
	p.assertHeld()
	claimed := false
	for gi := range p.groups {
		if a.claims[gi] > 0 {
			p.endClaimLocked(a, gi)
			claimed = true
		}
	}
	if claimed {
		p.wakePagesLocked()
	}
}

// faultedLocked is what a fault (a failed fill, a canary audit) does to
// admissions in progress: it voids every claim, since the pages promised
// may be the ones retired, and wakes every waiter, which then fails with
// ErrPoolFaulted (or, after ClearFault, decides again).
func (p *Pool) faultedLocked() {
	p.assertHeld()
	for gi := range p.groups {
		p.groups[gi].claimed = 0
	}
	p.mu.claimEpoch++
	p.wakeAllLocked()
}

func validateRequest(req Request, tokensPerPage int) error {
	switch {
	case isolation.NameProblem(req.ID, MaxIDLen) != "":
		return fmt.Errorf("%w: request ID %q: %s (want 1..%d bytes of UTF-8 without a NUL)",
			ErrInvalidRequest, req.ID, isolation.NameProblem(req.ID, MaxIDLen), MaxIDLen)
	case req.Tenant == "" || len(req.Tenant) > MaxIDLen:
		return fmt.Errorf("%w: tenant name of %d bytes, want 1..%d", ErrInvalidRequest, len(req.Tenant), MaxIDLen)
	case req.PromptTokens <= 0:
		return fmt.Errorf("%w: PromptTokens = %d, want ≥ 1", ErrInvalidRequest, req.PromptTokens)
	case req.MaxNewTokens < 0:
		return fmt.Errorf("%w: MaxNewTokens = %d, want ≥ 0", ErrInvalidRequest, req.MaxNewTokens)
	case req.PromptTokens > maxRequestTokens-req.MaxNewTokens:
		return fmt.Errorf("%w: PromptTokens %d + MaxNewTokens %d overflows", ErrInvalidRequest, req.PromptTokens, req.MaxNewTokens)
	}
	if err := req.Sizing.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidRequest, err)
	}
	return validatePrefix(req, tokensPerPage)
}

// Waiting.
//
// An admission that may wait and is refused for lack of pages or quota
// joins Pool.mu.waiters, in arrival order, and sleeps on its waiter's wake
// channel (capacity one: a wake-up sent while it is still deciding is not
// lost; a spurious one costs an attempt). An admission waits in its
// Lease's own waiter (Lease.wait), which nobody else uses while it runs;
// a growth in one of its own, since several growths of one lease may
// wait at once, and a growth of an incarnation that has ended may still
// be on its way out when the Lease is admitted into again. Every waiter
// keeps its place until it is admitted, refused or its context ends. A
// waiter for pages (waitPool) blocks the admissions behind it, except
// those inside their tenant's unused reservation (isolation.Decide with
// Supply.Queued); a waiter for quota (waitQuota) blocks nobody; a granted
// admission waiting for the fills of evicted pages (waitFill) holds a
// claim instead.
//
// What wakes whom, the whole table ("pool waiters that pass" are the
// waiting growths, which pass the queue, and the admissions whose tenant
// has reservation unused, which Decide lets take it whoever waits ahead):
//
//	event                                          wakes
//	pages scrubbed clean (finishScrubLocked)       first pool waiter, pool waiters that pass, fill waiters
//	a page became evictable (parked in the LRU)    first pool waiter, pool waiters that pass, fill waiters
//	a claim given back unused                      first pool waiter, pool waiters that pass, fill waiters
//	a waiter admitted, or no longer first in line  the next pool waiter, pool waiters that pass
//	a tenant's usage dropped (its lease ended)     that tenant's waiters
//	UpdateTenant                                   that tenant's waiters, first pool waiter
//	a fault, ClearFault, Close                     every waiter
//
// A state checkpoint whose units are in quarantine waits in the queue too,
// as a fill waiter that holds no claim (Pool.awaitScrubLocked).

// waitReason says what a waiting admission waits for.
type waitReason uint8

const (
	waitPool  waitReason = iota + 1 // pages: first come, first served
	waitQuota                       // its tenant's quota: its own leases to end
	waitFill                        // granted: the fills of evicted pages
)

// waiter is a waiting admission's, growth's or checkpoint's place in the
// queue.
type waiter struct {
	prev, next *waiter
	lease      *Lease // the admission's, or the growing or checkpointing one
	growth     bool   // a growth's: it passes the queue
	checkpoint bool   // a state checkpoint's (awaitScrubLocked), always waitFill
	queued     bool
	reason     waitReason
	tenant     *tenancy.Tenant
	wake       chan struct{}
}

// waitQueue is an intrusive list of waiters.
type waitQueue struct {
	head, tail *waiter
	len        int
}

// waitLocked queues a (at the tail on its first wait; a waiter keeps its
// place) and returns stepWait.
func (p *Pool) waitLocked(a *admission, t *tenancy.Tenant, reason waitReason) step {
	p.assertHeld()
	w := a.w
	if w == nil {
		if a.growing {
			w = &waiter{growth: true}
		} else {
			w = &a.l.wait
		}
		if w.wake == nil {
			w.wake = make(chan struct{}, 1)
		}
		w.lease, a.w = a.l, w
	}
	if !w.queued {
		p.mu.waiters.push(w)
	} else if w.reason == waitPool && reason != waitPool {
		// It leaves the line for pages: whoever is first now may fit.
		p.mu.poolWaiters--
		w.reason = reason
		p.wakePagesLocked()
	}
	if reason == waitPool && w.reason != waitPool {
		p.mu.poolWaiters++
	}
	w.reason, w.tenant = reason, t
	return stepWait
}

// dequeueLocked takes a out of the queue if it is in it and reports
// whether it was waiting for pages.
func (p *Pool) dequeueLocked(a *admission) (wasPoolWaiter bool) {
	p.assertHeld()
	w := a.w
	if w == nil || !w.queued {
		return false
	}
	p.mu.waiters.remove(w)
	wasPoolWaiter = w.reason == waitPool
	if wasPoolWaiter {
		p.mu.poolWaiters--
		p.wakePagesLocked() // the next in line
	}
	w.reason, w.tenant = 0, nil
	return wasPoolWaiter
}

// push appends w to the queue.
func (q *waitQueue) push(w *waiter) {
	w.prev, w.next, w.queued = q.tail, nil, true
	if q.tail != nil {
		q.tail.next = w
	} else {
		q.head = w
	}
	q.tail = w
	q.len++
}

// remove takes w, queued, out of the queue.
func (q *waitQueue) remove(w *waiter) {
	if w.prev != nil {
		w.prev.next = w.next
	} else {
		q.head = w.next
	}
	if w.next != nil {
		w.next.prev = w.prev
	} else {
		q.tail = w.prev
	}
	q.len--
	w.prev, w.next, w.queued = nil, nil, false
}

// queuedAheadLocked reports whether an admission waiting for pages came
// before a (which may not be queued at all).
func (p *Pool) queuedAheadLocked(a *admission) bool {
	p.assertHeld()
	if p.mu.poolWaiters == 0 {
		return false
	}
	if a.w == nil || !a.w.queued {
		return true
	}
	for w := p.mu.waiters.head; w != nil && w != a.w; w = w.next {
		if w.reason == waitPool {
			return true
		}
	}
	return false
}

func signal(w *waiter) {
	select {
	case w.wake <- struct{}{}:
	default: // a wake-up is already pending
	}
}

// wakePagesLocked wakes the first admission waiting for pages, the
// waiters for pages that may pass it, and every granted one waiting for
// fills: pages became free or evictable.
func (p *Pool) wakePagesLocked() {
	p.assertHeld()
	first := true
	for w := p.mu.waiters.head; w != nil; w = w.next {
		switch w.reason {
		case waitPool:
			if first || p.passesLocked(w) {
				signal(w)
			}
			first = false
		case waitFill:
			signal(w)
		}
	}
}

// passesLocked reports whether w, waiting for pages, may be granted
// ahead of the waiters before it: a growth, which passes the queue, or
// an admission whose tenant has reservation unused in some group, which
// it may take whoever waits (isolation.Decide with Supply.Queued).
func (p *Pool) passesLocked(w *waiter) bool {
	p.assertHeld()
	if w.growth {
		return true
	}
	for gi := range p.groups {
		if mt := p.groups[gi].mirror(w.tenant); mt.Used < mt.Reserved {
			return true
		}
	}
	return false
}

// wakeTenantLocked wakes t's waiting admissions: t's usage or limits
// changed.
func (p *Pool) wakeTenantLocked(t *tenancy.Tenant) {
	p.assertHeld()
	for w := p.mu.waiters.head; w != nil; w = w.next {
		if w.tenant == t {
			signal(w)
		}
	}
}

// wakeAllLocked wakes every waiting admission: the pool faulted, was
// cleared or closed.
func (p *Pool) wakeAllLocked() {
	p.assertHeld()
	for w := p.mu.waiters.head; w != nil; w = w.next {
		signal(w)
	}
}
