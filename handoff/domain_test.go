package handoff_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// TestSharingDomains: a manifest names the sharing domain its lease was
// admitted in, taken from the prefill pool's own configuration, and the
// decode pool admits the import only if the tenant is in that domain
// there. A refusal leaves no decode lease and both pools clean.
func TestSharingDomains(t *testing.T) {
	org := []kvcache.TenantConfig{{Name: "victim", Domain: "org"}, {Name: "colleague", Domain: "org"}, {Name: "other"}}
	own := []kvcache.TenantConfig{{Name: "victim"}, {Name: "colleague", Domain: "org"}, {Name: "other"}}
	tests := []struct {
		name       string
		src, dst   []kvcache.TenantConfig
		afterAdmit func(prefill, decode *kvcache.Pool) // before the export
		afterExp   func(prefill, decode *kvcache.Pool) // before the import
		domain     string                              // the manifest's
		want       error
	}{
		{name: "own domain on both sides", src: own, dst: own, domain: "tenant:victim"},
		{name: "same shared domain on both sides", src: org, dst: org, domain: "org"},
		{name: "shared on prefill, own on decode", src: org, dst: own, domain: "org", want: handoff.ErrDomainMismatch},
		{name: "own on prefill, shared on decode", src: own, dst: org, domain: "tenant:victim", want: handoff.ErrDomainMismatch},
		{name: "moved on decode between export and import", src: org, dst: org, domain: "org",
			afterExp: func(_, decode *kvcache.Pool) {
				require.NoError(t, decode.UpdateTenant(kvcache.TenantConfig{Name: "victim"}))
			}, want: handoff.ErrDomainMismatch},
		{name: "moved on both sides between export and import", src: org, dst: org, domain: "org",
			afterExp: func(prefill, decode *kvcache.Pool) {
				require.NoError(t, prefill.UpdateTenant(kvcache.TenantConfig{Name: "victim"}))
				require.NoError(t, decode.UpdateTenant(kvcache.TenantConfig{Name: "victim"}))
			}, want: handoff.ErrDomainMismatch},
		// The pages belong to the domain the lease was admitted in: a move
		// on the prefill side after admission does not relabel them.
		{name: "moved on prefill after admission", src: org, dst: org, domain: "org",
			afterAdmit: func(prefill, _ *kvcache.Pool) {
				require.NoError(t, prefill.UpdateTenant(kvcache.TenantConfig{Name: "victim"}))
			}},
		{name: "moved on both sides after admission", src: org, dst: org, domain: "org",
			afterAdmit: func(prefill, decode *kvcache.Pool) {
				require.NoError(t, prefill.UpdateTenant(kvcache.TenantConfig{Name: "victim"}))
				require.NoError(t, decode.UpdateTenant(kvcache.TenantConfig{Name: "victim"}))
			}, want: handoff.ErrDomainMismatch},
	}
	ctx := context.Background()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			prefill := pool(t, testkit.PoolConfig{Pages: 200, Tenants: tc.src})
			decode := pool(t, testkit.PoolConfig{Pages: 400, Tenants: tc.dst})
			recv := receiver(t, decode)
			inproc := handoff.NewInProcess(recv)

			l, err := testkit.Prefill(prefill, "req", "victim", 40*16-3)
			require.NoError(t, err)
			if tc.afterAdmit != nil {
				tc.afterAdmit(prefill, decode)
			}
			exp, err := sender(t).Export(l, 100)
			require.NoError(t, err)
			assert.Equal(t, tc.domain, exp.Manifest().Domain)
			if tc.afterExp != nil {
				tc.afterExp(prefill, decode)
			}
			err = exp.Send(ctx, inproc)
			inproc.Wait()
			if tc.want != nil {
				var re *handoff.RefusedError
				require.ErrorAs(t, err, &re, "got %v", err)
				assert.ErrorIs(t, err, tc.want)
				assert.Equal(t, "manifest", re.Stage, "refused before any page moved")
				t.Logf("refused: %v", err)
				assertNoImport(t, recv, decode, "req")
				assert.Zero(t, decode.Stats().LiveLeases)
				require.NoError(t, exp.Abort())
			} else {
				require.NoError(t, err)
				dl, ok := recv.Take("req")
				require.True(t, ok)
				assert.Equal(t, tc.domain, dl.Domain())
				require.NoError(t, testkit.VerifyContent(decode, dl, "req"))
				require.NoError(t, dl.Release())
			}
			sweep(t, prefill, decode)
		})
	}
}

// TestImportedPrefixSharing: a decode lease delivered by an import may
// publish its verified prompt pages in its domain once the engine attaches
// the prompt's tokens; the domain's other tenants then share them, other
// domains do not.
func TestImportedPrefixSharing(t *testing.T) {
	tenants := []kvcache.TenantConfig{{Name: "victim", Domain: "org"}, {Name: "colleague", Domain: "org"}, {Name: "other"}}
	prefill := pool(t, testkit.PoolConfig{Pages: 200, Tenants: tenants})
	decode := pool(t, testkit.PoolConfig{Pages: 400, Tenants: tenants})
	const prompt = 40*16 - 3 // 39 full pages
	tokens := make([]int32, prompt)
	for i := range tokens {
		tokens[i] = int32(7 * i)
	}
	recv := receiver(t, decode, func(c *handoff.ReceiverConfig) {
		c.Deliver = func(l *kvcache.Lease) {
			// The engine knows the request's tokens; the receiver does not.
			require.NoError(t, l.AttachTokens("", tokens))
			n, err := l.CachePrefix(l.Written())
			require.NoError(t, err)
			assert.Equal(t, 39*16, n)
			require.NoError(t, l.Commit(prompt+10)) // decoding
			require.NoError(t, l.Release())
		}
	})
	inproc := handoff.NewInProcess(recv)
	l, err := testkit.Prefill(prefill, "req", "victim", prompt)
	require.NoError(t, err)
	exp, err := sender(t).Export(l, 100)
	require.NoError(t, err)
	require.NoError(t, exp.Send(context.Background(), inproc))
	inproc.Wait()
	require.NoError(t, decode.Check())
	assert.Equal(t, 39, decode.Stats().CachedPages)

	ctx := context.Background()
	col, err := decode.Admit(ctx, kvcache.Request{ID: "col", Tenant: "colleague", PromptTokens: prompt, TokenIDs: tokens})
	require.NoError(t, err)
	assert.Equal(t, 39*16, col.HitTokens())
	oth, err := decode.Admit(ctx, kvcache.Request{ID: "oth", Tenant: "other", PromptTokens: prompt, TokenIDs: tokens})
	require.NoError(t, err)
	assert.Zero(t, oth.HitTokens())
	require.NoError(t, decode.Check())
	require.NoError(t, col.Release())
	require.NoError(t, oth.Release())
	require.NoError(t, decode.ClearPrefixCache())
	sweep(t, prefill, decode)
}

// TestLongTenantNamesHandOff: a tenant's own domain is "tenant:" + its
// name, so a tenant whose name is near the longest a pool accepts has a
// domain name longer than a tenant name or request ID may be. Its leases
// must export, import and verify like any other's (the manifest refused
// the domain, and Export aborted the prefilled lease).
func TestLongTenantNamesHandOff(t *testing.T) {
	long := strings.Repeat("t", kvcache.MaxIDLen)
	for _, tc := range []struct{ name, tenant, id string }{
		{"longest tenant name", long, "req"},
		{"longest tenant name and request ID", long, strings.Repeat("r", kvcache.MaxIDLen)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tenants := []kvcache.TenantConfig{{Name: tc.tenant}}
			prefill := pool(t, testkit.PoolConfig{Pages: 64, Tenants: tenants})
			decode := pool(t, testkit.PoolConfig{Pages: 128, Tenants: tenants})
			recv := receiver(t, decode)
			inproc := handoff.NewInProcess(recv)

			l, err := testkit.Prefill(prefill, tc.id, tc.tenant, 5*16)
			require.NoError(t, err)
			exp, err := sender(t).Export(l, 16)
			require.NoError(t, err, "a lease the pool admitted could not be exported")
			assert.Equal(t, "tenant:"+tc.tenant, exp.Manifest().Domain)
			require.NoError(t, exp.Send(context.Background(), inproc))
			inproc.Wait()
			dl, ok := recv.Take(tc.id)
			require.True(t, ok)
			assert.Equal(t, tc.tenant, dl.Tenant())
			assert.Equal(t, "tenant:"+tc.tenant, dl.Domain())
			require.NoError(t, testkit.VerifyContent(decode, dl, tc.id))
			require.NoError(t, dl.Release())
			sweep(t, prefill, decode)
		})
	}
}

// TestNamesAManifestCannotCarryNeverReachExport: a manifest carries
// names of UTF-8 only, and Export of a lease whose name it could not carry
// would be refused after the lease was prefilled. The pool refuses such
// names where they come in (a tenant's at configuration, a request ID at
// admission), so no lease has one.
func TestNamesAManifestCannotCarryNeverReachExport(t *testing.T) {
	_, err := testkit.NewPool(testkit.PoolConfig{Pages: 64, Tenants: []kvcache.TenantConfig{{Name: "t\xff\xfe"}}})
	require.ErrorIs(t, err, kvcache.ErrInvalidConfig, "a tenant name that is not UTF-8")
	prefill := pool(t, testkit.PoolConfig{Pages: 64, Tenants: []kvcache.TenantConfig{{Name: "victim"}}})
	_, err = testkit.Prefill(prefill, "req-\xc3", "victim", 5*16)
	require.ErrorIs(t, err, kvcache.ErrInvalidRequest, "a request ID that is not UTF-8")
	require.NoError(t, prefill.Check())
	sweep(t, prefill)
}
