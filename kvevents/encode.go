package kvevents

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"time"

	"github.com/vmihailenco/msgpack/v5"

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

// encoder turns events into one batch's msgpack payload.
type encoder struct {
	buf        bytes.Buffer
	enc        *msgpack.Encoder
	form       Encoding
	fullHashes bool
	medium     string
	blockSize  int
	rank       int
}

func newEncoder(form Encoding, fullHashes bool, medium string, blockSize, rank int) *encoder {
	e := &encoder{form: form, fullHashes: fullHashes, medium: medium, blockSize: blockSize, rank: rank}
	e.enc = msgpack.NewEncoder(&e.buf)
	return e
}

// batch encodes [ts, [events...], data_parallel_rank] into the encoder's
// buffer, valid until the next call. A KVEvent whose Kind is zero stands
// for an AllBlocksCleared the publisher inserted.
func (e *encoder) batch(ts time.Time, events []kvcache.KVEvent) ([]byte, error) {
	e.buf.Reset()
	w := &errWriter{enc: e.enc}
	w.arrayLen(3)
	w.float(float64(ts.UnixNano()) / 1e9)
	w.arrayLen(len(events))
	for i := range events {
		e.event(w, &events[i])
	}
	w.int(int64(e.rank))
	if w.err != nil {
		return nil, fmt.Errorf("%w: encoding a batch of %d events: %w", ErrEncoding, len(events), w.err)
	}
	return e.buf.Bytes(), nil
}

func (e *encoder) event(w *errWriter, ev *kvcache.KVEvent) {
	switch ev.Kind {
	case kvcache.KVStored:
		// vLLM's BlockStored: block_hashes, parent_block_hash, token_ids,
		// block_size, lora_id, medium, lora_name, extra_keys.
		if e.form == MapEvents {
			w.mapLen(9)
			w.str("type")
		} else {
			w.arrayLen(9)
		}
		w.str(TagBlockStored)
		e.field(w, "block_hashes")
		e.hashes(w, ev.Keys)
		e.field(w, "parent_block_hash")
		if ev.Parent.IsZero() {
			w.nil()
		} else {
			e.hash(w, &ev.Parent)
		}
		e.field(w, "token_ids")
		w.arrayLen(0) // kvfence keeps no prompt tokens: see the package doc
		e.field(w, "block_size")
		w.int(int64(e.blockSize))
		e.field(w, "lora_id")
		w.nil()
		e.field(w, "medium")
		w.str(e.medium)
		e.field(w, "lora_name")
		w.nil()
		e.field(w, "extra_keys")
		e.domainKeys(w, ev.Domain, len(ev.Keys))
	case kvcache.KVRemoved:
		// vLLM's BlockRemoved: block_hashes, medium, group_idx; then the
		// domain's extra keys (an addition of kvfence's, after vLLM's
		// fields so that positional decoders skip it).
		if e.form == MapEvents {
			w.mapLen(4)
			w.str("type")
		} else {
			w.arrayLen(5)
		}
		w.str(TagBlockRemoved)
		e.field(w, "block_hashes")
		e.hashes(w, ev.Keys)
		e.field(w, "medium")
		w.str(e.medium)
		if e.form == ArrayEvents {
			w.nil() // group_idx
		}
		e.field(w, "extra_keys")
		e.domainKeys(w, ev.Domain, len(ev.Keys))
	default: // KVCleared, or a resynchronisation
		if e.form == MapEvents {
			w.mapLen(1)
			w.str("type")
		} else {
			w.arrayLen(1)
		}
		w.str(TagAllBlocksCleared)
	}
}

// field writes a map key in the map form; the array form has none.
func (e *encoder) field(w *errWriter, name string) {
	if e.form == MapEvents {
		w.str(name)
	}
}

func (e *encoder) hashes(w *errWriter, keys []kvcache.BlockKey) {
	w.arrayLen(len(keys))
	for i := range keys {
		e.hash(w, &keys[i])
	}
}

// hash takes the key by pointer: a key passed by value would escape (its
// bytes go to the encoder) and cost an allocation per block.
func (e *encoder) hash(w *errWriter, k *kvcache.BlockKey) {
	if e.fullHashes {
		w.bytes(k[:])
	} else {
		w.uint(BlockHash(*k))
	}
}

// domainKeys writes extra_keys: for each of n blocks, the list holding the
// one extra key that names the domain.
func (e *encoder) domainKeys(w *errWriter, domain string, n int) {
	key := DomainKeyPrefix + domain
	w.arrayLen(n)
	for range n {
		w.arrayLen(1)
		w.str(key)
	}
}

// errWriter keeps the first error of a sequence of encoder calls.
type errWriter struct {
	enc *msgpack.Encoder
	err error
}

func (w *errWriter) do(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *errWriter) arrayLen(n int)  { w.do(w.enc.EncodeArrayLen(n)) }
func (w *errWriter) mapLen(n int)    { w.do(w.enc.EncodeMapLen(n)) }
func (w *errWriter) str(s string)    { w.do(w.enc.EncodeString(s)) }
func (w *errWriter) bytes(b []byte)  { w.do(w.enc.EncodeBytes(b)) }
func (w *errWriter) uint(n uint64)   { w.do(w.enc.EncodeUint(n)) }
func (w *errWriter) int(n int64)     { w.do(w.enc.EncodeInt(n)) }
func (w *errWriter) nil()            { w.do(w.enc.EncodeNil()) }
func (w *errWriter) float(f float64) { w.do(w.enc.EncodeFloat64(f)) }
