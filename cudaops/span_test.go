package cudaops_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// overlapByBytes is Overlap by enumeration: some byte in a page of both.
func overlapByBytes(a, b cudaops.Region) bool {
	in := func(r cudaops.Region, x uint64) bool {
		if x < r.Base {
			return false
		}
		off := int64(x - r.Base)
		return off/r.Stride < int64(r.Pages) && off%r.Stride < r.PageBytes
	}
	for i := range a.Pages {
		start := a.Base + uint64(int64(i)*a.Stride)
		for x := start; x < start+uint64(a.PageBytes); x++ {
			if in(b, x) {
				return true
			}
		}
	}
	return false
}

// Overlap agrees with enumeration on every region pair of one stride
// (where it is exact), and never misses an overlap of two strides (where
// it may refuse regions whose extents merely cross).
func TestOverlapMissedSharedBytes(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	region := func(stride int64) cudaops.Region {
		pb := 4 * (1 + rng.Int64N(stride/4))
		return cudaops.Region{Base: 1000 + 4*uint64(rng.IntN(200)), Stride: stride, PageBytes: pb, Pages: 1 + rng.IntN(8)}
	}
	exact, crossed := 0, 0
	for range 20000 {
		s := 4 * (1 + rng.Int64N(16))
		a, b := region(s), region(s)
		if rng.IntN(3) == 0 {
			b = region(4 * (1 + rng.Int64N(16)))
		}
		require.NoError(t, a.Validate())
		require.NoError(t, b.Validate())
		want := overlapByBytes(a, b)
		got := cudaops.Overlap(a, b)
		require.Equal(t, got, cudaops.Overlap(b, a), "Overlap is symmetric: %+v %+v", a, b)
		if a.Stride == b.Stride {
			require.Equal(t, want, got, "%+v %+v", a, b)
			exact++
		} else if want {
			require.True(t, got, "missed: %+v %+v", a, b)
			crossed++
		}
	}
	assert.Greater(t, exact, 1000)
	assert.Greater(t, crossed, 100)
}

// The layouts engines allocate: vLLM's [2, num_blocks, …] (K then V, each
// contiguous) and [num_blocks, 2, …] (K and V of a block side by side),
// SGLang's one buffer per layer: none of their regions overlap, and a
// region shifted by one word into its neighbour does.
func TestOverlapOfEngineLayouts(t *testing.T) {
	const blocks, pb = 100, 4096
	base := uint64(1 << 30)
	kvFirst := []cudaops.Region{
		{Base: base, Stride: pb, PageBytes: pb, Pages: blocks},
		{Base: base + blocks*pb, Stride: pb, PageBytes: pb, Pages: blocks},
	}
	blockFirst := []cudaops.Region{
		{Base: base, Stride: 2 * pb, PageBytes: pb, Pages: blocks},
		{Base: base + pb, Stride: 2 * pb, PageBytes: pb, Pages: blocks},
	}
	for name, rs := range map[string][]cudaops.Region{"[2, blocks, …]": kvFirst, "[blocks, 2, …]": blockFirst} {
		assert.False(t, cudaops.Overlap(rs[0], rs[1]), name)
		shifted := rs[1]
		shifted.Base -= 4
		assert.True(t, cudaops.Overlap(rs[0], shifted), name+" shifted by a word")
	}
}

// A host device refuses an adopted buffer that shares bytes with one it
// already has, and takes interleaved ones.
func TestHostAdoptOverlapping(t *testing.T) {
	h := cudaops.NewHost()
	defer h.Close()
	mem := make([]byte, 16*256)
	_, err := h.AdoptRegion(mem, 8, 512, 256)
	require.NoError(t, err)
	_, err = h.AdoptRegion(mem[256:], 8, 512, 256)
	require.NoError(t, err, "the other half of each 512-byte block")
	_, err = h.AdoptRegion(mem[1024:], 2, 256, 256)
	assert.ErrorIs(t, err, cudaops.ErrInvalidArgument)
	assert.ErrorContains(t, err, "overlaps region 0")
	assert.Len(t, h.Regions(), 2)
	assert.NotZero(t, h.Regions()[0].Base, "host regions report their address")
}
