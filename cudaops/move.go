package cudaops

import "fmt"

// Page moves: copies of whole pages from one page to another in the same
// regions, on the device. kvcache takes a state checkpoint by copying a
// lease's slot (every region of its group) onto a slot the prefix cache
// keeps, and restores one the other way into a new lease's slot, each
// ordered after the engine's work and fenced like a fill.

// PageMove copies page From onto page To, in every region of its span.
type PageMove struct{ From, To int32 }

// MoveSpan is the page moves of one span of regions [First, First+Count).
type MoveSpan struct {
	First, Count int
	Moves        []PageMove
}

// PageMover is implemented by devices that copy pages within the device,
// as one operation ordered after the engine work named by after (as
// Fill is: a zero Ordering waits for all work of the context) and
// completed by one fence: on CUDA, one asynchronous device-to-device copy
// per run of adjacent pages per region; on the Host, one pass. A batch
// CheckMoves refuses is refused before anything is copied.
type PageMover interface {
	MovePages(spans []MoveSpan, after Ordering) (Fence, error)
}

// CheckMoves validates a MovePages batch against a region table: every
// span names at least one region, within the table; no two spans share a
// region; every page is valid in every region of its span; no move copies
// a page onto itself, and no page of a span is written twice or both read
// and written (the moves of a span may run in any order, or at once).
func CheckMoves(regions []Region, spans []MoveSpan) error {
	for si, s := range spans {
		if s.Count < 1 || s.First < 0 || s.First > len(regions)-s.Count {
			return fmt.Errorf("%w: span %d names regions [%d, %d+%d) of %d", ErrInvalidArgument, si, s.First, s.First, s.Count, len(regions))
		}
		for oi, o := range spans[:si] {
			if s.First < o.First+o.Count && o.First < s.First+s.Count {
				return fmt.Errorf("%w: spans %d and %d share region %d", ErrInvalidArgument, oi, si, max(s.First, o.First))
			}
		}
		limit := regions[s.First].Pages
		for _, r := range regions[s.First : s.First+s.Count] {
			limit = min(limit, r.Pages)
		}
		written := make(map[int32]bool, len(s.Moves))
		for _, m := range s.Moves {
			switch {
			case m.From < 0 || int(m.From) >= limit || m.To < 0 || int(m.To) >= limit:
				return fmt.Errorf("%w: span %d moves page %d onto page %d, pages are [0, %d)", ErrInvalidArgument, si, m.From, m.To, limit)
			case m.From == m.To:
				return fmt.Errorf("%w: span %d moves page %d onto itself", ErrInvalidArgument, si, m.From)
			case written[m.To]:
				return fmt.Errorf("%w: span %d writes page %d twice", ErrInvalidArgument, si, m.To)
			}
			written[m.To] = true
		}
		for _, m := range s.Moves {
			if written[m.From] {
				return fmt.Errorf("%w: span %d both reads and writes page %d", ErrInvalidArgument, si, m.From)
			}
		}
	}
	return nil
}

// MovePages implements PageMover: one pass, after every fill issued
// before it.
func (h *Host) MovePages(spans []MoveSpan, after Ordering) (Fence, error) {
	h.afterFills()
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.mu.closed {
		return nil, ErrClosed
	}
	if err := CheckMoves(h.mu.regions, spans); err != nil {
		return nil, err
	}
	for _, s := range spans {
		for r := s.First; r < s.First+s.Count; r++ {
			reg, mem := h.mu.regions[r], h.mu.mem[r]
			for _, m := range s.Moves {
				from, to := int64(m.From)*reg.Stride, int64(m.To)*reg.Stride
				copy(mem[to:to+reg.PageBytes], mem[from:from+reg.PageBytes])
			}
		}
	}
	return Completed(nil), nil
}

var _ PageMover = (*Host)(nil)

// MovePages implements PageMover: the copies are queued on the device's
// stream after the ordering, one cuMemcpyDtoDAsync per run of adjacent
// pages (source and destination both adjacent) per region, and the fence
// is an event recorded after them, which the reaper waits for as it does
// for fills.
func (d *CUDA) MovePages(spans []MoveSpan, after Ordering) (Fence, error) {
	d.life.RLock()
	defer d.life.RUnlock()
	if d.closed {
		return nil, ErrClosed
	}
	check := func() error {
		d.mu.Lock()
		defer d.mu.Unlock()
		return CheckMoves(d.mu.regions, spans)
	}
	n := 0
	for _, s := range spans {
		n += len(s.Moves)
	}
	if err := check(); err != nil || n == 0 {
		if err != nil {
			return nil, err
		}
		return Completed(nil), nil
	}
	g, err := d.enter()
	if err != nil {
		return nil, err
	}
	defer g.leave()
	if after.IsZero() {
		if err := d.syncContext(); err != nil {
			return nil, err
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := CheckMoves(d.mu.regions, spans); err != nil { // regions may have grown meanwhile
		return nil, err
	}
	if !after.IsZero() {
		if err := d.orderAfterLocked(after); err != nil {
			return nil, err
		}
	}
	ev, err := d.getEvent()
	if err != nil {
		return nil, err
	}
	for _, s := range spans {
		for r := s.First; r < s.First+s.Count && err == nil; r++ {
			reg := d.mu.regions[r]
			for i := 0; i < len(s.Moves) && err == nil; {
				// A run: sources and destinations both adjacent, in a
				// region whose pages are contiguous.
				k := 1
				for reg.Stride == reg.PageBytes && i+k < len(s.Moves) &&
					s.Moves[i+k].From == s.Moves[i].From+int32(k) && s.Moves[i+k].To == s.Moves[i].To+int32(k) {
					k++
				}
				m := s.Moves[i]
				err = d.drv.memcpyDtoDAsync(reg.Base+uint64(m.To)*uint64(reg.Stride), reg.Base+uint64(m.From)*uint64(reg.Stride),
					uint64(k)*uint64(reg.PageBytes), d.stream)
				i += k
			}
		}
	}
	if err == nil {
		err = d.drv.eventRecord(ev, d.stream)
	}
	if err != nil {
		// Part of the batch may be queued: the destination pages hold
		// what they may, as after a failed fill; the event was not
		// recorded and can be reused.
		d.putEvent(ev)
		return nil, fmt.Errorf("%w: moving %d pages: %w", ErrDriver, n, err)
	}
	f := newFence(ev)
	// A move holds no staging: its fence, like a fill's that held an
	// empty slot, frees the ring up to where it stood.
	f.ringGen, f.ringEnd = d.mu.ring.gen, d.mu.ring.head
	d.mu.ring.inFlight++
	d.reap.track(f)
	return f, nil
}

var _ PageMover = (*CUDA)(nil)
