package kvevents_test

import (
	"encoding/binary"
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
)

// This file is what a KV-aware router does with the published batches:
// decode them strictly with vLLM's schema (vllm/distributed/kv_events.py:
// EventBatch, BlockStored, BlockRemoved, AllBlocksCleared), in the form
// they came in, and mirror the pool's cache per sharing domain.

// decodedEvent is one event of a batch, whichever form it came in.
type decodedEvent struct {
	tag       string
	hashes    []uint64
	parent    *uint64
	tokenIDs  []int64
	blockSize int
	medium    string
	loraName  *string
	// salt is the domain the first block's cache salt names, "" when the
	// event has none (it continues a prompt: its parent's domain).
	salt string
}

type decodedBatch struct {
	form   kvevents.Encoding
	ts     float64
	events []decodedEvent
	rank   int
}

// vLLM's structs, field by field: those without a default first (every
// encoding must carry them), then those with one (nil), which omit_defaults
// leaves out when they hold it (in the array form, only at the end).
var schema = map[string]struct{ required, optional []string }{
	kvevents.TagBlockStored: {
		[]string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"},
		[]string{"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"},
	},
	kvevents.TagBlockRemoved:     {[]string{"block_hashes", "medium"}, []string{"group_idx"}},
	kvevents.TagAllBlocksCleared: {},
}

// decodeBatch decodes one payload strictly: the batch and every event in
// one form, every field one of the struct's, every field without a
// default present, no field more than the struct has (as msgspec decodes
// with forbid_unknown_fields).
func decodeBatch(t testing.TB, payload []byte) decodedBatch {
	t.Helper()
	var raw any
	require.NoError(t, msgpack.Unmarshal(payload, &raw))
	var fields map[string]any
	var b decodedBatch
	switch v := raw.(type) {
	case []any:
		b.form = kvevents.ArrayEvents
		require.True(t, len(v) == 2 || len(v) == 3, "an array batch is [ts, events(, data_parallel_rank)], got %d", len(v))
		fields = map[string]any{"ts": v[0], "events": v[1]}
		if len(v) == 3 {
			fields["data_parallel_rank"] = v[2]
		}
	case map[string]any:
		b.form = kvevents.MapEvents
		fields = v
		for k := range v {
			require.Contains(t, []string{"ts", "events", "data_parallel_rank"}, k, "EventBatch has no field %q", k)
		}
	default:
		t.Fatalf("a batch of type %T", raw)
	}
	ts, ok := fields["ts"].(float64)
	require.True(t, ok, "ts is a float64, got %T", fields["ts"])
	evs, ok := fields["events"].([]any)
	require.True(t, ok, "events is a list, got %T", fields["events"])
	b.ts, b.rank = ts, int(asInt(t, fields["data_parallel_rank"]))
	for _, e := range evs {
		b.events = append(b.events, decodeEvent(t, b.form, e))
	}
	return b
}

func decodeEvent(t testing.TB, form kvevents.Encoding, e any) decodedEvent {
	t.Helper()
	var tag string
	fields := map[string]any{}
	if form == kvevents.ArrayEvents {
		v, ok := e.([]any)
		require.True(t, ok, "an event of an array batch is an array, got %T", e)
		require.NotEmpty(t, v)
		tag, ok = v[0].(string)
		require.True(t, ok, "a tag, got %T", v[0])
		sc, known := schema[tag]
		require.True(t, known, "unknown tag %q", tag)
		names := append(slices.Clone(sc.required), sc.optional...)
		require.GreaterOrEqual(t, len(v)-1, len(sc.required), "%s without all its required fields", tag)
		require.LessOrEqual(t, len(v)-1, len(names), "%s has more fields than vLLM's struct", tag)
		for i, x := range v[1:] {
			fields[names[i]] = x
		}
	} else {
		v, ok := e.(map[string]any)
		require.True(t, ok, "an event of a map batch is a map, got %T", e)
		tag, ok = v["type"].(string)
		require.True(t, ok, "a tag under type")
		sc, known := schema[tag]
		require.True(t, known, "unknown tag %q", tag)
		for k, x := range v {
			if k == "type" {
				continue
			}
			require.True(t, slices.Contains(sc.required, k) || slices.Contains(sc.optional, k), "%s has no field %q", tag, k)
			fields[k] = x
		}
		for _, k := range sc.required {
			require.Contains(t, fields, k, "%s without %s", tag, k)
		}
	}
	d := decodedEvent{tag: tag}
	if tag == kvevents.TagAllBlocksCleared {
		return d
	}
	hs, ok := fields["block_hashes"].([]any)
	require.True(t, ok, "block_hashes is a list")
	for _, h := range hs {
		d.hashes = append(d.hashes, hashOf(t, h))
	}
	if m := fields["medium"]; m != nil {
		d.medium, ok = m.(string)
		require.True(t, ok, "medium is a string or nil")
	}
	if g := fields["group_idx"]; g != nil {
		asInt(t, g)
	}
	if tag == kvevents.TagBlockRemoved {
		return d
	}
	if p := fields["parent_block_hash"]; p != nil {
		h := hashOf(t, p)
		d.parent = &h
	}
	toks, ok := fields["token_ids"].([]any)
	require.True(t, ok, "token_ids is a list")
	for _, tok := range toks {
		d.tokenIDs = append(d.tokenIDs, asInt(t, tok))
	}
	d.blockSize = int(asInt(t, fields["block_size"]))
	require.Nil(t, fields["lora_id"], "kvfence has no integer adapter IDs")
	if n := fields["lora_name"]; n != nil {
		s, ok := n.(string)
		require.True(t, ok, "lora_name is a string or nil")
		d.loraName = &s
	}
	if x := fields["extra_keys"]; x != nil {
		extra, ok := x.([]any)
		require.True(t, ok, "extra_keys is a list or nil")
		require.Len(t, extra, len(d.hashes), "one extra-keys entry per block")
		for i, blk := range extra {
			if blk == nil {
				continue
			}
			keys, ok := blk.([]any)
			require.True(t, ok, "an extra-keys entry is a tuple or nil")
			require.Zero(t, i, "only a prompt's first block carries extra keys (its cache salt)")
			require.Nil(t, d.parent, "a block with a parent is no prompt's first")
			require.Len(t, keys, 1)
			salt, ok := keys[0].(string)
			require.True(t, ok)
			require.True(t, strings.HasPrefix(salt, kvevents.DomainKeyPrefix), salt)
			d.salt = strings.TrimPrefix(salt, kvevents.DomainKeyPrefix)
		}
	}
	return d
}

// hashOf reads a block hash as llm-d does: an integer, or the last 8
// bytes of a byte string, big-endian.
func hashOf(t testing.TB, v any) uint64 {
	t.Helper()
	if b, ok := v.([]byte); ok {
		require.Len(t, b, 32)
		return binary.BigEndian.Uint64(b[24:])
	}
	return uint64(asInt(t, v))
}

func asInt(t testing.TB, v any) int64 {
	t.Helper()
	switch n := v.(type) {
	case int8:
		return int64(n)
	case int16:
		return int64(n)
	case int32:
		return int64(n)
	case int64:
		return n
	case uint8:
		return int64(n)
	case uint16:
		return int64(n)
	case uint32:
		return int64(n)
	case uint64:
		return int64(n)
	}
	t.Fatalf("not an integer: %T %v", v, v)
	return 0
}

// mirror is a router's view of one pool: per domain, the block hashes it
// holds. A stored prompt's domain is its first block's cache salt, a
// continuation's that of its parent, a removed block's that of its store.
type mirror map[string]map[uint64]bool

func (m mirror) apply(t testing.TB, b decodedBatch) {
	t.Helper()
	domainOf := func(h uint64) string {
		for d, hs := range m {
			if hs[h] {
				return d
			}
		}
		return ""
	}
	for _, e := range b.events {
		switch e.tag {
		case kvevents.TagAllBlocksCleared:
			clear(m)
		case kvevents.TagBlockStored:
			d := e.salt
			if e.parent != nil {
				require.Empty(t, d)
				d = domainOf(*e.parent)
				require.NotEmpty(t, d, "a stored block's parent is stored")
			}
			require.NotEmpty(t, d, "a stored prompt's first block names its domain")
			if m[d] == nil {
				m[d] = map[uint64]bool{}
			}
			for _, h := range e.hashes {
				m[d][h] = true
			}
		case kvevents.TagBlockRemoved:
			for _, h := range e.hashes {
				d := domainOf(h)
				require.NotEmpty(t, d, "a removed block was stored")
				delete(m[d], h)
				if len(m[d]) == 0 {
					delete(m, d)
				}
			}
		}
	}
}

func (m mirror) String() string {
	var doms []string
	for d, hs := range m {
		doms = append(doms, fmt.Sprintf("%s:%d", d, len(hs)))
	}
	sort.Strings(doms)
	return strings.Join(doms, " ")
}

// hashesOf is what a mirror holds for keys.
func hashesOf(keys []kvcache.BlockKey) map[uint64]bool {
	m := map[uint64]bool{}
	for _, k := range keys {
		m[kvevents.BlockHash(k)] = true
	}
	return m
}
