package kvcache

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/internal/testlog"
)

// Tests of what operators read: the logger, per-tenant counters and the
// fill latency histogram.

func TestLoggerSilentOnAdmissionsReleasesAndRefusals(t *testing.T) {
	var logs testlog.Buffer
	cfg := tinyConfig(8)
	cfg.Logger = logs.Logger()
	p := newPool(t, cfg)
	for i := range 20 {
		l := admit(t, p, "r", "a", 8)
		_, err := p.TryAdmit(Request{ID: "big", Tenant: "b", PromptTokens: 100})
		require.ErrorIs(t, err, ErrExceedsMaxContext, "cycle %d", i)
		_, err = p.TryAdmit(Request{ID: "who", Tenant: "nobody", PromptTokens: 4})
		require.ErrorIs(t, err, ErrUnknownTenant)
		require.NoError(t, l.Release())
	}
	assert.Empty(t, logs.Records(t), "nothing is logged per admission, release or refusal")
}

func TestLoggerLogsRefusedConfigurationWithItsNumbers(t *testing.T) {
	var logs testlog.Buffer
	cfg := tinyConfig(8)
	cfg.MaxContextTokens = 1000 // 8 pages of 4 tokens hold 32
	cfg.Logger = logs.Logger()
	_, err := New(cfg)
	require.ErrorIs(t, err, ErrUndersizedPool)
	recs := logs.Records(t)
	require.Len(t, recs, 1)
	assert.Equal(t, "ERROR", recs[0]["level"])
	assert.EqualValues(t, 8, recs[0]["pages"])
	assert.EqualValues(t, 1000, recs[0]["max_context_tokens"])
	assert.Contains(t, recs[0]["error"], "pool holds 32 tokens")
}

func TestLoggerLogsFailedFillOnceWithRetiredPages(t *testing.T) {
	var logs testlog.Buffer
	dev := newScripted()
	cfg := tinyConfig(8)
	cfg.Device = dev
	cfg.Logger = logs.Logger()
	p := newPool(t, cfg)
	l := admit(t, p, "r", "a", 12) // 3 pages
	dev.mu.Lock()
	dev.mu.failFence = errors.New("device lost")
	dev.mu.Unlock()
	require.ErrorIs(t, l.Release(), ErrPoolFaulted)
	recs := logs.Records(t)
	require.Len(t, recs, 1, "one fault, one record")
	assert.Equal(t, "ERROR", recs[0]["level"])
	assert.EqualValues(t, 3, recs[0]["pages_retired"])
	assert.EqualValues(t, 3, recs[0]["retired_pages_total"])
	assert.EqualValues(t, 8, recs[0]["total_pages"])
	assert.Contains(t, recs[0]["error"], "device lost")
	// The faulted pool refuses without logging again.
	_, err := p.TryAdmit(Request{ID: "next", Tenant: "a", PromptTokens: 4})
	require.ErrorIs(t, err, ErrPoolFaulted)
	assert.Len(t, logs.Records(t), 1)
	require.NoError(t, p.Check())
}

func TestLoggerLogsCanaryMismatchWithPageAndOwner(t *testing.T) {
	var logs testlog.Buffer
	cfg := tinyConfig(4)
	cfg.Scrub = ScrubPolicy{Kind: ScrubCanary}
	cfg.Logger = logs.Logger()
	p := newPool(t, cfg)
	l := admit(t, p, "victim", "a", 16)
	bt, _ := l.BlockTable()
	require.NoError(t, l.Release())
	hostOf(t, p).PageBytes(1, bt[3])[0] ^= 0xff

	_, err := p.TryAdmit(Request{ID: "next", Tenant: "b", PromptTokens: 16})
	require.ErrorIs(t, err, ErrCanaryMismatch)
	recs := logs.Records(t)
	require.Len(t, recs, 1)
	r := recs[0]
	assert.Equal(t, "ERROR", r["level"])
	assert.EqualValues(t, 1, r["pages_retired"])
	assert.EqualValues(t, bt[3], r["page"])
	assert.EqualValues(t, 1, r["region"])
	assert.EqualValues(t, 0, r["offset"])
	assert.Equal(t, "tenant:a", r["last_owner_domain"])
	require.NoError(t, p.Check())
}

func TestTenantStatsCountAdmissionsAndRefusalsPerTenant(t *testing.T) {
	p := newPool(t, tinyConfig(8, TenantConfig{Name: "a", QuotaPages: 2}, TenantConfig{Name: "b"}))
	la := admit(t, p, "a1", "a", 8)
	lb := admit(t, p, "b1", "b", 4)
	_, err := p.TryAdmit(Request{ID: "a2", Tenant: "a", PromptTokens: 4})
	require.ErrorIs(t, err, ErrExceedsQuota)
	_, err = p.TryAdmit(Request{ID: "b1", Tenant: "b", PromptTokens: 4})
	require.ErrorIs(t, err, ErrDuplicateRequest)
	_, err = p.TryAdmit(Request{ID: "x", Tenant: "b", PromptTokens: 0})
	require.ErrorIs(t, err, ErrInvalidRequest)
	_, err = p.TryAdmit(Request{ID: "y", Tenant: "ghost", PromptTokens: 4})
	require.ErrorIs(t, err, ErrUnknownTenant)
	require.NoError(t, la.Release())
	require.NoError(t, lb.Release())

	s := p.Stats()
	require.Len(t, s.Tenants, 2)
	a, b := s.Tenants[0], s.Tenants[1]
	assert.Equal(t, uint64(1), a.Admitted)
	assert.Equal(t, Refusals{ExceedsQuota: 1}, a.Refused)
	assert.Equal(t, uint64(1), b.Admitted)
	assert.Equal(t, Refusals{DuplicateRequest: 1, InvalidRequest: 1}, b.Refused)
	// The unknown tenant counts pool-wide only.
	assert.Equal(t, uint64(1), s.Refused.UnknownTenant)
	assert.Equal(t, s.Refused.Total(), a.Refused.Total()+b.Refused.Total()+s.Refused.UnknownTenant)

	// A tenant added later gets its own counters.
	require.NoError(t, p.AddTenant(TenantConfig{Name: "c"}))
	admit(t, p, "c1", "c", 4)
	s = p.Stats()
	assert.Equal(t, uint64(1), s.Tenants[2].Admitted)
}

func TestFillLatencyCountsEveryReleaseScrub(t *testing.T) {
	p := newPool(t, tinyConfig(8))
	before := p.Stats()
	for range 5 {
		l := admit(t, p, "r", "a", 8)
		require.NoError(t, l.Release())
	}
	s := p.Stats()
	h := s.FillLatency
	assert.Equal(t, uint64(5), h.Count-before.FillLatency.Count)
	assert.Equal(t, s.Scrub.Fills-before.Scrub.Fills, h.Count-before.FillLatency.Count, "one latency per fill")
	var sum uint64
	for _, n := range h.Buckets {
		sum += n
	}
	assert.Equal(t, h.Count, sum)
	assert.Positive(t, h.Sum)
}

func TestFillLatencyIncludesTheWaitForAnAsynchronousFence(t *testing.T) {
	dev := newScripted()
	cfg := tinyConfig(8)
	cfg.Device = dev
	p := newPool(t, cfg)
	l := admit(t, p, "r", "a", 8)
	dev.mu.Lock()
	dev.mu.hold = true
	dev.mu.Unlock()
	require.NoError(t, l.Release())
	const held = 30 * time.Millisecond
	time.Sleep(held)
	dev.complete()
	require.Eventually(t, func() bool { return p.Stats().FillLatency.Count == 1 }, 10*time.Second, time.Millisecond)
	h := p.Stats().FillLatency
	assert.GreaterOrEqual(t, h.Sum, held)
	// It landed in a bucket above the hold.
	for i, bound := range FillLatencyBounds() {
		if bound < held {
			assert.Zero(t, h.Buckets[i], "bucket ≤ %v", bound)
		}
	}
}

func TestFillLatencyNotCountedForFailedFills(t *testing.T) {
	dev := newScripted()
	cfg := tinyConfig(8)
	cfg.Device = dev
	p := newPool(t, cfg)
	l := admit(t, p, "r", "a", 8)
	dev.mu.Lock()
	dev.mu.failNext = errors.New("launch failed")
	dev.mu.Unlock()
	require.ErrorIs(t, l.Release(), ErrPoolFaulted)
	assert.Zero(t, p.Stats().FillLatency.Count)
}
