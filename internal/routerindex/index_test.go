package routerindex

import (
	"bytes"
	"testing"
)

// TestCBORIsCanonical: the heads take their shortest forms and the
// payload of a block is [parent, tokens, extra] as canonical CBOR writes
// it (RFC 8949, section 4.2.1).
func TestCBORIsCanonical(t *testing.T) {
	for _, tc := range []struct {
		n    uint64
		want []byte
	}{
		{0, []byte{0x00}}, {23, []byte{0x17}}, {24, []byte{0x18, 24}}, {255, []byte{0x18, 0xff}},
		{256, []byte{0x19, 1, 0}}, {65536, []byte{0x1a, 0, 1, 0, 0}}, {1 << 32, []byte{0x1b, 0, 0, 0, 1, 0, 0, 0, 0}},
	} {
		if got := cborHead(nil, 0, tc.n); !bytes.Equal(got, tc.want) {
			t.Errorf("head of %d: % x, want % x", tc.n, got, tc.want)
		}
	}
	// [1, [2, 3], [{"Hash": "s"}]]
	want := []byte{0x83, 0x01, 0x82, 0x02, 0x03, 0x81, 0xa1, 0x64, 'H', 'a', 's', 'h', 0x61, 's'}
	b := cborHead(nil, 4, 3)
	b = cborHead(b, 0, 1)
	b = cborHead(cborHead(cborHead(b, 4, 2), 0, 2), 0, 3)
	b = cborText(cborText(cborHead(cborHead(b, 4, 1), 5, 1), "Hash"), "s")
	if !bytes.Equal(b, want) {
		t.Errorf("% x, want % x", b, want)
	}
	if hashBlock(1, []uint32{2, 3}, "", []string{"s"}) == hashBlock(1, []uint32{2, 3}, "", nil) {
		t.Error("an extra feature does not change the key")
	}
}
