package isolation

import "fmt"

// Demand is what one admission asks of its tenant and of the pool.
type Demand struct {
	// Charge is the pages the admission adds to the tenant's usage: its
	// fresh pages plus the shared ones the tenant holds no other lease on.
	Charge int
	// Take is the pages it takes from the pool's supply (free or
	// evictable); the rest of Charge are resident pages shared inside the
	// tenant's domain. Take ≤ Charge.
	Take int
}

// Supply is what the pool can give one admission now.
type Supply struct {
	// Pages is the pages the pool can hand out to this admission: free
	// pages and evictable cached pages, less what other admissions have
	// claimed.
	Pages int
	// InService is the pool's pages that are not retired.
	InService int
	// Queued says that an earlier admission waits for pool pages: pages
	// beyond the tenant's own unused reservation are theirs first.
	Queued bool
	// Keep is the pages a new admission must leave to the growth of
	// running leases (the pool's growth watermark); zero for a growth.
	// A tenant's own unused reservation is its own: Keep comes out of the
	// unreserved pages only.
	Keep int
}

// Verdict is the outcome of Decide.
type Verdict uint8

const (
	// Grant: the admission may proceed; Apply charges the tenant.
	Grant Verdict = iota
	// OverQuota: the tenant's quota cannot take the charge now.
	OverQuota
	// PoolShort: the pool cannot give the tenant enough pages now (too few
	// pages, or earlier admissions queue for them).
	PoolShort
	// Reserved: enough pages exist, but some of them are other tenants'
	// unused reservations.
	Reserved
	// KeptForGrowth: enough pages exist, but a new admission would cut
	// into the pages kept for the growth of running leases.
	KeptForGrowth
)

var verdictNames = [...]string{"grant", "over quota", "pool short", "reserved for others", "kept for growth"}

func (v Verdict) String() string {
	if int(v) < len(verdictNames) {
		return verdictNames[v]
	}
	return fmt.Sprintf("Verdict(%d)", uint8(v))
}

// Decision is a verdict with the numbers behind it, in pages.
type Decision struct {
	Verdict Verdict
	Demand  Demand
	// Have is what the tenant could get now: its quota left for OverQuota,
	// the pool pages open to it (capped by its quota left) otherwise.
	Have int
	// Limit is the ceiling that applies: the tenant's quota for OverQuota,
	// the pool's free and evictable pages for Reserved and KeptForGrowth,
	// its pages in service otherwise.
	Limit int
}

// Err returns the decision as an error: nil for Grant and PoolShort (the
// pool's own refusal, which the pool reports), a *QuotaError wrapping
// ErrQuotaExceeded, ErrReserved or ErrKeptForGrowth otherwise.
func (d Decision) Err(tenant string) error {
	switch d.Verdict {
	case OverQuota:
		return &QuotaError{Err: ErrQuotaExceeded, Tenant: tenant, Need: d.Demand.Charge, Have: d.Have, Limit: d.Limit}
	case Reserved:
		return &QuotaError{Err: ErrReserved, Tenant: tenant, Need: d.Demand.Take, Have: d.Have, Limit: d.Limit}
	case KeptForGrowth:
		return &QuotaError{Err: ErrKeptForGrowth, Tenant: tenant, Need: d.Demand.Take, Have: d.Have, Limit: d.Limit}
	}
	return nil
}

// TenantState is what Decide reads of the tenant an admission is for:
// its limits and usage, and the unused reservations of every other
// tenant of the pool, summed (pages nobody else may take).
type TenantState struct {
	Quota, Reserved, Used int
	OthersUnused          int
}

// Decide is the one quota and reservation rule of kvfence (see the package
// doc for its steps), a pure function of the tenant's state, the
// admission's demand and the pool's supply. The pool that calls it
// charges the tenant after a Grant.
func Decide(t TenantState, d Demand, s Supply) Decision {
	quotaLeft := max(0, t.Quota-t.Used)
	own := max(0, t.Reserved-t.Used)
	others := t.OthersUnused
	// Pages open to t: the supply less others' unused reservations; of
	// what is not t's own reservation, less the pages kept for growth; and
	// only its own reservation while earlier admissions queue.
	unreserved := max(0, s.Pages-others)
	kept := min(unreserved, own+max(0, unreserved-own-s.Keep))
	open := kept
	if s.Queued {
		open = min(open, own)
	}
	overQuota := d.Charge > quotaLeft
	have := min(open, quotaLeft)
	// Each outcome is returned whole: a Decision built in place and then
	// amended went through memory, and reading it back cost more than the
	// rule itself (a one-page growth decides on every page).
	switch {
	case overQuota && t.Quota < s.InService:
		return Decision{Verdict: OverQuota, Demand: d, Have: quotaLeft, Limit: t.Quota}
	case d.Take > s.Pages:
		return Decision{Verdict: PoolShort, Demand: d, Have: have, Limit: s.InService}
	case d.Take > unreserved:
		return Decision{Verdict: Reserved, Demand: d, Have: open, Limit: s.Pages}
	case d.Take > kept:
		return Decision{Verdict: KeptForGrowth, Demand: d, Have: open, Limit: s.Pages}
	case d.Take > open:
		return Decision{Verdict: PoolShort, Demand: d, Have: have, Limit: s.InService} // queued behind earlier admissions
	case overQuota:
		// A quota as large as the pool cannot bind before the pool does
		// (the tenant's pages, the fresh ones and the shared ones are
		// distinct pages in service); kept so no path ever passes a quota.
		return Decision{Verdict: OverQuota, Demand: d, Have: quotaLeft, Limit: t.Quota}
	}
	return Decision{Verdict: Grant, Demand: d, Have: have, Limit: s.InService}
}
