package cudaops_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// Tests of the fill kernel itself. The simulated driver runs the text of
// fill.ptx (internal/ptx), so these catch a kernel that writes too little,
// too much or in the wrong place; without a GPU nothing else would.

// kernelRig is a CUDA device over the simulated driver whose regions have
// every shape the kernel has a path for, and a shadow of every byte they
// span, gaps between adopted pages included.
type kernelRig struct {
	d *cudaops.CUDA
	// stats, on the simulated driver, are what the interpreter ran; nil
	// on a GPU.
	stats func() cudaops.KernelStats
	rng   *rand.Rand
	pages int
	exts  []extent
	// region r lies in exts[ext[r]], its page 0 at offset off[r].
	ext, off []int
}

type extent struct {
	base uint64
	want []byte
}

// rigVariant is how the device launches the kernel: the production
// geometry, or one that makes the kernel's loops iterate and its rarer
// paths run on small regions.
type rigVariant struct {
	name   string
	pages  int    // per region
	block  uint32 // threads per block (0: production)
	chunk  uint32 // target chunk words (0: production)
	inline int    // page IDs a launch may carry (0: production)
}

var rigVariants = []rigVariant{
	// As on a GPU: 256 threads, 16 KiB chunks (region 5's pages are four
	// chunks), page IDs in the parameters.
	{name: "production", pages: 24},
	// Chunks of 64 words, 4 threads: pages of many chunks, some of them
	// empty, and vector loops that iterate.
	{name: "small chunks", pages: 8, block: 4, chunk: 64},
	// Page lists through the staging ring.
	{name: "ring", pages: 12, block: 32, inline: 3},
	// One thread: head and tail loops that iterate.
	{name: "one thread", pages: 6, block: 1, chunk: 16},
}

// newKernelRig lays out the regions of d, which has none yet:
//
//	0  allocated, 1032-byte pages: 258 words (≡ 2 mod 4); even pages are
//	   16-byte aligned, odd ones 8-byte aligned
//	1  allocated, 4096-byte pages: all 16-byte vectors
//	2  adopted, 64-byte pages 72 bytes apart (stride ≡ 8 mod 16): pages
//	   alternately 16- and 8-byte aligned, 8-byte gaps between them
//	3  adopted, 36-byte pages 40 bytes apart at a 4-byte aligned base
//	4  allocated, 16-byte pages: one vector each
//	5  allocated, 49160-byte pages: larger than a chunk, 12290 words
//	6  adopted, 20-byte pages 24 bytes apart at an 8-byte aligned base
//	7  allocated, 48-byte pages
//	8  allocated, 4-byte pages: one word
//	9  allocated, 260-byte pages
//
// The caller closes d after done.
func newKernelRig(d *cudaops.CUDA, stats func() cudaops.KernelStats, rng *rand.Rand, v rigVariant) (*kernelRig, func(), error) {
	rig := &kernelRig{d: d, stats: stats, rng: rng, pages: v.pages}
	var frees []func()
	done := func() {
		for _, fr := range frees {
			fr()
		}
	}
	if err := d.KernelError(); err != nil {
		done()
		return nil, nil, fmt.Errorf("the fill kernel did not load: %w", err)
	}
	d.SetFillBlock(v.block)
	d.SetInlineIDs(v.inline)
	if err := d.SetChunkWords(v.chunk); err != nil {
		done()
		return nil, nil, err
	}
	alloc := func(pb int64) error {
		r, err := d.AllocRegion(v.pages, pb)
		if err != nil {
			return err
		}
		reg := d.Regions()[r]
		rig.addExtent(reg.Base, int(reg.Bytes()), 0)
		return nil
	}
	adopt := func(stride, pb int64, skew uint64) error {
		n := uint64(stride*int64(v.pages)) + 16
		base, free, err := d.Scratch(n)
		if err != nil {
			return err
		}
		frees = append(frees, free)
		if _, err := d.AdoptRegion(base+skew, v.pages, stride, pb); err != nil {
			return err
		}
		rig.addExtent(base, int(n), int(skew))
		return nil
	}
	for _, step := range []func() error{
		func() error { return alloc(1032) },
		func() error { return alloc(4096) },
		func() error { return adopt(72, 64, 0) },
		func() error { return adopt(40, 36, 4) },
		func() error { return alloc(16) },
		func() error { return alloc(49160) },
		func() error { return adopt(24, 20, 8) },
		func() error { return alloc(48) },
		func() error { return alloc(4) },
		func() error { return alloc(260) },
	} {
		if err := step(); err != nil {
			done()
			return nil, nil, err
		}
	}
	for _, e := range rig.exts {
		for i := range e.want {
			e.want[i] = byte(rng.Uint32())
		}
		if err := d.CopyIn(e.base, e.want); err != nil {
			done()
			return nil, nil, err
		}
	}
	return rig, done, nil
}

func (r *kernelRig) addExtent(base uint64, n, off int) {
	r.ext = append(r.ext, len(r.exts))
	r.off = append(r.off, off)
	r.exts = append(r.exts, extent{base: base, want: make([]byte, n)})
}

// fill runs one FillSpans (spans nil: Fill of pages over every region),
// waits, records what it must have written, and compares every byte of
// every extent. In kernel mode the kernel must also have stored exactly
// the bytes the fill covers (no byte twice), in one launch per
// FillSpanSlots non-empty spans.
func (r *kernelRig) fill(spans []cudaops.Span, pages []int32, spec cudaops.FillSpec) error {
	before := r.d.Counters()
	var kBefore cudaops.KernelStats
	if r.stats != nil {
		kBefore = r.stats()
	}
	var fc cudaops.Fence
	var err error
	if spans == nil {
		fc, err = r.d.Fill(pages, spec, cudaops.Ordering{})
		spans = []cudaops.Span{{First: 0, Count: len(r.d.Regions()), Pages: pages}}
	} else {
		fc, err = r.d.FillSpans(spans, spec, cudaops.Ordering{})
	}
	if err != nil {
		return err
	}
	if err := fc.Wait(); err != nil {
		return err
	}
	regs := r.d.Regions()
	nonEmpty := 0
	for _, s := range spans {
		if len(s.Pages) > 0 {
			nonEmpty++
		}
		for ri := s.First; ri < s.First+s.Count; ri++ {
			reg, e := regs[ri], r.exts[r.ext[ri]]
			for _, p := range s.Pages {
				local := p - s.IDBase
				w := spec.WordFor(local)
				at := r.off[ri] + int(int64(local)*reg.Stride)
				for i := 0; i < int(reg.PageBytes); i += 4 {
					binary.LittleEndian.PutUint32(e.want[at+i:], w)
				}
			}
		}
	}
	for ei, e := range r.exts {
		got := make([]byte, len(e.want))
		if err := r.d.CopyOut(e.base, got); err != nil {
			return err
		}
		if !bytes.Equal(got, e.want) {
			i := 0
			for got[i] == e.want[i] {
				i++
			}
			return fmt.Errorf("%s: %s differs first at byte %d: got %#02x, want %#02x", r.d.Stats().Mode, r.where(ei, i), i, got[i], e.want[i])
		}
	}
	if r.d.Stats().Mode != cudaops.FillKernel {
		return nil
	}
	after := r.d.Counters()
	if r.stats != nil {
		if filled, stored := after.BytesFilled-before.BytesFilled, r.stats().BytesStored-kBefore.BytesStored; int64(filled) != stored {
			return fmt.Errorf("the kernel stored %d bytes for a fill of %d", stored, filled)
		}
	}
	want := uint64(nonEmpty+cudaops.FillSpanSlots-1) / cudaops.FillSpanSlots
	if got := after.Launches - before.Launches; got != want {
		return fmt.Errorf("%d launches for a fill of %d spans, want %d", got, nonEmpty, want)
	}
	return nil
}

// where names the region and page (or gap) byte i of extent ei is in.
func (r *kernelRig) where(ei, i int) string {
	regs := r.d.Regions()
	for ri, x := range r.ext {
		if x != ei {
			continue
		}
		rel := int64(i - r.off[ri])
		p, in := rel/regs[ri].Stride, rel%regs[ri].Stride
		if rel < 0 || p >= int64(regs[ri].Pages) {
			return fmt.Sprintf("region %d, outside its pages", ri)
		}
		if in >= regs[ri].PageBytes {
			return fmt.Sprintf("region %d, the gap after page %d", ri, p)
		}
		return fmt.Sprintf("region %d page %d (word %d of %d)", ri, p, in/4, regs[ri].PageBytes/4)
	}
	return fmt.Sprintf("extent %d", ei)
}

// check runs every batch shape: single pages, single regions, every page
// over grids of 2 and 3 blocks, several spans, more spans than one launch
// takes, and a scattered batch; it returns the first that went wrong.
func (r *kernelRig) check() error {
	canary := cudaops.FillSpec{Word: r.rng.Uint32(), PageSalt: 0x9e3779b9, ClearMask: 0x40004000}
	poison := cudaops.FillSpec{Word: 0x80008000}
	n := int32(r.pages)
	all := make([]int32, n)
	for i := range all {
		all[i] = int32(i)
	}
	scattered := append([]int32(nil), all...)
	r.rng.Shuffle(len(scattered), func(i, j int) { scattered[i], scattered[j] = scattered[j], scattered[i] })
	scattered = scattered[:n/2]
	odd, shifted := []int32{}, []int32{}
	for p := int32(1); p < n; p += 2 {
		odd = append(odd, p)
	}
	for _, p := range scattered[:3] {
		shifted = append(shifted, 1000+p)
	}
	var each []cudaops.Span // one span per region, each with its own pages
	for ri := range r.d.Regions() {
		each = append(each, cudaops.Span{First: ri, Count: 1, IDBase: int32(100 * ri), Pages: []int32{int32(100*ri) + int32(ri)%n, int32(100*ri) + (n - 1)}})
	}
	steps := []struct {
		name  string
		spans []cudaops.Span
		pages []int32
		spec  cudaops.FillSpec
		grid  uint32
	}{
		{"one page", nil, []int32{4}, poison, 0},
		{"one odd page", nil, []int32{n - 1}, canary, 0},
		{"one region", []cudaops.Span{{First: 1, Count: 1, Pages: []int32{0, 3, n - 1}}}, nil, canary, 0},
		{"one region, strided", []cudaops.Span{{First: 2, Count: 1, Pages: odd}}, nil, poison, 0},
		{"one region, larger than a chunk", []cudaops.Span{{First: 5, Count: 1, Pages: odd}}, nil, canary, 0},
		{"every page over 3 blocks", nil, all, canary, 3},
		{"several spans", []cudaops.Span{
			{First: 0, Count: 1, Pages: odd},
			{First: 2, Count: 2, IDBase: 1000, Pages: shifted},
			{First: 4, Count: 1, Pages: []int32{2}},
			{First: 5, Count: 2}, // no pages
			{First: 7, Count: 3, Pages: scattered},
		}, nil, canary, 0},
		{"several spans over 2 blocks", []cudaops.Span{
			{First: 3, Count: 3, Pages: scattered},
			{First: 0, Count: 3, IDBase: 1000, Pages: shifted},
			{First: 6, Count: 4, Pages: odd},
		}, nil, poison, 2},
		{"a span per region, more than a launch takes", each, nil, canary, 0},
		{"a span per region over 3 blocks", each, nil, poison, 3},
		{"scattered", nil, scattered, cudaops.FillSpec{}, 0},
	}
	for _, s := range steps {
		if s.grid != 0 {
			r.d.SetGridLimit(s.grid)
		}
		err := r.fill(s.spans, s.pages, s.spec)
		r.d.SetGridLimit(0)
		if err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return nil
}

// The fill kernel, run from its text, writes exactly the pages of every
// batch shape in every region shape, and nothing else (a kernel that
// skipped words, wrote gaps or stored a byte twice used to pass every
// test: the simulated driver re-implemented the kernel in Go).
func TestCUDAFillKernelWroteWrongBytes(t *testing.T) {
	for _, mode := range []cudaops.FillMode{cudaops.FillKernel, cudaops.FillMemset} {
		for _, v := range rigVariants {
			if mode == cudaops.FillMemset && v.name != "production" {
				continue
			}
			t.Run(mode.String()+"/"+v.name, func(t *testing.T) {
				seed := uint64(rand.Uint32())
				t.Logf("seed %d", seed)
				d, f := openFake(t)
				rig, done, err := newKernelRig(d, f.KernelStats, rand.New(rand.NewPCG(seed, 1)), v)
				require.NoError(t, err)
				defer done()
				require.NoError(t, rig.d.SetFillMode(mode))
				require.NoError(t, rig.check())
			})
		}
	}
}

// TestCUDAFillKernelGPU is the same check on GPU 0: the JIT-compiled
// kernel writes exactly every batch shape in every region shape, in every
// variant (it skips without a GPU; scripts/gpu-check.sh runs it, also
// under compute-sanitizer's memcheck).
func TestCUDAFillKernelGPU(t *testing.T) {
	for _, v := range rigVariants {
		t.Run(v.name, func(t *testing.T) {
			d := openGPU(t)
			defer d.Close()
			seed := uint64(rand.Uint32())
			t.Logf("seed %d", seed)
			rig, done, err := newKernelRig(d, nil, rand.New(rand.NewPCG(seed, 1)), v)
			require.NoError(t, err)
			defer done()
			require.NoError(t, rig.check())
		})
	}
}

// kernelMutants are edits of fill.ptx that break it in ways a test must
// notice; the kernel text must contain each pattern exactly once.
var kernelMutants = []struct{ name, from, to string }{
	{"vector stride 8 bytes", "shl.b64\t\t%rd29, %rd28, 4;", "shl.b64\t\t%rd29, %rd28, 3;"},
	{"tail loop dropped", "@%p5 bra\tTAIL;", "@%p5 bra\tNEXTCHUNK;"},
	{"head loop dropped", "@%p4 bra\tBODY;", "bra\t\tBODY;"},
	{"region table stride 24", "mul.wide.u32\t%rd4, %r16, 32;", "mul.wide.u32\t%rd4, %r16, 24;"},
	{"chunk shift ignored", "shr.u64\t\t%rd13, %rd11, %r18;", "mov.u64\t\t%rd13, %rd11;"},
	{"empty chunk written", "@%p3 bra\tNEXTCHUNK;\t\t// an empty last chunk", "// an empty last chunk"},
	{"chunk stride 1", "add.s64\t\t%rd11, %rd11, %rd12;", "add.s64\t\t%rd11, %rd11, 1;"},
	{"slot stride 1", "add.u32\t\t%r8, %r8, %r19;", "add.u32\t\t%r8, %r8, 1;"},
	{"span list offset ignored", "cvt.u64.u32\t%rd24, %r14;", "mov.u64\t\t%rd24, 0;"},
	{"thread stride 1 in the vector loop", "add.s64\t\t%rd28, %rd28, %rd23;\n\tbra\t\tVECTORS;", "add.s64\t\t%rd28, %rd28, 1;\n\tbra\t\tVECTORS;"},
	{"salt ignored", "mul.lo.u32\t%r21, %r20, %r2;", "mov.u32\t\t%r21, 0;"},
	{"ring list ignored", "@!%p7 bra\tLISTID;", "// no list"},
}

// Each mutant of the kernel must load (it is still valid PTX) and fail
// the geometry check in some variant: a check that passes a broken kernel
// checks nothing.
func TestCUDAFillKernelMutantSurvived(t *testing.T) {
	src := string(cudaops.FillKernelPTX())
	for _, m := range kernelMutants {
		t.Run(m.name, func(t *testing.T) {
			require.Equal(t, 1, strings.Count(src, m.from), "fill.ptx no longer holds %q once: update the mutant", m.from)
			var caught error
			for _, v := range rigVariants {
				f := cudaops.NewFakeDriver()
				f.SetBudget(1 << 24)
				f.RewriteImage(func(image []byte) []byte {
					return []byte(strings.Replace(string(image), m.from, m.to, 1))
				})
				d, err := cudaops.OpenOn(f, 0)
				require.NoError(t, err)
				require.NoError(t, d.KernelError(), "the mutant must still load")
				rig, done, err := newKernelRig(d, f.KernelStats, rand.New(rand.NewPCG(1, 1)), v)
				require.NoError(t, err)
				caught = rig.check()
				done()
				_ = d.Close() // fails after a mutant's fault: the context is poisoned, as on a GPU
				if caught != nil {
					t.Logf("caught in %s: %v", v.name, caught)
					break
				}
			}
			require.Error(t, caught, "the mutant passed every variant")
		})
	}
}

// A Go argument list that does not match the kernel's declared parameters
// (here the kernel text is changed to declare one differently) must fail
// the launch, loudly, instead of handing the GPU garbage.
func TestCUDAFillLaunchedWithMismatchedParams(t *testing.T) {
	for _, c := range []struct{ name, from, to, want string }{
		{"type", ".param .u32 kvf_fill_nslots", ".param .u64 kvf_fill_nslots", "kvf_fill_nslots is .u64 (8 bytes), the launch passes 4 bytes"},
		{"name", "kvf_fill_salt", "kvf_fill_pepper", "parameter 3 is kvf_fill_pepper, the launch passes kvf_fill_salt"},
		{"array size", "kvf_fill_ids[2048]", "kvf_fill_ids[1024]", "kvf_fill_ids is .b8 (1024 bytes), the launch passes 2048 bytes"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := cudaops.NewFakeDriver()
			f.RewriteImage(func(image []byte) []byte {
				return []byte(strings.ReplaceAll(string(image), c.from, c.to))
			})
			d, err := cudaops.OpenOn(f, 0)
			require.NoError(t, err)
			defer d.Close()
			// The warm-up launch at open fails, so the device fills with
			// memsets and says why.
			require.Error(t, d.KernelError())
			assert.ErrorContains(t, d.KernelError(), c.want)
			assert.ErrorContains(t, d.KernelError(), "CUDA_ERROR_INVALID_VALUE")
			assert.Equal(t, cudaops.FillMemset, d.Stats().Mode)
		})
	}
}

// A kernel the interpreter finds faulting (an out-of-bounds store) fails
// the fill's fence with the driver's error and the interpreter's account
// of the thread and the instruction.
func TestCUDAFillKernelFaultWasSilent(t *testing.T) {
	f := cudaops.NewFakeDriver()
	// Every store lands a page further than it should.
	f.RewriteImage(func(image []byte) []byte {
		return []byte(strings.Replace(string(image), "mad.lo.u64\t%rd19, %rd19, %rd6, %rd5;", "mad.lo.u64\t%rd19, %rd19, %rd6, %rd5;\n\tadd.s64\t\t%rd19, %rd19, %rd6;", 1))
	})
	d, err := cudaops.OpenOn(f, 0)
	require.NoError(t, err)
	defer d.Close()
	require.NoError(t, d.KernelError())
	_, err = d.AllocRegion(4, 64)
	require.NoError(t, err)
	fc, err := d.Fill([]int32{3}, cudaops.FillSpec{}, cudaops.Ordering{})
	require.NoError(t, err)
	err = fc.Wait()
	require.ErrorIs(t, err, cudaops.ErrDriver)
	assert.ErrorContains(t, err, "CUDA_ERROR_ILLEGAL_ADDRESS")
	assert.ErrorContains(t, err, "not inside one allocation")
	var de *cudaops.DriverError
	require.True(t, errors.As(err, &de))
}

// A kernel that never ends is stopped by the instruction budget and fails
// its fence, instead of hanging the test.
func TestCUDAFillKernelRanForever(t *testing.T) {
	f := cudaops.NewFakeDriver()
	f.RewriteImage(func(image []byte) []byte {
		return []byte(strings.Replace(string(image), "add.s64\t\t%rd11, %rd11, %rd12;", "add.s64\t\t%rd11, %rd11, 0;", 1))
	})
	f.SetBudget(1 << 16)
	d, err := cudaops.OpenOn(f, 0)
	require.NoError(t, err)
	defer d.Close()
	require.NoError(t, d.KernelError(), "no span at warm-up: it ends")
	_, err = d.AllocRegion(4, 64)
	require.NoError(t, err)
	fc, err := d.Fill([]int32{1}, cudaops.FillSpec{}, cudaops.Ordering{})
	require.NoError(t, err)
	err = fc.Wait()
	require.ErrorIs(t, err, cudaops.ErrDriver)
	assert.ErrorContains(t, err, "CUDA_ERROR_LAUNCH_TIMEOUT")
	assert.ErrorContains(t, err, "instruction budget")
}

// An image outside the interpreter's subset is refused at load with the
// parser's message as the JIT log, and the device falls back to memsets.
func TestCUDAKernelOutsideSubsetLoaded(t *testing.T) {
	f := cudaops.NewFakeDriver()
	f.RewriteImage(func(image []byte) []byte {
		return []byte(strings.Replace(string(image), "ret;", "bar.sync 0;\n\tret;", 1))
	})
	d, err := cudaops.OpenOn(f, 0)
	require.NoError(t, err)
	defer d.Close()
	require.Error(t, d.KernelError())
	assert.ErrorContains(t, d.KernelError(), "CUDA_ERROR_INVALID_PTX")
	assert.ErrorContains(t, d.KernelError(), `opcode "bar.sync" is not in the subset`)
	assert.Equal(t, cudaops.FillMemset, d.Stats().Mode)
}
