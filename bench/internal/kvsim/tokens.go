package kvsim

import "hash/fnv"

// Token IDs of simulated prompts.
//
// The prefix cache keys pages by their token IDs, so the simulator gives
// every prompt real ones, derived from the seed. A request with a prefix
// gets its first Prefix tokens from its PrefixID (the same for every
// request that names it) and the rest from its ID (unique in a trace). A
// request with a block chain gets each block's tokens from that block's ID
// alone. Equal prefixes, and equal chains, therefore hash to equal page keys
// inside one sharing domain, and nothing else does but by a SHA-256
// collision.
//
// Block tokens. A block's first blockIDTokens tokens spell its ID (XOR a
// word of the seed) in 17-bit digits, and the rest follow from a generator
// seeded by the same word: two different IDs differ in their first four
// tokens, so that, at any page size of at least four tokens that divides
// the block size, two chains that differ in block i differ in the first
// page of block i and (the keys being a hash chain) in every page after
// it. Pages of fewer than four tokens may share a token or three of two
// different blocks, as real text does.

// Vocab bounds the token IDs, as a tokenizer's vocabulary would.
const Vocab = 1 << 17

// blockIDTokens is how many leading tokens of a block spell its ID: four
// 17-bit digits hold 64 bits.
const blockIDTokens = 4

// AppendPromptTokens appends r's prompt token IDs under seed to dst;
// blockTokens is the trace's block size (Trace.BlockTokens), used when r
// has a block chain.
func AppendPromptTokens(dst []int32, seed uint64, r *Request, blockTokens int) []int32 {
	if len(r.Blocks) > 0 {
		for i, id := range r.Blocks {
			dst = appendBlock(dst, seed, id, min(blockTokens, r.Prompt-i*blockTokens))
		}
		return dst
	}
	if r.Prefix > 0 {
		dst = appendStream(dst, seed, "prefix\x00"+r.PrefixID, r.Prefix)
	}
	return appendStream(dst, seed, "request\x00"+r.ID, r.Prompt-r.Prefix)
}

// appendBlock appends the first n tokens of block id.
func appendBlock(dst []int32, seed uint64, id int64, n int) []int32 {
	// A bijection of the ID, so distinct IDs keep distinct digits.
	x := uint64(id) ^ mix64(seed^0x626c6f636b)
	for d := range min(n, blockIDTokens) {
		dst = append(dst, int32(x>>(17*d))&(Vocab-1))
	}
	if n > blockIDTokens {
		dst = appendSplitmix(dst, x, n-blockIDTokens)
	}
	return dst
}

// appendStream appends the first n tokens of the stream named name.
func appendStream(dst []int32, seed uint64, name string, n int) []int32 {
	h := fnv.New64a()
	h.Write([]byte(name))
	return appendSplitmix(dst, seed^h.Sum64(), n)
}

// appendSplitmix appends n tokens of the splitmix64 sequence from state x:
// a full-period generator whose outputs are well mixed even for adjacent
// states.
func appendSplitmix(dst []int32, x uint64, n int) []int32 {
	for range n {
		x += 0x9e3779b97f4a7c15
		dst = append(dst, int32(mix64(x)%Vocab))
	}
	return dst
}

// mix64 is splitmix64's output function.
func mix64(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// AppendOutputTokens appends the first n token IDs r generates under seed
// to dst: a stream of its own, named by the request's ID, so that a
// preempted request's written tokens (AppendPromptTokens, then these) hash
// to the same page keys when it is admitted again, and to no other
// request's.
func AppendOutputTokens(dst []int32, seed uint64, r *Request, n int) []int32 {
	return appendStream(dst, seed, "output\x00"+r.ID, n)
}
