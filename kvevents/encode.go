package kvevents

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvfence/kvfence/kvcache"
)

// Encoding selects how each event of a batch is encoded; the batch itself
// is always vLLM's positional [ts, events, data_parallel_rank].
type Encoding uint8

const (
	// ArrayEvents encodes every event as a positional array whose first
	// element is its type ("BlockStored", ...): vLLM's encoding before it
	// moved to maps, and the one every consumer reads (those written
	// before the change read nothing else; those after read both).
	ArrayEvents Encoding = iota
	// MapEvents encodes every event as a map of field names with its type
	// under "type": the encoding of current vLLM, read by consumers
	// updated for it.
	MapEvents
)

func (e Encoding) String() string {
	switch e {
	case ArrayEvents:
		return "array"
	case MapEvents:
		return "map"
	}
	return fmt.Sprintf("Encoding(%d)", uint8(e))
}

// vLLM's event type tags.
const (
	TagBlockStored      = "BlockStored"
	TagBlockRemoved     = "BlockRemoved"
	TagAllBlocksCleared = "AllBlocksCleared"
)

// DomainKeyPrefix starts the extra key that names an event's sharing
// domain: every block of a BlockStored or BlockRemoved event carries the
// one extra key DomainKeyPrefix + domain name.
const DomainKeyPrefix = "kvfence.domain:"

// BlockHash is the value a router sees for a key: the last 8 bytes of the
// 32-byte key as a big-endian unsigned integer, as vLLM sends its block
// hashes by default (llm-d reads a longer byte string the same way).
func BlockHash(k kvcache.BlockKey) uint64 { return binary.BigEndian.Uint64(k[24:]) }

// encoder turns events into one batch's msgpack payload. It writes
// msgpack itself, by appending to a byte slice: the shapes are fixed (see
// the package doc), so the bytes of every constant part (tags, field
// names, nil fields, the medium) are encoded once, in newEncoder, and a
// block costs its hash and a copy of its domain's extra key, with no
// reflection, no interface call and no allocation. Every value takes
// msgpack's shortest form, as github.com/vmihailenco/msgpack/v5 and
// Python's msgpack write it (the tests compare the bytes with the
// former's).
type encoder struct {
	fullHashes bool
	rank       int
	// The constant parts of each event, in order; an event is
	// stored[0] hashes stored[1] parent stored[2] extra_keys, and
	// removed[0] hashes removed[1] extra_keys.
	stored  [3][]byte
	removed [2][]byte
	cleared []byte
	// domain is the domain of the last event encoded and domainEntry its
	// extra_keys entry, [DomainKeyPrefix+domain]: a batch's events mostly
	// share a domain, so the entry is encoded once per run of them.
	domain      string
	domainEntry []byte
	haveDomain  bool
}

func newEncoder(form Encoding, fullHashes bool, medium string, blockSize, rank int) *encoder {
	e := &encoder{fullHashes: fullHashes, rank: rank}
	head := func(fields int, tag string) []byte {
		var b []byte
		if form == MapEvents {
			b = appendMapLen(b, fields)
			b = appendStr(b, "type")
		} else {
			b = appendArrayLen(b, fields)
		}
		return appendStr(b, tag)
	}
	field := func(b []byte, name string) []byte {
		if form == MapEvents {
			b = appendStr(b, name)
		}
		return b
	}
	// vLLM's BlockStored: block_hashes, parent_block_hash, token_ids,
	// block_size, lora_id, medium, lora_name, extra_keys (9 with the tag).
	e.stored[0] = field(head(9, TagBlockStored), "block_hashes")
	e.stored[1] = field(nil, "parent_block_hash")
	b := field(nil, "token_ids")
	b = appendArrayLen(b, 0) // kvfence keeps no prompt tokens: see the package doc
	b = appendInt(field(b, "block_size"), int64(blockSize))
	b = appendNil(field(b, "lora_id"))
	b = appendStr(field(b, "medium"), medium)
	b = appendNil(field(b, "lora_name"))
	e.stored[2] = field(b, "extra_keys")
	// vLLM's BlockRemoved: block_hashes, medium, group_idx; then the
	// domain's extra keys, an addition of kvfence's after vLLM's fields,
	// so that positional decoders skip it. The map form has no group_idx
	// (vLLM's map encoder omits the default).
	fields := 5
	if form == MapEvents {
		fields = 4
	}
	e.removed[0] = field(head(fields, TagBlockRemoved), "block_hashes")
	b = appendStr(field(nil, "medium"), medium)
	if form == ArrayEvents {
		b = appendNil(b) // group_idx
	}
	e.removed[1] = field(b, "extra_keys")
	e.cleared = head(1, TagAllBlocksCleared)
	return e
}

// batchBound is an upper bound on the bytes batch appends for events.
func (e *encoder) batchBound(events []kvcache.KVEvent) int {
	hash := 9 // an unsigned integer, at most 9 bytes
	if e.fullHashes {
		hash = 2 + len(kvcache.BlockKey{})
	}
	n := 1 + 9 + 5 + 9 // [ts, events, rank]: array, float64, array length, integer
	for i := range events {
		ev := &events[i]
		switch ev.Kind {
		case kvcache.KVStored:
			n += len(e.stored[0]) + len(e.stored[1]) + len(e.stored[2]) + hash
		case kvcache.KVRemoved:
			n += len(e.removed[0]) + len(e.removed[1])
		default:
			n += len(e.cleared)
			continue
		}
		// two arrays of len(Keys), each entry [DomainKeyPrefix+domain]
		n += 2*5 + len(ev.Keys)*(hash+1+5+len(DomainKeyPrefix)+len(ev.Domain))
	}
	return n
}

// batch appends [ts, [events...], data_parallel_rank] to dst. A KVEvent
// whose Kind is zero stands for an AllBlocksCleared the publisher inserted.
func (e *encoder) batch(dst []byte, ts time.Time, events []kvcache.KVEvent) []byte {
	b := appendArrayLen(dst, 3)
	b = appendFloat64(b, float64(ts.UnixNano())/1e9)
	b = appendArrayLen(b, len(events))
	for i := range events {
		b = e.event(b, &events[i])
	}
	return appendInt(b, int64(e.rank))
}

func (e *encoder) event(b []byte, ev *kvcache.KVEvent) []byte {
	switch ev.Kind {
	case kvcache.KVStored:
		b = append(b, e.stored[0]...)
		b = e.hashes(b, ev.Keys)
		b = append(b, e.stored[1]...)
		if ev.Parent.IsZero() {
			b = appendNil(b)
		} else {
			b = e.hash(b, &ev.Parent)
		}
		b = append(b, e.stored[2]...)
		return e.domainKeys(b, ev.Domain, len(ev.Keys))
	case kvcache.KVRemoved:
		b = append(b, e.removed[0]...)
		b = e.hashes(b, ev.Keys)
		b = append(b, e.removed[1]...)
		return e.domainKeys(b, ev.Domain, len(ev.Keys))
	default: // KVCleared, or a resynchronisation
		return append(b, e.cleared...)
	}
}

func (e *encoder) hashes(b []byte, keys []kvcache.BlockKey) []byte {
	b = appendArrayLen(b, len(keys))
	if e.fullHashes {
		for i := range keys {
			b = e.hash(b, &keys[i])
		}
		return b
	}
	// One pass into room for 9 bytes a hash, the most one takes.
	start := len(b)
	b = slices.Grow(b, 9*len(keys))
	out := b[start : start+9*len(keys)]
	w := 0
	for i := range keys {
		k := &keys[i]
		if k[24] != 0 {
			// A hash of 57 bits or more, nearly all of them: uint 64,
			// whose big-endian bytes are the key's last 8 as they are.
			o := out[w : w+9]
			o[0] = 0xcf
			*(*[8]byte)(o[1:]) = [8]byte(k[24:])
			w += 9
		} else {
			w += len(appendUint(out[w:w], BlockHash(*k))) // within out: at most 9 bytes
		}
	}
	return b[:start+w]
}

// hash writes a parent's hash, or a full hash. It takes the key by
// pointer: a key passed by value is a 32-byte copy.
func (e *encoder) hash(b []byte, k *kvcache.BlockKey) []byte {
	if e.fullHashes {
		return append(append(b, 0xc4, byte(len(k))), k[:]...) // bin 8
	}
	return appendUint(b, BlockHash(*k))
}

// domainKeys writes extra_keys: for each of n blocks, the list holding the
// one extra key that names the domain.
func (e *encoder) domainKeys(b []byte, domain string, n int) []byte {
	if !e.haveDomain || domain != e.domain {
		e.domain, e.haveDomain = domain, true
		entry := appendArrayLen(e.domainEntry[:0], 1)
		entry = appendStrLen(entry, len(DomainKeyPrefix)+len(domain))
		entry = append(append(entry, DomainKeyPrefix...), domain...)
		e.domainEntry = entry
	}
	b = appendArrayLen(b, n)
	if n == 0 {
		return b
	}
	// n copies of the entry, in log2(n) copies of what is written so far.
	start := len(b)
	b = slices.Grow(b, n*len(e.domainEntry))[:start+n*len(e.domainEntry)]
	out := b[start:]
	done := copy(out, e.domainEntry)
	for done < len(out) {
		done += copy(out[done:], out[:done])
	}
	return b
}

// msgpack's shortest forms (the msgpack spec's format families).

func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n)) // fixarray
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
}

func appendMapLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n)) // fixmap
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xde), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdf), uint32(n))
}

func appendStrLen(b []byte, n int) []byte {
	switch {
	case n < 32:
		return append(b, 0xa0|byte(n)) // fixstr
	case n <= math.MaxUint8:
		return append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xda), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdb), uint32(n))
}

func appendStr(b []byte, s string) []byte { return append(appendStrLen(b, len(s)), s...) }

func appendNil(b []byte) []byte { return append(b, 0xc0) }

func appendUint(b []byte, n uint64) []byte {
	switch {
	case n <= math.MaxInt8:
		return append(b, byte(n)) // positive fixint
	case n <= math.MaxUint8:
		return append(b, 0xcc, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(n))
	case n <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), n)
}

func appendInt(b []byte, n int64) []byte {
	switch {
	case n >= 0:
		return appendUint(b, uint64(n))
	case n >= -32:
		return append(b, byte(n)) // negative fixint
	case n >= math.MinInt8:
		return append(b, 0xd0, byte(n))
	case n >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(b, 0xd1), uint16(n))
	case n >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(n))
}

func appendFloat64(b []byte, f float64) []byte {
	return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(f))
}
