//go:build cgo && ucx

package ucxx_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/benchkit"
	"github.com/kvfence/kvfence/handoff/ucxx"
)

// BenchmarkPut is the transport's share of a handoff over remote memory:
// 256 MiB written into memory the server exposed, in chunks of a given
// size, each chunk's writes waited for before the next one's are posted
// but one (as the handoff's sender does); no checksums, no pools;
// cpu-ms/op is the process's CPU time (both ends) per 256 MiB. What
// ucx_perftest's ucp_put_bw measures, through this package.
func BenchmarkPut(b *testing.B) {
	const size = 256 << 20
	for _, chunk := range []int{1 << 20, 4 << 20, 32 << 20} {
		b.Run(fmt.Sprintf("chunk=%dMiB", chunk>>20), func(b *testing.B) {
			mem := cudaops.NewHost()
			defer mem.Close()
			for range 2 {
				_, err := mem.AllocRegion(1, size)
				require.NoError(b, err)
			}
			src, dst := mem.PageBytes(0, 0), mem.PageBytes(1, 0)
			for i := range src {
				src[i] = byte(i)
			}
			clear(dst)
			srv, err := ucxx.NewRawServer(func(ctx context.Context, ep handoff.Endpoint) error {
				me := ep.(handoff.MemoryEndpoint)
				desc, revoke, err := me.ExposeMemory([][]byte{dst})
				if err != nil {
					return err
				}
				if err := ep.Send(desc); err != nil {
					revoke()
					return err
				}
				for {
					if _, err := ep.Recv(); err != nil {
						revoke()
						return nil
					}
				}
			}, ucxx.Options{})
			require.NoError(b, err)
			defer srv.Close()
			addr, err := srv.Listen("127.0.0.1:0")
			require.NoError(b, err)
			tr, err := ucxx.Dial(addr, ucxx.Options{})
			require.NoError(b, err)
			defer tr.Close()
			st, err := tr.Open(context.Background())
			require.NoError(b, err)
			defer st.Close()
			desc, err := st.Recv()
			require.NoError(b, err)
			w, err := st.(handoff.MemoryStream).OpenRemote(desc, []int64{size})
			require.NoError(b, err)
			b.Log(ucxx.Lanes(st))
			b.SetBytes(size)
			b.ResetTimer()
			start := time.Now()
			cpu0, _ := benchkit.ProcessCPU()
			for range b.N {
				var waits []func() error
				for off := 0; off < size; off += chunk {
					wait, err := w.Write([]handoff.RemotePut{{Mem: 0, Off: int64(off), Src: [][]byte{src[off : off+chunk]}}})
					require.NoError(b, err)
					waits = append(waits, wait)
					if len(waits) > 1 {
						require.NoError(b, waits[0]())
						waits = waits[1:]
					}
				}
				for _, wait := range waits {
					require.NoError(b, wait())
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(size)*float64(b.N)/time.Since(start).Seconds()/1e9, "GB/s")
			if cpu1, ok := benchkit.ProcessCPU(); ok {
				b.ReportMetric(float64((cpu1-cpu0).Microseconds())/1e3/float64(b.N), "cpu-ms/op")
			}
			require.Equal(b, src[size-10:], dst[size-10:])
		})
	}
}
