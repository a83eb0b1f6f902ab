package kvevents_test

import (
	"encoding/binary"
	"fmt"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
)

// This file is what a KV-aware router does with the published batches:
// decode them with vLLM's schema, in either encoding, and mirror the
// pool's cache per sharing domain.

// decodedEvent is one event of a batch, whichever form it came in.
type decodedEvent struct {
	tag       string
	hashes    []uint64
	parent    *uint64
	tokenIDs  []any
	blockSize int
	medium    string
	domain    string // from the extra keys
	hasLora   bool   // lora_id and lora_name present (as nil)
}

type decodedBatch struct {
	ts     float64
	events []decodedEvent
	rank   int
}

// vLLM's field order for the positional forms.
var (
	storedFields  = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys"}
	removedFields = []string{"block_hashes", "medium", "group_idx", "extra_keys"}
)

// decodeBatch decodes one payload the way a consumer that reads both
// forms does (llm-d normalises maps to the positional layout; so does
// this).
func decodeBatch(t testing.TB, payload []byte) decodedBatch {
	t.Helper()
	var raw []any
	require.NoError(t, msgpack.Unmarshal(payload, &raw))
	require.Len(t, raw, 3, "a batch is [ts, events, data_parallel_rank]")
	ts, ok := raw[0].(float64)
	require.True(t, ok, "ts is a float64, got %T", raw[0])
	evs, ok := raw[1].([]any)
	require.True(t, ok)
	b := decodedBatch{ts: ts, rank: int(asInt(t, raw[2]))}
	for _, e := range evs {
		b.events = append(b.events, decodeEvent(t, e))
	}
	return b
}

func decodeEvent(t testing.TB, e any) decodedEvent {
	t.Helper()
	var tag string
	fields := map[string]any{}
	present := map[string]bool{}
	switch v := e.(type) {
	case []any:
		require.NotEmpty(t, v)
		tag = v[0].(string)
		names := map[string][]string{kvevents.TagBlockStored: storedFields, kvevents.TagBlockRemoved: removedFields}[tag]
		for i, x := range v[1:] {
			require.Less(t, i, len(names), "%s has more fields than vLLM's schema and kvfence's extra keys", tag)
			fields[names[i]], present[names[i]] = x, true
		}
	case map[string]any:
		tag = v["type"].(string)
		for k, x := range v {
			if k != "type" {
				fields[k], present[k] = x, true
			}
		}
	default:
		t.Fatalf("event of type %T", e)
	}
	d := decodedEvent{tag: tag}
	switch tag {
	case kvevents.TagAllBlocksCleared:
		require.Empty(t, fields)
		return d
	case kvevents.TagBlockStored, kvevents.TagBlockRemoved:
	default:
		t.Fatalf("unknown tag %q", tag)
	}
	for _, h := range fields["block_hashes"].([]any) {
		d.hashes = append(d.hashes, hashOf(t, h))
	}
	d.medium, _ = fields["medium"].(string)
	if tag == kvevents.TagBlockStored {
		if p := fields["parent_block_hash"]; p != nil {
			h := hashOf(t, p)
			d.parent = &h
		}
		d.tokenIDs = fields["token_ids"].([]any)
		d.blockSize = int(asInt(t, fields["block_size"]))
		d.hasLora = present["lora_id"] && present["lora_name"] && fields["lora_id"] == nil && fields["lora_name"] == nil
	}
	extra, ok := fields["extra_keys"].([]any)
	require.True(t, ok, "%s carries extra_keys", tag)
	require.Len(t, extra, len(d.hashes), "one extra-keys entry per block")
	for _, blk := range extra {
		keys := blk.([]any)
		require.Len(t, keys, 1)
		s := keys[0].(string)
		require.True(t, strings.HasPrefix(s, kvevents.DomainKeyPrefix), s)
		dom := strings.TrimPrefix(s, kvevents.DomainKeyPrefix)
		if d.domain != "" {
			require.Equal(t, d.domain, dom, "one domain per event")
		}
		d.domain = dom
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
// holds.
type mirror map[string]map[uint64]bool

func (m mirror) apply(b decodedBatch) {
	for _, e := range b.events {
		switch e.tag {
		case kvevents.TagAllBlocksCleared:
			clear(m)
		case kvevents.TagBlockStored:
			if m[e.domain] == nil {
				m[e.domain] = map[uint64]bool{}
			}
			for _, h := range e.hashes {
				m[e.domain][h] = true
			}
		case kvevents.TagBlockRemoved:
			for _, h := range e.hashes {
				delete(m[e.domain], h)
			}
			if len(m[e.domain]) == 0 {
				delete(m, e.domain)
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
