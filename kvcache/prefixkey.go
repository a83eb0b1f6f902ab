package kvcache

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"

	"github.com/kvfence/kvfence/isolation"
)

// BlockKey names the KV content of one full page inside one sharing
// domain: a SHA-256 hash chain over the prompt's full pages,
//
//	root    = SHA-256("kvfence/prefix-root/v1" ‖ len ‖ domain ‖ len ‖ adapter)
//	key_0   = SHA-256(root    ‖ tokensPerPage ‖ tokens of page 0)
//	key_i   = SHA-256(key_i-1 ‖ tokensPerPage ‖ tokens of page i)
//
// with lengths and token IDs as little-endian uint32; a page with extra
// key material (Request.PageExtra: a multimodal prompt's images) takes the
// extended form of pageextra.go. The domain and the
// extra key (the adapter: a LoRA or other weights ID) enter every key
// through the root, so key_i = H(domain, key_i-1, tokens_i, adapter) as a
// chain: equal tokens in two domains, or under two adapters, never share a
// key, and a key fixes the whole prefix before it. Every input has a fixed
// layout or a length prefix, so distinct prefixes hash distinct inputs; a
// shared key would need a SHA-256 collision (CVE-2025-25183 exploited a
// weak hash). The domain is the server-side one of the request's tenant:
// no client-supplied salt takes part.
//
// Keys depend only on the domain's name, the adapter, the page size and the
// tokens, so every pool serving the same model computes the same keys, as a
// KV-aware router needs.
type BlockKey [32]byte

// String returns the key in hex.
func (k BlockKey) String() string { return hex.EncodeToString(k[:]) }

// IsZero reports whether k is the zero key, which no derivation yields in
// practice and which events use for "no parent".
func (k BlockKey) IsZero() bool { return k == BlockKey{} }

// index64 folds a key and its domain into a map index. Keys are uniformly
// distributed hashes, so 64 bits of one make a good index; entries still
// compare the full key and domain.
func (k BlockKey) index64(domain uint32) uint64 {
	return binary.LittleEndian.Uint64(k[:8]) ^ uint64(domain)*0x9e3779b97f4a7c15
}

const rootTag = "kvfence/prefix-root/v1"

// prefixRoot is the chain's start for one domain and adapter.
func prefixRoot(domain, adapter string) BlockKey {
	var stack [len(rootTag) + 8 + len(isolation.PrivateDomainPrefix) + 2*MaxIDLen]byte // every valid name fits: no allocation
	buf := stack[:0]
	buf = append(buf, rootTag...)
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(domain)))
	buf = append(buf, domain...)
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(adapter)))
	buf = append(buf, adapter...)
	return sha256.Sum256(buf)
}

// keyScratchPages is the page size whose key input fits the stack buffer
// of appendPageKeys.
const keyScratchPages = 64

// appendPageKeys appends the keys of the full pages of tokens, chained from
// root, to dst. A trailing partial page gets no key.
func appendPageKeys(dst []BlockKey, root BlockKey, tokensPerPage int, tokens []int32) []BlockKey {
	var stack [32 + 4 + 4*keyScratchPages]byte
	n := 32 + 4 + 4*tokensPerPage
	var buf []byte
	if n <= len(stack) {
		buf = stack[:n]
	} else {
		buf = make([]byte, n)
	}
	binary.LittleEndian.PutUint32(buf[32:], uint32(tokensPerPage))
	parent := root
	for start := 0; start+tokensPerPage <= len(tokens); start += tokensPerPage {
		copy(buf, parent[:])
		appendTokenBytes(buf[:36], tokens[start:start+tokensPerPage]) // in place: buf has the room
		parent = sha256.Sum256(buf)
		dst = append(dst, parent)
	}
	return dst
}
