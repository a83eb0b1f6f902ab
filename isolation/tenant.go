package isolation

import (
	"fmt"
	"strings"
)

// MaxTenantName bounds tenant names, which travel in errors and events.
const MaxTenantName = 256

// PrivateDomainPrefix starts the name of every tenant's own sharing
// domain. Shared domain names may not start with it, so no
// operator-declared domain can alias a tenant's private one.
const PrivateDomainPrefix = "tenant:"

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
	// its own private domain ("tenant:" + Name). See the package doc.
	Domain string
	// Sizing overrides the pool's sizing of this tenant's leases; the
	// zero value inherits it.
	Sizing Sizing
	// MaxCheckpoints bounds the state checkpoints the prefix cache keeps
	// for the tenant's requests at once, in a pool with window or state
	// groups; zero means the pool's bound.
	MaxCheckpoints int
	// TierPages is the tenant's share of the pool's host tier, in pages:
	// its sharing domain may keep there at most the sum of its tenants'
	// shares (cached pages and swapped requests), and the tier evicts the
	// domain's own least recently used pages to stay within it. Zero sets
	// no share: while one tenant of a domain sets none, the domain may use
	// the whole tier. Without a tier it bounds nothing.
	TierPages int
}

// MaxCheckpointsLimit bounds TenantConfig.MaxCheckpoints.
const MaxCheckpointsLimit = 1 << 24

// ValidateTenant checks c on its own, for a pool of poolPages pages, and
// returns the quota it resolves to (the whole pool for zero or more).
// It does not know the other tenants: a duplicate name or reservations
// beyond the pool in all are the pool's to refuse.
func ValidateTenant(c TenantConfig, poolPages int) (quota int, err error) {
	switch {
	case NameProblem(c.Name, MaxTenantName) != "":
		return 0, fmt.Errorf("%w: name %q: %s (a tenant name is 1..%d bytes of UTF-8 without a NUL)",
			ErrInvalidTenant, c.Name, NameProblem(c.Name, MaxTenantName), MaxTenantName)
	case c.QuotaPages < 0 || c.ReservedPages < 0 || c.TierPages < 0:
		return 0, fmt.Errorf("%w: tenant %q quota %d, reservation %d, tier share %d must not be negative",
			ErrInvalidTenant, c.Name, c.QuotaPages, c.ReservedPages, c.TierPages)
	case c.MaxCheckpoints < 0 || c.MaxCheckpoints > MaxCheckpointsLimit:
		return 0, fmt.Errorf("%w: tenant %q MaxCheckpoints %d, want 0..%d", ErrInvalidTenant, c.Name, c.MaxCheckpoints, MaxCheckpointsLimit)
	}
	quota = c.QuotaPages
	if quota == 0 || quota > poolPages {
		quota = poolPages
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
