package memfill

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
)

func wordBytes(w uint32, n int64) []byte {
	b := make([]byte, n)
	for i := int64(0); i < n; i += 4 {
		binary.LittleEndian.PutUint32(b[i:], w)
	}
	return b
}

func TestWordsAllSizes(t *testing.T) {
	for _, fill := range []func([]byte, uint32){Words, WordsStreaming} {
		for _, n := range []int{0, 4, 8, 60, 64, 68, 508, 512, 4092, 4096, 4100, 3*4096 + 12} {
			for _, w := range []uint32{0, 0x80008000, 0xdeadbeef} {
				b := bytes.Repeat([]byte{0x5a}, n+8)
				fill(b[4:4+n], w)
				assert.Equal(t, wordBytes(w, int64(n)), b[4:4+n], "n=%d w=%#x", n, w)
				assert.Equal(t, []byte{0x5a, 0x5a, 0x5a, 0x5a}, b[:4], "wrote before the range")
				assert.Equal(t, []byte{0x5a, 0x5a, 0x5a, 0x5a}, b[4+n:], "wrote past the range")
			}
		}
	}
}
