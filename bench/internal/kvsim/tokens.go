package kvsim

import "hash/fnv"

// Token IDs of simulated prompts.
//
// The prefix cache keys pages by their token IDs, so the simulator gives
// every prompt real ones, derived from the seed: the first Prefix tokens
// from the request's PrefixID (the same for every request that names it),
// the rest from its ID (unique in a trace). Equal prefixes therefore hash
// to equal page keys inside one sharing domain, and nothing else does but
// by a SHA-256 collision.

// Vocab bounds the token IDs, as a tokenizer's vocabulary would.
const Vocab = 1 << 17

// AppendPromptTokens appends r's prompt token IDs under seed to dst.
func AppendPromptTokens(dst []int32, seed uint64, r *Request) []int32 {
	if r.Prefix > 0 {
		dst = appendStream(dst, seed, "prefix\x00"+r.PrefixID, r.Prefix)
	}
	return appendStream(dst, seed, "request\x00"+r.ID, r.Prompt-r.Prefix)
}

// appendStream appends the first n tokens of the stream named name.
func appendStream(dst []int32, seed uint64, name string, n int) []int32 {
	h := fnv.New64a()
	h.Write([]byte(name))
	x := seed ^ h.Sum64()
	for range n {
		// splitmix64: a full-period generator whose outputs are well mixed
		// even for adjacent seeds.
		x += 0x9e3779b97f4a7c15
		z := x
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		z ^= z >> 31
		dst = append(dst, int32(z%Vocab))
	}
	return dst
}
