package kvcache

import (
	"encoding/binary"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"
)

// watchGeometry's region pages are 6 KiB: a unit (2 layers, K and V) is
// 24 KiB, six checksum blocks, of which blocks 1 and 4 straddle two
// regions and the other four lie in one page each.
var watchGeometry = Geometry{TokensPerPage: 16, Layers: 2, KVHeads: 2, HeadDim: 96, DType: FP16}

// watchSetup is lendSetup over watchGeometry's pools: a prompt of units
// pages, exported, and its import begun with its pages lent.
func watchSetup(t *testing.T, units int) (dst *Pool, out *Outgoing, in *Incoming, l *PageLoan) {
	t.Helper()
	src, dst := handoffPoolOf(t, watchGeometry, 16), handoffPoolOf(t, watchGeometry, 16)
	prompt := units * 16
	out, err := prefilled(t, src, "r", prompt).Export(time.Now().Add(time.Minute))
	require.NoError(t, err)
	in, err = dst.TryBeginImport(Request{ID: "r", Tenant: "a", PromptTokens: prompt}, out.Domain(), mustChecksum(t, out))
	require.NoError(t, err)
	l, err = in.LendPages()
	require.NoError(t, err)
	return dst, out, in, l
}

// watch is Watch with marks the tests know. With a random seed, a
// block's last byte of the prefill's is its mark's by chance (1 in 256 a
// block; the test of a sum taken too soon failed 17 runs in 3,000), and
// that block then rightly waits for the writer to pass it, which the
// tests' exact counts do not allow for; TestWatchWaitsForABlocksLastByte
// tests that case.
func watch(l *PageLoan) (scan func()) { return l.watchMarked(12345) }

// earlyBlocks counts the block sums Landed took from the scan.
func earlyBlocks(l *PageLoan) (n int) {
	w := l.watch
	for i := range w.sums {
		if w.ready[i/64].Load()&(1<<(i%64)) != 0 {
			n++
		}
	}
	return n
}

// writeRunsScanned is writeRuns a page at a time, each write followed by
// a scan, as a transport whose own thread copies the bytes in calls it.
func writeRunsScanned(t *testing.T, dst *Pool, out *Outgoing, l *PageLoan, scan func()) {
	t.Helper()
	page := int(dst.lay.regions[0].PageBytes)
	unit := make([]byte, out.UnitBytes(0))
	for _, run := range l.Runs() {
		for i := range run.Units {
			require.NoError(t, out.ReadUnits(run.First+i, unit))
			copy(run.Mem[i*page:(i+1)*page], unit[run.Region*page:])
			scan()
		}
	}
}

// The blocks that lie in one page are marked, summed by the scan as they
// land and taken from it by Landed; those that straddle two regions are
// summed from memory; the import completes against the sender's
// checksum with nothing summed again.
func TestWatchSumsBlocksAsTheyLand(t *testing.T) {
	dst, out, in, l := watchSetup(t, 5)
	scan := watch(l)
	require.NotNil(t, scan)
	w := l.watch
	assert.Len(t, w.sums, 5*6)
	marked := 0
	for _, run := range w.runs {
		for j := range run.units {
			for _, blk := range run.blocks {
				at := j*run.page + blk.off + blk.n - 8
				assert.Equal(t, w.mark(w.base[run.first+j]+blk.b), binary.LittleEndian.Uint64(run.mem[at:]))
				marked++
			}
		}
	}
	assert.Equal(t, 5*4, marked, "blocks 0, 2, 3 and 5 of each unit")
	scan() // nothing landed: nothing summed
	assert.Zero(t, earlyBlocks(l))

	writeRunsScanned(t, dst, out, l, scan)
	require.NoError(t, l.Landed(0, 5))
	assert.Equal(t, 5*4, earlyBlocks(l))
	assert.Zero(t, l.Resum(mustChecksum(t, out)), "the sums make the sender's checksum")
	l.Return()
	lease, err := in.CompleteWithChecksum(mustChecksum(t, out))
	require.NoError(t, err)
	require.NoError(t, lease.Release())
	require.NoError(t, out.Ack())
	require.NoError(t, dst.Check())
}

// A block whose last bytes landed before the rest is summed too soon:
// the import's sums then miss the sender's checksum (without Resum,
// Complete refuses it), and Resum sums its unit again from memory, after
// which the import completes.
func TestWatchSumTakenTooSoonIsSummedAgain(t *testing.T) {
	for _, resum := range []bool{true, false} {
		dst, out, in, l := watchSetup(t, 3)
		scan := watch(l)
		require.NotNil(t, scan)
		// Unit 1's block 2 (region 1's page from 2 KiB on) gets its last
		// 8 bytes first, the canary still before them. Region 1 and unit
		// 1 alike, the bytes' place in its run and in its unit is the
		// page's size on, plus 6 KiB less 8.
		run := l.watch.runs[1]
		unit := make([]byte, out.UnitBytes(1))
		require.NoError(t, out.ReadUnits(1, unit))
		tail := run.page + 2<<10 + 4<<10 - 8
		copy(run.mem[tail:tail+8], unit[tail:])
		scan()
		writeRunsScanned(t, dst, out, l, scan)
		require.NoError(t, l.Landed(0, 3))
		want := mustChecksum(t, out)
		if resum {
			assert.Equal(t, 3, l.Resum(want), "every unit that took a block's sum from the scan")
			assert.Zero(t, l.Resum(want), "a second Resum finds the sums right")
		}
		l.Return()
		lease, err := in.CompleteWithChecksum(want)
		if !resum {
			assert.ErrorIs(t, err, ErrChecksumMismatch, "the early sum was wrong: the test shows nothing without it")
			require.NoError(t, out.Abort())
			require.NoError(t, dst.Check())
			continue
		}
		require.NoError(t, err)
		require.NoError(t, lease.Release())
		require.NoError(t, out.Ack())
		require.NoError(t, dst.Check())
	}
}

// Bytes that are wrong where they lie stay wrong once summed again: the
// import is refused.
func TestWatchResumRefusesWrongBytes(t *testing.T) {
	dst, out, in, l := watchSetup(t, 3)
	scan := watch(l)
	writeRunsScanned(t, dst, out, l, scan)
	assert.Equal(t, 3*4, earlyBlocks(l))
	l.watch.runs[0].mem[100] ^= 1 // unit 0's block 0 is wrong,
	l.watch.sums[0] ^= 1          // and so is its sum from the scan
	require.NoError(t, l.Landed(0, 3))
	want := mustChecksum(t, out)
	assert.Equal(t, 3, l.Resum(want), "every unit with an early block")
	l.Return()
	_, err := in.CompleteWithChecksum(want)
	assert.ErrorIs(t, err, ErrChecksumMismatch)
	require.NoError(t, out.Abort())
	require.NoError(t, dst.Check())
}

// A block never seen to land (no scan; or bytes that end in its mark) is
// summed from memory by Landed.
func TestWatchUnseenBlocksSummedFromMemory(t *testing.T) {
	dst, out, in, l := watchSetup(t, 2)
	scan := watch(l)
	require.NotNil(t, scan)
	w := l.watch
	writeRuns(t, dst, out, l) // no scan
	// Unit 0's block 0 ends in its mark, as sent: the scan cannot see it.
	mark := w.mark(w.base[0])
	run := w.runs[0]
	binary.LittleEndian.PutUint64(run.mem[4<<10-8:], mark)
	scan()
	assert.Zero(t, w.ready[0].Load()&1, "block 0 of unit 0 looks unwritten")
	require.NoError(t, l.Landed(0, 2))
	// Region 0's run stops at the block it cannot see: unit 1's block 0
	// too is summed from memory.
	assert.Equal(t, 2*4-2, earlyBlocks(l))
	// The bytes are not what the sender sent (the mark replaced 8 of
	// them): summed from memory, they are refused.
	want := mustChecksum(t, out)
	assert.Equal(t, 2, l.Resum(want))
	l.Return()
	_, err := in.CompleteWithChecksum(want)
	assert.ErrorIs(t, err, ErrChecksumMismatch)
	require.NoError(t, out.Abort())
	require.NoError(t, dst.Check())
}

// Watch marks nothing where no block lies in one page (pages of 32
// bytes), after a unit landed, or once the loan was returned; a second
// call is the first's watch.
func TestWatchRefusals(t *testing.T) {
	_, _, out0, in := lendSetup(t, 10)
	l, err := in.LendPages()
	require.NoError(t, err)
	assert.Nil(t, l.Watch(), "32-byte pages: every block straddles regions")
	l.Return()
	require.NoError(t, out0.Abort())
	require.NoError(t, in.Abort())

	dst, out, _, l := watchSetup(t, 2)
	writeRuns(t, dst, out, l)
	require.NoError(t, l.Landed(0, 1))
	assert.Nil(t, l.Watch(), "a unit landed")
	l.Return()

	_, _, _, l = watchSetup(t, 2)
	scan := l.Watch()
	require.NotNil(t, scan)
	w := l.watch
	require.NotNil(t, l.Watch())
	assert.Same(t, w, l.watch)
	l.Return()
	assert.Nil(t, l.Watch(), "returned")
	w.runs[0].mem[4<<10-1] ^= 0xff // a write after the loan ended
	scan()
	assert.Zero(t, earlyBlocks(l), "a returned loan's scan does nothing")
}

// A writer that moves on to a run the scan has not looked at lately (the
// next chunk starts again at its group's first region, with another
// group's idle runs between) is found within a few scans, whatever the
// number of runs: every block is summed within runs/scanIdleRuns+2 scans
// of landing.
func TestWatchScanFindsWhereTheWriterMovedOn(t *testing.T) {
	const runs, units, blocks = 10, 2, 3
	page := blocks * checksumBlock
	w := testWatch(runs, units, blocks)

	// Runs 0-4 are one group's regions, 5-9 another's: the first group's
	// units 0 then 1, region by region, then the second's.
	type write struct{ run, unit, block int }
	var order []write
	for _, r := range []struct{ runs []int }{{[]int{0, 1, 2, 3, 4}}, {[]int{5, 6, 7, 8, 9}}} {
		for j := range units {
			for _, run := range r.runs {
				for b := range blocks {
					order = append(order, write{run, j, b})
				}
			}
		}
	}
	maxLag := runs/scanIdleRuns + 2
	var pending []int // written blocks not yet summed, by index
	ready := w.isReady
	for n, wr := range order {
		run := &w.runs[wr.run]
		at := wr.unit*page + wr.block*checksumBlock
		for k := range checksumBlock {
			run.mem[at+k] = byte(n + k + 1)
		}
		pending = append(pending, w.base[run.first+wr.unit]+wr.block)
		w.scan()
		for i := 0; i < len(pending); i++ {
			if ready(pending[i]) {
				pending = append(pending[:i], pending[i+1:]...)
				i--
			}
		}
		require.LessOrEqual(t, len(pending), maxLag, "blocks written but not summed after write %d (%+v)", n, wr)
	}
	for i := range w.sums {
		require.True(t, ready(i), "block %d", i)
	}
}

// testWatch is a watch of runs runs of units pages of blocks whole
// checksum blocks each, one region a run, marked.
func testWatch(runs, units, blocks int) *landingWatch {
	page := blocks * checksumBlock
	w := &landingWatch{seed: 12345, base: make([]int, runs*units+1)}
	for u := range runs * units {
		w.base[u+1] = w.base[u] + blocks
	}
	var pb []pageBlock
	for b := range blocks {
		pb = append(pb, pageBlock{off: b * checksumBlock, n: checksumBlock, b: b})
	}
	for r := range runs {
		run := watchedRun{mem: make([]byte, units*page), page: page, first: r * units, units: units, blocks: pb}
		for j := range units {
			for _, blk := range pb {
				binary.LittleEndian.PutUint64(run.mem[j*page+blk.off+blk.n-8:], w.mark(w.base[r*units+j]+blk.b))
			}
		}
		w.runs = append(w.runs, run)
	}
	w.sums = make([]uint64, runs*units*blocks)
	w.ready = make([]atomic.Uint64, (len(w.sums)+63)/64)
	w.early = make([]bool, runs*units)
	return w
}

func (w *landingWatch) isReady(i int) bool { return w.ready[i/64].Load()&(1<<(i%64)) != 0 }

// A block is summed only once its last byte has landed: not while a
// write has stopped within its last 8 bytes, nor, when its last byte is
// the mark's by chance, before the writer is past it.
func TestWatchWaitsForABlocksLastByte(t *testing.T) {
	w := testWatch(1, 1, 3)
	mem := w.runs[0].mem
	data := make([]byte, len(mem))
	for k := range data {
		data[k] = byte(k*7 + 1)
	}
	// Block 0 lands all but its last 3 bytes, then the rest.
	copy(mem[:checksumBlock-3], data)
	w.scan()
	assert.False(t, w.isReady(0), "a block whose last bytes are still to land")
	copy(mem[checksumBlock-3:checksumBlock], data[checksumBlock-3:])
	w.scan()
	require.True(t, w.isReady(0))
	assert.Equal(t, xxh3.Hash(data[:checksumBlock]), w.sums[0])

	// Block 1's last byte is its mark's.
	end := 2 * checksumBlock
	data[end-1] = byte(w.mark(1) >> 56)
	copy(mem[checksumBlock:end], data[checksumBlock:end])
	w.scan()
	assert.False(t, w.isReady(1), "a block whose last byte is the mark's, the writer not past it")
	copy(mem[end:], data[end:])
	w.scan()
	require.True(t, w.isReady(1), "the writer went past it")
	require.True(t, w.isReady(2))
	assert.Equal(t, xxh3.Hash(data[checksumBlock:end]), w.sums[1])
	assert.Equal(t, xxh3.Hash(data[end:]), w.sums[2])
}

// Whatever the order and the pieces the bytes land in, each byte once
// with the value the sender sent and a scan after each piece, the
// import completes against the sender's checksum once Resum has run:
// sums taken too soon are always caught and taken again.
func TestWatchAnyLandingOrderCompletes(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	resummed := 0 // rounds in which some sum was taken too soon
	for iter := range 40 {
		dst, out, in, l := watchSetup(t, 3)
		scan := l.watchMarked(rng.Uint64())
		require.NotNil(t, scan)
		// What the transport must write: each run's bytes, as writeRuns
		// would, cut into pieces of 1 byte to 9 KiB, in a random order.
		type piece struct {
			mem  []byte
			data []byte
		}
		var pieces []piece
		page := int(dst.lay.regions[0].PageBytes)
		unit := make([]byte, out.UnitBytes(0))
		for _, run := range l.Runs() {
			want := make([]byte, len(run.Mem))
			for i := range run.Units {
				require.NoError(t, out.ReadUnits(run.First+i, unit))
				copy(want[i*page:], unit[run.Region*page:(run.Region+1)*page])
			}
			for off := 0; off < len(want); {
				n := min(len(want)-off, 1+rng.IntN(9<<10))
				pieces = append(pieces, piece{run.Mem[off : off+n], want[off : off+n]})
				off += n
			}
		}
		if iter%2 == 1 { // every other round, in order but for a few swaps
			for range 5 {
				i, j := rng.IntN(len(pieces)), rng.IntN(len(pieces))
				pieces[i], pieces[j] = pieces[j], pieces[i]
			}
		} else {
			rng.Shuffle(len(pieces), func(i, j int) { pieces[i], pieces[j] = pieces[j], pieces[i] })
		}
		for _, p := range pieces {
			copy(p.mem, p.data)
			scan()
		}
		require.NoError(t, l.Landed(0, 3))
		want := mustChecksum(t, out)
		if l.Resum(want) > 0 {
			resummed++
		}
		l.Return()
		lease, err := in.CompleteWithChecksum(want)
		require.NoError(t, err, "round %d", iter)
		require.NoError(t, lease.Release())
		require.NoError(t, out.Ack())
		require.NoError(t, dst.Check())
	}
	assert.Positive(t, resummed, "no order summed a block too soon: the test shows nothing")
	t.Logf("%d of 40 rounds summed units again", resummed)
}
