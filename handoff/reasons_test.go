package handoff_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// servedUnder is a transport whose receiver serves every transfer under
// ctx rather than under the sender's context: a decode server that is
// shutting down while its connections still carry verdicts.
type servedUnder struct {
	recv   *handoff.Receiver
	ctx    context.Context
	serves sync.WaitGroup
}

func (s *servedUnder) Open(context.Context) (handoff.Stream, error) {
	toServer, toClient := make(chan []byte, 64), make(chan []byte, 64)
	s.serves.Go(func() {
		s.recv.Serve(s.ctx, chanEnd{in: toServer, out: toClient})
		close(toClient)
	})
	return &chanStream{chanEnd: chanEnd{in: toClient, out: toServer}}, nil
}

// chanEnd is one end of a pair of buffered channels, enough for the few
// messages of a transfer refused at its manifest.
type chanEnd struct {
	in  <-chan []byte
	out chan<- []byte
}

func (e chanEnd) Recv() ([]byte, error) {
	msg, ok := <-e.in
	if !ok {
		return nil, io.EOF
	}
	return msg, nil
}

func (e chanEnd) Send(msg []byte) error {
	select {
	case e.out <- bytes.Clone(msg):
		return nil
	default:
		return fmt.Errorf("%w: test channel full", handoff.ErrTransport)
	}
}

type chanStream struct {
	chanEnd
	once sync.Once
}

func (s *chanStream) CloseSend() error { s.once.Do(func() { close(s.out) }); return nil }
func (s *chanStream) Close() error     { return s.CloseSend() }

// failingWrites is a host device whose page writes fail, and which offers
// nothing but the Device interface (no part writes, no page views).
type failingWrites struct{ cudaops.Device }

var errInjected = errors.New("injected device write failure")

func (failingWrites) WritePage(int, int32, []byte) error { return errInjected }

// TestImportFailuresReportedAsInternal: every failure a handoff can end
// with that kvcache gives its own sentinel reaches the sender (and both
// sides' counters) as that reason, not as "internal", which says the
// receiver failed for a reason the protocol cannot name.
func TestImportFailuresReportedAsInternal(t *testing.T) {
	cases := []struct {
		name   string
		reason error
		label  string
		// run sends exp, exported from prefill, to a receiver of its own
		// making, which it returns (nil: the failure is the sender's).
		run func(t *testing.T, exp *handoff.Export) (error, *handoff.Receiver)
	}{
		{"decode server's context done before the admission", kvcache.ErrContextDone, "context_done",
			func(t *testing.T, exp *handoff.Export) (error, *handoff.Receiver) {
				recv := receiver(t, pool(t, testkit.PoolConfig{Pages: 64}), func(c *handoff.ReceiverConfig) { c.AdmitWait = time.Minute })
				done, cancel := context.WithCancel(context.Background())
				cancel()
				tr := &servedUnder{recv: recv, ctx: done}
				err := exp.Send(context.Background(), tr)
				tr.serves.Wait()
				return err, recv
			}},
		{"decode device fails a page write", kvcache.ErrDevice, "device",
			func(t *testing.T, exp *handoff.Export) (error, *handoff.Receiver) {
				g := testkit.Geometry
				dev := cudaops.NewHost()
				for range g.Regions() {
					_, err := dev.AllocRegion(64, g.RegionPageBytes())
					require.NoError(t, err)
				}
				decode, err := kvcache.New(kvcache.Config{Geometry: g, Pages: 64, MaxContextTokens: 64 * g.TokensPerPage,
					Tenants: []kvcache.TenantConfig{{Name: testkit.Auditor}, {Name: "victim"}},
					Scrub:   kvcache.ScrubPolicy{Kind: kvcache.ScrubCanary}, Device: failingWrites{dev}})
				require.NoError(t, err)
				t.Cleanup(func() { decode.Close() })
				recv := receiver(t, decode)
				inproc := handoff.NewInProcess(recv)
				err = exp.Send(context.Background(), inproc)
				inproc.Wait()
				assertNoImport(t, recv, decode, exp.Manifest().RequestID)
				sweep(t, decode)
				return err, recv
			}},
		{"exported pages reclaimed before they were sent", kvcache.ErrReclaimed, "reclaimed",
			func(t *testing.T, exp *handoff.Export) (error, *handoff.Receiver) {
				require.NoError(t, exp.Abort())
				decode := pool(t, testkit.PoolConfig{Pages: 64})
				recv := receiver(t, decode)
				inproc := handoff.NewInProcess(recv)
				err := exp.Send(context.Background(), inproc)
				inproc.Wait()
				assertNoImport(t, recv, decode, exp.Manifest().RequestID)
				sweep(t, decode)
				return err, nil
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			prefill := pool(t, testkit.PoolConfig{Pages: 64})
			s := sender(t)
			l, err := testkit.Prefill(prefill, "r", "victim", 5*16)
			require.NoError(t, err)
			exp, err := s.Export(l, 16)
			require.NoError(t, err)

			err, recv := tc.run(t, exp)
			require.Error(t, err)
			assert.ErrorIs(t, err, tc.reason)
			assert.Equal(t, tc.label, handoff.ReasonName(err), "sender's error: %v", err)
			code := indexOf(t, tc.label)
			assert.Equal(t, uint64(1), s.Stats().FailedBy[code], "sender's failures: %v", s.Stats().FailedBy)
			if recv != nil {
				var re *handoff.RefusedError
				require.ErrorAs(t, err, &re, "the receiver's refusal reached the sender")
				assert.Equal(t, uint64(1), recv.Stats().RefusedBy[code], "receiver's refusals: %v", recv.Stats().RefusedBy)
			}
			require.NoError(t, exp.Abort())
			sweep(t, prefill)
		})
	}
}
