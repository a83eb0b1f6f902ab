package kvcache

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// canaryDevice returns a Host device whose pages already hold the canary
// of policy: New does not scrub a fresh pool, and the canary policy
// verifies pages on their first allocation too.
func canaryDevice(t *testing.T, g Geometry, pages int, policy ScrubPolicy) cudaops.Device {
	t.Helper()
	dev := cudaops.NewHost()
	for range g.Regions() {
		_, err := dev.AllocRegion(pages, g.RegionPageBytes())
		require.NoError(t, err)
	}
	spec, err := policy.FillSpec(g.DType)
	require.NoError(t, err)
	all := make([]int32, pages)
	for i := range all {
		all[i] = int32(i)
	}
	_, err = dev.Fill(all, spec, cudaops.Ordering{})
	require.NoError(t, err)
	t.Cleanup(func() { dev.Close() })
	return dev
}

func handoffPool(t *testing.T, pages int) *Pool {
	t.Helper()
	return handoffPoolOf(t, Geometry{TokensPerPage: 4, Layers: 2, KVHeads: 1, HeadDim: 4, DType: FP16}, pages)
}

// handoffPoolOf is handoffPool of geometry g.
func handoffPoolOf(t *testing.T, g Geometry, pages int) *Pool {
	t.Helper()
	p, err := New(Config{
		Device:           canaryDevice(t, g, pages, ScrubPolicy{Kind: ScrubCanary}),
		Geometry:         g,
		Pages:            pages,
		MaxContextTokens: pages * g.TokensPerPage,
		Tenants:          []TenantConfig{{Name: "a"}},
		Scrub:            ScrubPolicy{Kind: ScrubCanary},
	})
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// prefilled admits a lease and writes a recognisable pattern into its
// prompt pages, then walks it to the prefilled phase.
func prefilled(t *testing.T, p *Pool, id string, prompt int) *Lease {
	t.Helper()
	l, err := p.TryAdmit(Request{ID: id, Tenant: "a", PromptTokens: prompt})
	require.NoError(t, err)
	require.NoError(t, l.BeginPrefill())
	host := p.dev.(*cudaops.Host)
	table, _ := l.BlockTable()
	for i, pg := range table {
		for r := range p.Geometry().Regions() {
			b := host.PageBytes(r, pg)
			for j := range b {
				b[j] = byte(i*7 + r*3 + j)
			}
		}
	}
	require.NoError(t, l.Commit(prompt))
	require.NoError(t, l.FinishPrefill())
	return l
}

func TestLeasePhases(t *testing.T) {
	p := handoffPool(t, 16)
	l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 6})
	require.NoError(t, err)
	assert.Equal(t, PhaseAdmitted, l.Phase())

	_, err = l.Export(time.Now().Add(time.Minute))
	assert.ErrorIs(t, err, ErrLeasePhase, "admitted lease exported")
	assert.ErrorIs(t, l.FinishPrefill(), ErrLeasePhase, "prefill finished before it began")
	require.NoError(t, l.BeginPrefill())
	assert.ErrorIs(t, l.BeginPrefill(), ErrLeasePhase)
	require.NoError(t, l.Commit(1)) // the placeholder of the incident: one token
	assert.ErrorIs(t, l.FinishPrefill(), ErrLeasePhase, "prefill of 1 of 6 tokens finished")
	_, err = l.Export(time.Now().Add(time.Minute))
	assert.ErrorIs(t, err, ErrLeasePhase, "prefilling lease exported")
	assert.Equal(t, PhasePrefilling, l.Phase())
	require.NoError(t, l.Commit(6))
	require.NoError(t, l.FinishPrefill())
	assert.Equal(t, PhasePrefilled, l.Phase())
	require.NoError(t, p.Check())

	out, err := l.Export(time.Now().Add(time.Minute))
	require.NoError(t, err)
	assert.Equal(t, PhaseExported, l.Phase())
	_, err = l.Export(time.Now().Add(time.Minute))
	assert.ErrorIs(t, err, ErrLeasePhase, "exported twice")
	require.NoError(t, out.Ack())
	assert.Equal(t, PhaseReleased, l.Phase())
	assert.ErrorIs(t, out.Ack(), ErrReclaimed)
	require.NoError(t, p.Check())
	assert.Equal(t, 0, p.Stats().InUsePages)

	l2, err := p.TryAdmit(Request{ID: "r2", Tenant: "a", PromptTokens: 3})
	require.NoError(t, err)
	require.NoError(t, l2.Abort())
	assert.Equal(t, PhaseAborted, l2.Phase())
	assert.ErrorIs(t, l2.Abort(), ErrLeaseReleased)
	require.NoError(t, p.Check())
}

func TestExportImportMovesBytes(t *testing.T) {
	src, dst := handoffPool(t, 16), handoffPool(t, 32)
	l := prefilled(t, src, "r", 10) // 3 pages
	out, err := l.Export(time.Now().Add(time.Minute))
	require.NoError(t, err)
	require.Equal(t, 3, out.Units())

	in, err := dst.BeginImport(context.Background(), Request{ID: "r", Tenant: "a", PromptTokens: 10, MaxNewTokens: 20}, out.Domain(), mustChecksum(t, out))
	require.NoError(t, err)
	buf := make([]byte, 3*src.Geometry().PageBytes())
	require.NoError(t, out.ReadUnits(0, buf))
	require.NoError(t, in.WriteUnits(0, buf[:len(buf)/3]))
	require.NoError(t, in.WriteUnits(1, buf[len(buf)/3:]))
	require.NoError(t, dst.Check())
	got, err := in.Complete()
	require.NoError(t, err)
	assert.Equal(t, PhasePrefilled, got.Phase())
	assert.Equal(t, 10, got.Written())
	assert.GreaterOrEqual(t, got.CapacityTokens(), 30)
	require.NoError(t, out.Ack())

	back := leaseBytes(t, dst.dev.(*cudaops.Host), dst.Geometry().Regions(), got, 3)
	assert.True(t, bytes.Equal(buf, back), "imported bytes differ from exported ones")
	require.NoError(t, got.Release())
	require.NoError(t, src.Check())
	require.NoError(t, dst.Check())
}

// exported exports a prefilled 10-token (3-page) lease "r" of a fresh
// pool and returns the export and its pages' bytes; the export is aborted
// when the test ends.
func exported(t *testing.T) (*Outgoing, []byte) {
	t.Helper()
	src := handoffPool(t, 16)
	l := prefilled(t, src, "r", 10)
	out, err := l.Export(time.Now().Add(time.Minute))
	require.NoError(t, err)
	t.Cleanup(func() { out.Abort() })
	buf := make([]byte, 3*src.Geometry().PageBytes())
	require.NoError(t, out.ReadUnits(0, buf))
	return out, buf
}

// leaseBytes reads back the first n pages of lease l from host, whose
// pages have regions regions, in order.
func leaseBytes(t *testing.T, host *cudaops.Host, regions int, l *Lease, n int) []byte {
	t.Helper()
	table, err := l.BlockTable()
	require.NoError(t, err)
	var b []byte
	for _, pg := range table[:n] {
		for r := range regions {
			b = append(b, host.PageBytes(r, pg)...)
		}
	}
	return b
}

func TestImportFailuresAbort(t *testing.T) {
	out, good := exported(t)
	pb := len(good) / 3

	tests := []struct {
		name string
		run  func(in *Incoming) error
		want error
	}{
		{"truncated", func(in *Incoming) error {
			require.NoError(t, in.WriteUnits(0, good[:2*pb]))
			_, err := in.Complete()
			return err
		}, ErrIncompleteTransfer},
		{"checksum", func(in *Incoming) error {
			bad := bytes.Clone(good)
			bad[pb+5] ^= 1
			require.NoError(t, in.WriteUnits(0, bad))
			_, err := in.Complete()
			return err
		}, ErrChecksumMismatch},
		{"duplicate page", func(in *Incoming) error {
			require.NoError(t, in.WriteUnits(0, good[:pb]))
			return in.WriteUnits(0, good[:pb])
		}, ErrDuplicatePage},
		{"out of range", func(in *Incoming) error { return in.WriteUnits(2, good[:2*pb]) }, ErrInvalidArgument},
		{"partial page", func(in *Incoming) error { return in.WriteUnits(0, good[:pb-4]) }, ErrInvalidArgument},
		{"stale write after abort", func(in *Incoming) error {
			require.NoError(t, in.Abort())
			return in.WriteUnits(0, good)
		}, ErrStaleTransfer},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dst := handoffPool(t, 32)
			in, err := dst.BeginImport(context.Background(), Request{ID: "r", Tenant: "a", PromptTokens: 10, MaxNewTokens: 4}, out.Domain(), mustChecksum(t, out))
			require.NoError(t, err)
			err = tt.run(in)
			assert.ErrorIs(t, err, tt.want)
			_, err = in.Complete()
			assert.Error(t, err, "an aborted import completed")
			s := dst.Stats()
			assert.Equal(t, 0, s.InUsePages)
			assert.Equal(t, 0, s.LiveLeases)
			require.NoError(t, dst.Check())
			// Every page carries its canary again: admitting the whole pool
			// verifies each one.
			all, err := dst.TryAdmit(Request{ID: "sweep", Tenant: "a", PromptTokens: dst.CapacityTokens()})
			require.NoError(t, err)
			require.NoError(t, all.Release())
		})
	}
}

func TestReclaimDeadline(t *testing.T) {
	p := handoffPool(t, 16)
	l := prefilled(t, p, "r", 5)
	out, err := l.Export(time.Now().Add(20 * time.Millisecond))
	require.NoError(t, err)
	assert.True(t, out.Live())
	require.Eventually(t, func() bool { return !out.Live() }, 5*time.Second, time.Millisecond)
	assert.Equal(t, PhaseAborted, l.Phase())
	err = out.ReadUnits(0, make([]byte, p.Geometry().PageBytes()))
	assert.ErrorIs(t, err, ErrReclaimed)
	assert.ErrorIs(t, out.Ack(), ErrReclaimed)
	require.NoError(t, p.Check())

	// A recycled Lease struct is not reclaimed by the old export's timer.
	l2 := prefilled(t, p, "r2", 5)
	out2, err := l2.Export(time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.NoError(t, l2.Release())
	require.NoError(t, p.TryAdmitInto(Request{ID: "r3", Tenant: "a", PromptTokens: 5}, l2))
	assert.ErrorIs(t, out2.Ack(), ErrReclaimed)
	assert.True(t, l2.Live(), "an old export released the lease's next life")
	require.NoError(t, l2.Release())
	require.NoError(t, p.Check())
}

func TestExportReadAfterEngineRelease(t *testing.T) {
	p := handoffPool(t, 16)
	l := prefilled(t, p, "r", 5)
	out, err := l.Export(time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.NoError(t, l.Release())
	// The pages may now belong to someone else: never read them.
	other := prefilled(t, p, "other", 8)
	err = out.ReadUnits(0, make([]byte, p.Geometry().PageBytes()))
	assert.True(t, errors.Is(err, ErrReclaimed), "read of released pages: %v", err)
	require.NoError(t, other.Release())
	require.NoError(t, p.Check())
}

// mustChecksum is out's content checksum.
func mustChecksum(t testing.TB, out *Outgoing) uint32 {
	t.Helper()
	sum, err := out.Checksum()
	require.NoError(t, err)
	return sum
}
