package kvcache

import (
	"bytes"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

func TestNewRefusesBadConfig(t *testing.T) {
	good := tinyConfig(16)
	cases := []struct {
		name   string
		mutate func(*Config)
		want   error
	}{
		{"zero tokens per page", func(c *Config) { c.Geometry.TokensPerPage = 0 }, ErrInvalidConfig},
		{"negative layers", func(c *Config) { c.Geometry.Layers = -2 }, ErrInvalidConfig},
		{"zero heads", func(c *Config) { c.Geometry.KVHeads = 0 }, ErrInvalidConfig},
		{"absurd head dim", func(c *Config) { c.Geometry.HeadDim = 1 << 20 }, ErrInvalidConfig},
		{"absurd layers", func(c *Config) { c.Geometry.Layers = 1 << 20 }, ErrInvalidConfig},
		{"page too large", func(c *Config) {
			c.Geometry = Geometry{TokensPerPage: 1 << 16, Layers: 1, KVHeads: 1 << 12, HeadDim: 1 << 10, DType: FP32}
		}, ErrInvalidConfig},
		{"unknown dtype", func(c *Config) { c.Geometry.DType = 99 }, ErrInvalidConfig},
		{"fp8 page not word aligned", func(c *Config) {
			c.Geometry = Geometry{TokensPerPage: 1, Layers: 1, KVHeads: 1, HeadDim: 3, DType: FP8E4M3}
		}, ErrInvalidConfig},
		{"no size", func(c *Config) { c.Pages = 0 }, ErrInvalidConfig},
		{"both sizes", func(c *Config) { c.PoolBytes = 1 << 20 }, ErrInvalidConfig},
		{"negative pages", func(c *Config) { c.Pages = -1 }, ErrInvalidConfig},
		{"pool larger than addressable", func(c *Config) { c.Pages = math.MaxInt32 + 1; c.AllowUndersizedPool = true }, ErrInvalidConfig},
		{"bytes below one page", func(c *Config) { c.Pages = 0; c.PoolBytes = 10 }, ErrInvalidConfig},
		{"no max context", func(c *Config) { c.MaxContextTokens = 0 }, ErrInvalidConfig},
		{"negative max context", func(c *Config) { c.MaxContextTokens = -5 }, ErrInvalidConfig},
		{"undersized", func(c *Config) { c.MaxContextTokens = 16*4 + 1 }, ErrUndersizedPool},
		{"poison NaN", func(c *Config) { c.Scrub = ScrubPolicy{Kind: ScrubPoison, Pattern: 0x7fc0} }, isolation.ErrNonFinitePattern},
		{"poison Inf", func(c *Config) { c.Scrub = ScrubPolicy{Kind: ScrubPoison, Pattern: 0xff80} }, isolation.ErrNonFinitePattern},
		{"poison too wide", func(c *Config) { c.Scrub = ScrubPolicy{Kind: ScrubPoison, Pattern: 0x18000} }, isolation.ErrInvalidPolicy},
		{"unknown scrub kind", func(c *Config) { c.Scrub = ScrubPolicy{Kind: 7} }, isolation.ErrInvalidPolicy},
		{"duplicate tenant", func(c *Config) { c.Tenants = append(c.Tenants, TenantConfig{Name: "a"}) }, isolation.ErrDuplicateTenant},
		{"empty tenant name", func(c *Config) { c.Tenants = []TenantConfig{{}} }, isolation.ErrInvalidTenant},
		{"reservation above quota", func(c *Config) { c.Tenants = []TenantConfig{{Name: "x", QuotaPages: 2, ReservedPages: 3}} }, isolation.ErrInvalidTenant},
		{"reservations above pool", func(c *Config) {
			c.Tenants = []TenantConfig{{Name: "x", ReservedPages: 10}, {Name: "y", ReservedPages: 10}}
		}, isolation.ErrOverReserved},
		{"device with wrong region count", func(c *Config) {
			h := cudaops.NewHost()
			h.AllocRegion(16, 64)
			c.Device = h
		}, ErrInvalidConfig},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := good
			cfg.Tenants = append([]TenantConfig(nil), good.Tenants...)
			tc.mutate(&cfg)
			p, err := New(cfg)
			assert.Nil(t, p)
			assert.ErrorIs(t, err, tc.want)
		})
	}
}

func TestPoolBytesDerivesPages(t *testing.T) {
	cfg := tinyConfig(0)
	cfg.PoolBytes = 10*tinyGeometry.PageBytes() + 7
	cfg.MaxContextTokens = 40
	p := newPool(t, cfg)
	assert.Equal(t, 10, p.Pages())
	assert.Equal(t, 40, p.CapacityTokens())
	assert.Equal(t, int64(256), tinyGeometry.PageBytes(), "4 tokens × 8 dims × 2 bytes × 4 regions")
}

func TestAdoptedRegions(t *testing.T) {
	h := cudaops.NewHost()
	defer h.Close()
	rp := tinyGeometry.RegionPageBytes()
	for range tinyGeometry.Regions() {
		// The engine's memory holds stale KV from before the pool existed.
		_, err := h.AdoptRegion(bytes.Repeat([]byte{0xee}, int(20*2*rp)), 20, 2*rp, rp)
		require.NoError(t, err)
	}
	cfg := tinyConfig(16)
	cfg.Device = h
	p := newPool(t, cfg)
	l := admit(t, p, "r", "a", 64)
	require.NoError(t, expectScrubbed(p, h, l), "a new pool hands out stale engine memory")
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())
	require.NoError(t, p.Close())
	assert.Len(t, h.Regions(), 4, "a caller's device stays open")

	short := cudaops.NewHost()
	for range tinyGeometry.Regions() {
		_, err := short.AllocRegion(8, rp)
		require.NoError(t, err)
	}
	cfg.Device = short
	_, err := New(cfg)
	assert.ErrorIs(t, err, ErrInvalidConfig, "regions smaller than the pool")
}

func TestUndersizedPoolAllowedRefusesLongRequests(t *testing.T) {
	cfg := tinyConfig(16)
	cfg.MaxContextTokens = 1000
	_, err := New(cfg)
	require.ErrorIs(t, err, ErrUndersizedPool)
	assert.Contains(t, err.Error(), "holds 64 tokens")
	assert.Contains(t, err.Error(), "max context is 1000")
	cfg.AllowUndersizedPool = true
	p := newPool(t, cfg)
	before := state(p)
	_, err = p.Admit(t.Context(), Request{ID: "long", Tenant: "a", PromptTokens: 65})
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.ErrorIs(t, err, ErrExceedsCapacity)
	assert.Equal(t, 17, ae.Need)
	assert.Equal(t, 16, ae.Limit)
	assert.True(t, ae.Permanent())
	assert.False(t, ae.Retryable())
	assert.Equal(t, before, state(p))
	require.NoError(t, p.Check())
}

func TestPagesForMemorySizesPoolFromFreeDeviceMemory(t *testing.T) {
	// An H200-like device: 141 GB free, 20 GB kept for weights and workspace.
	g := Geometry{TokensPerPage: 16, Layers: 80, KVHeads: 8, HeadDim: 128, DType: BF16} // 5 MiB per page
	pages, err := g.PagesForMemory(141e9, 20e9)
	require.NoError(t, err)
	assert.Equal(t, int(int64(121e9)/(5<<20)), pages)
	cfg := Config{Geometry: g, Pages: pages, MaxContextTokens: 1 << 20, Tenants: []TenantConfig{{Name: "a"}}}
	_, err = cfg.validate()
	require.ErrorIs(t, err, ErrUndersizedPool, "369k tokens of KV cannot hold a 1M context")
	assert.Contains(t, err.Error(), fmt.Sprintf("pool holds %d tokens", pages*16))

	_, err = g.PagesForMemory(10e9, 20e9)
	assert.ErrorIs(t, err, cudaops.ErrOutOfMemory)
	_, err = Geometry{}.PagesForMemory(1e9, 0)
	assert.ErrorIs(t, err, ErrInvalidConfig)
}
