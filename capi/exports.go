//go:build cgo

package main

/*
#cgo CFLAGS: -I${SRCDIR}/include -I${SRCDIR}
#include "lasterror.h"
*/
import "C"

import (
	"fmt"
	"math"
	"time"
	"unicode/utf8"
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// fail records err as the calling thread's last error and returns its
// status.
func fail(err error) C.kvf_status {
	info := bridge.Classify(err)
	ci := C.kvf_error_info{
		status:       C.kvf_status(info.Status),
		need:         C.int64_t(info.Need),
		have:         C.int64_t(info.Have),
		limit:        C.int64_t(info.Limit),
		need_tokens:  C.int64_t(info.NeedTokens),
		limit_tokens: C.int64_t(info.LimitTokens),
	}
	if info.Retryable {
		ci.retryable = 1
	}
	if info.Permanent {
		ci.permanent = 1
	}
	msg := info.Status.String() + ": " + err.Error()
	if len(msg) > C.KVF_ERROR_MESSAGE_MAX-1 {
		cut := C.KVF_ERROR_MESSAGE_MAX - 1
		for cut > 0 && !utf8.RuneStart(msg[cut]) {
			cut--
		}
		msg = msg[:cut]
	}
	C.kvf__set_last_error(&ci, (*C.char)(unsafe.Pointer(unsafe.StringData(msg))), C.size_t(len(msg)))
	return ci.status
}

// result turns a Go error into the status a C function returns.
func result(err error) C.kvf_status {
	if err != nil {
		return fail(err)
	}
	return C.KVF_OK
}

// guard turns a panic into KVF_ERR_INTERNAL: a C caller cannot survive a
// Go panic unwinding through its frames. Deferred by every export.
func guard(st *C.kvf_status) {
	if r := recover(); r != nil {
		*st = fail(fmt.Errorf("%w: panic: %v", bridge.ErrInternal, r))
	}
}

func nullPointer(name string) C.kvf_status {
	return fail(fmt.Errorf("%w: %s", bridge.ErrNullPointer, name))
}

// maxCString bounds how far a C string is scanned for its NUL.
const maxCString = 1 << 20

// cString returns a Go string viewing the NUL-terminated C string p,
// without copying; bridge copies what it keeps. Scanning in Go avoids a
// cgo call to strlen on the admission path.
func cString(p *C.char, name string) (string, error) {
	if p == nil {
		return "", fmt.Errorf("%w: %s", bridge.ErrNullPointer, name)
	}
	base := unsafe.Pointer(p)
	for n := 0; n < maxCString; n++ {
		if *(*byte)(unsafe.Add(base, n)) == 0 {
			return unsafe.String((*byte)(base), n), nil
		}
	}
	return "", fmt.Errorf("%w: %s is not NUL-terminated within %d bytes", kvcache.ErrInvalidArgument, name, maxCString)
}

// maxBufferBytes caps the Go view of a caller buffer: kvfence never
// writes more than a lease's pages or slots, far below this.
const maxBufferBytes = 1 << 40

// cSlice views a caller buffer of n elements; NULL is allowed only with
// n = 0.
func cSlice[T any](p *T, n C.size_t, name string) ([]T, error) {
	if p == nil {
		if n != 0 {
			return nil, fmt.Errorf("%w: %s with length %d", bridge.ErrNullPointer, name, n)
		}
		return nil, nil
	}
	limit := uint64(maxBufferBytes / unsafe.Sizeof(*p))
	return unsafe.Slice(p, min(uint64(n), limit)), nil
}

//export kvf_pool_create
func kvf_pool_create(configJSON *C.char, out *C.kvf_pool) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	cfg, err := cString(configJSON, "config_json")
	if err != nil {
		return fail(err)
	}
	h, err := bridge.CreatePool([]byte(cfg))
	if err != nil {
		return fail(err)
	}
	*out = C.kvf_pool(h)
	return C.KVF_OK
}

//export kvf_pool_destroy
func kvf_pool_destroy(pool C.kvf_pool) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.DestroyPool(uint64(pool)))
}

func tenantConfig(name *C.char, quota, reserved C.int64_t) (kvcache.TenantConfig, error) {
	n, err := cString(name, "name")
	if err != nil {
		return kvcache.TenantConfig{}, err
	}
	// Out-of-range counts become -1, which the registry refuses with its
	// own error.
	clamp := func(v C.int64_t) int {
		if v < 0 || int64(v) > math.MaxInt32 {
			return -1
		}
		return int(v)
	}
	return kvcache.TenantConfig{Name: n, QuotaPages: clamp(quota), ReservedPages: clamp(reserved)}, nil
}

//export kvf_pool_add_tenant
func kvf_pool_add_tenant(pool C.kvf_pool, name *C.char, quotaPages, reservedPages C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	tc, err := tenantConfig(name, quotaPages, reservedPages)
	if err != nil {
		return fail(err)
	}
	return result(bridge.AddTenant(uint64(pool), tc))
}

//export kvf_pool_update_tenant
func kvf_pool_update_tenant(pool C.kvf_pool, name *C.char, quotaPages, reservedPages C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	tc, err := tenantConfig(name, quotaPages, reservedPages)
	if err != nil {
		return fail(err)
	}
	return result(bridge.UpdateTenantKeepDomain(uint64(pool), tc))
}

//export kvf_pool_stats_json
func kvf_pool_stats_json(pool C.kvf_pool, buf *C.char, bufLen C.size_t, needed *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cSlice((*byte)(unsafe.Pointer(buf)), bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	js, err := bridge.StatsJSON(uint64(pool))
	if err != nil {
		return fail(err)
	}
	if needed != nil {
		*needed = C.size_t(len(js) + 1)
	}
	if len(dst) < len(js)+1 {
		return fail(&bridge.BufferError{What: "stats JSON (bytes, NUL included)", Need: len(js) + 1, Have: len(dst)})
	}
	dst[copy(dst, js)] = 0
	return C.KVF_OK
}

//export kvf_pool_check
func kvf_pool_check(pool C.kvf_pool) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.Check(uint64(pool)))
}

//export kvf_pool_clear_fault
func kvf_pool_clear_fault(pool C.kvf_pool) (st C.kvf_status) {
	defer guard(&st)
	return result(bridge.ClearFault(uint64(pool)))
}

//export kvf_admit
func kvf_admit(pool C.kvf_pool, requestID, tenant *C.char, promptTokens, maxNewTokens, waitMS C.int64_t, out *C.kvf_lease) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	id, err := cString(requestID, "request_id")
	if err != nil {
		return fail(err)
	}
	tn, err := cString(tenant, "tenant")
	if err != nil {
		return fail(err)
	}
	wait := time.Duration(min(int64(waitMS), math.MaxInt64/int64(time.Millisecond))) * time.Millisecond
	h, err := bridge.Admit(uint64(pool), id, tn, int64(promptTokens), int64(maxNewTokens), wait)
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
