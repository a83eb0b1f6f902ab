package handoff_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// recordTransfer records one genuine transfer of request id (3 pages, one
// per data frame) from a fresh prefill pool: its manifest and the
// messages after it.
func recordTransfer(t *testing.T, id string) (manifest []byte, rest [][]byte) {
	t.Helper()
	tenants := []kvcache.TenantConfig{{Name: "victim"}}
	prefill, err := testkit.NewPool(testkit.PoolConfig{Pages: 16, Tenants: tenants})
	require.NoError(t, err)
	t.Cleanup(func() { prefill.Close() })
	sink, err := testkit.NewPool(testkit.PoolConfig{Pages: 16, Tenants: tenants})
	require.NoError(t, err)
	t.Cleanup(func() { sink.Close() })
	s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), TTL: time.Hour, FrameBytes: 1})
	require.NoError(t, err)
	l, err := testkit.Prefill(prefill, id, "victim", 3*testkit.Geometry.TokensPerPage)
	require.NoError(t, err)
	exp, err := s.Export(l, 8)
	require.NoError(t, err)
	r, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: sink, Key: testkit.Key(), MaxTTL: 2 * time.Hour})
	require.NoError(t, err)
	inproc := handoff.NewInProcess(r)
	var sent [][]byte
	require.NoError(t, exp.Send(context.Background(), &hooked{inner: inproc, send: func(st handoff.Stream, n int, msg []byte) error {
		sent = append(sent, bytes.Clone(msg))
		return st.Send(msg)
	}}))
	inproc.Wait()
	require.Len(t, sent, 5, "manifest, 3 data frames, seal")
	return sent[0], sent[1:]
}

// TestPlacedFramesLandInThePoolPages: on a PlacingEndpoint and a pool of
// host memory, every data frame is read into the import's pages (none
// goes through a copy), and the lease delivered holds exactly the
// prefill's KV.
func TestPlacedFramesLandInThePoolPages(t *testing.T) {
	const id = "placed"
	manifest, rest := recordTransfer(t, id)
	decode, err := testkit.NewPool(testkit.PoolConfig{Pages: 16, Tenants: []kvcache.TenantConfig{{Name: "victim"}}})
	require.NoError(t, err)
	defer decode.Close()
	r, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: testkit.Key(), MaxTTL: 2 * time.Hour})
	require.NoError(t, err)
	ep := &placingEndpoint{scriptedEndpoint: &scriptedEndpoint{manifest: manifest, msgs: rest, cuts: make([]int, len(rest))}}
	require.NoError(t, r.Serve(context.Background(), ep))
	require.Empty(t, ep.misuse)
	require.Equal(t, 3, ep.placed, "data frames placed")
	dl, ok := r.Take(id)
	require.True(t, ok)
	require.NoError(t, testkit.VerifyContent(decode, dl, id))
	require.NoError(t, dl.Release())
	require.NoError(t, testkit.Sweep(decode))
}

// stallingPlacer is a PlacingEndpoint whose first placed read stalls,
// holding the pages it was lent, until InterruptRecv: a sender that
// stops in the middle of a data frame.
type stallingPlacer struct {
	*placingEndpoint
	interrupted chan struct{}
	stalled     chan struct{}
}

func (e *stallingPlacer) RecvPlaced(place func(int, func(int) ([]byte, error)) ([][]byte, error)) ([]byte, bool, error) {
	msg, err := e.Recv()
	if err != nil {
		return nil, false, err
	}
	bufs, err := place(len(msg), func(n int) ([]byte, error) { return msg[:n], nil })
	if err != nil || bufs == nil {
		return msg, false, err
	}
	close(e.stalled)
	<-e.interrupted
	return nil, false, errDropped
}

func (e *stallingPlacer) InterruptRecv() {
	select {
	case <-e.interrupted:
	default:
		close(e.interrupted)
	}
}

// TestTransferTimeoutEndsAReadIntoPinnedPages: the transfer timeout
// fires while the endpoint is reading a frame into the import's pages,
// which pins them. The watchdog must end the read before it aborts the
// import, since the abort waits for the pin: the other way round, Serve
// never returns.
func TestTransferTimeoutEndsAReadIntoPinnedPages(t *testing.T) {
	const id = "stalled"
	manifest, rest := recordTransfer(t, id)
	decode, err := testkit.NewPool(testkit.PoolConfig{Pages: 16, Tenants: []kvcache.TenantConfig{{Name: "victim"}}})
	require.NoError(t, err)
	defer decode.Close()
	r, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: testkit.Key(), MaxTTL: 2 * time.Hour,
		TransferTimeout: 50 * time.Millisecond})
	require.NoError(t, err)
	ep := &stallingPlacer{
		placingEndpoint: &placingEndpoint{scriptedEndpoint: &scriptedEndpoint{manifest: manifest, msgs: rest, cuts: make([]int, len(rest))}},
		interrupted:     make(chan struct{}),
		stalled:         make(chan struct{}),
	}
	served := make(chan error, 1)
	go func() { served <- r.Serve(context.Background(), ep) }()
	select {
	case err := <-served:
		require.ErrorIs(t, err, kvcache.ErrIncompleteTransfer)
	case <-time.After(20 * time.Second):
		ep.InterruptRecv() // lets the pool's Close through
		t.Fatal("Serve did not return within 20 s of a 50 ms transfer timeout: the abort waits for the pages the stalled read holds")
	}
	select {
	case <-ep.stalled:
	default:
		t.Fatal("the read never stalled in placed pages: the test tested nothing")
	}
	_, ok := r.Take(id)
	require.False(t, ok)
	require.NoError(t, testkit.Sweep(decode))
	require.NoError(t, decode.Check())
}
