package kvcache

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The incident: a model with a 1,048,576-token context served from prefill
// GPUs whose pool held 681,280 tokens (42,580 pages of 16). An over-long
// prompt was replaced by a one-token placeholder and its "KV" shipped to
// decode from pages holding other tenants' data.
const (
	incidentPoolTokens = 681_280
	incidentContext    = 1_048_576
	incidentPrompt     = 700_000
)

func incidentConfig() Config {
	return Config{
		// Small per-token bytes keep the test light; the token numbers are
		// the incident's.
		Geometry:         Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 2, DType: BF16},
		Pages:            incidentPoolTokens / 16,
		MaxContextTokens: incidentContext,
		Tenants:          []TenantConfig{{Name: "victim"}, {Name: "attacker"}},
	}
}

func TestIncidentRegression(t *testing.T) {
	cfg := incidentConfig()
	_, err := New(cfg)
	require.ErrorIs(t, err, ErrUndersizedPool, "the incident's pool must be refused at construction")
	assert.Contains(t, err.Error(), "681280 tokens")
	assert.Contains(t, err.Error(), "1048576")

	cfg.AllowUndersizedPool = true
	p := newPool(t, cfg)
	victim := admit(t, p, "victim-1", "victim", 30_000)
	before := state(p)

	l, err := p.TryAdmit(Request{ID: "over-long", Tenant: "attacker", PromptTokens: incidentPrompt, MaxNewTokens: 1})
	require.Nil(t, l, "no lease, no placeholder")
	require.ErrorIs(t, err, ErrExceedsCapacity)
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, 43_751, ae.Need)
	assert.Equal(t, 42_580, ae.Limit)
	assert.Equal(t, incidentPrompt+1, ae.NeedTokens)
	assert.Equal(t, incidentPoolTokens, ae.LimitTokens)
	assert.True(t, ae.Permanent())
	assert.Equal(t, before, state(p), "not one page changed hands")
	require.NoError(t, p.Check())

	// Waiting does not help a permanent refusal: it returns at once.
	ctx, cancel := context.WithTimeout(context.Background(), 1e9)
	defer cancel()
	_, err = p.Admit(ctx, Request{ID: "over-long", Tenant: "attacker", PromptTokens: incidentPrompt})
	require.ErrorIs(t, err, ErrExceedsCapacity)
	assert.True(t, victim.Live())
}
