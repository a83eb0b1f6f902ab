package kvcache

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"golang.org/x/sync/semaphore"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/internal/invariants"
	"github.com/kvfence/kvfence/isolation"
)

// MaxIDLen bounds request IDs and tenant names.
const MaxIDLen = 256

// Request is what an engine asks to run.
type Request struct {
	ID     string // unique among live leases
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
}

// Tokens is the most tokens the request can hold: prompt plus output.
func (r Request) Tokens() int { return r.PromptTokens + r.MaxNewTokens }

// Pool is a paged KV cache shared by tenants. See the package doc.
type Pool struct {
	geom       Geometry
	total      int
	maxContext int
	dev        cudaops.Device
	ownsDevice bool
	freePages  *semaphore.Weighted // clean free pages not claimed by an admission
	closing    context.Context     // cancelled by Close, to wake waiting admissions
	stopAll    context.CancelFunc
	scrubs     sync.WaitGroup // asynchronous fills still in flight
	// prefixDisabled and events are set once in New.
	prefixDisabled bool
	events         chan KVEvent
	// q is set once in New. Issue may be called without mu; every method
	// ending in Locked needs mu.
	q *isolation.Quarantine
	// unpinned is signalled (with mu) when a lease's last page copy ends
	// while a release or Close waits for it.
	unpinned sync.Cond

	mu struct {
		sync.Mutex
		alloc    *allocator.Allocator
		tenants  *isolation.Registry
		leases   map[string]*Lease
		closed   bool
		pins     int           // page copies in flight outside mu, all leases
		changed  chan struct{} // closed when pages or quotas free up; nil while nobody waits
		admitted uint64
		refused  Refusals
		prefix   prefixCache
	}
}

// New builds a pool from cfg. It refuses a pool that cannot hold
// cfg.MaxContextTokens (ErrUndersizedPool) unless cfg.AllowUndersizedPool.
func New(cfg Config) (*Pool, error) {
	pages, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	alloc, err := allocator.New(pages)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	reg := isolation.NewRegistry(pages)
	for _, tc := range cfg.Tenants {
		if _, err := reg.Add(tc); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
	}
	dev, owned, err := cfg.setupDevice(pages)
	if err != nil {
		return nil, err
	}
	q, err := isolation.NewQuarantine(alloc, dev, reg, cfg.Scrub, cfg.Geometry.DType)
	if err != nil { // validated above; kept for safety
		if owned {
			dev.Close()
		}
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if err := q.ScrubAllFree(); err != nil {
		if owned {
			dev.Close()
		}
		return nil, err
	}
	p := &Pool{
		geom:       cfg.Geometry,
		total:      pages,
		maxContext: cfg.MaxContextTokens,
		dev:        dev,
		ownsDevice: owned,
		freePages:  semaphore.NewWeighted(int64(pages)),
	}
	p.closing, p.stopAll = context.WithCancel(context.Background())
	p.unpinned.L = &p.mu.Mutex
	p.mu.alloc, p.mu.tenants, p.q = alloc, reg, q
	p.mu.leases = make(map[string]*Lease)
	p.mu.prefix.init(pages, cfg.Prefix)
	p.prefixDisabled, p.events = cfg.Prefix.Disable, p.mu.prefix.events.ch
	return p, nil
}

// Geometry returns the pool's page geometry.
func (p *Pool) Geometry() Geometry { return p.geom }

// Pages returns the pool size in pages.
func (p *Pool) Pages() int { return p.total }

// CapacityTokens is the pool size in tokens.
func (p *Pool) CapacityTokens() int { return p.total * p.geom.TokensPerPage }

// Device returns the device that holds the pages.
func (p *Pool) Device() cudaops.Device { return p.dev }

// AddTenant registers a tenant in the sharing domain its config names.
func (p *Pool) AddTenant(tc TenantConfig) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed {
		return ErrPoolClosed
	}
	_, err := p.mu.tenants.Add(tc)
	return err
}

// UpdateTenant replaces a tenant's configuration: quota, reservation and
// sharing domain (an empty Domain moves it back to its own). Leases
// already admitted keep their pages, in the domain they were admitted in.
func (p *Pool) UpdateTenant(tc TenantConfig) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed {
		return ErrPoolClosed
	}
	if err := p.mu.tenants.Update(tc); err != nil {
		return err
	}
	p.broadcastLocked()
	return nil
}

// Admit reserves every page req can need and returns its lease, or an
// *AdmissionError (or ErrPoolClosed, ErrPoolFaulted) with nothing
// allocated. If ctx has a deadline, Admit waits up to it for pages or quota
// to free up; otherwise a busy pool refuses at once with ErrPoolExhausted
// or ErrExceedsQuota.
func (p *Pool) Admit(ctx context.Context, req Request) (*Lease, error) {
	l := new(Lease)
	if err := p.AdmitInto(ctx, req, l); err != nil {
		return nil, err
	}
	return l, nil
}

// TryAdmit is Admit that never waits: a busy pool or a full quota is
// refused at once (ErrPoolExhausted, ErrExceedsQuota), whatever the
// context of the caller.
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
	return p.AdmitInto(context.Background(), req, l)
}

// AdmitInto is Admit into a Lease the caller provides, so that an engine
// which recycles its request structs admits without allocating. l must be
// a zero Lease or one that has been released; it must not be in use by
// anyone else.
func (p *Pool) AdmitInto(ctx context.Context, req Request, l *Lease) error {
	if l == nil {
		return fmt.Errorf("%w: nil lease", ErrInvalidArgument)
	}
	if l.state.Load() == leaseLive {
		return fmt.Errorf("%w: lease %q is still live", ErrInvalidArgument, l.id)
	}
	l.keys, l.keysFor = l.keys[:0], nil
	if err := p.precheck(req); err != nil {
		return err
	}
	if len(req.PageKeys) > 0 && !p.prefixDisabled {
		l.keys = append(l.keys, req.PageKeys...)
	}
	need := p.geom.PagesFor(req.Tokens())
	_, wait := ctx.Deadline()
	wait = wait && ctx.Err() == nil
	if wait {
		var stop context.CancelFunc
		ctx, stop = context.WithCancel(ctx)
		defer stop()
		defer context.AfterFunc(p.closing, stop)()
	}
	for {
		// The cached prefix decides how many fresh pages to claim; it may
		// change before admitLocked, which then settles the difference.
		fresh, err := p.planPrefix(req, need, l)
		if err != nil {
			return err
		}
		if err := p.claimPages(ctx, req, fresh, l, wait); err != nil {
			return err
		}
		retry, err := p.admitLocked(req, need, fresh, l, wait)
		if err == nil && retry == nil {
			return nil
		}
		if retry == nil {
			return err
		}
		if err == nil { // retry at once: the prefix or the tenant's domain changed
			continue
		}
		select {
		case <-retry:
		case <-ctx.Done():
			if p.closing.Err() != nil {
				return ErrPoolClosed
			}
			if ae, ok := err.(*AdmissionError); ok {
				p.mu.Lock()
				p.mu.refused.count(ae.Err)
				p.mu.Unlock()
			}
			return err
		}
	}
}

// precheck refuses what can be decided without claiming pages.
func (p *Pool) precheck(req Request) error {
	refuse := func(e *AdmissionError) error {
		p.mu.Lock()
		p.mu.refused.count(e.Err)
		p.mu.Unlock()
		e.RequestID, e.Tenant = req.ID, req.Tenant
		return e
	}
	if err := validateRequest(req, p.geom.TokensPerPage); err != nil {
		return refuse(&AdmissionError{Err: ErrInvalidRequest, Cause: err})
	}
	if req.Tokens() > p.maxContext {
		return refuse(&AdmissionError{Err: ErrExceedsMaxContext, Need: req.Tokens(), Limit: p.maxContext})
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stateErrLocked(); err != nil {
		return err
	}
	var e *AdmissionError
	need := p.geom.PagesFor(req.Tokens())
	t, err := p.mu.tenants.Lookup(req.Tenant)
	inService := p.total - p.mu.alloc.Count(allocator.Retired)
	switch {
	case err != nil:
		e = &AdmissionError{Err: ErrUnknownTenant, Cause: err}
	case p.mu.leases[req.ID] != nil:
		e = &AdmissionError{Err: ErrDuplicateRequest}
	case need > inService:
		e = &AdmissionError{Err: ErrExceedsCapacity, Need: need, Have: p.mu.alloc.Count(allocator.Free), Limit: inService,
			NeedTokens: req.Tokens(), LimitTokens: inService * p.geom.TokensPerPage}
	case need > t.Quota:
		e = &AdmissionError{Err: ErrExceedsQuota, Need: need, Have: max(0, t.Quota-t.Used), Limit: t.Quota}
	default:
		return nil
	}
	p.mu.refused.count(e.Err)
	e.RequestID, e.Tenant = req.ID, req.Tenant
	return e
}

func validateRequest(req Request, tokensPerPage int) error {
	switch {
	case req.ID == "" || len(req.ID) > MaxIDLen:
		return fmt.Errorf("request ID of %d bytes, want 1..%d", len(req.ID), MaxIDLen)
	case req.Tenant == "" || len(req.Tenant) > MaxIDLen:
		return fmt.Errorf("tenant name of %d bytes, want 1..%d", len(req.Tenant), MaxIDLen)
	case req.PromptTokens <= 0:
		return fmt.Errorf("PromptTokens = %d, want ≥ 1", req.PromptTokens)
	case req.MaxNewTokens < 0:
		return fmt.Errorf("MaxNewTokens = %d, want ≥ 0", req.MaxNewTokens)
	case req.PromptTokens > maxRequestTokens-req.MaxNewTokens:
		return fmt.Errorf("PromptTokens %d + MaxNewTokens %d overflows", req.PromptTokens, req.MaxNewTokens)
	}
	return validatePrefix(req, tokensPerPage)
}

// maxRequestTokens keeps token arithmetic (and slot numbers) far from
// overflow on every platform.
const maxRequestTokens = 1 << 40

func (p *Pool) stateErrLocked() error {
	if p.mu.closed {
		return ErrPoolClosed
	}
	if f := p.q.FaultLocked(); f != nil {
		return fmt.Errorf("%w: %w", ErrPoolFaulted, f)
	}
	return nil
}

// admitLocked runs with claimed fresh pages taken from the semaphore. It
// shares the prefix cached in the tenant's domain and allocates the other
// pages of need; the claim becomes those pages. On failure the claim is
// given back; if the failure is retryable and the caller waits (or the
// cached prefix changed under it), it returns a channel closed when the
// admission should try again.
func (p *Pool) admitLocked(req Request, need, claimed int, l *Lease, wait bool) (retry <-chan struct{}, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	giveBack := claimed
	defer func() {
		if giveBack > 0 {
			p.freePages.Release(int64(giveBack))
		}
	}()
	if err := p.stateErrLocked(); err != nil {
		return nil, err
	}
	// Checked again: another admission may have taken the ID since precheck.
	if p.mu.leases[req.ID] != nil {
		p.mu.refused.count(ErrDuplicateRequest)
		return nil, &AdmissionError{Err: ErrDuplicateRequest, RequestID: req.ID, Tenant: req.Tenant}
	}
	t, err := p.mu.tenants.Lookup(req.Tenant)
	if err != nil { // tenants are never removed, so only a racing bug gets here
		return nil, &AdmissionError{Err: ErrUnknownTenant, Cause: err, RequestID: req.ID, Tenant: req.Tenant}
	}
	fresh := need
	p.mu.prefix.matched = p.mu.prefix.matched[:0]
	if !p.prefixOff(req) {
		if len(req.TokenIDs) > 0 && l.keysFor != t.Domain {
			return retryNow, nil // the tenant moved: derive its keys again
		}
		fresh -= p.matchLocked(t.Domain, l.keys, maxHitPages(req, p.geom.TokensPerPage))
	}
	newToTenant, cachedHits := p.chargeForMatchLocked(t)
	charge := fresh + newToTenant
	if t.Used+charge > t.Quota {
		e := &AdmissionError{Err: ErrExceedsQuota, RequestID: req.ID, Tenant: req.Tenant, Need: charge, Have: max(0, t.Quota-t.Used), Limit: t.Quota}
		if wait {
			return p.waitChanLocked(), e
		}
		p.mu.refused.count(e.Err)
		return nil, e
	}
	if fresh > claimed {
		// Part of the prefix was evicted since planPrefix, or the quota
		// that blocked the claim has room now.
		if !p.freePages.TryAcquire(int64(fresh - claimed)) {
			return retryNow, nil
		}
		giveBack = fresh
	}
	available := p.mu.alloc.Count(allocator.Free) + p.mu.prefix.lruLen - cachedHits
	if err := p.mu.tenants.ChargeShared(t, charge, fresh, available); err != nil {
		var qe *isolation.QuotaError
		errors.As(err, &qe)
		e := &AdmissionError{Err: ErrExceedsQuota, RequestID: req.ID, Tenant: req.Tenant, Need: qe.Need, Have: qe.Have, Limit: qe.Limit}
		if errors.Is(err, isolation.ErrReserved) {
			e.Err, e.Cause, e.Limit = ErrPoolExhausted, err, p.total-p.mu.alloc.Count(allocator.Retired)
		}
		if wait {
			return p.waitChanLocked(), e
		}
		p.mu.refused.count(e.Err)
		return nil, e
	}
	if p.q.NeedsVerify() {
		peek := p.mu.alloc.PeekFree(l.scrub[:0], fresh)
		l.scrub = peek[:0]
		if retired, err := p.q.VerifyLocked(peek); err != nil {
			p.mu.tenants.Uncharge(t, charge)
			giveBack -= retired // those pages left service for good
			p.mu.refused.count(ErrPoolFaulted)
			return nil, fmt.Errorf("%w: %w", ErrPoolFaulted, err)
		}
	}
	hits := len(p.mu.prefix.matched)
	handles := p.shareMatchedLocked(t, l.handles[:0])
	handles, err = p.mu.alloc.Alloc(handles, fresh, t.Domain.ID)
	if err != nil {
		panic(fmt.Sprintf("kvcache: %d pages claimed but allocator refused: %v", fresh, err))
	}
	giveBack -= fresh
	l.reset(p, req, t, handles)
	l.hitPages, l.published = hits, hits
	p.countMatchLocked(req, t.Domain, len(l.keys))
	p.mu.prefix.matched = p.mu.prefix.matched[:0]
	p.mu.leases[req.ID] = l
	p.mu.admitted++
	p.assertLocked("admit")
	return nil, nil
}

// retryNow is a closed channel: the admission retries at once.
var retryNow = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// waitChanLocked returns a channel that is closed at the next broadcast.
func (p *Pool) waitChanLocked() <-chan struct{} {
	if p.mu.changed == nil {
		p.mu.changed = make(chan struct{})
	}
	return p.mu.changed
}

// broadcastLocked wakes admissions waiting for quota or reservations.
func (p *Pool) broadcastLocked() {
	if p.mu.changed != nil {
		close(p.mu.changed)
		p.mu.changed = nil
	}
}

func (p *Pool) refuseExhausted(req Request, need int, cause error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.stateErrLocked(); err != nil {
		return err
	}
	p.mu.refused.count(ErrPoolExhausted)
	have := p.mu.alloc.Count(allocator.Free) + p.mu.prefix.lruLen // cached pages can be evicted
	if t, err := p.mu.tenants.Lookup(req.Tenant); err == nil {
		have = p.mu.tenants.Grantable(t, have)
	}
	return &AdmissionError{Err: ErrPoolExhausted, Cause: cause, RequestID: req.ID, Tenant: req.Tenant,
		Need: need, Have: have, Limit: p.total - p.mu.alloc.Count(allocator.Retired)}
}

// refuseWaitEnded explains why a waiting admission gave up.
func (p *Pool) refuseWaitEnded(req Request, need int, cause error) error {
	if p.closing.Err() != nil {
		return ErrPoolClosed
	}
	return p.refuseExhausted(req, need, cause)
}

// release ends lease l: its pages enter quarantine and are filled after
// the engine work named by after.
func (p *Pool) release(l *Lease, after cudaops.Ordering) error {
	p.mu.Lock()
	for {
		if p.mu.closed {
			p.mu.Unlock()
			return ErrPoolClosed
		}
		if l.state.Load() != leaseLive {
			p.mu.Unlock()
			return ErrLeaseReleased
		}
		if !p.drainLocked(l) {
			break
		}
	}
	l.state.Store(leaseReleased)
	pages := p.detachLocked(l, l.scrub[:0])
	l.scrub = pages[:0]
	p.mu.Unlock()
	return p.scrub(pages, after)
}

// detachLocked removes a released lease from the books and appends the
// pages that now need scrubbing.
func (p *Pool) detachLocked(l *Lease, pages []int32) []int32 {
	delete(p.mu.leases, l.id)
	before := len(pages)
	pages = p.releasePagesLocked(l, pages) // shared pages may stay cached
	p.q.BeginLocked(len(pages) - before)
	p.broadcastLocked()
	p.assertLocked("release")
	return pages
}

// scrub fills pages (already quarantined and counted in flight) and, once
// the fill has completed, returns them to the free list. pages may be
// reused by the caller once scrub returns.
func (p *Pool) scrub(pages []int32, after cudaops.Ordering) error {
	if len(pages) == 0 {
		return nil
	}
	if !slices.IsSorted(pages) {
		slices.Sort(pages) // adjacent IDs coalesce into one run per region
	}
	fence, err := p.q.Issue(pages, after)
	if err == nil {
		var done bool
		if done, err = fence.Done(); !done {
			batch := slices.Clone(pages)
			p.scrubs.Add(1)
			go func() {
				defer p.scrubs.Done()
				p.finishScrub(batch, fence.Wait())
			}()
			return nil
		}
	}
	return p.finishScrub(pages, err)
}

func (p *Pool) finishScrub(pages []int32, fillErr error) error {
	p.mu.Lock()
	err := p.q.FinishLocked(pages, fillErr)
	p.broadcastLocked()
	p.assertLocked("scrub")
	p.mu.Unlock()
	if err != nil {
		return fmt.Errorf("%w: %w", ErrPoolFaulted, err)
	}
	p.freePages.Release(int64(len(pages)))
	return nil
}

// ClearFault lets admissions run again after a fault. The pages of the
// failed fill (or the corrupt pages) stay retired; the pool's capacity is
// smaller by that much.
func (p *Pool) ClearFault() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.q.ClearFaultLocked()
	p.broadcastLocked()
}

// Fault returns the error that faulted the pool, or nil.
func (p *Pool) Fault() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.q.FaultLocked()
}

// Close refuses new admissions, releases every live lease (its pages are
// scrubbed), waits for all fills to complete and, if the pool created its
// device, closes it. Calls on the pool and its leases then return
// ErrPoolClosed; Stats and Check keep working.
func (p *Pool) Close() error {
	p.mu.Lock()
	if p.mu.closed {
		p.mu.Unlock()
		return ErrPoolClosed
	}
	p.mu.closed = true
	p.stopAll()
	for p.mu.pins > 0 { // no copy may outlive the pages or the device
		p.unpinned.Wait()
	}
	var pages []int32
	for _, l := range p.mu.leases {
		l.state.Store(leaseReleased)
		pages = p.detachLocked(l, pages)
	}
	pages = p.clearLocked(pages) // a closed pool keeps no KV
	p.mu.prefix.events.closeLocked()
	p.mu.Unlock()
	err := p.scrub(pages, cudaops.Ordering{})
	p.scrubs.Wait()
	if p.ownsDevice {
		err = errors.Join(err, p.dev.Close())
	}
	return err
}

// Check verifies the pool's accounting: the allocator's invariants, the
// registry's, that every quarantined page is being scrubbed, that the live
// leases hold exactly the in-use pages (each page's refcount is the number
// of leases holding it, each under the lease's domain at its current
// generation), that tenants are charged once per page they hold, and that
// the prefix cache's index and LRU list match the allocator's cached pages.
// It returns the first inconsistency found.
func (p *Pool) Check() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.checkLocked()
}

// assertLocked runs checkLocked after a state change when expensive
// self-checks are on (build tag invariants, or -race) and panics on the
// first inconsistency: a broken invariant is a kvfence bug that no caller
// can handle.
func (p *Pool) assertLocked(after string) {
	if !invariants.Enabled {
		return
	}
	if err := p.checkLocked(); err != nil {
		panic(fmt.Sprintf("kvcache: invariant broken after %s: %v", after, err))
	}
}

func (p *Pool) checkLocked() error {
	a := p.mu.alloc
	if err := a.Check(); err != nil {
		return err
	}
	if _, err := p.mu.tenants.Check(); err != nil {
		return err
	}
	if err := p.q.CheckLocked(); err != nil {
		return err
	}
	return p.checkSharingLocked()
}
