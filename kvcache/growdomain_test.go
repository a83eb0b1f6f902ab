package kvcache

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A lease keeps the sharing domain it was admitted in (UpdateTenant), and
// so must the pages it grows: growth took them in the tenant's current
// domain, so that the lease held pages of another domain, Check failed,
// and its release (the allocator refusing pages it did not own) panicked.
func TestGrowthAfterTheTenantMovedTakesPagesInTheLeasesDomain(t *testing.T) {
	p := onDemandPool(t, 16, 0, 0, TenantConfig{Name: "a"}, TenantConfig{Name: "b", Domain: "org"})
	l, err := p.TryAdmit(Request{ID: "run", Tenant: "a", PromptTokens: 4, MaxNewTokens: 12})
	require.NoError(t, err)
	require.NoError(t, l.Commit(4))
	require.NoError(t, p.UpdateTenant(TenantConfig{Name: "a", Domain: "org"}))
	require.NoError(t, l.TryGrow(8))
	assert.Equal(t, 3, l.Pages())
	assert.Equal(t, "tenant:a", l.Domain())
	require.NoError(t, p.Check())
	assert.NotPanics(t, func() { require.NoError(t, l.Release()) })
	require.NoError(t, p.Check())
	assert.Equal(t, 16, p.Stats().FreePages)
}
