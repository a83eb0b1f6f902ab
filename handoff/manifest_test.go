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

func sampleManifest(pages int) Manifest {
	m := Manifest{
		TransferID: [16]byte{1, 2, 3}, RequestID: "req-1", Tenant: "acme", Domain: "acme",
		PromptTokens: pages*16 - 3, MaxNewTokens: 256,
		Geometry: GeometryFingerprint{TokensPerPage: 16, Layers: 32, KVHeads: 8, HeadDim: 128, DType: kvcache.BF16, Layout: LayoutKVPerLayer},
		Expires:  time.Unix(1_800_000_000, 123),
		Checksum: 0xdeadbeef,
	}
	for i := range pages {
		m.Generations = append(m.Generations, uint32(i*3+1))
	}
	return m
}

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
	for _, m := range []Manifest{sampleManifest(1), sampleManifest(2), sampleManifest(2048), sealedManifest(1), sealedManifest(7), longest} {
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
		{"version 2", edit(func(b []byte) []byte { le.PutUint16(b[4:], 2); return b }), ErrMalformedManifest},
		{"unknown flag", edit(func(b []byte) []byte { le.PutUint16(b[6:], 2); return b }), ErrMalformedManifest},
		{"sealed with a checksum", edit(func(b []byte) []byte { le.PutUint16(b[6:], FlagChecksumSealed); return b }), ErrMalformedManifest},
		{"zero prompt", edit(func(b []byte) []byte { le.PutUint64(b[32:], 0); return b }), ErrMalformedManifest},
		{"huge prompt", edit(func(b []byte) []byte { le.PutUint64(b[32:], 1<<62); return b }), ErrMalformedManifest},
		{"prompt vs pages", edit(func(b []byte) []byte { le.PutUint64(b[32:], 16*5); return b }), ErrMalformedManifest},
		{"huge max new", edit(func(b []byte) []byte { le.PutUint64(b[40:], 1<<63); return b }), ErrMalformedManifest},
		{"zero tokens per page", edit(func(b []byte) []byte { le.PutUint32(b[48:], 0); return b }), ErrMalformedManifest},
		{"zero layers", edit(func(b []byte) []byte { le.PutUint32(b[52:], 0); return b }), ErrMalformedManifest},
		{"bad dtype", edit(func(b []byte) []byte { b[64] = 99; return b }), ErrMalformedManifest},
		{"bad layout", edit(func(b []byte) []byte { b[65] = 3; return b }), ErrMalformedManifest},
		{"CRC32C checksum (earlier builds)", edit(func(b []byte) []byte { b[66] = 1; return b }), ErrMalformedManifest},
		{"unknown checksum alg", edit(func(b []byte) []byte { b[66] = 3; return b }), ErrMalformedManifest},
		{"reserved", edit(func(b []byte) []byte { b[67] = 1; return b }), ErrMalformedManifest},
		{"page count", edit(func(b []byte) []byte { le.PutUint32(b[72:], 4); return b }), ErrMalformedManifest},
		{"empty request ID", edit(func(b []byte) []byte { le.PutUint16(b[76:], 0); return b }), ErrMalformedManifest},
		{"ID length past end", edit(func(b []byte) []byte { le.PutUint16(b[76:], 60000); return b }), ErrMalformedManifest},
		{"trailing byte", edit(func(b []byte) []byte { return append(b, 0) }), ErrMalformedManifest},
		{"missing generation", edit(func(b []byte) []byte { return b[:len(b)-4] }), ErrMalformedManifest},
		{"invalid UTF-8 tenant", edit(func(b []byte) []byte { b[fixedLen+len("req-1")] = 0xff; return b }), ErrMalformedManifest},
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
		"pages vs prompt": func(m *Manifest) { m.PromptTokens = 1 },
		"bad geometry":    func(m *Manifest) { m.Geometry.HeadDim = 0 },
		"bad layout":      func(m *Manifest) { m.Geometry.Layout = 0 },
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
	spec := sealedManifest(3) // a pool of a cache spec: regions, digest
	spec.Geometry = GeometryFingerprint{TokensPerPage: 16, Layers: 3, KVHeads: 0x1234, HeadDim: 0x5678, DType: kvcache.FP16, Layout: LayoutCacheSpec}
	b, err := spec.AppendEncode(nil, k)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
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
		if want := Fingerprint(m.Geometry.Geometry()); m.Geometry.Layout == LayoutKVPerLayer && want != m.Geometry {
			t.Fatalf("accepted geometry %v does not round-trip", m.Geometry)
		}
		again, err := m.AppendEncode(nil, k)
		if err != nil || !bytes.Equal(again, signed) {
			t.Fatalf("accepted manifest re-encodes differently (%v)", err)
		}
	})
}

func ExampleManifest() {
	key, _ := NewKey([]byte("a 32-byte key shared by the pools"))
	m := Manifest{
		RequestID: "req-7", Tenant: "acme", Domain: "acme",
		PromptTokens: 40, MaxNewTokens: 100,
		Geometry:    Fingerprint(kvcache.Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 1, HeadDim: 8, DType: kvcache.FP16}),
		Expires:     time.Unix(1_900_000_000, 0),
		Generations: []uint32{1, 1, 1},
	}
	wire, _ := m.AppendEncode(nil, key)
	got, err := Decode(wire, key)
	fmt.Println(len(wire), got.RequestID, got.Pages(), err)

	wire[len(wire)-1] ^= 1 // one bit of the MAC
	_, err = Decode(wire, key)
	fmt.Println(err)
	// Output:
	// 139 req-7 3 <nil>
	// handoff: manifest MAC does not verify
}
