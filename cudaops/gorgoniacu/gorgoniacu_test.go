//go:build gorgonia

package gorgoniacu_test

// These tests need a GPU to run: importing gorgonia.org/cu runs cuInit in
// its initialiser, which exits the process without one. CI only compiles
// them (scripts/ci-cuda.sh).

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/cu"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/cudaops/gorgoniacu"
)

func TestZeroHandles(t *testing.T) {
	assert.Zero(t, gorgoniacu.StreamHandle(cu.NoStream))
	assert.Zero(t, gorgoniacu.EventHandle(cu.Event{}))
	assert.True(t, gorgoniacu.Ordering(cu.NoStream, cu.Event{}).IsZero())
	h, err := gorgoniacu.ContextHandle(cu.CUContext{})
	require.NoError(t, err)
	assert.Zero(t, h)
}

func TestRegion(t *testing.T) {
	r, err := gorgoniacu.Region(cu.DevicePtr(0x7f0000001000), 16, 8192, 4096)
	require.NoError(t, err)
	assert.Equal(t, cudaops.Region{Base: 0x7f0000001000, Stride: 8192, PageBytes: 4096, Pages: 16}, r)
	_, err = gorgoniacu.Region(0, 16, 4096, 4096)
	assert.ErrorIs(t, err, cudaops.ErrInvalidArgument)
	_, err = gorgoniacu.Region(0x1000, 16, 4096, 4098)
	assert.ErrorIs(t, err, cudaops.ErrInvalidArgument)
}

// TestOnGPU fills engine memory through the adapter: gorgonia's own
// context, allocation, stream and event.
func TestOnGPU(t *testing.T) {
	dev, err := cu.GetDevice(0)
	require.NoError(t, err)
	ctx, err := dev.MakeContext(cu.SchedAuto)
	require.NoError(t, err)
	defer ctx.Destroy()
	require.NoError(t, ctx.Lock())
	defer ctx.Unlock()

	const pages, pageBytes = 32, 4096
	mem, err := cu.MemAlloc(pages * pageBytes)
	require.NoError(t, err)
	defer cu.MemFree(mem)
	stream, err := cu.MakeStream(cu.NonBlocking)
	require.NoError(t, err)
	defer stream.Destroy()
	ev, err := cu.MakeEvent(cu.DisableTiming)
	require.NoError(t, err)
	defer cu.DestroyEvent(&ev)

	d, err := gorgoniacu.OpenCUContext(ctx)
	require.NoError(t, err)
	defer d.Close()
	r, err := gorgoniacu.Adopt(d, mem, pages, pageBytes, pageBytes)
	require.NoError(t, err)

	// The engine writes 0xff.. to the page on its stream; the fill, ordered
	// after that stream and event, must win.
	require.NoError(t, cu.MemsetD32Async(mem+3*pageBytes, 0xffffffff, pageBytes/4, stream))
	require.NoError(t, ev.Record(stream))
	f, err := d.Fill([]int32{3}, cudaops.FillSpec{Word: 0x80008000}, gorgoniacu.Ordering(stream, ev))
	require.NoError(t, err)
	require.NoError(t, f.Wait())
	b := make([]byte, pageBytes)
	require.NoError(t, d.ReadPage(r, 3, b))
	for i := 0; i < len(b); i += 4 {
		require.Equal(t, []byte{0x00, 0x80, 0x00, 0x80}, b[i:i+4], "byte %d", i)
	}
}
