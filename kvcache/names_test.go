package kvcache

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/isolation"
)

// TestNamesThatBreakWhereTheyTravelAreRefused: names go where only UTF-8
// without a NUL survives (C strings, handoff manifests, Prometheus
// labels). A request ID or adapter that is not, or a tenant added or
// moved to a domain with such a name, is refused by name, and the pool is
// as it was.
func TestNamesThatBreakWhereTheyTravelAreRefused(t *testing.T) {
	p := newPool(t, tinyConfig(16))
	before := state(p)
	for _, req := range []Request{
		{ID: "r\xff", Tenant: "a", PromptTokens: 4},
		{ID: "r\x00s", Tenant: "a", PromptTokens: 4},
		{ID: "r", Tenant: "a", PromptTokens: 4, Adapter: "lora\xfe", TokenIDs: []int32{1, 2, 3, 4}},
		{ID: "r", Tenant: "a", PromptTokens: 4, Adapter: "lo\x00ra", TokenIDs: []int32{1, 2, 3, 4}},
	} {
		_, err := p.TryAdmit(req)
		require.ErrorIs(t, err, ErrInvalidRequest, "request %q adapter %q", req.ID, req.Adapter)
	}
	_, err := p.PageKeys("a", "lora\xfe", []int32{1, 2, 3, 4}, nil)
	require.ErrorIs(t, err, ErrInvalidArgument)
	for _, tc := range []TenantConfig{{Name: "c\xff"}, {Name: "c\x00"}, {Name: "c", Domain: "team\xfe"}} {
		require.ErrorIs(t, p.AddTenant(tc), isolation.ErrInvalidTenant, "tenant %q domain %q", tc.Name, tc.Domain)
	}
	require.ErrorIs(t, p.UpdateTenant(TenantConfig{Name: "a", Domain: "team\x00"}), isolation.ErrInvalidTenant)
	assert.Equal(t, before, state(p))
	require.NoError(t, p.Check())
	_, err = New(tinyConfig(16, TenantConfig{Name: "t\xc3"}))
	require.ErrorIs(t, err, ErrInvalidConfig)
}
