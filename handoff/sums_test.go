package handoff_test

import (
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
)

// inSpans covers every unit once, in consecutive spans, as many as the
// workers, the units and the bytes allow, and returns the error of the
// first span that failed.
func TestInSpans(t *testing.T) {
	cases := []struct {
		workers   int
		minBytes  int64
		n         int
		bytes     int64
		wantSpans int
	}{
		{workers: 1, minBytes: 1, n: 100, bytes: 1 << 30, wantSpans: 1},
		{workers: 4, minBytes: 1, n: 100, bytes: 1 << 30, wantSpans: 4},
		{workers: 4, minBytes: 1, n: 3, bytes: 1 << 30, wantSpans: 3},           // no more spans than units
		{workers: 4, minBytes: 1 << 20, n: 100, bytes: 2<<20 + 1, wantSpans: 2}, // at least minBytes each
		{workers: 4, minBytes: 1 << 20, n: 100, bytes: 1 << 19, wantSpans: 1},
		{workers: 3, minBytes: 1, n: 10, bytes: 10, wantSpans: 3},
		{workers: 4, minBytes: 1, n: 1, bytes: 1 << 30, wantSpans: 1},
		{workers: 4, minBytes: 1, n: 0, bytes: 0, wantSpans: 1}, // nothing to split: one empty call
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("w%d-min%d-n%d-b%d", c.workers, c.minBytes, c.n, c.bytes), func(t *testing.T) {
			defer handoff.SetSumSpansForTest(c.workers, c.minBytes)()
			var mu sync.Mutex
			var spans [][2]int
			require.NoError(t, handoff.InSpansForTest(c.n, c.bytes, func(lo, hi int) error {
				mu.Lock()
				defer mu.Unlock()
				spans = append(spans, [2]int{lo, hi})
				return nil
			}))
			require.Len(t, spans, c.wantSpans)
			slices.SortFunc(spans, func(a, b [2]int) int { return a[0] - b[0] })
			next := 0
			for i, s := range spans {
				require.Equal(t, next, s[0], "span %d does not start where %d ended", i, i-1)
				require.True(t, s[1] > s[0] || c.n == 0, "span %d is empty", i)
				next = s[1]
			}
			require.Equal(t, c.n, next, "the spans end short")
		})
	}
	t.Run("errors", func(t *testing.T) {
		defer handoff.SetSumSpansForTest(4, 1)()
		errAt := func(lo int) error { return fmt.Errorf("span at %d", lo) }
		err := handoff.InSpansForTest(8, 8, func(lo, hi int) error {
			if lo >= 4 {
				return errAt(lo)
			}
			return nil
		})
		require.EqualError(t, err, "span at 4", "the first failed span's error, in unit order")
	})
}

// A machine sums a chunk on one goroutine per 8 cores, 1 to 4.
func TestDefaultSumWorkers(t *testing.T) {
	for procs, want := range map[int]int{1: 1, 2: 1, 8: 1, 16: 2, 31: 3, 32: 4, 256: 4} {
		assert.Equal(t, want, handoff.DefaultSumWorkersForTest(procs), "GOMAXPROCS %d", procs)
	}
}

// The remote transfers' tests again, every chunk's units summed on three
// goroutines by both ends: the same transfers succeed, and the same
// faults (pages never written, a page changed after it was summed) are
// refused.
func TestRemoteSumsInSpans(t *testing.T) {
	defer handoff.SetSumSpansForTest(3, 1)()
	t.Run("RoundTrip", TestRemoteRoundTrip)
	t.Run("ChunksMeetMinPutBytes", TestRemoteChunksMeetMinPutBytes)
	t.Run("StagedChunksBounded", TestRemoteStagedChunksBounded)
	t.Run("Faults", TestRemoteFaults)
	t.Run("Hybrid", TestRemoteHybrid)
}
