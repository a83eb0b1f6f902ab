package handoff

import (
	"testing"
	"time"
)

// BenchmarkManifest2048 encodes and verifies (MAC and parse) the manifest
// of a 2,048-page (32,768-token) request: the work on the handoff's
// critical path before any page moves. Target: ≤ 20 µs. The baseline is
// the two HMAC-SHA256 passes over the same bytes that any signed manifest
// needs, measured in the same benchmark; x-hmac is the codec's total over
// that floor.
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
	for i := 0; i < b.N; i++ {
		buf, _ = m.AppendEncode(buf[:0], k)
		if _, err := Decode(buf, k); err != nil {
			b.Fatal(err)
		}
	}
	codec := time.Since(start)
	b.StopTimer()
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
