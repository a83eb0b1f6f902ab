package handoff

import (
	"crypto/hmac"
	"encoding/binary"
	"fmt"
	"sync"
)

// Messages of a transfer. The first byte names the kind.
//
//	sender → receiver
//	  'M' manifest                       the encoded, MAC'd manifest
//	  'D' transfer ID[16] first u32 n u32 gens n×u32 units
//	                                     n consecutive whole units from unit first
//	                                     (kvcache's handoff units: pages and slots
//	                                     of every group, each its group's
//	                                     UnitBytes long, regions in order)
//	  'P' transfer ID[16] unit u32 offset u64 gen u32 bytes
//	                                     bytes [offset, offset+len) of one unit too
//	                                     large for a message (a state slot): a
//	                                     unit's parts follow each other in order,
//	                                     from offset 0, every one but the last a
//	                                     multiple of kvcache.UnitRangeAlign long
//	  'E' transfer ID[16] units u32      no more units follow
//	  'S' transfer ID[16] units u32 checksum u32 MAC[32]
//	                                     seal: no more units follow, and the
//	                                     content checksum of a manifest with
//	                                     FlagChecksumSealed (which ends with a
//	                                     seal, never an end frame); MAC =
//	                                     HMAC-SHA256(key, "KVFS" ‖ the 24 bytes
//	                                     after 'S')
//	receiver → sender
//	  'V' stage u8 code u8 text          verdict: stage 1 after the manifest
//	                                     (accepted: pages may flow), stage 2 after
//	                                     the import; code 0 = yes, else a reason
const (
	msgManifest = 'M'
	msgData     = 'D'
	msgPart     = 'P'
	msgEnd      = 'E'
	msgSeal     = 'S'
	msgVerdict  = 'V'

	stageManifest = 1
	stageImport   = 2

	dataFixed   = 1 + 16 + 4 + 4
	partFixed   = 1 + 16 + 4 + 8 + 4
	endLen      = 1 + 16 + 4
	sealLen     = endLen + 4 + macLen
	sealMagic   = "KVFS" // separates seal MACs from manifest MACs ("KVFH")
	maxVerdict  = 1024   // bytes of error text a verdict carries
	defaultData = 1 << 20
)

// A received message may come as consecutive parts (PartsEndpoint): the
// parsers below read a message's head contiguously, copying it only when
// it straddles parts, and hand the page bytes on as parts.

// messageParts is a received message: parts, concatenated, are its bytes.
type messageParts struct {
	parts   [][]byte
	len     int
	scratch []byte // holds a head that straddles parts
}

func (m *messageParts) reset(parts [][]byte) {
	m.parts, m.len = parts, 0
	for _, p := range parts {
		m.len += len(p)
	}
}

// kind is the message's first byte, 0 for an empty message.
func (m *messageParts) kind() byte {
	for _, p := range m.parts {
		if len(p) > 0 {
			return p[0]
		}
	}
	return 0
}

// head returns the message's first k ≤ m.len bytes, contiguous: a slice
// of the first part when it holds them, else a copy, valid until the next
// head.
func (m *messageParts) head(k int) []byte {
	if len(m.parts) > 0 && len(m.parts[0]) >= k {
		return m.parts[0][:k]
	}
	if cap(m.scratch) < k {
		m.scratch = make([]byte, k)
	}
	h := m.scratch[:k]
	for i, off := 0, 0; off < k; i++ {
		off += copy(h[off:], m.parts[i])
	}
	return h
}

// tail appends to dst the parts that hold the message's bytes from
// offset off on.
func (m *messageParts) tail(dst [][]byte, off int) [][]byte {
	for _, p := range m.parts {
		if off >= len(p) {
			off -= len(p)
			continue
		}
		dst = append(dst, p[off:])
		off = 0
	}
	return dst
}

// dataFrame is a parsed 'D' message; its slices alias the message (or
// its head's scratch copy).
type dataFrame struct {
	id    [16]byte
	first int
	gens  []byte   // n little-endian u32
	units [][]byte // n units, regions in order, in parts
	n     int
}

// parseData parses m, a 'D' message; f.units reuses units' storage.
func parseData(m *messageParts, units [][]byte) (dataFrame, error) {
	var f dataFrame
	if m.len < dataFixed {
		return f, fmt.Errorf("%w: data frame of %d bytes", ErrProtocol, m.len)
	}
	h := m.head(dataFixed)
	copy(f.id[:], h[1:17])
	f.first = int(binary.LittleEndian.Uint32(h[17:]))
	n := int64(binary.LittleEndian.Uint32(h[21:]))
	if n == 0 || int64(m.len-dataFixed) < 4*n {
		return f, fmt.Errorf("%w: data frame of %d bytes claims %d units", ErrProtocol, m.len, n)
	}
	f.n = int(n)
	f.gens = m.head(dataFixed + 4*f.n)[dataFixed:]
	f.units = m.tail(units[:0], dataFixed+4*f.n)
	return f, nil
}

// partFrame is a parsed 'P' message; bytes aliases the message.
type partFrame struct {
	id    [16]byte
	unit  int
	off   int64
	gen   uint32
	bytes [][]byte // in parts
	n     int64
}

// parsePart parses m, a 'P' message; f.bytes reuses parts' storage.
func parsePart(m *messageParts, parts [][]byte) (partFrame, error) {
	var f partFrame
	if m.len <= partFixed {
		return f, fmt.Errorf("%w: part frame of %d bytes", ErrProtocol, m.len)
	}
	h := m.head(partFixed)
	le := binary.LittleEndian
	copy(f.id[:], h[1:17])
	f.unit = int(le.Uint32(h[17:]))
	off := le.Uint64(h[21:])
	if off > 1<<60 {
		return f, fmt.Errorf("%w: part frame at offset %d", ErrProtocol, off)
	}
	f.off, f.gen = int64(off), le.Uint32(h[29:])
	f.bytes = m.tail(parts[:0], partFixed)
	f.n = int64(m.len - partFixed)
	return f, nil
}

// appendSeal appends the seal of transfer id: units units whose content
// checksum is checksum.
func appendSeal(dst []byte, key *Key, id [16]byte, units int, checksum uint32) []byte {
	start := len(dst)
	dst = append(dst, msgSeal)
	dst = append(dst, id[:]...)
	dst = binary.LittleEndian.AppendUint32(dst, uint32(units))
	dst = binary.LittleEndian.AppendUint32(dst, checksum)
	return sealMAC(dst, key, dst[start+1:])
}

// sealMAC appends the MAC of a seal's 24 signed bytes.
func sealMAC(dst []byte, key *Key, signed []byte) []byte {
	var msg [len(sealMagic) + sealLen - 1 - macLen]byte
	copy(msg[:], sealMagic)
	copy(msg[len(sealMagic):], signed)
	return key.sum(dst, msg[:])
}

// parseSeal verifies a seal under key, then that it closes transfer id
// of units units, and returns its checksum.
func parseSeal(msg []byte, key *Key, id [16]byte, units int) (uint32, error) {
	if len(msg) != sealLen || msg[0] != msgSeal {
		return 0, fmt.Errorf("%w: seal of %d bytes (kind %q)", ErrProtocol, len(msg), firstByte(msg))
	}
	signed, mac := msg[1:sealLen-macLen], msg[sealLen-macLen:]
	var want [macLen]byte
	if !hmac.Equal(mac, sealMAC(want[:0], key, signed)) {
		return 0, fmt.Errorf("%w: the seal of transfer %x", ErrBadMAC, id)
	}
	le := binary.LittleEndian
	if [16]byte(signed[:16]) != id || int64(le.Uint32(signed[16:])) != int64(units) {
		return 0, fmt.Errorf("%w: seal of transfer %x (%d units) in transfer %x (%d units)",
			ErrProtocol, signed[:16], le.Uint32(signed[16:]), id, units)
	}
	return le.Uint32(signed[20:]), nil
}

func appendVerdict(dst []byte, stage uint8, err error) []byte {
	if err == nil {
		return append(dst, msgVerdict, stage, 0)
	}
	text := err.Error()
	if len(text) > maxVerdict {
		text = text[:maxVerdict]
	}
	return append(append(dst, msgVerdict, stage, reasonCode(err)), text...)
}

// parseVerdict returns nil for a yes, a *RefusedError for a no.
func parseVerdict(msg []byte, wantStage uint8) error {
	if len(msg) < 3 || msg[0] != msgVerdict || msg[1] != wantStage {
		return fmt.Errorf("%w: expected a stage-%d verdict, got %d bytes (kind %q)", ErrProtocol, wantStage, len(msg), firstByte(msg))
	}
	if msg[2] == 0 {
		return nil
	}
	stage := "manifest"
	if wantStage == stageImport {
		stage = "import"
	}
	text := msg[3:]
	if len(text) > maxVerdict { // what a receiver sends, not what it may
		text = text[:maxVerdict]
	}
	return &RefusedError{Reason: reasonOf(msg[2]), Message: string(text), Stage: stage}
}

func firstByte(b []byte) byte {
	if len(b) == 0 {
		return 0
	}
	return b[0]
}

// frameBuffers recycles data-frame buffers by capacity: every frame of an
// export is allocated with the capacity of a full one, so a process has
// one size class per geometry. A handoff moves hundreds of MiB of frames,
// which fresh allocations would have the kernel zero first.
var frameBuffers framePool

type framePool struct{ byCap sync.Map } // capacity → *sync.Pool of *[]byte

// get returns a buffer of length n and capacity c ≥ n.
func (fp *framePool) get(n, c int) *[]byte {
	if p, ok := fp.byCap.Load(c); ok {
		if b, ok := p.(*sync.Pool).Get().(*[]byte); ok {
			*b = (*b)[:n]
			return b
		}
	}
	b := make([]byte, n, c)
	return &b
}

func (fp *framePool) put(b *[]byte) {
	p, ok := fp.byCap.Load(cap(*b))
	if !ok {
		p, _ = fp.byCap.LoadOrStore(cap(*b), new(sync.Pool))
	}
	p.(*sync.Pool).Put(b)
}
