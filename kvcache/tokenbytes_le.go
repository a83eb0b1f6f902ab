//go:build 386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64 || wasm

package kvcache

import "unsafe"

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
