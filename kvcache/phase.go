package kvcache

// Handoff: the page-level half of disaggregated prefill → decode.
//
// A lease moves through phases that say what its pages hold:
//
//	admitted ──BeginPrefill──▶ prefilling ──FinishPrefill──▶ prefilled ──Export──▶ exported ──Ack──▶ released
//	   │                           │       (written = prompt)     │                     │
//	   └───────────────────────────┴────────── Abort ─────────────┴─────────────────────┴──▶ aborted
//	                                                            (reclaim deadline = Abort)
//
// and, on the decode side, an import:
//
//	BeginImport: admitted fail-closed ──▶ importing ──every page written, checksum matches──▶ prefilled
//	                                          └──────────── any failure, Abort ─────────────▶ aborted
//
// This file holds the phases; export.go the prefill side (Outgoing),
// import.go the decode side (Incoming), checksum.go the content checksum.
//
// Invariants:
//
//   - Only a prefilled lease (written watermark = prompt tokens) can be
//     exported. A refused request has no lease, so there is nothing to
//     export: no placeholder can travel.
//   - An exported lease takes no writes: Export seals its watermark at the
//     prompt, and Commit and SlotMapping then fail with ErrLeasePhase, so
//     every read of the pages, for the checksum or for the transfer,
//     sees the same bytes. An import's lease is sealed until Complete,
//     which leaves the decode lease open to commits of generated tokens.
//   - An import is admitted only in the sharing domain its KV was computed
//     in (the exporting lease's, Outgoing.Domain): BeginImport refuses with
//     ErrDomainMismatch when the tenant is in another domain here, before
//     and in the admission. The decode lease then belongs to that domain
//     and, given its tokens (AttachTokens), publishes there like any lease.
//   - Each export and each import belongs to one incarnation of its Lease
//     (Lease.seq, numbered at admission): a Lease released and admitted
//     again is another incarnation, and a stale Outgoing or Incoming can
//     do nothing to it. The end of a lease stops its export's reclaim
//     timer.
//   - An import never shares a page: its request may carry no prefix
//     material (ErrImportPrefix), and every page it writes must be held by
//     its lease alone and published nowhere.
//   - An exported lease's pages are read only while the lease still holds
//     them: each read checks, under Pool.mu, that the lease is exported,
//     still this export's incarnation, and that every page is at the
//     handle's generation, and pins the lease for the copy,
//     which then runs without the lock. Every release of a lease waits
//     for its pins and refuses new ones from when it starts (drainLocked),
//     so no read overlaps a release, and no byte of a reused page is ever
//     sent.
//   - An importing lease is never handed out: BeginImport returns an
//     *Incoming, not the *Lease. The Lease exists (its pages are in use,
//     charged to the tenant, counted by Check) but no engine can see its
//     block table until Complete has verified that every page arrived and
//     the content checksum matches. Any failure aborts the import: the
//     pages go through the scrubber.
//   - Writes into an import check, under Pool.mu, that the import is live
//     and each page still at its generation, and pin it as reads do, so a
//     late (stale) transfer never lands in a page that was released and
//     reused (a stale transfer landing in a reused page is a known
//     failure of disaggregated engines).

import (
	"errors"
	"fmt"

	"github.com/kvfence/kvfence/cudaops"
)

// Phase is a lease's place in the handoff state machine.
type Phase uint32

const (
	PhaseAdmitted   Phase = iota // admitted, nothing written yet
	PhasePrefilling              // the engine is writing the prompt's KV
	PhasePrefilled               // the prompt's KV is complete: written = prompt tokens
	PhaseExported                // pinned for a transfer; released on ack or at the reclaim deadline
	PhaseImporting               // decode side: receiving page bytes; not usable
	PhaseReleased                // ended normally
	PhaseAborted                 // ended by a failure, an abort or the reclaim deadline
)

var phaseNames = [...]string{"admitted", "prefilling", "prefilled", "exported", "importing", "released", "aborted"}

func (ph Phase) String() string {
	if int(ph) < len(phaseNames) {
		return phaseNames[ph]
	}
	return fmt.Sprintf("Phase(%d)", uint32(ph))
}

// Phase returns the lease's handoff phase: PhaseAdmitted for a nil or
// zero Lease.
func (l *Lease) Phase() Phase {
	if l == nil {
		return PhaseAdmitted
	}
	ph := Phase(l.phase.Load())
	switch l.state.Load() {
	case leaseLive:
		return ph
	case leaseReleased:
		if ph == PhaseAborted {
			return ph
		}
		return PhaseReleased
	}
	return PhaseAdmitted
}

// advance moves a live lease from one phase to the next.
func (l *Lease) advance(from, to Phase) error {
	if err := l.live(); err != nil {
		return err
	}
	if !l.phase.CompareAndSwap(uint32(from), uint32(to)) {
		return fmt.Errorf("%w: lease %q is %v, %v needs %v", ErrLeasePhase, l.id, l.Phase(), to, from)
	}
	return nil
}

// BeginPrefill records that the engine starts writing the prompt's KV.
func (l *Lease) BeginPrefill() error { return l.advance(PhaseAdmitted, PhasePrefilling) }

// FinishPrefill records that prefill is complete. The written watermark
// must equal the prompt: a prefill that stopped short (or a placeholder
// that wrote one token) cannot become exportable.
func (l *Lease) FinishPrefill() error {
	if err := l.live(); err != nil {
		return err
	}
	if w := l.Written(); w != l.prompt {
		return fmt.Errorf("%w: lease %q has %d of %d prompt tokens written", ErrLeasePhase, l.id, w, l.prompt)
	}
	return l.advance(PhasePrefilling, PhasePrefilled)
}

// Abort ends the lease from any phase, releasing its pages through the
// scrubber, and records it as aborted.
func (l *Lease) Abort() error {
	if err := l.live(); err != nil && !errors.Is(err, ErrLeaseReleased) {
		return err
	}
	ended, err := l.pool.endLease(l, nil, PhaseAborted, cudaops.Ordering{})
	if err == nil && !ended {
		return ErrLeaseReleased
	}
	return err
}

// importing reports whether the lease is an import still receiving pages.
func (l *Lease) importing() bool { return Phase(l.phase.Load()) == PhaseImporting }
