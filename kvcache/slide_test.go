package kvcache

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// staleStreams is a device whose orderings pass CheckOrdering and then go
// bad before the fill is queued (the engine destroyed its stream, or
// began capturing a graph on it, in between): every fill after a named
// stream or event is refused with ErrBadOrdering.
type staleStreams struct {
	*cudaops.Host
	refused int
}

func (d *staleStreams) CheckOrdering(cudaops.Ordering) error { return nil }

func (d *staleStreams) FillSpans(spans []cudaops.Span, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	if !after.IsZero() {
		d.refused++
		return nil, fmt.Errorf("%w: stream %#x is gone", cudaops.ErrBadOrdering, after.Stream)
	}
	return d.Host.FillSpans(spans, spec, after)
}

// An ordering that went bad after SlideWindows checked it is the
// engine's mistake, as for a release (scrub): the fill waits for all the
// engine's work instead. It faulted the pool, so that every tenant's
// admissions failed until ClearFault.
func TestSlideWindowsOrderingThatWentBadDoesNotFaultThePool(t *testing.T) {
	dev := &staleStreams{Host: cudaops.NewHost()}
	cfg := hybridConfig(64, 2)
	cfg.Device = dev
	p := newPool(t, cfg)
	l := admit(t, p, "long", "a", 200)
	require.NoError(t, l.Commit(12))
	n, err := l.SlideWindows(cudaops.Ordering{Stream: 0x1234})
	require.NoError(t, err)
	assert.Equal(t, 1, n, "page 0 slid out and was scrubbed")
	assert.Equal(t, 1, dev.refused)
	require.NoError(t, p.Fault())
	require.NoError(t, p.Check())
	admit(t, p, "next", "b", 4)
	// A release with the same ordering fares the same.
	require.NoError(t, l.ReleaseAfter(cudaops.Ordering{Stream: 0x1234}))
	require.NoError(t, p.Fault())
	require.NoError(t, p.Check())
}
