package handoff

import (
	"errors"
	"fmt"

	"github.com/kvfence/kvfence/kvcache"
)

// Sentinel errors. Every error this package returns wraps one of them (or
// one of kvcache's); match with errors.Is. A refusal that comes back from
// the other side is a *RefusedError wrapping both ErrRefused and the
// receiver's reason.
var (
	// ErrInvalidConfig: a sender or receiver configuration that cannot work
	// (no pool, a key shorter than MinKeyBytes, negative durations).
	ErrInvalidConfig = errors.New("handoff: invalid config")
	// ErrInvalidArgument: a nil lease, export, import, receiver, transport,
	// endpoint or context. It is kvcache.ErrInvalidArgument. A caller that
	// ignores an error holds a nil result, and the incident began with an
	// engine that carried on after a refusal: such a call must come back
	// as an error the caller can log, never as a panic that takes the node
	// (and every other tenant's requests on it) down.
	ErrInvalidArgument = kvcache.ErrInvalidArgument
	// ErrMalformedManifest: bytes that are not a version-2 manifest: wrong
	// magic, version or length, a field out of range, trailing bytes.
	ErrMalformedManifest = errors.New("handoff: malformed manifest")
	// ErrBadMAC: the manifest's MAC does not verify under the shared key
	// (forged, corrupted, or signed with another key).
	ErrBadMAC = errors.New("handoff: manifest MAC does not verify")
	// ErrExpired: the manifest's expiry has passed, or lies further ahead
	// than the receiver accepts.
	ErrExpired = errors.New("handoff: manifest expired")
	// ErrGeometryMismatch: the manifest describes units of another cache
	// spec than the decode pool's: its error names the first difference
	// (SpecDifference).
	ErrGeometryMismatch = errors.New("handoff: geometry mismatch")
	// ErrShardMismatch: the manifest's units are another tensor-parallel
	// shard than the decode pool's (kvcache.CacheSpec.Shard): another
	// rank, or another number of ranks. Slicing a shard's KV across
	// tensor-parallel sizes is not done.
	ErrShardMismatch = errors.New("handoff: tensor-parallel shard mismatch")
	// ErrDomainMismatch: the manifest's sharing domain (the exporting
	// lease's) is not the one its tenant is in on the decode pool. It is
	// kvcache.ErrDomainMismatch, which the decode pool's import returns.
	ErrDomainMismatch = kvcache.ErrDomainMismatch
	// ErrReplay: a manifest for a request ID that has already been
	// imported: refused for as long as the receiver remembers the ID (the
	// manifest's expiry). One whose ID is being imported is ErrInProgress,
	// which wraps ErrReplay.
	ErrReplay = errors.New("handoff: manifest replayed")
	// ErrInProgress: a manifest for a request ID whose import is still
	// running (a concurrent duplicate, or a retry that raced the first
	// attempt's end). Unlike a replay it may succeed later, once that
	// attempt has failed, so a sender may retry. It wraps ErrReplay, which
	// is what the receiver returned for it before it had a sentinel of its
	// own: code that matches ErrReplay refuses both as it did, and code
	// that tells them apart matches ErrInProgress first. It has a wire
	// reason code of its own, which a sender that predates it reads as
	// ErrInternal, not as a replay to give up on.
	ErrInProgress = fmt.Errorf("%w while its import is in progress", ErrReplay)
	// ErrProtocol: a message out of place or malformed: data before the
	// manifest, pages out of order, a frame of another transfer, a
	// generation that differs from the manifest's.
	ErrProtocol = errors.New("handoff: protocol violation")
	// ErrTransport: the transport failed (connection dropped, peer gone).
	ErrTransport = errors.New("handoff: transport failed")
	// ErrRefused: the receiver refused the transfer; the *RefusedError
	// also wraps the receiver's reason.
	ErrRefused = errors.New("handoff: refused by receiver")
	// ErrInternal: a refusal whose reason the sender cannot map (a newer
	// receiver, or an unexpected failure on its side).
	ErrInternal = errors.New("handoff: receiver failed")
)

// reasons maps the reasons a receiver can give to wire codes. The codes
// are part of the protocol: never renumber, only append.
var reasons = []error{
	0:  nil,
	1:  ErrMalformedManifest,
	2:  ErrBadMAC,
	3:  ErrExpired,
	4:  ErrGeometryMismatch,
	5:  ErrDomainMismatch,
	6:  ErrReplay,
	7:  ErrProtocol,
	8:  ErrTransport,
	9:  kvcache.ErrIncompleteTransfer,
	10: kvcache.ErrChecksumMismatch,
	11: kvcache.ErrDuplicatePage,
	12: kvcache.ErrStaleTransfer,
	13: kvcache.ErrPoolExhausted,
	14: kvcache.ErrExceedsQuota,
	15: kvcache.ErrExceedsCapacity,
	16: kvcache.ErrExceedsMaxContext,
	17: kvcache.ErrUnknownTenant,
	18: kvcache.ErrDuplicateRequest,
	19: kvcache.ErrInvalidRequest,
	20: kvcache.ErrPoolFaulted,
	21: kvcache.ErrPoolClosed,
	22: ErrInternal,
	23: ErrInProgress,
	24: kvcache.ErrContextDone, // the receiver's context ended before the admission
	25: kvcache.ErrDevice,      // a page copy failed: the decode pool's write, the prefill pool's read
	26: kvcache.ErrReclaimed,   // the sender's pages were released before they were all sent
	27: ErrShardMismatch,
}

const (
	codeInternal   = 22
	codeInProgress = 23
)

// ReasonNames label the reasons a transfer fails, indexed like the
// RefusedBy and FailedBy counters of ReceiverStats and SenderStats (by
// the wire's reason code; 0 is no failure). They are stable metric labels.
var ReasonNames = [...]string{
	0:  "ok",
	1:  "malformed_manifest",
	2:  "bad_mac",
	3:  "expired",
	4:  "geometry_mismatch",
	5:  "domain_mismatch",
	6:  "replay",
	7:  "protocol",
	8:  "transport",
	9:  "incomplete_transfer",
	10: "checksum_mismatch",
	11: "duplicate_page",
	12: "stale_transfer",
	13: "pool_exhausted",
	14: "exceeds_quota",
	15: "exceeds_capacity",
	16: "exceeds_max_context",
	17: "unknown_tenant",
	18: "duplicate_request",
	19: "invalid_request",
	20: "pool_faulted",
	21: "pool_closed",
	22: "internal",
	23: "in_progress",
	24: "context_done",
	25: "device",
	26: "reclaimed",
	27: "shard_mismatch",
}

// ReasonName is the label of the reason err ends a transfer for: the
// receiver's reason for a *RefusedError, "internal" for an error that
// wraps none of the reasons. A nil err is "ok".
func ReasonName(err error) string { return ReasonNames[failureCode(err)] }

// failureCode is the reason code of a failed transfer as either side
// sees it.
func failureCode(err error) uint8 {
	if err == nil {
		return 0
	}
	var refused *RefusedError
	if errors.As(err, &refused) {
		err = refused.Reason
	}
	return reasonCode(err)
}

func reasonCode(err error) uint8 {
	for code, r := range reasons {
		if r != nil && errors.Is(err, r) {
			// ErrInProgress wraps ErrReplay, whose code comes first.
			if r == ErrReplay && errors.Is(err, ErrInProgress) {
				return codeInProgress
			}
			return uint8(code)
		}
	}
	return codeInternal
}

func reasonOf(code uint8) error {
	if int(code) < len(reasons) && code != 0 {
		return reasons[code]
	}
	return ErrInternal
}

// RefusedError is the receiver's refusal as the sender sees it.
type RefusedError struct {
	Reason  error  // the receiver's sentinel, e.g. ErrBadMAC, kvcache.ErrPoolExhausted
	Message string // the receiver's full error text, with its numbers
	Stage   string // "manifest" (before any page moved) or "import"
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("%v at %s: %s", ErrRefused, e.Stage, e.Message)
}

// Unwrap exposes ErrRefused and the reason to errors.Is.
func (e *RefusedError) Unwrap() []error { return []error{ErrRefused, e.Reason} }
