package cudaops

import (
	"math/rand/v2"
	"testing"

	"github.com/kvfence/kvfence/internal/ptx"
)

// A region's chunking must cover its page exactly once: 1<<shift chunks
// of words words reach the page's end, every chunk starts at the page's
// 16-byte phase (words a multiple of 4), no chunk is above the target
// (but for the rounding to 4), and the shift is the least that does.
func TestChunksForLeftWordsOut(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	check := func(pw, target uint64) {
		c := chunksFor(pw, target)
		k := uint64(1) << c.shift
		switch {
		case c.words%4 != 0:
			t.Fatalf("chunksFor(%d, %d) = %+v: chunk not a multiple of 4 words", pw, target, c)
		case k*uint64(c.words) < pw:
			t.Fatalf("chunksFor(%d, %d) = %+v: chunks end before the page", pw, target, c)
		case uint64(c.words) > target+3 && k > 1:
			t.Fatalf("chunksFor(%d, %d) = %+v: chunks above the target", pw, target, c)
		case c.shift > 0 && (k/2)*target >= pw:
			t.Fatalf("chunksFor(%d, %d) = %+v: more chunks than needed", pw, target, c)
		}
	}
	for _, pw := range []uint64{1, 2, 3, 4, 5, 9, 16, 258, 1024, 4095, 4096, 4097, 8192, 8193, 12290, 1 << 38} {
		for _, target := range []uint64{4, 16, 64, chunkWords} {
			check(pw, target)
		}
	}
	for range 20000 {
		check(1+rng.Uint64N(1<<20), 4*(1+rng.Uint64N(2048)))
	}
}

// The kernel's parameters must fit the 4 KiB every GPU since Maxwell
// takes, and the host's limits must be the kernel's array sizes.
func TestFillKernelParamsOverLaunchLimit(t *testing.T) {
	m, err := ptx.Parse(fillPTX)
	if err != nil {
		t.Fatal(err)
	}
	e, err := m.Entry(fillKernelName)
	if err != nil {
		t.Fatal(err)
	}
	if e.ParamBytes > 4096 {
		t.Fatalf("%s takes %d bytes of parameters, more than 4096", fillKernelName, e.ParamBytes)
	}
	sizes := map[string]int{}
	for _, p := range e.Params {
		sizes[p.Name] = p.Size
	}
	if sizes["kvf_fill_ids"] != 4*fillInlineIDs || sizes["kvf_fill_spans"] != fillSpanSlots*fillSpanBytes {
		t.Fatalf("kvf_fill_ids %d bytes, kvf_fill_spans %d: the host takes %d IDs and %d spans", sizes["kvf_fill_ids"], sizes["kvf_fill_spans"], fillInlineIDs, fillSpanSlots)
	}
	if e.MaxNTID[0] < fillBlock {
		t.Fatalf(".maxntid %d below the launch's %d threads", e.MaxNTID[0], fillBlock)
	}
}
