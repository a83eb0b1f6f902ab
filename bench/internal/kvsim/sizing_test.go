package kvsim

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// pagesOf is how many pages of the tiny geometry hold tokens.
func pagesOf(tokens int) int {
	tpp := tinyGeometry.TokensPerPage
	return (tokens + tpp - 1) / tpp
}

// burstTrace is n requests of one tenant arriving together, each with a
// prompt of prompt+8i tokens and an output (and budget) of output tokens.
func burstTrace(n, prompt, output int, quotaPages int) *Trace {
	tr := &Trace{Tenants: []Tenant{{Name: "a", QuotaPages: quotaPages}}}
	for i := range n {
		tr.Requests = append(tr.Requests, Request{ID: fmt.Sprintf("r%d", i), Tenant: "a", Prompt: prompt + 8*i,
			Output: output, MaxNew: output, AbortAfter: -1})
	}
	return tr
}

func onDemandConfig(policy string, pages int) RunConfig {
	cfg := handConfig(policy)
	cfg.PoolPages, cfg.MaxContext = pages, 2048
	cfg.Duration, cfg.QueueTimeout = 5*time.Second, 10*time.Second
	cfg.Sizing, cfg.GrowthWatermark = SizingOnDemand, 0.01
	return cfg
}

// The case: a client that sends no max_tokens gets the rest of
// the context window as its budget, and full reservation holds that
// whole window per request. On a pool of three windows, full sizing runs
// three requests at a time; on-demand runs every one of them, each
// holding the pages it writes.
func TestRunOnDemandServesMoreAtOnceThanFullReservationsOfTheWindow(t *testing.T) {
	const window, windows, n, prompt, output = 1024, 3, 12, 100, 20
	pool := windows * pagesOf(window)
	tr := burstTrace(n, prompt, output, 0).WithWindowBudgets(window)
	for _, r := range tr.Requests {
		require.Equal(t, window, r.Prompt+r.MaxNew, "budgets are the rest of the window")
	}
	res := map[string]*RunResult{}
	for _, sizing := range SizingModes {
		cfg := onDemandConfig("zero", pool)
		cfg.MaxContext, cfg.Sizing = window, sizing
		if sizing == SizingFull {
			cfg.GrowthWatermark = 0
		}
		r, err := Run(tr, cfg)
		require.NoError(t, err, sizing)
		require.EqualValues(t, n, r.Completed, "%s: every request is served", sizing)
		assert.Zero(t, r.Growth.Preempted, "%s: the pool holds every request's pages", sizing)
		res[sizing] = r
	}
	full, od := res[SizingFull], res[SizingOnDemand]
	assert.Equal(t, windows, full.Concurrency.Max, "full: one request per window of the pool")
	assert.Equal(t, n, od.Concurrency.Max, "on-demand: all of them at once")
	assert.Greater(t, od.Concurrency.Mean, full.Concurrency.Mean)
	assert.Greater(t, od.KVUtilisation, full.KVUtilisation, "full leases hold pages they never write")
	assert.Less(t, od.TTFT.P99, full.TTFT.P99, "nobody waits for a window to free up")
	var grown uint64
	for _, r := range tr.Requests {
		grown += uint64(pagesOf(r.Prompt+r.Output) - pagesOf(r.Prompt))
	}
	assert.Equal(t, grown, od.Growth.PagesGrown, "a page at a time, as the outputs need them")
	assert.Zero(t, full.Growth.PagesGrown)
	assert.Equal(t, full.TokensGenerated, od.TokensGenerated)
	assert.Less(t, od.ScrubPerKVWritten, full.ScrubPerKVWritten, "no unwritten budget to scrub")

	// The same on the synthetic workload with window budgets.
	gen, err := Generate(GenConfig{Seed: 5, Duration: 3 * time.Second, Rate: 20, Tenants: 4, AbortFraction: 0.1,
		CapacityTokens: 4 * window, MaxContext: window, TokensPerPage: 16})
	require.NoError(t, err)
	gen = gen.WithWindowBudgets(window)
	for _, sizing := range SizingModes {
		cfg := onDemandConfig("zero", 4*pagesOf(window))
		cfg.MaxContext, cfg.Sizing, cfg.PrefixCache, cfg.Duration = window, sizing, true, 4*time.Second
		if sizing == SizingFull {
			cfg.GrowthWatermark = 0
		}
		r, err := Run(gen, cfg)
		require.NoError(t, err, sizing)
		res[sizing] = r
	}
	full, od = res[SizingFull], res[SizingOnDemand]
	assert.LessOrEqual(t, full.Concurrency.Max, 4, "full: at most one request per window")
	assert.Greater(t, od.Concurrency.Max, 4)
	assert.Greater(t, od.Concurrency.Mean, full.Concurrency.Mean)
	assert.Greater(t, od.Completed, full.Completed)
}

// preemptionChecks are the invariants of a run that preempts, checked
// while it runs: after every step the pool's books balance, every running
// request's written tokens are what its lease committed and within the
// pages it holds, and its block table is its lease's; no growth takes a
// lease past its budget's pages or the context window.
func preemptionChecks(t *testing.T, cfg *RunConfig) (ends map[string]string, generated, admissions map[string]int) {
	ends, generated, admissions = map[string]string{}, map[string]int{}, map[string]int{}
	tpp := cfg.Geometry.TokensPerPage
	cfg.afterAdmit = func(_ *sim, a *active) { admissions[a.req.ID]++ }
	cfg.afterGrow = func(_ *sim, a *active) {
		budget := a.req.Prompt + a.req.MaxNew
		require.LessOrEqual(t, a.lease.Pages(), pagesOf(budget), "%s grew past its budget", a.req.ID)
		require.LessOrEqual(t, a.lease.Pages(), (cfg.MaxContext+tpp-1)/tpp, "%s grew past the context window", a.req.ID)
	}
	cfg.onEnd = func(_ *sim, a *active, how string) {
		require.NotContains(t, ends, a.req.ID, "%s ended twice", a.req.ID)
		ends[a.req.ID], generated[a.req.ID] = how, a.generated
	}
	cfg.afterStep = func(s *sim) {
		require.NoError(t, s.pool.Check())
		for _, a := range s.running {
			require.LessOrEqual(t, a.written, a.lease.CapacityTokens(), "%s wrote past its pages", a.req.ID)
			require.Len(t, a.table, a.lease.Pages(), "%s: block table", a.req.ID)
			if w := a.lease.Written(); w != 0 || a.written != a.hit {
				require.Equal(t, a.written, w, "%s: written tokens are the lease's", a.req.ID)
			}
		}
	}
	return ends, generated, admissions
}

// Four requests whose outputs together need more pages than the pool
// has, though each fits alone: on-demand admits them all, their growths
// are refused, and the newest are preempted and admitted again. Every
// request completes with exactly its output, none lost nor written
// twice; every refusal preempted one lease, and every preempted request
// was admitted again; with the prefix cache the re-admissions share back
// what the preemptions kept. A refused growth taken for room (the
// engine writing on) fails here: the request would write past its pages.
func TestRunPreemptedRequestsCompleteWithTheirWholeOutput(t *testing.T) {
	const n, prompt, output, pool = 4, 64, 100, 32
	tr := burstTrace(n, prompt, output, 0)
	need := 0
	for _, r := range tr.Requests {
		require.LessOrEqual(t, pagesOf(r.Prompt+r.Output), pool, "each request fits alone")
		need += pagesOf(r.Prompt + r.Output)
	}
	require.Greater(t, need, pool, "together they do not")
	for _, policy := range []string{"zero", "canary"} {
		for _, prefix := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/prefix=%v", policy, prefix), func(t *testing.T) {
				cfg := onDemandConfig(policy, pool)
				cfg.PrefixCache, cfg.Seed, cfg.GrowthWatermark = prefix, 11, 0.1
				ends, generated, admissions := preemptionChecks(t, &cfg)
				res, err := Run(tr, cfg)
				require.NoError(t, err)
				g := res.Growth
				require.Positive(t, g.Preempted, "the pool is too small for all of them")
				assert.Equal(t, g.Preempted, g.Refused["pool_exhausted"], "every refused growth preempted one lease")
				assert.Equal(t, g.Preempted, g.Readmitted, "every preempted request was admitted again")
				assert.Zero(t, g.PreemptedAtEnd)
				assert.Empty(t, g.Truncated)
				assert.EqualValues(t, n, res.Admitted, "re-admissions are not admissions")
				assert.EqualValues(t, n, res.Completed)
				var readmissions int
				for _, r := range tr.Requests {
					assert.Equal(t, "completed", ends[r.ID], r.ID)
					assert.Equal(t, r.MaxNew, generated[r.ID], "%s generated its whole budget, no token lost or repeated", r.ID)
					readmissions += admissions[r.ID] - 1
				}
				assert.EqualValues(t, g.Readmitted, readmissions)
				assert.EqualValues(t, n*output, res.TokensGenerated)
				assert.Equal(t, n, res.TTFT.N, "one first token per request")
				assert.True(t, res.Audit.Passed, res.Audit.Summary)
				assert.Positive(t, res.Audit.PagesChecked, "grown and re-admitted pages were audited")
				if prefix {
					assert.Positive(t, g.ReadmitHitTokens, "re-admissions share back what was computed")
					assert.Positive(t, g.PreemptKeptPages)
					assert.Less(t, g.RecomputedTokens, g.ReadmitHitTokens, "most of it is shared back")
					assert.True(t, res.Prefix.LeaseHitTokensMatch)
					assert.LessOrEqual(t, res.Prefix.HitRate, res.Prefix.ServedBound.HitRate, "first admissions' hits, against the bound")
				} else {
					assert.Zero(t, g.ReadmitHitTokens)
					assert.Zero(t, g.PreemptKeptPages)
					assert.Positive(t, g.RecomputedTokens, "without the cache, re-admissions compute it all again")
				}
			})
		}
	}
}

// A growth refused for the tenant's quota preempts the newest request of
// that tenant, never another tenant's: b1 is the newest in the batch, but
// preempting it would not give tenant a a page.
func TestRunGrowthOverQuotaPreemptsTheTenantsNewest(t *testing.T) {
	tr := burstTrace(2, 48, 100, 16) // a: r0, r1; 2 × 10 pages > 16
	tr.Tenants = append(tr.Tenants, Tenant{Name: "b"})
	tr.Requests = append(tr.Requests, Request{ID: "b1", Tenant: "b", Prompt: 48, Output: 100, MaxNew: 100, AbortAfter: -1})
	cfg := onDemandConfig("zero", 64)
	ends, generated, admissions := preemptionChecks(t, &cfg)
	res, err := Run(tr, cfg)
	require.NoError(t, err)
	g := res.Growth
	require.Positive(t, g.Preempted)
	assert.Equal(t, g.Preempted, g.Refused["exceeds_quota"], "every quota refusal preempted one of a's leases")
	assert.Zero(t, g.Refused["pool_exhausted"])
	assert.Equal(t, 1, admissions["b1"], "b1 was never preempted")
	assert.Greater(t, admissions["r1"], 1, "a's newest was")
	for _, r := range tr.Requests {
		assert.Equal(t, "completed", ends[r.ID], r.ID)
		assert.Equal(t, r.Output, generated[r.ID], r.ID)
	}
}

// A request whose prompt fits the pool but whose output does not is
// refused at admission under full sizing; on-demand admits it, it grows
// to the whole pool, and the growth past it (ErrExceedsCapacity, which no
// preemption cures) ends it there, with the tokens the pool could hold.
// The request after it is served.
func TestRunOnDemandTruncatesWhatThePoolCanNeverHold(t *testing.T) {
	const pool, prompt, output = 16, 100, 300
	tr := burstTrace(1, prompt, output, 0)
	tr.Requests = append(tr.Requests, Request{ID: "next", At: time.Second, Tenant: "a", Prompt: 50, Output: 10, MaxNew: 10, AbortAfter: -1})
	full := onDemandConfig("zero", pool)
	full.Sizing, full.GrowthWatermark = SizingFull, 0
	res, err := Run(tr, full)
	require.NoError(t, err)
	assert.EqualValues(t, 1, res.Dropped["exceeds_capacity"])
	assert.EqualValues(t, 1, res.Completed)

	cfg := onDemandConfig("zero", pool)
	ends, generated, _ := preemptionChecks(t, &cfg)
	res, err = Run(tr, cfg)
	require.NoError(t, err)
	assert.Equal(t, map[string]uint64{"exceeds_capacity": 1}, res.Growth.Truncated)
	assert.Equal(t, "truncated", ends["r0"])
	assert.Equal(t, pool*tinyGeometry.TokensPerPage-prompt, generated["r0"], "it wrote until the pool was its own")
	assert.Zero(t, res.Growth.Preempted, "nothing to preempt but itself, which would not help")
	assert.Equal(t, "completed", ends["next"])
	assert.EqualValues(t, 2, res.Admitted)
	assert.EqualValues(t, 1, res.Completed)
}

// timeless is r without its wall-clock figures, which differ from run to
// run; everything else follows from the trace and the config.
func timeless(r *RunResult) RunResult {
	c := *r
	c.WallSeconds, c.ServingCPUSeconds, c.AdmitSeconds, c.ReleaseSeconds = 0, 0, 0, 0
	c.FillSeconds, c.KVWriteSeconds, c.AuditSeconds, c.AdmitThroughput, c.FillShare = 0, 0, 0, 0, 0
	c.AdmitLatency, c.Latencies, c.ScrubByBatch = LatencySummary{}, nil, nil
	c.Prefix.KeySeconds, c.Growth.GrowSeconds, c.Growth.PreemptSeconds = 0, 0, 0
	return c
}

// Same trace and config, same run: preemption picks its victims, and
// re-admission its order, from the batch and the queue alone.
func TestRunOnDemandIsDeterministic(t *testing.T) {
	tr, err := Generate(GenConfig{Seed: 9, Duration: 3 * time.Second, Rate: 40, Tenants: 4, OverlongFraction: 0.05,
		AbortFraction: 0.1, CapacityTokens: 256 * 16, MaxContext: 8192, TokensPerPage: 16})
	require.NoError(t, err)
	cfg := onDemandConfig("zero", 256)
	cfg.MaxContext, cfg.PrefixCache, cfg.PrefillTokens, cfg.HeadroomTokens = 8192, true, 512, 16
	first, err := Run(tr, cfg)
	require.NoError(t, err)
	require.Positive(t, first.Growth.Preempted, "a pool this small preempts")
	again, err := Run(tr, cfg)
	require.NoError(t, err)
	assert.Equal(t, timeless(first), timeless(again))
}

// Every arrival is admitted or dropped, every admitted request ends one
// way (or is still running, or waiting preempted, at the end), and every
// lease, admitted or re-admitted, ends by a release or a preemption.
func TestRunOnDemandSyntheticAccounting(t *testing.T) {
	tr, err := Generate(GenConfig{Seed: 3, Duration: 3 * time.Second, Rate: 40, Tenants: 4, OverlongFraction: 0.05,
		AbortFraction: 0.1, CapacityTokens: 256 * 16, MaxContext: 8192, TokensPerPage: 16})
	require.NoError(t, err)
	cfg := onDemandConfig("zero", 256)
	cfg.MaxContext, cfg.Duration, cfg.QueueTimeout, cfg.PrefixCache = 8192, 3*time.Second, 500*time.Millisecond, true
	ends, _, _ := preemptionChecks(t, &cfg)
	res, err := Run(tr, cfg)
	require.NoError(t, err)
	g := res.Growth
	require.Positive(t, g.Preempted, "a pool this small preempts")
	var dropped uint64
	for k, v := range res.Dropped {
		if k != "not_arrived" {
			dropped += v
		}
	}
	assert.Equal(t, res.Arrived, res.Admitted+dropped, "every arrival admitted or dropped: %v", res.Dropped)
	truncated := sumCounts(g.Truncated)
	assert.Equal(t, res.Admitted, res.Completed+res.Aborted+res.ShutdownReleases+truncated+g.PreemptedAtEnd)
	assert.Equal(t, res.Admitted+g.Readmitted, res.Releases+g.Preempted, "each lease ends once")
	// A page shared by several leases holds KV once: the written shares
	// count it once, as the pages in use do.
	for _, u := range res.Utilisation {
		require.LessOrEqual(t, u.Written, u.WrittenPages+1e-12, "at %.2fs", u.T)
		require.LessOrEqual(t, u.WrittenPages, u.InUse+1e-12, "at %.2fs", u.T)
	}
	var how = map[string]uint64{}
	for _, h := range ends {
		how[h]++
	}
	assert.Equal(t, res.Completed, how["completed"])
	assert.Equal(t, res.Aborted, how["aborted"])
	assert.Equal(t, res.ShutdownReleases, how["shutdown"])
	assert.LessOrEqual(t, how["truncated"], truncated, "truncated while running; the others at re-admission")
	// Every retryable refusal preempted; a quota refusal may also be for
	// good (more than the whole quota), which truncates instead.
	retryable := g.Refused["pool_exhausted"] + g.Refused["exceeds_quota"]
	assert.LessOrEqual(t, g.Preempted, retryable)
	assert.GreaterOrEqual(t, g.Preempted+g.Truncated["exceeds_quota"], retryable)
}

func TestRunBadSizingConfig(t *testing.T) {
	tr := &Trace{}
	for name, mod := range map[string]func(*RunConfig){
		"unknown sizing":          func(c *RunConfig) { c.Sizing = "lazy" },
		"negative headroom":       func(c *RunConfig) { c.Sizing, c.HeadroomTokens = SizingOnDemand, -1 },
		"watermark above the max": func(c *RunConfig) { c.Sizing, c.GrowthWatermark = SizingOnDemand, 0.75 },
		"NaN watermark":           func(c *RunConfig) { c.Sizing, c.GrowthWatermark = SizingOnDemand, math.NaN() },
		"headroom with full":      func(c *RunConfig) { c.Sizing, c.HeadroomTokens = SizingFull, 16 },
		"watermark with full":     func(c *RunConfig) { c.GrowthWatermark = 0.01 },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := handConfig("zero")
			mod(&cfg)
			_, err := Run(tr, cfg)
			assert.ErrorIs(t, err, ErrBadConfig)
		})
	}
}

// Window budgets change budgets only, and never shrink one.
func TestWithWindowBudgets(t *testing.T) {
	tr := &Trace{Tenants: []Tenant{{Name: "a"}}, Requests: []Request{
		{ID: "short", Tenant: "a", Prompt: 100, Output: 10, MaxNew: 20, AbortAfter: -1},
		{ID: "long", Tenant: "a", Prompt: 1000, Output: 50, MaxNew: 100, AbortAfter: 3},
	}}
	w := tr.WithWindowBudgets(1024)
	assert.Equal(t, 924, w.Requests[0].MaxNew)
	assert.Equal(t, 100, w.Requests[1].MaxNew, "already past the window: its own budget")
	assert.Equal(t, 20, tr.Requests[0].MaxNew, "the trace itself is left alone")
	for i := range w.Requests {
		a, b := w.Requests[i], tr.Requests[i]
		a.MaxNew = b.MaxNew
		assert.Equal(t, b, a)
	}
}

// A growth whose page fails the canary policy's own audit (a device that
// drops every fill after the pool's first scrub, so pages come back
// written) gets no page that step: the request writes nothing, the fault
// is cleared, and the run goes on to fail its audit, every page check
// holding at every step.
func TestRunOnDemandGrowthAgainstAFailedCanaryStalls(t *testing.T) {
	tr := burstTrace(4, 64, 100, 0)
	cfg := onDemandConfig("canary", 32)
	cfg.OpenDevice = func() (cudaops.Device, error) { return &dropsAfterFirstFill{Host: cudaops.NewHost()}, nil }
	preemptionChecks(t, &cfg)
	res, err := Run(tr, cfg)
	require.ErrorIs(t, err, ErrAuditFailed)
	require.NotNil(t, res)
	assert.Positive(t, res.Growth.Stalls, "growths met the failed canary")
	assert.GreaterOrEqual(t, res.Audit.PoolCanaryFaults, res.Growth.Stalls)
	assert.False(t, res.Audit.Passed)
}

// dropsAfterFirstFill is a broken Host whose fills after the first (the
// pool's scrub at creation) do nothing.
type dropsAfterFirstFill struct {
	*cudaops.Host
	fills int
}

func (d *dropsAfterFirstFill) Fill(pages []int32, spec cudaops.FillSpec, o cudaops.Ordering) (cudaops.Fence, error) {
	if d.fills++; d.fills == 1 {
		return d.Host.Fill(pages, spec, o)
	}
	return cudaops.Completed(nil), cudaops.CheckPages(d.Regions(), pages)
}
