package cudaops_test

import (
	"bytes"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// With a step lag of one, a batch launches at the second Step after it
// arrived, not at the first: an engine that frees pages a step ahead of
// the work it has queued gets its scrub after that work.
func TestRankWorkerStepLag(t *testing.T) {
	const pages, pb = 4, 64
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	host := cudaops.NewHost()
	_, err = host.AllocRegion(pages, pb)
	require.NoError(t, err)
	conn, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	w, err := cudaops.ServeRank(conn, 0, host, true)
	require.NoError(t, err)
	g, err := cudaops.ListenRanks(l, cudaops.RemoteConfig{Ranks: 1, ReportTimeout: 10 * time.Second, AcceptTimeout: 10 * time.Second})
	require.NoError(t, err)
	defer func() { require.NoError(t, g.Close()) }()
	w.SetAutoStep(false)
	w.SetStepLag(1)

	written := bytes.Repeat([]byte{0xab}, pb)
	fill := func(page int32) cudaops.Fence {
		require.NoError(t, host.WritePage(0, page, written))
		f, err := g.Fill([]int32{page}, cudaops.FillSpec{}, cudaops.Ordering{})
		require.NoError(t, err)
		require.Eventually(t, func() bool { return w.Waiting() == 1 }, 5*time.Second, time.Millisecond)
		return f
	}
	page := func(p int32) []byte {
		b := make([]byte, pb)
		require.NoError(t, host.ReadPage(0, p, b))
		return b
	}

	f := fill(1)
	n, err := w.Step(cudaops.Ordering{})
	require.NoError(t, err)
	assert.Zero(t, n, "the first step after its arrival holds the batch")
	assert.Equal(t, written, page(1), "nothing scrubbed yet")
	done, err := f.Done()
	require.NoError(t, err)
	assert.False(t, done)
	assert.Equal(t, 1, w.Waiting())

	n, err = w.Step(cudaops.Ordering{})
	require.NoError(t, err)
	assert.Equal(t, 1, n, "the second step launches it")
	require.NoError(t, f.Wait())
	assert.Equal(t, make([]byte, pb), page(1))
	assert.Zero(t, w.Waiting())

	// Launching on arrival again launches what is held at once.
	f = fill(2)
	_, err = w.Step(cudaops.Ordering{})
	require.NoError(t, err)
	assert.Equal(t, 1, w.Waiting())
	w.SetAutoStep(true)
	require.NoError(t, f.Wait())
	assert.Equal(t, make([]byte, pb), page(2))
	assert.Zero(t, w.Waiting())
}
