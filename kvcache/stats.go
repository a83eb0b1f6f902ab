package kvcache

import (
	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/isolation"
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
	Groups     []GroupStats
	LiveLeases int
	Admitted   uint64
	Refused    Refusals
	Growth     GrowthStats
	Scrub      isolation.ScrubStats
	Tenants    []TenantStats
	Prefix     PrefixStats
	Closed     bool
	Fault      string // why the pool is faulted; empty while healthy
}

// Stats returns a snapshot of the pool's counters.
func (p *Pool) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	a := p.mu.alloc
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
	}
	if f := p.q.FaultLocked(); f != nil {
		s.Fault = f.Error()
	}
	s.Prefix = p.prefixStatsLocked()
	for _, t := range p.mu.tenants.Tenants() {
		s.Tenants = append(s.Tenants, TenantStats{Name: t.Name, UsedPages: t.Used, QuotaPages: t.Quota, ReservedPages: t.Reserved})
	}
	return s
}
