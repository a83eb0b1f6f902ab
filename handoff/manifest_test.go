package handoff

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvcache"
)

var testSecret = []byte("0123456789abcdef0123456789abcdef")

func testKey(t testing.TB) *Key {
	k, err := NewKey(testSecret)
	require.NoError(t, err)
	return k
}

// sampleSpec is the spec of a 32-layer GQA model, as a manifest carries
// it.
var sampleSpec = wireSpec(kvcache.GeometrySpec(kvcache.Geometry{TokensPerPage: 16, Layers: 32, KVHeads: 8, HeadDim: 128, DType: kvcache.BF16}))

// hybridWireSpec is a hybrid model's spec (per-token MLA latents and
// indexer keys, a sliding window, a state slot), as a manifest carries
// it.
var hybridWireSpec = func() kvcache.CacheSpec {
	s := kvcache.CacheSpec{Groups: []kvcache.CacheGroup{
		{Name: "kv", Kind: kvcache.GroupPerToken, TokensPerPage: 16, Regions: append(
			kvcache.MLALatent([]int{1, 3}, 512, 64, kvcache.BF16, 16), kvcache.IndexerKeys([]int{1, 3}, 128, 16)...)},
		{Name: "swa", Kind: kvcache.GroupSlidingWindow, TokensPerPage: 16, WindowTokens: 128,
			Regions: kvcache.AttentionKVOf([]int{2}, 8, 64, kvcache.BF16, 16)},
		{Name: "state", Kind: kvcache.GroupState,
			Regions: kvcache.LinearAttentionState([]int{0, 4}, 1024, 4, kvcache.BF16, 8, 64, 64, kvcache.FP32)},
	}, Shard: kvcache.Shard{Rank: 1, Size: 2}}
	return wireSpec(s)
}()

// manifestOf is a manifest of spec for a prompt of prompt tokens.
func manifestOf(spec kvcache.CacheSpec, prompt int) Manifest {
	m := Manifest{
		TransferID: [16]byte{1, 2, 3}, RequestID: "req-1", Tenant: "acme", Domain: "acme",
		PromptTokens: prompt, MaxNewTokens: 256, Spec: wireSpec(spec),
		Extents:  wireExtents(spec.HandoffExtents(prompt)),
		Expires:  time.Unix(1_800_000_000, 123),
		Checksum: 0xdeadbeef,
	}
	units := 0
	for _, e := range m.Extents {
		units += e.Units
	}
	for i := range units {
		m.Generations = append(m.Generations, uint32(i*3+1))
	}
	return m
}

func sampleManifest(pages int) Manifest { return manifestOf(sampleSpec, pages*16-3) }

// sealedManifest is a manifest whose checksum follows in a seal.
func sealedManifest(pages int) Manifest {
	m := sampleManifest(pages)
	m.Checksum, m.ChecksumSealed = 0, true
	return m
}

func TestManifestRoundTrip(t *testing.T) {
	k := testKey(t)
	longest := sampleManifest(3)
	longest.RequestID, longest.Tenant = strings.Repeat("r", kvcache.MaxIDLen), strings.Repeat("t", kvcache.MaxIDLen)
	longest.Domain = "tenant:" + longest.Tenant
	for _, m := range []Manifest{sampleManifest(1), sampleManifest(2), sampleManifest(2048), sealedManifest(1), sealedManifest(7), longest,
		manifestOf(hybridWireSpec, 1), manifestOf(hybridWireSpec, 1000)} {
		b, err := m.AppendEncode(nil, k)
		require.NoError(t, err)
		assert.Equal(t, m.encodedLen(), len(b))
		got, err := Decode(b, k)
		require.NoError(t, err)
		assert.Equal(t, m.Expires.UnixNano(), got.Expires.UnixNano())
		got.Expires = m.Expires
		assert.Equal(t, m, got)
	}
}

// resign replaces b's MAC so that the parser, not the MAC check, judges it.
func resign(k *Key, body []byte) []byte {
	return k.sum(append([]byte(nil), body...), body)
}

func TestManifestRefusesMalformed(t *testing.T) {
	k := testKey(t)
	m := sampleManifest(3)
	specAt := fixedLen + len(m.RequestID) + len(m.Tenant) + len(m.Domain)
	extentsAt := specAt + specLen(m.Spec)
	good, err := m.AppendEncode(nil, k)
	require.NoError(t, err)
	body := good[:len(good)-macLen]
	le := binary.LittleEndian
	edit := func(f func(b []byte) []byte) []byte { return resign(k, f(bytes.Clone(body))) }
	tests := []struct {
		name string
		b    []byte
		want error
	}{
		{"empty", nil, ErrMalformedManifest},
		{"short", good[:40], ErrMalformedManifest},
		{"bad MAC", append(bytes.Clone(body), make([]byte, macLen)...), ErrBadMAC},
		{"flipped byte", func() []byte { b := bytes.Clone(good); b[30] ^= 1; return b }(), ErrBadMAC},
		{"other key", func() []byte {
			other, _ := NewKey(bytes.Repeat([]byte{7}, 32))
			b, _ := m.AppendEncode(nil, other)
			return b
		}(), ErrBadMAC},
		{"magic", edit(func(b []byte) []byte { b[0] = 'X'; return b }), ErrMalformedManifest},
		{"version 1", edit(func(b []byte) []byte { le.PutUint16(b[4:], 1); return b }), ErrMalformedManifest},
		{"version 3", edit(func(b []byte) []byte { le.PutUint16(b[4:], 3); return b }), ErrMalformedManifest},
		{"unknown flag", edit(func(b []byte) []byte { le.PutUint16(b[6:], 2); return b }), ErrMalformedManifest},
		{"sealed with a checksum", edit(func(b []byte) []byte { le.PutUint16(b[6:], FlagChecksumSealed); return b }), ErrMalformedManifest},
		{"zero prompt", edit(func(b []byte) []byte { le.PutUint64(b[32:], 0); return b }), ErrMalformedManifest},
		{"huge prompt", edit(func(b []byte) []byte { le.PutUint64(b[32:], 1<<62); return b }), ErrMalformedManifest},
		{"prompt vs units", edit(func(b []byte) []byte { le.PutUint64(b[32:], 16*5); return b }), ErrMalformedManifest},
		{"huge max new", edit(func(b []byte) []byte { le.PutUint64(b[40:], 1<<63); return b }), ErrMalformedManifest},
		{"CRC32C checksum (earlier builds)", edit(func(b []byte) []byte { b[48] = 1; return b }), ErrMalformedManifest},
		{"unknown checksum alg", edit(func(b []byte) []byte { b[48] = 3; return b }), ErrMalformedManifest},
		{"no groups", edit(func(b []byte) []byte { b[49] = 0; return b }), ErrMalformedManifest},
		{"two groups in the header", edit(func(b []byte) []byte { b[49] = 2; return b }), ErrMalformedManifest},
		{"reserved", edit(func(b []byte) []byte { b[50] = 1; return b }), ErrMalformedManifest},
		{"unit count", edit(func(b []byte) []byte { le.PutUint32(b[56:], 4); return b }), ErrMalformedManifest},
		{"spec length", edit(func(b []byte) []byte { le.PutUint32(b[60:], le.Uint32(b[60:])+1); return b }), ErrMalformedManifest},
		{"empty request ID", edit(func(b []byte) []byte { le.PutUint16(b[64:], 0); return b }), ErrMalformedManifest},
		{"ID length past end", edit(func(b []byte) []byte { le.PutUint16(b[64:], 60000); return b }), ErrMalformedManifest},
		{"trailing byte", edit(func(b []byte) []byte { return append(b, 0) }), ErrMalformedManifest},
		{"missing generation", edit(func(b []byte) []byte { return b[:len(b)-4] }), ErrMalformedManifest},
		{"invalid UTF-8 tenant", edit(func(b []byte) []byte { b[fixedLen+len("req-1")] = 0xff; return b }), ErrMalformedManifest},
		{"zero tokens per page", edit(func(b []byte) []byte { le.PutUint32(b[specAt+specShardLen+5:], 0); return b }), ErrMalformedManifest},
		{"unknown group kind", edit(func(b []byte) []byte { b[specAt+specShardLen] = 9; return b }), ErrMalformedManifest},
		{"bad dtype", edit(func(b []byte) []byte { b[specAt+specShardLen+specGroupLen+8] = 99; return b }), ErrMalformedManifest},
		{"odd region bytes", edit(func(b []byte) []byte { le.PutUint64(b[specAt+specShardLen+specGroupLen:], 4097); return b }), ErrMalformedManifest},
		{"shard rank past its size", edit(func(b []byte) []byte { le.PutUint32(b[specAt:], 1); le.PutUint32(b[specAt+4:], 1); return b }), ErrMalformedManifest},
		{"extent's first page", edit(func(b []byte) []byte { le.PutUint32(b[extentsAt:], 1); return b }), ErrMalformedManifest},
		{"extent's units", edit(func(b []byte) []byte { le.PutUint32(b[extentsAt+4:], 2); return b }), ErrMalformedManifest},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Decode(tt.b, k)
			assert.ErrorIs(t, err, tt.want)
			if tt.want == ErrMalformedManifest {
				assert.NotErrorIs(t, err, ErrBadMAC)
			}
		})
	}
}

func TestManifestEncodeRefusesInvalid(t *testing.T) {
	k := testKey(t)
	tests := map[string]func(m *Manifest){
		"no request ID":   func(m *Manifest) { m.RequestID = "" },
		"long tenant":     func(m *Manifest) { m.Tenant = string(make([]byte, kvcache.MaxIDLen+1)) },
		"no domain":       func(m *Manifest) { m.Domain = "" },
		"long domain":     func(m *Manifest) { m.Domain = strings.Repeat("d", maxDomainLen+1) },
		"no expiry":       func(m *Manifest) { m.Expires = time.Time{} },
		"units vs prompt": func(m *Manifest) { m.PromptTokens = 1 },
		"bad spec":        func(m *Manifest) { m.Spec.Groups[0].TokensPerPage = 0 },
		"no spec":         func(m *Manifest) { m.Spec = kvcache.CacheSpec{} },
		"bad shard":       func(m *Manifest) { m.Spec.Shard = kvcache.Shard{Rank: 2, Size: 2} },
		"extent missing":  func(m *Manifest) { m.Extents = m.Extents[:0] },
		"sealed checksum": func(m *Manifest) { m.ChecksumSealed = true },
	}
	for name, f := range tests {
		t.Run(name, func(t *testing.T) {
			m := sampleManifest(2)
			f(&m)
			_, err := m.AppendEncode(nil, k)
			assert.ErrorIs(t, err, ErrMalformedManifest)
		})
	}
	_, err := NewKey(make([]byte, MinKeyBytes-1))
	assert.ErrorIs(t, err, ErrInvalidConfig)
}

func fuzzSeeds(f *testing.F, k *Key) {
	for _, m := range []Manifest{sampleManifest(1), sampleManifest(3), sampleManifest(64), sealedManifest(2)} {
		b, err := m.AppendEncode(nil, k)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	for _, prompt := range []int{1, 17, 500} {
		hybrid := manifestOf(hybridWireSpec, prompt) // every kind of group
		b, err := hybrid.AppendEncode(nil, k)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte(magic))
}

// FuzzDecode: Decode never panics, and whatever it accepts re-encodes to
// the same bytes (one encoding per manifest).
func FuzzDecode(f *testing.F) {
	k := testKey(f)
	fuzzSeeds(f, k)
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := Decode(b, k)
		if err != nil {
			if !errors.Is(err, ErrMalformedManifest) && !errors.Is(err, ErrBadMAC) {
				t.Fatalf("unexpected error kind: %v", err)
			}
			return
		}
		again, err := m.AppendEncode(nil, k)
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("accepted manifest re-encodes differently (%v)", err)
		}
	})
}

// FuzzParse drives the parser behind the MAC: the fuzzer's bytes are
// signed, so every mutation reaches the field checks.
func FuzzParse(f *testing.F) {
	k := testKey(f)
	fuzzSeeds(f, k)
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) >= macLen {
			b = b[:len(b)-macLen]
		}
		signed := resign(k, b)
		m, err := Decode(signed, k)
		if err != nil {
			if !errors.Is(err, ErrMalformedManifest) {
				t.Fatalf("signed bytes refused for another reason: %v", err)
			}
			return
		}
		again, err := m.AppendEncode(nil, k)
		if err != nil || !bytes.Equal(again, signed) {
			t.Fatalf("accepted manifest re-encodes differently (%v)", err)
		}
	})
}

func ExampleManifest() {
	key, _ := NewKey([]byte("a 32-byte key shared by the pools"))
	spec := kvcache.GeometrySpec(kvcache.Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 1, HeadDim: 8, DType: kvcache.FP16})
	m := Manifest{
		RequestID: "req-7", Tenant: "acme", Domain: "acme",
		PromptTokens: 40, MaxNewTokens: 100,
		Spec: spec, Extents: spec.HandoffExtents(40),
		Expires:     time.Unix(1_900_000_000, 0),
		Generations: []uint32{1, 1, 1},
	}
	wire, _ := m.AppendEncode(nil, key)
	got, err := Decode(wire, key)
	fmt.Println(len(wire), got.RequestID, got.Units(), err)

	wire[len(wire)-1] ^= 1 // one bit of the MAC
	_, err = Decode(wire, key)
	fmt.Println(err)
	// Output:
	// 196 req-7 3 <nil>
	// handoff: manifest MAC does not verify
}
