package cudaops_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// Llama-3.1-8B's per-token group as a handoff copies it: 32 layers × K
// and V, 16 tokens a page, 32 KiB a region page (2 MiB a page).
const (
	llamaRegions    = 64
	llamaTPP        = 16
	llamaRegionPage = 32 << 10
)

// The benchmark's pages are shrunk to benchRegionPage bytes a region, and
// staging with them (benchStaging), so that a staging batch holds the 4
// pages that 8 MiB holds of the real model: the counts are the real
// model's, the bytes are not.
const (
	benchRegionPage = 64
	benchStaging    = (8 << 20) / llamaRegionPage * benchRegionPage
)

// perPageCopies is a CUDA device without its StagedCopier, so that a pool
// on it copies handoff pages the old way: one synchronous copy per page
// per region.
type perPageCopies struct{ cudaops.Device }

// BenchmarkCUDAHandoffCopiesSimulated moves the prompt pages of a
// prefilled lease of 2,048 and 32,768 tokens from one CUDA pool to
// another over the simulated driver, through kvcache: each op reads every
// page of the export (Outgoing.ReadPages) and writes them into a new
// import (Incoming.WritePagesFrom) from parts of half a region page each,
// as gRPC's 16 KiB buffers are of Llama's 32 KiB region pages, then
// completes and releases it. The exported pages lie adjacent (a fresh
// pool) or scattered (no two adjacent; the import's are adjacent in
// either case); the transport moves the whole lease in one call
// (frame=lease), or a page at a time (frame=1MiB: handoff's default
// frame holds one 2 MiB page).
//
// Per op it reports, for the staged path (StagedCopier) and, in the same
// run on identical pools, the old per-page path (base-):
//
//   - copies/op: the driver's host↔device copies;
//   - waits/op: the stream synchronisations, each a round trip to the
//     GPU (a synchronous copy is a copy and a wait);
//   - pinned-B/op: bytes that went through page-locked staging, each
//     copied once on the host, by kvcache, to or from Go memory;
//   - pageable-B/op: bytes copied straight from or to Go memory, which
//     the real driver copies once on the host through page-locked memory
//     of its own (the per-page import also first assembles each region
//     in scratch, as every one straddles two parts);
//   - x-copies and x-waits: the baseline's counts over the staged path's,
//     min / median / max over handoffs paired in the same run.
//
// The counts come from the simulated driver and do not vary; wall times
// on it mean nothing for a GPU and are not reported. After the loops the
// last import of each path is read back and compared with the export.
func BenchmarkCUDAHandoffCopiesSimulated(b *testing.B) {
	for _, tokens := range []int{2048, 32768} {
		for _, layout := range []string{"adjacent", "scattered"} {
			for _, frame := range []string{"lease", "1MiB"} {
				b.Run(fmt.Sprintf("tokens=%d/pages=%s/frame=%s", tokens, layout, frame), func(b *testing.B) {
					n := tokens / llamaTPP
					per := n
					if frame == "1MiB" {
						per = max(1, (1<<20)/(llamaRegions*llamaRegionPage))
					}
					staged := newHandoffPair(b, n, layout == "scattered", false)
					base := newHandoffPair(b, n, layout == "scattered", true)
					benchHandoff(b, staged, base, per)
				})
			}
		}
	}
}

// handoffPair is an exported lease on one pool and the pool it is
// imported into, each on a CUDA device over a simulated driver of its
// own.
type handoffPair struct {
	src, dst  *kvcache.Pool
	devs      [2]*cudaops.CUDA
	drivers   [2]*cudaops.FakeDriver
	out       *kvcache.Outgoing
	want      []byte // the exported pages, page-major
	sum       uint32
	parts     [][]byte // want as a transport delivers it
	pages     int
	pageBytes int
	last      *kvcache.Lease // the last import, not yet released
}

// newHandoffPair exports a prefilled lease of n pages; scattered puts no
// two of them adjacent; perPage hides the devices' StagedCopier from the
// pools.
func newHandoffPair(b *testing.B, n int, scattered, perPage bool) *handoffPair {
	b.Helper()
	geom := kvcache.Geometry{TokensPerPage: llamaTPP, Layers: llamaRegions / 2, KVHeads: 1,
		HeadDim: benchRegionPage / (llamaTPP * 2), DType: kvcache.BF16}
	h := &handoffPair{pages: n, pageBytes: int(geom.PageBytes())}
	pool := func(side, pages int) *kvcache.Pool {
		d, f, err := cudaops.OpenFake()
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = d.Close() })
		d.SetCopyStaging(benchStaging)
		if err := d.SetFillMode(cudaops.FillMemset); err != nil { // scrubs at native speed
			b.Fatal(err)
		}
		var dev cudaops.Device = d
		if perPage {
			dev = perPageCopies{d}
		}
		p, err := kvcache.New(kvcache.Config{Device: dev, Geometry: geom, Pages: pages,
			MaxContextTokens: n * llamaTPP, Tenants: []kvcache.TenantConfig{{Name: "a"}}})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = p.Close() })
		h.devs[side], h.drivers[side] = d, f
		return p
	}
	h.src, h.dst = pool(0, 2*n), pool(1, n)
	if scattered {
		// One-page holders on every page; every other one lets go.
		holders := make([]*kvcache.Lease, 2*n)
		for i := range holders {
			l, err := h.src.TryAdmit(kvcache.Request{ID: fmt.Sprint("hold", i), Tenant: "a", PromptTokens: llamaTPP})
			if err != nil {
				b.Fatal(err)
			}
			holders[i] = l
		}
		for i := 0; i < len(holders); i += 2 {
			if err := holders[i].Release(); err != nil {
				b.Fatal(err)
			}
		}
		for h.src.Stats().QuarantinedPages > 0 {
			time.Sleep(time.Millisecond) // the scrubs' fences
		}
	}
	l, err := h.src.TryAdmit(kvcache.Request{ID: "r", Tenant: "a", PromptTokens: n * llamaTPP})
	if err != nil {
		b.Fatal(err)
	}
	table, err := l.BlockTable()
	if err != nil {
		b.Fatal(err)
	}
	adjacent := 0
	for i := 1; i < len(table); i++ {
		if table[i] == table[i-1]+1 {
			adjacent++
		}
	}
	if scattered && adjacent > 0 || !scattered && adjacent != n-1 {
		b.Fatalf("%d of %d pages follow the one before them", adjacent, n)
	}
	rng := rand.New(rand.NewPCG(7, uint64(n)))
	h.want = make([]byte, n*h.pageBytes)
	for i := range h.want {
		h.want[i] = byte(rng.Uint32())
	}
	for i, pg := range table {
		for r := range llamaRegions {
			off := i*h.pageBytes + r*benchRegionPage
			if err := h.devs[0].WritePage(r, pg, h.want[off:off+benchRegionPage]); err != nil {
				b.Fatal(err)
			}
		}
	}
	err = l.BeginPrefill()
	if err == nil {
		err = l.Commit(n * llamaTPP)
	}
	if err == nil {
		err = l.FinishPrefill()
	}
	if err == nil {
		h.out, err = l.Export(time.Now().Add(time.Hour))
	}
	if err == nil {
		h.sum, err = h.out.Checksum()
	}
	if err != nil {
		b.Fatal(err)
	}
	for rest := h.want; len(rest) > 0; rest = rest[benchRegionPage/2:] {
		h.parts = append(h.parts, rest[:benchRegionPage/2])
	}
	return h
}

// handoff reads the export into buf, per pages a call, and writes each
// call's pages into a new import from their parts; it completes the
// import and releases the one before.
func (h *handoffPair) handoff(per int, buf []byte) error {
	if h.last != nil {
		if err := h.last.Release(); err != nil {
			return err
		}
		h.last = nil
	}
	// BeginImport waits for the last import's pages to be scrubbed.
	in, err := h.dst.BeginImport(context.Background(), kvcache.Request{ID: "r", Tenant: "a", PromptTokens: h.pages * llamaTPP}, h.out.Domain(), h.sum)
	if err != nil {
		return err
	}
	partsPerPage := len(h.parts) / h.pages
	for first := 0; first < h.pages; first += per {
		k := min(per, h.pages-first)
		if err := h.out.ReadUnits(first, buf[first*h.pageBytes:(first+k)*h.pageBytes]); err != nil {
			return err
		}
		if err := in.WriteUnitsFrom(first, h.parts[first*partsPerPage:(first+k)*partsPerPage]); err != nil {
			return err
		}
	}
	h.last, err = in.Complete()
	return err
}

// copyCounts are driver work, summed over a pair's two devices.
type copyCounts struct{ copies, waits, pinned, pageable uint64 }

func (h *handoffPair) counts() copyCounts {
	var c copyCounts
	for _, f := range h.drivers {
		toDev, fromDev := asyncCopies(f)
		pinned, pageable := f.CopiedBytes()
		c.copies += uint64(toDev + fromDev)
		c.waits += uint64(f.Calls("cuStreamSynchronize"))
		c.pinned += pinned
		c.pageable += pageable
	}
	return c
}

func (c copyCounts) minus(o copyCounts) copyCounts {
	return copyCounts{c.copies - o.copies, c.waits - o.waits, c.pinned - o.pinned, c.pageable - o.pageable}
}

// maxPairedRuns bounds the handoffs paired for the ratios.
const maxPairedRuns = 5

// verify checks that the last import holds the exported pages.
func (h *handoffPair) verify(b *testing.B) {
	table, err := h.last.BlockTable()
	if err != nil {
		b.Fatal(err)
	}
	page := make([]byte, benchRegionPage)
	for i, pg := range table[:h.pages] {
		for r := range llamaRegions {
			if err := h.devs[1].ReadPage(r, pg, page); err != nil {
				b.Fatal(err)
			}
			off := i*h.pageBytes + r*benchRegionPage
			if !bytes.Equal(page, h.want[off:off+benchRegionPage]) {
				b.Fatalf("imported page %d region %d differs from the export", i, r)
			}
		}
	}
}

func benchHandoff(b *testing.B, staged, base *handoffPair, per int) {
	buf := make([]byte, len(staged.want))
	step := func(h *handoffPair) copyCounts {
		before := h.counts()
		if err := h.handoff(per, buf); err != nil {
			b.Fatal(err)
		}
		if !bytes.Equal(buf, h.want) {
			b.Fatal("the export read other bytes")
		}
		return h.counts().minus(before)
	}
	step(staged) // warm: staging is allocated at the first copy
	step(base)
	var total copyCounts
	for b.Loop() {
		c := step(staged)
		total.copies += c.copies
		total.waits += c.waits
		total.pinned += c.pinned
		total.pageable += c.pageable
	}
	// The baseline, each run paired with one of the staged path.
	var xCopies, xWaits []float64
	var baseCounts copyCounts
	for range min(b.N, maxPairedRuns) {
		s, c := step(staged), step(base)
		baseCounts = c
		xCopies = append(xCopies, float64(c.copies)/float64(s.copies))
		xWaits = append(xWaits, float64(c.waits)/float64(s.waits))
	}
	staged.verify(b)
	base.verify(b)
	n := float64(b.N)
	b.ReportMetric(float64(total.copies)/n, "copies/op")
	b.ReportMetric(float64(total.waits)/n, "waits/op")
	b.ReportMetric(float64(total.pinned)/n, "pinned-B/op")
	b.ReportMetric(float64(total.pageable)/n, "pageable-B/op")
	b.ReportMetric(float64(baseCounts.copies), "base-copies/op")
	b.ReportMetric(float64(baseCounts.waits), "base-waits/op")
	b.ReportMetric(float64(baseCounts.pinned), "base-pinned-B/op")
	b.ReportMetric(float64(baseCounts.pageable), "base-pageable-B/op")
	for _, x := range []struct {
		name string
		v    []float64
	}{{"x-copies", xCopies}, {"x-waits", xWaits}} {
		slices.Sort(x.v)
		b.ReportMetric(x.v[0], x.name+"-min")
		b.ReportMetric(x.v[len(x.v)/2], x.name+"-med")
		b.ReportMetric(x.v[len(x.v)-1], x.name+"-max")
	}
}
