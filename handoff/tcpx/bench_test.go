package tcpx_test

import (
	"crypto/tls"
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/benchkit"
	"github.com/kvfence/kvfence/handoff/tcpx"
)

// BenchmarkHandoff is grpcx's BenchmarkHandoff over tcpx (benchkit.Handoff:
// the same workload, checks and raw TCP baseline after each handoff):
// export, manifest, pages (the prefill pool's own, summed where they lie
// and written to the socket with one writev per data frame) → wire →
// the connection's read buffer → decode device, content check, ack, and
// the release of the prefill pages, over loopback plain TCP. The prefill
// pages' scrub runs after Send has returned, as on a GPU: x-tcp is the
// handoff as its caller waits for it, clean-x-tcp the time until the
// pages are clean (benchkit.Handoff).
func BenchmarkHandoff(b *testing.B) {
	benchkit.Handoff(b, func(recv *handoff.Receiver) handoff.Transport {
		srv, err := tcpx.NewServer(recv, tcpx.Insecure(), tcpx.Options{})
		require.NoError(b, err)
		return serveBench(b, srv, tcpx.Insecure())
	})
}

// BenchmarkHandoffTLS is BenchmarkHandoff over TLS 1.3 (AES-GCM where the
// CPU has it): what encrypting and authenticating the page bytes costs.
func BenchmarkHandoffTLS(b *testing.B) {
	cert, roots := testCert(b)
	benchkit.Handoff(b, func(recv *handoff.Receiver) handoff.Transport {
		srv, err := tcpx.NewServer(recv, tcpx.TLS(&tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13}), tcpx.Options{})
		require.NoError(b, err)
		return serveBench(b, srv, tcpx.TLS(&tls.Config{RootCAs: roots}))
	})
}

// BenchmarkTCPXStream is tcpx's share of BenchmarkHandoff, as
// BenchmarkGRPCStream is gRPC's (benchkit.Stream): the same bytes in
// frames laid out like the handoff's, sent as views and dropped by the
// server as they arrive; no manifest, no checksums, no decode pool, no
// scrub.
func BenchmarkTCPXStream(b *testing.B) {
	srv, err := tcpx.NewDrainServer(tcpx.Options{})
	require.NoError(b, err)
	benchkit.Stream(b, serveBench(b, srv, tcpx.Insecure()))
}

// serveBench serves srv on a loopback port and dials it with sec, both
// closed when the benchmark ends.
func serveBench(b *testing.B, srv *tcpx.Server, sec tcpx.Security) handoff.Transport {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	go srv.Serve(ln)
	b.Cleanup(func() { srv.Close() })
	tr, err := tcpx.Dial(ln.Addr().String(), sec, tcpx.Options{})
	require.NoError(b, err)
	b.Cleanup(func() { tr.Close() })
	return tr
}

// BenchmarkHandoffHybrid is BenchmarkHandoff of the incident's model: a
// miniature of glm-5.3-flash (benchkit.Hybrid: MLA latents and indexer
// keys per token, a 16.6 MiB Kimi Delta Attention state slot in 1 MiB
// parts), 82.6 MiB a handoff, every group checked on the decode side.
func BenchmarkHandoffHybrid(b *testing.B) {
	benchkit.HandoffOf(b, benchkit.Hybrid(), func(recv *handoff.Receiver) handoff.Transport {
		srv, err := tcpx.NewServer(recv, tcpx.Insecure(), tcpx.Options{})
		require.NoError(b, err)
		return serveBench(b, srv, tcpx.Insecure())
	})
}

// BenchmarkHandoffLayered is BenchmarkHandoff of a model's many regions
// (benchkit.Layered: 32 layers, 64 regions of 32 KiB pages, 256 MiB).
func BenchmarkHandoffLayered(b *testing.B) {
	benchkit.HandoffOf(b, benchkit.Layered, func(recv *handoff.Receiver) handoff.Transport {
		srv, err := tcpx.NewServer(recv, tcpx.Insecure(), tcpx.Options{})
		require.NoError(b, err)
		return serveBench(b, srv, tcpx.Insecure())
	})
}
