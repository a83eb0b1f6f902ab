//go:build cgo && ucx

package ucxx_test

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/benchkit"
	"github.com/kvfence/kvfence/handoff/ucxx"
)

// BenchmarkHandoff is tcpx's BenchmarkHandoff over ucxx (benchkit.Handoff:
// the same workload, a 256 MiB prompt, the same checks and the raw TCP
// copy after each handoff), over the transports UCX_TLS names: export,
// manifest, the grant, the pages written into the decode pool's memory
// chunk by chunk (summed on both sides), the seal, the ack, the release
// of the prefill pages. After each handoff, beside the TCP copy, UCX's
// own put bandwidth over the same transports: ucx_perftest's ucp_put_bw
// between two processes, one message of the transfer's size
// (perftest-GB/s, x-perftest), and 4 MiB messages, the size of the
// handoff's chunks (perftest-4MiB-GB/s, x-perftest-4MiB), with UCX
// configured as this package configures it.
func BenchmarkHandoff(b *testing.B) {
	benchkit.Handoff(b, connect(b), perftest("perftest", 0), perftest("perftest-4MiB", 4<<20))
}

// connect returns benchkit's connect over ucxx: a server on loopback and
// a transport dialled to it, both closed when b ends.
func connect(b *testing.B) func(recv *handoff.Receiver) handoff.Transport {
	return func(recv *handoff.Receiver) handoff.Transport {
		srv, err := ucxx.NewServer(recv, ucxx.Options{})
		require.NoError(b, err)
		b.Cleanup(func() { srv.Close() })
		addr, err := srv.Listen("127.0.0.1:0")
		require.NoError(b, err)
		tr, err := ucxx.Dial(addr, ucxx.Options{})
		require.NoError(b, err)
		b.Cleanup(func() { tr.Close() })
		return tr
	}
}

// perftest is ucx_perftest's ucp_put_bw between two processes over the
// transports UCX_TLS names, as a reference of benchkit.Handoff's: msg
// bytes a message (0: one message of the transfer's size), as many as
// make the transfer's bytes, after one of warm-up. Without ucx_perftest
// the benchmark is skipped.
func perftest(name string, msg int64) benchkit.Reference {
	return benchkit.Reference{Name: name, Run: func(b *testing.B, size int64) float64 {
		if _, err := exec.LookPath("ucx_perftest"); err != nil {
			b.Skip("no ucx_perftest (Debian's ucx-utils)")
		}
		if msg == 0 {
			msg = size
		}
		iters := max(1, size/msg)
		var err error
		for try := 0; try < 5; try++ {
			var gbps float64
			if gbps, err = perftestOnce(msg, iters); err == nil {
				return gbps
			}
		}
		b.Fatalf("ucx_perftest: %v", err)
		return 0
	}}
}

// perftestOnce runs one ucx_perftest server and client and returns the
// client's overall put bandwidth in GB/s.
func perftestOnce(msg, iters int64) (float64, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0") // a free port
	if err != nil {
		return 0, err
	}
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	ln.Close()
	args := []string{"-p", port, "-t", "ucp_put_bw", "-s", strconv.FormatInt(msg, 10),
		"-n", strconv.FormatInt(iters, 10), "-w", "1"}
	// UCX configured as this package configures it (shim.c): TCP's
	// segments at 1M and shared memory's at 32K unless the environment
	// sizes them.
	env := os.Environ()
	if os.Getenv("UCX_TCP_TX_SEG_SIZE") == "" && os.Getenv("UCX_TCP_RX_SEG_SIZE") == "" && tlsMayUse("tcp") {
		env = append(env, "UCX_TCP_TX_SEG_SIZE=1M", "UCX_TCP_RX_SEG_SIZE=1M")
	}
	if os.Getenv("UCX_MM_SEG_SIZE") == "" && tlsMayUse("sm", "shm", "posix", "sysv") {
		env = append(env, "UCX_MM_SEG_SIZE=32K")
	}
	srv := exec.Command("ucx_perftest", args...)
	srv.Env = env
	if err := srv.Start(); err != nil {
		return 0, err
	}
	defer func() {
		srv.Process.Kill()
		srv.Wait()
	}()
	time.Sleep(200 * time.Millisecond) // for the server to listen
	cli := exec.Command("ucx_perftest", append([]string{"127.0.0.1"}, args...)...)
	cli.Env = env
	out, err := cli.CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("%w: %s", err, out)
	}
	// "Final: iters p50 avg overall bw-avg bw-overall mr-avg mr-overall",
	// bandwidths in MiB/s (ucx_perftest's MB/s).
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) >= 7 && f[0] == "Final:" {
			mibps, err := strconv.ParseFloat(f[6], 64)
			if err != nil {
				return 0, fmt.Errorf("ucx_perftest said %q: %w", line, err)
			}
			return mibps * (1 << 20) / 1e9, nil
		}
	}
	return 0, fmt.Errorf("no Final line in %s", out)
}

// tlsMayUse is shim.c's tls_may_use: whether UCX_TLS lets UCX use a
// transport any of names selects.
func tlsMayUse(names ...string) bool {
	tls := os.Getenv("UCX_TLS")
	if tls == "" {
		return true
	}
	named := false
	for _, n := range names {
		named = named || strings.Contains(tls, n)
	}
	if tls[0] == '^' {
		return !named
	}
	return named || strings.Contains(tls, "all")
}

// BenchmarkHandoffLayered is BenchmarkHandoff of a model's many regions
// (benchkit.Layered: 32 layers, 64 regions of 32 KiB pages, 256 MiB):
// each chunk's writes are a put per region.
func BenchmarkHandoffLayered(b *testing.B) {
	benchkit.HandoffOf(b, benchkit.Layered, connect(b))
}

// BenchmarkHandoffHybrid is BenchmarkHandoff of the incident's model
// (benchkit.Hybrid: a miniature of glm-5.3-flash, every group).
func BenchmarkHandoffHybrid(b *testing.B) {
	benchkit.HandoffOf(b, benchkit.Hybrid(), connect(b))
}
