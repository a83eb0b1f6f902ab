package kvcache

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// domainPool is handoffPool with the tenants given (each may name a
// sharing domain); tenant "a" is added in its own domain when absent.
func domainPool(t *testing.T, pages int, tenants ...TenantConfig) *Pool {
	t.Helper()
	g := Geometry{TokensPerPage: 4, Layers: 2, KVHeads: 1, HeadDim: 4, DType: FP16}
	hasA := false
	for _, tc := range tenants {
		hasA = hasA || tc.Name == "a"
	}
	if !hasA {
		tenants = append(tenants, TenantConfig{Name: "a"})
	}
	p, err := New(Config{
		Device:           canaryDevice(t, g, pages, ScrubPolicy{Kind: ScrubCanary}),
		Geometry:         g,
		Pages:            pages,
		MaxContextTokens: pages * 4,
		Tenants:          tenants,
		Scrub:            ScrubPolicy{Kind: ScrubCanary},
	})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// canarySweep checks that an idle pool's accounting holds and that every
// page carries its canary: admitting the whole pool verifies each one.
func canarySweep(t *testing.T, p *Pool) {
	t.Helper()
	require.NoError(t, p.Check())
	require.NoError(t, p.ClearPrefixCache())
	s := p.Stats()
	require.Zero(t, s.LiveLeases)
	require.Zero(t, s.InUsePages)
	all, err := p.TryAdmit(Request{ID: "canary-sweep", Tenant: "a", PromptTokens: p.CapacityTokens()})
	require.NoError(t, err)
	require.NoError(t, all.Release())
	require.NoError(t, p.Check())
	require.Zero(t, p.Stats().Scrub.CanaryFailures)
}

// transfer copies every exported page into the import and completes it.
func transfer(t *testing.T, out *Outgoing, in *Incoming) (*Lease, error) {
	t.Helper()
	buf := make([]byte, out.Units()*int(out.Geometry().PageBytes()))
	require.NoError(t, out.ReadUnits(0, buf))
	require.NoError(t, in.WriteUnits(0, buf))
	return in.Complete()
}

func TestTenantDomain(t *testing.T) {
	p := domainPool(t, 8, TenantConfig{Name: "a", Domain: "org"}, TenantConfig{Name: "b"})
	tests := []struct {
		tenant string
		want   string
		err    error
	}{
		{"a", "org", nil},
		{"b", "tenant:b", nil},
		{"nobody", "", ErrUnknownTenant},
	}
	for _, tt := range tests {
		got, err := p.TenantDomain(tt.tenant)
		assert.ErrorIs(t, err, tt.err, tt.tenant)
		assert.Equal(t, tt.want, got, tt.tenant)
	}
	require.NoError(t, p.UpdateTenant(TenantConfig{Name: "a"}))
	got, err := p.TenantDomain("a")
	require.NoError(t, err)
	assert.Equal(t, "tenant:a", got)
	require.NoError(t, p.Close())
	_, err = p.TenantDomain("a")
	assert.ErrorIs(t, err, ErrPoolClosed)
}

// TestImportDomain: an import is admitted only in the sharing domain its
// KV was computed in; every refusal leaves both pools clean.
func TestImportDomain(t *testing.T) {
	tests := []struct {
		name     string
		src, dst []TenantConfig
		domain   string // overrides the exported lease's domain when set
		during   func(dst *Pool) error
		want     error
	}{
		{name: "own domain on both sides"},
		{name: "same shared domain", src: []TenantConfig{{Name: "a", Domain: "org"}}, dst: []TenantConfig{{Name: "a", Domain: "org"}}},
		{name: "shared here, own there", src: []TenantConfig{{Name: "a", Domain: "org"}}, want: ErrDomainMismatch},
		{name: "own here, shared there", dst: []TenantConfig{{Name: "a", Domain: "org"}}, want: ErrDomainMismatch},
		{name: "shared domains named differently", src: []TenantConfig{{Name: "a", Domain: "org"}}, dst: []TenantConfig{{Name: "a", Domain: "org2"}}, want: ErrDomainMismatch},
		{name: "another tenant's own domain", domain: "tenant:b", dst: []TenantConfig{{Name: "b"}}, want: ErrDomainMismatch},
		{name: "no domain", domain: "-", want: ErrInvalidArgument},
		{name: "moved during the admission", during: func(dst *Pool) error {
			return dst.UpdateTenant(TenantConfig{Name: "a", Domain: "elsewhere"})
		}, want: ErrDomainMismatch},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			src, dst := domainPool(t, 16, tt.src...), domainPool(t, 32, tt.dst...)
			l := prefilled(t, src, "r", 10)
			out, err := l.Export(time.Now().Add(time.Minute))
			require.NoError(t, err)
			domain := out.Domain()
			assert.Equal(t, l.Domain(), domain)
			switch tt.domain {
			case "":
			case "-":
				domain = ""
			default:
				domain = tt.domain
			}
			if tt.during != nil {
				testHookBeforeImportAdmit = func() { require.NoError(t, tt.during(dst)) }
				t.Cleanup(func() { testHookBeforeImportAdmit = nil })
			}
			in, err := dst.BeginImport(context.Background(), Request{ID: "r", Tenant: "a", PromptTokens: 10, MaxNewTokens: 8}, domain, mustChecksum(t, out))
			testHookBeforeImportAdmit = nil
			if tt.want != nil {
				require.ErrorIs(t, err, tt.want)
				assert.Nil(t, in)
				t.Logf("refused: %v", err)
				s := dst.Stats()
				assert.Zero(t, s.LiveLeases, "a decode lease exists")
				assert.Zero(t, s.InUsePages)
				require.NoError(t, out.Abort())
			} else {
				require.NoError(t, err)
				got, err := transfer(t, out, in)
				require.NoError(t, err)
				assert.Equal(t, domain, got.Domain())
				require.NoError(t, out.Ack())
				require.NoError(t, got.Release())
			}
			canarySweep(t, src)
			canarySweep(t, dst)
		})
	}
}

// TestExportSealsWrites: once exported, a lease's pages take no writes
// (their checksum is computed and a transfer reads them); a lease
// delivered by an import takes commits for the tokens it generates.
func TestExportSealsWrites(t *testing.T) {
	src, dst := handoffPool(t, 16), handoffPool(t, 32)
	l, err := src.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 10, MaxNewTokens: 6})
	require.NoError(t, err)
	require.NoError(t, l.BeginPrefill())
	require.NoError(t, l.Commit(10))
	require.NoError(t, l.FinishPrefill())
	out, err := l.Export(time.Now().Add(time.Minute))
	require.NoError(t, err)

	writes := []struct {
		name string
		call func() error
	}{
		{"commit of the prompt again", func() error { return l.Commit(10) }},
		{"commit of a generated token", func() error { return l.Commit(11) }},
		{"commit of everything", func() error { return l.Commit(16) }},
		{"slot mapping of the prompt", func() error { _, err := l.SlotMapping(0, 10, nil); return err }},
		{"slot mapping past it", func() error { _, err := l.SlotMapping(10, 12, nil); return err }},
	}
	for _, w := range writes {
		assert.ErrorIs(t, w.call(), ErrLeasePhase, w.name)
		assert.Equal(t, 10, l.Written(), w.name)
		assert.Equal(t, PhaseExported, l.Phase(), w.name)
	}
	// Reads still work: the pages are the lease's until the ack.
	table, err := l.BlockTable()
	require.NoError(t, err)
	assert.Len(t, table, 4)

	in, err := dst.BeginImport(context.Background(), Request{ID: "r", Tenant: "a", PromptTokens: 10, MaxNewTokens: 6}, out.Domain(), mustChecksum(t, out))
	require.NoError(t, err)
	got, err := transfer(t, out, in)
	require.NoError(t, err)
	require.NoError(t, out.Ack())
	for _, w := range writes {
		assert.ErrorIs(t, w.call(), ErrLeaseReleased, "%s after the ack", w.name)
	}

	// The decode lease: prefilled, and it takes generated tokens.
	assert.Equal(t, 10, got.Written())
	require.NoError(t, got.Commit(11))
	slots, err := got.SlotMapping(11, 16, nil)
	require.NoError(t, err)
	assert.Len(t, slots, 5)
	require.NoError(t, got.Commit(16))
	assert.ErrorIs(t, got.Commit(17), ErrInvalidArgument)
	assert.Equal(t, 16, got.Written())
	_, err = got.Export(time.Now().Add(time.Minute))
	assert.ErrorIs(t, err, ErrLeasePhase, "a decode lease with generated tokens exported")
	require.NoError(t, got.Release())
	canarySweep(t, src)
	canarySweep(t, dst)
}

// TestExportCommitRace: a Commit racing an Export either lands first (and
// the export is refused, the watermark being past the prompt) or is
// refused; never both succeed.
func TestExportCommitRace(t *testing.T) {
	p := handoffPool(t, 16)
	for i := range 200 {
		l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 10, MaxNewTokens: 2})
		require.NoError(t, err)
		require.NoError(t, l.BeginPrefill())
		require.NoError(t, l.Commit(10))
		require.NoError(t, l.FinishPrefill())
		var wg sync.WaitGroup
		var out *Outgoing
		var exportErr, commitErr error
		wg.Add(2)
		go func() { defer wg.Done(); out, exportErr = l.Export(time.Now().Add(time.Minute)) }()
		go func() { defer wg.Done(); commitErr = l.Commit(11) }()
		wg.Wait()
		if exportErr == nil {
			require.ErrorIs(t, commitErr, ErrLeasePhase, "round %d: commit after export", i)
			require.Equal(t, 10, l.Written())
			require.NoError(t, out.Abort())
		} else {
			require.ErrorIs(t, exportErr, ErrLeasePhase, "round %d", i)
			require.NoError(t, commitErr, "round %d", i)
			require.Equal(t, 11, l.Written())
			require.NoError(t, l.Release())
		}
		require.NoError(t, p.Check())
	}
}

// TestImportedLeasePrefixCache: an imported decode lease holds verified KV
// of its own domain. Given the prompt's tokens it publishes its pages
// there (and only there); without them it publishes nothing; either way
// Release and Check hold.
func TestImportedLeasePrefixCache(t *testing.T) {
	tenants := []TenantConfig{{Name: "a", Domain: "org"}, {Name: "b", Domain: "org"}, {Name: "c"}}
	src, dst := domainPool(t, 16, tenants...), domainPool(t, 64, tenants...)
	tokens := make([]int32, 10) // 2 full pages of 4, and 2 tokens
	for i := range tokens {
		tokens[i] = int32(1000 + i)
	}
	pb := int(dst.Geometry().PageBytes())

	importOne := func(t *testing.T, id string) (*Lease, []byte) {
		t.Helper()
		l, err := src.TryAdmit(Request{ID: id, Tenant: "a", PromptTokens: 10})
		require.NoError(t, err)
		require.NoError(t, l.BeginPrefill())
		host := src.dev.(*cudaops.Host)
		table, _ := l.BlockTable()
		for i, pg := range table {
			for r := range src.Geometry().Regions() {
				b := host.PageBytes(r, pg)
				for j := range b {
					b[j] = byte(i*11 + r*5 + j + len(id))
				}
			}
		}
		require.NoError(t, l.Commit(10))
		require.NoError(t, l.FinishPrefill())
		out, err := l.Export(time.Now().Add(time.Minute))
		require.NoError(t, err)
		in, err := dst.BeginImport(context.Background(), Request{ID: id, Tenant: "a", PromptTokens: 10, MaxNewTokens: 4}, out.Domain(), mustChecksum(t, out))
		require.NoError(t, err)
		sent := make([]byte, out.Units()*pb)
		require.NoError(t, out.ReadUnits(0, sent))
		require.NoError(t, in.WriteUnits(0, sent))
		got, err := in.Complete()
		require.NoError(t, err)
		require.NoError(t, out.Ack())
		require.NoError(t, dst.Check())
		return got, sent
	}
	pageBytes := func(l *Lease, i int) []byte {
		table, err := l.BlockTable()
		require.NoError(t, err)
		var b []byte
		for r := range dst.Geometry().Regions() {
			b = append(b, dst.dev.(*cudaops.Host).PageBytes(r, table[i])...)
		}
		return b
	}

	t.Run("published with tokens", func(t *testing.T) {
		got, sent := importOne(t, "with")
		assert.ErrorIs(t, got.AttachTokens("", tokens[:9]), ErrInvalidArgument, "tokens that are not the prompt")
		assert.ErrorIs(t, got.AttachTokens("", nil), ErrInvalidArgument)
		require.NoError(t, got.AttachTokens("", tokens))
		assert.ErrorIs(t, got.AttachTokens("", tokens), ErrInvalidArgument, "tokens attached twice")
		n, err := got.CachePrefix(got.Written())
		require.NoError(t, err)
		assert.Equal(t, 8, n, "two full prompt pages published")
		require.NoError(t, got.Commit(12)) // decoding goes on
		require.NoError(t, dst.Check())
		require.NoError(t, got.Release())
		require.NoError(t, dst.Check())
		assert.Equal(t, 2, dst.Stats().CachedPages)

		// Another tenant of the domain shares the imported KV...
		b, err := dst.TryAdmit(Request{ID: "b", Tenant: "b", PromptTokens: 10, TokenIDs: tokens})
		require.NoError(t, err)
		assert.Equal(t, 8, b.HitTokens())
		for i := range 2 {
			assert.True(t, bytes.Equal(sent[i*pb:(i+1)*pb], pageBytes(b, i)), "shared page %d is not the imported KV", i)
		}
		// ...a tenant of another domain does not.
		c, err := dst.TryAdmit(Request{ID: "c", Tenant: "c", PromptTokens: 10, TokenIDs: tokens})
		require.NoError(t, err)
		assert.Zero(t, c.HitTokens())
		require.NoError(t, dst.Check())
		require.NoError(t, b.Release())
		require.NoError(t, c.Release())
		require.NoError(t, dst.Check())
		canarySweep(t, dst)
	})
	t.Run("private without tokens", func(t *testing.T) {
		got, _ := importOne(t, "without")
		n, err := got.CachePrefix(got.Written())
		require.NoError(t, err)
		assert.Zero(t, n)
		require.NoError(t, got.Release())
		s := dst.Stats()
		assert.Zero(t, s.CachedPages)
		require.NoError(t, dst.Check())
		b, err := dst.TryAdmit(Request{ID: "b", Tenant: "b", PromptTokens: 10, TokenIDs: tokens})
		require.NoError(t, err)
		assert.Zero(t, b.HitTokens())
		require.NoError(t, b.Release())
		canarySweep(t, dst)
	})
	t.Run("tenant moved after the import", func(t *testing.T) {
		got, _ := importOne(t, "moved")
		require.NoError(t, dst.UpdateTenant(TenantConfig{Name: "a"}))
		t.Cleanup(func() { require.NoError(t, dst.UpdateTenant(TenantConfig{Name: "a", Domain: "org"})) })
		// The lease's pages stay in the domain it was admitted in, and so
		// do the pages it publishes.
		require.NoError(t, got.AttachTokens("", tokens))
		_, err := got.CachePrefix(10)
		require.NoError(t, err)
		require.NoError(t, got.Release())
		b, err := dst.TryAdmit(Request{ID: "b", Tenant: "b", PromptTokens: 10, TokenIDs: tokens})
		require.NoError(t, err)
		assert.Equal(t, 8, b.HitTokens(), "published outside the lease's domain")
		a, err := dst.TryAdmit(Request{ID: "a", Tenant: "a", PromptTokens: 10, TokenIDs: tokens})
		require.NoError(t, err)
		assert.Zero(t, a.HitTokens(), "the moved tenant still reaches its old domain")
		require.NoError(t, b.Release())
		require.NoError(t, a.Release())
		canarySweep(t, dst)
	})
	canarySweep(t, src)
}
