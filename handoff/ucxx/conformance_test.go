//go:build cgo && ucx

package ucxx_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/conformance"
	"github.com/kvfence/kvfence/handoff/ucxx"
)

// TestConformance runs the handoff conformance suite over ucxx, on the
// transports UCX_TLS names (scripts/ci-ucx.sh runs it over TCP and over
// shared memory): the pages are written into the decode pool's memory,
// by rendezvous over TCP and by UCX's puts over shared memory.
func TestConformance(t *testing.T) {
	conformance.Run(t, harness(ucxx.Options{}))
}

// TestConformanceMessages is TestConformance with the pages sent as
// active messages (ucxx.PathMessages), the path a decode pool whose
// memory cannot be lent takes.
func TestConformanceMessages(t *testing.T) {
	conformance.Run(t, harness(ucxx.Options{DataPath: ucxx.PathMessages}))
}

func harness(opts ucxx.Options) conformance.Harness {
	return conformance.Harness{
		Serve: func(t testing.TB, recv *handoff.Receiver) conformance.Server {
			srv, err := ucxx.NewServer(recv, opts)
			require.NoError(t, err)
			t.Cleanup(func() { srv.Close() })
			addr, err := srv.Listen("127.0.0.1:0")
			require.NoError(t, err)
			return ucxServer{srv, addr}
		},
		Cut: ucxx.Cut,
	}
}

type ucxServer struct {
	srv  *ucxx.Server
	addr string
}

func (s ucxServer) Dial(t testing.TB) handoff.Transport {
	tr, err := ucxx.Dial(s.addr, ucxx.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { tr.Close() })
	return tr
}

func (s ucxServer) Close() error { return s.srv.Close() }
