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

// ringTestDevice opens a device whose staging ring is its least size,
// 16384 page IDs (the smallest region, 0, has 8 pages of 64 bytes),
// beside a region 1 of 16384 pages of 16 bytes whose batches can fill
// it, every page of both holding 0xee. Page lists of two or more go
// through the ring. The caller closes the device.
func ringTestDevice(t *testing.T) (*cudaops.CUDA, *cudaops.FakeDriver) {
	t.Helper()
	d, f, err := cudaops.OpenFake()
	require.NoError(t, err)
	require.NoError(t, d.KernelError())
	d.SetGridLimit(16)
	d.SetFillBlock(32)
	d.SetInlineIDs(1)
	_, err = d.AllocRegion(8, 64)
	require.NoError(t, err)
	_, err = d.AllocRegion(16384, 16)
	require.NoError(t, err)
	require.NoError(t, d.WritePages(0, runOf(0, 8), bytes.Repeat([]byte{0xee}, 8*64)))
	require.NoError(t, d.WritePages(1, runOf(0, 16384), bytes.Repeat([]byte{0xee}, 16384*16)))
	return d, f
}

// The reaper freed a fill's staging ring slot when its fence completed,
// whatever the wait's result. But a failed cuEventSynchronize does not
// mean the fill's work has run: its queued copy reads the slot when it
// runs. Once the ring wrapped, a later fill wrote its own page list into
// the slot, and the failed fill's launch then scrubbed the later fill's
// page numbers in the failed fill's region: pages nobody had released.
func TestCUDAFailedFenceWaitLentItsRingSlotToALaterFill(t *testing.T) {
	d, f := ringTestDevice(t)
	// Not a zero Ordering: synchronising the context would run the
	// failed fill's work before the ring wraps.
	after := cudaops.Ordering{Stream: cudaops.StreamLegacy}
	span := func(r int, pages []int32) []cudaops.Span { return []cudaops.Span{{First: r, Count: 1, Pages: pages}} }

	// The failing fill: region 0's pages 1 and 2, the ring's first 8 bytes.
	f.FailNext("cuEventSynchronize", 999)
	fc, err := d.FillSpans(span(0, []int32{1, 2}), cudaops.FillSpec{Word: 1}, after)
	require.NoError(t, err)
	require.ErrorIs(t, fc.Wait(), cudaops.ErrDriver)

	// Keep the rest in flight while the ring wraps: two fills take the
	// rest of it, and the third's slot is the failing fill's.
	release := f.HoldSyncs()
	defer release()
	var fences []cudaops.Fence
	for _, b := range []struct {
		pages []int32
		word  uint32
	}{{runOf(0, 8192), 2}, {runOf(8192, 8190), 3}} {
		fc, err := d.FillSpans(span(1, b.pages), cudaops.FillSpec{Word: b.word}, after)
		require.NoError(t, err)
		fences = append(fences, fc)
	}
	type result struct {
		f   cudaops.Fence
		err error
	}
	third := make(chan result, 1)
	go func() {
		fc, err := d.FillSpans(span(1, []int32{5, 6}), cudaops.FillSpec{Word: 4}, after)
		third <- result{fc, err}
	}()
	// It either took a slot or waits for one; either way, let the
	// stream run now.
	var r result
	waited := false
	require.Eventually(t, func() bool {
		select {
		case r = <-third:
			return true
		default:
			waited = d.Stats().StagingWaits > 0
			return waited
		}
	}, 10*time.Second, time.Millisecond)
	release()
	if waited {
		select {
		case r = <-third:
		case <-time.After(20 * time.Second):
			t.Fatal("the fill that waited for the ring did not return")
		}
	}
	require.NoError(t, r.err)
	fences = append(fences, r.f)
	for i, fc := range fences {
		require.NoError(t, fc.Wait(), "fill %d", i+2)
	}

	for _, p := range []int32{0, 3, 4, 5, 6, 7} {
		assert.Equal(t, uniform(0xeeeeeeee, 16), pageWords(t, d, 0, p), "region 0 page %d, never released, was filled", p)
	}
	got := make([]byte, 16384*16)
	require.NoError(t, d.ReadPages(1, runOf(0, 16384), got))
	for p := range int32(16384) {
		want := uint32(0xeeeeeeee)
		switch {
		case p == 5 || p == 6:
			want = 4
		case p < 8192:
			want = 2
		case p < 8192+8190:
			want = 3
		}
		if !assert.Equal(t, uniform(want, 4), words(got[16*p:16*(p+1)]), "region 1 page %d", p) {
			break
		}
	}
	require.NoError(t, d.Close())
	assert.Empty(t, f.Leaks())
}

// Once a failed fence wait keeps its fill's ring slot, a ring held
// entirely by fills whose waits failed has no fence left in flight to
// free it: the next fill that needs a slot waited for a reaper that had
// nothing to wait for, and never returned (Close then waited for it
// too). It must drain the stream and go on, or, when even that fails,
// fail with ErrDriver and leave the device usable.
func TestCUDARingHeldByFailedFenceWaitsHungTheNextFill(t *testing.T) {
	for _, drainFails := range []bool{false, true} {
		t.Run(map[bool]string{false: "drained", true: "drain failed"}[drainFails], func(t *testing.T) {
			d, f := ringTestDevice(t)
			span := func(pages []int32) []cudaops.Span { return []cudaops.Span{{First: 1, Count: 1, Pages: pages}} }
			legacy := cudaops.Ordering{Stream: cudaops.StreamLegacy}
			// Two fills of half the ring each, both waits failing.
			for i, first := range []int32{0, 8192} {
				f.FailNext("cuEventSynchronize", 999)
				fc, err := d.FillSpans(span(runOf(first, 8192)), cudaops.FillSpec{Word: uint32(i + 1)}, legacy)
				require.NoError(t, err)
				require.ErrorIs(t, fc.Wait(), cudaops.ErrDriver)
			}

			type result struct {
				f   cudaops.Fence
				err error
			}
			fill := func() result {
				done := make(chan result, 1)
				go func() {
					fc, err := d.FillSpans(span([]int32{5, 6}), cudaops.FillSpec{Word: 7}, legacy)
					done <- result{fc, err}
				}()
				select {
				case r := <-done:
					return r
				case <-time.After(20 * time.Second):
					t.Fatal("a fill that needs a slot of a ring held by failed waits has not returned")
					return result{}
				}
			}
			if drainFails {
				f.FailNext("cuStreamSynchronize", 999)
				r := fill()
				require.ErrorIs(t, r.err, cudaops.ErrDriver)
				require.ErrorContains(t, r.err, "cuStreamSynchronize")
			}
			r := fill()
			require.NoError(t, r.err)
			require.NoError(t, r.f.Wait())
			for _, p := range []int32{5, 6} {
				assert.Equal(t, uniform(7, 4), pageWords(t, d, 1, p), "region 1 page %d", p)
			}
			for p := range int32(8) {
				assert.Equal(t, uniform(0xeeeeeeee, 16), pageWords(t, d, 0, p), "region 0 page %d, never released, was filled", p)
			}
			require.NoError(t, d.Close())
			assert.Empty(t, f.Leaks())
		})
	}
}
