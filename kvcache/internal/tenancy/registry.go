// Package tenancy keeps the tenant books of one kvfence pool: who is
// registered, in which sharing domain, what each tenant holds, and the
// unused reservations that Decide (isolation's one rule) needs. It is
// kvcache's machinery: nothing here is safe for concurrent use, and the
// pool calls it under its lock. See isolation for the rules and the
// configuration they read.
//
// # Sharing domains
//
// A Domain is the only scope inside which KV pages are ever shared (prefix
// cache, handoff). Every tenant belongs to exactly one domain at a time:
// by default its own private domain, named isolation.PrivateDomainPrefix +
// the tenant's name, which no other tenant can join; or a shared domain
// the operator names in TenantConfig.Domain, which every tenant configured
// with the same name shares. The domain is server-side configuration:
// nothing a request carries can choose it. Domains are never removed. A
// domain's ID is the allocator.Owner of every page its tenants hold, so
// the allocator's same-owner rule for Retain is exactly "share only
// inside one domain". Moving a tenant to another domain (Update) changes
// where its new requests look up and publish pages; pages its live leases
// already hold stay in the old domain.
//
// # Invariants (checked by Check)
//
//   - every tenant has an ID equal to its index + 1, is found under its
//     name, and uses at least zero pages;
//   - the registry's sum of unused reservations equals the sum over its
//     tenants of max(0, Reserved − Used);
//   - every tenant is in exactly one registered domain, and each domain's
//     tenant count is the number of tenants in it.
package tenancy

import (
	"fmt"
	"math"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/isolation"
)

// Tenant is a registered tenant. Its fields are read and written under the
// owning pool's lock.
type Tenant struct {
	ID       allocator.Owner
	Name     string
	Quota    int
	Reserved int
	Used     int // pages held by the tenant's leases
	Domain   *Domain
	Sizing   isolation.Sizing
	// MaxCheckpoints is the configuration's bound on the tenant's state
	// checkpoints (0: the pool's).
	MaxCheckpoints int
}

// unusedReservation is the part of t's reservation it does not hold now.
func (t *Tenant) unusedReservation() int { return max(0, t.Reserved-t.Used) }

// Registry holds the tenants of one page space of totalPages pages.
type Registry struct {
	totalPages int
	byName     map[string]*Tenant
	list       []*Tenant // index = ID-1
	// unusedReserved is the sum over tenants of unusedReservation.
	unusedReserved int
	domains        domainTable
}

// NewRegistry returns an empty registry for a pool of totalPages pages.
func NewRegistry(totalPages int) *Registry {
	return &Registry{totalPages: totalPages, byName: make(map[string]*Tenant)}
}

func (r *Registry) reservedTotal(except *Tenant) int {
	n := 0
	for _, t := range r.list {
		if t != except {
			n += t.Reserved
		}
	}
	return n
}

// Add registers a tenant.
func (r *Registry) Add(c isolation.TenantConfig) (*Tenant, error) {
	quota, err := r.checkAdd(c)
	if err != nil {
		return nil, err
	}
	t := &Tenant{ID: allocator.Owner(len(r.list) + 1), Name: c.Name, Quota: quota, Reserved: c.ReservedPages, Sizing: c.Sizing,
		MaxCheckpoints: c.MaxCheckpoints}
	r.byName[c.Name] = t
	r.list = append(r.list, t)
	r.unusedReserved += t.unusedReservation()
	r.domains.assign(t, c.Domain)
	return t, nil
}

// CheckAdd returns the error Add(c) would return, and changes nothing: a
// pool that keeps one registry per cache group checks every group before
// it adds the tenant to any.
func (r *Registry) CheckAdd(c isolation.TenantConfig) error {
	_, err := r.checkAdd(c)
	return err
}

func (r *Registry) checkAdd(c isolation.TenantConfig) (quota int, err error) {
	quota, err = isolation.ValidateTenant(c, r.totalPages)
	if err != nil {
		return 0, err
	}
	if _, dup := r.byName[c.Name]; dup {
		return 0, fmt.Errorf("%w: %q", isolation.ErrDuplicateTenant, c.Name)
	}
	if len(r.list) >= math.MaxUint32-1 {
		return 0, fmt.Errorf("%w: too many tenants", isolation.ErrInvalidTenant)
	}
	if total := r.reservedTotal(nil) + c.ReservedPages; total > r.totalPages {
		return 0, fmt.Errorf("%w: %d pages reserved in all, pool has %d", isolation.ErrOverReserved, total, r.totalPages)
	}
	return quota, nil
}

// Update changes a tenant's quota, reservation and domain. Pages it
// already holds stay with it even above a lowered quota, and in the domain
// they were admitted in; new admissions see the new limits and domain.
func (r *Registry) Update(c isolation.TenantConfig) error {
	t, quota, err := r.checkUpdate(c)
	if err != nil {
		return err
	}
	r.unusedReserved -= t.unusedReservation()
	t.Quota, t.Reserved, t.Sizing, t.MaxCheckpoints = quota, c.ReservedPages, c.Sizing, c.MaxCheckpoints
	r.unusedReserved += t.unusedReservation()
	r.domains.assign(t, c.Domain)
	return nil
}

// CheckUpdate returns the error Update(c) would return, and changes
// nothing.
func (r *Registry) CheckUpdate(c isolation.TenantConfig) error {
	_, _, err := r.checkUpdate(c)
	return err
}

func (r *Registry) checkUpdate(c isolation.TenantConfig) (*Tenant, int, error) {
	t, err := r.Lookup(c.Name)
	if err != nil {
		return nil, 0, err
	}
	quota, err := isolation.ValidateTenant(c, r.totalPages)
	if err != nil {
		return nil, 0, err
	}
	if total := r.reservedTotal(t) + c.ReservedPages; total > r.totalPages {
		return nil, 0, fmt.Errorf("%w: %d pages reserved in all, pool has %d", isolation.ErrOverReserved, total, r.totalPages)
	}
	return t, quota, nil
}

// Lookup finds a tenant by name.
func (r *Registry) Lookup(name string) (*Tenant, error) {
	t, ok := r.byName[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", isolation.ErrUnknownTenant, name)
	}
	return t, nil
}

// Tenants returns the registered tenants in registration order. The
// pointers stay owned by the registry.
func (r *Registry) Tenants() []*Tenant { return r.list }

// Decide is isolation.Decide for tenant t of this registry.
func (r *Registry) Decide(t *Tenant, d isolation.Demand, s isolation.Supply) isolation.Decision {
	return isolation.Decide(isolation.TenantState{Quota: t.Quota, Reserved: t.Reserved, Used: t.Used,
		OthersUnused: r.unusedReserved - t.unusedReservation()}, d, s)
}

// Apply charges a granted decision to t. It panics on any other verdict:
// charging what Decide refused is a kvfence bug.
func (r *Registry) Apply(t *Tenant, d isolation.Decision) {
	if d.Verdict != isolation.Grant {
		panic(fmt.Sprintf("tenancy: applying a %v decision for tenant %q", d.Verdict, t.Name))
	}
	r.unusedReserved -= t.unusedReservation()
	t.Used += d.Demand.Charge
	r.unusedReserved += t.unusedReservation()
}

// TryChargeGrowth is Decide and Apply in one step for the common growth:
// pages ≥ 1 more pages for a running lease of t, taken from a supply of
// supply pages, passing the queue and the growth watermark (Queued false,
// Keep 0, Charge = Take = pages). It charges t and returns true exactly
// when Decide would return Grant, and otherwise changes nothing and
// returns false, leaving the refusal's numbers to Decide.
//
// With no queue and nothing kept, Decide's rule reduces to two bounds:
// the tenant's quota left, and the supply less the other tenants' unused
// reservations. A one-page growth decides on every page, and this is a
// few compares where Decide builds a Decision.
func (r *Registry) TryChargeGrowth(t *Tenant, pages, supply int) bool {
	own := t.unusedReservation()
	if pages < 1 || pages > t.Quota-t.Used || pages > supply || pages > supply-(r.unusedReserved-own) {
		return false
	}
	t.Used += pages
	if own > 0 { // else it stays 0: the sum is unchanged
		r.unusedReserved += t.unusedReservation() - own
	}
	return true
}

// Uncharge returns n pages of t's usage.
func (r *Registry) Uncharge(t *Tenant, n int) {
	if n > t.Used {
		panic(fmt.Sprintf("tenancy: tenant %q uncharged %d pages, holds %d", t.Name, n, t.Used))
	}
	r.unusedReserved -= t.unusedReservation()
	t.Used -= n
	r.unusedReserved += t.unusedReservation()
}

// Check verifies the registry's own accounting and returns the pages its
// tenants hold in all.
func (r *Registry) Check() (used int, err error) {
	unused := 0
	for i, t := range r.list {
		if t.ID != allocator.Owner(i+1) || r.byName[t.Name] != t {
			return 0, fmt.Errorf("%w: registry index broken at tenant %q", isolation.ErrCorrupt, t.Name)
		}
		if t.Used < 0 {
			return 0, fmt.Errorf("%w: tenant %q uses %d pages", isolation.ErrCorrupt, t.Name, t.Used)
		}
		used += t.Used
		unused += t.unusedReservation()
	}
	if unused != r.unusedReserved {
		return 0, fmt.Errorf("%w: unused reservations sum to %d, counter says %d", isolation.ErrCorrupt, unused, r.unusedReserved)
	}
	if err := r.checkDomains(); err != nil {
		return 0, err
	}
	return used, nil
}

// OwnerName names a page owner in reports: owners are sharing domains,
// and an owner no domain has is named by its number.
func (r *Registry) OwnerName(o allocator.Owner) string {
	if d := r.domains.byID(o); d != nil {
		return d.Name
	}
	return fmt.Sprintf("owner#%d", o)
}
