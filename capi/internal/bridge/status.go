package bridge

import (
	"errors"
	"fmt"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/ucxx"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// Status is the integer every C function returns (kvf_status in
// kvfence.h). The values are part of the ABI: never renumber, only add.
type Status int32

// Status codes; kvfence.h repeats them and a test keeps both in step.
const (
	OK Status = 0

	// Errors of the C boundary itself.
	StatusInvalidArgument Status = 1 // kvcache.ErrInvalidArgument and bad C arguments
	StatusNullPointer     Status = 2
	StatusInvalidHandle   Status = 3
	StatusBufferTooSmall  Status = 4
	StatusInternal        Status = 5 // a bug in kvfence (a recovered panic)

	// Pool construction.
	StatusInvalidConfig  Status = 10
	StatusUndersizedPool Status = 11

	// Admission refusals (kvcache.AdmissionError.Err).
	StatusInvalidRequest    Status = 20
	StatusUnknownTenant     Status = 21
	StatusDuplicateRequest  Status = 22
	StatusExceedsMaxContext Status = 23
	StatusExceedsCapacity   Status = 24
	StatusExceedsQuota      Status = 25
	StatusPoolExhausted     Status = 26

	// Pool and lease state.
	StatusPoolClosed     Status = 30
	StatusPoolFaulted    Status = 31
	StatusLeaseReleased  Status = 32
	StatusScrubFailed    Status = 33
	StatusCanaryMismatch Status = 34

	// Tenant administration.
	StatusInvalidTenant   Status = 40
	StatusDuplicateTenant Status = 41
	StatusOverReserved    Status = 42

	// Devices (pool config "device").
	StatusNoDevice          Status = 50 // cudaops.ErrNoDevice: no driver or GPU; the message has the driver's reason
	StatusDeviceOutOfMemory Status = 51
	StatusDeviceFailed      Status = 52 // cudaops.ErrDriver: a driver call failed
	StatusBadOrdering       Status = 53 // cudaops.ErrBadOrdering: a release's stream or event cannot order the scrub

	// Lease phases and handoff (kvcache/phase.go, export.go, import.go; package handoff).
	StatusLeasePhase         Status = 60
	StatusReclaimed          Status = 61
	StatusStaleTransfer      Status = 62
	StatusDuplicatePage      Status = 63
	StatusIncompleteTransfer Status = 64
	StatusChecksumMismatch   Status = 65
	StatusMalformedManifest  Status = 66
	StatusBadMAC             Status = 67
	StatusManifestExpired    Status = 68
	StatusGeometryMismatch   Status = 69
	StatusDomainMismatch     Status = 70
	StatusReplay             Status = 71
	StatusInProgress         Status = 72 // handoff.ErrInProgress: the request ID is being imported; try again later
	StatusShardMismatch      Status = 73 // handoff.ErrShardMismatch: another tensor-parallel shard's KV
	StatusNoStateGroup       Status = 74 // kvcache.ErrNoStateGroup: a state checkpoint in a pool without window or state groups
	StatusCheckpointCapacity Status = 75 // kvcache.ErrCheckpointCapacity: no room for a state checkpoint (counted, logged once a tenant)

	// Transports (since ABI 11: handoffs the library moves itself, over UCX).
	StatusTransport   Status = 76 // handoff.ErrTransport: the connection failed, the peer is gone or silent
	StatusProtocol    Status = 77 // handoff.ErrProtocol: the peer broke the protocol (a forged frame, a put outside the grant)
	StatusUnavailable Status = 78 // ucxx.ErrUnavailable: the library was built without UCX

	// The host tier (since ABI 12).
	StatusTierUnsupported Status = 79 // kvcache.ErrTierUnsupported: a host tier on a pool that cannot have one
	StatusOnloadFailed    Status = 80 // kvcache.ErrOnloadFailed: an admission's copy from the host tier failed (retryable)
	StatusOffloadFailed   Status = 81 // kvcache.ErrOffloadFailed: a copy into the host tier failed (logged and counted; no call returns it today)
)

// Errors of the C boundary. Match with errors.Is.
var (
	// ErrNullPointer: a required pointer argument was NULL.
	ErrNullPointer = errors.New("kvfence: NULL pointer argument")
	// ErrInvalidHandle: zero, never issued, already destroyed or freed, or
	// a handle of the other kind.
	ErrInvalidHandle = errors.New("kvfence: invalid handle")
	// ErrBufferTooSmall: the caller's buffer cannot hold the result; the
	// error is a *BufferError with the size needed.
	ErrBufferTooSmall = errors.New("kvfence: buffer too small")
	// ErrInternal: a panic inside kvfence, recovered at the boundary.
	ErrInternal = errors.New("kvfence: internal error")
)

// BufferError reports a short caller buffer.
type BufferError struct {
	What string
	Need int // elements (or bytes, for text) the result needs
	Have int // the buffer's capacity
}

func (e *BufferError) Error() string {
	return fmt.Sprintf("%v: %s needs %d, buffer holds %d", ErrBufferTooSmall, e.What, e.Need, e.Have)
}

func (e *BufferError) Unwrap() error { return ErrBufferTooSmall }

// sentinels maps errors to statuses in priority order: an error can wrap
// several sentinels (ErrPoolFaulted wraps the ErrScrubFailed that caused
// it, ErrInvalidConfig wraps the isolation error behind it), and the
// outermost, the one the Go API documents for the call, wins.
var sentinels = []struct {
	err    error
	status Status
}{
	{ErrNullPointer, StatusNullPointer},
	{ErrInvalidHandle, StatusInvalidHandle},
	{ErrBufferTooSmall, StatusBufferTooSmall},
	{ErrInternal, StatusInternal},
	{kvcache.ErrPoolClosed, StatusPoolClosed},
	{kvcache.ErrPoolFaulted, StatusPoolFaulted},
	{kvcache.ErrLeaseReleased, StatusLeaseReleased},
	// Before ErrReplay, which it wraps: a duplicate of an import in
	// progress may be retried once that import ends, a replay never.
	{handoff.ErrInProgress, StatusInProgress},
	{handoff.ErrReplay, StatusReplay},
	{handoff.ErrBadMAC, StatusBadMAC},
	{handoff.ErrMalformedManifest, StatusMalformedManifest},
	{handoff.ErrExpired, StatusManifestExpired},
	{handoff.ErrGeometryMismatch, StatusGeometryMismatch},
	{handoff.ErrShardMismatch, StatusShardMismatch},
	{kvcache.ErrNoStateGroup, StatusNoStateGroup},
	{kvcache.ErrCheckpointCapacity, StatusCheckpointCapacity},
	{handoff.ErrDomainMismatch, StatusDomainMismatch},
	{kvcache.ErrLeasePhase, StatusLeasePhase},
	{kvcache.ErrReclaimed, StatusReclaimed},
	{kvcache.ErrStaleTransfer, StatusStaleTransfer},
	{kvcache.ErrDuplicatePage, StatusDuplicatePage},
	{kvcache.ErrIncompleteTransfer, StatusIncompleteTransfer},
	{kvcache.ErrChecksumMismatch, StatusChecksumMismatch},
	// Before ErrInvalidConfig: a pool whose regions do not fit on the
	// device wraps both.
	{cudaops.ErrOutOfMemory, StatusDeviceOutOfMemory},
	{cudaops.ErrNoDevice, StatusNoDevice},
	// Before ErrInvalidConfig, which it comes wrapped in.
	{kvcache.ErrTierUnsupported, StatusTierUnsupported},
	{kvcache.ErrOnloadFailed, StatusOnloadFailed},
	{kvcache.ErrOffloadFailed, StatusOffloadFailed},
	{kvcache.ErrUndersizedPool, StatusUndersizedPool},
	{kvcache.ErrInvalidConfig, StatusInvalidConfig},
	{handoff.ErrInvalidConfig, StatusInvalidConfig},
	{kvcache.ErrInvalidRequest, StatusInvalidRequest},
	// Before ErrInvalidArgument, which a refused ordering also wraps.
	{cudaops.ErrBadOrdering, StatusBadOrdering},
	{kvcache.ErrInvalidArgument, StatusInvalidArgument},
	{kvcache.ErrDuplicateRequest, StatusDuplicateRequest},
	{kvcache.ErrUnknownTenant, StatusUnknownTenant},
	{kvcache.ErrExceedsMaxContext, StatusExceedsMaxContext},
	{kvcache.ErrExceedsCapacity, StatusExceedsCapacity},
	{kvcache.ErrExceedsQuota, StatusExceedsQuota},
	{kvcache.ErrPoolExhausted, StatusPoolExhausted},
	{kvcache.ErrScrubFailed, StatusScrubFailed},
	{kvcache.ErrCanaryMismatch, StatusCanaryMismatch},
	{isolation.ErrInvalidTenant, StatusInvalidTenant},
	{isolation.ErrDuplicateTenant, StatusDuplicateTenant},
	{isolation.ErrOverReserved, StatusOverReserved},
	{cudaops.ErrInvalidArgument, StatusInvalidArgument},
	// A failed page copy of a handoff (it wraps the device's error).
	{kvcache.ErrDevice, StatusDeviceFailed},
	// Last: a failed fill wraps it inside ErrScrubFailed/ErrPoolFaulted.
	{cudaops.ErrDriver, StatusDeviceFailed},
	// Transports, after every reason a refusal can carry: a sender's
	// refusal names the receiver's reason, which wins.
	{ucxx.ErrUnavailable, StatusUnavailable},
	{handoff.ErrProtocol, StatusProtocol},
	{handoff.ErrTransport, StatusTransport},
}

// Info is what kvf_last_error reports besides the message.
type Info struct {
	Status    Status
	Retryable bool // the same admission may succeed later unchanged
	Permanent bool // it can never succeed on this pool as configured
	// Need, Have and Limit: pages for admission refusals (tokens for
	// ErrExceedsMaxContext), elements or bytes for a short buffer.
	Need, Have, Limit       int64
	NeedTokens, LimitTokens int64
	Cause                   Cause // why the pool had no pages (cause.go)
}

// Classify returns the status of err and the numbers it carries. A nil
// error is OK; an error wrapping no known sentinel is StatusInternal.
func Classify(err error) Info {
	if err == nil {
		return Info{Status: OK}
	}
	if ae, ok := errors.AsType[*kvcache.AdmissionError](err); ok {
		return Info{
			Status:    statusOf(ae.Err),
			Retryable: ae.Retryable(),
			Permanent: ae.Permanent(),
			Need:      int64(ae.Need), Have: int64(ae.Have), Limit: int64(ae.Limit),
			NeedTokens: int64(ae.NeedTokens), LimitTokens: int64(ae.LimitTokens),
			Cause: causeOf(ae),
		}
	}
	info := Info{Status: statusOf(err)}
	if be, ok := errors.AsType[*BufferError](err); ok {
		info.Need, info.Have, info.Limit = int64(be.Need), int64(be.Have), int64(be.Have)
	}
	return info
}

func statusOf(err error) Status {
	for _, s := range sentinels {
		if errors.Is(err, s.err) {
			return s.status
		}
	}
	return StatusInternal
}

// statusNames are the C enumerator names, for messages and tests.
var statusNames = map[Status]string{
	OK:                      "KVF_OK",
	StatusInvalidArgument:   "KVF_ERR_INVALID_ARGUMENT",
	StatusNullPointer:       "KVF_ERR_NULL_POINTER",
	StatusInvalidHandle:     "KVF_ERR_INVALID_HANDLE",
	StatusBufferTooSmall:    "KVF_ERR_BUFFER_TOO_SMALL",
	StatusInternal:          "KVF_ERR_INTERNAL",
	StatusInvalidConfig:     "KVF_ERR_INVALID_CONFIG",
	StatusUndersizedPool:    "KVF_ERR_UNDERSIZED_POOL",
	StatusInvalidRequest:    "KVF_ERR_INVALID_REQUEST",
	StatusUnknownTenant:     "KVF_ERR_UNKNOWN_TENANT",
	StatusDuplicateRequest:  "KVF_ERR_DUPLICATE_REQUEST",
	StatusExceedsMaxContext: "KVF_ERR_EXCEEDS_MAX_CONTEXT",
	StatusExceedsCapacity:   "KVF_ERR_EXCEEDS_CAPACITY",
	StatusExceedsQuota:      "KVF_ERR_EXCEEDS_QUOTA",
	StatusPoolExhausted:     "KVF_ERR_POOL_EXHAUSTED",
	StatusPoolClosed:        "KVF_ERR_POOL_CLOSED",
	StatusPoolFaulted:       "KVF_ERR_POOL_FAULTED",
	StatusLeaseReleased:     "KVF_ERR_LEASE_RELEASED",
	StatusScrubFailed:       "KVF_ERR_SCRUB_FAILED",
	StatusCanaryMismatch:    "KVF_ERR_CANARY_MISMATCH",
	StatusInvalidTenant:     "KVF_ERR_INVALID_TENANT",
	StatusDuplicateTenant:   "KVF_ERR_DUPLICATE_TENANT",
	StatusOverReserved:      "KVF_ERR_OVER_RESERVED",

	StatusNoDevice:          "KVF_ERR_NO_DEVICE",
	StatusDeviceOutOfMemory: "KVF_ERR_DEVICE_OUT_OF_MEMORY",
	StatusDeviceFailed:      "KVF_ERR_DEVICE_FAILED",
	StatusBadOrdering:       "KVF_ERR_BAD_ORDERING",

	StatusLeasePhase:         "KVF_ERR_LEASE_PHASE",
	StatusReclaimed:          "KVF_ERR_RECLAIMED",
	StatusStaleTransfer:      "KVF_ERR_STALE_TRANSFER",
	StatusDuplicatePage:      "KVF_ERR_DUPLICATE_PAGE",
	StatusIncompleteTransfer: "KVF_ERR_INCOMPLETE_TRANSFER",
	StatusChecksumMismatch:   "KVF_ERR_CHECKSUM_MISMATCH",
	StatusMalformedManifest:  "KVF_ERR_MALFORMED_MANIFEST",
	StatusBadMAC:             "KVF_ERR_BAD_MAC",
	StatusManifestExpired:    "KVF_ERR_MANIFEST_EXPIRED",
	StatusGeometryMismatch:   "KVF_ERR_GEOMETRY_MISMATCH",
	StatusDomainMismatch:     "KVF_ERR_DOMAIN_MISMATCH",
	StatusReplay:             "KVF_ERR_REPLAY",
	StatusInProgress:         "KVF_ERR_IN_PROGRESS",
	StatusShardMismatch:      "KVF_ERR_SHARD_MISMATCH",
	StatusNoStateGroup:       "KVF_ERR_NO_STATE_GROUP",
	StatusCheckpointCapacity: "KVF_ERR_CHECKPOINT_CAPACITY",
	StatusTransport:          "KVF_ERR_TRANSPORT",
	StatusProtocol:           "KVF_ERR_PROTOCOL",
	StatusUnavailable:        "KVF_ERR_UNAVAILABLE",

	StatusTierUnsupported: "KVF_ERR_TIER_UNSUPPORTED",
	StatusOnloadFailed:    "KVF_ERR_ONLOAD_FAILED",
	StatusOffloadFailed:   "KVF_ERR_OFFLOAD_FAILED",
}

// Statuses returns every status with its C name.
func Statuses() map[Status]string {
	m := make(map[Status]string, len(statusNames))
	for k, v := range statusNames {
		m[k] = v
	}
	return m
}

func (s Status) String() string {
	if n, ok := statusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("kvf_status(%d)", int32(s))
}
