//go:build cgo

package main

// What the Go tests of this package need to call the exports directly, as
// Go functions: test files cannot use cgo, so the C types they pass are
// named here, and C memory is allocated and the last error read here.
// The library calls none of it, so the linker leaves its Go code out;
// only cgo's C trampolines for the two kvf_last_error calls remain.

/*
#include <stdlib.h>
#include "kvfence.h"
*/
import "C"

import (
	"runtime"
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
)

// The C types of the exports' parameters.
type (
	cStatus   = C.kvf_status
	cPool     = C.kvf_pool
	cLease    = C.kvf_lease
	cExport   = C.kvf_export
	cReceiver = C.kvf_receiver
	cImport   = C.kvf_import
	cWorker   = C.kvf_rank_worker
	cRegion   = C.kvf_region
	cTransfer = C.kvf_transfer_info
	cExtent   = C.kvf_handoff_extent
	cChar     = C.char
	cUint8    = C.uint8_t
	cInt32    = C.int32_t
	cInt64    = C.int64_t
	cUint64   = C.uint64_t
	cSize     = C.size_t
)

// cStrings copies each s into C memory, NUL-terminated; free releases them.
func cStrings(ss ...string) (ps []*cChar, free func()) {
	for _, s := range ss {
		ps = append(ps, C.CString(s))
	}
	return ps, func() {
		for _, p := range ps {
			C.free(unsafe.Pointer(p))
		}
	}
}

// cBuffer allocates n bytes of C memory, filled with fill; free releases
// it. The Go slice views the same memory.
func cBuffer(n int, fill byte) (p *cUint8, b []byte, free func()) {
	p = (*cUint8)(C.malloc(C.size_t(max(n, 1))))
	b = unsafe.Slice((*byte)(unsafe.Pointer(p)), n)
	for i := range b {
		b[i] = fill
	}
	return p, b, func() { C.free(unsafe.Pointer(p)) }
}

// lastError is what kvf_last_error and kvf_last_error_message report on
// the calling thread; callers hold runtime.LockOSThread across the failed
// call and this one.
func lastError() (bridge.Status, string) {
	var info C.kvf_error_info
	C.kvf_last_error(&info)
	msg := make([]byte, C.KVF_ERROR_MESSAGE_MAX)
	C.kvf_last_error_message((*C.char)(unsafe.Pointer(&msg[0])), C.size_t(len(msg)), nil)
	n := 0
	for n < len(msg) && msg[n] != 0 {
		n++
	}
	runtime.KeepAlive(msg)
	return bridge.Status(info.status), string(msg[:n])
}
