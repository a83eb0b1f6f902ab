package tenancy

import (
	"fmt"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/isolation"
)

// Domain is a sharing domain (see the package doc). Its fields are read
// and written under the owning pool's lock; ID and Name never change.
type Domain struct {
	ID      allocator.Owner
	Name    string
	Shared  bool // declared by name; false for a tenant's own domain
	Tenants int  // tenants currently in the domain
}

// domainTable indexes the domains of one registry.
type domainTable struct {
	byName map[string]*Domain
	list   []*Domain // index = ID-1
}

// lookupOrCreate returns the domain called name, creating it if needed.
func (d *domainTable) lookupOrCreate(name string, shared bool) *Domain {
	if dom, ok := d.byName[name]; ok {
		return dom
	}
	if d.byName == nil {
		d.byName = make(map[string]*Domain)
	}
	dom := &Domain{ID: allocator.Owner(len(d.list) + 1), Name: name, Shared: shared}
	d.byName[name] = dom
	d.list = append(d.list, dom)
	return dom
}

// assign puts t into the domain its configuration names (its own one when
// name is empty).
func (d *domainTable) assign(t *Tenant, name string) {
	var dom *Domain
	if name == "" {
		dom = d.lookupOrCreate(isolation.PrivateDomainPrefix+t.Name, false)
	} else {
		dom = d.lookupOrCreate(name, true)
	}
	if t.Domain == dom {
		return
	}
	if t.Domain != nil {
		t.Domain.Tenants--
	}
	dom.Tenants++
	t.Domain = dom
}

func (d *domainTable) byID(o allocator.Owner) *Domain {
	if o == 0 || int(o) > len(d.list) {
		return nil
	}
	return d.list[o-1]
}

// DomainByID returns the domain whose ID (page owner) is o, or nil.
func (r *Registry) DomainByID(o allocator.Owner) *Domain { return r.domains.byID(o) }

// Domains returns every domain ever created, in creation order (index =
// ID-1). The pointers stay owned by the registry.
func (r *Registry) Domains() []*Domain { return r.domains.list }

// checkDomains verifies the domain index and the tenant counts.
func (r *Registry) checkDomains() error {
	count := make([]int, len(r.domains.list))
	for _, t := range r.list {
		dom := t.Domain
		if dom == nil || r.domains.byID(dom.ID) != dom {
			return fmt.Errorf("%w: tenant %q is in no registered domain", isolation.ErrCorrupt, t.Name)
		}
		count[dom.ID-1]++
	}
	for i, dom := range r.domains.list {
		if dom.ID != allocator.Owner(i+1) || r.domains.byName[dom.Name] != dom {
			return fmt.Errorf("%w: domain index broken at %q", isolation.ErrCorrupt, dom.Name)
		}
		if dom.Tenants != count[i] {
			return fmt.Errorf("%w: domain %q counts %d tenants, has %d", isolation.ErrCorrupt, dom.Name, dom.Tenants, count[i])
		}
	}
	return nil
}
