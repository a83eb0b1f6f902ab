//go:build cgo

package main

// Errors at the boundary: every export returns a kvf_status, records the
// calling thread's last error on failure, and recovers its own panics.

// The #cgo directive below is the package's: cgo applies every file's
// CFLAGS to all of them, so the other files' preambles only include
// lasterror.h (the types of kvfence.h and kvf__set_last_error).

/*
#cgo CFLAGS: -I${SRCDIR}/include -I${SRCDIR}
#include "lasterror.h"
*/
import "C"

import (
	"fmt"
	"unicode/utf8"
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
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
		cause:        C.int32_t(info.Cause),
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
