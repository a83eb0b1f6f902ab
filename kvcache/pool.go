package kvcache

import (
	"errors"
	"fmt"
	"log/slog"
	"math/bits"
	"math/rand/v2"
	"slices"
	"sync"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/internal/invariants"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache/internal/scrub"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// This file holds the Pool itself: its fields and their invariants,
// construction, tenants, faults and Close. Admission is in admit.go,
// release and scrubbing in release.go, the prefix cache in prefix.go and
// prefixindex.go, the handoff in phase.go, export.go and import.go, and
// Check in check.go.

// Pool is a paged KV cache shared by tenants. See the package doc.
type Pool struct {
	// Set once in New, read without mu.
	geom     Geometry // zero for a pool made from a CacheSpec
	lay      *layout
	tpp      int // tokens per page of the per-token group
	tppShift int // log2(tpp) when tpp is a power of two, else -1
	total    int // per-token pages
	// groups are the cache groups (groups.go), the per-token group first;
	// the slice and each group's allocator and books never change, and
	// what they hold is guarded by mu.
	groups         []group
	maxContext     int
	dev            cudaops.Device
	ownsDevice     bool
	prefixDisabled bool
	maxCheckpoints int     // Config.Prefix.MaxCheckpoints
	sizing         Sizing  // the pool's default, never SizeInherit
	watermark      float64 // Config.GrowthWatermark
	events         chan KVEvent
	log            *slog.Logger // never nil: Config.logger
	// fillLatency is the time from issue to completion of every fill that
	// succeeded (atomic: recorded outside mu).
	fillLatency fillHistogram
	// q scrubs every group (quarantine space i is group i). Its Issue runs
	// without mu; its Locked methods need mu.
	q *scrub.Quarantine
	// tier is the host tier (tier.go), nil without one; what it holds is
	// guarded by mu.
	tier *hostTier

	// fills counts scrubs whose pages have left the books (quarantined
	// under mu) and whose fill has not finished. Add runs under mu before
	// the pages are handed to scrub, which calls Done; Close, once closed
	// is set, waits for it before it closes the device, so no fill ever
	// meets a closed device.
	fills sync.WaitGroup
	// quiet is signalled (with mu) when page copies or admissions in flight
	// end while a release or Close waits for them.
	quiet sync.Cond

	mu struct {
		sync.Mutex
		leases map[string]*Lease // the live leases, by request ID
		closed bool
		// pins counts page copies in flight outside mu, all leases.
		pins int
		// admitting counts calls of Admit, TryAdmit and BeginImport in
		// progress (waiting, hashing or evicting outside mu included);
		// Close waits for it to reach zero.
		admitting int
		// claimEpoch numbers the claims of admissions (group.claimed,
		// admission.claims): a fault ends an epoch and voids its claims.
		claimEpoch uint64
		// waiters is the queue of admissions waiting for pages or quota,
		// in arrival order; poolWaiters counts those waiting for pages.
		waiters     waitQueue
		poolWaiters int
		// seq numbers admissions: each incarnation of a Lease, and so each
		// export or import of it, has its own.
		seq       uint64
		admitted  uint64
		refused   Refusals
		perTenant tenantCounters // admissions and refusals per tenant
		growth    GrowthStats
		prefix    prefixIndex
		ckpts     checkpointBook
		events    eventSink
	}
}

// New builds a pool from cfg. It refuses a pool that cannot hold
// cfg.MaxContextTokens (ErrUndersizedPool) unless cfg.AllowUndersizedPool,
// and one whose page metadata (and host page memory, for the pool's own
// host device) would not fit in the memory this process may use.
func New(cfg Config) (_ *Pool, err error) {
	defer func() {
		if err != nil {
			cfg.logRefused(err)
		}
	}()
	v, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	p := &Pool{
		lay:            v.lay,
		tpp:            v.lay.tpp,
		tppShift:       log2Exact(v.lay.tpp),
		total:          v.pages[0],
		maxContext:     cfg.MaxContextTokens,
		prefixDisabled: cfg.Prefix.Disable,
		maxCheckpoints: cfg.Prefix.MaxCheckpoints,
		sizing:         cfg.Sizing.Or(Sizing{Mode: SizeFull}),
		watermark:      cfg.GrowthWatermark,
		log:            cfg.logger(),
	}
	if cfg.Cache.IsZero() {
		p.geom = cfg.Geometry
	}
	spaces := make([]scrub.Space, len(v.lay.groups))
	p.groups = make([]group, len(v.lay.groups))
	for i, gl := range v.lay.groups {
		a, err := allocator.New(v.pages[i])
		if err != nil {
			return nil, fmt.Errorf("%w: group %q: %w", ErrInvalidConfig, gl.name, err)
		}
		p.groups[i] = group{groupLayout: gl, index: i, pages: v.pages[i], alloc: a, tenants: tenancy.NewRegistry(v.pages[i])}
		spaces[i] = scrub.Space{Alloc: a, First: gl.first, Count: gl.count}
	}
	p.mu.Lock() // the Locked helpers assert it; nothing else can see p yet
	for _, tc := range cfg.Tenants {
		if err := p.addTenantLocked(tc); err != nil {
			p.mu.Unlock()
			return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
	}
	p.mu.Unlock()
	dev, owned, err := cfg.setupDevice(v)
	if err != nil {
		return nil, err
	}
	p.dev, p.ownsDevice = dev, owned
	books := p.groups[0].tenants
	q, err := scrub.New(spaces, dev, &p.mu.Mutex, cfg.Scrub, books.OwnerName, v.lay.dtypes...)
	if err == nil {
		err = q.ScrubAllFree()
	}
	if err != nil {
		if owned {
			dev.Close()
		}
		if errors.Is(err, isolation.ErrInvalidPolicy) { // a device that cannot fill the spec's groups
			err = fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		return nil, err
	}
	p.q = q
	if v.tierSlots > 0 {
		if p.tier, err = newHostTier(p, cfg.HostTier, v.tierSlots, v.tierCkpts); err != nil {
			if owned {
				dev.Close()
			}
			return nil, err
		}
		p.mu.Lock()
		for _, tc := range cfg.Tenants {
			p.setTierPagesLocked(tc)
		}
		p.mu.Unlock()
	}
	p.quiet.L = &p.mu.Mutex
	p.mu.leases = make(map[string]*Lease)
	p.mu.prefix.init(p.total, rand.Uint64())
	p.mu.ckpts.units, p.mu.ckpts.evictable = make([]int, len(p.groups)), make([]int, len(p.groups))
	p.mu.ckpts.loose = make(map[*checkpoint]struct{})
	if cfg.Prefix.EventBuffer > 0 {
		p.events = make(chan KVEvent, cfg.Prefix.EventBuffer)
		p.mu.events.ch = p.events
		p.mu.events.spare = make(chan []BlockKey, spareKeyArrays)
		if cfg.Prefix.EventTokens {
			p.mu.events.spareTokens = make(chan []int32, spareKeyArrays)
		}
	}
	return p, nil
}

// Geometry returns the pool's page geometry; the zero Geometry for a pool
// made from a CacheSpec (see Spec).
func (p *Pool) Geometry() Geometry { return p.geom }

// Spec returns the pool's cache spec: Config.Cache, or the one its
// Geometry describes (GeometrySpec). Adopted memory is left out.
func (p *Pool) Spec() CacheSpec {
	s := p.lay.spec
	s.Groups = slices.Clone(s.Groups)
	for i := range s.Groups {
		rs := slices.Clone(s.Groups[i].Regions)
		for j := range rs {
			rs[j].Memory = nil
		}
		s.Groups[i].Regions = rs
	}
	return s
}

// FillSpec is what the scrub policy writes over a freed page (the word of
// page p is FillSpec().WordFor(p)): for audits that read freed pages back.
func (p *Pool) FillSpec() cudaops.FillSpec { return p.q.Spec() }

// TokensPerPage is the page size of the per-token group.
func (p *Pool) TokensPerPage() int { return p.tpp }

// PageBytes is one per-token page over all its regions.
func (p *Pool) PageBytes() int64 { return p.groups[0].pageBytes }

// pagesFor is the per-token pages that hold tokens tokens.
func (p *Pool) pagesFor(tokens int) int {
	if p.tppShift >= 0 && tokens >= 0 {
		// The usual page sizes are powers of two; a 64-bit division
		// costs as much as the rest of a one-page growth's decision.
		return int((int64(tokens) + int64(p.tpp) - 1) >> p.tppShift)
	}
	return int((int64(tokens) + int64(p.tpp) - 1) / int64(p.tpp))
}

// log2Exact returns log2(n) for a power of two n ≥ 1, and -1 otherwise.
func log2Exact(n int) int {
	if n < 1 || n&(n-1) != 0 {
		return -1
	}
	return bits.TrailingZeros(uint(n))
}

// Pages returns the pool size in pages.
func (p *Pool) Pages() int { return p.total }

// CapacityTokens is the pool size in tokens.
func (p *Pool) CapacityTokens() int { return p.total * p.tpp }

// AddTenant registers a tenant in the sharing domain its config names.
func (p *Pool) AddTenant(tc TenantConfig) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.closed {
		return ErrPoolClosed
	}
	return p.addTenantLocked(tc)
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
	if err := p.updateTenantLocked(tc); err != nil {
		return err
	}
	t, _ := p.tenantsLocked().Lookup(tc.Name)
	p.wakeTenantLocked(t) // its quota or domain changed
	p.wakePagesLocked()   // a smaller reservation opens pages to others
	return nil
}

// ClearFault lets admissions run again after a fault. The pages of the
// failed fill (or the corrupt pages) stay retired; the pool's capacity is
// smaller by that much.
func (p *Pool) ClearFault() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.q.ClearFaultLocked()
	p.wakeAllLocked()
}

// Fault returns the error that faulted the pool, or nil.
func (p *Pool) Fault() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.q.FaultLocked()
}

// Close refuses new admissions and wakes waiting ones (they return
// ErrPoolClosed), waits for admissions and page copies in progress,
// releases every live lease and drops the prefix cache (their pages are
// scrubbed), waits for every fill issued before or during Close, and then,
// if the pool created its device, closes it. Nothing is retired by
// shutdown. Calls on the pool and its leases then return ErrPoolClosed;
// Stats and Check keep working.
func (p *Pool) Close() error {
	p.mu.Lock()
	if p.mu.closed {
		p.mu.Unlock()
		return ErrPoolClosed
	}
	p.mu.closed = true
	p.wakeAllLocked()
	// No copy may outlive the pages or the device, and no admission may
	// still be evicting or waiting when the books are closed.
	for p.mu.pins > 0 || p.mu.admitting > 0 || p.tier != nil && p.tier.busy > 0 {
		p.quiet.Wait()
	}
	b := scrubBatch{}.batchFor(p)
	for _, l := range p.mu.leases {
		l.state.Store(leaseReleased)
		b = p.detachLocked(l, b)
	}
	p.clearLocked(&b) // a closed pool keeps no KV
	fill := p.takeTierPendingLocked()
	p.mu.events.closeLocked()
	p.fills.Add(1)
	p.mu.Unlock()
	p.scrubTier(fill) // the host tier keeps no KV either
	err := p.scrub(b, cudaops.Ordering{})
	p.fills.Wait()
	err = errors.Join(err, p.closeTier())
	if p.ownsDevice {
		err = errors.Join(err, p.dev.Close())
	}
	return err
}

// assertHeld panics, when expensive self-checks are on (build tag
// invariants, or -race), if Pool.mu is not held: every method whose name
// ends in Locked needs it. TryLock cannot tell who holds the lock, but a
// Locked method called without it is the bug this catches.
func (p *Pool) assertHeld() {
	if invariants.Enabled && p.mu.TryLock() {
		p.mu.Unlock()
		panic("kvcache: a Locked method was called without Pool.mu")
	}
}

// stateErrLocked is the error of an operation on a closed or faulted
// pool, nil while the pool is healthy and open.
func (p *Pool) stateErrLocked() error {
	p.assertHeld()
	if p.mu.closed {
		return ErrPoolClosed
	}
	if f := p.q.FaultLocked(); f != nil {
		return fmt.Errorf("%w: %w", ErrPoolFaulted, f)
	}
	return nil
}

// inServiceLocked is the per-token group's pages that are not retired.
func (p *Pool) inServiceLocked() int {
	p.assertHeld()
	return p.groups[0].inServiceLocked()
}
