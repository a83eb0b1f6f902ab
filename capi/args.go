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

// maxCString is the longest C string accepted: a string is scanned for
// its NUL up to and including byte maxCString. It is the bridge's limit
// on a JSON document, so that a config the bridge would parse is never
// refused here first.
const maxCString = bridge.MaxJSONBytes

// cString returns a Go string viewing the NUL-terminated C string p,
// without copying; bridge copies what it keeps. Scanning in Go avoids a
// cgo call to strlen on the admission path.
//
// bad is the sentinel of the status kvfence.h promises for a bad value of
// this argument (KVF_ERR_INVALID_CONFIG for a config, INVALID_REQUEST for
// a request ID...): a string too long to scan is such a value, and the
// caller must get the same status as for one the bridge refuses after
// reading it. A NULL p is the boundary's own error.
func cString(p *C.char, name string, bad error) (string, error) {
	if p == nil {
		return "", fmt.Errorf("%w: %s", bridge.ErrNullPointer, name)
	}
	base := unsafe.Pointer(p)
	for n := 0; n <= maxCString; n++ {
		if *(*byte)(unsafe.Add(base, n)) == 0 {
			return unsafe.String((*byte)(base), n), nil
		}
	}
	return "", fmt.Errorf("%w: %s is longer than %d bytes (no NUL within them)", bad, name, maxCString)
}

// optString is cString for an optional argument: NULL is "".
func optString(p *C.char, name string, bad error) (string, error) {
	if p == nil {
		return "", nil
	}
	return cString(p, name, bad)
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

// cPages views the page buffer of kvf_export_read_pages or
// kvf_import_write_pages: cUnits of pages.
func cPages(p *C.uint8_t, n C.size_t, first C.int64_t, op string) ([]byte, error) {
	return cUnits(p, n, op, "page", first)
}

// cUnits views the buffer of a call that moves pages or handoff units
// (the page calls, kvf_export_read_units, kvf_import_write_unit_range,
// ...), what it moves starting at that one at. Its length says how many
// bytes to move, so, unlike cSlice, a length beyond maxBufferBytes is not
// cut down to a view of the first bytes (which could make a whole number
// of pages again): it is a range no transfer has, refused with the
// numbers before the buffer is viewed. The rest of the range is checked
// by bridge.
func cUnits(p *C.uint8_t, n C.size_t, op, what string, at C.int64_t) ([]byte, error) {
	if p != nil && uint64(n) > maxBufferBytes {
		return nil, fmt.Errorf("%w: %s of %d bytes at %s %d: more than the %d bytes one call moves",
			kvcache.ErrInvalidArgument, op, uint64(n), what, int64(at), uint64(maxBufferBytes))
	}
	return cBytes(p, n, "buf")
}

// waitDuration is a wait_ms or ttl_ms as a Duration, saturating rather
// than overflowing for waits beyond 292 years; a negative value stays
// negative, for bridge to refuse.
func waitDuration(waitMS C.int64_t) time.Duration {
	return time.Duration(min(int64(waitMS), math.MaxInt64/int64(time.Millisecond))) * time.Millisecond
}
