package kvsim

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvcache"
)

// The check on Mooncake's synthetic trace, at its block size: a
// pool of 50M tokens hits within a point of the trace's bound, pools of
// 1M, 3M and 10M at most the bound. Skipped without the trace, under
// -short and under the race detector (about 5 s on two cores, more than
// ten minutes with -race; the replay's code is raced by the other tests).
func TestMooncakeSyntheticHitRateAgainstBound(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("replays 4k requests four times")
	}
	tr, _, err := ReadTrace(openSharedTrace(t, "mooncake/synthetic_trace.jsonl"), "synthetic", FormatMooncake, ImportConfig{})
	require.NoError(t, err)
	g := kvcache.Geometry{TokensPerPage: MooncakeBlockTokens, Layers: 1, KVHeads: 1, HeadDim: 2, DType: kvcache.FP16}
	for _, tokens := range []int{1e6, 3e6, 10e6, 50e6} {
		t.Run(fmt.Sprintf("%dM", tokens/1e6), func(t *testing.T) {
			res, err := Run(tr, RunConfig{Geometry: g, PoolPages: tokens / g.TokensPerPage, MaxContext: 1 << 18, Policy: "zero",
				Step: 20 * time.Millisecond, MaxBatch: 256, QueueTimeout: 30 * time.Second, Duration: tr.Duration() + time.Minute,
				WriteKV: true, PrefixCache: true, PrefillTokens: 8192})
			require.NoError(t, err)
			px := res.Prefix
			require.EqualValues(t, len(tr.Requests), res.Admitted, "every request served")
			require.Equal(t, px.Bound, px.ServedBound)
			t.Logf("hit rate %.2f%%, bound %.2f%%", 100*px.HitRate, 100*px.Bound.HitRate)
			assert.LessOrEqual(t, px.HitRate, px.Bound.HitRate)
			if tokens >= 50e6 {
				assert.InDelta(t, px.Bound.HitRate, px.HitRate, 0.01)
			}
		})
	}
}
