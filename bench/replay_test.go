package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvfence/kvfence/bench/internal/kvsim"
	"github.com/kvfence/kvfence/kvcache"
)

// sharedTrace opens a public trace from $KVFENCE_TRACES, else from the
// nearest shared/traces beside a directory above this one (the traces are
// data, never in the repository), and skips when it is absent.
func sharedTrace(tb testing.TB, rel string) *os.File {
	tb.Helper()
	dir := os.Getenv("KVFENCE_TRACES")
	if dir == "" {
		for d, _ := os.Getwd(); ; d = filepath.Dir(d) {
			if fi, err := os.Stat(filepath.Join(d, "shared", "traces")); err == nil && fi.IsDir() {
				dir = filepath.Join(d, "shared", "traces")
				break
			}
			if filepath.Dir(d) == d {
				tb.Skipf("%s absent (public traces live in ../shared/traces, or set KVFENCE_TRACES)", rel)
			}
		}
	}
	f, err := os.Open(filepath.Join(dir, rel))
	if err != nil {
		tb.Skipf("%s: %v", rel, err)
	}
	tb.Cleanup(func() { f.Close() })
	return f
}

// BenchmarkReplayConversation: one kvbench replay of Mooncake's
// conversation trace (12,031 requests over an hour, prefix cache on,
// zero policy, 8 bytes of KV per token in host memory), at a 3M-token
// pool of 512- and of 16-token pages, and on a pool too small for its
// load (512 pages of 512 tokens: requests queue and time out). The same
// replay under the unsafe no-scrub baseline runs in the same loop.
// Target: under 30 s per replay on a 2-core machine. Each replay must
// account for every request and hit no more than its served bound. With
// -short (CI) only the small pool runs, to keep its checks exercised.
func BenchmarkReplayConversation(b *testing.B) {
	tr, _, err := kvsim.ReadTrace(sharedTrace(b, "mooncake/conversation_trace.jsonl"), "conversation", kvsim.FormatMooncake, kvsim.ImportConfig{})
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name        string
		pageTokens  int
		pages       int
		allAdmitted bool
	}{
		{"pool=3M/page=512", 512, 3_000_000 / 512, true},
		{"pool=3M/page=16", 16, 3_000_000 / 16, true},
		{"pool=512x512", 512, 512, false},
	} {
		b.Run(c.name, func(b *testing.B) {
			if testing.Short() && c.allAdmitted {
				b.Skip("-short: the small pool only")
			}
			g := kvcache.Geometry{TokensPerPage: c.pageTokens, Layers: 1, KVHeads: 1, HeadDim: 2, DType: kvcache.FP16}
			cfg := kvsim.RunConfig{Geometry: g, PoolPages: c.pages, MaxContext: 1 << 18, Step: 20 * time.Millisecond, MaxBatch: 256,
				QueueTimeout: 30 * time.Second, Duration: tr.Duration() + time.Minute, WriteKV: true, PrefixCache: true, PrefillTokens: 8192}
			var safe, unsafe time.Duration
			b.ResetTimer()
			for range b.N {
				for _, policy := range []string{"zero", kvsim.Baseline} {
					cfg.Policy = policy
					start := time.Now()
					res, err := kvsim.Run(tr, cfg)
					took := time.Since(start)
					if err != nil {
						b.Fatal(err)
					}
					if policy == kvsim.Baseline {
						unsafe += took
					} else {
						safe += took
					}
					if err := checkReplay(tr, res, c.allAdmitted); err != nil {
						b.Fatalf("%s: %v", policy, err)
					}
				}
			}
			b.StopTimer()
			b.ReportMetric(safe.Seconds()/float64(b.N), "s/replay")
			b.ReportMetric(unsafe.Seconds()/float64(b.N), "s/replay-unsafe-nofill")
			b.ReportMetric(float64(safe)/float64(unsafe), "x-vs-unsafe-nofill")
			b.ReportMetric(0, "ns/op") // an op is both replays: s/replay says it
		})
	}
}

// checkReplay says whether a replay accounted for every request of tr
// (admitted, or dropped with a reason) and hit no more pages than an
// infinite cache would have on what it served.
func checkReplay(tr *kvsim.Trace, res *kvsim.RunResult, allAdmitted bool) error {
	var dropped uint64
	for _, n := range res.Dropped {
		dropped += n
	}
	switch px := res.Prefix; {
	case res.Admitted+dropped != uint64(len(tr.Requests)):
		return fmt.Errorf("%d admitted + %d dropped of %d requests", res.Admitted, dropped, len(tr.Requests))
	case allAdmitted && res.Admitted != uint64(len(tr.Requests)):
		return fmt.Errorf("%d of %d requests admitted, want all: %v", res.Admitted, len(tr.Requests), res.Dropped)
	case !allAdmitted && dropped == 0:
		return fmt.Errorf("no request dropped: the pool is not too small")
	case px.HitPages == 0 || px.HitPages > px.ServedBound.HitPages:
		return fmt.Errorf("%d hit pages, served bound %d", px.HitPages, px.ServedBound.HitPages)
	}
	return nil
}
