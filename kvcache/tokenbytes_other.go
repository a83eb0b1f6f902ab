//go:build !(386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64 || wasm)

package kvcache

import (
	"encoding/binary"
	"slices"
)

// appendTokenBytes appends the little-endian bytes of tokens to dst, one
// token at a time: the twin of tokenbytes_le.go for big-endian machines.
func appendTokenBytes(dst []byte, tokens []int32) []byte {
	for _, t := range tokens {
		dst = binary.LittleEndian.AppendUint32(dst, uint32(t))
	}
	return dst
}

// tokensEqual reports whether a and b hold the same token IDs.
func tokensEqual(a, b []int32) bool { return slices.Equal(a, b) }
