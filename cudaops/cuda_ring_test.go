package cudaops_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// fillWithin runs fill and fails the test if it has not returned after
// limit. A fill that never returns holds the device, so on a timeout the
// device is left open (its Close would wait for the fill forever).
func fillWithin(t *testing.T, limit time.Duration, fill func() (cudaops.Fence, error)) cudaops.Fence {
	t.Helper()
	type result struct {
		f   cudaops.Fence
		err error
	}
	done := make(chan result, 1)
	go func() {
		f, err := fill()
		done <- result{f, err}
	}()
	select {
	case r := <-done:
		require.NoError(t, r.err)
		return r.f
	case <-time.After(limit):
		t.Fatalf("the fill has not returned after %v", limit)
		return nil
	}
}

func runOf(first, n int32) []int32 {
	s := make([]int32, n)
	for i := range s {
		s[i] = first + int32(i)
	}
	return s
}

// The staging ring is sized for the largest Fill, which names each page
// once and so at most the smallest region's pages. A FillSpans batch is
// bounded by each span's own regions instead: a pool with a state group
// of a few slots beside its per-token pages (a hybrid model) scrubs all
// its free pages at creation in one FillSpans, and a long lease's release
// names more pages than the ring holds. Such a batch waited for ring
// space that could never come: Fill did not return, and Close then waited
// for it too. It must be filled, and only its pages.
func TestCUDAFillSpansLargerThanStagingRingNeverReturned(t *testing.T) {
	const (
		slots, slotBytes = 8, 64      // the state group: the smallest region, so the ring's least size (64 KiB: 16384 IDs)
		pages, pageBytes = 20000, 16  // the per-token group
		word             = 0x5a5a5a5a // what the big batch writes
	)
	for _, tc := range []struct {
		name string
		// before are batches of the per-token region filled first, to
		// move the ring's head; batch is the batch that must not hang.
		before []int32
		batch  int32
	}{
		{name: "batch larger than the ring", batch: pages},
		{name: "batch of most of the ring after the head moved", before: []int32{5000}, batch: 12000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, f, err := cudaops.OpenFake()
			require.NoError(t, err)
			require.NoError(t, d.KernelError())
			d.SetGridLimit(16) // few simulated threads: the kernel loops
			d.SetFillBlock(32)
			_, err = d.AllocRegion(slots, slotBytes)
			require.NoError(t, err)
			_, err = d.AllocRegion(pages, pageBytes)
			require.NoError(t, err)
			old := bytes.Repeat([]byte{0xee}, pages*pageBytes)
			require.NoError(t, d.WritePages(1, runOf(0, pages), old))
			require.NoError(t, d.WritePages(0, runOf(0, slots), bytes.Repeat([]byte{0xee}, slots*slotBytes)))

			for _, n := range tc.before {
				fc := fillWithin(t, 10*time.Second, func() (cudaops.Fence, error) {
					return d.FillSpans([]cudaops.Span{{First: 1, Count: 1, Pages: runOf(0, n)}}, cudaops.FillSpec{Word: 1}, cudaops.Ordering{Stream: cudaops.StreamLegacy})
				})
				require.NoError(t, fc.Wait())
			}
			batch := runOf(0, tc.batch)
			fc := fillWithin(t, 10*time.Second, func() (cudaops.Fence, error) {
				return d.FillSpans([]cudaops.Span{
					{First: 0, Count: 1, Pages: []int32{2, 5}},
					{First: 1, Count: 1, Pages: batch},
				}, cudaops.FillSpec{Word: word}, cudaops.Ordering{Stream: cudaops.StreamLegacy})
			})
			require.NoError(t, fc.Wait())

			got := make([]byte, pages*pageBytes)
			require.NoError(t, d.ReadPages(1, runOf(0, pages), got))
			for p := range int32(pages) {
				want := uint32(0xeeeeeeee)
				if p < tc.batch {
					want = word
				}
				if w := words(got[int(p)*pageBytes : int(p+1)*pageBytes]); !assert.Equal(t, uniform(want, pageBytes/4), w, "region 1 page %d", p) {
					break
				}
			}
			for p := range int32(slots) {
				want := uint32(0xeeeeeeee)
				if p == 2 || p == 5 {
					want = word
				}
				assert.Equal(t, uniform(want, slotBytes/4), pageWords(t, d, 0, p), "region 0 page %d", p)
			}
			require.NoError(t, d.Close())
			assert.Empty(t, f.Leaks())
		})
	}
}

// A fill that failed after part of it was queued (its fence event not
// recorded, or its second launch refused) gave its staging ring slot
// back at once, on the grounds that a copy queued from the slot lands
// before any later one. But the copy reads the slot when it runs, not
// when it is queued: the next fill wrote its own page list into the slot
// first, and the failed fill's queued launch then scrubbed the next
// fill's page numbers in the failed fill's regions, pages nobody had
// released (another tenant's, in another cache group).
func TestCUDAFailedFillLentItsRingSlotToTheNextFill(t *testing.T) {
	const pb = 64
	for _, tc := range []struct {
		name    string
		regions int
		fail    func(f *cudaops.FakeDriver)
	}{
		{name: "fence event not recorded", regions: 2, fail: func(f *cudaops.FakeDriver) { f.FailNext("cuEventRecord", 999) }},
		{name: "fence event not recorded, and the wait for the stream failed", regions: 2, fail: func(f *cudaops.FakeDriver) {
			f.FailNext("cuEventRecord", 999)
			f.FailNext("cuStreamSynchronize", 999)
		}},
		// Nine spans are two launches.
		{name: "second launch refused", regions: 9, fail: func(f *cudaops.FakeDriver) { f.FailLater("cuLaunchKernel", 1, 701) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, f := openFake(t)
			d.SetInlineIDs(1) // page lists of two or more go through the ring
			for range tc.regions {
				_, err := d.AllocRegion(8, pb)
				require.NoError(t, err)
			}
			for r := range tc.regions {
				for p := range int32(8) {
					require.NoError(t, d.WritePage(r, p, bytes.Repeat([]byte{0xee}, pb)))
				}
			}
			// An engine event, so that neither fill synchronises the
			// context (which would run the failed fill's work first).
			after := cudaops.Ordering{Event: engineOn(t, d, cudaops.EngineOwnStream).Event()}
			last := tc.regions - 1
			var failing []cudaops.Span
			for r := range last {
				failing = append(failing, cudaops.Span{First: r, Count: 1, Pages: []int32{1, 2}})
			}
			if tc.regions == 2 {
				failing = failing[:1]
			} else {
				failing = append(failing, cudaops.Span{First: last, Count: 1, Pages: []int32{1, 2}})
			}
			tc.fail(f)
			_, err := d.FillSpans(failing, cudaops.FillSpec{Word: 1}, after)
			require.ErrorIs(t, err, cudaops.ErrDriver)

			fc, err := d.FillSpans([]cudaops.Span{{First: last, Count: 1, Pages: []int32{5, 6}}}, cudaops.FillSpec{Word: 2}, after)
			require.NoError(t, err)
			require.NoError(t, fc.Wait())
			for r := range last {
				for _, p := range []int32{5, 6} {
					assert.Equal(t, uniform(0xeeeeeeee, pb/4), pageWords(t, d, r, p), "region %d page %d, never released, was filled", r, p)
				}
			}
			for _, p := range []int32{5, 6} {
				assert.Equal(t, uniform(2, pb/4), pageWords(t, d, last, p), "region %d page %d", last, p)
			}
		})
	}
}

// A driver call that fails at any step of adding a region (the region's
// memory, the region table, its upload, the staging ring's two halves,
// which the first region allocates) must leave the device as it was: the
// region is not added, nothing leaks, and the next region and its fills
// work.
func TestCUDARegionAddFailedHalfwayLeftTheDeviceBroken(t *testing.T) {
	for _, tc := range []struct {
		name, call string
		skip, code int
	}{
		{"region memory", "cuMemAlloc_v2", 0, 2},
		{"region table", "cuMemAlloc_v2", 1, 2},
		{"table upload", "cuMemcpyHtoDAsync_v2", 0, 719},
		{"ring host half", "cuMemAllocHost_v2", 0, 2},
		{"ring device half", "cuMemAlloc_v2", 2, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, f := openFake(t)
			d.SetGridLimit(16)
			d.SetFillBlock(32)
			d.SetInlineIDs(1)
			const pages = 8192 // a ring larger than its least size
			f.FailLater(tc.call, tc.skip, tc.code)
			_, err := d.AllocRegion(pages, 64)
			require.Error(t, err)
			require.ErrorContains(t, err, tc.call)
			require.Empty(t, d.Regions())

			_, err = d.AllocRegion(pages, 64)
			require.NoError(t, err)
			for _, batch := range [][]int32{runOf(4000, 4000), {1, 2}} {
				fc, err := d.Fill(batch, cudaops.FillSpec{Word: uint32(len(batch))}, cudaops.Ordering{Stream: cudaops.StreamLegacy})
				require.NoError(t, err)
				require.NoError(t, fc.Wait())
			}
			assert.Equal(t, uniform(4000, 16), pageWords(t, d, 0, 7999))
			assert.Equal(t, uniform(2, 16), pageWords(t, d, 0, 2))
			assert.Equal(t, uniform(0, 16), pageWords(t, d, 0, 3999))
			_, err = d.AllocRegion(16, 64)
			require.NoError(t, err)
		})
	}
}

// Close while a fill waits for staging ring space (every slot still read
// by fills in flight) must let that fill finish, complete every fence
// without error and free everything.
func TestCUDACloseWhileFillWaitsForRingLostFences(t *testing.T) {
	d, f, err := cudaops.OpenFake()
	require.NoError(t, err)
	d.SetGridLimit(16)
	d.SetFillBlock(32)
	d.SetInlineIDs(1)
	const pages, batch = 8192, 4096 // a ring of 32768 IDs: 8 batches
	_, err = d.AllocRegion(pages, 16)
	require.NoError(t, err)
	release := f.HoldSyncs()
	defer release()
	fences := make(chan cudaops.Fence, 16)
	go func() {
		defer close(fences)
		for i := range 10 {
			fc, err := d.FillSpans([]cudaops.Span{{First: 0, Count: 1, Pages: runOf(int32(i%2)*batch, batch)}},
				cudaops.FillSpec{Word: uint32(i)}, cudaops.Ordering{Stream: cudaops.StreamLegacy})
			if err != nil {
				// Only fills after Close fail.
				assert.ErrorIs(t, err, cudaops.ErrClosed, "fill %d", i)
				return
			}
			fences <- fc
		}
	}()
	require.Eventually(t, func() bool { return d.Stats().StagingWaits > 0 }, 10*time.Second, time.Millisecond)
	closed := make(chan error, 1)
	go func() { closed <- d.Close() }()
	time.Sleep(10 * time.Millisecond) // let Close wait for the fill
	release()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("Close did not return")
	}
	n := 0
	for fc := range fences {
		require.NoError(t, fc.Wait())
		n++
	}
	assert.GreaterOrEqual(t, n, 9, "the fill that waited for the ring did not finish")
	assert.Empty(t, f.Leaks())
	_, err = d.Fill([]int32{1}, cudaops.FillSpec{}, cudaops.Ordering{})
	assert.ErrorIs(t, err, cudaops.ErrClosed)
}
