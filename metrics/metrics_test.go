package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
	"github.com/kvfence/kvfence/metrics"
)

// failingDevice is a host device whose next fill fails when armed.
type failingDevice struct {
	*cudaops.Host
	mu   sync.Mutex
	fail bool
}

func (d *failingDevice) Fill(pages []int32, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	d.mu.Lock()
	fail := d.fail
	d.fail = false
	d.mu.Unlock()
	if fail {
		return nil, errors.New("device lost")
	}
	return d.Host.Fill(pages, spec, after)
}

var geometry = kvcache.Geometry{TokensPerPage: 4, Layers: 1, KVHeads: 1, HeadDim: 8, DType: kvcache.BF16}

func tokens(start, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(start + i)
	}
	return out
}

// scripted runs the sequence the metrics are checked after, on a pool of
// 32 pages of 4 tokens: tenant a (own domain, quota 16), b and c (domain
// team).
//
//  1. a admits 16 tokens (4 pages) with tokens and publishes them; b is
//     refused for a prompt longer than the context; ghost is unknown;
//     a is over its quota.
//  2. a releases: its 4 pages stay cached.
//  3. b publishes 16 tokens in team, releases; c admits the same prompt
//     and hits 3 pages (the page holding the last prompt token is never
//     shared); c releases.
//  4. The next fill fails: a's next release retires its pages and faults
//     the pool; an admission is refused as faulted.
func scripted(t *testing.T) (*kvcache.Pool, *failingDevice) {
	t.Helper()
	dev := &failingDevice{Host: cudaops.NewHost()}
	p, err := kvcache.New(kvcache.Config{
		Geometry: geometry, Pages: 32, MaxContextTokens: 64, Device: dev,
		Tenants: []kvcache.TenantConfig{{Name: "a", QuotaPages: 16}, {Name: "b", Domain: "team"}, {Name: "c", Domain: "team"}},
	})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close(); dev.Close() })

	admit := func(id, tenant string, toks []int32) *kvcache.Lease {
		l, err := p.TryAdmit(kvcache.Request{ID: id, Tenant: tenant, PromptTokens: len(toks), TokenIDs: toks})
		require.NoError(t, err)
		require.NoError(t, l.Commit(len(toks)))
		_, err = l.CachePrefix(len(toks))
		require.NoError(t, err)
		return l
	}
	la := admit("a1", "a", tokens(0, 16))
	_, err = p.TryAdmit(kvcache.Request{ID: "long", Tenant: "b", PromptTokens: 65})
	require.ErrorIs(t, err, kvcache.ErrExceedsMaxContext)
	_, err = p.TryAdmit(kvcache.Request{ID: "x", Tenant: "ghost", PromptTokens: 4})
	require.ErrorIs(t, err, kvcache.ErrUnknownTenant)
	_, err = p.TryAdmit(kvcache.Request{ID: "big", Tenant: "a", PromptTokens: 60})
	require.ErrorIs(t, err, kvcache.ErrExceedsQuota)
	require.NoError(t, la.Release())

	require.NoError(t, admit("b1", "b", tokens(100, 16)).Release())
	lc := admit("c1", "c", tokens(100, 16))
	require.Equal(t, 12, lc.HitTokens())
	require.NoError(t, lc.Release())

	la2, err := p.TryAdmit(kvcache.Request{ID: "a2", Tenant: "a", PromptTokens: 8})
	require.NoError(t, err)
	dev.mu.Lock()
	dev.fail = true
	dev.mu.Unlock()
	require.ErrorIs(t, la2.Release(), kvcache.ErrPoolFaulted)
	_, err = p.TryAdmit(kvcache.Request{ID: "after", Tenant: "b", PromptTokens: 4})
	require.ErrorIs(t, err, kvcache.ErrPoolFaulted)
	require.NoError(t, p.Check())
	return p, dev
}

func TestCollectorAfterScriptedSequence(t *testing.T) {
	p, _ := scripted(t)
	c := metrics.NewCollector(p, metrics.Options{TenantLabels: true, ConstLabels: prometheus.Labels{"model_name": "m"}})
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))

	// Pages: 32 total; a's 4 and team's 4 cached (c's private page was
	// scrubbed), a2's 2 retired, the rest free.
	const want = `
# HELP kvfence_pool_pages Pages of the pool by state (free, in_use, cached, quarantined, retired).
# TYPE kvfence_pool_pages gauge
kvfence_pool_pages{model_name="m",state="cached"} 8
kvfence_pool_pages{model_name="m",state="free"} 22
kvfence_pool_pages{model_name="m",state="in_use"} 0
kvfence_pool_pages{model_name="m",state="quarantined"} 0
kvfence_pool_pages{model_name="m",state="retired"} 2
# HELP kvfence_pool_capacity_pages Pages of the pool, all states.
# TYPE kvfence_pool_capacity_pages gauge
kvfence_pool_capacity_pages{model_name="m"} 32
# HELP vllm:kv_cache_usage_perc Fraction of KV-cache pages not available to a new request: 1 - (free + evictable cached) / total.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.0625
# HELP kvfence_pool_faulted 1 while the pool is faulted (a failed fill or canary mismatch) and refuses every admission.
# TYPE kvfence_pool_faulted gauge
kvfence_pool_faulted{model_name="m"} 1
# HELP kvfence_admissions_total Admissions granted (leases and imports).
# TYPE kvfence_admissions_total counter
kvfence_admissions_total{model_name="m"} 4
# HELP kvfence_refusals_total Admissions refused, by reason.
# TYPE kvfence_refusals_total counter
kvfence_refusals_total{model_name="m",reason="duplicate_request"} 0
kvfence_refusals_total{model_name="m",reason="exceeds_capacity"} 0
kvfence_refusals_total{model_name="m",reason="exceeds_max_context"} 1
kvfence_refusals_total{model_name="m",reason="exceeds_quota"} 1
kvfence_refusals_total{model_name="m",reason="invalid_request"} 0
kvfence_refusals_total{model_name="m",reason="pool_exhausted"} 0
kvfence_refusals_total{model_name="m",reason="pool_faulted"} 1
kvfence_refusals_total{model_name="m",reason="unknown_tenant"} 1
# HELP kvfence_tenant_admissions_total Admissions granted to the tenant.
# TYPE kvfence_tenant_admissions_total counter
kvfence_tenant_admissions_total{model_name="m",tenant="a"} 2
kvfence_tenant_admissions_total{model_name="m",tenant="b"} 1
kvfence_tenant_admissions_total{model_name="m",tenant="c"} 1
# HELP kvfence_scrub_fill_errors_total Scrub fills that failed (their pages were retired, the pool faulted).
# TYPE kvfence_scrub_fill_errors_total counter
kvfence_scrub_fill_errors_total{model_name="m"} 1
# HELP kvfence_retired_pages_total Pages taken out of service for good (failed fills, canary mismatches).
# TYPE kvfence_retired_pages_total counter
kvfence_retired_pages_total{model_name="m"} 2
# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache (full pages a hit could cover).
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{domain="team",model_name="m"} 24
vllm:prefix_cache_queries_total{domain="tenant:a",model_name="m"} 12
# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{domain="team",model_name="m"} 12
vllm:prefix_cache_hits_total{domain="tenant:a",model_name="m"} 0
# HELP kvfence_prefix_cached_pages Published pages no lease holds (evictable).
# TYPE kvfence_prefix_cached_pages gauge
kvfence_prefix_cached_pages{domain="team",model_name="m"} 4
kvfence_prefix_cached_pages{domain="tenant:a",model_name="m"} 4
`
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want),
		"kvfence_pool_pages", "kvfence_pool_capacity_pages", "vllm:kv_cache_usage_perc", "kvfence_pool_faulted",
		"kvfence_admissions_total", "kvfence_refusals_total", "kvfence_tenant_admissions_total",
		"kvfence_scrub_fill_errors_total", "kvfence_retired_pages_total",
		"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "kvfence_prefix_cached_pages"))

	// Per-tenant refusals: the unknown tenant counts pool-wide only.
	assert.Equal(t, 1.0, testutil.ToFloat64(only(t, reg, "kvfence_tenant_refusals_total", "tenant", "b", "reason", "exceeds_max_context")))
	assert.Equal(t, 1.0, testutil.ToFloat64(only(t, reg, "kvfence_tenant_refusals_total", "tenant", "a", "reason", "exceeds_quota")))
	assert.Equal(t, 1.0, testutil.ToFloat64(only(t, reg, "kvfence_tenant_refusals_total", "tenant", "b", "reason", "pool_faulted")))
	assert.Equal(t, 16.0, testutil.ToFloat64(only(t, reg, "kvfence_tenant_quota_pages", "tenant", "a")))

	// The scrub counters and the fill latency histogram agree: every
	// fill that succeeded after New was timed (the initial scrub is one
	// fill more).
	s := p.Stats()
	fam := family(t, reg, "kvfence_scrub_fill_duration_seconds")
	h := fam.GetMetric()[0].GetHistogram()
	assert.Equal(t, s.Scrub.Fills-1, h.GetSampleCount())
	assert.Equal(t, float64(s.Scrub.BytesScrubbed), testutil.ToFloat64(only(t, reg, "kvfence_scrub_bytes_total")))
	buckets := h.GetBucket()
	require.Len(t, buckets, len(kvcache.FillLatencyBounds()))
	assert.Equal(t, 1e-6, buckets[0].GetUpperBound())
	assert.LessOrEqual(t, buckets[len(buckets)-1].GetCumulativeCount(), h.GetSampleCount())

	problems, err := testutil.GatherAndLint(reg)
	require.NoError(t, err)
	for _, pr := range problems {
		// vLLM's names keep their colon and "_perc" so that vLLM
		// dashboards work; everything else must lint clean.
		if !strings.HasPrefix(pr.Metric, "vllm:") {
			t.Errorf("lint: %s: %s", pr.Metric, pr.Text)
		}
	}
}

func TestCollectorWithoutTenantLabelsHasNoTenantSeries(t *testing.T) {
	p, _ := scripted(t)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(p, metrics.Options{})))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		assert.False(t, strings.HasPrefix(mf.GetName(), "kvfence_tenant_"), mf.GetName())
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				assert.NotEqual(t, "tenant", l.GetName(), mf.GetName())
				if l.GetName() == "domain" {
					assert.Contains(t, []string{"team", metrics.PrivateDomains}, l.GetValue(),
						"%s: a tenant's own domain is summed into %q", mf.GetName(), metrics.PrivateDomains)
				}
			}
		}
	}
	assert.Equal(t, 12.0, testutil.ToFloat64(only(t, reg, "vllm:prefix_cache_queries_total", "domain", metrics.PrivateDomains)))
}

// family returns the gathered family of name.
func family(t *testing.T, reg *prometheus.Registry, name string) *dto.MetricFamily {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf
		}
	}
	t.Fatalf("no metric %s", name)
	return nil
}

// only returns the one series of name whose labels include the given
// pairs, as a collector testutil.ToFloat64 can read.
func only(t *testing.T, reg *prometheus.Registry, name string, pairs ...string) prometheus.Collector {
	t.Helper()
	mf := family(t, reg, name)
	var found []*dto.Metric
	for _, m := range mf.GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		match := true
		for i := 0; i+1 < len(pairs); i += 2 {
			match = match && labels[pairs[i]] == pairs[i+1]
		}
		if match {
			found = append(found, m)
		}
	}
	require.Len(t, found, 1, "%s %v", name, pairs)
	m := found[0]
	var v float64
	switch {
	case m.GetCounter() != nil:
		v = m.GetCounter().GetValue()
	case m.GetGauge() != nil:
		v = m.GetGauge().GetValue()
	}
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "probe"}, func() float64 { return v })
}

// TestCollectorCountsHandoffOutcomesAndPublishedEvents: transfers by
// side and outcome, and the publisher's figures, next to the pool's.
func TestCollectorCountsHandoffOutcomesAndPublishedEvents(t *testing.T) {
	newPool := func(pages int) *kvcache.Pool {
		p, err := kvcache.New(kvcache.Config{Geometry: geometry, Pages: pages, MaxContextTokens: pages * 4,
			Tenants: []kvcache.TenantConfig{{Name: "a"}}, Prefix: kvcache.PrefixConfig{EventBuffer: 64}})
		require.NoError(t, err)
		t.Cleanup(func() { p.Close() })
		return p
	}
	prefill, decode := newPool(32), newPool(8)
	key, err := handoff.NewKey([]byte("metrics test key, at least 32 bytes"))
	require.NoError(t, err)
	snd, err := handoff.NewSender(handoff.SenderConfig{Key: key})
	require.NoError(t, err)
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: key})
	require.NoError(t, err)
	pub, err := kvevents.New(prefill, kvevents.Config{Endpoint: "tcp://127.0.0.1:0"})
	require.NoError(t, err)
	t.Cleanup(func() { pub.Close() })

	transfer := func(id string, prompt int) error {
		toks := tokens(0, prompt)
		l, err := prefill.TryAdmit(kvcache.Request{ID: id, Tenant: "a", PromptTokens: prompt, TokenIDs: toks})
		require.NoError(t, err)
		require.NoError(t, l.BeginPrefill())
		require.NoError(t, l.Commit(prompt))
		require.NoError(t, l.FinishPrefill())
		_, err = l.CachePrefix(prompt)
		require.NoError(t, err)
		exp, err := snd.Export(l, 0)
		require.NoError(t, err)
		in := handoff.NewInProcess(recv)
		err = exp.Send(context.Background(), in)
		in.Wait()
		if err != nil {
			require.NoError(t, exp.Abort())
		}
		return err
	}
	require.NoError(t, transfer("fits", 16))
	require.ErrorIs(t, transfer("too-long", 40), kvcache.ErrExceedsMaxContext, "the decode pool holds 32 tokens")
	if l, ok := recv.Take("fits"); assert.True(t, ok) {
		require.NoError(t, l.Release())
	}
	require.Eventually(t, func() bool { return pub.Stats().Events == prefill.Stats().Prefix.EventsSent }, 10*time.Second, time.Millisecond)

	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(prefill, metrics.Options{
		Senders: []*handoff.Sender{snd}, Receivers: []*handoff.Receiver{recv}, Events: pub})))
	for _, tc := range []struct {
		side, outcome string
		want          float64
	}{
		{"send", "ok", 1}, {"receive", "ok", 1},
		{"send", "exceeds_max_context", 1}, {"receive", "exceeds_max_context", 1},
		{"send", "bad_mac", 0},
	} {
		assert.Equal(t, tc.want, testutil.ToFloat64(only(t, reg, "kvfence_handoff_transfers_total", "side", tc.side, "outcome", tc.outcome)),
			"%s %s", tc.side, tc.outcome)
	}
	assert.Equal(t, 0.0, testutil.ToFloat64(only(t, reg, "kvfence_handoff_units_resummed_total")), "nothing landed out of order")
	ps := pub.Stats()
	assert.Equal(t, float64(ps.Events), testutil.ToFloat64(only(t, reg, "kvfence_kv_events_published_total")))
	assert.Equal(t, 2.0, testutil.ToFloat64(only(t, reg, "kvfence_kv_events_published_total")), "two prompts stored")
	assert.Equal(t, float64(ps.Batches), testutil.ToFloat64(only(t, reg, "kvfence_kv_event_batches_total")))
	assert.Equal(t, 0.0, testutil.ToFloat64(only(t, reg, "kvfence_kv_events_lost_total")))
	assert.Equal(t, 2.0, testutil.ToFloat64(only(t, reg, "kvfence_kv_events_total", "outcome", "sent")))
}

// hybridSpec is a small hybrid model: per-token pages, a sliding
// window's, and a state slot.
func hybridSpec() kvcache.CacheSpec {
	return kvcache.CacheSpec{Model: "hybrid", Groups: []kvcache.CacheGroup{
		{Name: "kv", Kind: kvcache.GroupPerToken, TokensPerPage: 4,
			Regions: kvcache.MLALatent([]int{0, 1}, 12, 4, kvcache.BF16, 4)},
		{Name: "swa", Kind: kvcache.GroupSlidingWindow, TokensPerPage: 4, WindowTokens: 8,
			Regions: kvcache.AttentionKVOf([]int{2}, 1, 8, kvcache.BF16, 4)},
		{Name: "state", Kind: kvcache.GroupState,
			Regions: kvcache.LinearAttentionState([]int{3}, 8, 4, kvcache.BF16, 2, 4, 4, kvcache.FP32)},
	}}
}

// A pool made from a cache spec reports every group's pages by state; a
// pool of one group adds no series (its pages are kvfence_pool_pages).
func TestCollectorReportsEveryCacheGroup(t *testing.T) {
	spec := hybridSpec()
	p, err := kvcache.New(kvcache.Config{Cache: spec, Pages: 16, MaxLeases: 3, MaxContextTokens: 64,
		Tenants: []kvcache.TenantConfig{{Name: "a"}}})
	require.NoError(t, err)
	defer p.Close()
	l, err := p.TryAdmit(kvcache.Request{ID: "r", Tenant: "a", PromptTokens: 20})
	require.NoError(t, err)

	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(p, metrics.Options{})))
	got := map[string]float64{}
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "kvfence_cache_group_pages" {
			continue
		}
		for _, m := range mf.GetMetric() {
			lab := map[string]string{}
			for _, lp := range m.GetLabel() {
				lab[lp.GetName()] = lp.GetValue()
			}
			got[lab["group"]+"/"+lab["kind"]+"/"+lab["state"]] = m.GetGauge().GetValue()
		}
	}
	s := p.Stats()
	require.Len(t, s.Groups, 3)
	assert.Equal(t, 5.0, got["kv/per_token/in_use"], "20 tokens in pages of 4")
	assert.Equal(t, 11.0, got["kv/per_token/free"])
	assert.Equal(t, float64(s.Groups[1].InUse), got["swa/sliding_window/in_use"])
	assert.Equal(t, 3.0, got["swa/sliding_window/in_use"], "a window of 8 tokens holds 8/4+1 pages")
	assert.Equal(t, 1.0, got["state/state/in_use"])
	assert.Equal(t, 2.0, got["state/state/free"])
	assert.Len(t, got, 15, "three groups, five states each")

	require.NoError(t, l.Release())
	require.NoError(t, p.Check())

	one, err := kvcache.New(kvcache.Config{Geometry: geometry, Pages: 8, MaxContextTokens: 32,
		Tenants: []kvcache.TenantConfig{{Name: "a"}}})
	require.NoError(t, err)
	defer one.Close()
	reg = prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(one, metrics.Options{})))
	n, err := testutil.GatherAndCount(reg, "kvfence_cache_group_pages")
	require.NoError(t, err)
	assert.Zero(t, n)
}

// A hybrid pool's state checkpoints: held by state and their bytes,
// taken, found there already, skipped for lack of room, hits and misses
// with their tokens, evicted, and the copy and restore time, each equal
// to the pool's Stats; a pool of one group sends no checkpoint series.
func TestCollectorReportsStateCheckpoints(t *testing.T) {
	spec := hybridSpec()
	// Two slots, shared by leases and checkpoints; tenant a keeps one
	// checkpoint at most.
	p, err := kvcache.New(kvcache.Config{Cache: spec, Pages: 32, MaxLeases: 2, MaxContextTokens: 64,
		Tenants: []kvcache.TenantConfig{{Name: "a", MaxCheckpoints: 1}, {Name: "b"}}})
	require.NoError(t, err)
	defer p.Close()
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(p, metrics.Options{})))
	prompt := tokens(500, 20)
	advance := func(l *kvcache.Lease, n int) {
		require.NoError(t, l.Commit(n))
		_, err := l.SlideWindows(cudaops.Ordering{})
		require.NoError(t, err)
	}

	la, err := p.TryAdmit(kvcache.Request{ID: "la", Tenant: "a", PromptTokens: 20, TokenIDs: prompt})
	require.NoError(t, err)
	// One checkpoint taken, one found there already, one over a's bound.
	advance(la, 8)
	require.NoError(t, la.CheckpointState(8, cudaops.Ordering{}))
	require.NoError(t, la.CheckpointState(8, cudaops.Ordering{}))
	advance(la, 16)
	require.ErrorIs(t, la.CheckpointState(16, cudaops.Ordering{}), kvcache.ErrCheckpointCapacity)
	require.NoError(t, la.Release())
	// A hit on it (8 tokens), and a prompt whose one matched page ends
	// before it: a miss of 4.
	lb, err := p.TryAdmit(kvcache.Request{ID: "lb", Tenant: "a", PromptTokens: 20, TokenIDs: prompt})
	require.NoError(t, err)
	require.Equal(t, 8, lb.HitTokens())
	require.NoError(t, lb.Release())
	lc, err := p.TryAdmit(kvcache.Request{ID: "lc", Tenant: "a", PromptTokens: 6, TokenIDs: prompt[:6]})
	require.NoError(t, err)
	require.Zero(t, lc.HitTokens())
	require.NoError(t, lc.Release())

	s := p.Stats().Checkpoints
	require.Equal(t, 1, s.Live)
	require.Positive(t, s.StateBytes)
	want := fmt.Sprintf(`
# HELP kvfence_state_checkpoints State checkpoints the prefix cache of a pool with window or state groups holds, by state: idle, or restoring (being copied into an admitted lease); their sum is the checkpoints held.
# TYPE kvfence_state_checkpoints gauge
kvfence_state_checkpoints{state="idle"} 1
kvfence_state_checkpoints{state="restoring"} 0
# HELP kvfence_state_checkpoint_bytes Bytes of the state slots and window pages state checkpoints hold, every group.
# TYPE kvfence_state_checkpoint_bytes gauge
kvfence_state_checkpoint_bytes %d
# HELP kvfence_state_checkpoints_taken_total State checkpoints taken (copies of a lease's state at a page boundary).
# TYPE kvfence_state_checkpoints_taken_total counter
kvfence_state_checkpoints_taken_total 1
# HELP kvfence_state_checkpoints_existing_total State checkpoint requests that found one at their prefix already (kept, nothing copied).
# TYPE kvfence_state_checkpoints_existing_total counter
kvfence_state_checkpoints_existing_total 1
# HELP kvfence_state_checkpoint_capacity_skips_total State checkpoints not taken for lack of room: the pool's or the tenant's bound, the tenant's quota, no slot free or evictable.
# TYPE kvfence_state_checkpoint_capacity_skips_total counter
kvfence_state_checkpoint_capacity_skips_total 1
# HELP kvfence_state_checkpoint_hits_total Admissions that restored a state checkpoint (their hit ends at it).
# TYPE kvfence_state_checkpoint_hits_total counter
kvfence_state_checkpoint_hits_total 1
# HELP kvfence_state_checkpoint_hit_tokens_total Prompt tokens those admissions shared.
# TYPE kvfence_state_checkpoint_hit_tokens_total counter
kvfence_state_checkpoint_hit_tokens_total 8
# HELP kvfence_state_checkpoint_misses_total Admissions that matched cached pages past their last state checkpoint, or with none: the pages were there, the state was not.
# TYPE kvfence_state_checkpoint_misses_total counter
kvfence_state_checkpoint_misses_total 1
# HELP kvfence_state_checkpoint_miss_tokens_total Prompt tokens of those pages, the hit lost for want of a checkpoint.
# TYPE kvfence_state_checkpoint_miss_tokens_total counter
kvfence_state_checkpoint_miss_tokens_total 4
# HELP kvfence_state_checkpoints_evicted_total State checkpoints evicted (least recently used first, for slots or pages; scrubbed).
# TYPE kvfence_state_checkpoints_evicted_total counter
kvfence_state_checkpoints_evicted_total 0
`, s.StateBytes)
	names := []string{"kvfence_state_checkpoints", "kvfence_state_checkpoint_bytes", "kvfence_state_checkpoints_taken_total",
		"kvfence_state_checkpoints_existing_total", "kvfence_state_checkpoint_capacity_skips_total",
		"kvfence_state_checkpoint_hits_total", "kvfence_state_checkpoint_hit_tokens_total",
		"kvfence_state_checkpoint_misses_total", "kvfence_state_checkpoint_miss_tokens_total", "kvfence_state_checkpoints_evicted_total"}
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want), names...))
	copySeconds := testutil.ToFloat64(only(t, reg, "kvfence_state_checkpoint_copy_seconds_total"))
	assert.Positive(t, copySeconds)
	assert.InDelta(t, float64(s.CopyNanos)/1e9, copySeconds, 1e-12)
	assert.InDelta(t, float64(s.RestoreNanos)/1e9, testutil.ToFloat64(only(t, reg, "kvfence_state_checkpoint_restore_seconds_total")), 1e-12)
	assert.Positive(t, s.RestoreNanos)

	// Two leases need both slots: the checkpoint is evicted for the
	// second, its bytes gone.
	x, err := p.TryAdmit(kvcache.Request{ID: "x", Tenant: "b", PromptTokens: 20})
	require.NoError(t, err)
	y, err := p.TryAdmit(kvcache.Request{ID: "y", Tenant: "b", PromptTokens: 20})
	require.NoError(t, err)
	assert.Equal(t, 0.0, testutil.ToFloat64(only(t, reg, "kvfence_state_checkpoints", "state", "idle")))
	assert.Equal(t, 0.0, testutil.ToFloat64(only(t, reg, "kvfence_state_checkpoint_bytes")))
	assert.Equal(t, 1.0, testutil.ToFloat64(only(t, reg, "kvfence_state_checkpoints_evicted_total")))
	require.NoError(t, x.Release())
	require.NoError(t, y.Release())
	require.NoError(t, p.Check())

	problems, err := testutil.GatherAndLint(reg)
	require.NoError(t, err)
	for _, pr := range problems {
		if !strings.HasPrefix(pr.Metric, "vllm:") {
			t.Errorf("lint: %s: %s", pr.Metric, pr.Text)
		}
	}

	one, err := kvcache.New(kvcache.Config{Geometry: geometry, Pages: 8, MaxContextTokens: 32,
		Tenants: []kvcache.TenantConfig{{Name: "a"}}})
	require.NoError(t, err)
	defer one.Close()
	reg = prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(one, metrics.Options{})))
	n, err := testutil.GatherAndCount(reg, names...)
	require.NoError(t, err)
	assert.Zero(t, n)
}

// TestCollectorReportsHostTier: a pool with a host tier has the
// kvfence_host_tier_* series, and they say what its Stats say: slots by
// state (adding up to its capacity), pages offloaded and onloaded, the
// copies' latency, and per domain the pages held there and the tokens
// onloaded, which the prefix-cache hits count too. A pool without one has
// none of them.
func TestCollectorReportsHostTier(t *testing.T) {
	p, err := kvcache.New(kvcache.Config{Geometry: geometry, Pages: 16, MaxContextTokens: 64,
		Tenants:  []kvcache.TenantConfig{{Name: "a", Domain: "team"}, {Name: "b"}},
		HostTier: kvcache.HostTierConfig{Pages: 8}})
	require.NoError(t, err)
	defer p.Close()
	toks := tokens(0, 17)
	l, err := p.TryAdmit(kvcache.Request{ID: "a1", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(t, err)
	require.NoError(t, l.Commit(len(toks)))
	_, err = l.CachePrefix(len(toks))
	require.NoError(t, err)
	require.NoError(t, l.Release())
	hog, err := p.TryAdmit(kvcache.Request{ID: "hog", Tenant: "b", PromptTokens: 64})
	require.NoError(t, err)
	require.NoError(t, hog.Release())
	l, err = p.TryAdmit(kvcache.Request{ID: "a2", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(t, err)
	require.Equal(t, 16, l.HitTokens())
	require.NoError(t, l.Release())

	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(p, metrics.Options{})))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	hist := map[string]uint64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			for _, lp := range m.GetLabel() {
				name += "/" + lp.GetValue()
			}
			switch {
			case m.GetGauge() != nil:
				got[name] = m.GetGauge().GetValue()
			case m.GetCounter() != nil:
				got[name] = m.GetCounter().GetValue()
			case m.GetHistogram() != nil:
				hist[name] = m.GetHistogram().GetSampleCount()
			}
		}
	}
	s := p.Stats().Tier
	assert.Equal(t, 8.0, got["kvfence_host_tier_capacity_slots"])
	sum := 0.0
	for _, st := range []string{"free", "cached", "swapped", "in_flight", "quarantined", "retired"} {
		sum += got["kvfence_host_tier_slots/"+st]
	}
	assert.Equal(t, 8.0, sum, "the slots add up")
	assert.Equal(t, 4.0, got["kvfence_host_tier_slots/cached"])
	assert.Equal(t, 4.0, got["kvfence_host_tier_pages_total/offload"])
	assert.Equal(t, 4.0, got["kvfence_host_tier_pages_total/onload"])
	assert.Equal(t, float64(s.OffloadBytes), got["kvfence_host_tier_bytes_total/offload"])
	assert.Equal(t, uint64(1), hist["kvfence_host_tier_copy_duration_seconds/offload"])
	assert.Equal(t, uint64(1), hist["kvfence_host_tier_copy_duration_seconds/onload"])
	assert.Equal(t, 4.0, got["kvfence_host_tier_domain_pages/team"])
	assert.Equal(t, 16.0, got["kvfence_host_tier_hit_tokens_total/team"])
	assert.Equal(t, 16.0, got["vllm:prefix_cache_hits_total/team"], "tier hits are prefix-cache hits")
	assert.Zero(t, got["kvfence_host_tier_domain_pages/private"])
	n, err := testutil.GatherAndCount(reg, "kvfence_host_tier_checkpoint_slots", "kvfence_host_tier_checkpoints_total",
		"kvfence_host_tier_checkpoint_restore_bytes_total")
	require.NoError(t, err)
	assert.Zero(t, n, "a pool without window or state groups keeps no checkpoints in its tier")
	_, ok := got["kvfence_host_tier_slots/checkpoints"]
	assert.False(t, ok)

	one, err := kvcache.New(kvcache.Config{Geometry: geometry, Pages: 8, MaxContextTokens: 32,
		Tenants: []kvcache.TenantConfig{{Name: "a"}}})
	require.NoError(t, err)
	defer one.Close()
	reg = prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(one, metrics.Options{})))
	n, err = testutil.GatherAndCount(reg, "kvfence_host_tier_slots", "kvfence_host_tier_pages_total")
	require.NoError(t, err)
	assert.Zero(t, n)
}

// TestCollectorReportsHostTierCheckpoints: the host tier of a hybrid pool
// keeps the state checkpoints the device evicts; its series say what its
// Stats say: the checkpoint slots (of the capacity, which counts both
// spaces, as the slots by state do), the checkpoints held, stored,
// restored by a hit and evicted for room, and the bytes restored.
func TestCollectorReportsHostTierCheckpoints(t *testing.T) {
	spec := hybridSpec()
	// Two slots, shared by leases and checkpoints: a second checkpoint
	// evicts the first from the device. The tier keeps one.
	p, err := kvcache.New(kvcache.Config{Cache: spec, Pages: 32, MaxLeases: 2, MaxContextTokens: 64,
		Tenants: []kvcache.TenantConfig{{Name: "a"}}, HostTier: kvcache.HostTierConfig{Pages: 16, Checkpoints: 1}})
	require.NoError(t, err)
	defer p.Close()
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(metrics.NewCollector(p, metrics.Options{})))
	admit := func(id string, prompt []int32) *kvcache.Lease {
		l, err := p.TryAdmit(kvcache.Request{ID: id, Tenant: "a", PromptTokens: len(prompt), TokenIDs: prompt})
		require.NoError(t, err)
		return l
	}
	checkpointed := func(id string, prompt []int32) {
		l := admit(id, prompt)
		require.NoError(t, l.Commit(8))
		_, err := l.SlideWindows(cudaops.Ordering{})
		require.NoError(t, err)
		require.NoError(t, l.CheckpointState(8, cudaops.Ordering{}))
		require.NoError(t, l.Release())
	}
	first := tokens(500, 20)
	checkpointed("c1", first)
	checkpointed("c2", tokens(900, 20)) // c1's checkpoint to the tier
	l := admit("again", first)
	require.Equal(t, 8, l.HitTokens(), "restored from the tier")
	require.NoError(t, l.Release())
	checkpointed("c3", tokens(1300, 20)) // c2's to the tier, which evicts c1's

	s := p.Stats().Tier
	require.Positive(t, s.CheckpointRestoreBytes)
	want := fmt.Sprintf(`
# HELP kvfence_host_tier_checkpoint_slots Slots of the host tier that hold state checkpoints, one whole checkpoint each (of kvfence_host_tier_capacity_slots).
# TYPE kvfence_host_tier_checkpoint_slots gauge
kvfence_host_tier_checkpoint_slots 1
# HELP kvfence_host_tier_checkpoints_total State checkpoints by outcome: stored (evicted by the device, kept in the tier), dropped (no room), failed (the copy in failed), restored (copied into an admitted lease: a hit), restore_failed (the copy back failed: the admission refused), evicted (for room, or with their page).
# TYPE kvfence_host_tier_checkpoints_total counter
kvfence_host_tier_checkpoints_total{outcome="dropped"} 0
kvfence_host_tier_checkpoints_total{outcome="evicted"} 1
kvfence_host_tier_checkpoints_total{outcome="failed"} 0
kvfence_host_tier_checkpoints_total{outcome="restore_failed"} 0
kvfence_host_tier_checkpoints_total{outcome="restored"} 1
kvfence_host_tier_checkpoints_total{outcome="stored"} 2
# HELP kvfence_host_tier_checkpoint_restore_bytes_total Bytes of state checkpoints copied out of the host tier into admitted leases.
# TYPE kvfence_host_tier_checkpoint_restore_bytes_total counter
kvfence_host_tier_checkpoint_restore_bytes_total %d
`, s.CheckpointRestoreBytes)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(want), "kvfence_host_tier_checkpoint_slots",
		"kvfence_host_tier_checkpoints_total", "kvfence_host_tier_checkpoint_restore_bytes_total"))
	assert.Equal(t, 17.0, testutil.ToFloat64(only(t, reg, "kvfence_host_tier_capacity_slots")), "16 pages and 1 checkpoint")
	assert.Equal(t, 1.0, testutil.ToFloat64(only(t, reg, "kvfence_host_tier_slots", "state", "checkpoints")))
	sum := 0.0
	for _, st := range []string{"free", "cached", "swapped", "checkpoints", "in_flight", "quarantined", "retired"} {
		sum += testutil.ToFloat64(only(t, reg, "kvfence_host_tier_slots", "state", st))
	}
	assert.Equal(t, 17.0, sum, "the slots add up, both spaces")
	require.NoError(t, p.Check())
	problems, err := testutil.GatherAndLint(reg)
	require.NoError(t, err)
	for _, pr := range problems {
		if !strings.HasPrefix(pr.Metric, "vllm:") {
			t.Errorf("lint: %s: %s", pr.Metric, pr.Text)
		}
	}
}
