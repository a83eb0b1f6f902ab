package kvcache

import (
	"errors"
	"fmt"

	"github.com/kvfence/kvfence/isolation"
)

// Sentinel errors. Every error this package returns wraps one of them;
// match with errors.Is. Admission refusals are *AdmissionError values that
// carry the numbers behind the refusal.
var (
	// ErrInvalidConfig: a Config that cannot describe a pool (zero or
	// absurd geometry, no size, a pool larger than addressable, a bad scrub
	// policy, a device whose regions do not match the geometry).
	ErrInvalidConfig = errors.New("kvcache: invalid config")
	// ErrUndersizedPool: the pool cannot hold MaxContextTokens and the
	// config did not allow that.
	ErrUndersizedPool = errors.New("kvcache: pool cannot hold the maximum context")
	// ErrInvalidRequest: an empty or over-long ID or tenant, zero or
	// negative token counts, token counts whose sum overflows.
	ErrInvalidRequest = errors.New("kvcache: invalid request")
	// ErrUnknownTenant: the request names a tenant the pool does not know.
	ErrUnknownTenant = isolation.ErrUnknownTenant
	// ErrInvalidTenant, ErrDuplicateTenant, ErrOverReserved: AddTenant or
	// UpdateTenant (or a Config's Tenants, inside ErrInvalidConfig) was
	// given a bad tenant, one already registered, or reservations that
	// exceed the pool.
	ErrInvalidTenant   = isolation.ErrInvalidTenant
	ErrDuplicateTenant = isolation.ErrDuplicateTenant
	ErrOverReserved    = isolation.ErrOverReserved
	// ErrKeptForGrowth is the cause of an admission refused because it
	// would cut into the pages kept for the growth of running leases
	// (Config.GrowthWatermark); the refusal itself is ErrPoolExhausted.
	ErrKeptForGrowth = isolation.ErrKeptForGrowth
	// ErrDuplicateRequest: a live lease already has this request ID.
	ErrDuplicateRequest = errors.New("kvcache: request ID already has a live lease")
	// ErrExceedsMaxContext: prompt + max new tokens is above the
	// configured MaxContextTokens. Permanent.
	ErrExceedsMaxContext = errors.New("kvcache: request exceeds the maximum context")
	// ErrExceedsCapacity: the request needs more pages than the pool has
	// in service. Permanent: no release can make it fit.
	ErrExceedsCapacity = errors.New("kvcache: request exceeds pool capacity")
	// ErrExceedsQuota: the tenant's quota cannot take the request now
	// (retryable) or ever (AdmissionError.Permanent).
	ErrExceedsQuota = isolation.ErrQuotaExceeded
	// ErrPoolExhausted: not enough pages for this tenant now (too few, or
	// reserved for other tenants, or earlier admissions queue for them).
	// Retryable: Admit waits for pages until its context ends.
	ErrPoolExhausted = errors.New("kvcache: pool exhausted")
	// ErrPoolClosed: the pool has been closed.
	ErrPoolClosed = errors.New("kvcache: pool closed")
	// ErrPoolFaulted: a scrub failed or a canary audit found a freed page
	// written; every admission fails (an *AdmissionError whose Cause is
	// the fault) until the operator calls ClearFault.
	ErrPoolFaulted = errors.New("kvcache: pool faulted")
	// ErrLeaseReleased: the lease has been released.
	ErrLeaseReleased = errors.New("kvcache: lease released")
	// ErrInvalidArgument: a bad argument to a lease or pool method (a token
	// range outside the lease, a watermark going backwards).
	ErrInvalidArgument = errors.New("kvcache: invalid argument")
	// ErrScrubFailed: a fill failed on the device; its pages were retired
	// and the pool faulted.
	ErrScrubFailed = isolation.ErrScrubFailed
	// ErrCanaryMismatch: a canary audit found a freed page written. The
	// error is an *isolation.CanaryError naming the page.
	ErrCanaryMismatch = isolation.ErrCanaryMismatch
	// ErrContextDone: Admit was called with a context that had already
	// ended; nothing was attempted. The error also wraps ctx.Err().
	ErrContextDone = errors.New("kvcache: context done before admission")
	// ErrDevice: the device failed a page copy (a handoff read or write).
	// The error also wraps the device's own error.
	ErrDevice = errors.New("kvcache: device operation failed")
	// ErrTierUnsupported: a host tier (Config.HostTier) on a pool whose
	// device cannot copy pages to host memory (cudaops.HostCopier), or of
	// a pool with sliding-window or state groups without room for their
	// state checkpoints (HostTierConfig.Checkpoints). It comes wrapped in
	// ErrInvalidConfig.
	ErrTierUnsupported = errors.New("kvcache: host tier not supported")
	// ErrOnloadFailed: an admission whose prefix continued in the host
	// tier could not copy it (its pages, or the state checkpoint at its
	// end) into its pages: nothing was handed out, its pages were
	// scrubbed and the tier's copies of them dropped (an *AdmissionError,
	// retryable: the next attempt computes them).
	ErrOnloadFailed = errors.New("kvcache: copy from the host tier failed")
	// ErrOffloadFailed: a copy into the host tier failed; what it carried
	// (pages, a swap, a state checkpoint) was not kept there. No call
	// returns it: an offload rides on an eviction or a preemption that
	// succeeds without it, so it is the error of the log record and the
	// count in TierStats (OffloadsFailed, SwapsFailed, CheckpointsFailed).
	ErrOffloadFailed = errors.New("kvcache: copy into the host tier failed")
	// ErrCorrupt: Check found the pool's accounting inconsistent. It always
	// means a bug in kvfence; Check joins one such error per problem.
	ErrCorrupt = errors.New("kvcache: accounting is inconsistent")

	// Sentinels of the handoff state machine (export.go, import.go).

	// ErrLeasePhase: the lease is not in the phase the operation needs,
	// e.g. an export of a lease that has not finished prefill, or whose
	// written watermark is not its prompt.
	ErrLeasePhase = errors.New("kvcache: lease in the wrong handoff phase")
	// ErrReclaimed: an exported lease's pages were released (its reclaim
	// deadline passed, it was acknowledged, aborted, or released by the
	// engine) and can no longer be read for a transfer.
	ErrReclaimed = errors.New("kvcache: exported pages reclaimed")
	// ErrStaleTransfer: page bytes arrived for an import that has ended,
	// or for pages whose generation changed. Nothing was written.
	ErrStaleTransfer = errors.New("kvcache: stale transfer")
	// ErrDuplicatePage: an import received the same page twice.
	ErrDuplicatePage = errors.New("kvcache: page received twice")
	// ErrIncompleteTransfer: an import was completed before every page of
	// the prompt arrived (a truncated transfer).
	ErrIncompleteTransfer = errors.New("kvcache: incomplete transfer")
	// ErrChecksumMismatch: the bytes an import received do not match the
	// content checksum it was promised.
	ErrChecksumMismatch = errors.New("kvcache: transfer checksum mismatch")
	// ErrDomainMismatch: an import's KV was computed in another sharing
	// domain than the one its tenant is in on this pool (the pools are
	// configured differently, or the tenant moved since the export).
	// Nothing is imported.
	ErrDomainMismatch = errors.New("kvcache: sharing domain mismatch")
	// ErrImportPrefix: an import request carries prefix material (TokenIDs
	// or PageKeys). An import never shares pages: every page it writes is
	// its own; give the tokens to the delivered lease with AttachTokens.
	ErrImportPrefix = errors.New("kvcache: an import request carries prefix material")
	// ErrNoStateGroup: a state checkpoint of a lease in a pool whose only
	// cache group is per-token: there is no state to checkpoint.
	ErrNoStateGroup = errors.New("kvcache: the pool has no window or state group")
	// ErrCheckpointCapacity: a state checkpoint not taken because the
	// pool's or the tenant's bound on checkpoints (Prefix.MaxCheckpoints,
	// TenantConfig.MaxCheckpoints) is reached, or its groups have no units
	// for it, free or held by evictable checkpoints. It is counted and
	// logged once per tenant; the lease is unchanged.
	ErrCheckpointCapacity = errors.New("kvcache: no room for a state checkpoint")
)

// AdmissionError is a refused admission with its numbers. It wraps one of
// the sentinels above (Err) and, where a lower layer decided, its cause.
type AdmissionError struct {
	Err       error  // the sentinel: ErrExceedsCapacity, ErrPoolExhausted, …
	Cause     error  // the lower-level error, if any (e.g. isolation.ErrReserved)
	RequestID string // the refused request
	Tenant    string
	// Group names the cache group whose numbers these are, in a pool of
	// several groups (CacheSpec); empty in a pool of one. GroupKind is
	// its kind (zero with no Group).
	Group     string
	GroupKind GroupKind
	// Need, Have and Limit are in pages (slots, for a state group); for
	// ErrExceedsMaxContext in tokens. Have is what could be granted now, Limit the ceiling that
	// applies (pool pages in service, tenant quota, max context).
	Need, Have, Limit int
	// NeedTokens and LimitTokens restate capacity refusals of pages in
	// tokens; zero for a state group, whose slots hold no tokens.
	NeedTokens, LimitTokens int
}

// unit names what Need, Have and Limit count, for Error.
func (e *AdmissionError) unit() string {
	if e.GroupKind == GroupState {
		return "slots"
	}
	return "pages"
}

func (e *AdmissionError) Error() string {
	prefix := fmt.Sprintf("%v: request %q of tenant %q", e.Err, e.RequestID, e.Tenant)
	if e.Group != "" {
		prefix += fmt.Sprintf(" in cache group %q", e.Group)
	}
	switch e.Err {
	case ErrExceedsMaxContext:
		return fmt.Sprintf("%s needs %d tokens, max context is %d", prefix, e.Need, e.Limit)
	case ErrExceedsCapacity:
		if e.NeedTokens == 0 && e.LimitTokens == 0 {
			return fmt.Sprintf("%s needs %d %s, pool has %d in service", prefix, e.Need, e.unit(), e.Limit)
		}
		return fmt.Sprintf("%s needs %d %s (%d tokens), pool has %d %s (%d tokens) in service",
			prefix, e.Need, e.unit(), e.NeedTokens, e.Limit, e.unit(), e.LimitTokens)
	case ErrExceedsQuota:
		return fmt.Sprintf("%s needs %d %s, %d left of quota %d", prefix, e.Need, e.unit(), e.Have, e.Limit)
	case ErrPoolExhausted:
		msg := fmt.Sprintf("%s needs %d %s, %d grantable of %d in service", prefix, e.Need, e.unit(), e.Have, e.Limit)
		if e.Cause != nil {
			msg += " (" + e.Cause.Error() + ")"
		}
		return msg
	}
	if e.Cause != nil {
		return prefix + ": " + e.Cause.Error()
	}
	return prefix
}

// Unwrap exposes both the sentinel and the cause to errors.Is and As.
func (e *AdmissionError) Unwrap() []error {
	if e.Cause == nil {
		return []error{e.Err}
	}
	return []error{e.Err, e.Cause}
}

// Retryable reports whether the same request may succeed later without
// any configuration change: the pool or the tenant's quota was only busy.
func (e *AdmissionError) Retryable() bool {
	switch e.Err {
	case ErrPoolExhausted, ErrOnloadFailed:
		return true
	case ErrExceedsQuota:
		return e.Need <= e.Limit
	}
	return false
}

// Permanent reports whether the request can never be admitted by this
// pool as configured.
func (e *AdmissionError) Permanent() bool {
	switch e.Err {
	case ErrExceedsCapacity, ErrExceedsMaxContext:
		return true
	case ErrExceedsQuota:
		return e.Need > e.Limit
	}
	return false
}
