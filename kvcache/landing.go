package kvcache

import (
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"sync/atomic"

	"github.com/zeebo/xxh3"
)

// Sums taken as the bytes land.
//
// A transport whose own threads copy the sender's bytes into the lent
// memory (UCX's emulated puts over shared memory: the receiver's worker
// copies each element out of its queue as it progresses) leaves each
// block it wrote in the cache of the core that wrote it. Summed there and
// then, a block costs a fraction of what it costs read back from memory
// when its unit's landed note comes, on whichever core: on a machine
// whose cores are shared by both ends of a handoff, that read is what
// stands between the handoff and the transport's own speed. PageLoan.Watch
// arranges it:
//
//   - it writes a mark into the last 8 bytes of every checksum block
//     (4 KiB of a unit, checksum.go) that lies wholly in one region's
//     page, a value drawn at random for the loan and distinct per block;
//   - the transport calls the scan Watch returns each time it may have
//     written into the memory, on the thread that wrote: the scan walks
//     each run of pages from where it stopped and sums every block whose
//     last byte is no longer the mark's, for, written in address order (a
//     copy, a receive), all of it has then landed; a block whose last byte
//     still is (a write that stopped within the last 8 bytes, or a byte
//     equal to the mark's by chance) waits until the next block's mark is
//     touched;
//   - Landed takes a unit's block sums from the scan where it has them
//     and sums the rest (blocks the scan has not reached, blocks that
//     straddle two regions) from memory.
//
// A sum taken too soon is wrong, and caught: a writer that does not fill
// a block in address order (a NIC, whose writes may become visible in
// any order) can have a block summed before all of it landed. Its unit's
// sum then differs from the sender's, and so does the content checksum;
// Resum, called once nothing writes the memory any more, sums every unit
// that used a scanned block again from memory before the import is
// completed against the seal. A block whose bytes end with its
// mark by chance (one in 2^64) is never seen to land and is summed from
// memory. What a scan sums is the block as first written: a sender that
// writes a byte twice breaks the protocol, as one that writes a unit
// after its landed note always did (handoff's remote.go), and leaves
// bytes the seal did not vouch for in its own import's pages, no other's.

// scanIdleRuns is how many runs in a row a scan visits in which nothing
// new landed before it stops: a sender writes a chunk region by region,
// so the bytes land in one run, then the next, and a scan need not visit
// every run of a model's many regions each time (scan).
const scanIdleRuns = 4

// landingWatch is a loan's watch (PageLoan.Watch).
type landingWatch struct {
	seed uint64
	// base[u] is the index of unit u's first checksum block in sums and
	// ready: unit u's block b is base[u]+b.
	base []int
	// sums[i] is block i's sum once ready's bit i is set; the scan writes
	// it before it sets the bit, and Landed reads it after it saw the bit.
	sums  []uint64
	ready []atomic.Uint64
	// early[u]: Landed took some block sum of unit u from the scan (each
	// Landed writes its own units'; Resum reads them after the last).
	early   []bool
	stopped atomic.Bool // the loan was returned: scans do nothing

	// The scan's alone (the transport calls it from one goroutine at a
	// time).
	runs  []watchedRun
	cur   int // the run the scan last found bytes landing in
	sweep int // the run the scan looks at next when none after cur took bytes
}

// watchedRun is a PageRun's watched blocks.
type watchedRun struct {
	mem    []byte
	page   int // the region's page bytes
	first  int // the run's first unit
	units  int
	blocks []pageBlock // the blocks the region's page holds whole, by offset
	next   int         // the run's first block not yet seen to land, counted over its units
}

// pageBlock is a checksum block that lies wholly in a region's page.
type pageBlock struct {
	off, n int // where in the page, how long
	b      int // which block of its unit
}

// Watch has the loan sum each block of its memory as it lands (see
// "Sums taken as the bytes land" above): it marks the memory, and returns
// the scan the transport calls, on the thread that wrote, each time it
// may have written into the memory, from one goroutine at a time, until
// it no longer writes it (before Return). It must be called before any
// writer can write the memory (before the sender has what it needs to),
// for it writes into it. It returns nil where no block lies wholly in
// one page, once a unit has landed, or once the loan was returned; a
// second call returns the first's scan.
func (l *PageLoan) Watch() (scan func()) { return l.watchMarked(rand.Uint64()) }

// watchMarked is Watch with the marks drawn from seed, so that a test
// knows which blocks' last bytes are their marks' by chance.
func (l *PageLoan) watchMarked(seed uint64) (scan func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.mu.returned:
		return nil
	case l.watch != nil:
		return l.watch.scan
	case slices.Contains(l.mu.landed, true):
		return nil
	}
	w := &landingWatch{seed: seed, base: make([]int, len(l.unitParts)+1)}
	for u, parts := range l.unitParts {
		n := 0
		for _, p := range parts {
			n += len(p)
		}
		w.base[u+1] = w.base[u] + (n+checksumBlock-1)/checksumBlock
	}
	groups := l.in.pool.groups
	for _, run := range l.runs {
		parts := l.unitParts[run.First]
		k := run.Region - groups[l.in.units[run.First].group].first
		blocks := wholeBlocks(parts, k)
		if len(blocks) == 0 {
			continue
		}
		wr := watchedRun{mem: run.Mem, page: len(parts[k]), first: run.First, units: run.Units, blocks: blocks}
		for bk := range wr.units * len(blocks) {
			b, i := w.block(&wr, bk)
			binary.LittleEndian.PutUint64(b[len(b)-8:], w.mark(i))
		}
		w.runs = append(w.runs, wr)
	}
	if len(w.runs) == 0 {
		return nil
	}
	blocks := w.base[len(l.unitParts)]
	w.sums = make([]uint64, blocks)
	w.ready = make([]atomic.Uint64, (blocks+63)/64)
	w.early = make([]bool, len(l.unitParts))
	l.watch = w
	return w.scan
}

// wholeBlocks lists the checksum blocks of a unit whose regions' pages
// are parts that lie wholly in parts[k], each at least 8 bytes long (the
// mark's).
func wholeBlocks(parts [][]byte, k int) []pageBlock {
	start, unit := 0, 0
	for i, p := range parts {
		if i < k {
			start += len(p)
		}
		unit += len(p)
	}
	end := start + len(parts[k])
	var blocks []pageBlock
	for b := (start + checksumBlock - 1) / checksumBlock; b*checksumBlock < unit; b++ {
		lo, hi := b*checksumBlock, min((b+1)*checksumBlock, unit)
		if hi > end {
			break
		}
		if hi-lo >= 8 {
			blocks = append(blocks, pageBlock{off: lo - start, n: hi - lo, b: b})
		}
	}
	return blocks
}

// mark is block i's mark.
func (w *landingWatch) mark(i int) uint64 { return w.seed ^ uint64(i+1)*0x9e3779b97f4a7c15 }

// block returns run r's block k, counted over the run's units, and its
// index among the loan's blocks (its mark's and its sum's).
func (w *landingWatch) block(r *watchedRun, k int) (b []byte, i int) {
	j, blk := k/len(r.blocks), r.blocks[k%len(r.blocks)]
	at := j*r.page + blk.off
	return r.mem[at : at+blk.n : at+blk.n], w.base[r.first+j] + blk.b
}

// lastWord is a block's last 8 bytes, where its mark is written.
func lastWord(b []byte) uint64 { return binary.LittleEndian.Uint64(b[len(b)-8:]) }

// scan sums the blocks that have landed since the last scan. They lie
// where the bytes landed last (cur) and in the runs that follow, for a
// writer writes a chunk region by region; when nothing landed there the
// writer has moved on (the next chunk starts again at its group's first
// region), and the scan looks a few runs further round the ring each
// time (sweep), so that it finds the new place within a few scans
// whatever the number of runs, at a few reads a scan.
func (w *landingWatch) scan() {
	if w.stopped.Load() {
		return
	}
	if w.follow(w.cur) {
		return
	}
	for range min(scanIdleRuns, len(w.runs)) {
		r := w.sweep
		if w.sweep++; w.sweep == len(w.runs) {
			w.sweep = 0
		}
		if w.follow(r) {
			return
		}
	}
}

// follow sums what landed in run r and, if anything did, in the runs
// after it, until scanIdleRuns in a row took nothing; it reports whether
// r took anything.
func (w *landingWatch) follow(r int) bool {
	if !w.advance(&w.runs[r]) {
		return false
	}
	w.cur = r
	for i, idle := r+1, 0; idle < scanIdleRuns; i++ {
		if i == len(w.runs) {
			i = 0
		}
		if i == r {
			break
		}
		if w.advance(&w.runs[i]) {
			w.cur, idle = i, 0
		} else {
			idle++
		}
	}
	return true
}

// advance sums run r's blocks that have landed, in order from the first
// one not seen yet, and reports whether there were any.
func (w *landingWatch) advance(r *watchedRun) bool {
	moved := false
	for r.next < r.units*len(r.blocks) {
		b, i := w.block(r, r.next)
		tail, mark := lastWord(b), w.mark(i)
		if tail == mark {
			break // nothing of its last 8 bytes has landed
		}
		if tail>>56 == mark>>56 && !w.passed(r) {
			// Its last byte is still the mark's: the write stopped
			// within the last 8 bytes (a receive or a queue element
			// ended there), or that byte is the mark's by chance (1 in
			// 256). It has landed whole once the writer is past it.
			break
		}
		w.sums[i] = xxh3.Hash(b)
		w.ready[i/64].Or(1 << (i % 64))
		r.next++
		moved = true
	}
	return moved
}

// passed reports whether the writer has gone past run r's next block:
// the last 8 bytes of the watched block after it are no longer its mark.
func (w *landingWatch) passed(r *watchedRun) bool {
	k := r.next + 1
	if k >= r.units*len(r.blocks) {
		return false
	}
	b, i := w.block(r, k)
	return lastWord(b) != w.mark(i)
}

// known returns unit u's block sums as the scan took them, for
// pageChecksumOf.
func (w *landingWatch) known(u int) func(b int) (uint64, bool) {
	return func(b int) (uint64, bool) {
		i := w.base[u] + b
		if w.ready[i/64].Load()&(1<<(i%64)) == 0 {
			return 0, false
		}
		w.early[u] = true
		return w.sums[i], true
	}
}

// Resum, called once nothing writes the loan's memory any more (after
// the transport's revoke) and before Return, sums again from memory
// every unit that landed with some block summed as it landed (Watch), if
// the units' sums do not make the content checksum want: a block summed
// before all of it had landed is then summed as it is now, and the
// import is completed (CompleteWithChecksum) against what its memory
// holds. It must not run beside Landed, and reports how many units it
// summed again.
func (l *PageLoan) Resum(want uint32) int {
	l.mu.Lock()
	w, returned := l.watch, l.mu.returned
	l.mu.Unlock()
	if w == nil || returned {
		return 0
	}
	in := l.in
	in.mu.Lock()
	mismatch := in.mu.received == len(in.units) && ContentChecksum(in.mu.sums) != want
	in.mu.Unlock()
	if !mismatch {
		return 0
	}
	var units []int
	var sums []uint64
	for u, early := range w.early {
		if early {
			units = append(units, u)
			sums = append(sums, PageChecksumOf(l.unitParts[u]))
		}
	}
	in.mu.Lock()
	for i, u := range units {
		in.mu.sums[u] = sums[i]
	}
	in.mu.Unlock()
	return len(units)
}
