// Package benchkit is what the transports' handoff benchmarks share: the
// workload of BenchmarkHandoff (a 32,768-token prompt's KV from a prefill
// pool to a decode pool, every handoff checked), the raw loopback TCP
// copy each transfer is measured against, and the tally of wall and CPU
// time over both. It is imported by benchmarks only (it needs a
// *testing.B); it lives in non-test files because test files cannot be
// imported across packages.
package benchkit

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

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// Geometry: 2 layers × 8 KV heads × 128 dims of bf16, 16 tokens per page:
// 128 KiB pages, so a Prompt-token prompt is 2,048 pages, 256 MiB.
var Geometry = kvcache.Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 8, HeadDim: 128, DType: kvcache.BF16}

// Prompt is the prompt's length in tokens.
const Prompt = 32_768

// Bytes is the size of the prompt's KV, what each handoff moves.
var Bytes = int64(Prompt) * Geometry.TokenBytes()

var tenants = []kvcache.TenantConfig{{Name: "victim"}, {Name: "other"}}

// Workload is what a handoff benchmark moves: the cache of a prompt of
// Prompt tokens between pools of Spec (with MaxLeases leases of its
// window and state groups).
type Workload struct {
	Spec      kvcache.CacheSpec
	Prompt    int
	MaxLeases int
}

// PerToken is BenchmarkHandoff's workload: Geometry's K and V, Prompt
// tokens, 256 MiB.
var PerToken = Workload{Spec: kvcache.GeometrySpec(Geometry), Prompt: Prompt}

// Layered is BenchmarkHandoffLayered's workload: PerToken's 256 MiB in
// the layout of a real model's cache, llama-3.1-8b's (32 layers × 8 KV
// heads × 128 dims of bf16, 16 tokens a page): 64 regions (each layer's
// K and V) of 32 KiB pages, a unit of 2 MiB, 2,048 tokens. A transport
// that writes region by region writes a region's run of pages at a time:
// PerToken's are 1 MiB in a chunk of 4 MiB, these 64 KiB.
var Layered = Workload{Spec: kvcache.GeometrySpec(kvcache.Geometry{TokensPerPage: 16, Layers: 32, KVHeads: 8,
	HeadDim: 128, DType: kvcache.BF16}), Prompt: 2048}

// HybridPrompt is the prompt of the Hybrid workload.
const HybridPrompt = 16_384

// Hybrid is BenchmarkHandoffHybrid's workload: a miniature of the
// incident's model, glm-5.3-flash, of its first 4 layers of each group
// at their full size: per token 4 MLA latents and pooled indexer keys
// (pages of 64 tokens, 264 KiB), and a state slot of 4 Kimi Delta
// Attention layers (16.6 MiB), for a prompt of HybridPrompt tokens:
// 82.6 MiB a handoff, the slot in 1 MiB parts.
func Hybrid() Workload {
	full, err := kvcache.Preset("glm-5.3-flash")
	if err != nil {
		panic(err)
	}
	spec, err := full.Miniature(4, 1)
	if err != nil {
		panic(err)
	}
	return Workload{Spec: spec, Prompt: HybridPrompt, MaxLeases: 2}
}

// Bytes is what one handoff of the workload moves: every unit of every
// group.
func (w Workload) Bytes() int64 {
	var b int64
	for _, e := range w.Spec.HandoffExtents(w.Prompt) {
		b += int64(e.Units) * e.UnitBytes
	}
	return b
}

// Handoff runs b.N handoffs of a Prompt-token prompt's KV from a prefill
// pool to a decode pool over the transport connect returns, which
// delivers to recv (connect registers its own cleanup with b), and after
// each one a raw TCP copy of the same bytes over loopback, so that both
// see the same load on a shared machine. It reports GB/s, tcp-GB/s and
// x-tcp, clean-x-tcp, and, where the process's CPU time can be read,
// cpu-ms/op and tcp-cpu-ms/op (Tally).
//
// A handoff is timed from the export to Send's return: manifest, pages
// (lent from the prefill pool's memory where the transport takes views),
// content check, ack, and the release of the prefill pages. The prefill
// pool's device fills asynchronously (cudaops.HostConfig.AsyncFills), as
// a GPU's does: the release queues the scrub of the prefill pages and
// Send returns, which is what GB/s and x-tcp measure, the handoff as its
// caller waits for it. The clock then runs on until those pages are clean
// (the pool holds no quarantined page): clean-x-tcp is the handoff with
// its scrub, and cpu-ms/op counts the scrub's CPU time too. Each is
// checked outside the timed part: the decode lease holds the prompt's
// pages, sampled pages (the first, a middle and the last, in every
// region) carry what the prefill side wrote into them, and the prefill
// pages have been released. The receiver has verified the content
// checksum over every page before Send returned; the sample shows the
// pages it verified are the ones the decode lease got.
//
// refs, if any, are further baselines, each run after each handoff
// beside the TCP copy (and so under the same load): for each, Handoff
// reports its bandwidth (NAME-GB/s, over the runs) and the handoff's
// against it (x-NAME).
func Handoff(b *testing.B, connect func(recv *handoff.Receiver) handoff.Transport, refs ...Reference) {
	HandoffOf(b, PerToken, connect, refs...)
}

// Reference is a baseline of Handoff's besides the TCP copy: Run moves
// size bytes its own way and returns the bandwidth it measured, in GB/s
// (10⁹ bytes a second).
type Reference struct {
	Name string
	Run  func(b *testing.B, size int64) float64
}

// HandoffOf is Handoff of workload w: every group's units move, and the
// sample covers every group (its first, middle and last units).
func HandoffOf(b *testing.B, w Workload, connect func(recv *handoff.Receiver) handoff.Transport, refs ...Reference) {
	newPool := func(dev cudaops.Device) *kvcache.Pool {
		if dev != nil {
			b.Cleanup(func() { dev.Close() }) // after the pool's Close
		}
		p, err := kvcache.New(kvcache.Config{Cache: w.Spec, Pages: w.Spec.PagesFor(w.Prompt), MaxLeases: w.MaxLeases,
			MaxContextTokens: w.Prompt, Tenants: tenants, Device: dev})
		require.NoError(b, err)
		b.Cleanup(func() { p.Close() })
		return p
	}
	prefill := newPool(cudaops.NewHostWith(cudaops.HostConfig{AsyncFills: true}))
	decode := newPool(nil)
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: testkit.Key()})
	require.NoError(b, err)
	tr := connect(recv)
	s, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key()})
	require.NoError(b, err)
	ctx := context.Background()
	size := w.Bytes()
	tcp := NewTCPCopy(b, size)
	defer tcp.Close()
	b.SetBytes(size)

	extents := w.Spec.HandoffExtents(w.Prompt)
	// mark returns bytes of n that name request i, group g, unit j and
	// region r.
	mark := func(i, g, j, r int, n int64) []byte {
		page := make([]byte, n)
		for off := 0; off+8 <= len(page); off += 8 {
			binary.LittleEndian.PutUint64(page[off:], uint64(i)<<40|uint64(g)<<32|uint64(j)<<16|uint64(r)<<8|uint64(off&0xff))
		}
		return page
	}
	// sampled calls f for the sample: the first, a middle and the last
	// unit of every group, every region.
	sampled := func(f func(g int, e kvcache.HandoffExtent, j, r int, n int64)) {
		for g, e := range extents {
			for _, j := range []int{0, e.Units / 2, e.Units - 1} {
				for r, reg := range w.Spec.Groups[g].Regions {
					f(g, e, j, r, reg.PageBytes)
				}
			}
		}
	}

	tally := NewTally()
	refGBps := make([]float64, len(refs)) // summed over the runs
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		id := fmt.Sprint("bench-", i)
		l, err := prefill.Admit(ctx, kvcache.Request{ID: id, Tenant: "victim", PromptTokens: w.Prompt})
		require.NoError(b, err)
		require.NoError(b, l.BeginPrefill())
		require.NoError(b, l.Commit(w.Prompt))
		_, err = l.SlideWindows(cudaops.Ordering{})
		require.NoError(b, err)
		sampled(func(g int, e kvcache.HandoffExtent, j, r int, n int64) {
			require.NoError(b, l.WritePage(e.Group, j, r, mark(i, g, j, r, n)))
		})
		require.NoError(b, l.FinishPrefill())
		b.StartTimer()
		span := tally.Begin()
		exp, err := s.Export(l, 0)
		require.NoError(b, err)
		require.NoError(b, exp.Send(ctx, tr))
		span.Returned()
		b.StopTimer() // ns/op is the handoff as its caller waits for it
		waitClean(b, prefill)
		tally.End(span)
		dl, ok := recv.Take(id)
		require.True(b, ok, "no decode lease for %s", id)
		require.Equal(b, w.Prompt, dl.Written(), "decode lease of %s", id)
		sampled(func(g int, e kvcache.HandoffExtent, j, r int, n int64) {
			got := make([]byte, n)
			require.NoError(b, dl.ReadPage(e.Group, j, r, got))
			if !bytes.Equal(got, mark(i, g, j, r, n)) {
				b.Fatalf("%s: decode unit %d of group %q region %d is not what prefill wrote", id, j, e.Group, r)
			}
		})
		require.NoError(b, dl.Release())
		require.Zero(b, prefill.Stats().LiveLeases, "the exported lease of %s is still live", id)
		tally.Baseline(b, tcp)
		for k, ref := range refs {
			refGBps[k] += ref.Run(b, size)
		}
		b.StartTimer()
	}
	b.StopTimer()
	require.Equal(b, handoff.ReceiverStats{Imported: uint64(b.N)}, recv.Stats())
	require.NoError(b, prefill.Check())
	require.NoError(b, decode.Check())
	tally.Report(b, size)
	gbps := float64(size) * float64(b.N) / tally.time.Seconds() / 1e9
	for k, ref := range refs {
		mean := refGBps[k] / float64(b.N)
		b.ReportMetric(mean, ref.Name+"-GB/s")
		b.ReportMetric(gbps/mean, "x-"+ref.Name)
	}
}

// waitClean returns once p holds no quarantined page: every scrub its
// releases queued has ended.
func waitClean(b *testing.B, p *kvcache.Pool) {
	quarantined := func() (n int) {
		for _, g := range p.Stats().Groups {
			n += g.Quarantined
		}
		return n
	}
	for deadline := time.Now().Add(time.Minute); quarantined() > 0; {
		if time.Now().After(deadline) {
			b.Fatalf("the prefill pages are still quarantined a minute after the handoff: %+v", p.Stats())
		}
		time.Sleep(20 * time.Microsecond)
	}
}

// Stream is a transport's share of Handoff: it streams the same bytes
// b.N times over tr, in messages laid out like the handoff's data frames
// (a head, then 7 pages of views per message), lent to the stream from
// memory of the pools' kind (ViewStream.SendViews, every view given back
// before the clock stops), then closes its side and expects the one-byte
// reply 'V' from a server that drops what it receives; no manifest, no
// checksums, no decode pool, no scrub. The raw TCP copy runs after each
// stream, as in Handoff, and the report is Handoff's.
func Stream(b *testing.B, tr handoff.Transport) {
	size := Bytes
	tcp := NewTCPCopy(b, size)
	defer tcp.Close()
	src := tcp.Mem
	r, err := src.AllocRegion(1, size) // the bytes streamed: cold, like the pages
	require.NoError(b, err)
	data := src.PageBytes(r, 0)
	copy(data, tcp.Src) // backed now, not read from the kernel's zero page
	b.SetBytes(size)

	regionBytes := int(Geometry.RegionPageBytes())
	pageBytes := regionBytes * Geometry.Regions()
	const perMessage = 7 // pages in a 1 MiB data frame (handoff's default FrameBytes)
	head := make([]byte, 1+16+4+4+4*perMessage)
	var views [][]byte
	ctx := context.Background()
	tally := NewTally()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		var lent sync.WaitGroup
		span := tally.Begin()
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
		tally.End(span)
		b.StopTimer()
		tally.Baseline(b, tcp)
		b.StartTimer()
	}
	b.StopTimer()
	tally.Report(b, size)
}

// Tally sums a benchmark's timed transfers and the TCP copies after
// each: wall time, and the CPU time of the whole process (both ends,
// every goroutine, the kernel's work for its system calls) over the same
// spans, since on a machine with few cores the ratio follows CPU per
// byte.
type Tally struct {
	time, cpu       time.Duration // the transfers': until they returned, and CPU until End
	clean           time.Duration // the transfers' until End, work left behind included
	tcpTime, tcpCPU time.Duration // the baseline's
	hasCPU          bool          // every span's CPU time could be read
	returned        bool          // some span marked where its transfer returned
}

// NewTally returns an empty tally.
func NewTally() *Tally { return &Tally{hasCPU: true} }

// Span is where a timed span began.
type Span struct {
	start, returned time.Time
	cpu             time.Duration
}

// Begin starts a timed transfer.
func (t *Tally) Begin() *Span {
	cpu, ok := ProcessCPU()
	t.hasCPU = t.hasCPU && ok
	return &Span{start: time.Now(), cpu: cpu}
}

// Returned marks where the transfer's caller had control back, for a
// transfer that leaves work behind (a scrub still running): its time
// ends there, and End, once that work has finished, adds the rest to
// the clean time and to the CPU time only.
func (s *Span) Returned() { s.returned = time.Now() }

// End ends the timed transfer begun at s.
func (t *Tally) End(s *Span) {
	end := time.Now()
	ret := end
	if !s.returned.IsZero() {
		ret, t.returned = s.returned, true
	}
	t.time += ret.Sub(s.start)
	t.clean += end.Sub(s.start)
	cpu, ok := ProcessCPU()
	t.cpu += cpu - s.cpu
	t.hasCPU = t.hasCPU && ok
}

// Baseline times one TCP copy of the transfer's bytes.
func (t *Tally) Baseline(b *testing.B, tcp *TCPCopy) {
	cpu0, ok0 := ProcessCPU()
	t.tcpTime += tcp.run(b)
	cpu1, ok1 := ProcessCPU()
	t.tcpCPU += cpu1 - cpu0
	t.hasCPU = t.hasCPU && ok0 && ok1
}

// Report reports GB/s of both, x-tcp, clean-x-tcp where some span
// marked its return (x-tcp with the work left behind), and CPU per
// operation where it could be read, for b.N transfers of size bytes.
func (t *Tally) Report(b *testing.B, size int64) {
	gbps := float64(size) * float64(b.N) / t.time.Seconds() / 1e9
	tcpGBps := float64(size) * float64(b.N) / t.tcpTime.Seconds() / 1e9
	b.ReportMetric(gbps, "GB/s")
	b.ReportMetric(tcpGBps, "tcp-GB/s")
	b.ReportMetric(gbps/tcpGBps, "x-tcp")
	if t.returned {
		cleanGBps := float64(size) * float64(b.N) / t.clean.Seconds() / 1e9
		b.ReportMetric(cleanGBps/tcpGBps, "clean-x-tcp")
	}
	if t.hasCPU {
		b.ReportMetric(float64(t.cpu.Microseconds())/1e3/float64(b.N), "cpu-ms/op")
		b.ReportMetric(float64(t.tcpCPU.Microseconds())/1e3/float64(b.N), "tcp-cpu-ms/op")
	}
}

// TCPCopy is the baseline: a loopback TCP connection that copies bytes
// from one buffer of the handoff's size to another, 1 MiB per write and
// read. The buffers are memory of the pools' kind (Host device regions:
// as cold as the pages, and backed alike, huge pages included), not
// cache-resident scratch buffers.
type TCPCopy struct {
	// Mem holds the copy's two buffers, regions 0 and 1; a benchmark may
	// allocate more of the same kind in it.
	Mem *cudaops.Host
	// Src is the bytes copied, filled with a pattern; Dst receives them.
	Src, Dst []byte
	w, r     net.Conn
}

// NewTCPCopy connects a loopback TCP pair and allocates two buffers of
// bytes each.
func NewTCPCopy(b *testing.B, bytes int64) *TCPCopy {
	c := &TCPCopy{Mem: cudaops.NewHost()}
	for range 2 {
		_, err := c.Mem.AllocRegion(1, bytes)
		require.NoError(b, err)
	}
	c.Src, c.Dst = c.Mem.PageBytes(0, 0), c.Mem.PageBytes(1, 0)
	for i := range c.Src {
		c.Src[i] = byte(i)
	}
	clear(c.Dst) // touched now, not during the first copy
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
func (c *TCPCopy) run(b *testing.B) time.Duration {
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		for off := 0; off < len(c.Dst); off += 1 << 20 {
			if _, err := io.ReadFull(c.r, c.Dst[off:min(off+1<<20, len(c.Dst))]); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	for off := 0; off < len(c.Src); off += 1 << 20 {
		_, err := c.w.Write(c.Src[off:min(off+1<<20, len(c.Src))])
		require.NoError(b, err)
	}
	require.NoError(b, <-done)
	return time.Since(start)
}

// Close closes the connection and frees the buffers.
func (c *TCPCopy) Close() {
	c.w.Close()
	c.r.Close()
	c.Mem.Close()
}
