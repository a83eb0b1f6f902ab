package cudaops

import (
	"encoding/binary"
	"fmt"
)

// Host↔device copies. A kernel fill reads the region table from device
// memory: it changes only when a region is added, so it is uploaded
// then. A batch too large for the launch's parameters (fillInlineIDs
// pages) has its page list written into the staging ring (page-locked
// host memory) and copied asynchronously to its device twin. The slot
// must outlive that queued copy, so it is freed only when the fill's
// fence completes successfully, or a later one does (the stream runs in
// order): a failed wait does not mean the copy has run. A fill that
// finds the ring full with no fence in flight (every fill holding it
// failed) drains the stream instead, or fails if that fails. The ring
// is sized, when regions are added, for several of the largest batches a
// pool can issue, so a fill never allocates or frees driver memory (which
// can synchronise the device). ReadPage and WritePage copy Go memory
// synchronously on the device's stream, so they are ordered after every
// fill already queued.
// Batched copies (PageCopier, StagedCopier) go through a page-locked
// buffer of their own (copyHost), on the same stream: async copies of a
// staging buffer's worth, one wait, and the buffer is reused only after
// that wait succeeded, so no queued copy ever reads or writes it late (a
// buffer whose wait failed is set aside until Close).

// ringBatches is how many batches of the largest size the ring holds.
const ringBatches = 4

// minRingBytes is the ring's least size.
const minRingBytes = 64 << 10

// stagingRing is a page-locked host buffer and a device buffer of the same
// size that carry fills' page lists, used as a ring: head and tail count
// the bytes reserved and freed since the ring was allocated (gen).
// inFlight counts the fences of this ring the reaper has not completed:
// only they can free space; with none, a full ring stays full until the
// stream is drained.
type stagingRing struct {
	host       []byte
	dev        uint64
	head, tail uint64
	gen        uint64
	inFlight   int
}

// reserve takes n contiguous bytes (a slot never wraps: the end of the
// ring is skipped when it is too short) and returns the slot's offset.
func (r *stagingRing) reserve(n uint64) (uint64, bool) {
	size := uint64(len(r.host))
	if n == 0 || n > size {
		return 0, n == 0
	}
	pos, need := r.head%size, n
	if pos+n > size {
		need += size - pos
		pos = 0
	}
	if r.head+need-r.tail > size {
		return 0, false
	}
	r.head += need
	return pos, true
}

func (r *stagingRing) free(drv driver) {
	if r.host != nil {
		_ = drv.memFreeHost(r.host)
	}
	if r.dev != 0 {
		_ = drv.memFree(r.dev)
	}
	r.host, r.dev = nil, 0
}

// resizeLocked uploads regions' table to device memory and grows the
// staging ring for their largest batch (a batch names each page at most
// once, so it is at most the smallest region's page count). The context
// is current. On error the device's copies are unchanged.
func (d *CUDA) resizeLocked(regions []Region) error {
	wrap := func(what string, err error) error {
		if driverCode(err) == cuErrorOutOfMemory {
			return fmt.Errorf("%w: %s: %w", ErrOutOfMemory, what, err)
		}
		return fmt.Errorf("%w: %s: %w", ErrDriver, what, err)
	}
	table := make([]byte, len(regions)*regionEntryBytes)
	chunks := make([]regionChunks, len(regions))
	minPages := regions[0].Pages
	for i, r := range regions {
		e := table[i*regionEntryBytes:]
		chunks[i] = chunksFor(uint64(r.PageBytes/4), uint64(d.chunkWords))
		binary.LittleEndian.PutUint64(e[0:], r.Base)
		binary.LittleEndian.PutUint64(e[8:], uint64(r.Stride))
		binary.LittleEndian.PutUint64(e[16:], uint64(r.PageBytes/4))
		binary.LittleEndian.PutUint32(e[24:], chunks[i].words)
		binary.LittleEndian.PutUint32(e[28:], chunks[i].shift)
		minPages = min(minPages, r.Pages)
	}
	dev, err := d.drv.memAlloc(uint64(len(table)))
	if err != nil {
		return wrap("region table", err)
	}
	// Synchronous on the stream: fills queued before still read the old
	// table, and have finished when the copy returns.
	if err := d.drv.memcpyHtoDSync(dev, table, d.stream); err != nil {
		_ = d.drv.memFree(dev)
		return wrap("uploading the region table", err)
	}
	need := max(uint64(minRingBytes), ringBatches*4*uint64(minPages))
	need = (need + 255) &^ 255
	if uint64(len(d.mu.ring.host)) < need {
		host, err := d.drv.memAllocHost(int(need))
		if err != nil {
			_ = d.drv.memFree(dev)
			return wrap("staging ring", err)
		}
		rdev, err := d.drv.memAlloc(need)
		if err != nil {
			_ = d.drv.memFreeHost(host)
			_ = d.drv.memFree(dev)
			return wrap("staging ring", err)
		}
		// The table upload drained the stream: no queued copy reads the
		// old ring any more.
		d.mu.ring.free(d.drv)
		d.mu.ring = stagingRing{host: host, dev: rdev, gen: d.mu.ring.gen + 1}
		d.mu.ringFreed.Broadcast()
	}
	if d.mu.table != 0 {
		_ = d.drv.memFree(d.mu.table)
	}
	d.mu.table = dev
	d.mu.chunks = chunks
	return nil
}

// pageLocked validates (r, p, n) and returns the page's device address.
func (d *CUDA) pageLocked(r int, p int32, n int) (uint64, error) {
	if d.closed {
		return 0, ErrClosed
	}
	if r < 0 || r >= len(d.mu.regions) {
		return 0, fmt.Errorf("%w: region %d of %d", ErrInvalidArgument, r, len(d.mu.regions))
	}
	reg := d.mu.regions[r]
	if p < 0 || int(p) >= reg.Pages {
		return 0, fmt.Errorf("%w: page %d outside [0, %d)", ErrInvalidArgument, p, reg.Pages)
	}
	if n >= 0 && int64(n) != reg.PageBytes { // n < 0: a part, which the caller checks
		return 0, fmt.Errorf("%w: buffer of %d bytes for a page of %d", ErrInvalidArgument, n, reg.PageBytes)
	}
	return reg.Base + uint64(p)*uint64(reg.Stride), nil
}

// ReadPage implements Device: it waits for every fill already issued.
func (d *CUDA) ReadPage(r int, p int32, dst []byte) error {
	return d.copyPage(r, p, len(dst), "reading", func(addr uint64) error {
		return d.drv.memcpyDtoHSync(dst, addr, d.stream)
	})
}

// WritePage implements Device: the write lands after every fill already
// issued, and has landed when WritePage returns.
func (d *CUDA) WritePage(r int, p int32, src []byte) error {
	return d.copyPage(r, p, len(src), "writing", func(addr uint64) error {
		return d.drv.memcpyHtoDSync(addr, src, d.stream)
	})
}

// ReadPagePart implements PartReader: ReadPage of bytes [off,
// off+len(dst)) of the page.
func (d *CUDA) ReadPagePart(r int, p int32, off int, dst []byte) error {
	if off < 0 {
		return fmt.Errorf("%w: a part at offset %d", ErrInvalidArgument, off)
	}
	return d.copyPagePart(r, p, off, len(dst), "reading", func(addr uint64) error {
		return d.drv.memcpyDtoHSync(dst, addr, d.stream)
	})
}

// WritePagePart implements PartWriter: WritePage of bytes [off,
// off+len(src)) of the page.
func (d *CUDA) WritePagePart(r int, p int32, off int, src []byte) error {
	if off < 0 {
		return fmt.Errorf("%w: a part at offset %d", ErrInvalidArgument, off)
	}
	return d.copyPagePart(r, p, off, len(src), "writing", func(addr uint64) error {
		return d.drv.memcpyHtoDSync(addr, src, d.stream)
	})
}

var (
	_ PartReader = (*CUDA)(nil)
	_ PartWriter = (*CUDA)(nil)
)

// copyPage runs a synchronous copy of page p of region r on the device's
// stream, so that it is ordered after every fill already issued.
func (d *CUDA) copyPage(r int, p int32, n int, verb string, copyAt func(addr uint64) error) error {
	return d.copyPagePart(r, p, -1, n, verb, copyAt)
}

// copyPagePart is copyPage of n bytes at offset off of the page; off < 0
// means the whole page, which n must then be.
func (d *CUDA) copyPagePart(r int, p int32, off, n int, verb string, copyAt func(addr uint64) error) error {
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	var addr uint64
	var err error
	if off < 0 {
		addr, err = d.pageLocked(r, p, n)
	} else if addr, err = d.pageLocked(r, p, -1); err == nil {
		if pb := d.mu.regions[r].PageBytes; int64(off) > pb || int64(n) > pb-int64(off) {
			err = fmt.Errorf("%w: %d bytes at offset %d of a page of %d", ErrInvalidArgument, n, off, pb)
		}
		addr += uint64(off)
	}
	if err != nil || n == 0 {
		return err // nothing to copy: no driver call at the end of a region
	}
	g, err := d.enter()
	if err != nil {
		return err
	}
	defer g.leave()
	if err := copyAt(addr); err != nil {
		return fmt.Errorf("%w: %s page %d of region %d: %w", ErrDriver, verb, p, r, err)
	}
	return nil
}

// copyStagingBytes is the size of the page-locked buffer batched copies
// go through (StagedCopier), allocated at the first such copy; a page
// larger than it (over the regions copied) gets a buffer of its own size.
const copyStagingBytes = 8 << 20

// ReadPages implements PageCopier: ReadStaged of region r, each batch
// copied out of staging into its place in dst.
func (d *CUDA) ReadPages(r int, pages []int32, dst []byte) error {
	return d.copyStaged([]int{r}, pages, len(dst), false, func(first int, staged [][]byte) {
		pb := len(dst) / len(pages) // copyStaged checked len(dst) = len(pages) × PageBytes
		copy(dst[first*pb:], staged[0])
	})
}

// WritePages implements PageCopier: WriteStaged of region r, each batch
// copied into staging from its place in src.
func (d *CUDA) WritePages(r int, pages []int32, src []byte) error {
	return d.copyStaged([]int{r}, pages, len(src), true, func(first int, staged [][]byte) {
		pb := len(src) / len(pages)
		copy(staged[0], src[first*pb:])
	})
}

// ReadStaged implements StagedCopier: each batch goes from the device into
// page-locked staging with one asynchronous copy per run of adjacent
// pages per region (per page in a strided region), is waited for once,
// and is then drained.
func (d *CUDA) ReadStaged(regions []int, pages []int32, drain func(first int, staged [][]byte)) error {
	return d.copyStaged(regions, pages, -1, false, drain)
}

// WriteStaged implements StagedCopier, the other way: each batch is filled,
// goes to the device with one asynchronous copy per run of adjacent pages
// per region, and is waited for before staging is filled again.
func (d *CUDA) WriteStaged(regions []int, pages []int32, fill func(first int, staged [][]byte)) error {
	return d.copyStaged(regions, pages, -1, true, fill)
}

var _ StagedCopier = (*CUDA)(nil)

// copyStaged runs a PageCopier or StagedCopier call: regions of pages, a
// staging buffer's worth at a time, each batch laid out region by region
// (see StagedCopier) so that a run of adjacent pages of a contiguous
// region is one copy, and every copy of a batch, over all its regions,
// waited for once. stage fills a batch before it is written, or drains it
// after it was read.
// With bufLen ≥ 0 the call is refused unless a buffer of bufLen bytes
// holds exactly the pages (ReadPages, WritePages). Nothing is copied
// unless the whole call is valid.
func (d *CUDA) copyStaged(regions []int, pages []int32, bufLen int, write bool, stage func(first int, staged [][]byte)) error {
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return ErrClosed
	}
	pageBytes, err := checkStaged(d.mu.regions, regions, pages)
	if err != nil {
		return err
	}
	if bufLen >= 0 && int64(bufLen) != int64(len(pages))*pageBytes {
		return fmt.Errorf("%w: buffer of %d bytes for %d pages of %d", ErrInvalidArgument, bufLen, len(pages), pageBytes)
	}
	if len(pages) == 0 {
		return nil
	}
	g, err := d.enter()
	if err != nil {
		return err
	}
	defer g.leave()
	if need := max(d.copyStaging, int(pageBytes)); len(d.mu.copyHost) < need {
		host, err := d.drv.memAllocHost(need)
		if err != nil {
			return fmt.Errorf("%w: copy staging: %w", ErrDriver, err)
		}
		if d.mu.copyHost != nil {
			_ = d.drv.memFreeHost(d.mu.copyHost) // no copy uses it: each waits before returning
		}
		d.mu.copyHost = host
	}
	verb := "reading"
	if write {
		verb = "writing"
	}
	per := len(d.mu.copyHost) / int(pageBytes)
	staged := make([][]byte, len(regions))
	for first := 0; first < len(pages); first += per {
		batch := pages[first:min(first+per, len(pages))]
		off := 0
		for k, r := range regions {
			n := len(batch) * int(d.mu.regions[r].PageBytes)
			staged[k] = d.mu.copyHost[off : off+n : off+n]
			off += n
		}
		if write {
			stage(first, staged)
		}
		failed := -1 // the region whose copy could not be queued
		for k, r := range regions {
			if err = d.queueRunsLocked(d.mu.regions[r], batch, staged[k], write); err != nil {
				failed = r
				break
			}
		}
		// Wait even after a failed queue: staging must not be reused
		// while a queued copy may still read or write it.
		serr := d.drv.streamSynchronize(d.stream)
		if serr != nil {
			// A failed wait does not mean the copies are done: one may
			// still run and read staging then, writing whatever a later
			// call staged into this call's pages. This staging is never
			// used again; the next call allocates its own.
			d.mu.abandonedHost = append(d.mu.abandonedHost, d.mu.copyHost)
			d.mu.copyHost = nil
		}
		switch {
		case err != nil:
			return fmt.Errorf("%w: %s pages [%d, %d) of the %d listed, region %d: %w",
				ErrDriver, verb, first, first+len(batch), len(pages), failed, err)
		case serr != nil:
			return fmt.Errorf("%w: %s pages [%d, %d) of the %d listed, %d regions: %w",
				ErrDriver, verb, first, first+len(batch), len(pages), len(regions), serr)
		}
		if !write {
			stage(first, staged)
		}
	}
	return nil
}

// queueRunsLocked queues the copies between batch's pages of reg and
// staged, their bytes page after page: one per run of adjacent pages
// when the region is contiguous, one per page when it is strided.
func (d *CUDA) queueRunsLocked(reg Region, batch []int32, staged []byte, write bool) error {
	pb := int(reg.PageBytes)
	for j := 0; j < len(batch); {
		k := j + 1
		for reg.Contiguous() && k < len(batch) && batch[k] == batch[k-1]+1 {
			k++
		}
		addr := reg.Base + uint64(batch[j])*uint64(reg.Stride)
		b := staged[j*pb : k*pb]
		var err error
		if write {
			err = d.drv.memcpyHtoDAsync(addr, b, d.stream)
		} else {
			err = d.drv.memcpyDtoHAsync(b, addr, d.stream)
		}
		if err != nil {
			return err
		}
		j = k
	}
	return nil
}
