package grpcx_test

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/grpcx"
	"github.com/kvfence/kvfence/handoff/internal/conformance"
)

// TestConformance runs the handoff conformance suite over grpcx, plain
// gRPC on loopback.
func TestConformance(t *testing.T) {
	conformance.Run(t, conformance.Harness{
		Serve: func(t testing.TB, recv *handoff.Receiver) conformance.Server {
			srv, err := grpcx.NewServer(recv, insecure.NewCredentials())
			require.NoError(t, err)
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			go srv.Serve(ln)
			t.Cleanup(srv.Stop)
			return grpcServer{srv, ln.Addr().String()}
		},
	})
}

type grpcServer struct {
	srv  *grpc.Server
	addr string
}

func (s grpcServer) Dial(t testing.TB) handoff.Transport {
	tr, err := grpcx.Dial(s.addr, insecure.NewCredentials())
	require.NoError(t, err)
	t.Cleanup(func() { tr.Close() })
	return tr
}

func (s grpcServer) Close() error {
	s.srv.Stop()
	return nil
}
