package cudaops_test

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// Tests of the CUDA device's own behaviour over the simulated driver:
// failure paths a real GPU cannot be made to take on demand.

func openFake(t *testing.T) (*cudaops.CUDA, *cudaops.FakeDriver) {
	t.Helper()
	d, f, err := cudaops.OpenFake()
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = d.Close()
		assert.Empty(t, f.Leaks(), "driver resources left after Close")
	})
	require.NoError(t, d.KernelError(), "the simulated driver could not load or run fill.ptx")
	return d, f
}

func words(b []byte) []uint32 {
	w := make([]uint32, len(b)/4)
	for i := range w {
		w[i] = binary.LittleEndian.Uint32(b[4*i:])
	}
	return w
}

func pageWords(t *testing.T, d cudaops.Device, r int, p int32) []uint32 {
	t.Helper()
	b := make([]byte, d.Regions()[r].PageBytes)
	require.NoError(t, d.ReadPage(r, p, b))
	return words(b)
}

func uniform(w uint32, n int) []uint32 {
	s := make([]uint32, n)
	for i := range s {
		s[i] = w
	}
	return s
}

// With every staging buffer busy (the driver never completes work on a
// query), a fill must wait for the oldest instead of overwriting a batch
// the device has not read yet.
func TestCUDAStagingNotReusedEarly(t *testing.T) {
	for _, mode := range []cudaops.FillMode{cudaops.FillKernel, cudaops.FillMemset} {
		t.Run(mode.String(), func(t *testing.T) {
			d, f := openFake(t)
			require.NoError(t, d.SetFillMode(mode))
			f.SetStubborn(true)
			const pages = 64
			_, err := d.AllocRegion(pages, 64)
			require.NoError(t, err)
			var fences []cudaops.Fence
			for p := range int32(pages) {
				fc, err := d.Fill([]int32{p}, cudaops.FillSpec{Word: uint32(p) + 1}, cudaops.Ordering{})
				require.NoError(t, err)
				fences = append(fences, fc)
			}
			for _, fc := range fences {
				require.NoError(t, fc.Wait())
			}
			for p := range int32(pages) {
				assert.Equal(t, uniform(uint32(p)+1, 16), pageWords(t, d, 0, p), "page %d", p)
			}
		})
	}
}

func TestCUDAOpenErrors(t *testing.T) {
	f := cudaops.NewFakeDriver()
	f.SetInitError(34)
	_, err := cudaops.OpenOn(f, 0)
	require.ErrorIs(t, err, cudaops.ErrNoDevice)
	require.ErrorContains(t, err, "cuInit: CUDA_ERROR_STUB_LIBRARY (34)")
	var de *cudaops.DriverError
	require.ErrorAs(t, err, &de)
	assert.Equal(t, 34, de.Code)

	f = cudaops.NewFakeDriver()
	_, err = cudaops.OpenOn(f, 3)
	require.ErrorIs(t, err, cudaops.ErrNoDevice)
	require.ErrorContains(t, err, "CUDA_ERROR_INVALID_DEVICE")
	_, err = cudaops.OpenOn(f, -1)
	require.ErrorIs(t, err, cudaops.ErrInvalidArgument)
	assert.Empty(t, f.Leaks())

	// A failure half-way through opening releases what was taken.
	f = cudaops.NewFakeDriver()
	f.FailNext("cuEventCreate", 2)
	_, err = cudaops.OpenOn(f, 0)
	require.ErrorIs(t, err, cudaops.ErrDriver)
	assert.Empty(t, f.Leaks())

	_, err = cudaops.OpenCUDAContext(0)
	require.ErrorIs(t, err, cudaops.ErrInvalidArgument)
}

func TestCUDAKernelUnavailableFallsBackToMemset(t *testing.T) {
	f := cudaops.NewFakeDriver()
	f.SetLoadError(222) // CUDA_ERROR_UNSUPPORTED_PTX_VERSION
	d, err := cudaops.OpenOn(f, 0)
	require.NoError(t, err)
	defer d.Close()
	require.ErrorContains(t, d.KernelError(), "CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
	require.ErrorIs(t, d.SetFillMode(cudaops.FillKernel), cudaops.ErrDriver)
	_, err = d.AllocRegion(8, 64)
	require.NoError(t, err)
	fc, err := d.Fill([]int32{1, 2, 3, 6}, cudaops.FillSpec{Word: 7}, cudaops.Ordering{})
	require.NoError(t, err)
	require.NoError(t, fc.Wait())
	assert.Equal(t, uniform(7, 16), pageWords(t, d, 0, 6))
	assert.Equal(t, uint64(2), d.Counters().Launches, "runs {1,2,3} and {6}")
	assert.Zero(t, f.Calls("cuLaunchKernel"))
}

func TestCUDAFillDriverErrors(t *testing.T) {
	for _, call := range []string{"cuMemcpyHtoDAsync_v2", "cuLaunchKernel", "cuEventRecord", "cuEventCreate"} {
		t.Run(call, func(t *testing.T) {
			d, f := openFake(t)
			_, err := d.AllocRegion(8, 64)
			require.NoError(t, err)
			if call == "cuMemcpyHtoDAsync_v2" {
				d.SetInlineIDs(1) // the page list goes through the staging ring
			}
			f.FailNext(call, 719)
			fc, err := d.Fill([]int32{1, 2}, cudaops.FillSpec{}, cudaops.Ordering{})
			require.ErrorIs(t, err, cudaops.ErrDriver)
			require.ErrorContains(t, err, call)
			assert.Nil(t, fc)
			assert.Zero(t, d.Counters().FillCalls, "a failed fill is not counted")
			assert.Zero(t, f.ContextDepth(), "context left pushed")
			// The device still works afterwards.
			fc, err = d.Fill([]int32{1, 2}, cudaops.FillSpec{Word: 9}, cudaops.Ordering{})
			require.NoError(t, err)
			require.NoError(t, fc.Wait())
			assert.Equal(t, uniform(9, 16), pageWords(t, d, 0, 2))
		})
	}
}

// A kernel that faults on the device surfaces through the fence.
func TestCUDAFillFaultsThroughFence(t *testing.T) {
	d, f := openFake(t)
	_, err := d.AllocRegion(8, 64)
	require.NoError(t, err)
	f.FaultNext("cuLaunchKernel", 700)
	fc, err := d.Fill([]int32{1}, cudaops.FillSpec{}, cudaops.Ordering{})
	require.NoError(t, err, "the launch itself is accepted")
	err = fc.Wait()
	require.ErrorIs(t, err, cudaops.ErrDriver)
	require.ErrorContains(t, err, "CUDA_ERROR_ILLEGAL_ADDRESS")
	done, err2 := fc.Done()
	assert.True(t, done)
	assert.Equal(t, err, err2)
}

func TestCUDAOrderingBadHandle(t *testing.T) {
	d, _ := openFake(t)
	_, err := d.AllocRegion(8, 64)
	require.NoError(t, err)
	for _, o := range []cudaops.Ordering{{Stream: 0xdead0}, {Event: 0xbeef0}} {
		_, err = d.Fill([]int32{1}, cudaops.FillSpec{}, o)
		require.ErrorIs(t, err, cudaops.ErrInvalidArgument, "%+v", o)
		require.ErrorIs(t, err, cudaops.ErrBadOrdering, "%+v", o)
		require.ErrorContains(t, err, "CUDA_ERROR_INVALID_HANDLE")
		require.ErrorIs(t, d.CheckOrdering(o), cudaops.ErrBadOrdering, "%+v", o)
	}
	assert.Zero(t, d.Counters().FillCalls)
}

func TestCUDAAllocOutOfMemory(t *testing.T) {
	d, _ := openFake(t)
	_, err := d.AllocRegion(1<<20, 4096) // 4 GiB: beyond the fake's limit
	require.ErrorIs(t, err, cudaops.ErrOutOfMemory)
	require.ErrorContains(t, err, "CUDA_ERROR_OUT_OF_MEMORY")
	assert.Empty(t, d.Regions())
}

// Adopted memory with a stride wider than the page: two regions
// interleaved in one buffer (vLLM's [num_blocks, 2, …] layout: K and V of
// a block side by side) are not an overlap; the fill writes each region's
// pages and nothing between them; a region that shares bytes with
// another is refused; Close does not free adopted memory.
func TestCUDAAdoptStrided(t *testing.T) {
	for _, mode := range []cudaops.FillMode{cudaops.FillKernel, cudaops.FillMemset} {
		t.Run(mode.String(), func(t *testing.T) {
			d, _ := openFake(t)
			require.NoError(t, d.SetFillMode(mode))
			const n, pb = 16, 64
			// Backing: 2n pages outside the region table; page p of the
			// even region is backing page 2p, of the odd one 2p+1.
			base, free, err := d.Scratch(2 * n * pb)
			require.NoError(t, err)
			t.Cleanup(free)
			for _, bad := range []struct {
				base              uint64
				pages             int
				stride, pageBytes int64
			}{
				{0, n, 2 * pb, pb}, {base + 2, n, 2 * pb, pb}, {^uint64(0) - 64, n, 2 * pb, pb},
				{base, n, pb - 4, pb}, {base, 0, 2 * pb, pb}, {base, n, 2 * pb, 6},
			} {
				_, err := d.AdoptRegion(bad.base, bad.pages, bad.stride, bad.pageBytes)
				assert.ErrorIs(t, err, cudaops.ErrInvalidArgument, "%+v", bad)
			}
			even, err := d.AdoptRegion(base, n, 2*pb, pb)
			require.NoError(t, err)
			odd, err := d.AdoptRegion(base+pb, n, 2*pb, pb)
			require.NoError(t, err, "interleaved regions of one stride do not overlap")
			for _, bad := range []struct {
				base   uint64
				pages  int
				stride int64
			}{{base + pb/2, n - 1, 2 * pb}, {base, 2 * n, pb}, {base + 2*pb*(n/2), n / 2, 2 * pb}, {base + 4, 1, 2 * pb}} {
				_, err := d.AdoptRegion(bad.base, bad.pages, bad.stride, pb)
				assert.ErrorIs(t, err, cudaops.ErrInvalidArgument, "overlapping %+v", bad)
				assert.ErrorContains(t, err, "overlaps region")
			}
			require.Len(t, d.Regions(), 2)
			for q := range int32(n) {
				for _, r := range []int{even, odd} {
					require.NoError(t, d.WritePage(r, q, bytes.Repeat([]byte{0xee}, pb)))
				}
			}
			fc, err := d.Fill([]int32{0, 1, 2, 5, 9}, cudaops.FillSpec{}, cudaops.Ordering{})
			require.NoError(t, err)
			require.NoError(t, fc.Wait())
			filled := map[int32]bool{0: true, 1: true, 2: true, 5: true, 9: true}
			for q := range int32(n) {
				want := uniform(0xeeeeeeee, pb/4)
				if filled[q] {
					want = uniform(0, pb/4)
				}
				assert.Equal(t, want, pageWords(t, d, even, q), "even page %d", q)
				assert.Equal(t, want, pageWords(t, d, odd, q), "odd page %d", q)
			}
		})
	}
}

func TestCUDAContextBalanced(t *testing.T) {
	d, f := openFake(t)
	_, err := d.AllocRegion(8, 64)
	require.NoError(t, err)
	fc, err := d.Fill([]int32{1}, cudaops.FillSpec{}, cudaops.Ordering{})
	require.NoError(t, err)
	_, _ = fc.Done()
	require.NoError(t, fc.Wait())
	_ = pageWords(t, d, 0, 1)
	_, _, err = d.MemInfo()
	require.NoError(t, err)
	assert.Zero(t, f.ContextDepth())
	require.NoError(t, d.Close())
	_, _, err = d.MemInfo()
	assert.ErrorIs(t, err, cudaops.ErrClosed)
	assert.ErrorIs(t, d.SetFillMode(cudaops.FillMemset), cudaops.ErrClosed)
}

// A handoff read or wrote a page per synchronous copy: a 32k-token
// lease was about 131k round trips. ReadPages and WritePages make one
// asynchronous copy per run of adjacent pages (per page in a strided
// region) and one wait per staging buffer's worth, and are exact in both
// kinds of region and across staging batches.
func TestCUDAPageCopiesMadeACopyPerPage(t *testing.T) {
	d, f := openFake(t)
	const n, pb = 64, 256
	_, err := d.AllocRegion(n, pb)
	require.NoError(t, err)
	base, free, err := d.Scratch(2 * n * pb)
	require.NoError(t, err)
	t.Cleanup(free)
	_, err = d.AdoptRegion(base+pb, n, 2*pb, pb) // strided: pages 512 bytes apart
	require.NoError(t, err)
	pages := []int32{}
	for _, run := range [][2]int32{{0, 16}, {20, 30}, {40, 41}, {50, 64}} {
		for p := run[0]; p < run[1]; p++ {
			pages = append(pages, p)
		}
	}
	src := make([]byte, len(pages)*pb)
	for i := range src {
		src[i] = byte(i*7 + i/pb)
	}
	calls := func() (h2d, d2h, syncs int) {
		return f.Calls("cuMemcpyHtoDAsync_v2"), f.Calls("cuMemcpyDtoHAsync_v2"), f.Calls("cuStreamSynchronize")
	}
	for r, wantCopies := range []int{4, len(pages)} {
		h0, d0, s0 := calls()
		require.NoError(t, d.WritePages(r, pages, src))
		got := make([]byte, len(src))
		require.NoError(t, d.ReadPages(r, pages, got))
		h1, d1, s1 := calls()
		assert.Equal(t, wantCopies, h1-h0, "region %d: copies to the device", r)
		assert.Equal(t, wantCopies, d1-d0, "region %d: copies from the device", r)
		assert.Equal(t, 2, s1-s0, "region %d: one wait per call", r)
		require.Equal(t, src, got, "region %d", r)
		for i, p := range pages {
			assert.Equal(t, src[i*pb:(i+1)*pb], readPage(t, d, r, p), "region %d page %d", r, p)
		}
	}
	// The strided region's gaps (the allocated region's pages would be
	// there in a vLLM layout) are untouched.
	gap := make([]byte, pb)
	require.NoError(t, d.CopyOut(base, gap))
	assert.Equal(t, make([]byte, pb), gap, "the byte before the adopted region's page 0")

	// Batches larger than the staging buffer: 5 pages a batch.
	d2, f2 := openFake(t)
	d2.SetCopyStaging(5 * pb)
	_, err = d2.AllocRegion(n, pb)
	require.NoError(t, err)
	require.NoError(t, d2.WritePages(0, pages, src))
	got := make([]byte, len(src))
	s0 := f2.Calls("cuStreamSynchronize")
	require.NoError(t, d2.ReadPages(0, pages, got))
	require.Equal(t, src, got)
	assert.Equal(t, (len(pages)+4)/5, f2.Calls("cuStreamSynchronize")-s0, "one wait per staging batch")
}

func readPage(t *testing.T, d cudaops.Device, r int, p int32) []byte {
	t.Helper()
	b := make([]byte, d.Regions()[r].PageBytes)
	require.NoError(t, d.ReadPage(r, p, b))
	return b
}

// A failed queued copy must not leave staging in use by a copy still
// pending, and must say which call failed.
func TestCUDAPageCopiesFailedCopy(t *testing.T) {
	d, f := openFake(t)
	_, err := d.AllocRegion(8, 64)
	require.NoError(t, err)
	f.FailNext("cuMemcpyDtoHAsync_v2", 719)
	err = d.ReadPages(0, []int32{1, 3}, make([]byte, 128))
	require.ErrorIs(t, err, cudaops.ErrDriver)
	require.ErrorContains(t, err, "cuMemcpyDtoHAsync_v2")
	src := bytes.Repeat([]byte{9}, 128)
	require.NoError(t, d.WritePages(0, []int32{1, 3}, src), "the device still works")
	got := make([]byte, 128)
	require.NoError(t, d.ReadPages(0, []int32{1, 3}, got))
	assert.Equal(t, src, got)
}

// A failed wait does not say the queued copies are done: a copy from
// staging may still run later, and read whatever staging holds then. The
// next batched copy must not reuse that staging, or its bytes would land
// in the earlier call's pages (here: another import's).
func TestCUDAStagedCopyAfterFailedWaitUsesFreshStaging(t *testing.T) {
	d, f := openFake(t)
	_, err := d.AllocRegion(8, 64)
	require.NoError(t, err)
	f.FailNext("cuStreamSynchronize", 999)
	first := bytes.Repeat([]byte{1}, 128)
	err = d.WritePages(0, []int32{1, 3}, first)
	require.ErrorIs(t, err, cudaops.ErrDriver)
	require.ErrorContains(t, err, "cuStreamSynchronize")

	second := bytes.Repeat([]byte{2}, 128)
	require.NoError(t, d.WritePages(0, []int32{5, 6}, second), "the device still works")
	for _, p := range []int32{1, 3} {
		got := make([]byte, 64)
		require.NoError(t, d.ReadPage(0, p, got))
		assert.NotContains(t, string(got), string(second[:1]),
			"page %d, of the failed call, got the next call's bytes", p)
	}
	got := make([]byte, 128)
	require.NoError(t, d.ReadPages(0, []int32{5, 6}, got))
	assert.Equal(t, second, got)
}
