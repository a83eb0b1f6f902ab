package cudaops

import (
	"fmt"
	"slices"
)

// Copies between the device's regions and page-locked host memory of its
// own (HostCopier): kvcache's host tier. The memory comes from
// cuMemAllocHost, so every run of adjacent pages of a region (into
// adjacent slots) is one cuMemcpy*Async straight into or out of it,
// queued on the device's stream after the fills already queued there,
// and a call waits for its copies once. No staging buffer sits between:
// the tier's memory is what a staged copy would stage into. A failed
// wait leaves copies that may still run, so the memory of such a call is
// never freed before Close, which drains the stream first.

var _ HostCopier = (*CUDA)(nil)

// AllocHost implements HostCopier with cuMemAllocHost: page-locked memory
// the device's copies reach by DMA.
func (d *CUDA) AllocHost(n int64) ([]byte, error) {
	if n <= 0 || n > maxPageBytes*64 {
		return nil, fmt.Errorf("%w: host memory of %d bytes, want 1..%d", ErrInvalidArgument, n, int64(maxPageBytes*64))
	}
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	g, err := d.enter()
	if err != nil {
		return nil, err
	}
	defer g.leave()
	b, err := d.drv.memAllocHost(int(n))
	if err != nil {
		if driverCode(err) == cuErrorOutOfMemory {
			return nil, fmt.Errorf("%w: %d bytes of page-locked host memory: %w", ErrOutOfMemory, n, err)
		}
		return nil, fmt.Errorf("%w: page-locked host memory: %w", ErrDriver, err)
	}
	d.mu.hostMem = append(d.mu.hostMem, b)
	return b, nil
}

// FreeHost implements HostCopier. Memory a failed copy may still reach
// is kept until Close.
func (d *CUDA) FreeHost(b []byte) error {
	d.life.RLock()
	defer d.life.RUnlock()
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return ErrClosed
	}
	i := d.hostMemIndexLocked(b)
	if i < 0 || hostAddr(d.mu.hostMem[i]) != hostAddr(b) {
		return fmt.Errorf("%w: FreeHost of memory AllocHost did not return", ErrInvalidArgument)
	}
	if d.mu.hostSuspect {
		return nil // a failed wait may leave copies into it: Close frees it
	}
	g, err := d.enter()
	if err != nil {
		return err
	}
	defer g.leave()
	d.mu.hostMem = slices.Delete(d.mu.hostMem, i, i+1)
	if err := d.drv.memFreeHost(b[:cap(b)]); err != nil {
		return fmt.Errorf("%w: freeing page-locked host memory: %w", ErrDriver, err)
	}
	return nil
}

// hostMemIndexLocked returns the index in hostMem of the allocation that
// holds all of b, or -1.
func (d *CUDA) hostMemIndexLocked(b []byte) int {
	if len(b) == 0 {
		return -1
	}
	lo, hi := hostAddr(b), hostAddr(b)+uint64(len(b))
	for i, m := range d.mu.hostMem {
		if base := hostAddr(m); lo >= base && hi <= base+uint64(len(m)) {
			return i
		}
	}
	return -1
}

// CopyToHost implements HostCopier: one cuMemcpyDtoHAsync per run, after
// the engine's work named by after, and one wait.
func (d *CUDA) CopyToHost(c HostCopy, after Ordering) error {
	return d.hostCopy(c, false, after, true)
}

// CopyFromHost implements HostCopier: one cuMemcpyHtoDAsync per run, and
// one wait.
func (d *CUDA) CopyFromHost(c HostCopy) error {
	return d.hostCopy(c, true, Ordering{}, false)
}

func (d *CUDA) hostCopy(c HostCopy, toDevice bool, after Ordering, ordered bool) error {
	d.life.RLock()
	defer d.life.RUnlock()
	if d.closed {
		return ErrClosed
	}
	if len(c.Pages) == 0 {
		d.mu.Lock()
		_, err := checkHostCopy(d.mu.regions, c)
		d.mu.Unlock()
		return err
	}
	g, err := d.enter()
	if err != nil {
		return err
	}
	defer g.leave()
	if ordered && after.IsZero() {
		// As Fill: before the device lock, the wait is the engine's.
		if err := d.syncContext(); err != nil {
			return err
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := checkHostCopy(d.mu.regions, c); err != nil {
		return err
	}
	for k := range c.Host {
		if d.hostMemIndexLocked(c.Host[k]) < 0 {
			return fmt.Errorf("%w: host memory of region %d was not allocated by AllocHost (it must be page-locked)", ErrInvalidArgument, c.Regions[k])
		}
	}
	if ordered && !after.IsZero() {
		if err := d.orderAfterLocked(after); err != nil {
			return err
		}
	}
	verb := "to host memory"
	if toDevice {
		verb = "from host memory"
	}
	var qerr error
	failed := -1
	for k, r := range c.Regions {
		reg, host := d.mu.regions[r], c.Host[k]
		pb := reg.PageBytes
		qerr = hostRuns(reg, c, func(i, j int) error {
			addr := reg.Base + uint64(c.Pages[i])*uint64(reg.Stride)
			slot := host[int64(c.Slots[i])*pb:][:int64(j-i)*pb]
			if toDevice {
				return d.drv.memcpyHtoDAsync(addr, slot, d.stream)
			}
			return d.drv.memcpyDtoHAsync(slot, addr, d.stream)
		})
		if qerr != nil {
			failed = r
			break
		}
	}
	// Wait even after a failed queue: the copies queued may still read
	// or write the memory.
	serr := d.drv.streamSynchronize(d.stream)
	if serr != nil {
		d.mu.hostSuspect = true // copies may still run: free nothing before Close
	}
	switch {
	case qerr != nil:
		return fmt.Errorf("%w: copying %d pages %s, region %d: %w", ErrDriver, len(c.Pages), verb, failed, qerr)
	case serr != nil:
		return fmt.Errorf("%w: copying %d pages %s: %w", ErrDriver, len(c.Pages), verb, serr)
	}
	return nil
}
