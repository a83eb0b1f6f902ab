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
