//go:build cgo && ucx

package ucxx_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/benchkit"
	"github.com/kvfence/kvfence/handoff/ucxx"
)

// BenchmarkHandoff is tcpx's BenchmarkHandoff over ucxx (benchkit.Handoff:
// the same workload, checks and raw TCP baseline after each handoff),
// over the transports UCX_TLS names.
func BenchmarkHandoff(b *testing.B) {
	benchkit.Handoff(b, func(recv *handoff.Receiver) handoff.Transport {
		srv, err := ucxx.NewServer(recv, ucxx.Options{})
		require.NoError(b, err)
		b.Cleanup(func() { srv.Close() })
		addr, err := srv.Listen("127.0.0.1:0")
		require.NoError(b, err)
		tr, err := ucxx.Dial(addr, ucxx.Options{})
		require.NoError(b, err)
		b.Cleanup(func() { tr.Close() })
		return tr
	})
}
