package cudaops_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/cudaops/devicetest"
	"github.com/kvfence/kvfence/kvcache"
)

// A group of host devices is a Device like any other: the conformance
// suite, one launch per member per fill.
func TestGroupConformance(t *testing.T) {
	devicetest.RunWith(t, devicetest.Config{
		Open: func(*testing.T) cudaops.Device {
			g, err := cudaops.NewGroup(cudaops.NewHost(), cudaops.NewHost(), cudaops.NewHost())
			require.NoError(t, err)
			return g
		},
		LaunchesPerFill: 3,
	})
}

// openFakeGroup is a group of n CUDA devices over one simulated driver
// with n GPUs.
func openFakeGroup(t *testing.T, n int) (*cudaops.Group, *cudaops.FakeDriver) {
	t.Helper()
	f := cudaops.NewFakeDriver()
	f.SetDevices(n)
	var members []cudaops.Device
	for i := range n {
		d, err := cudaops.OpenOn(f, i)
		require.NoError(t, err)
		members = append(members, d)
	}
	g, err := cudaops.NewGroup(members...)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = g.Close()
		assert.Empty(t, f.Leaks())
	})
	return g, f
}

// Only one GPU of a tensor-parallel group used to be scrubbed: a pool
// drove one device. A pool over a group fills every rank's shard, and a
// canary audit reads every shard back.
func TestGroupPoolScrubbedOneRankOnly(t *testing.T) {
	g, _ := openFakeGroup(t, 3)
	p, err := kvcache.New(kvcache.Config{
		Geometry:         kvcache.Geometry{TokensPerPage: 4, Layers: 2, KVHeads: 3, HeadDim: 4, DType: kvcache.FP32},
		Pages:            16,
		MaxContextTokens: 64,
		Tenants:          []kvcache.TenantConfig{{Name: "acme"}},
		Scrub:            kvcache.ScrubPolicy{Kind: kvcache.ScrubCanary},
		Device:           g,
	})
	require.NoError(t, err)
	defer p.Close()
	// Dirty every page of every rank, then release: each shard must hold
	// its page's canary, and the next admission's audit must pass.
	l, err := p.TryAdmit(kvcache.Request{ID: "r", Tenant: "acme", PromptTokens: 60})
	require.NoError(t, err)
	table, err := l.BlockTable()
	require.NoError(t, err)
	for i, m := range g.Members() {
		for r, reg := range m.Regions() {
			for _, pg := range table {
				buf := make([]byte, reg.PageBytes)
				for k := range buf {
					buf[k] = byte(0xa0 + i)
				}
				require.NoError(t, m.WritePage(r, pg, buf))
			}
		}
	}
	require.NoError(t, l.ReleaseAfter(cudaops.Ordering{Stream: cudaops.StreamLegacy}))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	l, err = p.Admit(ctx, kvcache.Request{ID: "r2", Tenant: "acme", PromptTokens: 60})
	require.NoError(t, err, "the canary audit of the reused pages")
	defer l.Release()
	st := p.Stats()
	assert.Empty(t, st.Fault)
	assert.NotZero(t, st.Scrub.CanaryChecks)
	assert.Zero(t, st.Scrub.CanaryFailures)
	require.NoError(t, p.Check())
	for i, m := range g.Members() {
		assert.Equal(t, uint64(2), m.Counters().FillCalls, "member %d: the initial scrub and the release", i)
	}
}

// A member that cannot queue its fill fails the group's fill; a member's
// fence error fails the group's fence.
func TestGroupMemberFailureFailsFill(t *testing.T) {
	g, f := openFakeGroup(t, 2)
	_, err := g.AllocRegion(8, 64)
	require.NoError(t, err)
	f.FailNext("cuLaunchKernel", 719)
	_, err = g.Fill([]int32{1}, cudaops.FillSpec{}, cudaops.Ordering{Stream: cudaops.StreamLegacy})
	require.ErrorIs(t, err, cudaops.ErrDriver)
	f.FaultNext("cuLaunchKernel", 700)
	fc, err := g.Fill([]int32{1}, cudaops.FillSpec{}, cudaops.Ordering{Stream: cudaops.StreamLegacy})
	require.NoError(t, err)
	require.ErrorIs(t, fc.Wait(), cudaops.ErrDriver)
}

// A specific stream belongs to one member: that member waits for it, the
// others synchronise their contexts; a stream of no member is refused.
func TestGroupOrderingOfOneMember(t *testing.T) {
	g, f := openFakeGroup(t, 2)
	_, err := g.AllocRegion(8, 64)
	require.NoError(t, err)
	d1 := g.Members()[1].(*cudaops.CUDA)
	e := engineOn(t, d1, cudaops.EngineOwnStream)
	o, err := e.Write(0, 2, 0xe0e0e0e0)
	require.NoError(t, err)
	require.NoError(t, g.CheckOrdering(o))
	fc, err := g.Fill([]int32{2}, cudaops.FillSpec{Word: poison}, o)
	require.NoError(t, err)
	require.NoError(t, fc.Wait())
	require.NoError(t, e.Sync())
	assert.Equal(t, uniform(poison, 8), pageWords(t, d1, 0, 2))
	foreign, free := f.ForeignStream()
	defer free()
	require.ErrorIs(t, g.CheckOrdering(cudaops.Ordering{Stream: foreign}), cudaops.ErrBadOrdering)
	_, err = g.Fill([]int32{2}, cudaops.FillSpec{}, cudaops.Ordering{Stream: foreign})
	require.ErrorIs(t, err, cudaops.ErrBadOrdering)
}

// TestCUDAGroupGPU fills a group over every visible GPU (device 0 twice
// when there is one, so the fan-out still runs) and checks each shard.
// It skips without a GPU.
func TestCUDAGroupGPU(t *testing.T) {
	first := openGPU(t)
	members := []cudaops.Device{first}
	for i := 1; ; i++ {
		d, err := cudaops.OpenCUDA(i)
		if errors.Is(err, cudaops.ErrNoDevice) {
			break
		}
		require.NoError(t, err)
		members = append(members, d)
	}
	if len(members) == 1 {
		d, err := cudaops.OpenCUDA(0)
		require.NoError(t, err)
		members = append(members, d)
	}
	g, err := cudaops.NewGroup(members...)
	require.NoError(t, err)
	defer g.Close()
	t.Logf("devices %s", g.Name())
	for range 4 {
		_, err := g.AllocRegion(256, 16384)
		require.NoError(t, err)
	}
	spec := cudaops.FillSpec{Word: 0x3c5a0f0f, PageSalt: 0x9e3779b9, ClearMask: 0x40004000}
	batch := []int32{0, 1, 2, 77, 128, 255}
	fc, err := g.Fill(batch, spec, cudaops.Ordering{})
	require.NoError(t, err)
	require.NoError(t, fc.Wait())
	for i, m := range members {
		for r, reg := range m.Regions() {
			for _, p := range batch {
				assert.Equal(t, uniform(spec.WordFor(p), int(reg.PageBytes/4)), pageWords(t, m, r, p), "member %d region %d page %d", i, r, p)
			}
		}
	}
}
