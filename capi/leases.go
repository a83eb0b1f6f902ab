//go:build cgo

package main

// Leases: admission by token count, the block table and slot mapping,
// the written watermark, release and free, and the lease phases of ABI 2.

// #include "lasterror.h"
import "C"

import (
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

//export kvf_admit
func kvf_admit(pool C.kvf_pool, requestID, tenant *C.char, promptTokens, maxNewTokens, waitMS C.int64_t, out *C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	id, err := cString(requestID, "request_id", kvcache.ErrInvalidRequest)
	if err != nil {
		return fail(err)
	}
	tn, err := cString(tenant, "tenant", kvcache.ErrInvalidRequest)
	if err != nil {
		return fail(err)
	}
	h, err := bridge.Admit(uint64(pool), id, tn, int64(promptTokens), int64(maxNewTokens), waitDuration(waitMS))
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_lease(h)
	return C.KVF_OK
}

//export kvf_lease_block_table
func kvf_lease_block_table(lease C.kvf_lease, buf *C.int32_t, bufLen C.size_t, length *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cSlice((*int32)(unsafe.Pointer(buf)), bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	n, err := bridge.BlockTable(uint64(lease), dst)
	if length != nil {
		*length = C.size_t(n)
	}
	return result(err)
}

//export kvf_lease_slot_mapping
func kvf_lease_slot_mapping(lease C.kvf_lease, start, end C.int64_t, buf *C.int64_t, bufLen C.size_t, length *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cSlice((*int64)(unsafe.Pointer(buf)), bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	n, err := bridge.SlotMapping(uint64(lease), int64(start), int64(end), dst)
	if length != nil {
		*length = C.size_t(n)
	}
	return result(err)
}

//export kvf_lease_commit
func kvf_lease_commit(lease C.kvf_lease, tokens C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.Commit(uint64(lease), int64(tokens)))
}

//export kvf_lease_describe
func kvf_lease_describe(lease C.kvf_lease, out *C.kvf_lease_info) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	li, err := bridge.DescribeLease(uint64(lease))
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_lease_info{
		pages:           C.int64_t(li.Pages),
		capacity_tokens: C.int64_t(li.CapacityTokens),
		prompt_tokens:   C.int64_t(li.PromptTokens),
		max_new_tokens:  C.int64_t(li.MaxNewTokens),
		written_tokens:  C.int64_t(li.Written),
	}
	if li.Live {
		out.live = 1
	}
	return C.KVF_OK
}

//export kvf_lease_release
func kvf_lease_release(lease C.kvf_lease, stream, event C.uintptr_t) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.Release(uint64(lease), cudaops.Ordering{Stream: uintptr(stream), Event: uintptr(event)}))
}

//export kvf_lease_free
func kvf_lease_free(lease C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.Free(uint64(lease)))
}

//export kvf_lease_phase
func kvf_lease_phase(lease C.kvf_lease, out *C.int32_t) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	ph, err := bridge.Phase(uint64(lease))
	if err != nil {
		return fail(err)
	}
	*out = C.int32_t(ph)
	return C.KVF_OK
}

//export kvf_lease_begin_prefill
func kvf_lease_begin_prefill(lease C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.BeginPrefill(uint64(lease)))
}

//export kvf_lease_finish_prefill
func kvf_lease_finish_prefill(lease C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.FinishPrefill(uint64(lease)))
}

//export kvf_lease_abort
func kvf_lease_abort(lease C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.Abort(uint64(lease)))
}

// Growth and preemption (since ABI 3).

//export kvf_lease_grow
func kvf_lease_grow(lease C.kvf_lease, tokens, waitMS C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.Grow(uint64(lease), int64(tokens), waitDuration(waitMS)))
}

//export kvf_lease_preempt
func kvf_lease_preempt(lease C.kvf_lease, tokenIDs *C.int32_t, nTokens C.size_t, keptTokens *C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	toks, err := cSlice((*int32)(unsafe.Pointer(tokenIDs)), nTokens, "token_ids")
	if err != nil {
		return fail(err)
	}
	kept, err := bridge.Preempt(uint64(lease), toks)
	if keptTokens != nil {
		*keptTokens = C.int64_t(kept)
	}
	return result(err)
}

// Cache groups (since ABI 4).

//export kvf_lease_group_table
func kvf_lease_group_table(lease C.kvf_lease, group *C.char, buf *C.int32_t, bufLen C.size_t, length *C.size_t, firstPage *C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	name, err := cString(group, "group", kvcache.ErrInvalidArgument)
	if err != nil {
		return fail(err)
	}
	dst, err := cSlice((*int32)(unsafe.Pointer(buf)), bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	n, first, err := bridge.GroupTable(uint64(lease), name, dst)
	if length != nil {
		*length = C.size_t(n)
	}
	if firstPage != nil {
		*firstPage = C.int64_t(first)
	}
	return result(err)
}

//export kvf_lease_slide_windows
func kvf_lease_slide_windows(lease C.kvf_lease, stream, event C.uintptr_t, scrubbed *C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	n, err := bridge.SlideWindows(uint64(lease), cudaops.Ordering{Stream: uintptr(stream), Event: uintptr(event)})
	if scrubbed != nil {
		*scrubbed = C.int64_t(n)
	}
	return result(err)
}
