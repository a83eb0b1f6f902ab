//go:build 386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64 || wasm

package kvcache

import (
	"bytes"
	"unsafe"
)

// tokenBytes is the little-endian bytes of tokens, the layout BlockKey
// hashes: on a little-endian machine that is the tokens' own memory, so a
// page of them is hashed after one copy instead of a store per token. The
// view aliases tokens and is only read. tokenbytes_other.go is the twin
// for big-endian machines.
func tokenBytes(tokens []int32) []byte {
	if len(tokens) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(tokens))), 4*len(tokens))
}

// appendTokenBytes appends the little-endian bytes of tokens to dst.
func appendTokenBytes(dst []byte, tokens []int32) []byte { return append(dst, tokenBytes(tokens)...) }

// tokensEqual reports whether a and b hold the same token IDs, comparing
// their memory at once (the runtime's vector compare) instead of a token
// at a time: the trie compares a whole page per step of a walk. Equal
// memory is equal tokens whatever the byte order; the twin compares
// token by token.
func tokensEqual(a, b []int32) bool {
	return bytes.Equal(tokenBytes(a), tokenBytes(b)) // equal bytes: equal lengths too
}
