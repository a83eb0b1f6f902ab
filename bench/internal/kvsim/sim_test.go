package kvsim

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// tinyGeometry: 4 regions of 256-byte pages, 64 bytes of KV per token.
var tinyGeometry = kvcache.Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 1, HeadDim: 8, DType: kvcache.FP16}

// handTrace has one request of every fate; pool: 64 pages (1024 tokens),
// context window 2048 tokens.
const handTrace = `{"type":"tenant","name":"a"}
{"type":"tenant","name":"b","quota_pages":8}
{"type":"request","at":0,"id":"r1","tenant":"a","prompt":100,"output":20,"max_new":28}
{"type":"request","at":0,"id":"too-long","tenant":"b","prompt":3000,"output":1}
{"type":"request","at":0,"id":"too-big","tenant":"a","prompt":1500,"output":10}
{"type":"request","at":0,"id":"over-quota","tenant":"b","prompt":200,"output":10}
{"type":"request","at":0.1,"id":"r5","tenant":"b","prompt":50,"output":30,"abort_after":5}
{"type":"request","at":1,"id":"r6","tenant":"a","prompt":60,"output":5}
{"type":"request","at":1,"id":"r7","tenant":"b","prompt":30,"output":4}
`

func handConfig(policy string) RunConfig {
	return RunConfig{Geometry: tinyGeometry, PoolPages: 64, MaxContext: 2048, Policy: policy, Step: 10 * time.Millisecond,
		MaxBatch: 16, QueueTimeout: time.Second, Duration: 2 * time.Second, Audit: true, WriteKV: true}
}

func TestRunHandTrace(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(handTrace), "hand")
	require.NoError(t, err)
	tokenBytes := uint64(tinyGeometry.TokenBytes())
	for _, policy := range Policies {
		t.Run(policy, func(t *testing.T) {
			res, err := Run(tr, handConfig(policy))
			require.NoError(t, err)
			assert.EqualValues(t, 7, res.Arrived)
			assert.EqualValues(t, 4, res.Admitted)
			assert.EqualValues(t, 3, res.Completed)
			assert.EqualValues(t, 1, res.Aborted)
			assert.EqualValues(t, 4, res.Releases)
			assert.Zero(t, res.ShutdownReleases)
			want := map[string]uint64{"exceeds_max_context": 1, "exceeds_capacity": 1, "exceeds_quota": 1}
			assert.Equal(t, want, res.Refusals, "pool's refusal counters")
			assert.Equal(t, want, withoutZeros(res.Dropped), "requests dropped")
			assert.EqualValues(t, 20+5+5+4, res.TokensGenerated)
			assert.Equal(t, (120+55+65+34)*tokenBytes, res.KVBytesWritten)
			// Pages: r1 8, r5 5, r6 5, r7 3; each scrubbed once per use.
			assert.EqualValues(t, 21, res.PagesScrubbed)
			assert.EqualValues(t, 240, res.PromptTokens)
			assert.Equal(t, 4, res.AdmitLatency.N)
			assert.Positive(t, res.Audit.PagesChecked, "r6 and r7 reuse pages")
			if policy == Baseline {
				assert.True(t, res.Unsafe)
				assert.Zero(t, res.BytesScrubbed, "the baseline writes nothing")
				assert.False(t, res.Audit.Passed, "the baseline hands out stale KV")
				assert.Positive(t, res.Audit.StalePages)
				assert.Positive(t, res.Audit.CrossTenantPages, "r7 (b) gets pages r1 (a) wrote")
				assert.Contains(t, res.Audit.Examples[0], `KV of tenant "a"`)
				return
			}
			assert.Equal(t, 21*uint64(tinyGeometry.PageBytes()), res.BytesScrubbed)
			assert.InDelta(t, float64(21*tinyGeometry.PageBytes())/34, res.ScrubBytesPerGeneratedToken, 1e-9)
			assert.InDelta(t, float64(21*tinyGeometry.PageBytes())/float64(274*tokenBytes), res.ScrubPerKVWritten, 1e-9)
			assert.True(t, res.Audit.Passed, res.Audit.Summary)
			assert.Zero(t, res.Audit.StalePages)
			if policy == "canary" {
				assert.Positive(t, res.Audit.CanaryChecks)
			}
		})
	}
}

func sumValues(m map[string]uint64) uint64 {
	var n uint64
	for _, v := range m {
		n += v
	}
	return n
}

func withoutZeros(m map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range m {
		if v != 0 {
			out[k] = v
		}
	}
	return out
}

// A safe policy on a device that drops its fills must fail the audit:
// the audit is able to fail.
func TestRunAuditCatchesSkippedFills(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(handTrace), "hand")
	require.NoError(t, err)
	for _, policy := range []string{"zero", "poison", "canary"} {
		t.Run(policy, func(t *testing.T) {
			cfg := handConfig(policy)
			cfg.OpenDevice = func() (cudaops.Device, error) { return droppingHost{cudaops.NewHost()}, nil }
			res, err := Run(tr, cfg)
			require.ErrorIs(t, err, ErrAuditFailed)
			require.NotNil(t, res)
			assert.False(t, res.Audit.Passed)
			assert.Contains(t, res.Audit.Summary, "FAILED")
		})
	}
}

// droppingHost is a broken Host whose fills do nothing.
type droppingHost struct{ *cudaops.Host }

func (d droppingHost) Fill(pages []int32, _ cudaops.FillSpec, _ cudaops.Ordering) (cudaops.Fence, error) {
	return cudaops.Completed(nil), cudaops.CheckPages(d.Regions(), pages)
}

func TestRunSyntheticAccounting(t *testing.T) {
	tr, err := Generate(GenConfig{Seed: 3, Duration: 3 * time.Second, Rate: 40, Tenants: 4, OverlongFraction: 0.05,
		AbortFraction: 0.1, CapacityTokens: 256 * 16, MaxContext: 8192, TokensPerPage: 16})
	require.NoError(t, err)
	cfg := handConfig("zero")
	cfg.PoolPages, cfg.MaxContext, cfg.Duration, cfg.QueueTimeout = 256, 8192, 3*time.Second, 500*time.Millisecond
	var steps int
	var last Progress
	cfg.Progress = func(p Progress) {
		steps++
		require.Equal(t, steps, p.Step)
		require.GreaterOrEqual(t, p.Done, last.Done, "requests done never go back")
		require.GreaterOrEqual(t, p.Refusals, last.Refusals)
		last = p
	}
	res, err := Run(tr, cfg)
	require.NoError(t, err)
	assert.Equal(t, 300, steps)
	assert.Equal(t, Progress{Step: 300, Steps: 300, Now: 3 * time.Second, Duration: 3 * time.Second, Requests: len(tr.Requests),
		Done:   res.Completed + res.Aborted + sumValues(res.Dropped) - res.Dropped["unserved_at_end"] - res.Dropped["not_arrived"],
		Queued: last.Queued, Running: last.Running, Refusals: sumValues(res.Refusals)}, last)
	var dropped uint64
	for k, v := range res.Dropped {
		if k != "not_arrived" {
			dropped += v
		}
	}
	assert.Equal(t, res.Arrived, res.Admitted+dropped, "every arrival admitted or dropped: %v", res.Dropped)
	assert.Equal(t, res.Admitted, res.Completed+res.Aborted+res.ShutdownReleases)
	assert.Equal(t, res.Admitted, res.Releases)
	assert.EqualValues(t, len(tr.Requests), res.Arrived+res.Dropped["not_arrived"])
	assert.Positive(t, res.Refusals["pool_exhausted"], "a pool this small runs full")
	assert.Positive(t, res.Dropped["exceeds_capacity"]+res.Dropped["exceeds_max_context"])
	assert.GreaterOrEqual(t, res.ScrubPerKVWritten, 1.0, "whole pages are scrubbed, partly written ones too")
	assert.NotEmpty(t, res.Utilisation)
	assert.LessOrEqual(t, res.PeakInUse, 1.0)
	assert.Positive(t, res.PeakInUse)
	assert.NotEmpty(t, res.ScrubByBatch)
	assert.False(t, res.Prefix.Enabled, "prefix cache off")
	assert.Zero(t, res.Prefix.HitTokens)
	assert.Zero(t, res.Prefix.LookupPages)
}

func TestRunBadConfig(t *testing.T) {
	tr := &Trace{}
	tests := []struct {
		name string
		mod  func(*RunConfig)
	}{
		{"unknown policy", func(c *RunConfig) { c.Policy = "bleach" }},
		{"zero step", func(c *RunConfig) { c.Step = 0 }},
		{"zero duration", func(c *RunConfig) { c.Duration = 0 }},
		{"no batch", func(c *RunConfig) { c.MaxBatch = 0 }},
		{"no pool", func(c *RunConfig) { c.PoolPages = 0 }},
		{"no queue timeout", func(c *RunConfig) { c.QueueTimeout = 0 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := handConfig("zero")
			tt.mod(&cfg)
			_, err := Run(tr, cfg)
			assert.ErrorIs(t, err, ErrBadConfig)
		})
	}
}

func TestCompareWithBaseline(t *testing.T) {
	zero := &RunResult{Policy: "zero", PoolPages: 10, ServingSeconds: 2, ServingCPUSeconds: 3, BytesScrubbed: 8e9,
		AdmitLatency: LatencySummary{P50: 20, P99: 40}}
	none := &RunResult{Policy: "none", Unsafe: true, PoolPages: 10, ServingSeconds: 2, ServingCPUSeconds: 2,
		AdmitLatency: LatencySummary{P50: 10, P99: 10}}
	other := &RunResult{Policy: "zero", PoolPages: 20, ServingSeconds: 2}
	CompareWithBaseline([]*RunResult{zero, none, other}, 4e9)
	require.NotNil(t, zero.VsBaseline)
	assert.InDelta(t, 1.5, zero.VsBaseline.RunTime, 1e-9)
	assert.InDelta(t, 2, zero.VsBaseline.AdmitP50, 1e-9)
	assert.InDelta(t, 4, zero.VsBaseline.AdmitP99, 1e-9)
	assert.Nil(t, none.VsBaseline)
	assert.Nil(t, other.VsBaseline, "no baseline of its pool size")
	require.NotNil(t, zero.GPUFillPerServingSecond)
	assert.InDelta(t, 1.0, *zero.GPUFillPerServingSecond, 1e-9, "8 GB over 2 s at 4 GB/s")
}

// wholePoolQuotaTrace: tenant a's quota is the whole pool (64 pages of 16
// tokens, steps of 10 ms). hogA (32 pages, 112 steps) and hogB (32 pages,
// 32 steps) fill it; big (48 pages) arrives first, then three small
// requests (8 pages each). When hogB ends, 32 pages are free: enough for
// the small ones, not for big.
const wholePoolQuotaTrace = `{"type":"tenant","name":"a"}
{"type":"request","at":0,"id":"hogA","tenant":"a","prompt":400,"output":112}
{"type":"request","at":0,"id":"hogB","tenant":"a","prompt":480,"output":32}
{"type":"request","at":0.05,"id":"big","tenant":"a","prompt":700,"output":68}
{"type":"request","at":0.06,"id":"small1","tenant":"a","prompt":100,"output":20,"max_new":28}
{"type":"request","at":0.06,"id":"small2","tenant":"a","prompt":100,"output":20,"max_new":28}
{"type":"request","at":0.06,"id":"small3","tenant":"a","prompt":100,"output":20,"max_new":28}
`

// A request that waits for pages holds the queue: for a tenant whose quota
// is the whole pool, a full pool is a lack of pages, not of quota, so the
// big request queued first must be admitted before the small ones behind
// it. kvcache refused it with ErrExceedsQuota (a quota wait, which the
// simulator lets later requests pass) instead of ErrPoolExhausted, and
// the small requests overtook it; the fix of the reason is kvcache's.
func TestRunWholePoolQuotaNoOvertaking(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(wholePoolQuotaTrace), "whole-pool-quota")
	require.NoError(t, err)
	cfg := handConfig("zero")
	cfg.Duration, cfg.QueueTimeout = 3*time.Second, 10*time.Second
	var order []string
	cfg.afterAdmit = func(_ *sim, a *active) { order = append(order, a.req.ID) }
	res, err := Run(tr, cfg)
	require.NoError(t, err)
	assert.EqualValues(t, 6, res.Admitted, "every request is served in the window")
	require.Len(t, order, 6)
	assert.Equal(t, []string{"hogA", "hogB", "big"}, order[:3], "big is admitted before the small requests queued after it: %v", order)
	assert.Zero(t, res.Refusals["exceeds_quota"], "a full pool refuses a tenant whose quota is the pool with pool_exhausted: %v", res.Refusals)
	assert.Positive(t, res.Refusals["pool_exhausted"], "big waited for pages")
}

// With a report geometry, byte figures are those of the model's pages
// (here 16× the pool's per token: 4 layers × 2 heads × 16 dims fp32 against
// 2 × 1 × 8 fp16), the pool stays small, and ratios and counts do not move.
func TestRunReportGeometry(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(handTrace), "hand")
	require.NoError(t, err)
	model := kvcache.Geometry{TokensPerPage: 16, Layers: 4, KVHeads: 2, HeadDim: 16, DType: kvcache.FP32}
	require.Equal(t, 16*tinyGeometry.TokenBytes(), model.TokenBytes(), "16× the pool's bytes per token")
	for _, policy := range []string{"zero", Baseline} {
		host, err := Run(tr, handConfig(policy))
		require.NoError(t, err)
		cfg := handConfig(policy)
		cfg.ReportGeometry = &model
		got, err := Run(tr, cfg)
		require.NoError(t, err)
		assert.Equal(t, host.HostPoolBytes, got.HostPoolBytes, "the same pool is allocated")
		assert.Equal(t, 64*model.PageBytes(), got.PoolBytes)
		assert.Equal(t, 64*tinyGeometry.PageBytes(), host.PoolBytes)
		assert.Equal(t, 16*host.KVBytesWritten, got.KVBytesWritten)
		assert.Equal(t, 16*host.BytesScrubbed, got.BytesScrubbed)
		assert.Equal(t, host.BytesScrubbed, got.HostBytesScrubbed, "the device wrote the small pages")
		assert.Equal(t, host.PagesScrubbed, got.PagesScrubbed)
		assert.InDelta(t, host.ScrubPerKVWritten, got.ScrubPerKVWritten, 1e-12)
		assert.InDelta(t, 16*host.ScrubBytesPerGeneratedToken, got.ScrubBytesPerGeneratedToken, 1e-9)
		if policy == Baseline {
			assert.Zero(t, got.BytesScrubbed)
		}
	}
	cfg := handConfig("zero")
	other := model
	other.TokensPerPage = 32
	cfg.ReportGeometry = &other
	_, err = Run(tr, cfg)
	assert.ErrorIs(t, err, ErrBadConfig, "a report geometry of another page size")
	cfg.ReportGeometry = &kvcache.Geometry{TokensPerPage: 16}
	_, err = Run(tr, cfg)
	assert.ErrorIs(t, err, ErrBadConfig, "an invalid report geometry")
}

// A prompt no pool of this run can serve (longer than the context window
// or than the pool) is refused for good at its first attempt; the
// simulator tokenised and hashed it all the same, which on a trace of
// million-token prompts (the incident's) was most of the run.
func TestRunDoesNotHashUnservablePrompts(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(handTrace), "hand")
	require.NoError(t, err)
	cfg := handConfig("zero")
	cfg.PrefixCache = true
	derived := map[string]int{}
	cfg.onKeys = func(r *Request) { derived[r.ID]++ }
	res, err := Run(tr, cfg)
	require.NoError(t, err)
	assert.Equal(t, map[string]int{"r1": 1, "over-quota": 1, "r5": 1, "r6": 1, "r7": 1}, derived,
		"too-long (over the window) and too-big (over the pool) are not hashed")
	assert.EqualValues(t, 1, res.Dropped["exceeds_max_context"])
	assert.EqualValues(t, 1, res.Dropped["exceeds_capacity"])
}
