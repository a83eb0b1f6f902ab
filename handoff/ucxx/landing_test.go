//go:build cgo && ucx

package ucxx_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/handoff/ucxx"
	"github.com/kvfence/kvfence/kvcache"
)

// The exposed memory's watch is called as the sender's bytes land, by
// whichever goroutine progressed the worker (UCX's copies out of its
// shared-memory queue, or its receives over TCP), so that after the
// progress that landed the last byte a scan sees every byte; after the
// revoke it is called no more.
func TestWatchLandingScansAsBytesLand(t *testing.T) {
	mem := make([]byte, 1<<20)
	src := bytes.Repeat([]byte{0xab}, len(mem))
	var scans, scansAtRevoke atomic.Int64
	var sawAll atomic.Bool
	revoked := make(chan struct{})
	tr := rawServer(t, func(ctx context.Context, ep handoff.Endpoint) error {
		desc, revoke, err := ep.(handoff.MemoryEndpoint).ExposeMemory([][]byte{mem})
		if err != nil {
			return err
		}
		lw := ep.(handoff.LandingWatcher)
		if !lw.LandsHere() {
			return fmt.Errorf("the bytes land elsewhere over %q", os.Getenv("UCX_TLS"))
		}
		lw.WatchLanding(func() {
			scans.Add(1)
			sawAll.Store(mem[0] == 0xab && mem[len(mem)-1] == 0xab)
		})
		defer close(revoked)
		defer func() {
			revoke()
			scansAtRevoke.Store(scans.Load())
		}()
		if err := ep.Send(desc); err != nil {
			return err
		}
		for {
			if _, err := ep.Recv(); err != nil {
				return nil
			}
		}
	}, ucxx.Options{})
	st, err := tr.Open(context.Background())
	require.NoError(t, err)
	desc, err := st.Recv()
	require.NoError(t, err, "the server exposed nothing")
	w, err := st.(handoff.MemoryStream).OpenRemote(desc, []int64{int64(len(mem))})
	require.NoError(t, err)
	wait, err := w.Write([]handoff.RemotePut{{Mem: 0, Off: 0, Src: [][]byte{src}}})
	require.NoError(t, err)
	require.NoError(t, wait())
	require.NoError(t, w.Close())
	require.NoError(t, st.Close())
	select {
	case <-revoked:
	case <-time.After(20 * time.Second):
		t.Fatal("the server never revoked")
	}
	assert.Equal(t, src, mem)
	assert.Positive(t, scans.Load())
	assert.True(t, sawAll.Load(), "the last scan before the revoke saw every byte (%d scans)", scans.Load())
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, scansAtRevoke.Load(), scans.Load(), "scans after the revoke")
}

// Handoffs into pages that hold whole checksum blocks (6 KiB pages, as a
// model's are) are summed as they land, and every page arrives as the
// prefill wrote it; both pools sweep clean.
func TestHandoffSummedAsItLands(t *testing.T) {
	g := kvcache.Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 2, HeadDim: 96, DType: kvcache.FP16}
	pool := func(pages int) *kvcache.Pool {
		p, err := testkit.NewPool(testkit.PoolConfig{Geometry: g, Pages: pages, Tenants: tenants})
		require.NoError(t, err)
		t.Cleanup(func() { p.Close() })
		return p
	}
	prefill, decode := pool(512), pool(1024)
	recv, _, tr := serve(t, handoff.ReceiverConfig{Pool: decode}, ucxx.Options{})
	s := newSender(t)
	for i, prompt := range []int{1, 16, 400*16 + 3} {
		id := fmt.Sprint("landing-", i)
		require.NoError(t, export(t, s, prefill, id, prompt).Send(context.Background(), tr))
		dl, ok := recv.Take(id)
		require.True(t, ok, "no decode lease for %s", id)
		require.NoError(t, testkit.VerifyContent(decode, dl, id))
		require.NoError(t, dl.Release())
	}
	require.NoError(t, testkit.Sweep(prefill))
	require.NoError(t, testkit.Sweep(decode))
}
