package isolation

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestNamesThatBreakWhereTheyTravelAreRefused: a tenant or domain name
// that is not UTF-8 (a Prometheus label value must be: a scrape of it
// panicked the collector's process), that holds a NUL (C cuts it there:
// "acme\x00x" reached the pool as "acme"), that is empty or too long, is
// refused by name before the tenant is registered.
func TestNamesThatBreakWhereTheyTravelAreRefused(t *testing.T) {
	for _, c := range []TenantConfig{
		{Name: "a\xff"}, {Name: "acme\x00evil"}, {Name: ""}, {Name: strings.Repeat("n", MaxTenantName+1)},
		{Name: "ok", Domain: "d\xfe"}, {Name: "ok", Domain: "team\x00"}, {Name: "ok", Domain: strings.Repeat("d", MaxTenantName+1)},
	} {
		_, err := ValidateTenant(c, 64)
		require.ErrorIs(t, err, ErrInvalidTenant, "tenant %q domain %q", c.Name, c.Domain)
	}
	_, err := ValidateTenant(TenantConfig{Name: "équipe-α", Domain: strings.Repeat("é", MaxTenantName/2)}, 64)
	require.NoError(t, err, "any UTF-8 up to the limit in bytes")
}

func TestNameProblem(t *testing.T) {
	for s, want := range map[string]string{
		"x": "", "": "empty", "xxxxx": "5 bytes, want at most 4", "\xc3": "not UTF-8", "a\x00": "holds a NUL byte", "é": "",
	} {
		assert.Equal(t, want, NameProblem(s, 4), "%q", s)
	}
}
