package grpcx_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/grpcx"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// benchGeometry: 2 layers × 8 KV heads × 128 dims of bf16, 16 tokens per
// page: 128 KiB pages, so a 32,768-token prompt is 2,048 pages, 256 MiB.
var benchGeometry = kvcache.Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 8, HeadDim: 128, DType: kvcache.BF16}

const benchPrompt = 32_768

// BenchmarkHandoff hands a 32,768-token prompt's KV from a prefill pool to
// a decode pool over loopback gRPC: export, manifest, pages (lent from
// the prefill pool's memory to gRPC, summed just before gRPC copies them
// out) → wire → decode device, content check, ack, and the release of
// the prefill pages. The baseline is a raw TCP copy of
// the same bytes over loopback, measured in the same benchmark: one after
// each handoff, so that both see the same load on a shared machine.
//
// Each handoff is checked, outside the timed part: the decode lease holds
// the prompt's pages, sampled pages (the first, a middle and the last, in
// every region) carry what the prefill side wrote into them, and the
// prefill pages have been released. The receiver has verified the content
// checksum over every page before Send returned; the sample shows the
// pages it verified are the ones the decode lease got.
//
// cpu-ms/op and tcp-cpu-ms/op are the process's CPU time (user and
// system, both ends) over the same spans: where both ends share a few
// cores, as on bench/README.md's machine, x-tcp follows how much more CPU
// per byte the handoff takes than the copy. BenchmarkGRPCStream is the
// ceiling: gRPC's share alone.
func BenchmarkHandoff(b *testing.B) {
	newPool := func() *kvcache.Pool {
		p, err := kvcache.New(kvcache.Config{Geometry: benchGeometry, Pages: benchPrompt / 16,
			MaxContextTokens: benchPrompt, Tenants: tenants})
		require.NoError(b, err)
		b.Cleanup(func() { p.Close() })
		return p
	}
	prefill, decode := newPool(), newPool()
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: testkit.Key()})
	require.NoError(b, err)
	srv, err := grpcx.NewServer(recv, insecure.NewCredentials())
	require.NoError(b, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	go srv.Serve(ln)
	defer srv.Stop()
	tr, err := grpcx.Dial(ln.Addr().String(), insecure.NewCredentials())
	require.NoError(b, err)
	defer tr.Close()
	s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key()})
	require.NoError(b, err)
	ctx := context.Background()
	size := int64(benchPrompt) * benchGeometry.TokenBytes()
	tcp := newTCPCopy(b, size)
	defer tcp.close()
	b.SetBytes(size)

	pages := benchGeometry.PagesFor(benchPrompt)
	sample := []int{0, pages / 2, pages - 1}
	page := make([]byte, benchGeometry.RegionPageBytes())
	// mark fills page with bytes that name request i, prompt page p and
	// region r.
	mark := func(i, p, r int) []byte {
		for off := 0; off < len(page); off += 8 {
			binary.LittleEndian.PutUint64(page[off:], uint64(i)<<40|uint64(p)<<16|uint64(r)<<8|uint64(off&0xff))
		}
		return page
	}
	got := make([]byte, len(page))

	tally := transferTally{hasCPU: true}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		id := fmt.Sprint("bench-", i)
		l, err := prefill.Admit(ctx, kvcache.Request{ID: id, Tenant: "victim", PromptTokens: benchPrompt})
		require.NoError(b, err)
		require.NoError(b, l.BeginPrefill())
		table, err := l.BlockTable()
		require.NoError(b, err)
		for _, p := range sample {
			for r := range benchGeometry.Regions() {
				require.NoError(b, prefill.Device().WritePage(r, table[p], mark(i, p, r)))
			}
		}
		require.NoError(b, l.Commit(benchPrompt))
		require.NoError(b, l.FinishPrefill())
		b.StartTimer()
		span := tally.begin()
		exp, err := s.Export(l, 0)
		require.NoError(b, err)
		require.NoError(b, exp.Send(ctx, tr))
		tally.end(span)
		b.StopTimer()
		dl, ok := recv.Take(id)
		require.True(b, ok, "no decode lease for %s", id)
		require.Equal(b, benchPrompt, dl.Written(), "decode lease of %s", id)
		dtable, err := dl.BlockTable()
		require.NoError(b, err)
		require.GreaterOrEqual(b, len(dtable), pages)
		for _, p := range sample {
			for r := range benchGeometry.Regions() {
				require.NoError(b, decode.Device().ReadPage(r, dtable[p], got))
				if !bytes.Equal(got, mark(i, p, r)) {
					b.Fatalf("%s: decode page %d region %d is not what prefill wrote", id, p, r)
				}
			}
		}
		require.NoError(b, dl.Release())
		require.Zero(b, prefill.Stats().LiveLeases, "the exported lease of %s is still live", id)
		tally.baseline(b, tcp)
		b.StartTimer()
	}
	b.StopTimer()
	require.Equal(b, handoff.ReceiverStats{Imported: uint64(b.N)}, recv.Stats())
	require.NoError(b, prefill.Check())
	require.NoError(b, decode.Check())
	tally.report(b, size)
}

// transferTally sums a benchmark's timed transfers and the TCP copies
// after each: wall time, and the CPU time of the whole process (both
// ends, every goroutine, the kernel's work for its system calls) over
// the same spans, since on a machine with few cores the ratio follows
// CPU per byte.
type transferTally struct {
	time, cpu       time.Duration // the transfers'
	tcpTime, tcpCPU time.Duration // the baseline's
	hasCPU          bool          // every span's CPU time could be read
}

// tallySpan is where a timed span began.
type tallySpan struct {
	start time.Time
	cpu   time.Duration
}

func (t *transferTally) begin() tallySpan {
	cpu, ok := processCPU()
	t.hasCPU = t.hasCPU && ok
	return tallySpan{start: time.Now(), cpu: cpu}
}

func (t *transferTally) end(s tallySpan) {
	t.time += time.Since(s.start)
	cpu, ok := processCPU()
	t.cpu += cpu - s.cpu
	t.hasCPU = t.hasCPU && ok
}

// baseline times one TCP copy of the transfer's bytes.
func (t *transferTally) baseline(b *testing.B, tcp *tcpCopy) {
	cpu0, ok0 := processCPU()
	t.tcpTime += tcp.run(b)
	cpu1, ok1 := processCPU()
	t.tcpCPU += cpu1 - cpu0
	t.hasCPU = t.hasCPU && ok0 && ok1
}

// report reports GB/s of both, x-tcp, and CPU per operation where it
// could be read, for b.N transfers of size bytes.
func (t *transferTally) report(b *testing.B, size int64) {
	gbps := float64(size) * float64(b.N) / t.time.Seconds() / 1e9
	tcpGBps := float64(size) * float64(b.N) / t.tcpTime.Seconds() / 1e9
	b.ReportMetric(gbps, "GB/s")
	b.ReportMetric(tcpGBps, "tcp-GB/s")
	b.ReportMetric(gbps/tcpGBps, "x-tcp")
	if t.hasCPU {
		b.ReportMetric(float64(t.cpu.Microseconds())/1e3/float64(b.N), "cpu-ms/op")
		b.ReportMetric(float64(t.tcpCPU.Microseconds())/1e3/float64(b.N), "tcp-cpu-ms/op")
	}
}

// BenchmarkGRPCStream is gRPC's share of BenchmarkHandoff, and so the
// ceiling of its x-tcp: the same 256 MiB in messages laid out like the
// handoff's data frames (a head, then 7 pages of views per message), lent
// to gRPC from memory of the pools' kind (SendViews, no copy, every view
// given back before the clock stops) and taken on the server in the
// buffers they arrived in (RecvParts) and dropped, over this package's
// options and codec; no manifest, no checksums, no decode pool, no scrub.
// The raw TCP copy runs after each stream, as in BenchmarkHandoff.
func BenchmarkGRPCStream(b *testing.B) {
	opts, err := grpcx.ServerOptions(insecure.NewCredentials())
	require.NoError(b, err)
	srv := grpc.NewServer(opts...)
	grpcx.RegisterDrain(srv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	go srv.Serve(ln)
	defer srv.Stop()
	tr, err := grpcx.Dial(ln.Addr().String(), insecure.NewCredentials())
	require.NoError(b, err)
	defer tr.Close()
	size := int64(benchPrompt) * benchGeometry.TokenBytes()
	tcp := newTCPCopy(b, size)
	defer tcp.close()
	src := tcp.mem
	r, err := src.AllocRegion(1, size) // the bytes streamed: cold, like the pages
	require.NoError(b, err)
	data := src.PageBytes(r, 0)
	copy(data, tcp.src) // backed now, not read from the kernel's zero page
	b.SetBytes(size)

	regionBytes := int(benchGeometry.RegionPageBytes())
	pageBytes := regionBytes * benchGeometry.Regions()
	const perMessage = 7 // pages in a 1 MiB data frame (handoff's default FrameBytes)
	head := make([]byte, 1+16+4+4+4*perMessage)
	var views [][]byte
	ctx := context.Background()
	tally := transferTally{hasCPU: true}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var lent sync.WaitGroup
		span := tally.begin()
		st, err := tr.Open(ctx)
		require.NoError(b, err)
		vs := st.(handoff.ViewStream)
		for off := 0; off < len(data); {
			views = views[:0]
			for k := 0; k < perMessage && off < len(data); k++ {
				for end := off + pageBytes; off < end; off += regionBytes {
					views = append(views, data[off:off+regionBytes])
				}
			}
			lent.Add(1)
			require.NoError(b, vs.SendViews(head, views, lent.Done))
		}
		require.NoError(b, st.CloseSend())
		reply, err := st.Recv()
		require.NoError(b, err)
		require.Equal(b, []byte{'V'}, reply)
		require.NoError(b, st.Close())
		lent.Wait()
		tally.end(span)
		b.StopTimer()
		tally.baseline(b, tcp)
		b.StartTimer()
	}
	b.StopTimer()
	tally.report(b, size)
}

// tcpCopy is the baseline: a loopback TCP connection that copies bytes
// from one buffer of the handoff's size to another, 1 MiB per write and
// read. The buffers are memory of the pools' kind (Host device regions:
// as cold as the pages, and backed alike, huge pages included), not
// cache-resident scratch buffers.
type tcpCopy struct {
	mem      *cudaops.Host
	src, dst []byte
	w, r     net.Conn
}

func newTCPCopy(b *testing.B, bytes int64) *tcpCopy {
	c := &tcpCopy{mem: cudaops.NewHost()}
	for range 2 {
		_, err := c.mem.AllocRegion(1, bytes)
		require.NoError(b, err)
	}
	c.src, c.dst = c.mem.PageBytes(0, 0), c.mem.PageBytes(1, 0)
	for i := range c.src {
		c.src[i] = byte(i)
	}
	clear(c.dst) // touched now, not during the first copy
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(b, err)
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		conn, _ := ln.Accept()
		accepted <- conn
	}()
	c.w, err = net.Dial("tcp", ln.Addr().String())
	require.NoError(b, err)
	c.r = <-accepted
	require.NotNil(b, c.r)
	return c
}

// run copies the bytes once and returns the time until the reader has
// all of them.
func (c *tcpCopy) run(b *testing.B) time.Duration {
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		for off := 0; off < len(c.dst); off += 1 << 20 {
			if _, err := io.ReadFull(c.r, c.dst[off:min(off+1<<20, len(c.dst))]); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	for off := 0; off < len(c.src); off += 1 << 20 {
		_, err := c.w.Write(c.src[off:min(off+1<<20, len(c.src))])
		require.NoError(b, err)
	}
	require.NoError(b, <-done)
	return time.Since(start)
}

func (c *tcpCopy) close() {
	c.w.Close()
	c.r.Close()
	c.mem.Close()
}
