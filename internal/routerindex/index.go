// Package routerindex is a KV-aware router's index fed by KV events in
// vLLM's array form, built the way llm-d-kv-cache's indexer builds its own
// (its kvevents pool and kvblock packages), so that kvevents' tests and
// examples/router can show what such a router makes of a kvfence pool.
//
// # Model
//
// The router keys blocks by keys of its own ("request keys"), derived from
// tokens alone, never from the engine's block hashes: the key of a block
// is FNV-64a over the canonical CBOR of [parent's key, the block's token
// IDs, its extra features], the first block's parent being the hash of
// [FNV-64a(seed), nil, model name]. The extra features of a block are the
// string extra keys the engine sent for it (llm-d takes them for
// multimodal hashes); kvfence sends one, the domain's cache salt
// (kvevents.CacheSalt), on the first block of each prompt, so that keys of
// equal prompts differ by domain. The model name is the event's lora_name
// when it has one, the topic's model ("kv@POD@MODEL") otherwise.
//
// A BlockStored event adds its pod, on the event's device tier (its
// medium, lower-cased: "gpu", or "cpu" for a host tier; "gpu" when it has
// none), to each of its blocks' request keys and maps each engine block
// hash to its request key, as llm-d's PodEntry{pod, tier} does; the
// parent's request key is looked up by the parent's engine hash, so a
// continuation whose parent was never indexed is skipped, as is an event
// without token_ids. BlockRemoved looks each engine hash up and removes
// the pod's entry of the event's tier from its request key (a block a
// pod holds on two tiers stays on the other); AllBlocksCleared removes
// the pod everywhere. A request is scored by deriving its request keys
// from its tokens, model and salt and counting, per pod, the leading
// blocks the pod holds on any tier.
package routerindex

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strings"
	"sync"

	"github.com/vmihailenco/msgpack/v5"
)

// Index is one router's index over any number of pods.
type Index struct {
	blockSize int
	initHash  uint64

	mu       sync.Mutex
	requests map[uint64]map[podTier]bool // request key -> pods holding it, by tier
	engine   map[uint64]uint64           // engine block hash -> request key
	stats    Stats
}

// Stats count what the index did with the events it was given.
type Stats struct {
	Batches uint64
	// Indexed counts stored blocks indexed; Skipped those it could not
	// index (no token_ids, or a parent it never indexed), as llm-d skips
	// them.
	Indexed, Skipped uint64
	// Removed counts removed blocks whose entry was dropped; Unknown
	// removed blocks it had no entry for.
	Removed, Unknown uint64
	Cleared          uint64
}

// podTier is a pod's hold on a block on one device tier.
type podTier struct{ pod, tier string }

// tierOf is the device tier an event's medium names, as llm-d reads it.
func tierOf(medium any) string {
	if m, ok := medium.(string); ok && m != "" {
		return strings.ToLower(m)
	}
	return "gpu"
}

// New returns an empty index for blocks of blockSize tokens, with the
// hash seed the router shares with its engines ("" for none).
func New(blockSize int, seed string) *Index {
	h := fnv.New64a()
	h.Write([]byte(seed))
	return &Index{blockSize: blockSize, initHash: h.Sum64(),
		requests: map[uint64]map[podTier]bool{}, engine: map[uint64]uint64{}}
}

// Stats returns the index's running totals.
func (x *Index) Stats() Stats {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.stats
}

// Len is the number of request keys some pod holds.
func (x *Index) Len() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return len(x.requests)
}

// Apply indexes one batch (an array-form EventBatch payload) published
// under topic "kv@POD@MODEL".
func (x *Index) Apply(topic string, payload []byte) error {
	pod, model, ok := parseTopic(topic)
	if !ok {
		return fmt.Errorf("routerindex: topic %q is not kv@POD@MODEL", topic)
	}
	var batch struct {
		_      struct{} `msgpack:",array"`
		TS     float64
		Events []msgpack.RawMessage
		Rank   *int
	}
	if err := msgpack.Unmarshal(payload, &batch); err != nil {
		return fmt.Errorf("routerindex: batch: %w", err)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	x.stats.Batches++
	for _, raw := range batch.Events {
		var fields []any
		if err := msgpack.Unmarshal(raw, &fields); err != nil {
			return fmt.Errorf("routerindex: event: %w", err)
		}
		if len(fields) == 0 {
			return errors.New("routerindex: an event without a tag")
		}
		var err error
		switch fields[0] {
		case "BlockStored":
			err = x.storedLocked(pod, model, fields)
		case "BlockRemoved":
			err = x.removedLocked(pod, fields)
		case "AllBlocksCleared":
			x.clearLocked(pod)
		default:
			err = fmt.Errorf("routerindex: unknown event %v", fields[0])
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func at(fields []any, i int) any {
	if i < len(fields) {
		return fields[i]
	}
	return nil
}

func (x *Index) storedLocked(pod, model string, f []any) error {
	if len(f) < 5 {
		return fmt.Errorf("routerindex: BlockStored of %d fields", len(f))
	}
	hashes, err := uints(f[1])
	if err != nil {
		return fmt.Errorf("routerindex: block_hashes: %w", err)
	}
	ids, err := uints(f[3])
	if err != nil {
		return fmt.Errorf("routerindex: token_ids: %w", err)
	}
	tokens := make([]uint32, len(ids))
	for i, id := range ids {
		tokens[i] = uint32(id)
	}
	if name, ok := at(f, 7).(string); ok && name != "" {
		model = name // the adapter stands in for the model, as in llm-d
	}
	parent := x.rootKey(model)
	if p := at(f, 2); p != nil {
		ph, err := uint64Of(p)
		if err != nil {
			return fmt.Errorf("routerindex: parent_block_hash: %w", err)
		}
		rk, ok := x.engine[ph]
		if !ok { // llm-d: "engine key not found"
			x.stats.Skipped += uint64(len(hashes))
			return nil
		}
		parent = rk
	}
	var extra []any
	if e, ok := at(f, 8).([]any); ok {
		extra = e
	}
	keys := x.chain(parent, tokens, func(i int) []string { return stringKeys(extra, i) })
	if len(keys) != len(hashes) {
		x.stats.Skipped += uint64(len(hashes)) // no tokens: nothing to derive keys from
		return nil
	}
	tier := tierOf(at(f, 6))
	for i, h := range hashes {
		x.engine[h] = keys[i]
		pods := x.requests[keys[i]]
		if pods == nil {
			pods = map[podTier]bool{}
			x.requests[keys[i]] = pods
		}
		pods[podTier{pod, tier}] = true
		x.stats.Indexed++
	}
	return nil
}

func (x *Index) removedLocked(pod string, f []any) error {
	if len(f) < 2 {
		return fmt.Errorf("routerindex: BlockRemoved of %d fields", len(f))
	}
	hashes, err := uints(f[1])
	if err != nil {
		return fmt.Errorf("routerindex: block_hashes: %w", err)
	}
	held := podTier{pod, tierOf(at(f, 2))}
	for _, h := range hashes {
		rk, ok := x.engine[h]
		if !ok || !x.requests[rk][held] {
			x.stats.Unknown++
			continue
		}
		delete(x.requests[rk], held)
		if len(x.requests[rk]) == 0 {
			delete(x.requests, rk)
			delete(x.engine, h)
		}
		x.stats.Removed++
	}
	return nil
}

func (x *Index) clearLocked(pod string) {
	for rk, pods := range x.requests {
		for held := range pods {
			if held.pod == pod {
				delete(pods, held)
			}
		}
		if len(pods) == 0 {
			delete(x.requests, rk)
		}
	}
	x.stats.Cleared++
}

// Tiers returns, for each pod holding request key k, the device tiers it
// holds it on.
func (x *Index) Tiers(k uint64) map[string][]string {
	x.mu.Lock()
	defer x.mu.Unlock()
	out := map[string][]string{}
	for held := range x.requests[k] {
		out[held.pod] = append(out[held.pod], held.tier)
	}
	for _, tiers := range out {
		slices.Sort(tiers)
	}
	return out
}

// Keys returns the request keys of tokens' full blocks under model, with
// salt (a domain's kvevents.CacheSalt; "" for none) as the first block's
// extra feature.
func (x *Index) Keys(tokens []uint32, model, salt string) []uint64 {
	return x.chain(x.rootKey(model), tokens, func(i int) []string {
		if i == 0 && salt != "" {
			return []string{salt}
		}
		return nil
	})
}

// Score returns, for each pod that holds the first of keys, how many of
// keys it holds from the first on without a gap.
func (x *Index) Score(keys []uint64) map[string]int {
	x.mu.Lock()
	defer x.mu.Unlock()
	scores := map[string]int{}
	for i, k := range keys {
		held := map[string]bool{}
		for h := range x.requests[k] {
			held[h.pod] = true
		}
		if i == 0 {
			for pod := range held {
				scores[pod] = 1
			}
			continue
		}
		for pod, n := range scores {
			if n == i && held[pod] {
				scores[pod]++
			}
		}
	}
	return scores
}

// Best returns the pod that holds the longest prefix of keys, "" if none
// holds its first block (ties go to the pod named first).
func (x *Index) Best(keys []uint64) (pod string, blocks int) {
	for p, n := range x.Score(keys) {
		if n > blocks || (n == blocks && p < pod) {
			pod, blocks = p, n
		}
	}
	return pod, blocks
}

func (x *Index) rootKey(model string) uint64 {
	return hashBlock(x.initHash, nil, model, nil)
}

// chain derives the keys of tokens' full blocks from parent, block i
// with the extra features extra(i).
func (x *Index) chain(parent uint64, tokens []uint32, extra func(int) []string) []uint64 {
	var keys []uint64
	for i := 0; (i+1)*x.blockSize <= len(tokens); i++ {
		parent = hashBlock(parent, tokens[i*x.blockSize:(i+1)*x.blockSize], "", extra(i))
		keys = append(keys, parent)
	}
	return keys
}

// hashBlock is FNV-64a over the canonical CBOR of [parent, tokens,
// extra]: extra is the model's name for a root (tokens nil), otherwise
// nil or the block's features, each a map {"Hash": feature}.
func hashBlock(parent uint64, tokens []uint32, model string, features []string) uint64 {
	b := cborHead(nil, 4, 3)
	b = cborHead(b, 0, parent)
	if tokens == nil {
		b = append(b, 0xf6) // null
	} else {
		b = cborHead(b, 4, uint64(len(tokens)))
		for _, t := range tokens {
			b = cborHead(b, 0, uint64(t))
		}
	}
	switch {
	case tokens == nil:
		b = cborText(b, model)
	case features == nil:
		b = append(b, 0xf6)
	default:
		b = cborHead(b, 4, uint64(len(features)))
		for _, f := range features {
			b = cborText(cborText(cborHead(b, 5, 1), "Hash"), f)
		}
	}
	h := fnv.New64a()
	h.Write(b)
	return h.Sum64()
}

// cborHead appends a CBOR head of major type major and argument n, in
// its shortest form (canonical CBOR).
func cborHead(b []byte, major byte, n uint64) []byte {
	m := major << 5
	switch {
	case n < 24:
		return append(b, m|byte(n))
	case n <= math.MaxUint8:
		return append(b, m|24, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, m|25), uint16(n))
	case n <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, m|26), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(b, m|27), n)
}

func cborText(b []byte, s string) []byte { return append(cborHead(b, 3, uint64(len(s))), s...) }

// stringKeys are block i's string extra keys, as llm-d's
// ParseRawExtraKeys reads them (a bare string, or the first element of a
// [string, offset] pair); nil for a block without any.
func stringKeys(extra []any, i int) []string {
	if i >= len(extra) {
		return nil
	}
	entry, ok := extra[i].([]any)
	if !ok {
		return nil
	}
	var out []string
	for _, e := range entry {
		switch v := e.(type) {
		case string:
			out = append(out, v)
		case []any:
			if s, ok := at(v, 0).(string); ok {
				out = append(out, s)
			}
		}
	}
	return out
}

func parseTopic(topic string) (pod, model string, ok bool) {
	parts := strings.SplitN(topic, "@", 3)
	if len(parts) != 3 || parts[0] != "kv" {
		return "", "", false
	}
	return parts[1], parts[2], true
}

func uints(v any) ([]uint64, error) {
	list, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("not a list: %T", v)
	}
	out := make([]uint64, len(list))
	for i, e := range list {
		n, err := uint64Of(e)
		if err != nil {
			return nil, err
		}
		out[i] = n
	}
	return out, nil
}

// uint64Of reads an integer, or a byte string's last 8 bytes, as llm-d
// reads block hashes.
func uint64Of(v any) (uint64, error) {
	switch n := v.(type) {
	case int8:
		return uint64(n), nil
	case int16:
		return uint64(n), nil
	case int32:
		return uint64(n), nil
	case int64:
		return uint64(n), nil
	case uint8:
		return uint64(n), nil
	case uint16:
		return uint64(n), nil
	case uint32:
		return uint64(n), nil
	case uint64:
		return n, nil
	case []byte:
		if len(n) >= 8 {
			return binary.BigEndian.Uint64(n[len(n)-8:]), nil
		}
	}
	return 0, fmt.Errorf("not an integer: %T", v)
}
