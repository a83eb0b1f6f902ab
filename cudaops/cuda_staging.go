package cudaops

import (
	"fmt"
)

// Host↔device copies. A kernel fill reads its region table and page list
// from device memory, so each batch is first written into a page-locked
// host buffer and copied asynchronously; the buffer must outlive that
// queued copy, which is why staging buffers are tracked here with the
// fence of the fill that last used them. ReadPage and WritePage copy Go
// memory synchronously on the device's stream, so they are ordered after
// every fill already queued.

// maxStaging bounds the staging buffers, so the fills in flight.
const maxStaging = 16

// staging is a page-locked host buffer and a device buffer of the same
// size that carry one fill's region table and page list.
type staging struct {
	host  []byte
	dev   uint64
	fence *cudaFence // the last fill that used it; nil if none
}

// idle reports whether no queued copy or kernel can still use s.
func (s *staging) idle() bool {
	if s.fence == nil {
		return true
	}
	done, _ := s.fence.poll()
	return done
}

// stagingLocked returns an idle staging buffer of at least n bytes,
// growing or adding one if needed and, when maxStaging are all busy,
// waiting for the oldest.
func (d *CUDA) stagingLocked(n int) (*staging, error) {
	var spare *staging
	for _, s := range d.mu.staging {
		if !s.idle() {
			continue
		}
		if len(s.host) >= n {
			s.fence = nil
			return s, nil
		}
		spare = s
	}
	if spare == nil && len(d.mu.staging) >= maxStaging {
		// All busy: wait for the first. Its fence's error, if any,
		// belongs to its own Fill's caller.
		spare = d.mu.staging[0]
		_ = spare.fence.wait()
		if len(spare.host) >= n {
			spare.fence = nil
			return spare, nil
		}
	}
	size := max(n, 64<<10)
	host, err := d.drv.memAllocHost(size)
	if err != nil {
		return nil, fmt.Errorf("%w: staging buffer: %w", ErrDriver, err)
	}
	dev, err := d.drv.memAlloc(uint64(size))
	if err != nil {
		_ = d.drv.memFreeHost(host)
		return nil, fmt.Errorf("%w: staging buffer: %w", ErrDriver, err)
	}
	s := &staging{host: host, dev: dev}
	if spare != nil {
		// spare is idle: nothing queued reads its buffers any more.
		d.freeStaging(spare)
		for i, x := range d.mu.staging {
			if x == spare {
				d.mu.staging[i] = s
			}
		}
	} else {
		d.mu.staging = append(d.mu.staging, s)
	}
	return s, nil
}

func (d *CUDA) freeStaging(s *staging) {
	_ = d.drv.memFreeHost(s.host)
	_ = d.drv.memFree(s.dev)
}

// page validates (r, p, n) and returns the page's device address. d.mu held.
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
	if err := d.enter(); err != nil {
		return err
	}
	defer d.leave()
	if err := copyAt(addr); err != nil {
		return fmt.Errorf("%w: %s page %d of region %d: %w", ErrDriver, verb, p, r, err)
	}
	return nil
}
