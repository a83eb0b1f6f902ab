//go:build cgo

package main

// Pools: creation, destruction, the accounting check, faults and the
// device regions (kvfence.h, "Pools").

// #include "lasterror.h"
import "C"

import (
	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

//export kvf_pool_create
func kvf_pool_create(configJSON *C.char, out *C.kvf_pool) (st C.kvf_status) {
	defer guard(&st)
	if out == nil {
		return nullPointer("out")
	}
	cfg, err := cString(configJSON, "config_json", kvcache.ErrInvalidConfig)
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

//export kvf_pool_regions
func kvf_pool_regions(pool C.kvf_pool, buf *C.kvf_region, bufLen C.size_t, length *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cSlice(buf, bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	// The Go copy has room for the pool's regions, not for buf_len of
	// them: buf_len may be anything up to SIZE_MAX. The first call only
	// counts them (a nil buffer is short unless there are none); the
	// second reports a bad handle or a short buffer.
	n, _ := bridge.Regions(uint64(pool), nil)
	rs := make([]cudaops.Region, min(n, len(dst)))
	n, err = bridge.Regions(uint64(pool), rs)
	if length != nil && n > 0 {
		*length = C.size_t(n)
	}
	if err != nil {
		return fail(err)
	}
	for i, r := range rs[:n] {
		dst[i] = C.kvf_region{base: C.uint64_t(r.Base), stride: C.int64_t(r.Stride), page_bytes: C.int64_t(r.PageBytes), pages: C.int64_t(r.Pages)}
	}
	return C.KVF_OK
}
