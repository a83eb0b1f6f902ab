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

// Version is the manifest encoding this package writes and reads. 2
// carries every cache group of a pool (the cache spec, the handoff's
// extents and every unit's generation); a version-1 manifest, of an
// earlier build that moved per-token pages only, is refused by name.
const Version = 2

// Manifest encoding, version 2. All integers little-endian.
//
//	off  size  field
//	  0     4  magic "KVFH"
//	  4     2  version (2)
//	  6     2  flags: bit 0 FlagChecksumSealed; any other bit is refused
//	  8    16  transfer ID (random; tags every data frame)
//	 24     8  expiry, Unix nanoseconds
//	 32     8  prompt tokens (≥ 1)
//	 40     8  max new tokens (≥ 0), what the decode lease reserves beyond the prompt
//	 48     1  checksum algorithm (ChecksumXXH3)
//	 49     1  cache groups g (1..kvcache.MaxCacheGroups)
//	 50     2  reserved (0)
//	 52     4  content checksum (0 when FlagChecksumSealed)
//	 56     4  units n: every group's, summed
//	 60     4  spec bytes s
//	 64     2  request ID length (1..kvcache.MaxIDLen)
//	 66     2  tenant length (1..kvcache.MaxIDLen)
//	 68     2  sharing domain length (1..maxDomainLen)
//	 70     …  request ID, tenant, domain (UTF-8)
//	  …     s  the cache spec (specEncoding: shapes, element types and
//	           shard; no names)
//	  …  8×g   per group: the logical page of its first unit u32, its units u32
//	  …  4×n   per unit, in unit order: its generation on the sender
//	  …    32  HMAC-SHA256 over every byte before it
const (
	magic       = "KVFH"
	fixedLen    = 70
	macLen      = sha256.Size
	MinKeyBytes = 32 // shared HMAC keys shorter than this are refused

	// maxDomainLen bounds a sharing domain's name: a tenant's own domain
	// is isolation.PrivateDomainPrefix + its name, longer than any tenant
	// name or request ID may be (a shared one is at most MaxTenantName).
	maxDomainLen = len(isolation.PrivateDomainPrefix) + isolation.MaxTenantName

	// maxUnits bounds what a manifest lists: 4 M units.
	maxUnits = 4 << 20

	// MaxManifestBytes bounds what a decoder reads.
	MaxManifestBytes = fixedLen + 2*kvcache.MaxIDLen + maxDomainLen + maxSpecBytes +
		8*kvcache.MaxCacheGroups + 4*maxUnits + macLen

	maxTokens = 1 << 40 // as kvcache: far from overflow everywhere
)

// ChecksumXXH3 is the content checksum of kvcache.ContentChecksum: per-unit
// XXH3-64 hashes folded into 32 bits. (1 named CRC32C, the algorithm of
// earlier builds; it is refused, as any other value is.)
const ChecksumXXH3 uint8 = 2

// FlagChecksumSealed marks a manifest whose content checksum is not in it
// but follows the units, in the transfer's seal (see frames.go), MAC'd
// with the same key and bound to the manifest's transfer ID. A sender
// that streams the units (Export.Send) sums them as it reads them to send
// them, so no pass over the units delays the manifest, and each byte
// leaves the device once.
const FlagChecksumSealed uint16 = 1

// Manifest is what a decode pool needs to accept a prompt's cache.
type Manifest struct {
	TransferID   [16]byte
	RequestID    string
	Tenant       string
	Domain       string // sharing domain, keyed server-side from the tenant
	PromptTokens int
	MaxNewTokens int
	// Spec is the exporting pool's cache spec as a manifest carries it:
	// every group's kind, page size and window, every region's bytes per
	// page and element types, in order, and the shard. Names are not
	// carried (a preset and a hand-written spec of the same shapes
	// interoperate), nor adopted memory. The decode pool's spec must match
	// it (SpecDifference).
	Spec kvcache.CacheSpec
	// Extents is, per group, the logical page of its first unit and its
	// units: kvcache.CacheSpec.HandoffExtents of the prompt, which the
	// receiver checks (with its own groups' names).
	Extents        []kvcache.HandoffExtent
	Expires        time.Time
	Checksum       uint32   // content checksum of the units (ChecksumXXH3); 0 if ChecksumSealed
	ChecksumSealed bool     // the checksum follows the units, in the transfer's seal (FlagChecksumSealed)
	Generations    []uint32 // per unit, on the sender: which life of each page (slot) the cache came from
}

// Units is the number of units the manifest describes, every group's.
func (m Manifest) Units() int { return len(m.Generations) }

// validate checks what a decoder would refuse, so that Encode never
// produces bytes Decode rejects.
func (m *Manifest) validate() error {
	if err := checkNames(m.RequestID, m.Tenant, m.Domain); err != nil {
		return err
	}
	switch {
	case m.PromptTokens < 1 || m.PromptTokens > maxTokens:
		return fmt.Errorf("%w: %d prompt tokens", ErrMalformedManifest, m.PromptTokens)
	case m.MaxNewTokens < 0 || m.MaxNewTokens > maxTokens:
		return fmt.Errorf("%w: %d max new tokens", ErrMalformedManifest, m.MaxNewTokens)
	case m.Expires.IsZero():
		return fmt.Errorf("%w: no expiry", ErrMalformedManifest)
	case m.ChecksumSealed && m.Checksum != 0:
		return fmt.Errorf("%w: checksum %08x in a manifest whose checksum is sealed", ErrMalformedManifest, m.Checksum)
	case len(m.Generations) > maxUnits:
		return fmt.Errorf("%w: %d units, at most %d", ErrMalformedManifest, len(m.Generations), maxUnits)
	}
	if err := m.Spec.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrMalformedManifest, err)
	}
	if err := checkExtents(m.Spec, m.PromptTokens, m.Extents); err != nil {
		return err
	}
	units := 0
	for _, e := range m.Extents {
		units += e.Units
	}
	if len(m.Generations) != units {
		return fmt.Errorf("%w: %d unit generations, the extents list %d units", ErrMalformedManifest, len(m.Generations), units)
	}
	if n := m.encodedLen(); n > MaxManifestBytes {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrMalformedManifest, n, MaxManifestBytes)
	}
	return nil
}

// checkExtents refuses extents that are not the handoff of a prompt of
// prompt tokens under spec: a group's first page (a window's ring
// position) or unit count other than the prompt's, or a unit size other
// than the group's. Names are not compared.
func checkExtents(spec kvcache.CacheSpec, prompt int, es []kvcache.HandoffExtent) error {
	want := spec.HandoffExtents(prompt)
	if len(es) != len(want) {
		return fmt.Errorf("%w: %d extents for a spec of %d cache groups", ErrMalformedManifest, len(es), len(want))
	}
	for i, e := range es {
		w := want[i]
		if e.First != w.First || e.Units != w.Units || (e.UnitBytes != 0 && e.UnitBytes != w.UnitBytes) {
			return fmt.Errorf("%w: cache group %d (%v) moves %d units from logical page %d; a prompt of %d tokens moves %d from page %d",
				ErrMalformedManifest, i, w.Kind, e.Units, e.First, prompt, w.Units, w.First)
		}
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
	return fixedLen + len(m.RequestID) + len(m.Tenant) + len(m.Domain) + specLen(m.Spec) +
		8*len(m.Extents) + 4*len(m.Generations) + macLen
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
	dst = append(dst, ChecksumXXH3, byte(len(m.Extents)), 0, 0)
	dst = le.AppendUint32(dst, m.Checksum)
	dst = le.AppendUint32(dst, uint32(len(m.Generations)))
	dst = le.AppendUint32(dst, uint32(specLen(m.Spec)))
	dst = le.AppendUint16(dst, uint16(len(m.RequestID)))
	dst = le.AppendUint16(dst, uint16(len(m.Tenant)))
	dst = le.AppendUint16(dst, uint16(len(m.Domain)))
	dst = append(dst, m.RequestID...)
	dst = append(dst, m.Tenant...)
	dst = append(dst, m.Domain...)
	dst = appendSpec(dst, m.Spec)
	for _, e := range m.Extents {
		dst = le.AppendUint32(dst, uint32(e.First))
		dst = le.AppendUint32(dst, uint32(e.Units))
	}
	dst = append(dst, make([]byte, 4*len(m.Generations))...)
	gens := dst[len(dst)-4*len(m.Generations):]
	for i, g := range m.Generations {
		le.PutUint32(gens[4*i:], g)
	}
	return key.sum(dst, dst[start:]), nil
}

// Decode verifies b's MAC under key and parses it. Anything but a
// well-formed version-2 manifest signed with key is refused: ErrBadMAC
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
		if v == 1 {
			return bad("version 1, of a kvfence that moves per-token pages only; this decoder reads version %d: update the sender", Version)
		}
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
	groups := int64(b[49])
	if b[48] != ChecksumXXH3 || b[50] != 0 || b[51] != 0 {
		return bad("checksum algorithm %d, reserved bytes %d %d", b[48], b[50], b[51])
	}
	m.Checksum = le.Uint32(b[52:])
	units, specBytes := int64(le.Uint32(b[56:])), int64(le.Uint32(b[60:]))
	idLen, tenantLen, domainLen := int64(le.Uint16(b[64:])), int64(le.Uint16(b[66:])), int64(le.Uint16(b[68:]))
	if units > maxUnits || specBytes > maxSpecBytes || groups > kvcache.MaxCacheGroups {
		return bad("%d units, %d spec bytes, %d groups", units, specBytes, groups)
	}
	if want := fixedLen + idLen + tenantLen + domainLen + specBytes + 8*groups + 4*units; int64(len(b)) != want {
		return bad("%d bytes, fields say %d", len(b), want)
	}
	rest := b[fixedLen:]
	m.RequestID, rest = string(rest[:idLen]), rest[idLen:]
	m.Tenant, rest = string(rest[:tenantLen]), rest[tenantLen:]
	m.Domain, rest = string(rest[:domainLen]), rest[domainLen:]
	spec, err := parseSpec(rest[:specBytes])
	if err != nil {
		return Manifest{}, err
	}
	m.Spec, rest = spec, rest[specBytes:]
	if int64(len(spec.Groups)) != groups {
		return bad("%d cache groups in the spec, %d in the header", len(spec.Groups), groups)
	}
	m.Extents = make([]kvcache.HandoffExtent, groups)
	for i := range m.Extents {
		g := spec.Groups[i]
		m.Extents[i] = kvcache.HandoffExtent{Kind: g.Kind, First: int(le.Uint32(rest[8*i:])), Units: int(le.Uint32(rest[8*i+4:]))}
		for _, r := range g.Regions {
			m.Extents[i].UnitBytes += r.PageBytes
		}
	}
	rest = rest[8*groups:]
	m.Generations = make([]uint32, units)
	for i := range m.Generations {
		m.Generations[i] = le.Uint32(rest[4*i:])
	}
	if err := m.validate(); err != nil {
		return Manifest{}, err
	}
	return m, nil
}
