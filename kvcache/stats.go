package kvcache

import (
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

// Refusals counts refused admissions by reason.
type Refusals struct {
	InvalidRequest   uint64
	UnknownTenant    uint64
	DuplicateRequest uint64
	ExceedsContext   uint64
	ExceedsCapacity  uint64
	ExceedsQuota     uint64
	PoolExhausted    uint64
	PoolFaulted      uint64
}

func (r *Refusals) count(reason error) {
	switch reason {
	case ErrInvalidRequest:
		r.InvalidRequest++
	case ErrUnknownTenant:
		r.UnknownTenant++
	case ErrDuplicateRequest:
		r.DuplicateRequest++
	case ErrExceedsMaxContext:
		r.ExceedsContext++
	case ErrExceedsCapacity:
		r.ExceedsCapacity++
	case ErrExceedsQuota:
		r.ExceedsQuota++
	case ErrPoolExhausted:
		r.PoolExhausted++
	case ErrPoolFaulted:
		r.PoolFaulted++
	}
}

// Total is the number of refusals.
func (r Refusals) Total() uint64 {
	return r.InvalidRequest + r.UnknownTenant + r.DuplicateRequest + r.ExceedsContext +
		r.ExceedsCapacity + r.ExceedsQuota + r.PoolExhausted + r.PoolFaulted
}

// TenantStats is one tenant's usage.
type TenantStats struct {
	Name          string
	UsedPages     int
	QuotaPages    int
	ReservedPages int
	// Admitted and Refused count the tenant's admissions (imports
	// included) and refusals by reason since the tenant was registered.
	// A refusal of a request naming no registered tenant counts only in
	// the pool's Stats.Refused.
	Admitted uint64
	Refused  Refusals
}

// tenantCounters holds admissions and refusals per tenant, indexed by
// tenant ID - 1 (IDs are dense and never reused), so that counting an
// admission is an index, not a map lookup. Guarded by Pool.mu.
type tenantCounters struct {
	byID []tenantCount
}

type tenantCount struct {
	admitted uint64
	refused  Refusals
}

// of returns t's counters, growing the table for a new tenant.
func (c *tenantCounters) of(t *tenancy.Tenant) *tenantCount {
	i := int(t.ID) - 1
	if i >= len(c.byID) {
		c.byID = append(c.byID, make([]tenantCount, i+1-len(c.byID))...)
	}
	return &c.byID[i]
}

// countAdmittedLocked counts an admission of t.
func (p *Pool) countAdmittedLocked(t *tenancy.Tenant) {
	p.mu.perTenant.of(t).admitted++
}

// countRefusedLocked counts a refusal against the tenant the request
// names, if it is registered: an unknown name must not grow the table.
func (p *Pool) countRefusedLocked(tenant string, reason error) {
	if reason == ErrUnknownTenant {
		return
	}
	if t, err := p.tenantsLocked().Lookup(tenant); err == nil {
		p.mu.perTenant.of(t).refused.count(reason)
	}
}

// fillLatencyBounds are the upper bounds of Stats.FillLatency's buckets:
// from a host fill of a few pages to a device fill queued behind long
// engine work.
var fillLatencyBounds = [...]time.Duration{
	time.Microsecond, 2 * time.Microsecond, 5 * time.Microsecond,
	10 * time.Microsecond, 20 * time.Microsecond, 50 * time.Microsecond,
	100 * time.Microsecond, 200 * time.Microsecond, 500 * time.Microsecond,
	time.Millisecond, 2 * time.Millisecond, 5 * time.Millisecond,
	10 * time.Millisecond, 20 * time.Millisecond, 50 * time.Millisecond,
	100 * time.Millisecond, 200 * time.Millisecond, 500 * time.Millisecond,
	time.Second, 2 * time.Second, 5 * time.Second, 10 * time.Second,
}

// FillLatencyBounds returns the upper bounds of Stats.FillLatency's
// buckets, ascending (a copy: the buckets are fixed).
func FillLatencyBounds() []time.Duration { return slices.Clone(fillLatencyBounds[:]) }

// FillLatency is a histogram of the time from a scrub fill's issue to its
// fence's completion, over the fills that succeeded (release scrubs and the
// scrubs of evicted pages; the pool's first scrub at New is not counted).
// A fill ordered after engine work includes the wait for that work.
type FillLatency struct {
	// Buckets[i] counts fills that took at most FillLatencyBounds()[i] and
	// more than the bound before (not cumulative); the last element counts
	// fills longer than every bound.
	Buckets [len(fillLatencyBounds) + 1]uint64
	Count   uint64        // the sum of Buckets
	Sum     time.Duration // total time of the fills counted
}

// fillHistogram records FillLatency with atomics: fills finish outside
// Pool.mu, and recording must cost no lock.
type fillHistogram struct {
	buckets [len(fillLatencyBounds) + 1]atomic.Uint64
	sumNs   atomic.Int64
}

func (h *fillHistogram) record(d time.Duration) {
	i := 0
	for i < len(fillLatencyBounds) && d > fillLatencyBounds[i] {
		i++
	}
	h.buckets[i].Add(1)
	h.sumNs.Add(int64(d))
}

// snapshot reads the buckets first and derives Count from them, so that
// Count always equals the sum of Buckets even while fills finish.
func (h *fillHistogram) snapshot() FillLatency {
	var s FillLatency
	for i := range h.buckets {
		s.Buckets[i] = h.buckets[i].Load()
		s.Count += s.Buckets[i]
	}
	s.Sum = time.Duration(h.sumNs.Load())
	return s
}

// Stats is a snapshot of a pool.
type Stats struct {
	Device           string
	TotalPages       int
	FreePages        int // clean, ready to hand out
	InUsePages       int
	CachedPages      int
	QuarantinedPages int // released, fill not yet completed
	RetiredPages     int // out of service after a failed fill or audit
	TokensPerPage    int
	PageBytes        int64 // one page over all regions of the per-token group
	// Groups is every cache group's figures, the per-token group first
	// (its figures are the ones above).
	Groups      []GroupStats
	LiveLeases  int
	Admitted    uint64
	Refused     Refusals
	Growth      GrowthStats
	Scrub       isolation.ScrubStats
	FillLatency FillLatency
	Tenants     []TenantStats
	Prefix      PrefixStats
	// Checkpoints is the state checkpoints of a pool with window or state
	// groups (zero in any other).
	Checkpoints CheckpointStats
	// Tier is the host tier's figures (zero without one).
	Tier   TierStats
	Closed bool
	Fault  string // why the pool is faulted; empty while healthy
}

// Stats returns a snapshot of the pool's counters.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	a := p.groups[0].alloc
	s := Stats{
		Device:           p.dev.Name(),
		TotalPages:       p.total,
		FreePages:        a.Count(allocator.Free),
		InUsePages:       a.Count(allocator.InUse),
		CachedPages:      a.Count(allocator.Cached),
		QuarantinedPages: a.Count(allocator.Quarantined),
		RetiredPages:     a.Count(allocator.Retired),
		TokensPerPage:    p.tpp,
		PageBytes:        p.PageBytes(),
		Groups:           p.groupStatsLocked(),
		LiveLeases:       len(p.mu.leases),
		Admitted:         p.mu.admitted,
		Refused:          p.mu.refused,
		Growth:           p.mu.growth,
		Scrub:            p.q.StatsLocked(),
		Closed:           p.mu.closed,
		FillLatency:      p.fillLatency.snapshot(),
	}
	if f := p.q.FaultLocked(); f != nil {
		s.Fault = f.Error()
	}
	s.Prefix = p.prefixStatsLocked()
	s.Checkpoints = p.checkpointStatsLocked()
	s.Tier = p.tierStatsLocked()
	// One allocation, sized: this runs under mu, which a scrape should
	// hold for the copy and no longer.
	tenants := p.tenantsLocked().Tenants()
	s.Tenants = make([]TenantStats, len(tenants))
	for i, t := range tenants {
		c := p.mu.perTenant.of(t)
		s.Tenants[i] = TenantStats{Name: t.Name, UsedPages: t.Used, QuotaPages: t.Quota, ReservedPages: t.Reserved,
			Admitted: c.admitted, Refused: c.refused}
	}
	return s
}
