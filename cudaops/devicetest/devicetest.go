// Package devicetest is the conformance suite every cudaops.Device must
// pass. A backend's tests call Run (or RunWith) with a constructor; the
// suite allocates its own regions, so each subtest gets a fresh device.
//
// Fill correctness is checked on fresh random data every run (the seed is
// logged, and KVFENCE_SEED=N repeats a run): every page of every region is
// written with random bytes, a random subset is scrubbed with zero, poison
// and per-page canary specs in ascending, scattered and run-heavy orders,
// and then every byte of every page of every region is read back: scrubbed
// pages must hold the pattern, all others their random bytes.
package devicetest

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// Engine stands for the inference engine's own device work, so the suite
// can check that a fill is ordered after it.
type Engine interface {
	// Write queues engine work that writes word over page p of region r
	// (preceded, on a GPU, by enough other work that it is still pending
	// when Write returns) and returns the Ordering that names it.
	Write(t *testing.T, r int, p int32, word uint32) cudaops.Ordering
	// Sync waits for all engine work queued so far.
	Sync(t *testing.T)
}

// Config describes a backend under test.
type Config struct {
	// Open returns a new device with no regions. The suite closes it.
	Open func(t *testing.T) cudaops.Device
	// Engine returns the engine stand-in for d; nil means writes through
	// d.WritePage and a dummy Ordering{Stream: 1, Event: 1} (for backends that
	// ignore ordering handles, like Host).
	Engine func(t *testing.T, d cudaops.Device) Engine
	// LaunchesPerFill is the exact Counters.Launches increase per
	// non-empty Fill; 0 means "at least one".
	LaunchesPerFill int
}

// Run runs the suite on a backend that launches once per fill batch.
func Run(t *testing.T, open func(t *testing.T) cudaops.Device) {
	RunWith(t, Config{Open: open, LaunchesPerFill: 1})
}

// RunWith runs the suite with a full Config.
func RunWith(t *testing.T, c Config) {
	t.Run("Regions", func(t *testing.T) { testRegions(t, c) })
	t.Run("FillCorrectness", func(t *testing.T) { testFillCorrectness(t, c) })
	t.Run("FillOutOfRange", func(t *testing.T) { testFillOutOfRange(t, c) })
	t.Run("Spans", func(t *testing.T) { testSpans(t, c) })
	t.Run("PageCopies", func(t *testing.T) { testPageCopies(t, c) })
	t.Run("StagedCopies", func(t *testing.T) { testStagedCopies(t, c) })
	t.Run("PageMoves", func(t *testing.T) { testPageMoves(t, c) })
	t.Run("PageParts", func(t *testing.T) { testPageParts(t, c) })
	t.Run("HostCopies", func(t *testing.T) { testHostCopies(t, c) })
	t.Run("PageBounds", func(t *testing.T) { testPageBounds(t, c) })
	t.Run("Fence", func(t *testing.T) { testFence(t, c) })
	t.Run("Ordering", func(t *testing.T) { testOrdering(t, c) })
	t.Run("Counters", func(t *testing.T) { testCounters(t, c) })
	t.Run("Pipelined", func(t *testing.T) { testPipelined(t, c) })
	t.Run("Concurrent", func(t *testing.T) { testConcurrent(t, c) })
	t.Run("Closed", func(t *testing.T) { testClosed(t, c) })
}

// geometry is the suite's region layout: pages per region and the page
// sizes, chosen to cover 16-byte multiples and 4-byte-only multiples.
var geometry = struct {
	pages     int
	pageBytes []int64
}{pages: 48, pageBytes: []int64{256, 1028, 4096, 36}}

func open(t *testing.T, c Config) cudaops.Device {
	t.Helper()
	d := c.Open(t)
	require.NotNil(t, d)
	t.Cleanup(func() { _ = d.Close() })
	for _, pb := range geometry.pageBytes {
		_, err := d.AllocRegion(geometry.pages, pb)
		require.NoError(t, err)
	}
	return d
}

func newRand(t *testing.T) *rand.Rand {
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("KVFENCE_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "KVFENCE_SEED")
		seed = v
	}
	t.Logf("seed %d (KVFENCE_SEED=%d repeats it)", seed, seed)
	return rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
}

// image is the expected content of every page of every region.
type image [][][]byte

func randomize(t *testing.T, d cudaops.Device, rng *rand.Rand) image {
	t.Helper()
	regs := d.Regions()
	img := make(image, len(regs))
	for r, reg := range regs {
		img[r] = make([][]byte, reg.Pages)
		for p := range reg.Pages {
			b := make([]byte, reg.PageBytes)
			for i := range b {
				b[i] = byte(rng.Uint32())
			}
			require.NoError(t, d.WritePage(r, int32(p), b))
			img[r][p] = b
		}
	}
	return img
}

// apply records in img what a fill of pages with spec must leave.
func (img image) apply(pages []int32, spec cudaops.FillSpec) {
	for r := range img {
		for _, p := range pages {
			fillWord(img[r][p], spec.WordFor(p))
		}
	}
}

func fillWord(b []byte, w uint32) {
	for i := 0; i+4 <= len(b); i += 4 {
		binary.LittleEndian.PutUint32(b[i:], w)
	}
}

// verify reads every page of every region and compares it with img.
func verify(t *testing.T, d cudaops.Device, img image, what string) {
	t.Helper()
	bad := 0
	for r := range img {
		for p, want := range img[r] {
			got := make([]byte, len(want))
			require.NoError(t, d.ReadPage(r, int32(p), got))
			if !bytes.Equal(got, want) {
				i := 0
				for got[i] == want[i] {
					i++
				}
				bad++
				if bad <= 5 {
					t.Errorf("%s: region %d page %d differs first at byte %d: got %#x, want %#x", what, r, p, i, got[i], want[i])
				}
			}
		}
	}
	if bad > 5 {
		t.Errorf("%s: %d pages differ in all", what, bad)
	}
}

func fill(t *testing.T, d cudaops.Device, pages []int32, spec cudaops.FillSpec, after cudaops.Ordering) {
	t.Helper()
	f, err := d.Fill(pages, spec, after)
	require.NoError(t, err)
	require.NoError(t, f.Wait())
}

func testRegions(t *testing.T, c Config) {
	d := open(t, c)
	regs := d.Regions()
	require.Len(t, regs, len(geometry.pageBytes))
	for i, r := range regs {
		assert.Equal(t, geometry.pages, r.Pages, "region %d pages", i)
		assert.Equal(t, geometry.pageBytes[i], r.PageBytes, "region %d page bytes", i)
		assert.GreaterOrEqual(t, r.Stride, r.PageBytes, "region %d stride", i)
		assert.NoError(t, r.Validate())
	}
	regs[0].Pages = 1 // a copy: the device must not change
	assert.Equal(t, geometry.pages, d.Regions()[0].Pages)

	for _, bad := range []struct {
		pages     int
		pageBytes int64
	}{{0, 64}, {-1, 64}, {4, 0}, {4, -4}, {4, 6}, {4, 3}} {
		_, err := d.AllocRegion(bad.pages, bad.pageBytes)
		assert.ErrorIs(t, err, cudaops.ErrInvalidArgument, "AllocRegion(%d, %d)", bad.pages, bad.pageBytes)
	}
	assert.Len(t, d.Regions(), len(geometry.pageBytes), "failed allocations added regions")
}

// batch picks a random subset of [0, n) in the given order.
func batch(rng *rand.Rand, n int, order string) []int32 {
	var pages []int32
	switch order {
	case "runs": // a few long runs of adjacent pages
		for p := 0; p < n; {
			run := 1 + rng.IntN(8)
			if rng.IntN(2) == 0 {
				for i := p; i < min(p+run, n); i++ {
					pages = append(pages, int32(i))
				}
			}
			p += run
		}
	default:
		for p := range n {
			if rng.IntN(3) == 0 {
				pages = append(pages, int32(p))
			}
		}
	}
	if len(pages) == 0 {
		pages = append(pages, int32(rng.IntN(n)))
	}
	if order == "scattered" {
		rng.Shuffle(len(pages), func(i, j int) { pages[i], pages[j] = pages[j], pages[i] })
	}
	return pages
}

var specs = []struct {
	name string
	spec cudaops.FillSpec
}{
	{"zero", cudaops.FillSpec{}},
	{"poison", cudaops.FillSpec{Word: 0x80008000}},
	{"canary", cudaops.FillSpec{Word: 0x3c5a0f0f, PageSalt: 0x9e3779b9, ClearMask: 0x40004000}},
}

func testFillCorrectness(t *testing.T, c Config) {
	for _, order := range []string{"ascending", "scattered", "runs"} {
		for _, s := range specs {
			t.Run(order+"/"+s.name, func(t *testing.T) {
				d := open(t, c)
				rng := newRand(t)
				img := randomize(t, d, rng)
				spec := s.spec
				if spec.PageSalt != 0 {
					spec.Word = rng.Uint32() // a fresh canary each run
				}
				pages := batch(rng, geometry.pages, order)
				fill(t, d, pages, spec, cudaops.Ordering{})
				img.apply(pages, spec)
				verify(t, d, img, fmt.Sprintf("after filling %d pages", len(pages)))

				// A second batch over the result: fills compose.
				pages = batch(rng, geometry.pages, order)
				fill(t, d, pages, cudaops.FillSpec{Word: 0x80}, cudaops.Ordering{})
				img.apply(pages, cudaops.FillSpec{Word: 0x80})
				verify(t, d, img, "after a second fill")
			})
		}
	}
	t.Run("empty", func(t *testing.T) {
		d := open(t, c)
		img := randomize(t, d, newRand(t))
		f, err := d.Fill(nil, cudaops.FillSpec{}, cudaops.Ordering{})
		require.NoError(t, err)
		require.NoError(t, f.Wait())
		verify(t, d, img, "after an empty fill")
	})
}

func testFillOutOfRange(t *testing.T, c Config) {
	d := open(t, c)
	rng := newRand(t)
	img := randomize(t, d, rng)
	before := d.Counters()
	n := int32(geometry.pages)
	for _, bad := range [][]int32{
		{n},
		{0, 1, n},
		{-1},
		{2, 3, -7, 4},
		{1<<31 - 1},
		{-1 << 31},
	} {
		f, err := d.Fill(bad, cudaops.FillSpec{}, cudaops.Ordering{})
		assert.ErrorIs(t, err, cudaops.ErrInvalidArgument, "Fill(%v)", bad)
		assert.Nil(t, f, "Fill(%v) returned a fence with its error", bad)
	}
	verify(t, d, img, "after rejected fills")
	assert.Equal(t, before, d.Counters(), "rejected fills were counted")

	// A region smaller than the others bounds the valid pages of all.
	_, err := d.AllocRegion(geometry.pages/2, 64)
	require.NoError(t, err)
	_, err = d.Fill([]int32{int32(geometry.pages/2) + 1}, cudaops.FillSpec{}, cudaops.Ordering{})
	assert.ErrorIs(t, err, cudaops.ErrInvalidArgument, "page beyond the smallest region")
	verify(t, d, img, "after a fill beyond the smallest region")
}

func testPageBounds(t *testing.T, c Config) {
	d := open(t, c)
	img := randomize(t, d, newRand(t))
	regs := d.Regions()
	pb := int(regs[0].PageBytes)
	cases := []struct {
		r int
		p int32
		n int
	}{
		{-1, 0, pb}, {len(regs), 0, pb},
		{0, -1, pb}, {0, int32(regs[0].Pages), pb},
		{0, 0, pb - 4}, {0, 0, pb + 4}, {0, 0, 0},
		{1, 0, pb}, // region 1 has a different page size
	}
	for _, tc := range cases {
		buf := bytes.Repeat([]byte{0xa5}, tc.n)
		err := d.WritePage(tc.r, tc.p, buf)
		assert.ErrorIs(t, err, cudaops.ErrInvalidArgument, "WritePage(%d, %d, %d bytes)", tc.r, tc.p, tc.n)
		err = d.ReadPage(tc.r, tc.p, buf)
		assert.ErrorIs(t, err, cudaops.ErrInvalidArgument, "ReadPage(%d, %d, %d bytes)", tc.r, tc.p, tc.n)
		assert.Equal(t, bytes.Repeat([]byte{0xa5}, tc.n), buf, "failed ReadPage wrote its buffer")
	}
	verify(t, d, img, "after rejected page writes")

	// The last page of every region is reachable.
	for r, reg := range regs {
		b := bytes.Repeat([]byte{byte(r + 1)}, int(reg.PageBytes))
		require.NoError(t, d.WritePage(r, int32(reg.Pages-1), b))
		img[r][reg.Pages-1] = b
	}
	verify(t, d, img, "after writing last pages")
}

func testFence(t *testing.T, c Config) {
	d := open(t, c)
	f, err := d.Fill([]int32{0, 5, 7}, cudaops.FillSpec{Word: 1}, cudaops.Ordering{})
	require.NoError(t, err)
	require.NoError(t, f.Wait())
	for range 3 {
		done, err := f.Done()
		assert.True(t, done, "Done after Wait")
		assert.NoError(t, err)
	}
	assert.NoError(t, f.Wait(), "second Wait")

	// Polling Done alone reaches completion.
	f, err = d.Fill([]int32{1, 2, 3}, cudaops.FillSpec{}, cudaops.Ordering{})
	require.NoError(t, err)
	deadline := time.Now().Add(10 * time.Second)
	for {
		done, err := f.Done()
		require.NoError(t, err)
		if done {
			break
		}
		require.True(t, time.Now().Before(deadline), "fence not done after 10s of polling")
		time.Sleep(50 * time.Microsecond)
	}
	assert.NoError(t, f.Wait())

	// Several goroutines may wait on one fence.
	f, err = d.Fill([]int32{4, 6}, cudaops.FillSpec{}, cudaops.Ordering{})
	require.NoError(t, err)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() { assert.NoError(t, f.Wait()) })
		wg.Go(func() { _, err := f.Done(); assert.NoError(t, err) })
	}
	wg.Wait()
}

type hostEngine struct{ d cudaops.Device }

func (e hostEngine) Write(t *testing.T, r int, p int32, word uint32) cudaops.Ordering {
	b := make([]byte, e.d.Regions()[r].PageBytes)
	fillWord(b, word)
	require.NoError(t, e.d.WritePage(r, p, b))
	return cudaops.Ordering{Stream: 1, Event: 1}
}

func (hostEngine) Sync(*testing.T) {}

func engine(t *testing.T, c Config, d cudaops.Device) Engine {
	if c.Engine == nil {
		return hostEngine{d}
	}
	return c.Engine(t, d)
}

func testOrdering(t *testing.T, c Config) {
	d := open(t, c)
	rng := newRand(t)
	img := randomize(t, d, rng)
	e := engine(t, c, d)
	nreg := len(d.Regions())

	// The engine writes pages the fill then scrubs; if the fill ran before
	// the engine's write, the engine's word would survive.
	for round, kind := range []string{"stream", "event", "both"} {
		pages := batch(rng, geometry.pages, "scattered")
		var after cudaops.Ordering
		for _, p := range pages {
			for r := range nreg {
				o := e.Write(t, r, p, 0xe0e0e0e0+uint32(round))
				after.Stream, after.Event = max(after.Stream, o.Stream), max(after.Event, o.Event)
			}
		}
		switch kind {
		case "stream":
			after.Event = 0
		case "event":
			after.Stream = 0
		}
		if after.IsZero() {
			t.Fatalf("engine returned a zero Ordering for %s", kind)
		}
		spec := cudaops.FillSpec{Word: 0x80008000 + uint32(round)}
		fill(t, d, pages, spec, after)
		e.Sync(t)
		img.apply(pages, spec)
		verify(t, d, img, "fill ordered after the engine's "+kind)
	}
}

func testCounters(t *testing.T, c Config) {
	d := open(t, c)
	rng := newRand(t)
	var perPage uint64
	for _, r := range d.Regions() {
		perPage += uint64(r.PageBytes)
	}
	for i := range 5 {
		order := []string{"ascending", "scattered", "runs"}[i%3]
		pages := batch(rng, geometry.pages, order)
		before := d.Counters()
		fill(t, d, pages, specs[i%len(specs)].spec, cudaops.Ordering{})
		after := d.Counters()
		assert.Equal(t, before.FillCalls+1, after.FillCalls, "FillCalls")
		launches := after.Launches - before.Launches
		if c.LaunchesPerFill > 0 {
			assert.Equal(t, uint64(c.LaunchesPerFill), launches, "launches for a batch of %d %s pages", len(pages), order)
		} else {
			assert.GreaterOrEqual(t, launches, uint64(1), "launches")
		}
		assert.Equal(t, before.PagesFilled+uint64(len(pages)), after.PagesFilled, "PagesFilled")
		assert.Equal(t, before.BytesFilled+uint64(len(pages))*perPage, after.BytesFilled, "BytesFilled")
	}
}

// testPipelined issues many fills before waiting for any: a backend that
// stages batches for the device must not reuse a batch's staging before
// the device has read it.
func testPipelined(t *testing.T, c Config) {
	d := open(t, c)
	rng := newRand(t)
	img := randomize(t, d, rng)
	perm := rng.Perm(geometry.pages)
	var fences []cudaops.Fence
	for i := 0; i+2 <= len(perm); i += 2 {
		pages := []int32{int32(perm[i]), int32(perm[i+1])}
		spec := cudaops.FillSpec{Word: rng.Uint32(), PageSalt: uint32(i)}
		f, err := d.Fill(pages, spec, cudaops.Ordering{})
		require.NoError(t, err)
		fences = append(fences, f)
		img.apply(pages, spec)
	}
	for i := len(fences) - 1; i >= 0; i-- {
		require.NoError(t, fences[i].Wait())
	}
	verify(t, d, img, fmt.Sprintf("after %d fills in flight", len(fences)))
}

func testConcurrent(t *testing.T, c Config) {
	d := open(t, c)
	rng := newRand(t)
	img := randomize(t, d, rng)
	// Each goroutine owns the pages congruent to it mod workers.
	const workers = 4
	var wg sync.WaitGroup
	for w := range workers {
		var mine []int32
		for p := w; p < geometry.pages; p += workers {
			mine = append(mine, int32(p))
		}
		spec := cudaops.FillSpec{Word: 0x01010101 * uint32(w+1)}
		img.apply(mine, spec)
		wg.Go(func() {
			for i := 0; i < len(mine); i += 3 {
				f, err := d.Fill(mine[i:min(i+3, len(mine))], spec, cudaops.Ordering{})
				if !assert.NoError(t, err) {
					return
				}
				assert.NoError(t, f.Wait())
			}
		})
	}
	wg.Wait()
	verify(t, d, img, "after concurrent fills")
}

func testClosed(t *testing.T, c Config) {
	d := open(t, c)
	f, err := d.Fill([]int32{0, 1}, cudaops.FillSpec{}, cudaops.Ordering{})
	require.NoError(t, err)
	require.NoError(t, d.Close())
	// A fence taken before Close still reports, and reports success: Close
	// waited for the work.
	assert.NoError(t, f.Wait())
	done, err := f.Done()
	assert.True(t, done)
	assert.NoError(t, err)

	_, err = d.AllocRegion(4, 64)
	assert.ErrorIs(t, err, cudaops.ErrClosed, "AllocRegion")
	_, err = d.Fill([]int32{0}, cudaops.FillSpec{}, cudaops.Ordering{})
	assert.ErrorIs(t, err, cudaops.ErrClosed, "Fill")
	b := make([]byte, geometry.pageBytes[0])
	assert.ErrorIs(t, d.ReadPage(0, 0, b), cudaops.ErrClosed, "ReadPage")
	assert.ErrorIs(t, d.WritePage(0, 0, b), cudaops.ErrClosed, "WritePage")
	assert.NoError(t, d.Close(), "second Close")
	assert.Empty(t, d.Regions(), "regions after Close")
}

// testSpans checks FillSpans, for devices that implement it: each span
// writes its own pages in its own regions and nothing else, at its
// regions' page numbers (page − IDBase) and with their words; a bad batch
// writes nothing.
func testSpans(t *testing.T, c Config) {
	d := open(t, c)
	sf, ok := d.(cudaops.SpanFiller)
	if !ok {
		t.Skipf("%s does not implement SpanFiller", d.Name())
	}
	rng := newRand(t)
	img := randomize(t, d, rng)
	n := int32(geometry.pages)
	for _, s := range specs {
		spec := s.spec
		if spec.PageSalt != 0 {
			spec.Word = rng.Uint32()
		}
		// Regions 0 and 3 as one group numbered from 0, regions 1..2 as
		// another numbered from n (as a pool numbers a second group).
		a, b := batch(rng, int(n), "runs"), batch(rng, int(n), "scattered")
		bGlobal := make([]int32, len(b))
		for i, p := range b {
			bGlobal[i] = p + n
		}
		spans := []cudaops.Span{{First: 1, Count: 2, IDBase: n, Pages: bGlobal}, {First: 3, Count: 1, Pages: a}, {First: 0, Count: 1, Pages: a}}
		f, err := sf.FillSpans(spans, spec, cudaops.Ordering{})
		require.NoError(t, err, s.name)
		require.NoError(t, f.Wait())
		for _, r := range []int{0, 3} {
			for _, p := range a {
				fillWord(img[r][p], spec.WordFor(p))
			}
		}
		for _, r := range []int{1, 2} {
			for _, p := range b {
				fillWord(img[r][p], spec.WordFor(p))
			}
		}
		verify(t, d, img, "after a span fill with "+s.name)
	}
	before := d.Counters()
	for name, bad := range map[string][]cudaops.Span{
		"region in two spans":   {{First: 0, Count: 2, Pages: []int32{1}}, {First: 1, Count: 1, Pages: []int32{2}}},
		"no region":             {{First: 0, Count: 0, Pages: []int32{1}}},
		"regions past the end":  {{First: 3, Count: 2, Pages: []int32{1}}},
		"negative first":        {{First: -1, Count: 1, Pages: []int32{1}}},
		"page below its base":   {{First: 0, Count: 1, IDBase: 10, Pages: []int32{12, 9}}},
		"page past its regions": {{First: 0, Count: 1, IDBase: 10, Pages: []int32{10 + n}}},
		"negative base":         {{First: 0, Count: 1, IDBase: -1, Pages: []int32{0}}},
		"a good span and a bad": {{First: 0, Count: 1, Pages: []int32{0, 1}}, {First: 1, Count: 1, Pages: []int32{n}}},
	} {
		f, err := sf.FillSpans(bad, cudaops.FillSpec{Word: 0xdead}, cudaops.Ordering{})
		assert.ErrorIs(t, err, cudaops.ErrInvalidArgument, name)
		assert.Nil(t, f, name)
	}
	verify(t, d, img, "after rejected span fills")
	assert.Equal(t, before, d.Counters(), "rejected span fills were counted")
	f, err := sf.FillSpans(nil, cudaops.FillSpec{}, cudaops.Ordering{})
	require.NoError(t, err, "an empty span batch")
	require.NoError(t, f.Wait())
}

// testPageCopies checks ReadPages and WritePages, for devices that
// implement PageCopier: every region, run-heavy and scattered batches, a
// page listed twice, reads ordered after a fill not waited for, and
// refusals that touch nothing.
func testPageCopies(t *testing.T, c Config) {
	d := open(t, c)
	pc, ok := d.(cudaops.PageCopier)
	if !ok {
		t.Skipf("%s does not implement PageCopier", d.Name())
	}
	rng := newRand(t)
	img := randomize(t, d, rng)
	regs := d.Regions()
	for r, reg := range regs {
		pb := int(reg.PageBytes)
		for _, order := range []string{"runs", "scattered"} {
			pages := batch(rng, reg.Pages, order)
			got := make([]byte, len(pages)*pb)
			require.NoError(t, pc.ReadPages(r, pages, got), "region %d", r)
			for i, p := range pages {
				if !bytes.Equal(got[i*pb:(i+1)*pb], img[r][p]) {
					t.Fatalf("ReadPages of region %d (%s): page %d (item %d) differs", r, order, p, i)
				}
			}
			src := make([]byte, len(pages)*pb)
			for i := range src {
				src[i] = byte(rng.Uint32())
			}
			require.NoError(t, pc.WritePages(r, pages, src), "region %d", r)
			for i, p := range pages {
				img[r][p] = append([]byte(nil), src[i*pb:(i+1)*pb]...)
			}
		}
	}
	verify(t, d, img, "after batched writes")

	// A page listed twice gets its last copy.
	pb := int(regs[0].PageBytes)
	src := bytes.Repeat([]byte{1}, 3*pb)
	copy(src[2*pb:], bytes.Repeat([]byte{2}, pb))
	require.NoError(t, pc.WritePages(0, []int32{5, 6, 5}, src))
	img[0][5], img[0][6] = bytes.Repeat([]byte{2}, pb), bytes.Repeat([]byte{1}, pb)
	verify(t, d, img, "after a write listing a page twice")

	// Reads are ordered after fills issued before them.
	spec := cudaops.FillSpec{Word: 0x80008000}
	f, err := d.Fill([]int32{7, 8}, spec, cudaops.Ordering{})
	require.NoError(t, err)
	img.apply([]int32{7, 8}, spec)
	got := make([]byte, 2*pb)
	require.NoError(t, pc.ReadPages(0, []int32{7, 8}, got))
	assert.Equal(t, append(append([]byte(nil), img[0][7]...), img[0][8]...), got, "ReadPages before the fill's fence was waited for")
	require.NoError(t, f.Wait())

	// Refusals write nothing, read into nothing.
	before := bytes.Repeat([]byte{0xa5}, 2*pb)
	for name, call := range map[string]func(buf []byte) error{
		"read of a region past the end": func(b []byte) error { return pc.ReadPages(len(regs), []int32{0, 1}, b) },
		"read of a page out of range":   func(b []byte) error { return pc.ReadPages(0, []int32{0, int32(regs[0].Pages)}, b) },
		"read of a negative page":       func(b []byte) error { return pc.ReadPages(0, []int32{-1, 0}, b) },
		"read into a short buffer":      func(b []byte) error { return pc.ReadPages(0, []int32{0, 1}, b[:len(b)-4]) },
		"write of a page out of range":  func(b []byte) error { return pc.WritePages(0, []int32{3, int32(regs[0].Pages)}, b) },
		"write from a long buffer":      func(b []byte) error { return pc.WritePages(0, []int32{3}, b) },
		"write to a negative region":    func(b []byte) error { return pc.WritePages(-1, []int32{3, 4}, b) },
	} {
		buf := append([]byte(nil), before...)
		assert.ErrorIs(t, call(buf), cudaops.ErrInvalidArgument, name)
		assert.Equal(t, before, buf, "%s: the buffer changed", name)
	}
	require.NoError(t, pc.ReadPages(0, nil, nil), "an empty read")
	verify(t, d, img, "after refused copies")
	require.NoError(t, d.Close())
	assert.ErrorIs(t, pc.ReadPages(0, []int32{0}, make([]byte, pb)), cudaops.ErrClosed)
	assert.ErrorIs(t, pc.WritePages(0, []int32{0}, make([]byte, pb)), cudaops.ErrClosed)
}

// testPageMoves checks MovePages, for devices that implement PageMover:
// runs and scattered moves over spans of regions, moves ordered after a
// fill not waited for (the moved page carries the fill), and refusals
// that move nothing.
func testPageMoves(t *testing.T, c Config) {
	d := open(t, c)
	pm, ok := d.(cudaops.PageMover)
	if !ok {
		t.Skipf("%s does not implement PageMover", d.Name())
	}
	rng := newRand(t)
	img := randomize(t, d, rng)
	regs := d.Regions()
	move := func(spans []cudaops.MoveSpan) {
		t.Helper()
		f, err := pm.MovePages(spans, cudaops.Ordering{})
		require.NoError(t, err)
		require.NoError(t, f.Wait())
		for _, s := range spans {
			for r := s.First; r < s.First+s.Count; r++ {
				moved := make(map[int32][]byte)
				for _, m := range s.Moves {
					moved[m.To] = append([]byte(nil), img[r][m.From]...)
				}
				for p, b := range moved {
					img[r][p] = b
				}
			}
		}
	}
	// A run (sources and destinations adjacent) and scattered pages, over
	// two spans of regions.
	move([]cudaops.MoveSpan{
		{First: 0, Count: 2, Moves: []cudaops.PageMove{{From: 0, To: 20}, {From: 1, To: 21}, {From: 2, To: 22}, {From: 9, To: 3}}},
		{First: 2, Count: len(regs) - 2, Moves: []cudaops.PageMove{{From: 40, To: 5}, {From: 7, To: 30}}},
	})
	verify(t, d, img, "after moves")
	// Random batches: distinct destinations, none of them a source.
	for range 4 {
		perm := rng.Perm(regs[0].Pages)
		var moves []cudaops.PageMove
		for i := 0; i+1 < len(perm) && len(moves) < 10; i += 2 {
			moves = append(moves, cudaops.PageMove{From: int32(perm[i]), To: int32(perm[i+1])})
		}
		move([]cudaops.MoveSpan{{First: 0, Count: len(regs), Moves: moves}})
	}
	verify(t, d, img, "after random moves")

	// Moves are ordered after fills issued before them.
	spec := cudaops.FillSpec{Word: 0x3c003c00}
	f, err := d.Fill([]int32{11}, spec, cudaops.Ordering{})
	require.NoError(t, err)
	img.apply([]int32{11}, spec)
	move([]cudaops.MoveSpan{{First: 0, Count: len(regs), Moves: []cudaops.PageMove{{From: 11, To: 12}}}})
	require.NoError(t, f.Wait())
	verify(t, d, img, "after a move of a page being filled")

	for name, spans := range map[string][]cudaops.MoveSpan{
		"a region past the end":   {{First: len(regs), Count: 1, Moves: []cudaops.PageMove{{From: 0, To: 1}}}},
		"no regions":              {{First: 0, Count: 0, Moves: []cudaops.PageMove{{From: 0, To: 1}}}},
		"spans sharing a region":  {{First: 0, Count: 2, Moves: []cudaops.PageMove{{From: 0, To: 1}}}, {First: 1, Count: 1, Moves: []cudaops.PageMove{{From: 2, To: 3}}}},
		"a page out of range":     {{First: 0, Count: 1, Moves: []cudaops.PageMove{{From: 0, To: int32(regs[0].Pages)}}}},
		"a negative page":         {{First: 0, Count: 1, Moves: []cudaops.PageMove{{From: -1, To: 1}}}},
		"a page onto itself":      {{First: 0, Count: 1, Moves: []cudaops.PageMove{{From: 4, To: 4}}}},
		"a page written twice":    {{First: 0, Count: 1, Moves: []cudaops.PageMove{{From: 4, To: 6}, {From: 5, To: 6}}}},
		"a page read and written": {{First: 0, Count: 1, Moves: []cudaops.PageMove{{From: 4, To: 6}, {From: 6, To: 7}}}},
	} {
		_, err := pm.MovePages(spans, cudaops.Ordering{})
		assert.ErrorIs(t, err, cudaops.ErrInvalidArgument, name)
	}
	verify(t, d, img, "after refused moves")
	f, err = pm.MovePages(nil, cudaops.Ordering{})
	require.NoError(t, err, "an empty batch")
	require.NoError(t, f.Wait())
	require.NoError(t, d.Close())
	_, err = pm.MovePages([]cudaops.MoveSpan{{First: 0, Count: 1, Moves: []cudaops.PageMove{{From: 0, To: 1}}}}, cudaops.Ordering{})
	assert.ErrorIs(t, err, cudaops.ErrClosed)
}

// testPageParts checks ReadPagePart and WritePagePart, for devices that
// implement PartReader and PartWriter: parts at every offset class, in
// every region, ordered after fills, and refusals that touch nothing.
func testPageParts(t *testing.T, c Config) {
	d := open(t, c)
	pr, okr := d.(cudaops.PartReader)
	pw, okw := d.(cudaops.PartWriter)
	if !okr || !okw {
		t.Skipf("%s does not implement PartReader and PartWriter", d.Name())
	}
	rng := newRand(t)
	img := randomize(t, d, rng)
	for r, reg := range d.Regions() {
		pb := int(reg.PageBytes)
		for _, part := range [][2]int{{0, pb}, {0, 4}, {pb - 4, 4}, {pb / 3, pb / 3}, {pb, 0}} {
			off, n := part[0], part[1]
			p := int32(rng.IntN(reg.Pages))
			got := make([]byte, n)
			require.NoError(t, pr.ReadPagePart(r, p, off, got), "region %d", r)
			assert.Equal(t, img[r][p][off:off+n], got, "region %d page %d [%d, %d)", r, p, off, off+n)
			src := make([]byte, n)
			for i := range src {
				src[i] = byte(rng.Uint32())
			}
			require.NoError(t, pw.WritePagePart(r, p, off, src))
			copy(img[r][p][off:], src)
		}
	}
	verify(t, d, img, "after part writes")
	// Ordered after a fill not waited for.
	spec := cudaops.FillSpec{Word: 0x80008000}
	f, err := d.Fill([]int32{9}, spec, cudaops.Ordering{})
	require.NoError(t, err)
	img.apply([]int32{9}, spec)
	got := make([]byte, 8)
	require.NoError(t, pr.ReadPagePart(0, 9, 8, got))
	assert.Equal(t, img[0][9][8:16], got)
	require.NoError(t, f.Wait())
	pb := int(d.Regions()[0].PageBytes)
	for name, call := range map[string]func() error{
		"a read past the page":    func() error { return pr.ReadPagePart(0, 1, pb-4, make([]byte, 8)) },
		"a read at a negative":    func() error { return pr.ReadPagePart(0, 1, -4, make([]byte, 4)) },
		"a read of a bad page":    func() error { return pr.ReadPagePart(0, int32(geometry.pages), 0, make([]byte, 4)) },
		"a write past the page":   func() error { return pw.WritePagePart(0, 1, pb-4, make([]byte, 8)) },
		"a write to a bad region": func() error { return pw.WritePagePart(len(d.Regions()), 1, 0, make([]byte, 4)) },
	} {
		assert.ErrorIs(t, call(), cudaops.ErrInvalidArgument, name)
	}
	verify(t, d, img, "after refused parts")
}

// testStagedCopies checks ReadStaged and WriteStaged, for devices that
// implement StagedCopier: some of the regions, not in device order,
// run-heavy and scattered batches, each batch the next pages of the list
// laid out region by region, a page listed twice, reads ordered after a
// fill not waited for, and refusals that copy nothing and call no
// callback. The callbacks run with the device locked, so they report
// with t.Errorf and never stop the test inside.
func testStagedCopies(t *testing.T, c Config) {
	d := open(t, c)
	sc, ok := d.(cudaops.StagedCopier)
	if !ok {
		t.Skipf("%s does not implement StagedCopier", d.Name())
	}
	rng := newRand(t)
	img := randomize(t, d, rng)
	regs := d.Regions()
	regions := []int{2, 0, 3}
	// batches walks a call's batches: each must start where the last
	// ended and hold, for every listed region, whole pages of it.
	type walk struct{ next int }
	pagesIn := func(w *walk, what string, first int, staged [][]byte) int {
		if len(staged) != len(regions) {
			t.Errorf("%s: a batch of %d regions, %d listed", what, len(staged), len(regions))
			return 0
		}
		n := len(staged[0]) / int(regs[regions[0]].PageBytes)
		if first != w.next || n == 0 {
			t.Errorf("%s: a batch of %d pages at %d, the last ended at %d", what, n, first, w.next)
		}
		for k, r := range regions {
			if len(staged[k]) != n*int(regs[r].PageBytes) {
				t.Errorf("%s: region %d staged %d bytes for %d pages of %d", what, r, len(staged[k]), n, regs[r].PageBytes)
				return 0
			}
		}
		w.next = first + n
		return n
	}
	for _, order := range []string{"runs", "scattered"} {
		pages := batch(rng, geometry.pages, order)
		w := &walk{}
		require.NoError(t, sc.ReadStaged(regions, pages, func(first int, staged [][]byte) {
			for j := range pagesIn(w, "ReadStaged", first, staged) {
				p := pages[first+j]
				for k, r := range regions {
					pb := int(regs[r].PageBytes)
					if !bytes.Equal(staged[k][j*pb:(j+1)*pb], img[r][p]) {
						t.Errorf("ReadStaged (%s): region %d page %d (item %d) differs", order, r, p, first+j)
					}
				}
			}
		}))
		assert.Equal(t, len(pages), w.next, "ReadStaged (%s) staged every page", order)

		w = &walk{}
		require.NoError(t, sc.WriteStaged(regions, pages, func(first int, staged [][]byte) {
			for j := range pagesIn(w, "WriteStaged", first, staged) {
				p := pages[first+j]
				for k, r := range regions {
					pb := int(regs[r].PageBytes)
					page := staged[k][j*pb : (j+1)*pb]
					for i := range page {
						page[i] = byte(rng.Uint32())
					}
					img[r][p] = append([]byte(nil), page...)
				}
			}
		}))
		assert.Equal(t, len(pages), w.next, "WriteStaged (%s) staged every page", order)
	}
	verify(t, d, img, "after staged writes")

	// A page listed twice gets its last copy.
	stamp := func(first int, staged [][]byte) {
		for k, r := range regions {
			pb := int(regs[r].PageBytes)
			for j := 0; j*pb < len(staged[k]); j++ {
				page := staged[k][j*pb : (j+1)*pb]
				for i := range page {
					page[i] = byte(first + j + 1)
				}
			}
		}
	}
	require.NoError(t, sc.WriteStaged(regions, []int32{5, 6, 5}, stamp))
	for _, r := range regions {
		pb := int(regs[r].PageBytes)
		img[r][5], img[r][6] = bytes.Repeat([]byte{3}, pb), bytes.Repeat([]byte{2}, pb)
	}
	verify(t, d, img, "after a staged write listing a page twice")

	// Reads are ordered after fills issued before them.
	spec := cudaops.FillSpec{Word: 0x80008000}
	f, err := d.Fill([]int32{7, 8}, spec, cudaops.Ordering{})
	require.NoError(t, err)
	img.apply([]int32{7, 8}, spec)
	var got []byte
	require.NoError(t, sc.ReadStaged([]int{0}, []int32{7, 8}, func(_ int, staged [][]byte) {
		got = append(got, staged[0]...)
	}))
	assert.Equal(t, append(append([]byte(nil), img[0][7]...), img[0][8]...), got, "ReadStaged before the fill's fence was waited for")
	require.NoError(t, f.Wait())

	// Refusals copy nothing and call no callback.
	called := 0
	count := func(int, [][]byte) { called++ }
	last := int32(geometry.pages)
	for name, call := range map[string]func() error{
		"read of no regions":            func() error { return sc.ReadStaged(nil, []int32{0}, count) },
		"read of a region past the end": func() error { return sc.ReadStaged([]int{0, len(regs)}, []int32{0}, count) },
		"read of a page out of range":   func() error { return sc.ReadStaged(regions, []int32{0, last}, count) },
		"write of no regions":           func() error { return sc.WriteStaged([]int{}, []int32{0}, count) },
		"write to a negative region":    func() error { return sc.WriteStaged([]int{1, -1}, []int32{0}, count) },
		"write of a page out of range":  func() error { return sc.WriteStaged(regions, []int32{3, last}, count) },
		"write of a negative page":      func() error { return sc.WriteStaged(regions, []int32{-1, 3}, count) },
	} {
		assert.ErrorIs(t, call(), cudaops.ErrInvalidArgument, name)
		assert.Zero(t, called, "%s: a callback ran", name)
	}
	require.NoError(t, sc.ReadStaged(regions, nil, count), "an empty read")
	require.NoError(t, sc.WriteStaged(regions, nil, count), "an empty write")
	assert.Zero(t, called, "a callback ran for no pages")
	verify(t, d, img, "after refused staged copies")
	require.NoError(t, d.Close())
	assert.ErrorIs(t, sc.ReadStaged(regions, []int32{0}, count), cudaops.ErrClosed)
	assert.ErrorIs(t, sc.WriteStaged(regions, []int32{0}, count), cudaops.ErrClosed)
	assert.Zero(t, called, "a callback ran on a closed device")
}

// testHostCopies checks CopyToHost and CopyFromHost, for devices that
// implement HostCopier: host memory from AllocHost laid out by region,
// some of the regions in another order than the device's, runs of
// adjacent pages into adjacent slots and scattered ones, every byte read
// back both ways, copies to host ordered after a fill not waited for, and
// refusals that copy nothing.
func testHostCopies(t *testing.T, c Config) {
	d := open(t, c)
	hc, ok := d.(cudaops.HostCopier)
	if !ok {
		t.Skipf("%s does not implement HostCopier", d.Name())
	}
	rng := newRand(t)
	img := randomize(t, d, rng)
	regs := d.Regions()
	regions := []int{2, 0, 3} // not in device order, not all of them
	const slots = 40
	var total int64
	for _, r := range regions {
		total += slots * regs[r].PageBytes
	}
	mem, err := hc.AllocHost(total)
	require.NoError(t, err)
	host := make([][]byte, len(regions))
	off := int64(0)
	for k, r := range regions {
		n := slots * regs[r].PageBytes
		host[k] = mem[off : off+n : off+n]
		off += n
	}
	slotOf := func(k int, s int32) []byte {
		pb := regs[regions[k]].PageBytes
		return host[k][int64(s)*pb : int64(s+1)*pb]
	}
	for _, order := range []string{"runs", "scattered"} {
		pages := batch(rng, slots, order)
		// Slots: runs of adjacent slots where the pages are adjacent, in
		// another place than the pages, and a few breaks.
		sl := make([]int32, len(pages))
		for i := range pages {
			sl[i] = int32((int(pages[i]) + 7) % slots)
		}
		hcopy := cudaops.HostCopy{Regions: regions, Host: host, Pages: pages, Slots: sl}
		require.NoError(t, hc.CopyToHost(hcopy, cudaops.Ordering{}), order)
		for k, r := range regions {
			for i, p := range pages {
				if !bytes.Equal(slotOf(k, sl[i]), img[r][p]) {
					t.Fatalf("CopyToHost (%s): region %d page %d (item %d) differs in slot %d", order, r, p, i, sl[i])
				}
			}
		}
		// Back into other pages: page p gets slot of page q.
		dst := append([]int32(nil), pages...)
		rng.Shuffle(len(dst), func(i, j int) { dst[i], dst[j] = dst[j], dst[i] })
		for k := range regions {
			for _, s := range sl {
				b := slotOf(k, s)
				for i := range b {
					b[i] = byte(rng.Uint32())
				}
			}
		}
		require.NoError(t, hc.CopyFromHost(cudaops.HostCopy{Regions: regions, Host: host, Pages: dst, Slots: sl}), order)
		for k, r := range regions {
			for i, p := range dst {
				img[r][p] = append([]byte(nil), slotOf(k, sl[i])...)
			}
		}
		verify(t, d, img, "after CopyFromHost ("+order+")")
	}

	// A copy to host is ordered after fills issued before it.
	spec := cudaops.FillSpec{Word: 0x80008000}
	f, err := d.Fill([]int32{7, 8}, spec, cudaops.Ordering{})
	require.NoError(t, err)
	img.apply([]int32{7, 8}, spec)
	require.NoError(t, hc.CopyToHost(cudaops.HostCopy{Regions: regions, Host: host, Pages: []int32{7, 8}, Slots: []int32{0, 1}}, cudaops.Ordering{}))
	for k, r := range regions {
		assert.Equal(t, img[r][7], slotOf(k, 0), "CopyToHost before the fill's fence was waited for")
		assert.Equal(t, img[r][8], slotOf(k, 1), "CopyToHost before the fill's fence was waited for")
	}
	require.NoError(t, f.Wait())

	// Refusals copy nothing, either way.
	snapshot := append([]byte(nil), mem...)
	ok1 := cudaops.HostCopy{Regions: regions, Host: host, Pages: []int32{1, 2}, Slots: []int32{3, 4}}
	bad := map[string]cudaops.HostCopy{
		"a region past the end":      {Regions: []int{len(regs)}, Host: host[:1], Pages: []int32{1}, Slots: []int32{1}},
		"a page out of range":        {Regions: regions, Host: host, Pages: []int32{1, int32(regs[0].Pages)}, Slots: []int32{1, 2}},
		"a slot past the memory":     {Regions: regions, Host: host, Pages: []int32{1, 2}, Slots: []int32{1, slots}},
		"a negative slot":            {Regions: regions, Host: host, Pages: []int32{1, 2}, Slots: []int32{-1, 2}},
		"fewer slots than pages":     {Regions: regions, Host: host, Pages: ok1.Pages, Slots: ok1.Slots[:1]},
		"fewer buffers than regions": {Regions: regions, Host: host[:2], Pages: ok1.Pages, Slots: ok1.Slots},
		"no regions":                 {Pages: ok1.Pages, Slots: ok1.Slots},
	}
	for name, hcopy := range bad {
		assert.ErrorIs(t, hc.CopyToHost(hcopy, cudaops.Ordering{}), cudaops.ErrInvalidArgument, "to host: %s", name)
		assert.ErrorIs(t, hc.CopyFromHost(hcopy), cudaops.ErrInvalidArgument, "from host: %s", name)
	}
	assert.Equal(t, snapshot, mem, "a refused copy wrote host memory")
	verify(t, d, img, "after refused host copies")
	require.NoError(t, hc.FreeHost(mem))
	require.NoError(t, d.Close())
	_, err = hc.AllocHost(64)
	assert.ErrorIs(t, err, cudaops.ErrClosed)
	assert.ErrorIs(t, hc.CopyToHost(ok1, cudaops.Ordering{}), cudaops.ErrClosed)
}
