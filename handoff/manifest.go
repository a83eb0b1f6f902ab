package handoff

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// Version is the manifest encoding this package writes and reads.
const Version = 1

// Manifest encoding, version 1. All integers little-endian.
//
//	off  size  field
//	  0     4  magic "KVFH"
//	  4     2  version (1)
//	  6     2  flags: bit 0 FlagChecksumSealed; any other bit is refused
//	  8    16  transfer ID (random; tags every data frame)
//	 24     8  expiry, Unix nanoseconds
//	 32     8  prompt tokens (≥ 1)
//	 40     8  max new tokens (≥ 0), what the decode lease reserves beyond the prompt
//	 48    16  geometry: tokens per page, layers, KV heads, head dim (u32 each);
//	           under LayoutCacheSpec: tokens per page, regions, and the
//	           spec's 64-bit digest (high, low)
//	 64     1  dtype (kvcache.DType; under LayoutCacheSpec the first region's)
//	 65     1  layout (LayoutKVPerLayer or LayoutCacheSpec)
//	 66     1  checksum algorithm (ChecksumXXH3)
//	 67     1  reserved (0)
//	 68     4  content checksum (0 when FlagChecksumSealed)
//	 72     4  page count = ceil(prompt tokens / tokens per page)
//	 76     2  request ID length (1..kvcache.MaxIDLen)
//	 78     2  tenant length (1..kvcache.MaxIDLen)
//	 80     2  sharing domain length (1..maxDomainLen)
//	 82     …  request ID, tenant, domain (UTF-8)
//	  …  4×n  per-page generation on the sender
//	  …    32  HMAC-SHA256 over every byte before it
const (
	magic       = "KVFH"
	fixedLen    = 82
	macLen      = sha256.Size
	MinKeyBytes = 32 // shared HMAC keys shorter than this are refused

	// maxDomainLen bounds a sharing domain's name: a tenant's own domain
	// is isolation.PrivateDomainPrefix + its name, longer than any tenant
	// name or request ID may be (a shared one is at most MaxTenantName).
	maxDomainLen = len(isolation.PrivateDomainPrefix) + isolation.MaxTenantName

	// MaxManifestBytes bounds what a decoder reads: 4 M pages.
	MaxManifestBytes = fixedLen + 2*kvcache.MaxIDLen + maxDomainLen + 4*(4<<20) + macLen

	maxTokens = 1 << 40 // as kvcache: far from overflow everywhere
)

// Layout names how a page's bytes are laid out over regions.
const (
	// LayoutKVPerLayer is kvcache's layout: 2×Layers regions, layer l's K
	// in region 2l and its V in 2l+1, each page TokensPerPage × KVHeads ×
	// HeadDim elements.
	LayoutKVPerLayer uint8 = 1
	// LayoutCacheSpec is a pool made from a kvcache.CacheSpec of one
	// per-token group (MLA latents, indexer keys, fused layouts): the
	// regions of that group in order, each page its region's PageBytes.
	// What must match is the spec's digest (SpecDigest): the regions'
	// page sizes and element types in order, and the page size in tokens.
	LayoutCacheSpec uint8 = 2
)

// SpecDigest is the first 8 bytes of a SHA-256 over what makes two
// pools' pages mean the same bytes: tokens per page, then per region of
// the per-token group its page bytes and element types, in order. Names
// and the model name are left out: a preset and a hand-written spec of
// the same shapes interoperate.
func SpecDigest(s kvcache.CacheSpec) uint64 {
	h := sha256.New()
	var b [8]byte
	put := func(v uint64) { binary.LittleEndian.PutUint64(b[:], v); h.Write(b[:]) }
	if len(s.Groups) == 0 {
		return 0
	}
	g := s.Groups[0]
	put(uint64(g.TokensPerPage))
	put(uint64(len(g.Regions)))
	for _, r := range g.Regions {
		put(uint64(r.PageBytes))
		put(uint64(r.DType))
		put(uint64(len(r.AlsoHolds)))
		for _, d := range r.AlsoHolds {
			put(uint64(d))
		}
	}
	return binary.BigEndian.Uint64(h.Sum(nil))
}

// ChecksumXXH3 is the content checksum of kvcache.ContentChecksum: per-page
// XXH3-64 hashes folded into 32 bits. (1 named CRC32C, the algorithm of
// earlier builds; it is refused, as any other value is.)
const ChecksumXXH3 uint8 = 2

// FlagChecksumSealed marks a manifest whose content checksum is not in it
// but follows the pages, in the transfer's seal (see frames.go), MAC'd
// with the same key and bound to the manifest's transfer ID. A sender
// that streams the pages (Export.Send) sums them as it reads them to send
// them, so no pass over the pages delays the manifest, and each byte
// leaves the device once.
const FlagChecksumSealed uint16 = 1

// GeometryFingerprint is what must match between prefill and decode pools
// for page bytes to mean the same thing on both sides.
type GeometryFingerprint struct {
	TokensPerPage, Layers, KVHeads, HeadDim uint32
	DType                                   kvcache.DType
	Layout                                  uint8
}

// PoolFingerprint returns the fingerprint of a pool's pages: its
// Geometry's for a pool made from one (LayoutKVPerLayer, as every earlier
// build wrote), its cache spec's otherwise (LayoutCacheSpec).
func PoolFingerprint(p interface {
	Geometry() kvcache.Geometry
	Spec() kvcache.CacheSpec
}) GeometryFingerprint {
	if g := p.Geometry(); g != (kvcache.Geometry{}) {
		return Fingerprint(g)
	}
	return SpecFingerprint(p.Spec())
}

// SpecFingerprint returns a cache spec's fingerprint (LayoutCacheSpec).
func SpecFingerprint(s kvcache.CacheSpec) GeometryFingerprint {
	d := SpecDigest(s)
	f := GeometryFingerprint{TokensPerPage: uint32(s.TokensPerPage()), KVHeads: uint32(d >> 32), HeadDim: uint32(d), Layout: LayoutCacheSpec}
	if len(s.Groups) > 0 && len(s.Groups[0].Regions) > 0 {
		f.Layers = uint32(len(s.Groups[0].Regions))
		f.DType = s.Groups[0].Regions[0].DType
	}
	return f
}

// Fingerprint returns a pool geometry's fingerprint.
func Fingerprint(g kvcache.Geometry) GeometryFingerprint {
	return GeometryFingerprint{
		TokensPerPage: uint32(g.TokensPerPage), Layers: uint32(g.Layers),
		KVHeads: uint32(g.KVHeads), HeadDim: uint32(g.HeadDim),
		DType: g.DType, Layout: LayoutKVPerLayer,
	}
}

// Geometry returns the kvcache geometry the fingerprint describes.
func (f GeometryFingerprint) Geometry() kvcache.Geometry {
	return kvcache.Geometry{TokensPerPage: int(f.TokensPerPage), Layers: int(f.Layers),
		KVHeads: int(f.KVHeads), HeadDim: int(f.HeadDim), DType: f.DType}
}

func (f GeometryFingerprint) String() string {
	if f.Layout == LayoutCacheSpec {
		return fmt.Sprintf("%d tokens/page, %d regions of a cache spec (digest %08x%08x), layout %d",
			f.TokensPerPage, f.Layers, f.KVHeads, f.HeadDim, f.Layout)
	}
	return fmt.Sprintf("%d tokens/page, %d layers × %d KV heads × %d dims %v, layout %d",
		f.TokensPerPage, f.Layers, f.KVHeads, f.HeadDim, f.DType, f.Layout)
}

// validate checks a fingerprint on its own.
func (f GeometryFingerprint) validate() error {
	if f.Layout == LayoutCacheSpec {
		if f.TokensPerPage < 1 || f.TokensPerPage > kvcache.MaxTokensPerPage || f.Layers < 1 || f.Layers > kvcache.MaxCacheRegions || !f.DType.Valid() {
			return fmt.Errorf("%w: cache-spec geometry %v", ErrMalformedManifest, f)
		}
		return nil
	}
	if err := f.Geometry().Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrMalformedManifest, err)
	}
	return nil
}

func (f GeometryFingerprint) pagesFor(tokens int) int {
	return int((int64(tokens) + int64(f.TokensPerPage) - 1) / int64(f.TokensPerPage))
}

// Manifest is what a decode pool needs to accept a prompt's KV.
type Manifest struct {
	TransferID     [16]byte
	RequestID      string
	Tenant         string
	Domain         string // sharing domain, keyed server-side from the tenant
	PromptTokens   int
	MaxNewTokens   int
	Geometry       GeometryFingerprint
	Expires        time.Time
	Checksum       uint32   // content checksum of the pages (ChecksumXXH3); 0 if ChecksumSealed
	ChecksumSealed bool     // the checksum follows the pages, in the transfer's seal (FlagChecksumSealed)
	Generations    []uint32 // per page, on the sender: which life of each page the KV came from
}

// Pages is the number of pages the manifest describes.
func (m Manifest) Pages() int { return len(m.Generations) }

// validate checks what a decoder would refuse, so that Encode never
// produces bytes Decode rejects.
func (m *Manifest) validate() error {
	if err := checkNames(m.RequestID, m.Tenant, m.Domain); err != nil {
		return err
	}
	g := m.Geometry
	switch {
	case m.PromptTokens < 1 || m.PromptTokens > maxTokens:
		return fmt.Errorf("%w: %d prompt tokens", ErrMalformedManifest, m.PromptTokens)
	case m.MaxNewTokens < 0 || m.MaxNewTokens > maxTokens:
		return fmt.Errorf("%w: %d max new tokens", ErrMalformedManifest, m.MaxNewTokens)
	case g.Layout != LayoutKVPerLayer && g.Layout != LayoutCacheSpec:
		return fmt.Errorf("%w: layout %d", ErrMalformedManifest, g.Layout)
	case m.Expires.IsZero():
		return fmt.Errorf("%w: no expiry", ErrMalformedManifest)
	case m.ChecksumSealed && m.Checksum != 0:
		return fmt.Errorf("%w: checksum %08x in a manifest whose checksum is sealed", ErrMalformedManifest, m.Checksum)
	}
	if err := g.validate(); err != nil {
		return err
	}
	if want := g.pagesFor(m.PromptTokens); len(m.Generations) != want {
		return fmt.Errorf("%w: %d page generations for %d prompt tokens at %d per page (want %d)",
			ErrMalformedManifest, len(m.Generations), m.PromptTokens, g.TokensPerPage, want)
	}
	if n := m.encodedLen(); n > MaxManifestBytes {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrMalformedManifest, n, MaxManifestBytes)
	}
	return nil
}

// checkNames checks a manifest's request ID, tenant and domain.
func checkNames(requestID, tenant, domain string) error {
	str := func(name, s string, limit int) error {
		if len(s) == 0 || len(s) > limit || !utf8.ValidString(s) {
			return fmt.Errorf("%w: %s of %d bytes, want 1..%d bytes of UTF-8", ErrMalformedManifest, name, len(s), limit)
		}
		return nil
	}
	for _, err := range []error{str("request ID", requestID, kvcache.MaxIDLen), str("tenant", tenant, kvcache.MaxIDLen),
		str("domain", domain, maxDomainLen)} {
		if err != nil {
			return err
		}
	}
	return nil
}

func (m *Manifest) encodedLen() int {
	return fixedLen + len(m.RequestID) + len(m.Tenant) + len(m.Domain) + 4*len(m.Generations) + macLen
}

// Key is a shared HMAC-SHA256 key. It is safe for concurrent use.
type Key struct {
	macs sync.Pool // of hash.Hash keyed with the secret; Reset keeps the key
}

// NewKey returns a key for secret, which must be at least MinKeyBytes
// of random bytes shared by the prefill and decode pools.
func NewKey(secret []byte) (*Key, error) {
	if len(secret) < MinKeyBytes {
		return nil, fmt.Errorf("%w: HMAC key of %d bytes, want at least %d", ErrInvalidConfig, len(secret), MinKeyBytes)
	}
	s := append([]byte(nil), secret...)
	k := &Key{}
	k.macs.New = func() any { return hmac.New(sha256.New, s) }
	return k, nil
}

func (k *Key) sum(dst, msg []byte) []byte {
	h := k.macs.Get().(hash.Hash)
	h.Reset()
	h.Write(msg)
	dst = h.Sum(dst)
	k.macs.Put(h)
	return dst
}

// AppendEncode appends the manifest's encoding, MAC included, to dst.
func (m *Manifest) AppendEncode(dst []byte, key *Key) ([]byte, error) {
	if m == nil {
		return dst, fmt.Errorf("%w: nil manifest", ErrInvalidArgument)
	}
	if key == nil {
		return dst, fmt.Errorf("%w: no key", ErrInvalidConfig)
	}
	if err := m.validate(); err != nil {
		return dst, err
	}
	start := len(dst)
	dst = append(dst, magic...)
	le := binary.LittleEndian
	dst = le.AppendUint16(dst, Version)
	var flags uint16
	if m.ChecksumSealed {
		flags |= FlagChecksumSealed
	}
	dst = le.AppendUint16(dst, flags)
	dst = append(dst, m.TransferID[:]...)
	dst = le.AppendUint64(dst, uint64(m.Expires.UnixNano()))
	dst = le.AppendUint64(dst, uint64(m.PromptTokens))
	dst = le.AppendUint64(dst, uint64(m.MaxNewTokens))
	g := m.Geometry
	dst = le.AppendUint32(dst, g.TokensPerPage)
	dst = le.AppendUint32(dst, g.Layers)
	dst = le.AppendUint32(dst, g.KVHeads)
	dst = le.AppendUint32(dst, g.HeadDim)
	dst = append(dst, byte(g.DType), g.Layout, ChecksumXXH3, 0)
	dst = le.AppendUint32(dst, m.Checksum)
	dst = le.AppendUint32(dst, uint32(len(m.Generations)))
	dst = le.AppendUint16(dst, uint16(len(m.RequestID)))
	dst = le.AppendUint16(dst, uint16(len(m.Tenant)))
	dst = le.AppendUint16(dst, uint16(len(m.Domain)))
	dst = append(dst, m.RequestID...)
	dst = append(dst, m.Tenant...)
	dst = append(dst, m.Domain...)
	dst = append(dst, make([]byte, 4*len(m.Generations))...)
	gens := dst[len(dst)-4*len(m.Generations):]
	for i, g := range m.Generations {
		le.PutUint32(gens[4*i:], g)
	}
	return key.sum(dst, dst[start:]), nil
}

// Decode verifies b's MAC under key and parses it. Anything but a
// well-formed version-1 manifest signed with key is refused: ErrBadMAC
// for a MAC that does not verify, ErrMalformedManifest for the rest. The
// MAC is checked before any field is trusted.
func Decode(b []byte, key *Key) (Manifest, error) {
	if key == nil {
		return Manifest{}, fmt.Errorf("%w: no key", ErrInvalidConfig)
	}
	if len(b) < fixedLen+3+macLen || len(b) > MaxManifestBytes {
		return Manifest{}, fmt.Errorf("%w: %d bytes, want %d..%d", ErrMalformedManifest, len(b), fixedLen+3+macLen, MaxManifestBytes)
	}
	body, mac := b[:len(b)-macLen], b[len(b)-macLen:]
	var want [macLen]byte
	if !hmac.Equal(mac, key.sum(want[:0], body)) {
		return Manifest{}, ErrBadMAC
	}
	return parse(body)
}

// parse decodes an authenticated manifest body (everything but the MAC).
func parse(b []byte) (Manifest, error) {
	var m Manifest
	bad := func(format string, args ...any) (Manifest, error) {
		return Manifest{}, fmt.Errorf("%w: "+format, append([]any{ErrMalformedManifest}, args...)...)
	}
	if len(b) < fixedLen {
		return bad("%d bytes, header is %d", len(b), fixedLen)
	}
	le := binary.LittleEndian
	if string(b[:4]) != magic {
		return bad("magic %q", b[:4])
	}
	if v := le.Uint16(b[4:]); v != Version {
		return bad("version %d, this decoder reads %d", v, Version)
	}
	flags := le.Uint16(b[6:])
	if flags&^FlagChecksumSealed != 0 {
		return bad("flags %#x", flags)
	}
	m.ChecksumSealed = flags&FlagChecksumSealed != 0
	copy(m.TransferID[:], b[8:24])
	m.Expires = time.Unix(0, int64(le.Uint64(b[24:])))
	prompt, maxNew := le.Uint64(b[32:]), le.Uint64(b[40:])
	if prompt > maxTokens || maxNew > maxTokens {
		return bad("%d prompt tokens, %d max new tokens", prompt, maxNew)
	}
	m.PromptTokens, m.MaxNewTokens = int(prompt), int(maxNew)
	m.Geometry = GeometryFingerprint{
		TokensPerPage: le.Uint32(b[48:]), Layers: le.Uint32(b[52:]),
		KVHeads: le.Uint32(b[56:]), HeadDim: le.Uint32(b[60:]),
		DType: kvcache.DType(b[64]), Layout: b[65],
	}
	if b[66] != ChecksumXXH3 || b[67] != 0 {
		return bad("checksum algorithm %d, reserved byte %d", b[66], b[67])
	}
	m.Checksum = le.Uint32(b[68:])
	pages := int64(le.Uint32(b[72:]))
	idLen, tenantLen, domainLen := int64(le.Uint16(b[76:])), int64(le.Uint16(b[78:])), int64(le.Uint16(b[80:]))
	if want := fixedLen + idLen + tenantLen + domainLen + 4*pages; int64(len(b)) != want {
		return bad("%d bytes, fields say %d", len(b), want)
	}
	rest := b[fixedLen:]
	m.RequestID, rest = string(rest[:idLen]), rest[idLen:]
	m.Tenant, rest = string(rest[:tenantLen]), rest[tenantLen:]
	m.Domain, rest = string(rest[:domainLen]), rest[domainLen:]
	m.Generations = make([]uint32, pages)
	for i := range m.Generations {
		m.Generations[i] = le.Uint32(rest[4*i:])
	}
	if err := m.validate(); err != nil {
		return Manifest{}, err
	}
	return m, nil
}
