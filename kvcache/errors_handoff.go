package kvcache

import "errors"

// Sentinel errors of the handoff state machine (handoff.go). They live in
// their own file so that the handoff work and other work on errors.go do
// not collide; they follow the same rules as the sentinels there.
var (
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
)
