package isolation

import (
	"fmt"
	"math"

	"github.com/kvfence/kvfence/allocator"
)

// MaxTenantName bounds tenant names, which travel in errors and events.
const MaxTenantName = 256

// TenantConfig is what an operator declares for a tenant.
type TenantConfig struct {
	// Name is 1..MaxTenantName bytes of UTF-8 without a NUL, as is a
	// Domain name (see NameProblem).
	Name string
	// QuotaPages is the most pages the tenant may hold at once (a hard
	// limit); zero means the whole pool.
	QuotaPages int
	// ReservedPages are kept for this tenant: no other tenant may take
	// them, whether or not this tenant uses them. At most QuotaPages.
	ReservedPages int
	// Domain names the sharing domain the tenant belongs to; empty means
	// its own private domain. See Domain.
	Domain string
	// Sizing overrides the pool's sizing of this tenant's leases; the
	// zero value inherits it.
	Sizing Sizing
}

// Tenant is a registered tenant. Its fields are read and written under the
// owning pool's lock.
type Tenant struct {
	ID       allocator.Owner
	Name     string
	Quota    int
	Reserved int
	Used     int // pages held by the tenant's leases
	Domain   *Domain
	Sizing   Sizing
}

// unusedReservation is the part of t's reservation it does not hold now.
func (t *Tenant) unusedReservation() int { return max(0, t.Reserved-t.Used) }

// Registry holds the tenants of one pool of totalPages pages. It is not
// safe for concurrent use: the pool calls it under its lock.
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

func (r *Registry) validate(c TenantConfig) (quota int, err error) {
	switch {
	case NameProblem(c.Name, MaxTenantName) != "":
		return 0, fmt.Errorf("%w: name %q: %s (a tenant name is 1..%d bytes of UTF-8 without a NUL)",
			ErrInvalidTenant, c.Name, NameProblem(c.Name, MaxTenantName), MaxTenantName)
	case c.QuotaPages < 0 || c.ReservedPages < 0:
		return 0, fmt.Errorf("%w: tenant %q quota %d, reservation %d must not be negative", ErrInvalidTenant, c.Name, c.QuotaPages, c.ReservedPages)
	}
	quota = c.QuotaPages
	if quota == 0 || quota > r.totalPages {
		quota = r.totalPages
	}
	if c.ReservedPages > quota {
		return 0, fmt.Errorf("%w: tenant %q reserves %d pages, above its quota of %d", ErrInvalidTenant, c.Name, c.ReservedPages, quota)
	}
	if err := validateDomainName(c.Domain); err != nil {
		return 0, err
	}
	if err := c.Sizing.Validate(); err != nil {
		return 0, fmt.Errorf("%w: tenant %q: %w", ErrInvalidTenant, c.Name, err)
	}
	return quota, nil
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
func (r *Registry) Add(c TenantConfig) (*Tenant, error) {
	quota, err := r.checkAdd(c)
	if err != nil {
		return nil, err
	}
	t := &Tenant{ID: allocator.Owner(len(r.list) + 1), Name: c.Name, Quota: quota, Reserved: c.ReservedPages, Sizing: c.Sizing}
	r.byName[c.Name] = t
	r.list = append(r.list, t)
	r.unusedReserved += t.unusedReservation()
	r.domains.assign(t, c.Domain)
	return t, nil
}

// CheckAdd returns the error Add(c) would return, and changes nothing: a
// pool that keeps one registry per cache group checks every group before
// it adds the tenant to any.
func (r *Registry) CheckAdd(c TenantConfig) error {
	_, err := r.checkAdd(c)
	return err
}

func (r *Registry) checkAdd(c TenantConfig) (quota int, err error) {
	quota, err = r.validate(c)
	if err != nil {
		return 0, err
	}
	if _, dup := r.byName[c.Name]; dup {
		return 0, fmt.Errorf("%w: %q", ErrDuplicateTenant, c.Name)
	}
	if len(r.list) >= math.MaxUint32-1 {
		return 0, fmt.Errorf("%w: too many tenants", ErrInvalidTenant)
	}
	if total := r.reservedTotal(nil) + c.ReservedPages; total > r.totalPages {
		return 0, fmt.Errorf("%w: %d pages reserved in all, pool has %d", ErrOverReserved, total, r.totalPages)
	}
	return quota, nil
}

// Update changes a tenant's quota, reservation and domain. Pages it
// already holds stay with it even above a lowered quota, and in the domain
// they were admitted in; new admissions see the new limits and domain.
func (r *Registry) Update(c TenantConfig) error {
	t, quota, err := r.checkUpdate(c)
	if err != nil {
		return err
	}
	r.unusedReserved -= t.unusedReservation()
	t.Quota, t.Reserved, t.Sizing = quota, c.ReservedPages, c.Sizing
	r.unusedReserved += t.unusedReservation()
	r.domains.assign(t, c.Domain)
	return nil
}

// CheckUpdate returns the error Update(c) would return, and changes
// nothing.
func (r *Registry) CheckUpdate(c TenantConfig) error {
	_, _, err := r.checkUpdate(c)
	return err
}

func (r *Registry) checkUpdate(c TenantConfig) (*Tenant, int, error) {
	t, err := r.Lookup(c.Name)
	if err != nil {
		return nil, 0, err
	}
	quota, err := r.validate(c)
	if err != nil {
		return nil, 0, err
	}
	if total := r.reservedTotal(t) + c.ReservedPages; total > r.totalPages {
		return nil, 0, fmt.Errorf("%w: %d pages reserved in all, pool has %d", ErrOverReserved, total, r.totalPages)
	}
	return t, quota, nil
}

// Lookup finds a tenant by name.
func (r *Registry) Lookup(name string) (*Tenant, error) {
	t, ok := r.byName[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrUnknownTenant, name)
	}
	return t, nil
}

// Tenants returns the registered tenants in registration order. The
// pointers stay owned by the registry.
func (r *Registry) Tenants() []*Tenant { return r.list }

// Uncharge returns n pages of t's usage.
func (r *Registry) Uncharge(t *Tenant, n int) {
	if n > t.Used {
		panic(fmt.Sprintf("isolation: tenant %q uncharged %d pages, holds %d", t.Name, n, t.Used))
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
			return 0, fmt.Errorf("%w: registry index broken at tenant %q", ErrCorrupt, t.Name)
		}
		if t.Used < 0 {
			return 0, fmt.Errorf("%w: tenant %q uses %d pages", ErrCorrupt, t.Name, t.Used)
		}
		used += t.Used
		unused += t.unusedReservation()
	}
	if unused != r.unusedReserved {
		return 0, fmt.Errorf("%w: unused reservations sum to %d, counter says %d", ErrCorrupt, unused, r.unusedReserved)
	}
	if err := r.checkDomains(); err != nil {
		return 0, err
	}
	return used, nil
}
