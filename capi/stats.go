//go:build cgo

package main

// Statistics and prefix-cache events, both as NUL-terminated JSON in a
// caller buffer.

// #include "lasterror.h"
import "C"

import (
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
)

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

//export kvf_pool_events_json
func kvf_pool_events_json(pool C.kvf_pool, buf *C.char, bufLen C.size_t, needed *C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cSlice((*byte)(unsafe.Pointer(buf)), bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	n, err := bridge.Events(uint64(pool), dst)
	if needed != nil && n > 0 {
		*needed = C.size_t(n)
	}
	return result(err)
}
