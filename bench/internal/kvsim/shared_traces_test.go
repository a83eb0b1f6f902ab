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

// Mooncake's synthetic trace gives no max_tokens: with the rest of a
// 262k-token window as every request's budget, full reservation holds
// three or four requests in a 1M-token pool, on-demand sizing all that
// arrive; every request on-demand admits completes, none truncated.
// Five minutes of the trace (about 1,100 requests); skipped like the
// test above.
func TestMooncakeSyntheticOnDemandAgainstWindowBudgets(t *testing.T) {
	if testing.Short() || raceEnabled {
		t.Skip("replays 1k requests twice")
	}
	tr, _, err := ReadTrace(openSharedTrace(t, "mooncake/synthetic_trace.jsonl"), "synthetic", FormatMooncake, ImportConfig{})
	require.NoError(t, err)
	const window, poolTokens = 1 << 18, 1_000_000
	tr = tr.WithWindowBudgets(window)
	g := kvcache.Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 2, DType: kvcache.FP16}
	res := map[string]*RunResult{}
	for _, sizing := range SizingModes {
		cfg := RunConfig{Geometry: g, PoolPages: poolTokens / g.TokensPerPage, MaxContext: window, Policy: "zero",
			Step: 20 * time.Millisecond, MaxBatch: 256, QueueTimeout: 30 * time.Second, Duration: 5 * time.Minute,
			WriteKV: true, PrefixCache: true, PrefillTokens: 8192, Sizing: sizing}
		if sizing == SizingOnDemand {
			cfg.GrowthWatermark = 0.01
		}
		r, err := Run(tr, cfg)
		require.NoError(t, err, sizing)
		t.Logf("%s: concurrency %.1f (max %d), KV util %.1f%%, admitted %d, completed %d, TTFT p99 %.2fs, %d preempted",
			sizing, r.Concurrency.Mean, r.Concurrency.Max, 100*r.KVUtilisation, r.Admitted, r.Completed, r.TTFT.P99, r.Growth.Preempted)
		res[sizing] = r
	}
	full, od := res[SizingFull], res[SizingOnDemand]
	perWindow := poolTokens / window
	assert.LessOrEqual(t, full.Concurrency.Max, perWindow+1, "full: a window per request (a shared prefix may let one more in)")
	assert.Greater(t, od.Concurrency.Mean, 2*full.Concurrency.Mean)
	assert.Greater(t, od.Completed, full.Completed)
	assert.Empty(t, od.Growth.Truncated)
	assert.Equal(t, od.Admitted, od.Completed+od.ShutdownReleases+od.Growth.PreemptedAtEnd)
}
