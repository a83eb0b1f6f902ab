package kvevents

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvfence/kvfence/kvcache"
)

// Encoding selects the form of every batch and of the events in it: one
// shape per form, each that of vLLM's structs (vllm/distributed/kv_events.py)
// in that form, field for field.
type Encoding uint8

const (
	// ArrayEvents is vLLM's positional form (msgspec's array_like=True):
	// the batch [ts, events, data_parallel_rank], every event an array
	// whose first element is its tag, the fields in vLLM's order, trailing
	// fields at their defaults left out. The form llm-d's indexer and
	// vLLM's example subscriber decode.
	ArrayEvents Encoding = iota
	// MapEvents is vLLM's map form (its structs without array_like): the
	// batch a map of ts, events and data_parallel_rank, every event a map
	// of its fields with its tag under "type", fields at their defaults
	// left out. The form of current vLLM, for consumers that decode it.
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

// DomainKeyPrefix starts the cache salt that names a sharing domain on the
// wire: see CacheSalt.
const DomainKeyPrefix = "kvfence.domain:"

// CacheSalt is the cache salt of a sharing domain, DomainKeyPrefix +
// domain ("kvfence.domain:team", "kvfence.domain:tenant:acme"). It is the
// extra key of the first block of every prompt the domain stores, where
// vLLM puts a request's cache_salt, so that a router that folds extra
// keys into its block keys (llm-d) keys each domain's prompts apart; a
// router gives it as the first block's extra key of a request of the
// domain to find that domain's blocks (see the package doc).
func CacheSalt(domain string) string { return DomainKeyPrefix + domain }

// BlockHash is the value a router sees for a key: the last 8 bytes of the
// 32-byte key as a big-endian unsigned integer, as vLLM sends its block
// hashes by default (llm-d reads a longer byte string the same way).
func BlockHash(k kvcache.BlockKey) uint64 { return binary.BigEndian.Uint64(k[24:]) }

// encoder turns events into one batch's msgpack payload. It writes
// msgpack itself, by appending to a byte slice: the shapes are fixed (see
// the package doc), so the bytes of every constant part (tags, field
// names, nil fields, the medium) are encoded once, in newEncoder, and a
// block costs its hash, its tokens and its extra-keys entry, with no
// reflection, no interface call and no allocation. Every value takes
// msgpack's shortest form, as github.com/vmihailenco/msgpack/v5 and
// Python's msgpack write it (the tests compare the bytes with the
// former's).
type encoder struct {
	fullHashes bool
	blockSize  int
	rank       int
	// The constant parts, in the order they are written; a field name is
	// empty in the array form.
	batchHead  []byte // the batch's header and the name of ts
	eventsName []byte
	rankName   []byte
	storedHead []byte // BlockStored's header, tag and block_hashes' name
	parentName []byte
	tokensName []byte
	storedMid  [2][]byte // block_size, lora_id, medium, and lora_name's name, per kvcache.Medium
	extraName  []byte
	removed    []byte    // BlockRemoved's header, tag and block_hashes' name
	removedEnd [2][]byte // medium, per kvcache.Medium
	cleared    []byte
	// domain is the domain of the last salt encoded and salt its
	// extra_keys entry, [CacheSalt(domain)]: a batch's events mostly
	// share a domain, so the entry is encoded once per run of them.
	domain     string
	salt       []byte
	haveDomain bool
}

// newEncoder returns an encoder whose events name medium for pages on the
// pool's device and hostMedium for those in its host tier.
func newEncoder(form Encoding, fullHashes bool, medium, hostMedium string, blockSize, rank int) *encoder {
	e := &encoder{fullHashes: fullHashes, blockSize: blockSize, rank: rank}
	name := func(b []byte, n string) []byte {
		if form == MapEvents {
			b = appendStr(b, n)
		}
		return b
	}
	head := func(fields int, tag string) []byte {
		var b []byte
		if form == MapEvents {
			b = appendStr(appendMapLen(b, fields), "type")
		} else {
			b = appendArrayLen(b, fields)
		}
		return appendStr(b, tag)
	}
	// EventBatch: ts, events, data_parallel_rank.
	if form == MapEvents {
		e.batchHead = name(appendMapLen(nil, 3), "ts")
	} else {
		e.batchHead = appendArrayLen(nil, 3)
	}
	e.eventsName = name(nil, "events")
	e.rankName = name(nil, "data_parallel_rank")
	// BlockStored: block_hashes, parent_block_hash, token_ids, block_size,
	// lora_id, medium, lora_name, extra_keys (9 with the tag); group_idx
	// and the cache-spec fields stay at their defaults (nil), left out.
	e.storedHead = name(head(9, TagBlockStored), "block_hashes")
	e.parentName = name(nil, "parent_block_hash")
	e.tokensName = name(nil, "token_ids")
	for m, name_ := range [2]string{medium, hostMedium} {
		b := appendInt(name(nil, "block_size"), int64(blockSize))
		b = appendNil(name(b, "lora_id")) // deprecated in vLLM; kvfence names adapters
		b = appendStr(name(b, "medium"), name_)
		e.storedMid[m] = name(b, "lora_name")
		e.removedEnd[m] = appendStr(name(nil, "medium"), name_)
	}
	e.extraName = name(nil, "extra_keys")
	// BlockRemoved: block_hashes, medium; group_idx at its default.
	e.removed = name(head(3, TagBlockRemoved), "block_hashes")
	e.cleared = head(1, TagAllBlocksCleared)
	return e
}

// batchBound is an upper bound on the bytes batch appends for events.
func (e *encoder) batchBound(events []kvcache.KVEvent) int {
	hash := 9 // an unsigned integer, at most 9 bytes
	if e.fullHashes {
		hash = 2 + len(kvcache.BlockKey{})
	}
	n := len(e.batchHead) + 9 + len(e.eventsName) + 5 + len(e.rankName) + 9
	for i := range events {
		ev := &events[i]
		switch ev.Kind {
		case kvcache.KVStored:
			n += len(e.storedHead) + len(e.parentName) + hash + len(e.tokensName) + 5 + 5*len(ev.TokenIDs) +
				len(e.storedMid[medium(ev)]) + 5 + len(ev.Adapter) + len(e.extraName) + 5 + len(ev.Keys) + 1 + 5 + len(DomainKeyPrefix) + len(ev.Domain)
		case kvcache.KVRemoved:
			n += len(e.removed) + len(e.removedEnd[medium(ev)])
		default:
			n += len(e.cleared)
			continue
		}
		n += 5 + len(ev.Keys)*hash
	}
	return n
}

// batch appends an EventBatch of events to dst. A KVEvent whose Kind is
// zero stands for an AllBlocksCleared the publisher inserted.
func (e *encoder) batch(dst []byte, ts time.Time, events []kvcache.KVEvent) []byte {
	b := append(dst, e.batchHead...)
	b = appendFloat64(b, float64(ts.UnixNano())/1e9)
	b = appendArrayLen(append(b, e.eventsName...), len(events))
	for i := range events {
		b = e.event(b, &events[i])
	}
	return appendInt(append(b, e.rankName...), int64(e.rank))
}

func (e *encoder) event(b []byte, ev *kvcache.KVEvent) []byte {
	switch ev.Kind {
	case kvcache.KVStored:
		b = e.hashes(append(b, e.storedHead...), ev.Keys)
		b = append(b, e.parentName...)
		if ev.Parent.IsZero() {
			b = appendNil(b)
		} else {
			b = e.hash(b, &ev.Parent)
		}
		b = append(b, e.tokensName...)
		if len(ev.TokenIDs) == len(ev.Keys)*e.blockSize {
			b = appendTokens(b, ev.TokenIDs)
		} else {
			b = appendArrayLen(b, 0) // no tokens: see the package doc
		}
		b = append(b, e.storedMid[medium(ev)]...)
		if ev.Adapter == "" {
			b = appendNil(b)
		} else {
			b = appendStr(b, ev.Adapter)
		}
		return e.extraKeys(append(b, e.extraName...), ev)
	case kvcache.KVRemoved:
		b = e.hashes(append(b, e.removed...), ev.Keys)
		return append(b, e.removedEnd[medium(ev)]...)
	default: // KVCleared, or a resynchronisation
		return append(b, e.cleared...)
	}
}

// medium is the index of ev's medium in the encoder's constant parts: 1
// for the host tier, 0 for the device (and anything unknown).
func medium(ev *kvcache.KVEvent) int {
	if ev.Medium == kvcache.MediumHost {
		return 1
	}
	return 0
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

// extraKeys writes a stored event's extra_keys, one entry per block, as
// vLLM does: the domain's cache salt, [CacheSalt(domain)], for the first
// block of a prompt (an event without a parent), nil for every other.
func (e *encoder) extraKeys(b []byte, ev *kvcache.KVEvent) []byte {
	n := len(ev.Keys)
	b = appendArrayLen(b, n)
	if n == 0 {
		return b
	}
	if ev.Parent.IsZero() {
		if !e.haveDomain || ev.Domain != e.domain {
			e.domain, e.haveDomain = ev.Domain, true
			salt := appendArrayLen(e.salt[:0], 1)
			salt = appendStrLen(salt, len(DomainKeyPrefix)+len(ev.Domain))
			e.salt = append(append(salt, DomainKeyPrefix...), ev.Domain...)
		}
		b = append(b, e.salt...)
		n--
	}
	for range n {
		b = append(b, 0xc0) // nil
	}
	return b
}

// appendTokens writes token IDs as a msgpack array of integers, each in
// its shortest form.
func appendTokens(b []byte, tokens []int32) []byte {
	b = appendArrayLen(b, len(tokens))
	start := len(b)
	b = slices.Grow(b, 5*len(tokens))
	out := b[start : start+5*len(tokens)]
	w := 0
	for _, t := range tokens {
		switch {
		case t >= 0 && t <= math.MaxInt8:
			out[w] = byte(t)
			w++
		case t >= 0 && t <= math.MaxUint16:
			if t <= math.MaxUint8 {
				out[w], out[w+1] = 0xcc, byte(t)
				w += 2
			} else {
				out[w] = 0xcd
				binary.BigEndian.PutUint16(out[w+1:], uint16(t))
				w += 3
			}
		case t > 0:
			out[w] = 0xce
			binary.BigEndian.PutUint32(out[w+1:], uint32(t))
			w += 5
		default:
			w += len(appendInt(out[w:w], int64(t))) // at most 5 bytes for an int32
		}
	}
	return b[:start+w]
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
