// Package memfill writes host memory as fast as the machine allows: a
// repeated 32-bit word over byte slices (the host backend's fill
// primitive), and copies with streaming stores (its write path for
// received pages). It is kept apart from cudaops because Go assembly and
// cgo cannot share a package.
package memfill

import (
	"encoding/binary"
	"sync"
)

// patternBlock is the size of the pattern copied for non-zero words: small
// enough to stay in L1, large enough that copy runs at full speed.
const patternBlock = 4096

var patternPool = sync.Pool{New: func() any { return new([patternBlock]byte) }}

// Words writes w (little-endian) over b; len(b) is a multiple of 4.
func Words(b []byte, w uint32) {
	if w == 0 {
		clear(b)
		return
	}
	if len(b) <= 64 {
		for i := 0; i+4 <= len(b); i += 4 {
			binary.LittleEndian.PutUint32(b[i:], w)
		}
		return
	}
	blk := patternPool.Get().(*[patternBlock]byte)
	for i := 0; i < patternBlock; i += 4 {
		binary.LittleEndian.PutUint32(blk[i:], w)
	}
	for len(b) > 0 {
		b = b[copy(b, blk[:]):]
	}
	patternPool.Put(blk)
}
