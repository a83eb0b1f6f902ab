package tenancy

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/isolation"
)

func TestDomainsAssignAndMove(t *testing.T) {
	r := NewRegistry(100)
	a, err := r.Add(isolation.TenantConfig{Name: "a", Domain: "org"})
	require.NoError(t, err)
	b, err := r.Add(isolation.TenantConfig{Name: "b", Domain: "org"})
	require.NoError(t, err)
	c, err := r.Add(isolation.TenantConfig{Name: "c"})
	require.NoError(t, err)
	require.Same(t, a.Domain, b.Domain)
	assert.Equal(t, "org", a.Domain.Name)
	assert.True(t, a.Domain.Shared)
	assert.Equal(t, 2, a.Domain.Tenants)
	assert.Equal(t, isolation.PrivateDomainPrefix+"c", c.Domain.Name)
	assert.False(t, c.Domain.Shared)
	require.Same(t, c.Domain, r.DomainByID(c.Domain.ID))
	_, err = r.Check()
	require.NoError(t, err)

	org := a.Domain
	require.NoError(t, r.Update(isolation.TenantConfig{Name: "a"})) // back to its own
	assert.Equal(t, isolation.PrivateDomainPrefix+"a", a.Domain.Name)
	assert.Equal(t, 1, org.Tenants)
	require.NoError(t, r.Update(isolation.TenantConfig{Name: "c", Domain: "org"}))
	assert.Same(t, org, c.Domain)
	assert.Equal(t, 0, r.domains.byName[isolation.PrivateDomainPrefix+"c"].Tenants, "private domains stay, empty")
	require.NoError(t, r.Update(isolation.TenantConfig{Name: "a"}))
	assert.Len(t, r.Domains(), 3, "moving back reuses the tenant's own domain")
	_, err = r.Check()
	require.NoError(t, err)
	assert.Nil(t, r.DomainByID(0))
	assert.Nil(t, r.DomainByID(99))
}

func TestDomainNameValidation(t *testing.T) {
	r := NewRegistry(10)
	for _, tc := range []struct {
		name, domain string
	}{
		{"reserved prefix", isolation.PrivateDomainPrefix + "x"},
		{"too long", string(make([]byte, isolation.MaxTenantName+1))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := r.Add(isolation.TenantConfig{Name: "t", Domain: tc.domain})
			require.ErrorIs(t, err, isolation.ErrInvalidTenant)
			assert.Empty(t, r.Domains(), "a refused tenant creates no domain")
		})
	}
}
