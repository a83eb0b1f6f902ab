package cudaops

import (
	"fmt"

	"github.com/kvfence/kvfence/internal/memfill"
)

// HostCopier is implemented by devices that copy pages straight between
// their regions and host memory they allocated for it (AllocHost): a
// second page space in host memory, such as kvcache's host tier, whose
// slots hold evicted pages until they are copied back into fresh ones.
// On CUDA that memory is page-locked (cuMemAllocHost), so each run of
// adjacent pages of a region is one asynchronous DMA straight into or out
// of it, with no staging copy, and a call waits once for all of them. On
// the Host it is Go memory, and a run is one memory copy.
//
// Host memory of a HostCopy is laid out by region: Host[k] holds region
// Regions[k] of slot after slot, each that region's PageBytes long. Slot s
// of page i is Host[k][s·PageBytes : (s+1)·PageBytes].
type HostCopier interface {
	// AllocHost returns n bytes of host memory for HostCopy calls; its
	// content is unspecified. The device frees what is left of it at
	// Close.
	AllocHost(n int64) ([]byte, error)
	// FreeHost frees memory AllocHost returned, which no copy may be
	// using.
	FreeHost(b []byte) error
	// CopyToHost copies, for every k and i, region Regions[k] of page
	// Pages[i] into slot Slots[i] of Host[k]. It is ordered after the
	// engine work named by after (the zero Ordering: all work of the
	// device's context, as Fill) and after fills already issued, and the
	// bytes have landed when it returns. A call that is not valid copies
	// nothing; a copy that fails may have copied some runs and not
	// others: the caller must treat every slot of the call as unwritten.
	CopyToHost(c HostCopy, after Ordering) error
	// CopyFromHost copies the other way: slot Slots[i] of Host[k] into
	// region Regions[k] of page Pages[i]. It is ordered after fills
	// already issued (its pages are ones no engine work touches yet), and
	// the bytes have landed when it returns. Failures are CopyToHost's.
	CopyFromHost(c HostCopy) error
}

// HostCopy is one call of a HostCopier (see there for the layout).
type HostCopy struct {
	Regions []int
	Host    [][]byte
	Pages   []int32
	Slots   []int32
}

// checkHostCopy validates c against a region table: every region exists
// and is contiguous or not, every page is valid in each, every slot lies
// within its region's host memory. It returns the bytes one page over
// the regions copies.
func checkHostCopy(table []Region, c HostCopy) (int64, error) {
	switch {
	case len(c.Host) != len(c.Regions):
		return 0, fmt.Errorf("%w: host copy of %d regions with %d host buffers", ErrInvalidArgument, len(c.Regions), len(c.Host))
	case len(c.Pages) != len(c.Slots):
		return 0, fmt.Errorf("%w: host copy of %d pages into %d slots", ErrInvalidArgument, len(c.Pages), len(c.Slots))
	}
	pageBytes, err := checkStaged(table, c.Regions, c.Pages)
	if err != nil {
		return 0, err
	}
	for k, r := range c.Regions {
		slots := int64(len(c.Host[k])) / table[r].PageBytes
		for _, s := range c.Slots {
			if s < 0 || int64(s) >= slots {
				return 0, fmt.Errorf("%w: slot %d outside the %d slots of the host memory of region %d", ErrInvalidArgument, s, slots, r)
			}
		}
	}
	return pageBytes, nil
}

// hostRuns calls run for each run of c's pages and slots that one copy of
// region reg can move: adjacent pages into adjacent slots of a contiguous
// region, one page at a time otherwise. i and j bound the run in c.Pages.
func hostRuns(reg Region, c HostCopy, run func(i, j int) error) error {
	for i := 0; i < len(c.Pages); {
		j := i + 1
		for reg.Contiguous() && j < len(c.Pages) && c.Pages[j] == c.Pages[j-1]+1 && c.Slots[j] == c.Slots[j-1]+1 {
			j++
		}
		if err := run(i, j); err != nil {
			return err
		}
		i = j
	}
	return nil
}

var _ HostCopier = (*Host)(nil)

// AllocHost implements HostCopier: Go memory, advised to use huge pages
// when large (AllocRegion's memory is too).
func (h *Host) AllocHost(n int64) ([]byte, error) {
	if n <= 0 || n > maxHostRegion {
		return nil, fmt.Errorf("%w: host memory of %d bytes, want 1..%d", ErrInvalidArgument, n, int64(maxHostRegion))
	}
	h.mu.RLock()
	closed := h.mu.closed
	h.mu.RUnlock()
	if closed {
		return nil, ErrClosed
	}
	mem := make([]byte, n)
	adviseHuge(mem)
	return mem, nil
}

// FreeHost implements HostCopier: the garbage collector frees Go memory.
func (h *Host) FreeHost([]byte) error { return nil }

// CopyToHost implements HostCopier.
func (h *Host) CopyToHost(c HostCopy, _ Ordering) error { return h.hostCopy(c, false) }

// CopyFromHost implements HostCopier.
func (h *Host) CopyFromHost(c HostCopy) error { return h.hostCopy(c, true) }

// hostCopy copies c with one memory copy per run, with streaming stores
// both ways: a page written to host memory is read again only when it is
// copied back, and a page copied back is read by the engine's next step,
// after its prefill wrote the rest of the request.
func (h *Host) hostCopy(c HostCopy, toDevice bool) error {
	h.afterFills()
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.mu.closed {
		return ErrClosed
	}
	if _, err := checkHostCopy(h.mu.regions, c); err != nil {
		return err
	}
	for k, r := range c.Regions {
		reg, mem, host := h.mu.regions[r], h.mu.mem[r], c.Host[k]
		pb := reg.PageBytes
		_ = hostRuns(reg, c, func(i, j int) error {
			dev := mem[int64(c.Pages[i])*reg.Stride:][:int64(j-i-1)*reg.Stride+pb]
			slot := host[int64(c.Slots[i])*pb:][:int64(j-i)*pb]
			if toDevice {
				memfill.CopyStreaming(dev, slot)
			} else {
				memfill.CopyStreaming(slot, dev)
			}
			return nil
		})
	}
	return nil
}
