package cudaops_test

import (
	"bytes"
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// Handoff copies on CUDA, over the simulated driver: the device's staged
// copies (StagedCopier) on their own, and kvcache's export and import,
// which copy through them, on CUDA pools.

// asyncCopies is how many copies were queued each way so far.
func asyncCopies(f *cudaops.FakeDriver) (toDevice, fromDevice int) {
	return f.Calls("cuMemcpyHtoDAsync_v2"), f.Calls("cuMemcpyDtoHAsync_v2")
}

// stagedCopies is what a StagedCopier call must queue: per batch of per
// pages, one copy per run of adjacent pages for each contiguous region
// and one per page for each strided one; and one wait per batch.
func stagedCopies(regions []cudaops.Region, pages []int32, per int) (copies, waits int) {
	for first := 0; first < len(pages); first += per {
		batch := pages[first:min(first+per, len(pages))]
		runs := 1
		for j := 1; j < len(batch); j++ {
			if batch[j] != batch[j-1]+1 {
				runs++
			}
		}
		for _, r := range regions {
			if r.Contiguous() {
				copies += runs
			} else {
				copies += len(batch)
			}
		}
		waits++
	}
	return copies, waits
}

// A staged copy of several regions queues one async copy per run of
// adjacent pages per contiguous region (one per page in a strided one)
// and waits once per staging buffer's worth, over all its regions: here
// 41 pages in 4 runs of two contiguous regions (256 and 512 bytes a page)
// and a strided one (256), staged 16 pages (16 KiB) at a time, are 3
// batches of 1, 3 and 1 runs: 2×5 + 41 copies each way, 3 waits.
func TestCUDAStagedCopiesCoalesceRuns(t *testing.T) {
	d, f := openFake(t)
	d.SetCopyStaging(16 << 10)
	const n = 64
	_, err := d.AllocRegion(n, 256)
	require.NoError(t, err)
	_, err = d.AllocRegion(n, 512)
	require.NoError(t, err)
	base, free, err := d.Scratch(2 * n * 256)
	require.NoError(t, err)
	t.Cleanup(free)
	_, err = d.AdoptRegion(base, n, 512, 256) // strided: pages 512 bytes apart
	require.NoError(t, err)
	regs := d.Regions()
	var pages []int32
	for _, run := range [][2]int32{{0, 16}, {20, 30}, {40, 41}, {50, 64}} {
		for p := run[0]; p < run[1]; p++ {
			pages = append(pages, p)
		}
	}
	require.Len(t, pages, 41)
	copies, waits := stagedCopies(regs, pages, 16)
	require.Equal(t, 2*5+41, copies)
	require.Equal(t, 3, waits)

	regions := []int{0, 1, 2}
	rng := rand.New(rand.NewPCG(1, 2))
	want := make([][][]byte, len(regions)) // [region][item] bytes
	for k, r := range regions {
		for range pages {
			b := make([]byte, regs[r].PageBytes)
			for i := range b {
				b[i] = byte(rng.Uint32())
			}
			want[k] = append(want[k], b)
		}
	}
	h0, _ := asyncCopies(f)
	s0 := f.Calls("cuStreamSynchronize")
	batches := 0
	require.NoError(t, d.WriteStaged(regions, pages, func(first int, staged [][]byte) {
		batches++
		for k, r := range regions {
			pb := int(regs[r].PageBytes)
			for j := 0; j*pb < len(staged[k]); j++ {
				copy(staged[k][j*pb:(j+1)*pb], want[k][first+j])
			}
		}
	}))
	h1, _ := asyncCopies(f)
	assert.Equal(t, copies, h1-h0, "copies to the device")
	assert.Equal(t, waits, f.Calls("cuStreamSynchronize")-s0, "waits")
	assert.Equal(t, waits, batches, "fills")
	for k, r := range regions {
		for i, p := range pages {
			assert.Equal(t, want[k][i], readPage(t, d, r, p), "region %d page %d", r, p)
		}
	}

	_, d1 := asyncCopies(f)
	s1 := f.Calls("cuStreamSynchronize")
	got := make([][][]byte, len(regions))
	require.NoError(t, d.ReadStaged(regions, pages, func(first int, staged [][]byte) {
		for k, r := range regions {
			pb := int(regs[r].PageBytes)
			for j := 0; j*pb < len(staged[k]); j++ {
				got[k] = append(got[k], bytes.Clone(staged[k][j*pb:(j+1)*pb]))
			}
		}
	}))
	_, d2 := asyncCopies(f)
	assert.Equal(t, copies, d2-d1, "copies from the device")
	assert.Equal(t, waits, f.Calls("cuStreamSynchronize")-s1, "waits")
	assert.Equal(t, want, got)
	// The strided region's gaps are untouched.
	assert.Equal(t, make([]byte, 256), copyOut(t, d, base+256, 256), "between the adopted region's pages 0 and 1")
}

func copyOut(t *testing.T, d *cudaops.CUDA, addr uint64, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	require.NoError(t, d.CopyOut(addr, b))
	return b
}

// handoffPool is a kvcache pool on a CUDA device over the simulated
// driver, with 4 regions of 1,600-byte pages (so a 6,400-byte page's
// 4 KiB checksum blocks straddle regions), whose staged copies take
// stagingPages pages at a time.
type handoffPool struct {
	d *cudaops.CUDA
	f *cudaops.FakeDriver
	p *kvcache.Pool
}

const (
	handoffTPP        = 4
	handoffRegionPage = handoffTPP * 200 * 2 // 4 tokens × 1 head × 200 × FP16
	handoffPage       = 4 * handoffRegionPage
)

// openHandoffPool opens a pool of pages pages. With adopted, its regions
// are engine tensors: layer 0's K and V interleaved in one (vLLM's
// [num_blocks, 2, …], so strided regions), layer 1's split (contiguous).
func openHandoffPool(t *testing.T, pages, stagingPages int, adopted bool) handoffPool {
	t.Helper()
	d, f := openFake(t)
	d.SetCopyStaging(stagingPages * handoffPage)
	// Scrubs by memset: the kernel's own tests run fill.ptx, and the
	// interpreter would make these slow.
	require.NoError(t, d.SetFillMode(cudaops.FillMemset))
	cfg := kvcache.Config{Device: d, Pages: pages, MaxContextTokens: pages * handoffTPP,
		Tenants: []kvcache.TenantConfig{{Name: "a"}}}
	if adopted {
		regs := kvcache.AttentionKV(2, 1, 200, kvcache.FP16, handoffTPP)
		pb := regs[0].PageBytes
		tensor := uint64(2 * int64(pages) * pb)
		base, free, err := d.Scratch(2 * tensor)
		require.NoError(t, err)
		t.Cleanup(free) // after the pool's Close, before the device's
		k0, v0, err := kvcache.FusedKVMemory(kvcache.KVInterleaved, pages, pb, base, nil)
		require.NoError(t, err)
		k1, v1, err := kvcache.FusedKVMemory(kvcache.KVSplit, pages, pb, base+tensor, nil)
		require.NoError(t, err)
		regs[0].Memory, regs[1].Memory, regs[2].Memory, regs[3].Memory = k0, v0, k1, v1
		cfg.Cache = kvcache.CacheSpec{Groups: []kvcache.CacheGroup{{Name: "kv", Kind: kvcache.GroupPerToken,
			TokensPerPage: handoffTPP, Regions: regs}}}
	} else {
		cfg.Geometry = kvcache.Geometry{TokensPerPage: handoffTPP, Layers: 2, KVHeads: 1, HeadDim: 200, DType: kvcache.FP16}
	}
	p, err := kvcache.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	require.Equal(t, int64(handoffPage), p.PageBytes())
	regs := d.Regions()
	require.Len(t, regs, 4)
	if adopted {
		assert.False(t, regs[0].Contiguous() || regs[1].Contiguous(), "layer 0 is interleaved")
		assert.True(t, regs[2].Contiguous() && regs[3].Contiguous(), "layer 1 is split")
	}
	return handoffPool{d: d, f: f, p: p}
}

// prefill admits a request of prompt tokens whose pages are both
// scattered and adjacent (others' leases hold pages in between), writes
// random bytes into them through the device and finishes its prefill.
// It returns the lease and its pages' bytes, page-major.
func (h handoffPool) prefill(t *testing.T, rng *rand.Rand, prompt int) (*kvcache.Lease, []byte) {
	t.Helper()
	// Fragment the free pages: hold some, release every other holder.
	var holders []*kvcache.Lease
	for i := range 6 {
		l, err := h.p.TryAdmit(kvcache.Request{ID: "hold" + string(rune('0'+i)), Tenant: "a", PromptTokens: (1 + i%3) * handoffTPP})
		require.NoError(t, err)
		holders = append(holders, l)
	}
	for i := 0; i < len(holders); i += 2 {
		require.NoError(t, holders[i].Release())
	}
	scrubbed(t, h.p)
	l, err := h.p.TryAdmit(kvcache.Request{ID: "r", Tenant: "a", PromptTokens: prompt})
	require.NoError(t, err)
	table, err := l.BlockTable()
	require.NoError(t, err)
	adjacent, apart := false, false
	for i := 1; i < len(table); i++ {
		adjacent = adjacent || table[i] == table[i-1]+1
		apart = apart || table[i] != table[i-1]+1
	}
	require.True(t, adjacent && apart, "the lease's pages %v are not both adjacent and scattered", table)
	content := make([]byte, len(table)*handoffPage)
	for i := range content {
		content[i] = byte(rng.Uint32())
	}
	for i, pg := range table {
		for r := range 4 {
			off := i*handoffPage + r*handoffRegionPage
			require.NoError(t, h.d.WritePage(r, pg, content[off:off+handoffRegionPage]))
		}
	}
	require.NoError(t, l.BeginPrefill())
	require.NoError(t, l.Commit(prompt))
	require.NoError(t, l.FinishPrefill())
	return l, content
}

// scrubbed waits until no page of p is waiting for its scrub's fence.
func scrubbed(t *testing.T, p *kvcache.Pool) {
	t.Helper()
	require.Eventually(t, func() bool { return p.Stats().QuarantinedPages == 0 }, 10*time.Second, time.Millisecond)
}

// leaseContent reads n pages of l back through the device, page-major.
func (h handoffPool) leaseContent(t *testing.T, l *kvcache.Lease, n int) []byte {
	t.Helper()
	table, err := l.BlockTable()
	require.NoError(t, err)
	var b []byte
	for _, pg := range table[:n] {
		for r := range 4 {
			b = append(b, readPage(t, h.d, r, pg)...)
		}
	}
	return b
}

// parts cuts b into gRPC-like pieces: mostly 16 KiB, some short, some
// empty, so page regions straddle them.
func parts(b []byte, rng *rand.Rand) [][]byte {
	var ps [][]byte
	for len(b) > 0 {
		n := min(len(b), []int{16 << 10, 16 << 10, 1000, 0, 3}[rng.IntN(5)])
		ps = append(ps, b[:n])
		b = b[n:]
	}
	return ps
}

// A CUDA export → import round trip moves every byte, the checksums of
// the two sides agree (the import sums what it staged), and each side's
// copies are staged copies: one async copy per run of adjacent pages per
// contiguous region (per page in a strided one) per staging batch, one
// wait per batch, no synchronous copy. Batches here are 3 pages, so a
// 10-page lease takes several, and runs are cut at their ends.
func TestCUDAHandoffRoundTrip(t *testing.T) {
	for _, adopted := range []bool{false, true} {
		name := map[bool]string{false: "allocated", true: "adopted"}[adopted]
		t.Run(name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(3, uint64(len(name))))
			const prompt, pages, per = 10 * handoffTPP, 10, 3
			src := openHandoffPool(t, 32, per, adopted)
			dst := openHandoffPool(t, 32, per, adopted)
			l, want := src.prefill(t, rng, prompt)
			out, err := l.Export(time.Now().Add(time.Hour))
			require.NoError(t, err)
			srcTable, err := l.BlockTable()
			require.NoError(t, err)

			_, d0 := asyncCopies(src.f)
			s0 := src.f.Calls("cuStreamSynchronize")
			_, pageable0 := src.f.CopiedBytes()
			got := make([]byte, pages*handoffPage)
			require.NoError(t, out.ReadUnits(0, got))
			require.True(t, bytes.Equal(want, got), "the export read other bytes")
			_, d1 := asyncCopies(src.f)
			copies, waits := stagedCopies(src.d.Regions(), srcTable[:pages], per)
			assert.Equal(t, copies, d1-d0, "export: copies from the device")
			assert.Equal(t, waits, src.f.Calls("cuStreamSynchronize")-s0, "export: waits")
			_, pageable1 := src.f.CopiedBytes()
			assert.Equal(t, pageable0, pageable1, "export: a synchronous copy of Go memory")

			sum, err := out.Checksum()
			require.NoError(t, err)
			var sums []uint64
			for i := range pages {
				sums = append(sums, kvcache.PageChecksum(want[i*handoffPage:(i+1)*handoffPage]))
			}
			require.Equal(t, kvcache.ContentChecksum(sums), sum)

			in, err := dst.p.BeginImport(context.Background(), kvcache.Request{ID: "r", Tenant: "a", PromptTokens: prompt}, out.Domain(), sum)
			require.NoError(t, err)
			h0, _ := asyncCopies(dst.f)
			s0 = dst.f.Calls("cuStreamSynchronize")
			_, pageable0 = dst.f.CopiedBytes()
			// Pages 4… first, then 0…3: two calls, out of order.
			const split = 4
			require.NoError(t, in.WriteUnitsFrom(split, parts(want[split*handoffPage:], rng)))
			require.NoError(t, in.WriteUnitsFrom(0, parts(want[:split*handoffPage], rng)))
			h1, _ := asyncCopies(dst.f)
			_, pageable1 = dst.f.CopiedBytes()
			delivered, err := in.Complete()
			require.NoError(t, err, "the import's sums are the export's")
			dstTable, err := delivered.BlockTable()
			require.NoError(t, err)
			c1, w1 := stagedCopies(dst.d.Regions(), dstTable[split:pages], per)
			c2, w2 := stagedCopies(dst.d.Regions(), dstTable[:split], per)
			assert.Equal(t, c1+c2, h1-h0, "import: copies to the device")
			assert.Equal(t, w1+w2, dst.f.Calls("cuStreamSynchronize")-s0, "import: waits")
			assert.Equal(t, pageable0, pageable1, "import: a synchronous copy of Go memory")
			assert.True(t, bytes.Equal(want, dst.leaseContent(t, delivered, pages)), "the imported pages differ")

			require.NoError(t, out.Ack())
			require.NoError(t, delivered.Release())
			require.NoError(t, src.p.Check())
			require.NoError(t, dst.p.Check())
		})
	}
}

// A driver failure in the middle of a staged copy (a later batch's copy
// refused, or a copy that faults when it runs) fails the read or write
// with ErrDevice and leaves each pool consistent. A failed import is
// aborted; after a refused copy the device still works, so a second
// import of the same pages completes, and a failed export read can be
// retried. A fault poisons the context, as on a GPU: the abort's scrub
// then fails too, and the pool retires the pages instead of reusing them.
func TestCUDAHandoffDriverFailure(t *testing.T) {
	const prompt, pages, per = 10 * handoffTPP, 10, 3
	rng := rand.New(rand.NewPCG(5, 6))
	src := openHandoffPool(t, 32, per, true)
	l, want := src.prefill(t, rng, prompt)
	out, err := l.Export(time.Now().Add(time.Hour))
	require.NoError(t, err)
	sum, err := out.Checksum()
	require.NoError(t, err)

	table, err := l.BlockTable()
	require.NoError(t, err)
	// Fail the second copy of the second batch.
	firstBatch, _ := stagedCopies(src.d.Regions(), table[:per], per)

	t.Run("export read", func(t *testing.T) {
		src.f.FailLater("cuMemcpyDtoHAsync_v2", firstBatch+1, 719)
		err := out.ReadUnits(0, make([]byte, pages*handoffPage))
		require.ErrorIs(t, err, kvcache.ErrDevice)
		require.ErrorIs(t, err, cudaops.ErrDriver)
		require.ErrorContains(t, err, "reading pages [3, 6) of the 10 listed, region 0", "not the second batch's second copy")
		require.NoError(t, src.p.Check())
		require.True(t, out.Live(), "a failed read ends no export")
		got := make([]byte, pages*handoffPage)
		require.NoError(t, out.ReadUnits(0, got))
		require.True(t, bytes.Equal(want, got))
	})

	for _, how := range []string{"refused copy", "faulting copy"} {
		t.Run("import/"+how, func(t *testing.T) {
			dst := openHandoffPool(t, 32, per, true)
			begin := func() *kvcache.Incoming {
				in, err := dst.p.BeginImport(context.Background(), kvcache.Request{ID: "r", Tenant: "a", PromptTokens: prompt}, out.Domain(), sum)
				require.NoError(t, err)
				return in
			}
			in := begin()
			if how == "refused copy" {
				// A fresh pool's pages are adjacent: the first batch is
				// 2×3 copies of the strided regions and one of each
				// contiguous one.
				dst.f.FailLater("cuMemcpyHtoDAsync_v2", 2*3+2+1, 719)
			} else {
				dst.f.FaultNext("cuMemcpyHtoDAsync_v2", 700)
			}
			err := in.WriteUnitsFrom(0, parts(want, rng))
			require.ErrorIs(t, err, kvcache.ErrDevice)
			require.ErrorIs(t, err, cudaops.ErrDriver)
			if how == "refused copy" {
				require.ErrorContains(t, err, "writing pages [3, 6) of the 10 listed, region 0", "not the second batch's second copy")
			}
			scrubbed(t, dst.p)
			s := dst.p.Stats()
			assert.Zero(t, s.InUsePages+s.QuarantinedPages+s.LiveLeases, "the failed import was not aborted")
			require.NoError(t, dst.p.Check())
			_, err = in.Complete()
			require.ErrorIs(t, err, kvcache.ErrIncompleteTransfer, "a failed import completed")
			if how == "faulting copy" {
				assert.Equal(t, pages, s.RetiredPages, "pages scrubbed on a poisoned context")
				assert.NotEmpty(t, s.Fault)
				return
			}
			assert.Zero(t, s.RetiredPages)
			again := begin()
			require.NoError(t, again.WriteUnitsFrom(0, parts(want, rng)))
			delivered, err := again.Complete()
			require.NoError(t, err)
			assert.True(t, bytes.Equal(want, dst.leaseContent(t, delivered, pages)))
			require.NoError(t, delivered.Release())
			require.NoError(t, dst.p.Check())
		})
	}
	require.NoError(t, out.Abort())
	require.NoError(t, src.p.Check())
}
