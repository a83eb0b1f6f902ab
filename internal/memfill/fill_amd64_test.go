//go:build amd64 && !purego

package memfill

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
)

// Both streaming routines, at every alignment, write exactly the range.
func TestStreamingFillBothRoutines(t *testing.T) {
	saved := hasAVX2
	defer func() { hasAVX2 = saved }()
	for _, avx2 := range []bool{false, saved} {
		hasAVX2 = avx2
		for _, skew := range []int{0, 4, 8, 12, 16, 20, 28} {
			for _, n := range []int{512, 516, 1020, 4096, 4096 + 132, 65536 + 4} {
				buf := bytes.Repeat([]byte{0x77}, n+64)
				WordsStreaming(buf[skew:skew+n], 0x80008000)
				assert.Equal(t, wordBytes(0x80008000, int64(n)), buf[skew:skew+n], "avx2=%v skew=%d n=%d", avx2, skew, n)
				assert.Equal(t, bytes.Repeat([]byte{0x77}, skew), buf[:skew])
				assert.Equal(t, bytes.Repeat([]byte{0x77}, 64-skew), buf[skew+n:])
			}
		}
	}
}

// Both streaming copies, at every alignment of either side, copy exactly
// the range.
func TestStreamingCopyBothRoutines(t *testing.T) {
	saved := hasAVX2
	defer func() { hasAVX2 = saved }()
	src := make([]byte, 70000)
	for i := range src {
		src[i] = byte(i*7 + i>>8)
	}
	for _, avx2 := range []bool{false, saved} {
		hasAVX2 = avx2
		for _, dskew := range []int{0, 1, 4, 16, 31} {
			for _, sskew := range []int{0, 3, 32} {
				for _, n := range []int{0, 100, 1023, 1024, 1025, 4096 + 13, 65536 + 4} {
					buf := bytes.Repeat([]byte{0x77}, n+64)
					got := CopyStreaming(buf[dskew:dskew+n], src[sskew:sskew+n])
					assert.Equal(t, n, got)
					assert.Equal(t, src[sskew:sskew+n], buf[dskew:dskew+n], "avx2=%v dskew=%d sskew=%d n=%d", avx2, dskew, sskew, n)
					assert.Equal(t, bytes.Repeat([]byte{0x77}, dskew), buf[:dskew])
					assert.Equal(t, bytes.Repeat([]byte{0x77}, 64-dskew), buf[dskew+n:])
				}
			}
		}
	}
	// Lengths differ: the shorter one counts.
	dst := make([]byte, 2000)
	assert.Equal(t, 1500, CopyStreaming(dst, src[:1500]))
	assert.Equal(t, src[:1500], dst[:1500])
	assert.Equal(t, make([]byte, 500), dst[1500:])
}
