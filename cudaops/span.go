package cudaops

import "fmt"

// Span is one part of a FillSpans batch: Pages filled in the regions
// [First, First+Count) and in no other. A pool whose caches are several
// groups, each with its own regions and its own page IDs (attention KV
// pages, sliding-window pages, recurrent-state slots), scrubs what a
// release frees in all of them with one device operation this way.
//
// The caller may number the pages of several groups in one space: span
// page p is page p − IDBase of each of its regions, and gets the word
// FillSpec.WordFor(p − IDBase) (the region's own page number).
type Span struct {
	First, Count int
	IDBase       int32
	Pages        []int32
}

// SpanFiller is implemented by devices that fill several spans in one
// operation (one pass on the host; on CUDA, one operation ordered after
// the engine's work, completing with one fence). Fill(pages) is
// FillSpans of one span over every region with IDBase 0.
type SpanFiller interface {
	FillSpans(spans []Span, spec FillSpec, after Ordering) (Fence, error)
}

// CheckSpans validates a FillSpans batch against a region table: every
// span names at least one region, within the table; no two spans share a
// region; every page is valid in every region of its span. Backends call
// it before touching memory.
func CheckSpans(regions []Region, spans []Span) error {
	for si, s := range spans {
		if s.Count < 1 || s.First < 0 || s.First > len(regions)-s.Count {
			return fmt.Errorf("%w: span %d names regions [%d, %d+%d) of %d", ErrInvalidArgument, si, s.First, s.First, s.Count, len(regions))
		}
		if s.IDBase < 0 {
			return fmt.Errorf("%w: span %d has ID base %d", ErrInvalidArgument, si, s.IDBase)
		}
		for oi, o := range spans[:si] { // spans are few: one per cache group
			if s.First < o.First+o.Count && o.First < s.First+s.Count {
				return fmt.Errorf("%w: spans %d and %d share region %d", ErrInvalidArgument, oi, si, max(s.First, o.First))
			}
		}
		limit := regions[s.First].Pages
		for _, r := range regions[s.First : s.First+s.Count] {
			limit = min(limit, r.Pages)
		}
		for _, p := range s.Pages {
			if local := int64(p) - int64(s.IDBase); local < 0 || local >= int64(limit) {
				return fmt.Errorf("%w: span %d page %d (page %d of its regions) outside [0, %d)", ErrInvalidArgument, si, p, local, limit)
			}
		}
		if len(s.Pages) > limit {
			return fmt.Errorf("%w: span %d of %d pages, its regions hold %d: a page is named twice", ErrInvalidArgument, si, len(s.Pages), limit)
		}
	}
	return nil
}

// Overlap reports whether some byte belongs to a page of a and to a page
// of b. Regions of the same stride are compared exactly, so the K and V
// halves of vLLM's [num_blocks, 2, …] layout, which interleave, do not
// overlap; regions of different strides are taken to overlap as soon as
// their extents do.
func Overlap(a, b Region) bool {
	aEnd, bEnd := a.Base+uint64(a.Bytes()), b.Base+uint64(b.Bytes())
	if aEnd <= b.Base || bEnd <= a.Base {
		return false
	}
	if a.Stride != b.Stride {
		return true
	}
	// Extents overlap, so |b.Base − a.Base| < 2^62 (Region.Validate): the
	// arithmetic below cannot overflow. Page i of a and page j of b meet
	// iff, with k = j − i and d = b.Base − a.Base,
	// −d − b.PageBytes < k·s < a.PageBytes − d.
	s := a.Stride
	d := int64(b.Base - a.Base) // two's complement: negative when b is below a
	lo := floorDiv(-d-b.PageBytes, s) + 1
	hi := ceilDiv(a.PageBytes-d, s) - 1
	lo = max(lo, -int64(a.Pages-1))
	hi = min(hi, int64(b.Pages-1))
	return lo <= hi
}

func floorDiv(x, y int64) int64 {
	q := x / y
	if (x%y != 0) && ((x < 0) != (y < 0)) {
		q--
	}
	return q
}

func ceilDiv(x, y int64) int64 { return -floorDiv(-x, y) }

// checkAdopted refuses an adopted region that overlaps a region of the
// table: two regions sharing bytes would let one page's fill or write land
// in another page.
func checkAdopted(regions []Region, r Region) error {
	for i, o := range regions {
		if Overlap(o, r) {
			return fmt.Errorf("%w: adopted region [%#x, %#x) (stride %d, %d-byte pages) overlaps region %d [%#x, %#x) (stride %d, %d-byte pages)",
				ErrInvalidArgument, r.Base, r.Base+uint64(r.Bytes()), r.Stride, r.PageBytes,
				i, o.Base, o.Base+uint64(o.Bytes()), o.Stride, o.PageBytes)
		}
	}
	return nil
}
