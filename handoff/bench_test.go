package handoff

import (
	"errors"
	"reflect"
	"testing"
	"time"
)

// BenchmarkManifest2048 encodes and verifies (MAC and parse) the manifest
// of a 2,048-page (32,768-token) request: the work on the handoff's
// critical path before any page moves. Target: ≤ 20 µs. The baseline is
// the two HMAC-SHA256 passes over the same bytes that any signed manifest
// needs, measured in the same benchmark; x-hmac is the codec's total over
// that floor. After the loop it checks the work: the last decode gave back
// the manifest that was encoded, and the same bytes with one bit flipped
// are refused (a decoder that skipped the MAC would pass the first check
// and be timed as the fastest).
func BenchmarkManifest2048(b *testing.B) {
	k := testKey(b)
	m := sampleManifest(2048)
	buf, err := m.AppendEncode(nil, k)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(buf)))
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	var got Manifest
	for i := 0; i < b.N; i++ {
		if buf, err = m.AppendEncode(buf[:0], k); err != nil {
			b.Fatal(err)
		}
		if got, err = Decode(buf, k); err != nil {
			b.Fatal(err)
		}
	}
	codec := time.Since(start)
	b.StopTimer()
	if !got.Expires.Equal(m.Expires) {
		b.Fatalf("decoded expiry %v, encoded %v", got.Expires, m.Expires)
	}
	got.Expires = m.Expires
	if !reflect.DeepEqual(got, m) {
		b.Fatalf("decoded manifest differs from the encoded one:\n got %+v\nwant %+v", got, m)
	}
	buf[len(buf)/2] ^= 1
	if _, err := Decode(buf, k); !errors.Is(err, ErrBadMAC) {
		b.Fatalf("a manifest with a flipped bit decoded with error %v, want ErrBadMAC", err)
	}
	buf[len(buf)/2] ^= 1
	var mac [macLen]byte
	start = time.Now()
	for i := 0; i < b.N; i++ {
		k.sum(mac[:0], buf)
		k.sum(mac[:0], buf)
	}
	floor := time.Since(start)
	b.ReportMetric(float64(codec.Nanoseconds())/float64(b.N)/1e3, "µs/op")
	b.ReportMetric(codec.Seconds()/floor.Seconds(), "x-hmac")
}
