//go:build amd64 && !purego

package memfill

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// In fill_amd64.s.
//
//go:noescape
func fillNTSSE2(dst unsafe.Pointer, n uintptr, w uint32)

//go:noescape
func fillNTAVX2(dst unsafe.Pointer, n uintptr, w uint32)

//go:noescape
func copyNTSSE2(dst, src unsafe.Pointer, n uintptr)

//go:noescape
func copyNTAVX2(dst, src unsafe.Pointer, n uintptr)

var hasAVX2 = cpu.X86.HasAVX2

// WordsStreaming is fillWord with non-temporal stores for the aligned
// body. A scrubbed page is next written by its new owner, not read, so
// keeping it in cache only evicts useful data; streaming stores also skip
// the read-for-ownership, which roughly doubles the bandwidth of large
// fills. Go's own clear() does the same above 32 MiB.
func WordsStreaming(b []byte, w uint32) {
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	if len(b) < 512 || addr%4 != 0 {
		Words(b, w) // too small to matter, or a word pattern out of phase
		return
	}
	head := int((32 - addr%32) % 32)
	body := (len(b) - head) &^ 127
	Words(b[:head], w)
	if hasAVX2 {
		fillNTAVX2(unsafe.Pointer(&b[head]), uintptr(body), w)
	} else {
		fillNTSSE2(unsafe.Pointer(&b[head]), uintptr(body), w)
	}
	Words(b[head+body:], w)
}

// CopyStreaming is copy(dst, src) with non-temporal stores for the aligned
// body: for bytes written to memory nobody reads soon (a page just
// received, which the decode engine reads long after, from DRAM anyway).
// It skips the read-for-ownership of every destination line, a quarter
// of a large copy's memory traffic, and keeps the cache for what is read
// next. dst and src must not overlap. Under the race detector it is a
// plain copy, so that page writes stay visible to it.
func CopyStreaming(dst, src []byte) int {
	n := min(len(dst), len(src))
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(dst)))
	if n < 1024 || raceEnabled {
		return copy(dst[:n], src)
	}
	head := int((32 - addr%32) % 32)
	body := (n - head) &^ 127
	copy(dst[:head], src)
	if hasAVX2 {
		copyNTAVX2(unsafe.Pointer(&dst[head]), unsafe.Pointer(&src[head]), uintptr(body))
	} else {
		copyNTSSE2(unsafe.Pointer(&dst[head]), unsafe.Pointer(&src[head]), uintptr(body))
	}
	copy(dst[head+body:n], src[head+body:n])
	return n
}
