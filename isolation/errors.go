package isolation

import (
	"errors"
	"fmt"
)

// Sentinel errors. Match with errors.Is.
var (
	// ErrInvalidTenant: an empty or over-long tenant name, a negative
	// quota or reservation, a reservation above the quota.
	ErrInvalidTenant = errors.New("isolation: invalid tenant configuration")
	// ErrDuplicateTenant: a tenant of that name is already registered.
	ErrDuplicateTenant = errors.New("isolation: tenant already registered")
	// ErrUnknownTenant: no tenant of that name.
	ErrUnknownTenant = errors.New("isolation: unknown tenant")
	// ErrQuotaExceeded: the tenant's pages in use plus the request would
	// pass its quota.
	ErrQuotaExceeded = errors.New("isolation: tenant quota exceeded")
	// ErrReserved: free pages exist, but they are reserved for other
	// tenants.
	ErrReserved = errors.New("isolation: free pages are reserved for other tenants")
	// ErrKeptForGrowth: free pages exist, but they are kept for the growth
	// of running leases (the pool's growth watermark).
	ErrKeptForGrowth = errors.New("isolation: free pages are kept for the growth of running leases")
	// ErrOverReserved: reservations would exceed the pool.
	ErrOverReserved = errors.New("isolation: reservations exceed the pool")
	// ErrInvalidSizing: an unknown sizing mode, or a headroom out of range
	// or given without on-demand sizing. It arrives inside the error of
	// what carried the sizing (a tenant, a request, a pool's config).
	ErrInvalidSizing = errors.New("isolation: invalid lease sizing")
	// ErrInvalidPolicy: an unknown scrub kind or dtype, or a poison pattern
	// wider than the dtype.
	ErrInvalidPolicy = errors.New("isolation: invalid scrub policy")
	// ErrNonFinitePattern: a poison pattern that is NaN or Inf in the KV
	// dtype (0 × NaN = NaN spreads through masked attention).
	ErrNonFinitePattern = errors.New("isolation: scrub pattern is not a finite number in the KV dtype")
	// ErrScrubFailed: a fill failed on the device; its pages are retired.
	ErrScrubFailed = errors.New("isolation: scrub failed")
	// ErrCanaryMismatch: a freed page was written before its next
	// allocation (a use after free somewhere in the engine).
	ErrCanaryMismatch = errors.New("isolation: canary mismatch on a freed page")
	// ErrCorrupt: a Check found the accounting inconsistent. It always
	// means a bug in kvfence.
	ErrCorrupt = errors.New("isolation: accounting is inconsistent")
)

// QuotaError reports a tenant's limit with the numbers behind it.
type QuotaError struct {
	Err    error // ErrQuotaExceeded, ErrReserved or ErrKeptForGrowth
	Tenant string
	Need   int // pages the request needs
	Have   int // pages the tenant could still get now
	Limit  int // the tenant's quota (ErrQuotaExceeded) or the pool's free pages (ErrReserved)
}

func (e *QuotaError) Error() string {
	switch e.Err {
	case ErrReserved:
		return fmt.Sprintf("%v: tenant %q needs %d pages, %d of %d free pages are not reserved for others",
			e.Err, e.Tenant, e.Need, e.Have, e.Limit)
	case ErrKeptForGrowth:
		return fmt.Sprintf("%v: tenant %q needs %d pages, %d of %d free pages are not kept for growth",
			e.Err, e.Tenant, e.Need, e.Have, e.Limit)
	}
	return fmt.Sprintf("%v: tenant %q needs %d pages, has %d left of its quota of %d", e.Err, e.Tenant, e.Need, e.Have, e.Limit)
}

func (e *QuotaError) Unwrap() error { return e.Err }

// Permanent reports whether the request could never fit, whatever is
// released.
func (e *QuotaError) Permanent() bool { return e.Err == ErrQuotaExceeded && e.Need > e.Limit }

// CanaryError names the page a canary audit found written after free.
type CanaryError struct {
	Page      int32
	Region    int
	Offset    int64 // byte offset of the first wrong word inside the page
	Want, Got uint32
	PrevOwner string // sharing domain whose tenants last held the page
	Gen       uint32 // the page's generation when it was scrubbed
}

func (e *CanaryError) Error() string {
	return fmt.Sprintf("%v: page %d (generation %d, last owner domain %q) region %d offset %d holds %#08x, canary is %#08x",
		ErrCanaryMismatch, e.Page, e.Gen, e.PrevOwner, e.Region, e.Offset, e.Got, e.Want)
}

func (e *CanaryError) Unwrap() error { return ErrCanaryMismatch }
