package bridge

import (
	"fmt"

	"github.com/kvfence/kvfence/kvcache"
)

// Handoff units through C (since ABI 9): a transfer moves every cache
// group of a pool, as kvcache's handoff units (kvcache/units.go): the
// per-token group's prompt pages, each sliding window's ring pages still
// inside the window at the prompt's end, each state group's slot, group
// by group, numbered from 0 across groups. The page calls
// (ExportReadPages, ImportWritePages) move the per-token group's units,
// the transfer's first; these move any of them, whole or (a unit larger
// than the caller's message) in ranges.
//
// As for pages, a run or range the transfer does not have is the
// caller's arithmetic: it is refused, naming the numbers, before the
// export or import is touched. Only what depends on the import's state
// (a unit twice, a range out of order) reaches it, and ends it.

// Group kinds as the C ABI numbers them (KVF_GROUP_*).
const (
	GroupPerToken      int32 = 1
	GroupSlidingWindow int32 = 2
	GroupState         int32 = 3
)

// groupKind is kind's KVF_GROUP_* number (0 for a kind the ABI does not
// know).
func groupKind(kind kvcache.GroupKind) int32 {
	switch kind {
	case kvcache.GroupPerToken:
		return GroupPerToken
	case kvcache.GroupSlidingWindow:
		return GroupSlidingWindow
	case kvcache.GroupState:
		return GroupState
	}
	return 0
}

// Extent is one cache group's part of a transfer (kvf_handoff_extent).
type Extent struct {
	Group string
	Kind  int32 // GroupPerToken, GroupSlidingWindow, GroupState
	// FirstUnit is the transfer's number of the group's first unit;
	// FirstPage the logical page it holds (kvcache.HandoffExtent.First).
	FirstUnit, FirstPage int64
	Units, UnitBytes     int64
}

// Extents is a transfer's extents, one per cache group in the spec's
// order, with its totals.
type Extents struct {
	Groups []Extent
	Units  int64 // every group's
	Bytes  int64 // every unit's: what the transfer moves
}

func extentsOf(es []kvcache.HandoffExtent) Extents {
	var x Extents
	for _, e := range es {
		x.Groups = append(x.Groups, Extent{Group: e.Group, Kind: groupKind(e.Kind), FirstUnit: x.Units,
			FirstPage: int64(e.First), Units: int64(e.Units), UnitBytes: e.UnitBytes})
		x.Units += int64(e.Units)
		x.Bytes += int64(e.Units) * e.UnitBytes
	}
	return x
}

// ExportExtents describes the units of export h; it does so until the
// handle is freed, after the export ended too.
func ExportExtents(h Handle) (Extents, error) {
	exp, err := lookupExport(h)
	if err != nil {
		return Extents{}, err
	}
	return extentsOf(exp.Extents()), nil
}

// ImportExtents describes the units import h expects: the export's, the
// receiver having checked that both pools have one cache spec.
func ImportExtents(h Handle) (Extents, error) {
	ie, err := lookupImport(h)
	if err != nil {
		return Extents{}, err
	}
	return extentsOf(ie.imp.Extents()), nil
}

// unitRun checks a caller's run of whole units, n bytes from unit first,
// against extents es, and returns first as an int. The run must start at
// a unit of the transfer and end at a unit's end within it; units of
// several groups (of different sizes) may follow each other. The
// arithmetic is on int64 values that cannot overflow, whatever first and
// n are (see pageRange). A refusal names the numbers.
func unitRun(op string, first int64, n int, es Extents) (int, error) {
	refuse := func(why string) (int, error) {
		return 0, fmt.Errorf("%w: %s of %d bytes at unit %d: %s", kvcache.ErrInvalidArgument, op, n, first, why)
	}
	switch {
	case first < 0 || first >= es.Units:
		return refuse(fmt.Sprintf("outside units 0..%d of the transfer", es.Units-1))
	case n <= 0:
		return refuse("not a positive number of bytes")
	}
	rest := int64(n)
	for _, g := range es.Groups {
		end := g.FirstUnit + g.Units
		if first >= end || g.UnitBytes <= 0 {
			continue
		}
		from := max(first, g.FirstUnit)
		avail := end - from // units of this group from the run's position on
		whole := rest / g.UnitBytes
		switch {
		case whole < avail && rest%g.UnitBytes != 0:
			return refuse(fmt.Sprintf("ends inside unit %d (group %q's units are %d bytes)", from+whole, g.Group, g.UnitBytes))
		case whole <= avail && rest%g.UnitBytes == 0:
			return int(first), nil
		}
		rest -= avail * g.UnitBytes
	}
	return refuse(fmt.Sprintf("runs %d bytes past the end of the transfer's %d units (%d bytes)", rest, es.Units, es.Bytes))
}

// unitOf returns the extent of unit u, which must lie in the transfer.
func (x Extents) unitOf(u int64) Extent {
	for _, g := range x.Groups {
		if u < g.FirstUnit+g.Units {
			return g
		}
	}
	return Extent{}
}

// unitRange checks bytes [off, off+n) of unit u of a transfer of extents
// es and returns u as an int: a unit of the transfer, a non-empty range
// inside it. A write's ranges also start at multiples of
// kvcache.UnitRangeAlign and end at one or at the unit's end (the
// receiver sums a unit as its ranges land). A refusal names the numbers.
func unitRange(op string, u, off int64, n int, es Extents, write bool) (int, error) {
	refuse := func(why string) (int, error) {
		return 0, fmt.Errorf("%w: %s of %d bytes at offset %d of unit %d: %s", kvcache.ErrInvalidArgument, op, n, off, u, why)
	}
	if u < 0 || u >= es.Units {
		return refuse(fmt.Sprintf("outside units 0..%d of the transfer", es.Units-1))
	}
	g := es.unitOf(u)
	size := int64(n)
	switch {
	case size <= 0:
		return refuse("not a positive number of bytes")
	case off < 0 || off > g.UnitBytes-size:
		return refuse(fmt.Sprintf("outside the unit's %d bytes (group %q)", g.UnitBytes, g.Group))
	case write && off%kvcache.UnitRangeAlign != 0:
		return refuse(fmt.Sprintf("a range starts at a multiple of %d", kvcache.UnitRangeAlign))
	case write && off+size < g.UnitBytes && size%kvcache.UnitRangeAlign != 0:
		return refuse(fmt.Sprintf("a range but the unit's last is a multiple of %d bytes long", kvcache.UnitRangeAlign))
	}
	return int(u), nil
}

// ExportReadUnits copies exported units first, first+1, … into dst, whole
// units that end where dst does (they may be of several groups). A run
// the export does not have is refused before the export is touched:
// nothing is copied and the export is unchanged. dst may alias C memory.
func ExportReadUnits(h Handle, first int64, dst []byte) error {
	exp, err := lookupExport(h)
	if err != nil {
		return err
	}
	f, err := unitRun("read", first, len(dst), extentsOf(exp.Extents()))
	if err != nil {
		return err
	}
	return exp.ReadUnits(f, dst)
}

// ExportReadUnitRange copies bytes [off, off+len(dst)) of exported unit
// u into dst, for a unit the caller sends in ranges. A range outside the
// unit is refused before the export is touched.
func ExportReadUnitRange(h Handle, u, off int64, dst []byte) error {
	exp, err := lookupExport(h)
	if err != nil {
		return err
	}
	unit, err := unitRange("read", u, off, len(dst), extentsOf(exp.Extents()), false)
	if err != nil {
		return err
	}
	return exp.ReadUnitRange(unit, off, dst)
}

// ImportWriteUnits writes received units first, first+1, … from src,
// whole units that end where src does. A run the import does not have is
// refused before the import is touched (nothing written, the import
// live); any other error aborts the import, as ImportWritePages's do.
func ImportWriteUnits(h Handle, first int64, src []byte) error {
	ie, err := lookupImport(h)
	if err != nil {
		return err
	}
	f, err := unitRun("write", first, len(src), extentsOf(ie.imp.Extents()))
	if err != nil {
		return err
	}
	return ie.imp.WriteUnits(f, src)
}

// ImportWriteUnitRange writes bytes [off, off+len(src)) of unit u, for a
// unit received in ranges. A range outside the unit, or not aligned as
// ranges must be, is refused before the import is touched. A range out
// of order (a unit's ranges come one at a time, from offset 0, each
// where the last ended, one unit's at a time) or of a unit received
// already is the transfer's fault, not the caller's arithmetic: it aborts
// the import, as every other error does.
func ImportWriteUnitRange(h Handle, u, off int64, src []byte) error {
	ie, err := lookupImport(h)
	if err != nil {
		return err
	}
	unit, err := unitRange("write", u, off, len(src), extentsOf(ie.imp.Extents()), true)
	if err != nil {
		return err
	}
	return ie.imp.WriteUnitRange(unit, off, src)
}
