//go:build cgo

package main

// Handoff units (since ABI 9): the extents of a transfer, one per cache
// group, and reads and writes of whole units or of ranges of one unit, on
// both sides. The caller carries the bytes, as with pages.

// #include "lasterror.h"
import "C"

import (
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
)

// writeExtents copies x into the caller's extents buffer (buf, bufLen
// entries) and sets the lengths: as the other calls that fill a caller
// buffer, a short one gets nothing and KVF_ERR_BUFFER_TOO_SMALL, with the
// count in *length and the totals set.
func writeExtents(x bridge.Extents, buf *C.kvf_handoff_extent, bufLen C.size_t, length *C.size_t, units, bytes *C.int64_t) C.kvf_status {
	dst, err := cSlice(buf, bufLen, "buf")
	if err != nil {
		return fail(err)
	}
	if length != nil {
		*length = C.size_t(len(x.Groups))
	}
	if units != nil {
		*units = C.int64_t(x.Units)
	}
	if bytes != nil {
		*bytes = C.int64_t(x.Bytes)
	}
	if len(dst) < len(x.Groups) {
		return fail(&bridge.BufferError{What: "extents", Need: len(x.Groups), Have: len(dst)})
	}
	for i, g := range x.Groups {
		e := C.kvf_handoff_extent{
			first_unit: C.int64_t(g.FirstUnit),
			units:      C.int64_t(g.Units),
			unit_bytes: C.int64_t(g.UnitBytes),
			first_page: C.int64_t(g.FirstPage),
			kind:       C.int32_t(g.Kind),
		}
		name := unsafe.Slice((*byte)(unsafe.Pointer(&e.group[0])), len(e.group))
		copy(name[:len(name)-1], g.Group) // a spec's names fit; the last byte stays NUL
		dst[i] = e
	}
	return C.KVF_OK
}

//export kvf_export_extents
func kvf_export_extents(export C.kvf_export, buf *C.kvf_handoff_extent, bufLen C.size_t, length *C.size_t,
	units, bytes *C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	x, err := bridge.ExportExtents(uint64(export))
	if err != nil {
		return fail(err)
	}
	return writeExtents(x, buf, bufLen, length, units, bytes)
}

//export kvf_import_extents
func kvf_import_extents(imp C.kvf_import, buf *C.kvf_handoff_extent, bufLen C.size_t, length *C.size_t,
	units, bytes *C.int64_t) (st C.kvf_status) {
	defer guard(&st)
	x, err := bridge.ImportExtents(uint64(imp))
	if err != nil {
		return fail(err)
	}
	return writeExtents(x, buf, bufLen, length, units, bytes)
}

//export kvf_export_read_units
func kvf_export_read_units(export C.kvf_export, firstUnit C.int64_t, buf *C.uint8_t, bufLen C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cUnits(buf, bufLen, "read", "unit", firstUnit)
	if err != nil {
		return fail(err)
	}
	return result(bridge.ExportReadUnits(uint64(export), int64(firstUnit), dst))
}

//export kvf_export_read_unit_range
func kvf_export_read_unit_range(export C.kvf_export, unit, offset C.int64_t, buf *C.uint8_t, bufLen C.size_t) (st C.kvf_status) {
	defer guard(&st)
	dst, err := cUnits(buf, bufLen, "read", "unit", unit)
	if err != nil {
		return fail(err)
	}
	return result(bridge.ExportReadUnitRange(uint64(export), int64(unit), int64(offset), dst))
}

//export kvf_import_write_units
func kvf_import_write_units(imp C.kvf_import, firstUnit C.int64_t, buf *C.uint8_t, bufLen C.size_t) (st C.kvf_status) {
	defer guard(&st)
	src, err := cUnits(buf, bufLen, "write", "unit", firstUnit)
	if err != nil {
		return fail(err)
	}
	return result(bridge.ImportWriteUnits(uint64(imp), int64(firstUnit), src))
}

//export kvf_import_write_unit_range
func kvf_import_write_unit_range(imp C.kvf_import, unit, offset C.int64_t, buf *C.uint8_t, bufLen C.size_t) (st C.kvf_status) {
	defer guard(&st)
	src, err := cUnits(buf, bufLen, "write", "unit", unit)
	if err != nil {
		return fail(err)
	}
	return result(bridge.ImportWriteUnitRange(uint64(imp), int64(unit), int64(offset), src))
}
