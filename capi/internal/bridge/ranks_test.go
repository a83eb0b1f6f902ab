package bridge

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// The scheduler's pool over remote ranks and the rank workers, in one
// process: every rank worker here is a bridge worker over a host device
// whose shard memory the test owns (adopted), so the test can play the
// engine (write KV into the shard) and look at what the scrub left.

// Each rank holds 2 regions (layer 0's K and V) of 16 pages of 128 bytes:
// 2 fp32 heads of dim 4, 4 tokens per page.
const (
	rankPages     = 16
	rankPageBytes = 128
	rankRegions   = 2
)

func rankPoolConfig(listen string, ranks int, reportMS int64) string {
	return fmt.Sprintf(`{"geometry": {"tokens_per_page": 4, "layers": 1, "kv_heads": %d, "head_dim": 4, "dtype": "fp32"},
	 "pages": %d, "max_context_tokens": 64, "tenants": [{"name": "acme"}, {"name": "globex"}],
	 "scrub": {"kind": "canary"},
	 "device": {"kind": "remote", "listen": "unix:%s", "ranks": %d, "report_timeout_ms": %d, "accept_timeout_ms": 20000}}`,
		2*ranks, rankPages, listen, ranks, reportMS)
}

// socketPath is a Unix socket path short enough for sun_path (108 bytes).
func socketPath(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvfr")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "s")
}

// shard is one rank's memory: rankRegions regions the test owns.
type shard [][]byte

func newShard() shard {
	s := make(shard, rankRegions)
	for i := range s {
		s[i] = make([]byte, rankPages*rankPageBytes)
	}
	return s
}

func (s shard) regions() []RankRegion {
	rs := make([]RankRegion, len(s))
	for i, mem := range s {
		rs[i] = RankRegion{Base: 1, Stride: rankPageBytes, PageBytes: rankPageBytes, Pages: rankPages, Host: mem}
	}
	return rs
}

func (s shard) page(r int, p int32) []byte {
	return s[r][int(p)*rankPageBytes : int(p+1)*rankPageBytes]
}

// uniformWord returns the word page p holds in every region, and false if
// it holds anything else.
func (s shard) uniformWord(p int32) (uint32, bool) {
	w := binary.LittleEndian.Uint32(s.page(0, p))
	for r := range s {
		b := s.page(r, p)
		for off := 0; off < len(b); off += 4 {
			if binary.LittleEndian.Uint32(b[off:]) != w {
				return 0, false
			}
		}
	}
	return w, true
}

func rankConfig(addr string, rank int, extra string) RankConfig {
	cfg, err := ParseRankConfig([]byte(fmt.Sprintf(`{"connect": "unix:%s", "rank": %d, "connect_timeout_ms": 20000%s}`, addr, rank, extra)))
	if err != nil {
		panic(err)
	}
	return cfg
}

// rankGroup creates the scheduler's pool and a worker per shard, the
// workers first (they wait for the scheduler to listen, as a worker
// process started before its scheduler does).
func rankGroup(t *testing.T, shards []shard, reportMS int64, workerExtra string) (pool Handle, ws []Handle) {
	t.Helper()
	addr := socketPath(t)
	type made struct {
		h   Handle
		err error
	}
	results := make(chan made, len(shards))
	for rank, s := range shards {
		go func() {
			h, err := CreateRankWorker(rankConfig(addr, rank, workerExtra), s.regions())
			results <- made{h, err}
		}()
	}
	pool, err := CreatePool([]byte(rankPoolConfig(addr, len(shards), reportMS)))
	if err != nil {
		t.Fatal(err)
	}
	// The workers were made concurrently: order their handles by rank.
	ws = make([]Handle, len(shards))
	for range shards {
		m := <-results
		if m.err != nil {
			t.Fatal(m.err)
		}
		e, err := lookupWorker(m.h)
		if err != nil {
			t.Fatal(err)
		}
		ws[e.rank] = m.h
	}
	t.Cleanup(func() {
		DestroyPool(pool)
		for _, h := range ws {
			CloseRankWorker(h)
		}
	})
	return pool, ws
}

func poolStats(t *testing.T, h Handle) StatsDoc {
	t.Helper()
	js, err := StatsJSON(h)
	if err != nil {
		t.Fatal(err)
	}
	var doc StatsDoc
	if err := json.Unmarshal(js, &doc); err != nil {
		t.Fatal(err)
	}
	return doc
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// stepArrived steps w until it has launched the batch the scheduler just
// handed over (it reaches the worker asynchronously) and fails if a step
// launched more than one.
func stepArrived(t *testing.T, w Handle) {
	t.Helper()
	eventually(t, "the batch to arrive", func() bool {
		n, err := RankStep(w, cudaops.Ordering{Stream: cudaops.StreamLegacy})
		if err != nil || n > 1 {
			t.Fatalf("step: %d batches, %v", n, err)
		}
		return n == 1
	})
}

// TestRankInitialScrubNeedsNoStep: the scheduler's pool creation waits
// for every rank to report the initial scrub. A worker in step mode must
// serve it before its engine ever steps (nothing could step it: the engine
// waits for the pool), or the pool would never be created.
func TestRankInitialScrubNeedsNoStep(t *testing.T) {
	shards := []shard{newShard(), newShard()}
	for _, s := range shards {
		for r := range s {
			for i := range s[r] {
				s[r][i] = 0xEE // an earlier user's data in the adopted memory
			}
		}
	}
	pool, _ := rankGroup(t, shards, 5000, "")
	for rank, s := range shards {
		for p := range int32(rankPages) {
			if w, ok := s.uniformWord(p); !ok || w == 0xEEEEEEEE {
				t.Fatalf("rank %d page %d not scrubbed: word %#x, uniform %v", rank, p, w, ok)
			}
		}
	}
	if st := poolStats(t, pool); st.FreePages != rankPages || st.Device != "remote[2 ranks]" {
		t.Fatalf("stats %+v", st)
	}
	mustCheck(t, pool)
}

// TestRankPagesFreeOnlyAfterEveryRankStepped: after its first step a
// worker launches a released lease's scrub only at its next step, and the
// pages stay quarantined until the last rank has stepped and reported;
// then the canary audit of the next admission reads every rank's shard.
func TestRankPagesFreeOnlyAfterEveryRankStepped(t *testing.T) {
	shards := []shard{newShard(), newShard(), newShard()}
	pool, ws := rankGroup(t, shards, 5000, "")
	for _, w := range ws {
		if n, err := RankStep(w, cudaops.Ordering{}); err != nil || n != 0 {
			t.Fatalf("step before any batch: %d, %v", n, err)
		}
	}
	l := must(Admit(pool, "r", "acme", 60, 0, 0))
	table := make([]int32, 16)
	n, err := BlockTable(l, table)
	if err != nil {
		t.Fatal(err)
	}
	table = table[:n]
	for _, s := range shards { // the engine writes KV into every rank's shard
		for r := range s {
			for _, p := range table {
				copy(s.page(r, p), strings.Repeat("secret! ", rankPageBytes/8))
			}
		}
	}
	noErr(t, Release(l, cudaops.Ordering{Stream: cudaops.StreamLegacy}))
	for rank, w := range ws {
		time.Sleep(20 * time.Millisecond) // time for a report that must not come
		if st := poolStats(t, pool); st.QuarantinedPages != n || st.FreePages != rankPages-n {
			t.Fatalf("before rank %d stepped: %d quarantined, %d free; want %d, %d", rank, st.QuarantinedPages, st.FreePages, n, rankPages-n)
		}
		if _, ok := shards[rank].uniformWord(table[0]); ok {
			t.Fatalf("rank %d scrubbed before its step", rank)
		}
		stepArrived(t, w)
		for _, p := range table {
			if _, ok := shards[rank].uniformWord(p); !ok {
				t.Fatalf("rank %d page %d still holds KV after its step", rank, p)
			}
		}
	}
	eventually(t, "the pages to be free", func() bool { return poolStats(t, pool).FreePages == rankPages })
	l = must(Admit(pool, "g", "globex", 64, 0, 0)) // every page: the canary audit reads every rank's shard
	st := poolStats(t, pool)
	if st.Scrub.CanaryChecks < rankPages || st.Scrub.CanaryFailures != 0 || st.Fault != "" {
		t.Fatalf("audit: %+v, fault %q", st.Scrub, st.Fault)
	}
	noErr(t, Free(l))
	for _, w := range ws {
		stepArrived(t, w)
	}
	eventually(t, "the pages to be free", func() bool { return poolStats(t, pool).FreePages == rankPages })
	mustCheck(t, pool)
}

// TestRankShardWrittenAfterScrubFaultsPool: a rank's engine that writes a
// freed page after the scrub (a kernel outliving its request) is caught
// by the canary audit, whichever rank's shard it wrote.
func TestRankShardWrittenAfterScrubFaultsPool(t *testing.T) {
	shards := []shard{newShard(), newShard(), newShard()}
	pool, _ := rankGroup(t, shards, 5000, `, "auto_step": true`)
	shards[2].page(1, 5)[17] ^= 0x40 // rank 2, region 1 (V), page 5
	_, err := Admit(pool, "g", "globex", 64, 0, 0)
	wantStatus(t, err, StatusPoolFaulted)
	if !errors.Is(err, kvcache.ErrCanaryMismatch) {
		t.Fatalf("%v: not a canary mismatch", err)
	}
	st := poolStats(t, pool)
	if st.RetiredPages != 1 || st.Fault == "" || !strings.Contains(st.Fault, "page 5") {
		t.Fatalf("retired %d, fault %q", st.RetiredPages, st.Fault)
	}
	mustCheck(t, pool)
}

// TestRankWorkerClosedMidFillFaultsPool: a worker that leaves while the
// scheduler waits for its report (a worker killed mid-fill) fails the
// fill: the pages are retired, never freed, and the pool faults.
func TestRankWorkerClosedMidFillFaultsPool(t *testing.T) {
	shards := []shard{newShard(), newShard()}
	pool, ws := rankGroup(t, shards, 5000, "")
	for _, w := range ws {
		must(RankStep(w, cudaops.Ordering{}))
	}
	l := must(Admit(pool, "r", "acme", 60, 0, 0))
	noErr(t, Release(l, cudaops.Ordering{}))
	stepArrived(t, ws[0])
	noErr(t, CloseRankWorker(ws[1]))
	eventually(t, "the pool to fault", func() bool { return poolStats(t, pool).Fault != "" })
	st := poolStats(t, pool)
	if !strings.Contains(st.Fault, "rank 1 lost") || st.RetiredPages != 15 || st.FreePages != rankPages-15 {
		t.Fatalf("fault %q, %d retired, %d free", st.Fault, st.RetiredPages, st.FreePages)
	}
	mustCheck(t, pool)
	_, err := Admit(pool, "r2", "acme", 4, 0, 0)
	wantStatus(t, err, StatusPoolFaulted)
	_, err = RankStep(ws[1], cudaops.Ordering{})
	wantStatus(t, err, StatusInvalidHandle)
}

// TestRankSchedulerGoneIsAnError: once the scheduler's pool is destroyed
// the worker's wait returns and its step fails, rather than serving
// nothing for ever.
func TestRankSchedulerGoneIsAnError(t *testing.T) {
	pool, ws := rankGroup(t, []shard{newShard()}, 5000, "")
	if ended, err := RankWait(ws[0], 0); ended || err != nil {
		t.Fatalf("wait on a live group: %v, %v", ended, err)
	}
	start := time.Now()
	if ended, err := RankWait(ws[0], 30*time.Millisecond); ended || err != nil || time.Since(start) < 30*time.Millisecond {
		t.Fatalf("wait 30 ms on a live group: %v, %v after %v", ended, err, time.Since(start))
	}
	_, err := RankWait(ws[0], -time.Millisecond)
	wantStatus(t, err, StatusInvalidArgument)
	noErr(t, DestroyPool(pool))
	if ended, err := RankWait(ws[0], 10*time.Second); !ended || err != nil {
		t.Fatalf("wait after the pool's destruction: %v, %v", ended, err)
	}
	_, err = RankStep(ws[0], cudaops.Ordering{})
	wantStatus(t, err, StatusPoolClosed)
	noErr(t, CloseRankWorker(ws[0]))
	wantStatus(t, CloseRankWorker(ws[0]), StatusInvalidHandle)
	_, err = RankWait(ws[0], 0)
	wantStatus(t, err, StatusInvalidHandle)
}

// fakeScheduler accepts one rank on a Unix socket and hands its
// connection to the test, after reading the hello.
func fakeScheduler(t *testing.T) (addr string, conn <-chan net.Conn) {
	t.Helper()
	addr = socketPath(t)
	l, err := net.Listen("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan net.Conn, 1)
	go func() {
		defer l.Close()
		c, err := l.Accept()
		if err != nil {
			close(ch)
			return
		}
		hello := make([]byte, 5+12+16*rankRegions)
		if _, err := c.Read(hello); err != nil {
			c.Close()
			close(ch)
			return
		}
		ch <- c
	}()
	t.Cleanup(func() { l.Close() })
	return addr, ch
}

// TestRankBrokenConnectionIsDeviceFailure: a scheduler that sends what no
// kvfence scheduler sends (here a frame of length 0) ends the rank with an
// error (KVF_ERR_DEVICE_FAILED), not an orderly close.
func TestRankBrokenConnectionIsDeviceFailure(t *testing.T) {
	addr, conns := fakeScheduler(t)
	s := newShard()
	w, err := CreateRankWorker(rankConfig(addr, 0, ""), s.regions())
	if err != nil {
		t.Fatal(err)
	}
	defer CloseRankWorker(w)
	c := <-conns
	if c == nil {
		t.Fatal("no connection")
	}
	defer c.Close()
	if _, err := c.Write([]byte{0, 0, 0, 0, 0}); err != nil {
		t.Fatal(err)
	}
	ended, err := RankWait(w, 10*time.Second)
	if !ended {
		t.Fatal("the rank did not notice")
	}
	wantStatus(t, err, StatusDeviceFailed)
	_, err = RankStep(w, cudaops.Ordering{})
	wantStatus(t, err, StatusDeviceFailed)
}

func TestRankWorkerRefusals(t *testing.T) {
	s := newShard()
	good := s.regions()
	cfg := rankConfig(socketPath(t), 0, `, "connect_timeout_ms": 50`)
	for _, c := range []struct {
		name    string
		regions []RankRegion
		want    Status
		msg     string
	}{
		{"no regions", nil, StatusInvalidArgument, "n_regions 0"},
		{"page size", []RankRegion{{PageBytes: 6, Pages: 4}}, StatusInvalidArgument, "multiple of 4"},
		{"no pages", []RankRegion{{PageBytes: 8}}, StatusInvalidArgument, "0 pages"},
		{"allocated with a stride", []RankRegion{{PageBytes: 8, Stride: 16, Pages: 4}}, StatusInvalidArgument, "stride = page_bytes"},
		{"short adopted memory", []RankRegion{{Base: 1, PageBytes: 8, Stride: 8, Pages: 4, Host: make([]byte, 31)}}, StatusInternal, "31 bytes"},
		{"no scheduler", good, StatusNoDevice, "no scheduler at unix:"},
	} {
		start := time.Now()
		h, err := CreateRankWorker(cfg, c.regions)
		if h != 0 || Classify(err).Status != c.want || !strings.Contains(fmt.Sprint(err), c.msg) {
			t.Errorf("%s: handle %d, %v (%v), want %v with %q", c.name, h, err, Classify(err).Status, c.want, c.msg)
		}
		if c.want == StatusNoDevice && time.Since(start) < 50*time.Millisecond {
			t.Errorf("gave up on the scheduler after %v, before connect_timeout_ms", time.Since(start))
		}
	}
	for _, h := range []Handle{0, 1 << 60} {
		_, err := RankStep(h, cudaops.Ordering{})
		wantStatus(t, err, StatusInvalidHandle)
		_, err = RankWait(h, 0)
		wantStatus(t, err, StatusInvalidHandle)
		_, err = RankRegions(h, 0)
		wantStatus(t, err, StatusInvalidHandle)
		wantStatus(t, CloseRankWorker(h), StatusInvalidHandle)
	}
	pool := newTestPool(t)
	_, err := RankStep(pool, cudaops.Ordering{})
	wantStatus(t, err, StatusInvalidHandle) // a pool is not a rank worker
}

func TestRankRegions(t *testing.T) {
	addr, conns := fakeScheduler(t)
	w, err := CreateRankWorker(rankConfig(addr, 0, ""), []RankRegion{{PageBytes: 64, Pages: 8}, {PageBytes: 64, Pages: 8}})
	if err != nil {
		t.Fatal(err)
	}
	defer CloseRankWorker(w)
	if c := <-conns; c != nil {
		defer c.Close()
	}
	rs, err := RankRegions(w, 1)
	wantStatus(t, err, StatusBufferTooSmall)
	if rs != nil || Classify(err).Need != 2 {
		t.Fatalf("short: %v, need %d", rs, Classify(err).Need)
	}
	if rs, err = RankRegions(w, 2); err != nil || len(rs) != 2 || rs[1].Base == 0 ||
		rs[1] != (cudaops.Region{Base: rs[1].Base, Stride: 64, PageBytes: 64, Pages: 8}) {
		t.Fatalf("regions %v, %v", rs, err)
	}
}

func TestParseRankConfig(t *testing.T) {
	cfg, err := ParseRankConfig([]byte(`{"connect": "tcp:127.0.0.1:7070", "rank": 3, "device": {"kind": "cuda", "ordinal": 1}, "auto_step": true, "connect_timeout_ms": 1500}`))
	if err != nil {
		t.Fatal(err)
	}
	want := RankConfig{Network: "tcp", Address: "127.0.0.1:7070", Rank: 3, Device: DeviceJSON{Kind: DeviceCUDA, Ordinal: 1},
		AutoStep: true, ConnectTimeout: 1500 * time.Millisecond}
	if cfg != want {
		t.Fatalf("%+v, want %+v", cfg, want)
	}
	if cfg := must(ParseRankConfig([]byte(`{"connect": "unix:/run/kvf.sock", "rank": 0}`))); cfg.Device.Kind != DeviceHost || cfg.ConnectTimeout != defaultConnectTimeout {
		t.Fatalf("defaults: %+v", cfg)
	}
	for _, c := range []struct{ js, msg string }{
		{`{"connect": "unix:/s"}`, "rank missing"},
		{`{"connect": "unix:/s", "rank": -1}`, "rank -1"},
		{`{"connect": "unix:/s", "rank": 4096}`, "rank 4096"},
		{`{"rank": 0}`, "connect missing"},
		{`{"connect": "/tmp/s", "rank": 0}`, `want "unix:PATH"`},
		{`{"connect": "http://x", "rank": 0}`, `want "unix:PATH"`},
		{`{"connect": "unix:", "rank": 0}`, "no path"},
		{`{"connect": "tcp:localhost", "rank": 0}`, "missing port"},
		{`{"connect": "unix:/s", "rank": 0, "connect_timeout_ms": -1}`, "connect_timeout_ms -1"},
		{`{"connect": "unix:/s", "rank": 0, "device": {"kind": "remote"}}`, `device.kind "remote"`},
		{`{"connect": "unix:/s", "rank": 0, "device": {"kind": "host", "ranks": 2}}`, `are for kind "remote"`},
		{`{"connect": "unix:/s", "rank": 0, "colour": 1}`, `unknown field "colour"`},
		{`{"connect": "unix:/s", "rank": 0} {}`, "trailing data"},
		{`[]`, "rank worker config"},
	} {
		_, err := ParseRankConfig([]byte(c.js))
		if !errors.Is(err, kvcache.ErrInvalidConfig) || !strings.Contains(fmt.Sprint(err), c.msg) {
			t.Errorf("%s: %v, want ErrInvalidConfig with %q", c.js, err, c.msg)
		}
	}
}

func TestParseRemoteDevice(t *testing.T) {
	pool := func(dev string) string {
		return `{"geometry": {"tokens_per_page": 4, "layers": 1, "kv_heads": 2, "head_dim": 4, "dtype": "fp32"}, "pages": 4, "max_context_tokens": 16, "device": ` + dev + `}`
	}
	_, dev, err := parseConfig([]byte(pool(`{"kind": "remote", "listen": "tcp:[::1]:9000", "ranks": 8, "report_timeout_ms": 100, "accept_timeout_ms": 200}`)))
	if err != nil || dev != (DeviceJSON{Kind: DeviceRemote, Listen: "tcp:[::1]:9000", Ranks: 8, ReportTimeoutMS: 100, AcceptTimeoutMS: 200}) {
		t.Fatalf("%+v, %v", dev, err)
	}
	cache := `{"cache": {"groups": [{"name": "kv", "kind": "per_token", "tokens_per_page": 4, "regions": [{"name": "k", "dtype": "fp16", "page_bytes": 64}]}]},
	 "pages": 4, "max_context_tokens": 16, "device": {"kind": "remote", "listen": "unix:/s", "ranks": 2}}`
	if _, _, err := parseConfig([]byte(cache)); !errors.Is(err, kvcache.ErrInvalidConfig) || !strings.Contains(err.Error(), "takes a geometry") {
		t.Errorf("a cache spec over remote ranks: %v", err)
	}
	for _, c := range []struct{ dev, msg string }{
		{`{"kind": "remote", "ranks": 2}`, "device.listen missing"},
		{`{"kind": "remote", "listen": "unix:/s"}`, "ranks 0"},
		{`{"kind": "remote", "listen": "unix:/s", "ranks": 5000}`, "ranks 5000"},
		{`{"kind": "remote", "listen": "unix:/s", "ranks": 2, "ordinal": 1}`, "ordinal 1 for a remote group"},
		{`{"kind": "remote", "listen": "unix:/s", "ranks": 2, "report_timeout_ms": -1}`, "report_timeout_ms -1"},
		{`{"kind": "remote", "listen": "unix:/s", "ranks": 2, "accept_timeout_ms": -1}`, "accept_timeout_ms -1"},
		{`{"kind": "cuda", "listen": "unix:/s"}`, `are for kind "remote"`},
		{`{"kind": "tpu"}`, `want "host", "cuda" or "remote"`},
	} {
		_, _, err := parseConfig([]byte(pool(c.dev)))
		if !errors.Is(err, kvcache.ErrInvalidConfig) || !strings.Contains(fmt.Sprint(err), c.msg) {
			t.Errorf("%s: %v, want ErrInvalidConfig with %q", c.dev, err, c.msg)
		}
	}
}

// TestRemotePoolWithoutRanks: a scheduler whose ranks never come gives up
// at accept_timeout_ms with KVF_ERR_NO_DEVICE, and leaves no socket file
// behind to refuse its next attempt.
func TestRemotePoolWithoutRanks(t *testing.T) {
	addr := socketPath(t)
	js := strings.Replace(rankPoolConfig(addr, 2, 100), `"accept_timeout_ms": 20000`, `"accept_timeout_ms": 50`, 1)
	for range 2 {
		h, err := CreatePool([]byte(js))
		if h != 0 {
			t.Fatal("a pool without its ranks")
		}
		wantStatus(t, err, StatusNoDevice)
		if !strings.Contains(err.Error(), "accepting rank 0 of 2") {
			t.Fatalf("%v", err)
		}
	}
	if _, err := os.Stat(addr); !os.IsNotExist(err) {
		t.Fatalf("socket file left: %v", err)
	}
}

// TestRankWorkersOnGPU: two rank workers on GPU 0, their regions
// allocated by the workers, serve a scheduler pool: steps after the legacy
// default stream scrub their shards on the device, and the canary audit
// reads them back. It skips without a GPU.
func TestRankWorkersOnGPU(t *testing.T) {
	d, err := cudaops.OpenCUDA(0)
	if err != nil {
		if os.Getenv("KVFENCE_REQUIRE_GPU") != "" {
			t.Fatalf("KVFENCE_REQUIRE_GPU is set and there is no usable CUDA device: %v", err)
		}
		t.Skipf("no CUDA device: %v", err)
	}
	d.Close()
	addr := socketPath(t)
	type made struct {
		h   Handle
		err error
	}
	results := make(chan made, 2)
	for rank := range 2 {
		go func() {
			h, err := CreateRankWorker(rankConfig(addr, rank, `, "device": {"kind": "cuda", "ordinal": 0}`),
				[]RankRegion{{PageBytes: rankPageBytes, Pages: rankPages}, {PageBytes: rankPageBytes, Pages: rankPages}})
			results <- made{h, err}
		}()
	}
	pool, err := CreatePool([]byte(rankPoolConfig(addr, 2, 10000)))
	if err != nil {
		t.Fatal(err)
	}
	var ws []Handle
	t.Cleanup(func() {
		DestroyPool(pool) // first: a worker closed under a live pool faults it
		for _, w := range ws {
			CloseRankWorker(w)
		}
	})
	for range 2 {
		m := <-results
		if m.err != nil {
			t.Fatal(m.err)
		}
		ws = append(ws, m.h)
	}
	for _, w := range ws {
		rs, err := RankRegions(w, 2)
		if err != nil || len(rs) != 2 || rs[0].Base == 0 {
			t.Fatalf("regions %+v, %v", rs, err)
		}
		must(RankStep(w, cudaops.Ordering{Stream: cudaops.StreamLegacy}))
	}
	for round := range 2 {
		l := must(Admit(pool, fmt.Sprint("r", round), []string{"acme", "globex"}[round], 64, 0, 0)) // audited on both GPUs' shards
		noErr(t, Release(l, cudaops.Ordering{}))
		for _, w := range ws {
			stepArrived(t, w)
		}
		eventually(t, "the pages to be free", func() bool { return poolStats(t, pool).FreePages == rankPages })
		noErr(t, Free(l))
	}
	if st := poolStats(t, pool); st.Fault != "" || st.Scrub.CanaryFailures != 0 || st.Scrub.CanaryChecks < rankPages {
		t.Fatalf("fault %q, scrub %+v", st.Fault, st.Scrub)
	}
	mustCheck(t, pool)
}

// TestRankGroupOverTCP: the same group over TCP on the loopback.
func TestRankGroupOverTCP(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Skipf("no loopback TCP: %v", err)
	}
	addr := l.Addr().String() // a port free a moment ago: the scheduler takes it
	l.Close()
	s := newShard()
	cfg, err := ParseRankConfig([]byte(`{"connect": "tcp:` + addr + `", "rank": 0, "connect_timeout_ms": 20000}`))
	if err != nil {
		t.Fatal(err)
	}
	made := make(chan Handle, 1)
	go func() {
		h, err := CreateRankWorker(cfg, s.regions())
		if err != nil {
			t.Error(err)
		}
		made <- h
	}()
	js := strings.Replace(rankPoolConfig("", 1, 5000), `"listen": "unix:"`, `"listen": "tcp:`+addr+`"`, 1)
	pool, err := CreatePool([]byte(js))
	if err != nil {
		t.Fatal(err)
	}
	w := <-made
	defer CloseRankWorker(w)
	defer DestroyPool(pool)
	must(RankStep(w, cudaops.Ordering{}))
	lease := must(Admit(pool, "r", "acme", 64, 0, 0))
	noErr(t, Free(lease))
	stepArrived(t, w)
	eventually(t, "the pages to be free", func() bool { return poolStats(t, pool).FreePages == rankPages })
	mustCheck(t, pool)
}

// TestHugeTimeoutsWaitLongerNotShorter: a timeout in milliseconds whose
// nanoseconds do not fit in a time.Duration (INT64_MAX, the natural
// "forever") waits as long as one can, as the receiver's timeouts and
// wait_ms do; multiplied in int64 it wrapped, to a negative wait (a rank
// worker that gave up connecting at once) or to a tiny one (a scheduler
// that stopped accepting its ranks after 448 µs).
func TestHugeTimeoutsWaitLongerNotShorter(t *testing.T) {
	for _, v := range []string{"9223372036854775807", "18446744073710"} {
		cfg, err := ParseRankConfig([]byte(`{"connect": "unix:/s", "rank": 0, "connect_timeout_ms": ` + v + `}`))
		if err != nil || cfg.ConnectTimeout < 100*365*24*time.Hour {
			t.Errorf("connect_timeout_ms %s: %v, %v", v, cfg.ConnectTimeout, err)
		}
	}

	// 18446744073710 ms is 2^64 ns and 448384 ns more.
	addr := socketPath(t)
	js := strings.Replace(rankPoolConfig(addr, 1, 9223372036854775807), `"accept_timeout_ms": 20000`, `"accept_timeout_ms": 18446744073710`, 1)
	type made struct {
		h   Handle
		err error
	}
	pool := make(chan made, 1)
	go func() {
		h, err := CreatePool([]byte(js))
		pool <- made{h, err}
	}()
	select {
	case m := <-pool:
		t.Fatalf("the pool stopped waiting for its rank at once: %#x, %v", m.h, m.err)
	case <-time.After(300 * time.Millisecond):
	}
	w, err := CreateRankWorker(rankConfig(addr, 0, ""), newShard().regions())
	if err != nil {
		t.Fatal(err)
	}
	defer CloseRankWorker(w)
	m := <-pool
	if m.err != nil {
		t.Fatal(m.err)
	}
	if err := DestroyPool(m.h); err != nil {
		t.Fatal(err)
	}
}
