package kvcache

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The incident: a model with a 1,048,576-token context served from prefill
// GPUs whose pool held 681,280 tokens. An over-long prompt was replaced by
// a one-token placeholder and its "KV" shipped to decode from pages
// holding other tenants' data.
//
// The replay runs on the GLM-5 preset, a GLM-family model (MLA latents
// and sparse-attention indexer keys on 78 layers, pages of 64 tokens):
// 681,280 tokens are 10,645 of its pages. At the model's size that pool
// is 68 GB of host memory, so the pool that admits is the preset's
// miniature (incidentShrink): the same groups, pages and tokens, hence
// the same decisions, at 1/64 of one layer's bytes. Bytes are reported
// from the full preset.
const (
	incidentPreset     = "glm-5"
	incidentPoolTokens = 681_280
	incidentContext    = 1_048_576
	incidentLayers     = 1
	incidentShrink     = 64
)

// incidentConfig is the incident's pool of spec s: 681,280 tokens for a
// 1,048,576-token context.
func incidentConfig(s CacheSpec) Config {
	return Config{
		Cache:            s,
		Pages:            incidentPoolTokens / s.TokensPerPage(),
		MaxContextTokens: incidentContext,
		Tenants:          []TenantConfig{{Name: "victim"}, {Name: "attacker"}},
	}
}

func incidentSpecs(t *testing.T) (full, mini CacheSpec) {
	t.Helper()
	full, err := Preset(incidentPreset)
	require.NoError(t, err)
	mini, err = full.Miniature(incidentLayers, incidentShrink)
	require.NoError(t, err)
	return full, mini
}

func TestIncidentPoolAtTheModelsSizeIsRefusedAtConstruction(t *testing.T) {
	full, mini := incidentSpecs(t)
	require.Equal(t, 0, incidentPoolTokens%full.TokensPerPage(), "the incident's pool is a whole number of pages")

	// GLM-5: 78 layers × ((kv_lora_rank 512 + qk_rope_head_dim 64) bf16
	// latent + 128 fp8 indexer key + one fp32 scale).
	const tokenBytes = 78 * ((512+64)*2 + 128 + 4)
	require.Equal(t, int64(tokenBytes), full.TokenBytes())
	poolBytes := full.BytesFor(incidentPoolTokens/full.TokensPerPage(), 0)
	require.Equal(t, int64(incidentPoolTokens)*tokenBytes, poolBytes)
	miniBytes := mini.BytesFor(incidentPoolTokens/mini.TokensPerPage(), 0)
	t.Logf("%s: %d bytes per token; the incident's pool of %d tokens is %d bytes (%.1f GiB) at the model's size, %d bytes (%.1f MiB) as the replay's miniature",
		incidentPreset, full.TokenBytes(), incidentPoolTokens, poolBytes, float64(poolBytes)/(1<<30), miniBytes, float64(miniBytes)/(1<<20))

	// Refused before anything is allocated: the 68 GB are never asked for.
	for _, s := range []CacheSpec{full, mini} {
		p, err := New(incidentConfig(s))
		require.Nil(t, p)
		require.ErrorIs(t, err, ErrUndersizedPool, "the incident's pool must be refused at construction (%s)", s.Model)
		assert.Contains(t, err.Error(), "681280 tokens")
		assert.Contains(t, err.Error(), "1048576")
	}
}

func TestIncidentRegression(t *testing.T) {
	_, mini := incidentSpecs(t)
	cfg := incidentConfig(mini)
	cfg.AllowUndersizedPool = true
	p := newPool(t, cfg)
	require.Equal(t, incidentPoolTokens, p.CapacityTokens())
	host := hostOf(t, p)

	// The victim's KV fills every byte of its pages, in every region.
	victim := admit(t, p, "victim-1", "victim", 30_000)
	table, err := victim.BlockTable()
	require.NoError(t, err)
	secret := []byte("victim's private prompt ")
	for r := range host.Regions() {
		for _, pg := range table {
			mem := host.PageBytes(r, pg)
			for i := range mem {
				mem[i] = secret[i%len(secret)]
			}
		}
	}
	before := state(p)

	// The over-long request asks for the model's whole context.
	l, err := p.TryAdmit(Request{ID: "over-long", Tenant: "attacker", PromptTokens: incidentContext - 1, MaxNewTokens: 1})
	require.Nil(t, l, "no lease, no placeholder")
	require.ErrorIs(t, err, ErrExceedsCapacity)
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, incidentContext/64, ae.Need, "pages of 64 tokens the context needs")
	assert.Equal(t, incidentPoolTokens/64, ae.Limit)
	assert.Equal(t, incidentContext, ae.NeedTokens)
	assert.Equal(t, incidentPoolTokens, ae.LimitTokens)
	assert.Contains(t, err.Error(), "(1048576 tokens)")
	assert.Contains(t, err.Error(), "(681280 tokens)")
	assert.True(t, ae.Permanent())
	assert.Equal(t, before, state(p), "not one page changed hands")
	require.NoError(t, p.Check())

	// Waiting does not help a permanent refusal: it returns at once.
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err = p.Admit(ctx, Request{ID: "over-long", Tenant: "attacker", PromptTokens: incidentContext})
	require.ErrorIs(t, err, ErrExceedsCapacity)
	require.NoError(t, ctx.Err(), "the refusal did not wait")
	assert.True(t, victim.Live())
	assert.Equal(t, before, state(p))

	// And nothing touched the victim's pages.
	for r := range host.Regions() {
		for _, pg := range table {
			mem := host.PageBytes(r, pg)
			assert.True(t, bytes.HasPrefix(mem, secret), "region %d page %d", r, pg)
		}
	}
	require.NoError(t, p.Check())
}
