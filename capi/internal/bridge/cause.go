package bridge

import (
	"errors"

	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// Cause says why a pool had no pages for an admission
// (kvf_error_info.cause, since ABI 8): a KVF_ERR_POOL_EXHAUSTED refusal
// is the pool's whole supply running short, or the pages it has being
// kept for others, which tells an engine whether other tenants may still
// be admitted. The values are part of the ABI: never renumber, only add.
type Cause int32

const (
	CauseNone          Cause = 0 // no cause beyond the status
	CauseReserved      Cause = 1 // isolation.ErrReserved: the free pages are other tenants' unused reservations
	CauseKeptForGrowth Cause = 2 // isolation.ErrKeptForGrowth: the free pages are kept for running leases' growth
)

// causeOf is the Cause of an admission refusal.
func causeOf(ae *kvcache.AdmissionError) Cause {
	switch {
	case ae.Cause == nil:
		return CauseNone
	case errors.Is(ae.Cause, isolation.ErrReserved):
		return CauseReserved
	case errors.Is(ae.Cause, isolation.ErrKeptForGrowth):
		return CauseKeptForGrowth
	}
	return CauseNone
}
