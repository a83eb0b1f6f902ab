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
