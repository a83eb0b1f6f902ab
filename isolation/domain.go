package isolation

import (
	"fmt"
	"strings"

	"github.com/kvfence/kvfence/allocator"
)

// Sharing domains.
//
// A Domain is the only scope inside which KV pages are ever shared (prefix
// cache, handoff). Every tenant belongs to exactly one domain at a time:
//
//   - by default its own private domain, named PrivateDomainPrefix + the
//     tenant's name, which no other tenant can join;
//   - or a shared domain the operator names in TenantConfig.Domain; every
//     tenant configured with the same name shares it (for example tenants
//     of one organisation, or a public system prompt).
//
// The domain is server-side configuration: nothing a request carries can
// choose it. Domains are never removed. A domain's ID is the
// allocator.Owner of every page its tenants hold, so the allocator's
// same-owner rule for Retain is exactly "share only inside one domain".
// Moving a tenant to another domain (Registry.Update) changes where its new
// requests look up and publish pages; pages its live leases already hold
// stay in the old domain.

// PrivateDomainPrefix starts the name of every tenant's own domain. Shared
// domain names may not start with it, so no operator-declared domain can
// alias a tenant's private one.
const PrivateDomainPrefix = "tenant:"

// Domain is a sharing domain. Its fields are read and written under the
// owning pool's lock; ID and Name never change.
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

func validateDomainName(name string) error {
	switch {
	case name == "":
		return nil
	case NameProblem(name, MaxTenantName) != "":
		return fmt.Errorf("%w: domain name %q: %s (a domain name is 1..%d bytes of UTF-8 without a NUL)",
			ErrInvalidTenant, name, NameProblem(name, MaxTenantName), MaxTenantName)
	case strings.HasPrefix(name, PrivateDomainPrefix):
		return fmt.Errorf("%w: domain name %q uses the reserved prefix %q", ErrInvalidTenant, name, PrivateDomainPrefix)
	}
	return nil
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
		dom = d.lookupOrCreate(PrivateDomainPrefix+t.Name, false)
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
			return fmt.Errorf("%w: tenant %q is in no registered domain", ErrCorrupt, t.Name)
		}
		count[dom.ID-1]++
	}
	for i, dom := range r.domains.list {
		if dom.ID != allocator.Owner(i+1) || r.domains.byName[dom.Name] != dom {
			return fmt.Errorf("%w: domain index broken at %q", ErrCorrupt, dom.Name)
		}
		if dom.Tenants != count[i] {
			return fmt.Errorf("%w: domain %q counts %d tenants, has %d", ErrCorrupt, dom.Name, dom.Tenants, count[i])
		}
	}
	return nil
}
