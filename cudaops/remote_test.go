package cudaops_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// Tensor parallelism with one process per rank: the scheduler's pool is
// over RemoteRanks, and each rank is a worker process of this test binary
// (TestRankWorkerProcess) serving its shard on the host backend, the
// CUDA backend over the simulated driver, or a real GPU.

// The geometry every rank's shard has: 2 layers × K/V, 16 pages of 128
// bytes; the pool's page is the ranks' shards side by side.
const (
	rankLayers    = 2
	rankPages     = 16
	rankShardSize = 128
)

// TestRankWorkerProcess is the worker, run in a child process: it does
// nothing in a plain test run.
func TestRankWorkerProcess(t *testing.T) {
	addr := os.Getenv("KVFENCE_RANK_ADDR")
	if addr == "" {
		t.Skip("the worker of the remote-rank tests, started by them")
	}
	rank, _ := strconv.Atoi(os.Getenv("KVFENCE_RANK"))
	var dev cudaops.Device
	switch os.Getenv("KVFENCE_RANK_BACKEND") {
	case "host":
		dev = cudaops.NewHost()
	case "fake":
		d, _, err := cudaops.OpenFake()
		require.NoError(t, err)
		dev = d
	case "gpu":
		dev = openGPU(t)
	}
	defer dev.Close()
	for range 2 * rankLayers {
		_, err := dev.AllocRegion(rankPages, rankShardSize)
		require.NoError(t, err)
	}
	conn, err := net.Dial("unix", addr)
	require.NoError(t, err)
	defer conn.Close()
	// A rank that dies when its n-th batch arrives: killed mid-fill, the
	// batch handed over and never reported.
	if n, _ := strconv.Atoi(os.Getenv("KVFENCE_RANK_DIE_ON_BATCH")); n > 0 {
		conn = &dyingConn{Conn: conn, fills: n}
	}
	// A rank that hangs on its n-th batch: alive, connected, silent.
	if n, _ := strconv.Atoi(os.Getenv("KVFENCE_RANK_HANG_ON_BATCH")); n > 0 {
		conn = &dyingConn{Conn: conn, fills: n, hang: true}
	}
	w, err := cudaops.ServeRank(conn, rank, dev, true)
	require.NoError(t, err)
	require.NoError(t, w.Wait())
}

// dyingConn ends the process as its n-th fill frame arrives.
type dyingConn struct {
	net.Conn
	fills int
	hang  bool
	buf   []byte
}

func (c *dyingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.buf = append(c.buf, b[:n]...)
	for len(c.buf) >= 5 {
		size := int(uint32(c.buf[0]) | uint32(c.buf[1])<<8 | uint32(c.buf[2])<<16 | uint32(c.buf[3])<<24)
		if len(c.buf) < 4+size {
			break
		}
		if c.buf[4] == 2 { // frameFill
			if c.fills--; c.fills == 0 {
				if c.hang {
					time.Sleep(time.Hour) // until the test ends it (select{} would be a detected deadlock)
				}
				os.Exit(3)
			}
		}
		c.buf = c.buf[4+size:]
	}
	return n, err
}

// startRanks starts n worker processes on backend and returns the
// scheduler's device over them; env adds variables for one rank.
func startRanks(t *testing.T, n int, backend string, env map[int][]string) *cudaops.RemoteRanks {
	return startRanksTimeout(t, n, backend, env, 5*time.Second)
}

func startRanksTimeout(t *testing.T, n int, backend string, env map[int][]string, report time.Duration) *cudaops.RemoteRanks {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvf-ranks")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	addr := filepath.Join(dir, "s")
	l, err := net.Listen("unix", addr)
	require.NoError(t, err)
	defer l.Close()
	var procs []*exec.Cmd
	for rank := range n {
		cmd := exec.Command(os.Args[0], "-test.run", "^TestRankWorkerProcess$", "-test.count=1")
		cmd.Env = append(os.Environ(), "KVFENCE_RANK_ADDR="+addr, fmt.Sprintf("KVFENCE_RANK=%d", rank), "KVFENCE_RANK_BACKEND="+backend)
		cmd.Env = append(cmd.Env, env[rank]...)
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		require.NoError(t, cmd.Start())
		procs = append(procs, cmd)
	}
	t.Cleanup(func() {
		for _, p := range procs {
			done := make(chan struct{})
			go func() { _ = p.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(2 * time.Second): // a hung rank is killed
				_ = p.Process.Kill()
				<-done
			}
		}
	})
	d, err := cudaops.ListenRanks(l, cudaops.RemoteConfig{Ranks: n, ReportTimeout: report, AcceptTimeout: 60 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = d.Close() })
	return d
}

func rankPool(t *testing.T, d cudaops.Device, ranks int) *kvcache.Pool {
	t.Helper()
	// fp32, 4 tokens per page, head dim 4: 64 bytes per head; each rank
	// holds 2 heads (128 bytes) of every layer's K and V.
	p, err := kvcache.New(kvcache.Config{
		Geometry:         kvcache.Geometry{TokensPerPage: 4, Layers: rankLayers, KVHeads: 2 * ranks, HeadDim: 4, DType: kvcache.FP32},
		Pages:            rankPages,
		MaxContextTokens: 64,
		Tenants:          []kvcache.TenantConfig{{Name: "acme"}, {Name: "globex"}},
		Scrub:            kvcache.ScrubPolicy{Kind: kvcache.ScrubCanary},
		Device:           d,
	})
	require.NoError(t, err)
	return p
}

// Pages of a tensor-parallel pool return to the free list only once every
// rank has scrubbed its shard: the canary audit of the next admission
// reads every rank's shard back.
func TestRemoteRanksScrubEveryShard(t *testing.T) {
	for _, backend := range []string{"host", "fake"} {
		t.Run(backend, func(t *testing.T) {
			const ranks = 3
			d := startRanks(t, ranks, backend, nil)
			p := rankPool(t, d, ranks)
			defer p.Close()
			for round := range 3 {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				l, err := p.Admit(ctx, kvcache.Request{ID: fmt.Sprint("r", round), Tenant: "acme", PromptTokens: 60})
				cancel()
				require.NoError(t, err)
				table, err := l.BlockTable()
				require.NoError(t, err)
				// The engine writes KV into every rank's shard.
				buf := make([]byte, d.Regions()[0].PageBytes)
				for i := range buf {
					buf[i] = byte(0x11 * (round + 1))
				}
				for r := range d.Regions() {
					require.NoError(t, d.WritePage(r, table[0], buf))
				}
				require.NoError(t, l.Release())
				ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
				l2, err := p.Admit(ctx, kvcache.Request{ID: fmt.Sprint("g", round), Tenant: "globex", PromptTokens: 60})
				cancel()
				require.NoError(t, err, "round %d: the canary audit over every rank", round)
				require.NoError(t, l2.Release())
				require.NoError(t, p.Check())
			}
			st := p.Stats()
			assert.Empty(t, st.Fault)
			assert.NotZero(t, st.Scrub.CanaryChecks)
			assert.Zero(t, st.Scrub.CanaryFailures)
			assert.Equal(t, uint64(ranks)*d.Counters().FillCalls, d.Counters().Launches)
		})
	}
}

// A worker killed while its fill is in flight never reports it: the
// pool must fault and retire the pages, not free them.
func TestRemoteRankKilledMidFillFreedPages(t *testing.T) {
	for _, backend := range []string{"host", "fake"} {
		t.Run(backend, func(t *testing.T) {
			const ranks = 3
			// Batch 1 is the pool's initial scrub; rank 1 dies on batch 2.
			d := startRanks(t, ranks, backend, map[int][]string{1: {"KVFENCE_RANK_DIE_ON_BATCH=2"}})
			p := rankPool(t, d, ranks)
			defer p.Close()
			l, err := p.TryAdmit(kvcache.Request{ID: "r", Tenant: "acme", PromptTokens: 60})
			require.NoError(t, err)
			leased := l.Pages()
			_ = l.Release() // the scrub's failure may come back here or later
			require.Eventually(t, func() bool { return p.Stats().Fault != "" }, 10*time.Second, time.Millisecond)
			st := p.Stats()
			assert.Contains(t, st.Fault, "rank 1 lost")
			assert.Equal(t, leased, st.RetiredPages, "the lease's pages")
			assert.Equal(t, rankPages-leased, st.FreePages, "a page was freed without every rank's report")
			require.NoError(t, p.Check())
			_, err = p.TryAdmit(kvcache.Request{ID: "r2", Tenant: "acme", PromptTokens: 4})
			require.ErrorIs(t, err, kvcache.ErrPoolFaulted)
		})
	}
}

// A worker that hangs (alive, connected, never reporting) is declared
// lost at the report deadline: the pool faults, the pages are retired.
func TestRemoteRankHungFreedPages(t *testing.T) {
	d := startRanksTimeout(t, 2, "host", map[int][]string{0: {"KVFENCE_RANK_HANG_ON_BATCH=2"}}, 300*time.Millisecond)
	p := rankPool(t, d, 2)
	defer p.Close()
	l, err := p.TryAdmit(kvcache.Request{ID: "r", Tenant: "acme", PromptTokens: 60})
	require.NoError(t, err)
	leased := l.Pages()
	_ = l.Release()
	require.Eventually(t, func() bool { return p.Stats().Fault != "" }, 10*time.Second, time.Millisecond)
	st := p.Stats()
	assert.Contains(t, st.Fault, "rank 0 did not report")
	assert.Equal(t, leased, st.RetiredPages)
	require.NoError(t, p.Check())
}

// TestRemoteRanksGPU runs two worker processes on GPU 0 (one GPU is
// enough to run the protocol for real). It skips without a GPU.
func TestRemoteRanksGPU(t *testing.T) {
	openGPU(t).Close()
	d := startRanks(t, 2, "gpu", nil)
	p := rankPool(t, d, 2)
	defer p.Close()
	l, err := p.TryAdmit(kvcache.Request{ID: "r", Tenant: "acme", PromptTokens: 60})
	require.NoError(t, err)
	require.NoError(t, l.Release())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err = p.Admit(ctx, kvcache.Request{ID: "g", Tenant: "globex", PromptTokens: 60})
	require.NoError(t, err)
	require.NoError(t, l.Release())
	assert.Empty(t, p.Stats().Fault)
	require.NoError(t, p.Check())
}

// Two ranks that hang on the same fill: the deadline that declares the
// first lost must declare the second lost too. (A fill used to wait for
// the second for ever, its deadline timer already spent on the first: the
// fence never completed and the pool neither faulted nor closed.)
func TestRemoteRanksTwoHungFreedPages(t *testing.T) {
	hang := []string{"KVFENCE_RANK_HANG_ON_BATCH=2"}
	d := startRanksTimeout(t, 3, "host", map[int][]string{0: hang, 1: hang}, 300*time.Millisecond)
	p := rankPool(t, d, 3)
	l, err := p.TryAdmit(kvcache.Request{ID: "r", Tenant: "acme", PromptTokens: 60})
	require.NoError(t, err)
	leased := l.Pages()
	_ = l.Release()
	faulted := assert.Eventually(t, func() bool { return p.Stats().Fault != "" }, 10*time.Second, time.Millisecond)
	if !faulted {
		_ = d.Close() // fail the fill, so that Close does not wait for it for ever
	}
	require.NoError(t, p.Close())
	if faulted {
		st := p.Stats()
		assert.Contains(t, st.Fault, "rank 0 did not report")
		assert.Equal(t, leased, st.RetiredPages)
	}
}
