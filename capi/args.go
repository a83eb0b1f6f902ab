//go:build cgo

package main

// Translation of C arguments into Go values: strings, caller buffers and
// durations. Nothing here keeps a pointer to caller memory.

// #include "lasterror.h"
import "C"

import (
	"fmt"
	"math"
	"time"
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/kvcache"
)

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

// optString is cString for an optional argument: NULL is "".
func optString(p *C.char, name string) (string, error) {
	if p == nil {
		return "", nil
	}
	return cString(p, name)
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

// cBytes views a caller byte buffer; NULL only with length 0.
func cBytes(p *C.uint8_t, n C.size_t, name string) ([]byte, error) {
	return cSlice((*byte)(unsafe.Pointer(p)), n, name)
}

func waitDuration(waitMS C.int64_t) time.Duration {
	return time.Duration(min(int64(waitMS), math.MaxInt64/int64(time.Millisecond))) * time.Millisecond
}
