package cudaops_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// Host-tier copies on CUDA, over the simulated driver: one async copy per
// run of adjacent pages into adjacent slots per contiguous region (one
// per page in a strided one), all straight into or out of the page-locked
// memory AllocHost returned, one wait per call; memory of any other kind
// refused; failures that free nothing a queued copy may still reach.

// hostTier opens a device with a contiguous and a strided region of n
// pages of 256 bytes and page-locked memory of slots slots for each.
func hostTier(t *testing.T, n, slots int) (*cudaops.CUDA, *cudaops.FakeDriver, []byte, cudaops.HostCopy) {
	t.Helper()
	d, f := openFake(t)
	_, err := d.AllocRegion(n, 256)
	require.NoError(t, err)
	base, free, err := d.Scratch(uint64(2 * n * 256))
	require.NoError(t, err)
	t.Cleanup(free)
	_, err = d.AdoptRegion(base, n, 512, 256)
	require.NoError(t, err)
	mem, err := d.AllocHost(int64(2 * slots * 256))
	require.NoError(t, err)
	half := slots * 256
	return d, f, mem, cudaops.HostCopy{Regions: []int{0, 1}, Host: [][]byte{mem[:half:half], mem[half:]}}
}

func TestCUDAHostCopiesCoalesceRuns(t *testing.T) {
	d, f, mem, c := hostTier(t, 64, 64)
	for p := range int32(64) {
		for r := range 2 {
			require.NoError(t, d.WritePage(r, p, bytes.Repeat([]byte{byte(p), byte(r)}, 128)))
		}
	}
	// Runs: pages 0-9 into slots 20-29 (one run), 30-33 into 5, 4, 3, 2
	// (four runs), 40-41 into 50-51 (one run): 6 runs, 16 pages.
	for p := int32(0); p < 10; p++ {
		c.Pages, c.Slots = append(c.Pages, p), append(c.Slots, 20+p)
	}
	for i := int32(0); i < 4; i++ {
		c.Pages, c.Slots = append(c.Pages, 30+i), append(c.Slots, 5-i)
	}
	c.Pages, c.Slots = append(c.Pages, 40, 41), append(c.Slots, 50, 51)
	_, out0 := asyncCopies(f)
	s0 := f.Calls("cuStreamSynchronize")
	pinned0, pageable0 := f.CopiedBytes()
	require.NoError(t, d.CopyToHost(c, cudaops.Ordering{}))
	_, out1 := asyncCopies(f)
	assert.Equal(t, 6+16, out1-out0, "one copy per run of the contiguous region, one per page of the strided one")
	assert.Equal(t, 1, f.Calls("cuStreamSynchronize")-s0, "one wait")
	pinned1, pageable1 := f.CopiedBytes()
	assert.Equal(t, uint64(2*16*256), pinned1-pinned0, "every byte by DMA from page-locked memory")
	assert.Equal(t, pageable0, pageable1, "no byte through pageable memory")
	for i, p := range c.Pages {
		for k := range 2 {
			assert.Equal(t, bytes.Repeat([]byte{byte(p), byte(k)}, 128), c.Host[k][int(c.Slots[i])*256:][:256], "page %d region %d", p, k)
		}
	}
	// And back into other pages.
	in0, _ := asyncCopies(f)
	back := c
	back.Pages = make([]int32, len(c.Pages))
	for i := range back.Pages {
		back.Pages[i] = 63 - c.Pages[i] // descending: runs break
	}
	require.NoError(t, d.CopyFromHost(back))
	in1, _ := asyncCopies(f)
	assert.Equal(t, 2*16, in1-in0, "descending pages are runs of one")
	for i, p := range back.Pages {
		got := make([]byte, 256)
		require.NoError(t, d.ReadPage(0, p, got))
		assert.Equal(t, bytes.Repeat([]byte{byte(c.Pages[i]), 0}, 128), got, "page %d", p)
	}
	require.NoError(t, d.FreeHost(mem))
}

func TestCUDAHostCopiesRefuseOtherMemory(t *testing.T) {
	d, _, mem, c := hostTier(t, 8, 8)
	c.Pages, c.Slots = []int32{1}, []int32{1}
	goMem := make([]byte, len(mem))
	other := c
	other.Host = [][]byte{goMem[:8*256], goMem[8*256:]}
	assert.ErrorIs(t, d.CopyToHost(other, cudaops.Ordering{}), cudaops.ErrInvalidArgument, "Go memory is not page-locked")
	assert.ErrorIs(t, d.CopyFromHost(other), cudaops.ErrInvalidArgument)
	assert.ErrorIs(t, d.FreeHost(goMem), cudaops.ErrInvalidArgument)
	assert.ErrorIs(t, d.FreeHost(mem[256:]), cudaops.ErrInvalidArgument, "only what AllocHost returned is freed")
	_, err := d.AllocHost(0)
	assert.ErrorIs(t, err, cudaops.ErrInvalidArgument)
	// What is not freed is freed by Close (openFake's cleanup finds no
	// leak).
}

func TestCUDAHostCopyFailures(t *testing.T) {
	t.Run("a copy that cannot be queued half-way", func(t *testing.T) {
		d, f, _, c := hostTier(t, 8, 8)
		c.Pages, c.Slots = []int32{0, 2, 4}, []int32{0, 2, 4}
		s0 := f.Calls("cuStreamSynchronize")
		f.FailLater("cuMemcpyDtoHAsync_v2", 1, 999)
		err := d.CopyToHost(c, cudaops.Ordering{})
		assert.ErrorIs(t, err, cudaops.ErrDriver)
		assert.Equal(t, 1, f.Calls("cuStreamSynchronize")-s0, "the copies queued before are waited for")
		// The device still works.
		require.NoError(t, d.CopyToHost(c, cudaops.Ordering{}))
	})
	t.Run("a failed wait keeps the memory until Close", func(t *testing.T) {
		d, f, mem, c := hostTier(t, 8, 8)
		c.Pages, c.Slots = []int32{1}, []int32{1}
		f.FailNext("cuStreamSynchronize", 999)
		assert.ErrorIs(t, d.CopyFromHost(c), cudaops.ErrDriver)
		freed := f.Calls("cuMemFreeHost")
		require.NoError(t, d.FreeHost(mem))
		assert.Equal(t, freed, f.Calls("cuMemFreeHost"), "not freed while a copy may still reach it")
		require.NoError(t, d.Close())
		assert.Greater(t, f.Calls("cuMemFreeHost"), freed, "freed at Close")
	})
	t.Run("page-locked memory the driver cannot give", func(t *testing.T) {
		d, f := openFake(t)
		_, err := d.AllocRegion(4, 256)
		require.NoError(t, err)
		f.FailNext("cuMemAllocHost_v2", 2)
		_, err = d.AllocHost(4096)
		assert.ErrorIs(t, err, cudaops.ErrOutOfMemory)
	})
}
