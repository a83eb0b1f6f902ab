package kvsim

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testGenConfig(seed uint64) GenConfig {
	return GenConfig{Seed: seed, Duration: 20 * time.Second, Rate: 50, Tenants: 6, OverlongFraction: 0.1,
		AbortFraction: 0.2, CapacityTokens: 16384, MaxContext: 65536, TokensPerPage: 16}
}

func TestGenerateDeterministic(t *testing.T) {
	a, err := Generate(testGenConfig(42))
	require.NoError(t, err)
	b, err := Generate(testGenConfig(42))
	require.NoError(t, err)
	assert.Equal(t, a, b, "same seed, same trace")
	c, err := Generate(testGenConfig(43))
	require.NoError(t, err)
	assert.NotEqual(t, a.Requests, c.Requests, "another seed, another trace")
}

func TestGenerateShape(t *testing.T) {
	cfg := testGenConfig(1)
	tr, err := Generate(cfg)
	require.NoError(t, err)
	n := len(tr.Requests)
	// Poisson at 50/s over 20s: 1000 ± a few standard deviations (√1000 ≈ 32).
	assert.InDelta(t, 1000, n, 150)
	require.Len(t, tr.Tenants, cfg.Tenants)
	assert.Equal(t, cfg.CapacityTokens/cfg.TokensPerPage/4, tr.Tenants[cfg.Tenants-1].QuotaPages, "the batch tenant's quota")

	var overContext, overPool, aborting, prefixed int
	var prompts []int
	perTenant := map[string]int{}
	for i, r := range tr.Requests {
		require.GreaterOrEqual(t, r.At, time.Duration(0))
		require.Less(t, r.At, cfg.Duration)
		if i > 0 {
			require.GreaterOrEqual(t, r.At, tr.Requests[i-1].At, "arrivals sorted")
		}
		require.GreaterOrEqual(t, r.Prompt, 1)
		require.LessOrEqual(t, r.Prefix, r.Prompt)
		require.GreaterOrEqual(t, r.MaxNew, r.Output)
		require.GreaterOrEqual(t, r.Output, 1)
		require.Less(t, r.AbortAfter, r.Output)
		perTenant[r.Tenant]++
		switch total := r.Prompt + r.MaxNew; {
		case total > cfg.MaxContext:
			overContext++
		case total > cfg.CapacityTokens:
			overPool++
		default:
			prompts = append(prompts, r.Prompt)
		}
		if r.AbortAfter >= 0 {
			aborting++
		}
		if r.Prefix > 0 {
			prefixed++
		}
	}
	assert.InDelta(t, 0.1*float64(n), overContext+overPool, 0.04*float64(n), "over-long share")
	assert.Positive(t, overContext, "some exceed the context window")
	assert.Positive(t, overPool, "some fit the window but not the pool")
	assert.InDelta(t, 0.2*float64(n), aborting, 0.05*float64(n), "abort share")
	assert.Positive(t, prefixed, "tenants share system prompts")
	// Zipf popularity: the first tenant is the busiest.
	for name, c := range perTenant {
		assert.LessOrEqual(t, c, perTenant["tenant-00"], name)
	}
	// A long tail: p99 of ordinary prompts is many times the median.
	slices.Sort(prompts)
	assert.Greater(t, Percentile(prompts, 0.99), 5*Percentile(prompts, 0.5))
}

// Organisations share a system prompt and name a domain; token IDs are
// deterministic, equal over a shared prefix and unique elsewhere.
func TestGenerateOrganisationsAndTokens(t *testing.T) {
	cfg := testGenConfig(9)
	cfg.Tenants, cfg.OrgSize, cfg.OverlongFraction = 10, 4, 0
	tr, err := Generate(cfg)
	require.NoError(t, err)
	wantDomains := []string{"org-00", "org-00", "org-00", "org-00", "org-01", "org-01", "org-01", "org-01", "org-02", "org-02"}
	for i, tn := range tr.Tenants {
		assert.Equal(t, wantDomains[i], tn.Domain, tn.Name)
		if i%4 == 3 {
			assert.Zero(t, tn.SystemPrompt, "%s uses no system prompt", tn.Name)
		} else {
			assert.Equal(t, tr.Tenants[i/4*4].SystemPrompt, tn.SystemPrompt, "%s uses its organisation's prompt", tn.Name)
		}
	}
	// Two requests of different tenants of one organisation, both with
	// the system prompt.
	var first, other *Request
	for i := range tr.Requests {
		r := &tr.Requests[i]
		switch {
		case r.Prefix == 0:
		case r.Tenant == "tenant-00" && first == nil:
			first = r
		case r.Tenant == "tenant-01" && other == nil:
			other = r
		}
	}
	require.NotNil(t, first)
	require.NotNil(t, other)
	assert.Equal(t, "org-00", first.PrefixID)
	assert.Equal(t, first.PrefixID, other.PrefixID)
	assert.Equal(t, first.Prefix, other.Prefix)

	a := AppendPromptTokens(nil, 1, first, 0)
	b := AppendPromptTokens(nil, 1, other, 0)
	require.Len(t, a, first.Prompt)
	require.Len(t, b, other.Prompt)
	assert.Equal(t, a, AppendPromptTokens(nil, 1, first, 0), "same seed, same tokens")
	assert.Equal(t, a[:first.Prefix], b[:first.Prefix], "the shared system prompt")
	assert.NotEqual(t, a[first.Prefix:min(len(a), len(b))], b[first.Prefix:min(len(a), len(b))], "the users' prompts differ")
	assert.NotEqual(t, a[:first.Prefix], AppendPromptTokens(nil, 2, first, 0)[:first.Prefix], "another seed, other tokens")
	for _, tok := range a {
		require.True(t, tok >= 0 && tok < Vocab)
	}
	// No two requests share a full page outside their prefix.
	seen := map[[16]int32]string{}
	for i := range tr.Requests[:min(len(tr.Requests), 200)] {
		r := &tr.Requests[i]
		toks := AppendPromptTokens(nil, 1, r, 0)
		for p := (r.Prefix + 15) / 16 * 16; p+16 <= len(toks); p += 16 {
			k := [16]int32(toks[p : p+16])
			if prev, dup := seen[k]; dup {
				t.Fatalf("page at token %d of %s also in %s", p, r.ID, prev)
			}
			seen[k] = r.ID
		}
	}

	// OrgSize 0 or 1: tenants alone, each with a prompt of its own.
	cfg.OrgSize = 1
	alone, err := Generate(cfg)
	require.NoError(t, err)
	for _, tn := range alone.Tenants {
		assert.Empty(t, tn.Domain)
	}
	for _, r := range alone.Requests {
		if r.Prefix > 0 {
			assert.Equal(t, r.Tenant, r.PrefixID)
		}
	}
}

func TestGenerateBadConfig(t *testing.T) {
	tests := []struct {
		name string
		mod  func(*GenConfig)
	}{
		{"zero duration", func(c *GenConfig) { c.Duration = 0 }},
		{"zero rate", func(c *GenConfig) { c.Rate = 0 }},
		{"NaN rate", func(c *GenConfig) { c.Rate = nan() }},
		{"no tenants", func(c *GenConfig) { c.Tenants = 0 }},
		{"too many tenants", func(c *GenConfig) { c.Tenants = 256 }},
		{"overlong 1", func(c *GenConfig) { c.OverlongFraction = 1 }},
		{"negative abort", func(c *GenConfig) { c.AbortFraction = -0.1 }},
		{"no capacity", func(c *GenConfig) { c.CapacityTokens = 0 }},
		{"too many requests", func(c *GenConfig) { c.Rate, c.Duration = 1e6, time.Minute }},
		{"negative org size", func(c *GenConfig) { c.OrgSize = -1 }},
		{"org size too big", func(c *GenConfig) { c.OrgSize = 256 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := testGenConfig(1)
			tt.mod(&cfg)
			_, err := Generate(cfg)
			assert.ErrorIs(t, err, ErrBadConfig)
		})
	}
}

func nan() float64 { zero := 0.0; return zero / zero }
