package kvcache

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
)

// Extra key material of a prompt's pages (Request.PageExtra).
//
// A page's KV depends on more than its token IDs when the tokens are
// placeholders: the image, audio or video whose embeddings stand where a
// multimodal prompt has its placeholder tokens, identical token IDs for
// any two images. An engine gives, for each such page, bytes that name
// what else it was computed from (vLLM: the multimodal items' hashes and
// their offsets in the page), and the page's key covers them:
//
//	key_i = SHA-256(key_i-1 ‖ tokensPerPage|1<<31 ‖ tokens of page i ‖ len ‖ extra_i)
//
// with lengths as little-endian uint32, the high bit of the page size
// telling the extended form from the plain one (prefixkey.go), which a
// page without extra bytes keeps. Every key after such a page chains from
// it, so equal tokens with other images never share a page, while a
// prompt's pages before its first image share with text-only prompts as
// before. Leases with extra material publish their pages by key alone
// (never in the token trie, which compares tokens only): their domain's
// requests then match by keys (prefixindex.go), and a text-only request
// derives, for a page that held an image, a key without the image's
// bytes, which is another key.

// MaxPageExtraBytes bounds one page's extra key material.
const MaxPageExtraBytes = 1 << 16

// extendedPageSize marks the extended key form in the page-size field.
const extendedPageSize = 1 << 31

// validatePageExtra checks a request's extra key material: only with
// TokenIDs (keys given by the engine already say what they cover), at
// most one entry per prompt page, partial last page included (its key is
// derived once output fills it, at preemption), and each entry bounded.
func validatePageExtra(req Request, tokensPerPage int) error {
	if len(req.PageExtra) == 0 {
		return nil
	}
	pages := (req.PromptTokens + tokensPerPage - 1) / tokensPerPage
	switch {
	case len(req.TokenIDs) == 0:
		return fmt.Errorf("%w: PageExtra without TokenIDs: extra key material qualifies the tokens' keys", ErrInvalidRequest)
	case len(req.PageExtra) > pages:
		return fmt.Errorf("%w: %d PageExtra entries for a prompt of %d pages", ErrInvalidRequest, len(req.PageExtra), pages)
	}
	for i, e := range req.PageExtra {
		if len(e) > MaxPageExtraBytes {
			return fmt.Errorf("%w: PageExtra[%d] of %d bytes, limit %d", ErrInvalidRequest, i, len(e), MaxPageExtraBytes)
		}
	}
	return nil
}

// copyPageExtra copies extra into dst's entries, one backing array for
// all of them: the caller may reuse its buffers (the C ABI passes C
// memory). An entry without bytes is kept as nil.
func copyPageExtra(dst [][]byte, extra [][]byte) [][]byte {
	dst = dst[:0]
	if len(extra) == 0 {
		return dst
	}
	n := 0
	for _, e := range extra {
		n += len(e)
	}
	buf := make([]byte, 0, n)
	for _, e := range extra {
		if len(e) == 0 {
			dst = append(dst, nil)
			continue
		}
		start := len(buf)
		buf = append(buf, e...)
		dst = append(dst, buf[start:len(buf):len(buf)])
	}
	return dst
}

// appendLeaseKeys appends the keys of the full pages of tokens, which are
// pages first, first+1, ... of the lease's tokens, chained from parent;
// pages with extra key material (l.extra) take the extended form.
func (l *Lease) appendLeaseKeys(dst []BlockKey, parent BlockKey, tokensPerPage int, first int, tokens []int32) []BlockKey {
	if len(l.extra) <= first {
		return appendPageKeys(dst, parent, tokensPerPage, tokens)
	}
	return appendPageKeysExtra(dst, parent, tokensPerPage, tokens, l.extra[first:])
}

// appendPageKeysExtra is appendPageKeys where page i of tokens also
// covers extra[i] (when i < len(extra) and it has bytes): the plain form
// for a page without, the extended one for a page with.
func appendPageKeysExtra(dst []BlockKey, parent BlockKey, tokensPerPage int, tokens []int32, extra [][]byte) []BlockKey {
	var buf []byte
	for i, start := 0, 0; start+tokensPerPage <= len(tokens); i, start = i+1, start+tokensPerPage {
		var e []byte
		if i < len(extra) {
			e = extra[i]
		}
		size := uint32(tokensPerPage)
		if len(e) > 0 {
			size |= extendedPageSize
		}
		buf = append(buf[:0], parent[:]...)
		buf = binary.LittleEndian.AppendUint32(buf, size)
		for _, t := range tokens[start : start+tokensPerPage] {
			buf = binary.LittleEndian.AppendUint32(buf, uint32(t))
		}
		if len(e) > 0 {
			buf = binary.LittleEndian.AppendUint32(buf, uint32(len(e)))
			buf = append(buf, e...)
		}
		parent = sha256.Sum256(buf)
		dst = append(dst, parent)
	}
	return dst
}
