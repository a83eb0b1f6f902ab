package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvfence/kvfence/capi/internal/bridge"
	"github.com/kvfence/kvfence/cudaops"
)

// A tensor-parallel group with one process per rank, through the C ABI:
// the scheduler's pool is over remote ranks (created here through the
// bridge, as kvf_pool_create would), and each rank is a process of
// testdata/rank_worker.c, linked against libkvfence.so, whose shard is
// host memory it hands to kvfence and can write and inspect itself.

// Every rank's shard: 2 regions (layer 0's K and V) of 16 pages of 128
// bytes; the pool's pages are 3 ranks' shards side by side.
const (
	procRanks     = 3
	procPages     = 16
	procPageBytes = 128
	procKV        = 0x5A // the byte the "engine" writes as KV
)

// rankProc is one worker process and its command pipe.
type rankProc struct {
	t    *testing.T
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Scanner
	rank int
}

// do sends one command and returns the answer line.
func (p *rankProc) do(command string) string {
	p.t.Helper()
	if _, err := fmt.Fprintln(p.in, command); err != nil {
		p.t.Fatalf("rank %d: %s: %v", p.rank, command, err)
	}
	return p.line(command)
}

func (p *rankProc) line(what string) string {
	p.t.Helper()
	got := make(chan bool, 1)
	go func() { got <- p.out.Scan() }()
	select {
	case ok := <-got:
		if !ok {
			p.t.Fatalf("rank %d: no answer to %s: %v", p.rank, what, p.out.Err())
		}
		return p.out.Text()
	case <-time.After(30 * time.Second):
		p.t.Fatalf("rank %d: no answer to %s in 30 s", p.rank, what)
		return ""
	}
}

// want runs command and fails unless the answer starts with prefix.
func (p *rankProc) want(command, prefix string) string {
	p.t.Helper()
	ans := p.do(command)
	if !strings.HasPrefix(ans, prefix) {
		p.t.Fatalf("rank %d: %s answered %q, want %q", p.rank, command, ans, prefix)
	}
	return ans
}

// scrubbed fails unless page holds one word other than the KV in every
// region of the rank's shard.
func (p *rankProc) scrubbed(page int32) {
	p.t.Helper()
	var word string
	var uniform int
	ans := p.do(fmt.Sprint("word ", page))
	if _, err := fmt.Sscanf(ans, "word %s %d", &word, &uniform); err != nil || uniform != 1 || word == "5a5a5a5a" || word == "eeeeeeee" {
		p.t.Fatalf("rank %d page %d not scrubbed: %q", p.rank, page, ans)
	}
}

// rankWorkerBinary compiles testdata/rank_worker.c against libkvfence.so.
func rankWorkerBinary(t *testing.T) (bin, libDir string) {
	t.Helper()
	dir := buildShared(t)
	bin = filepath.Join(dir, "rank_worker")
	if _, err := os.Stat(bin); err != nil {
		out, err := exec.Command("gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-Iinclude", "testdata/rank_worker.c",
			"-L"+dir, "-lkvfence", "-lpthread", "-o", bin).CombinedOutput()
		if err != nil {
			t.Fatalf("gcc: %v\n%s", err, out)
		}
	}
	return bin, dir
}

// startRankGroup starts the workers, then the scheduler's pool (the
// workers wait for it to listen), and returns both once the pool exists.
func startRankGroup(t *testing.T) (pool bridge.Handle, procs []*rankProc) {
	t.Helper()
	bin, libDir := rankWorkerBinary(t)
	dir, err := os.MkdirTemp("", "kvfc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	addr := "unix:" + filepath.Join(dir, "s")
	for rank := range procRanks {
		cmd := exec.Command(bin, addr, fmt.Sprint(rank), fmt.Sprint(procPages), fmt.Sprint(procPageBytes), "2")
		cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+libDir)
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		p := &rankProc{t: t, cmd: cmd, in: in, out: bufio.NewScanner(out), rank: rank}
		procs = append(procs, p)
		t.Cleanup(func() {
			in.Close() // a live worker closes and exits at the end of its input
			done := make(chan struct{})
			go func() { _ = cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				_ = cmd.Process.Kill()
				<-done
			}
		})
	}
	pool, err = bridge.CreatePool(fmt.Appendf(nil, `{"geometry": {"tokens_per_page": 4, "layers": 1, "kv_heads": %d, "head_dim": 4, "dtype": "fp32"},
	 "pages": %d, "max_context_tokens": 64, "tenants": [{"name": "acme"}, {"name": "globex"}], "scrub": {"kind": "canary"},
	 "device": {"kind": "remote", "listen": %q, "ranks": %d, "report_timeout_ms": 10000, "accept_timeout_ms": 30000}}`,
		2*procRanks, procPages, addr, procRanks))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bridge.DestroyPool(pool) })
	for _, p := range procs {
		if ans := p.line("the start"); ans != "ready" {
			t.Fatalf("rank %d started with %q", p.rank, ans)
		}
	}
	return pool, procs
}

func rankStats(t *testing.T, pool bridge.Handle) bridge.StatsDoc {
	t.Helper()
	js, err := bridge.StatsJSON(pool)
	if err != nil {
		t.Fatal(err)
	}
	var doc bridge.StatsDoc
	if err := json.Unmarshal(js, &doc); err != nil {
		t.Fatal(err)
	}
	return doc
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// leaseKV admits a lease over all but one page and has every rank write
// KV into its shard of each of them; it returns the lease and its pages.
func leaseKV(t *testing.T, pool bridge.Handle, procs []*rankProc) (bridge.Handle, []int32) {
	t.Helper()
	l, err := bridge.Admit(pool, "r", "acme", 60, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	table := make([]int32, procPages)
	n, err := bridge.BlockTable(l, table)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range procs {
		for _, page := range table[:n] {
			p.want(fmt.Sprintf("write %d %d", page, procKV), "ok")
		}
	}
	return l, table[:n]
}

// TestRankProcessesFreePagesOnlyAfterEveryRank: a released lease's pages
// stay quarantined while any rank has not stepped its scrub, each rank's
// shard is scrubbed by its own step, and the pages are free, with every
// rank's shard passing the canary audit, once the last rank reported.
// When the scheduler destroys its pool the workers' calls say so.
func TestRankProcessesFreePagesOnlyAfterEveryRank(t *testing.T) {
	pool, procs := startRankGroup(t)
	for _, p := range procs {
		for page := range int32(procPages) {
			p.scrubbed(page) // the pool's initial scrub, served without a step
		}
		p.want("step", "stepped 0") // before any batch
	}
	l, table := leaseKV(t, pool, procs)
	if err := bridge.Release(l, cudaops.Ordering{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range procs {
		time.Sleep(20 * time.Millisecond) // time for a report that must not come
		if st := rankStats(t, pool); st.QuarantinedPages != len(table) || st.FreePages != procPages-len(table) {
			t.Fatalf("before rank %d stepped: %d pages quarantined, %d free", p.rank, st.QuarantinedPages, st.FreePages)
		}
		if ans := p.do(fmt.Sprint("word ", table[0])); ans != "word 5a5a5a5a 1" {
			t.Fatalf("rank %d scrubbed before its step: %q", p.rank, ans)
		}
		p.want("step-arrived", "stepped 1")
		for _, page := range table {
			p.scrubbed(page)
		}
	}
	waitFor(t, "the pages to be free", func() bool { return rankStats(t, pool).FreePages == procPages })
	g, err := bridge.Admit(pool, "g", "globex", 64, 0, 0) // every page, audited on every rank
	if err != nil {
		t.Fatal(err)
	}
	st := rankStats(t, pool)
	if st.Scrub.CanaryChecks < procPages || st.Scrub.CanaryFailures != 0 || st.Fault != "" {
		t.Fatalf("canary audit: %+v, fault %q", st.Scrub, st.Fault)
	}
	if err := bridge.Free(g); err != nil {
		t.Fatal(err)
	}
	for _, p := range procs {
		p.want("step-arrived", "stepped 1")
	}
	waitFor(t, "the pages to be free", func() bool { return rankStats(t, pool).FreePages == procPages })
	if err := bridge.Check(pool); err != nil {
		t.Fatal(err)
	}
	if err := bridge.DestroyPool(pool); err != nil {
		t.Fatal(err)
	}
	for _, p := range procs {
		p.want("wait 10000", "ended 1 KVF_OK")
		p.want("step", "error KVF_ERR_POOL_CLOSED")
		p.want("close", "closed KVF_OK")
	}
}

// TestRankProcessKilledMidFillFaultsPool: a worker killed while its
// scrub is handed over but not reported makes the scheduler retire the
// pages and fault, though the other ranks reported theirs.
func TestRankProcessKilledMidFillFaultsPool(t *testing.T) {
	pool, procs := startRankGroup(t)
	for _, p := range procs {
		p.want("step", "stepped 0")
	}
	l, table := leaseKV(t, pool, procs)
	if err := bridge.Release(l, cudaops.Ordering{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range procs[:2] {
		p.want("step-arrived", "stepped 1")
		p.scrubbed(table[0])
	}
	if err := procs[2].cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the pool to fault", func() bool { return rankStats(t, pool).Fault != "" })
	st := rankStats(t, pool)
	if !strings.Contains(st.Fault, "rank 2 lost") || st.RetiredPages != len(table) || st.FreePages != procPages-len(table) {
		t.Fatalf("fault %q, %d retired, %d free; want rank 2 lost, %d retired", st.Fault, st.RetiredPages, st.FreePages, len(table))
	}
	if err := bridge.Check(pool); err != nil {
		t.Fatal(err)
	}
	if _, err := bridge.Admit(pool, "r2", "acme", 4, 0, 0); bridge.Classify(err).Status != bridge.StatusPoolFaulted {
		t.Fatalf("admission on the faulted pool: %v", err)
	}
}

// TestRankProcessStrayWriteFailsCanaryAudit: a rank's engine writing into
// a freed page after its scrub (on one rank only) is caught when the page
// is next handed out: the audit reads every rank's shard.
func TestRankProcessStrayWriteFailsCanaryAudit(t *testing.T) {
	pool, procs := startRankGroup(t)
	procs[1].want(fmt.Sprintf("write 9 %d", procKV), "ok")
	_, err := bridge.Admit(pool, "g", "globex", 64, 0, 0)
	if bridge.Classify(err).Status != bridge.StatusPoolFaulted || !strings.Contains(fmt.Sprint(err), "canary") {
		t.Fatalf("admission over a dirty page: %v", err)
	}
	if st := rankStats(t, pool); st.RetiredPages != 1 || st.Scrub.CanaryFailures != 1 {
		t.Fatalf("%d retired, %d canary failures", st.RetiredPages, st.Scrub.CanaryFailures)
	}
}
