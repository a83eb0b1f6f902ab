//go:build cgo

package main

import (
	"fmt"
	"math"
	"testing"
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
)

// hybridConfig: a host pool of a per-token group (208-byte pages), a
// sliding window of 8 tokens (128-byte pages) and a state slot of 9,096
// bytes.
const hybridConfig = `{"cache": {"groups": [
  {"name": "kv", "kind": "per_token", "tokens_per_page": 4, "regions": [
    {"name": "l1.latent", "dtype": "bf16", "page_bytes": 128}, {"name": "l1.indexer", "dtype": "fp8_e4m3", "page_bytes": 80}]},
  {"name": "swa", "kind": "sliding_window", "tokens_per_page": 4, "window_tokens": 8, "regions": [
    {"name": "l2.kv", "dtype": "bf16", "page_bytes": 128}]},
  {"name": "state", "kind": "state", "regions": [
    {"name": "l0.conv", "dtype": "bf16", "page_bytes": 96}, {"name": "l0.state", "dtype": "fp32", "page_bytes": 9000}]}]},
 "max_leases": 4, "pages": 64, "max_context_tokens": 128, "tenants": [{"name": "acme"}]}`

// newHybridHandoff exports a 22-token prompt of a hybrid pool (6 pages, 3
// window pages, a state slot: 10 units) and begins its import.
func newHybridHandoff(t *testing.T) (exp, imp uint64) {
	t.Helper()
	mustB := func(h uint64, err error) uint64 {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	src, dst := uint64(newPool(t, hybridConfig)), uint64(newPool(t, hybridConfig))
	key := []byte("kvfence capi export test key, 32+ bytes")
	l := mustB(bridge.Admit(src, "h", "acme", 22, 0, 0))
	for _, err := range []error{bridge.BeginPrefill(l), bridge.Commit(l, 22), bridge.FinishPrefill(l)} {
		if err != nil {
			t.Fatal(err)
		}
	}
	exp = mustB(bridge.Export(l, key, 0, 0))
	n, _ := bridge.ExportManifest(exp, nil)
	m := make([]byte, n)
	if _, err := bridge.ExportManifest(exp, m); err != nil {
		t.Fatal(err)
	}
	rcv := mustB(bridge.CreateReceiver(dst, key, nil))
	imp = mustB(bridge.BeginImport(rcv, m))
	t.Cleanup(func() {
		bridge.FreeImport(imp)
		bridge.DestroyReceiver(rcv)
		bridge.FreeExport(exp)
		bridge.Free(l)
	})
	return exp, imp
}

// TestExtentsThroughExports: the extents reach C field for field, the
// group's name NUL-terminated in its array; a short buffer gets nothing
// but the sizes; NULL out-parameters are optional.
func TestExtentsThroughExports(t *testing.T) {
	exp, imp := newHybridHandoff(t)
	for _, side := range []struct {
		name string
		f    func(buf *cExtent, n cSize, length *cSize, units, bytes *cInt64) cStatus
	}{
		{"kvf_export_extents", func(b *cExtent, n cSize, l *cSize, u, by *cInt64) cStatus {
			return kvf_export_extents(cExport(exp), b, n, l, u, by)
		}},
		{"kvf_import_extents", func(b *cExtent, n cSize, l *cSize, u, by *cInt64) cStatus {
			return kvf_import_extents(cImport(imp), b, n, l, u, by)
		}},
	} {
		var n cSize
		var units, bytes cInt64
		wantCall(t, side.name+"(NULL, 0)", func() cStatus { return side.f(nil, 0, &n, &units, &bytes) },
			bridge.StatusBufferTooSmall)
		if n != 3 || units != 10 || bytes != 6*208+3*128+9096 {
			t.Errorf("%s: sizes %d extents, %d units, %d bytes", side.name, n, units, bytes)
		}
		ext := make([]cExtent, 4)
		for i := range ext {
			ext[i].units = -7
		}
		wantCall(t, side.name+" short", func() cStatus { return side.f(&ext[0], 2, &n, nil, nil) }, bridge.StatusBufferTooSmall)
		if ext[0].units != -7 || n != 3 {
			t.Errorf("%s: a short buffer was written, or the count is %d", side.name, n)
		}
		wantCall(t, side.name+" NULL with a length", func() cStatus { return side.f(nil, 3, &n, nil, nil) }, bridge.StatusNullPointer)
		wantCall(t, side.name, func() cStatus { return side.f(&ext[0], cSize(len(ext)), nil, nil, nil) }, bridge.OK)
		want := []struct {
			group                                  string
			kind                                   int32
			firstUnit, units, unitBytes, firstPage int64
		}{
			{"kv", bridge.GroupPerToken, 0, 6, 208, 0},
			{"swa", bridge.GroupSlidingWindow, 6, 3, 128, 3},
			{"state", bridge.GroupState, 9, 1, 9096, 0},
		}
		for i, w := range want {
			e := ext[i]
			name := cArrayString(&e.group[0])
			if name != w.group || int32(e.kind) != w.kind || int64(e.first_unit) != w.firstUnit || int64(e.units) != w.units ||
				int64(e.unit_bytes) != w.unitBytes || int64(e.first_page) != w.firstPage {
				t.Errorf("%s: extent %d is %q kind %d units %d+%d of %d bytes from page %d, want %+v", side.name, i,
					name, e.kind, e.first_unit, e.units, e.unit_bytes, e.first_page, w)
			}
		}
		if ext[3].units != -7 {
			t.Errorf("%s: wrote past the extents", side.name)
		}
	}
	wantCall(t, "kvf_export_extents of an import", func() cStatus { return kvf_export_extents(cExport(imp), nil, 0, nil, nil, nil) },
		bridge.StatusInvalidHandle)
	wantCall(t, "kvf_import_extents of 0", func() cStatus { return kvf_import_extents(0, nil, 0, nil, nil, nil) },
		bridge.StatusInvalidHandle)
}

// cArrayString reads a NUL-terminated name out of a C char array.
func cArrayString(p *cChar) string {
	b := unsafe.Slice((*byte)(unsafe.Pointer(p)), 129)
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// TestUnitRangesThroughExports: first units, offsets and lengths that
// overflow any sum, from C's int64_t and size_t, are refused as a range
// (KVF_ERR_INVALID_ARGUMENT naming the numbers), not a recovered panic,
// and leave the export and the import as they were; NULL buffers are the
// boundary's error.
func TestUnitRangesThroughExports(t *testing.T) {
	exp, imp := newHybridHandoff(t)
	const total = 6*208 + 3*128 + 9096
	p, buf, free := cBuffer(total, 0x5A)
	defer free()
	const sizeMax = ^cSize(0)
	for _, c := range []struct {
		first cInt64
		n     cSize
	}{
		{math.MaxInt64, 208},
		{math.MaxInt64 - 1, 416},
		{math.MinInt64, 208},
		{-1, 208},
		{10, 128},
		{0, sizeMax},
		{1, sizeMax - sizeMax%208},
		{0, maxBufferBytes},
		{0, maxBufferBytes + 208},
		{0, 0},
		{5, 208 + 127},
	} {
		for _, op := range []struct {
			name string
			f    func() cStatus
		}{
			{"kvf_export_read_units", func() cStatus { return kvf_export_read_units(cExport(exp), c.first, p, c.n) }},
			{"kvf_import_write_units", func() cStatus { return kvf_import_write_units(cImport(imp), c.first, p, c.n) }},
		} {
			wantCall(t, fmt.Sprintf("%s(first %d, %d bytes)", op.name, c.first, c.n), op.f, bridge.StatusInvalidArgument,
				fmt.Sprint(int64(c.first)), fmt.Sprint(uint64(c.n)))
		}
	}
	for _, c := range []struct {
		unit, off cInt64
		n         cSize
	}{
		{math.MaxInt64, 0, 1},
		{math.MinInt64, 0, 1},
		{9, math.MaxInt64, 1},
		{9, math.MinInt64, 1},
		{9, math.MaxInt64 - 4095, 4096},
		{9, 4096, sizeMax},
		{9, 0, maxBufferBytes},
		{9, 8192, 905},
	} {
		for _, op := range []struct {
			name string
			f    func() cStatus
		}{
			{"kvf_export_read_unit_range", func() cStatus { return kvf_export_read_unit_range(cExport(exp), c.unit, c.off, p, c.n) }},
			{"kvf_import_write_unit_range", func() cStatus { return kvf_import_write_unit_range(cImport(imp), c.unit, c.off, p, c.n) }},
		} {
			wantCall(t, fmt.Sprintf("%s(unit %d at %d, %d bytes)", op.name, c.unit, c.off, c.n), op.f, bridge.StatusInvalidArgument,
				fmt.Sprint(int64(c.unit)), fmt.Sprint(uint64(c.n)))
		}
	}
	for i, b := range buf {
		if b != 0x5A {
			t.Fatalf("byte %d of the buffer was written", i)
		}
	}
	for _, op := range []struct {
		name string
		f    func() cStatus
	}{
		{"kvf_export_read_units", func() cStatus { return kvf_export_read_units(cExport(exp), 0, nil, 208) }},
		{"kvf_import_write_units", func() cStatus { return kvf_import_write_units(cImport(imp), 0, nil, 208) }},
		{"kvf_export_read_unit_range", func() cStatus { return kvf_export_read_unit_range(cExport(exp), 9, 0, nil, 1) }},
		{"kvf_import_write_unit_range", func() cStatus { return kvf_import_write_unit_range(cImport(imp), 9, 0, nil, 1) }},
	} {
		wantCall(t, op.name+" NULL", op.f, bridge.StatusNullPointer)
	}
	var ti cTransfer
	for _, f := range []func() cStatus{
		func() cStatus { return kvf_export_describe(cExport(exp), &ti) },
		func() cStatus { return kvf_import_describe(cImport(imp), &ti) },
	} {
		if wantCall(t, "describe", f, bridge.OK); ti.live != 1 {
			t.Fatal("a refused range ended the export or the import")
		}
	}
	wantCall(t, "read", func() cStatus { return kvf_export_read_units(cExport(exp), 0, p, total) }, bridge.OK)
	wantCall(t, "write", func() cStatus { return kvf_import_write_units(cImport(imp), 0, p, total-9096) }, bridge.OK)
	slot := (*cUint8)(unsafe.Add(unsafe.Pointer(p), total-9096))
	for off := 0; off < 9096; off += 4096 {
		n := min(4096, 9096-off)
		wantCall(t, "write range", func() cStatus {
			return kvf_import_write_unit_range(cImport(imp), 9, cInt64(off), (*cUint8)(unsafe.Add(unsafe.Pointer(slot), off)), cSize(n))
		}, bridge.OK)
	}
	var lease cLease
	wantCall(t, "complete", func() cStatus { return kvf_import_complete(cImport(imp), &lease) }, bridge.OK)
	kvf_lease_free(lease)
}
