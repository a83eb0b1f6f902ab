//go:build cgo

package main

// Admission with extra key material per prompt page, and dropping the
// prefix cache (since ABI 8).

// #include "lasterror.h"
import "C"

import (
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
)

//export kvf_admit_tokens_keyed
func kvf_admit_tokens_keyed(pool C.kvf_pool, requestID, tenant *C.char, tokenIDs *C.int32_t, nTokens C.size_t,
	maxNewTokens C.int64_t, adapter *C.char, pageExtra *C.uint8_t, pageExtraEnds *C.uint64_t, nExtraPages C.size_t,
	waitMS C.int64_t, table *C.int32_t, tableLen C.size_t, tableLength *C.size_t, out *C.kvf_lease) (st C.kvf_status) {
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
	ends, err := cSlice((*uint64)(unsafe.Pointer(pageExtraEnds)), nExtraPages, "page_extra_ends")
	if err != nil {
		return fail(err)
	}
	var total C.size_t
	if len(ends) > 0 {
		total = C.size_t(min(ends[len(ends)-1], maxBufferBytes))
	}
	buf, err := cBytes(pageExtra, total, "page_extra")
	if err != nil {
		return fail(err)
	}
	extra, err := bridge.SplitPageExtra(buf, ends)
	if err != nil {
		return fail(err)
	}
	dst, err := cSlice((*int32)(unsafe.Pointer(table)), tableLen, "table")
	if err != nil {
		return fail(err)
	}
	h, n, err := bridge.AdmitTokensKeyed(uint64(pool), id, tn, toks, int64(maxNewTokens), ad, extra, waitDuration(waitMS), dst)
	if tableLength != nil {
		*tableLength = C.size_t(n)
	}
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_lease(h)
	return C.KVF_OK
}

//export kvf_pool_clear_prefix_cache
func kvf_pool_clear_prefix_cache(pool C.kvf_pool) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.ClearPrefixCache(uint64(pool)))
}
