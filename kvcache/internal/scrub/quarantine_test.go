package scrub

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

// failingDevice is a Host whose next FillSpans fails to queue (queueErr)
// or returns a fence that fails (fenceErr).
type failingDevice struct {
	*cudaops.Host
	queueErr, fenceErr error
}

func (d *failingDevice) FillSpans(spans []cudaops.Span, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	if err := d.queueErr; err != nil {
		d.queueErr = nil
		return nil, err
	}
	f, err := d.Host.FillSpans(spans, spec, after)
	if err == nil && d.fenceErr != nil {
		f, d.fenceErr = cudaops.Completed(d.fenceErr), nil
	}
	return f, err
}

// After a fill that fails to queue and one whose fence fails, the books
// of a two-space quarantine must still balance: nothing left in flight,
// the failed batches retired in their own spaces, the errors counted and
// the first one kept as the fault; a later good fill cleans its pages.
func TestQuarantineBooksAfterFailedFills(t *testing.T) {
	host := cudaops.NewHost()
	for _, pages := range []int{16, 4} {
		_, err := host.AllocRegion(pages, 64)
		require.NoError(t, err)
	}
	dev := &failingDevice{Host: host}
	var mu sync.Mutex
	big, err := allocator.New(16)
	require.NoError(t, err)
	small, err := allocator.New(4)
	require.NoError(t, err)
	q, err := New([]Space{{Alloc: big, First: 0, Count: 1}, {Alloc: small, First: 1, Count: 1}},
		dev, &mu, isolation.ScrubPolicy{Kind: isolation.ScrubPoison}, nil, isolation.FP16)
	require.NoError(t, err)
	mu.Lock()
	defer mu.Unlock()

	// release takes n pages of each space and quarantines them, as a
	// pool's release does.
	release := func(nBig, nSmall int) [][]int32 {
		var batches [][]int32
		for s, a := range []*allocator.Allocator{big, small} {
			n := []int{nBig, nSmall}[s]
			hs, err := a.Alloc(nil, n, 1)
			require.NoError(t, err)
			pages, err := a.Release(nil, hs, 1)
			require.NoError(t, err)
			q.BeginLocked(s, len(pages))
			batches = append(batches, pages)
		}
		require.NoError(t, q.CheckLocked())
		return batches
	}
	queueErr := errors.New("queue failed")
	fenceErr := errors.New("fence failed")

	dev.queueErr = queueErr
	b1 := release(3, 1)
	_, err = q.Issue(b1, cudaops.Ordering{})
	require.ErrorIs(t, err, queueErr)
	require.ErrorIs(t, q.FinishLocked(b1, err), isolation.ErrScrubFailed)

	dev.fenceErr = fenceErr
	b2 := release(2, 2)
	f, err := q.Issue(b2, cudaops.Ordering{})
	require.NoError(t, err)
	require.ErrorIs(t, q.FinishLocked(b2, f.Wait()), fenceErr)

	require.NoError(t, q.CheckLocked())
	assert.Equal(t, 5, big.Count(allocator.Retired))
	assert.Equal(t, 3, small.Count(allocator.Retired))
	assert.Zero(t, big.Count(allocator.Quarantined)+small.Count(allocator.Quarantined))
	st := q.StatsLocked()
	assert.Equal(t, uint64(2), st.FillErrors)
	assert.Equal(t, uint64(8), st.PagesRetired)
	assert.Zero(t, st.Fills)
	require.ErrorIs(t, q.FaultLocked(), queueErr, "the first failure is the fault")

	q.ClearFaultLocked()
	b3 := release(4, 1)
	f, err = q.Issue(b3, cudaops.Ordering{})
	require.NoError(t, err)
	require.NoError(t, q.FinishLocked(b3, f.Wait()))
	require.NoError(t, q.CheckLocked())
	require.NoError(t, q.FaultLocked())
	assert.Equal(t, 16-5, big.Count(allocator.Free))
	assert.Equal(t, 4-3, small.Count(allocator.Free))
	st = q.StatsLocked()
	assert.Equal(t, uint64(1), st.Fills)
	assert.Equal(t, uint64(5), st.PagesScrubbed)
	assert.Equal(t, uint64(5*64), st.BytesScrubbed)
	// Pages out of quarantine, per space: retired and cleaned alike.
	assert.Equal(t, uint64(3+2+4), q.EndedLocked(0))
	assert.Equal(t, uint64(1+2+1), q.EndedLocked(1))
	for _, p := range b3[0] {
		assert.Equal(t, []byte{0, 0x80}, host.PageBytes(0, p)[:2], "page %d scrubbed with fp16 -0", p)
	}
	require.NoError(t, big.Check())
	require.NoError(t, small.Check())
}
