package kvevents

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvfence/kvfence/kvcache"
)

// refEncoder is the encoder the package had before it wrote msgpack
// itself: the same shapes, through github.com/vmihailenco/msgpack/v5's
// low-level encoder (the library llm-d decodes with). The tests hold the
// two to the same bytes.
type refEncoder struct {
	buf        bytes.Buffer
	enc        *msgpack.Encoder
	form       Encoding
	fullHashes bool
	medium     string
	hostMedium string
	blockSize  int
	rank       int
}

func newRefEncoder(form Encoding, fullHashes bool, medium, hostMedium string, blockSize, rank int) *refEncoder {
	e := &refEncoder{form: form, fullHashes: fullHashes, medium: medium, hostMedium: hostMedium, blockSize: blockSize, rank: rank}
	e.enc = msgpack.NewEncoder(&e.buf)
	return e
}

func (e *refEncoder) batch(t testing.TB, ts time.Time, events []kvcache.KVEvent) []byte {
	e.buf.Reset()
	w := &refWriter{t: t, enc: e.enc}
	name := func(n string) {
		if e.form == MapEvents {
			w.do(w.enc.EncodeString(n))
		}
	}
	if e.form == MapEvents {
		w.do(w.enc.EncodeMapLen(3))
	} else {
		w.do(w.enc.EncodeArrayLen(3))
	}
	name("ts")
	w.do(w.enc.EncodeFloat64(float64(ts.UnixNano()) / 1e9))
	name("events")
	w.do(w.enc.EncodeArrayLen(len(events)))
	for i := range events {
		e.event(w, &events[i])
	}
	name("data_parallel_rank")
	w.do(w.enc.EncodeInt(int64(e.rank)))
	return e.buf.Bytes()
}

func (e *refEncoder) event(w *refWriter, ev *kvcache.KVEvent) {
	head := func(fields int, tag string) {
		if e.form == MapEvents {
			w.do(w.enc.EncodeMapLen(fields))
			w.do(w.enc.EncodeString("type"))
		} else {
			w.do(w.enc.EncodeArrayLen(fields))
		}
		w.do(w.enc.EncodeString(tag))
	}
	field := func(name string) {
		if e.form == MapEvents {
			w.do(w.enc.EncodeString(name))
		}
	}
	hash := func(k *kvcache.BlockKey) {
		if e.fullHashes {
			w.do(w.enc.EncodeBytes(k[:]))
		} else {
			w.do(w.enc.EncodeUint(BlockHash(*k)))
		}
	}
	medium := e.medium
	if ev.Medium == kvcache.MediumHost {
		medium = e.hostMedium
	}
	hashes := func() {
		w.do(w.enc.EncodeArrayLen(len(ev.Keys)))
		for i := range ev.Keys {
			hash(&ev.Keys[i])
		}
	}
	switch ev.Kind {
	case kvcache.KVStored:
		head(9, TagBlockStored)
		field("block_hashes")
		hashes()
		field("parent_block_hash")
		if ev.Parent.IsZero() {
			w.do(w.enc.EncodeNil())
		} else {
			hash(&ev.Parent)
		}
		field("token_ids")
		if len(ev.TokenIDs) == len(ev.Keys)*e.blockSize {
			w.do(w.enc.EncodeArrayLen(len(ev.TokenIDs)))
			for _, tok := range ev.TokenIDs {
				w.do(w.enc.EncodeInt(int64(tok)))
			}
		} else {
			w.do(w.enc.EncodeArrayLen(0))
		}
		field("block_size")
		w.do(w.enc.EncodeInt(int64(e.blockSize)))
		field("lora_id")
		w.do(w.enc.EncodeNil())
		field("medium")
		w.do(w.enc.EncodeString(medium))
		field("lora_name")
		if ev.Adapter == "" {
			w.do(w.enc.EncodeNil())
		} else {
			w.do(w.enc.EncodeString(ev.Adapter))
		}
		field("extra_keys")
		w.do(w.enc.EncodeArrayLen(len(ev.Keys)))
		for i := range ev.Keys {
			if i == 0 && ev.Parent.IsZero() {
				w.do(w.enc.EncodeArrayLen(1))
				w.do(w.enc.EncodeString(CacheSalt(ev.Domain)))
			} else {
				w.do(w.enc.EncodeNil())
			}
		}
	case kvcache.KVRemoved:
		head(3, TagBlockRemoved)
		field("block_hashes")
		hashes()
		field("medium")
		w.do(w.enc.EncodeString(medium))
	default:
		head(1, TagAllBlocksCleared)
	}
}

type refWriter struct {
	t   testing.TB
	enc *msgpack.Encoder
}

func (w *refWriter) do(err error) {
	if err != nil {
		w.t.Fatal(err)
	}
}

// randomKey has a BlockHash of a random width, so that every msgpack
// integer form (fixint, uint 8, 16, 32, 64) occurs.
func randomKey(r *rand.Rand) kvcache.BlockKey {
	var k kvcache.BlockKey
	for i := range k {
		k[i] = byte(r.Uint32())
	}
	zero := 24 + r.IntN(9) // bytes 24.. zero-1 are cleared
	for i := 24; i < zero; i++ {
		k[i] = 0
	}
	return k
}

// adapters are the adapters of randomEvents' stored events.
var adapters = []string{"", "", "lora-7", strings.Repeat("a", 40)}

// randomEvents returns n events of up to maxKeys keys each, in pages of
// blockSize tokens.
func randomEvents(r *rand.Rand, domains []string, n, maxKeys, blockSize int) []kvcache.KVEvent {
	evs := make([]kvcache.KVEvent, n)
	for i := range evs {
		ev := &evs[i]
		switch r.IntN(5) {
		case 0:
			ev.Kind = kvcache.KVCleared
			if r.IntN(2) == 0 {
				ev.Kind = 0 // a resynchronisation
			}
			continue
		case 1, 2:
			ev.Kind = kvcache.KVStored
			if r.IntN(2) == 0 {
				ev.Parent = randomKey(r)
			}
		default:
			ev.Kind = kvcache.KVRemoved
		}
		ev.Domain = domains[r.IntN(len(domains))]
		ev.Medium = kvcache.Medium(r.IntN(2)) // the device or the host tier
		ev.Keys = make([]kvcache.BlockKey, 1+r.IntN(maxKeys))
		for j := range ev.Keys {
			ev.Keys[j] = randomKey(r)
		}
		if ev.Kind == kvcache.KVStored {
			ev.Adapter = adapters[r.IntN(len(adapters))]
			if r.IntN(3) > 0 && len(ev.Keys)*blockSize <= 1<<14 { // most with tokens, of every integer width
				ev.TokenIDs = make([]int32, len(ev.Keys)*blockSize)
				for j := range ev.TokenIDs {
					ev.TokenIDs[j] = int32(r.Uint32()) >> r.IntN(32)
				}
			}
		}
	}
	return evs
}

// TestEncoderMatchesMsgpackLibrary: in both encodings and both hash
// forms, for ranks, block sizes and media of every integer and string
// width, domains of every string width, events of every array width and
// batches of every length width, the encoder writes exactly the bytes
// vmihailenco/msgpack writes for the same shapes, within its bound.
func TestEncoderMatchesMsgpackLibrary(t *testing.T) {
	r := rand.New(rand.NewPCG(17, 1))
	domains := []string{"", "team", "tenant:acme", strings.Repeat("d", 40), strings.Repeat("e", 300), strings.Repeat("f", 70_000)}
	ranks := []int{0, 1, 127, 128, 255, 256, 70_000, 1 << 40, -1, -32, -33, -128, -129, -40_000, -1 << 40}
	blockSizes := []int{16, 128, 256, 1 << 20}
	media := []string{"GPU", "cpu_" + strings.Repeat("x", 40), strings.Repeat("m", 300)}
	ts := time.Unix(1_764_600_000, 123_456_789)
	for _, form := range []Encoding{ArrayEvents, MapEvents} {
		for _, full := range []bool{false, true} {
			for round := range 40 {
				rank, bs, medium := ranks[round%len(ranks)], blockSizes[round%len(blockSizes)], media[round%len(media)]
				n := []int{0, 1, 2, 15, 16, 40}[round%6]
				evs := randomEvents(r, domains[:len(domains)-1], n, 20, bs)
				host := media[(round+1)%len(media)]
				got := newEncoder(form, full, medium, host, bs, rank)
				ref := newRefEncoder(form, full, medium, host, bs, rank)
				// twice with the same encoder: its cached domain entry must
				// not leak from one batch into the next
				for range 2 {
					b := got.batch(nil, ts, evs)
					want := ref.batch(t, ts, evs)
					if !bytes.Equal(b, want) {
						t.Fatalf("%v full=%v rank=%d block=%d medium=%d bytes, %d events: bytes differ\n got  %x\n want %x",
							form, full, rank, bs, len(medium), n, b, want)
					}
					if bound := got.batchBound(evs); len(b) > bound {
						t.Fatalf("%v full=%v: %d bytes, bound %d", form, full, len(b), bound)
					}
				}
			}
		}
	}
	// Lengths past 16 bits: a batch of 70,000 events, an event of 70,000
	// keys, a domain of 70,000 bytes.
	for _, form := range []Encoding{ArrayEvents, MapEvents} {
		keys := []kvcache.KVEvent{{Kind: kvcache.KVRemoved, Domain: "team", Keys: make([]kvcache.BlockKey, 70_000)},
			{Kind: kvcache.KVStored, Domain: "team", Keys: make([]kvcache.BlockKey, 70_000)},
			{Kind: kvcache.KVStored, Domain: "team", Keys: make([]kvcache.BlockKey, 5000), TokenIDs: make([]int32, 5000*16)}}
		domain := []kvcache.KVEvent{{Kind: kvcache.KVStored, Domain: domains[len(domains)-1], Keys: make([]kvcache.BlockKey, 2)}}
		many := make([]kvcache.KVEvent, 70_000)
		for i := range many {
			many[i].Kind = kvcache.KVCleared
		}
		for _, evs := range [][]kvcache.KVEvent{keys, domain, many} {
			b := newEncoder(form, false, "GPU", "CPU", 16, 0).batch(nil, ts, evs)
			if want := newRefEncoder(form, false, "GPU", "CPU", 16, 0).batch(t, ts, evs); !bytes.Equal(b, want) {
				t.Fatalf("%v, %d events of %d keys: bytes differ", form, len(evs), len(evs[0].Keys))
			}
		}
	}
}

// TestEncoderAppendsWithoutAllocating: a batch into a buffer with room
// costs no allocation, whichever the domains.
func TestEncoderAppendsWithoutAllocating(t *testing.T) {
	r := rand.New(rand.NewPCG(17, 2))
	evs := randomEvents(r, []string{"team", "tenant:acme"}, 32, 128, 16)
	e := newEncoder(MapEvents, false, "GPU", "CPU", 16, 0)
	buf := make([]byte, 0, e.batchBound(evs))
	ts := time.Now()
	e.batch(buf, ts, evs) // the domain entry's buffer grows once
	if n := testing.AllocsPerRun(100, func() { e.batch(buf, ts, evs) }); n != 0 {
		t.Fatalf("%v allocations per batch", n)
	}
}

// benchmarkEvents are BenchmarkAdmitReleaseObserved's two events of a
// cycle: a prompt of 128 pages stored, another one removed.
func benchmarkEvents() []kvcache.KVEvent {
	r := rand.New(rand.NewPCG(17, 3))
	keys := make([]kvcache.BlockKey, 256)
	for i := range keys {
		for j := range keys[i] {
			keys[i][j] = byte(r.Uint32())
		}
	}
	toks := make([]int32, 2048)
	for i := range toks {
		toks[i] = r.Int32N(150_000) // a vocabulary of 150k: mostly 3- and 5-byte integers
	}
	return []kvcache.KVEvent{
		{Kind: kvcache.KVStored, Domain: "tenant:bench", Keys: keys[:128], Tokens: 2048, TokenIDs: toks},
		{Kind: kvcache.KVRemoved, Domain: "tenant:bench", Keys: keys[128:], Tokens: 2048},
	}
}

// BenchmarkEncode encodes the two 128-block events of a cycle of
// metrics' BenchmarkAdmitReleaseObserved (the default encoding and
// hashes) as one batch, with the stored prompt's 2,048 token IDs
// ("own/tokens") or without ("own"); "msgpack" is the batch with tokens
// through refEncoder, what the publisher did before. Compare ns/event in
// the same run.
func BenchmarkEncode(b *testing.B) {
	withTokens := benchmarkEvents()
	plain := slices.Clone(withTokens)
	plain[0].TokenIDs = nil
	evs := withTokens
	ts := time.Now()
	b.Run("own", func(b *testing.B) {
		e := newEncoder(ArrayEvents, false, "GPU", "CPU", 16, 0)
		buf := make([]byte, 0, e.batchBound(plain))
		b.ReportAllocs()
		for b.Loop() {
			buf = e.batch(buf[:0], ts, plain)
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(plain)), "ns/event")
		b.ReportMetric(float64(len(buf))/float64(len(plain)), "B/event")
	})
	b.Run("own/tokens", func(b *testing.B) {
		e := newEncoder(ArrayEvents, false, "GPU", "CPU", 16, 0)
		buf := make([]byte, 0, e.batchBound(evs))
		b.ReportAllocs()
		for b.Loop() {
			buf = e.batch(buf[:0], ts, evs)
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(evs)), "ns/event")
		b.ReportMetric(float64(len(buf))/float64(len(evs)), "B/event")
	})
	b.Run("msgpack", func(b *testing.B) {
		ref := newRefEncoder(ArrayEvents, false, "GPU", "CPU", 16, 0)
		b.ReportAllocs()
		for b.Loop() {
			ref.batch(b, ts, evs)
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(evs)), "ns/event")
	})
}
