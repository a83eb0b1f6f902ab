package cudaops_test

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// CheckPages finds and names every bad page, wherever it sits in the
// batch, at either end of the range (a negative page, one past the
// smallest region), the first one when there are several.
func TestCheckPagesFindsEveryBadPageWhereverItSits(t *testing.T) {
	regions := []cudaops.Region{{Pages: 100}, {Pages: 64}} // the smallest bounds every batch
	require.NoError(t, cudaops.CheckPages(regions, nil))
	require.NoError(t, cudaops.CheckPages(regions, []int32{0, 63}))
	for n := 1; n <= 11; n++ {
		for at := range n {
			for _, bad := range []int32{64, 99, -1, math.MinInt32, math.MaxInt32} {
				pages := make([]int32, n)
				for i := range pages {
					pages[i] = int32(i * 5 % 64)
				}
				pages[at] = bad
				err := cudaops.CheckPages(regions, pages)
				require.ErrorIs(t, err, cudaops.ErrInvalidArgument, "page %d at %d of %d", bad, at, n)
				assert.ErrorContains(t, err, fmt.Sprintf("page %d outside [0, 64)", bad))
				if at+1 < n {
					pages[at+1] = -7 // a second bad page: the first is named
					assert.ErrorContains(t, cudaops.CheckPages(regions, pages), fmt.Sprintf("page %d ", bad))
				}
			}
		}
	}
	require.ErrorIs(t, cudaops.CheckPages(nil, []int32{0}), cudaops.ErrInvalidArgument, "a device with no regions")
}
