package grpcx_test

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/grpcx"
	"github.com/kvfence/kvfence/handoff/internal/benchkit"
)

// BenchmarkHandoff hands a 32,768-token prompt's KV from a prefill pool to
// a decode pool over loopback gRPC (benchkit.Handoff: the workload, its
// checks and the raw TCP baseline after each handoff): export, manifest,
// pages (lent from the prefill pool's memory to gRPC, summed just before
// gRPC copies them out) → wire → decode device, content check, ack, and
// the release of the prefill pages, whose scrub runs after Send has
// returned, as on a GPU (clean-x-tcp waits for it: benchkit.Handoff).
//
// cpu-ms/op and tcp-cpu-ms/op are the process's CPU time (user and
// system, both ends) over the same spans: where both ends share a few
// cores, as on bench/README.md's machine, x-tcp follows how much more CPU
// per byte the handoff takes than the copy. BenchmarkGRPCStream is the
// ceiling: gRPC's share alone.
func BenchmarkHandoff(b *testing.B) {
	benchkit.Handoff(b, func(recv *handoff.Receiver) handoff.Transport {
		srv, err := grpcx.NewServer(recv, insecure.NewCredentials())
		require.NoError(b, err)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(b, err)
		go srv.Serve(ln)
		b.Cleanup(srv.Stop)
		tr, err := grpcx.Dial(ln.Addr().String(), insecure.NewCredentials())
		require.NoError(b, err)
		b.Cleanup(func() { tr.Close() })
		return tr
	})
}

// BenchmarkGRPCStream is gRPC's share of BenchmarkHandoff, and so the
// ceiling of its x-tcp: the same 256 MiB in messages laid out like the
// handoff's data frames (benchkit.Stream: a head, then 7 pages of views
// per message), lent to gRPC from memory of the pools' kind (SendViews, no
// copy, every view given back before the clock stops) and taken on the
// server in the buffers they arrived in (RecvParts) and dropped, over this
// package's options and codec; no manifest, no checksums, no decode pool,
// no scrub. The raw TCP copy runs after each stream, as in
// BenchmarkHandoff.
func BenchmarkGRPCStream(b *testing.B) {
	opts, err := grpcx.ServerOptions(insecure.NewCredentials())
	require.NoError(b, err)
	srv := grpc.NewServer(opts...)
	grpcx.RegisterDrain(srv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	go srv.Serve(ln)
	defer srv.Stop()
	tr, err := grpcx.Dial(ln.Addr().String(), insecure.NewCredentials())
	require.NoError(b, err)
	defer tr.Close()
	benchkit.Stream(b, tr)
}
