package tcpx_test

import (
	"net"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/conformance"
	"github.com/kvfence/kvfence/handoff/tcpx"
)

// TestConformance runs the handoff conformance suite over tcpx, plain
// TCP on loopback.
func TestConformance(t *testing.T) {
	conformance.Run(t, conformance.Harness{
		Serve: func(t testing.TB, recv *handoff.Receiver) conformance.Server {
			srv, err := tcpx.NewServer(recv, tcpx.Insecure(), tcpx.Options{})
			require.NoError(t, err)
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			go srv.Serve(ln)
			t.Cleanup(func() { srv.Close() })
			return tcpxServer{srv, ln.Addr().String()}
		},
		Cut: func(st handoff.Stream) {
			raw := tcpx.RawConn(st).(*net.TCPConn)
			raw.SetLinger(0) // close with a reset
			raw.Close()
		},
	})
}

type tcpxServer struct {
	srv  *tcpx.Server
	addr string
}

func (s tcpxServer) Dial(t testing.TB) handoff.Transport {
	return dial(t, s.addr, tcpx.Insecure(), tcpx.Options{})
}

func (s tcpxServer) Close() error { return s.srv.Close() }
