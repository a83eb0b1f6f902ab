//go:build cgo

package main

// The prefix cache: admission by token IDs (with the block table in the
// same call, since ABI 6), the hit, publishing a lease's prompt pages,
// and state checkpoints (since ABI 10).

// #include "lasterror.h"
import "C"

import (
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// tokenAdmission converts the arguments both token admissions share, in
// the order their errors are reported.
func tokenAdmission(requestID, tenant, adapter *C.char, tokenIDs *C.int32_t, nTokens C.size_t) (id, tn, ad string, toks []int32, err error) {
	if id, err = cString(requestID, "request_id", kvcache.ErrInvalidRequest); err != nil {
		return
	}
	if tn, err = cString(tenant, "tenant", kvcache.ErrInvalidRequest); err != nil {
		return
	}
	if ad, err = optString(adapter, "adapter", kvcache.ErrInvalidRequest); err != nil {
		return
	}
	toks, err = cSlice((*int32)(unsafe.Pointer(tokenIDs)), nTokens, "token_ids")
	return
}

//export kvf_admit_tokens
func kvf_admit_tokens(pool C.kvf_pool, requestID, tenant *C.char, tokenIDs *C.int32_t, nTokens C.size_t,
	maxNewTokens C.int64_t, adapter *C.char, waitMS C.int64_t, out *C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	id, tn, ad, toks, err := tokenAdmission(requestID, tenant, adapter, tokenIDs, nTokens)
	if err != nil {
		return fail(err)
	}
	h, err := bridge.AdmitTokens(uint64(pool), id, tn, toks, int64(maxNewTokens), ad, waitDuration(waitMS))
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_lease(h)
	return C.KVF_OK
}

// Admission with the block table in the same call (since ABI 6).

//export kvf_admit_tokens_table
func kvf_admit_tokens_table(pool C.kvf_pool, requestID, tenant *C.char, tokenIDs *C.int32_t, nTokens C.size_t,
	maxNewTokens C.int64_t, adapter *C.char, waitMS C.int64_t, table *C.int32_t, tableLen C.size_t,
	tableLength *C.size_t, out *C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	if tableLength != nil {
		*tableLength = 0
	}
	if out == nil {
		return nullPointer("out")
	}
	id, tn, ad, toks, err := tokenAdmission(requestID, tenant, adapter, tokenIDs, nTokens)
	if err != nil {
		return fail(err)
	}
	dst, err := cSlice((*int32)(unsafe.Pointer(table)), tableLen, "table")
	if err != nil {
		return fail(err)
	}
	h, n, err := bridge.AdmitTokensTable(uint64(pool), id, tn, toks, int64(maxNewTokens), ad, waitDuration(waitMS), dst)
	if tableLength != nil {
		*tableLength = C.size_t(n)
	}
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_lease(h)
	return C.KVF_OK
}

//export kvf_lease_hit_tokens
func kvf_lease_hit_tokens(lease C.kvf_lease, out *C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	n, err := bridge.HitTokens(uint64(lease))
	if err != nil {
		return fail(err)
	}
	*out = C.int64_t(n)
	return C.KVF_OK
}

//export kvf_lease_cache_prefix
func kvf_lease_cache_prefix(lease C.kvf_lease, tokens C.int64_t, sharedTokens *C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	n, err := bridge.CachePrefix(uint64(lease), int64(tokens))
	if err != nil {
		return fail(err)
	}
	if sharedTokens != nil {
		*sharedTokens = C.int64_t(n)
	}
	return C.KVF_OK
}

// State checkpoints (since ABI 10): a pool with window or state groups
// shares a prefix with the state at its end.

//export kvf_lease_checkpoint_state
func kvf_lease_checkpoint_state(lease C.kvf_lease, tokens C.int64_t, stream, event C.uintptr_t) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.CheckpointState(uint64(lease), int64(tokens), cudaops.Ordering{Stream: uintptr(stream), Event: uintptr(event)}))
}

//export kvf_lease_prefill_checkpoint
func kvf_lease_prefill_checkpoint(lease C.kvf_lease, out *C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	n, err := bridge.PrefillCheckpoint(uint64(lease))
	if err != nil {
		return fail(err)
	}
	*out = C.int64_t(n)
	return C.KVF_OK
}
