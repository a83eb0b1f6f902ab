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
// fence completes. The ring is sized, when regions
// are added, for several of the largest batches a pool can issue, so a
// fill never allocates or frees driver memory (which can synchronise the
// device). ReadPage and WritePage copy Go memory synchronously on the
// device's stream, so they are ordered after every fill already queued.

// ringBatches is how many batches of the largest size the ring holds.
const ringBatches = 4

// minRingBytes is the ring's least size.
const minRingBytes = 64 << 10

// stagingRing is a page-locked host buffer and a device buffer of the same
// size that carry fills' page lists, used as a ring: head and tail count
// the bytes reserved and freed since the ring was allocated (gen).
type stagingRing struct {
	host       []byte
	dev        uint64
	head, tail uint64
	gen        uint64
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
	if int64(n) != reg.PageBytes {
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

// copyPage runs a synchronous copy of page p of region r on the device's
// stream, so that it is ordered after every fill already issued.
func (d *CUDA) copyPage(r int, p int32, n int, verb string, copyAt func(addr uint64) error) error {
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	addr, err := d.pageLocked(r, p, n)
	if err != nil {
		return err
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
// go through (PageCopier), allocated at the first such copy; a page
// larger than it gets a buffer of its own size.
const copyStagingBytes = 8 << 20

// ReadPages implements PageCopier: pages go from the device into
// page-locked staging with one asynchronous copy per run of adjacent
// pages (per page in a strided region), a staging buffer's worth at a
// time, each batch waited for once and then copied out.
func (d *CUDA) ReadPages(r int, pages []int32, dst []byte) error {
	return d.copyPages(r, pages, dst, false)
}

// WritePages implements PageCopier, the other way: src is copied into
// staging, each staging buffer's worth goes to the device with one
// asynchronous copy per run of adjacent pages, and is waited for; the
// writes have landed when it returns.
func (d *CUDA) WritePages(r int, pages []int32, src []byte) error {
	return d.copyPages(r, pages, src, true)
}

var _ PageCopier = (*CUDA)(nil)

func (d *CUDA) copyPages(r int, pages []int32, buf []byte, write bool) error {
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return ErrClosed
	}
	reg, err := checkCopy(d.mu.regions, r, pages, len(buf))
	if err != nil || len(pages) == 0 {
		return err
	}
	g, err := d.enter()
	if err != nil {
		return err
	}
	defer g.leave()
	pb := uint64(reg.PageBytes)
	if need := max(uint64(d.copyStaging), pb); uint64(len(d.mu.copyHost)) < need {
		host, err := d.drv.memAllocHost(int(need))
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
	per := len(d.mu.copyHost) / int(pb)
	for i := 0; i < len(pages); i += per {
		batch := pages[i:min(i+per, len(pages))]
		part := buf[uint64(i)*pb:][:uint64(len(batch))*pb]
		stage := d.mu.copyHost[:len(part)]
		if write {
			copy(stage, part)
		}
		for j := 0; j < len(batch); {
			k := j + 1
			for reg.Contiguous() && k < len(batch) && batch[k] == batch[k-1]+1 {
				k++
			}
			addr := reg.Base + uint64(batch[j])*uint64(reg.Stride)
			b := stage[uint64(j)*pb : uint64(k)*pb]
			if write {
				err = d.drv.memcpyHtoDAsync(addr, b, d.stream)
			} else {
				err = d.drv.memcpyDtoHAsync(b, addr, d.stream)
			}
			if err != nil {
				break
			}
			j = k
		}
		// Wait even after a failed queue: staging must not be reused
		// while a queued copy may still read or write it.
		if serr := d.drv.streamSynchronize(d.stream); err == nil {
			err = serr
		}
		if err != nil {
			return fmt.Errorf("%w: %s %d pages of region %d: %w", ErrDriver, verb, len(pages), r, err)
		}
		if !write {
			copy(part, stage)
		}
	}
	return nil
}
