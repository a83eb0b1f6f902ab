//go:build cgo

package main

import (
	"strings"
	"testing"
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
)

// TestRankWorkerExportsRefuse calls kvf_rank_worker_create as a Go
// function with C memory for the shard: a host shard's extent is checked
// before the library views the caller's memory, so a region whose extent
// overflows is an argument error, never a view past the buffer; a refused
// call writes neither the handle nor the shard.
func TestRankWorkerExportsRefuse(t *testing.T) {
	const pages, pageBytes = 4, 64
	mem, buf, free := cBuffer(pages*pageBytes, 0xAB)
	defer free()
	base := uint64(uintptr(unsafe.Pointer(mem)))
	good := []cRegion{{base: cUint64(base), stride: pageBytes, page_bytes: pageBytes, pages: pages}}
	huge := []cRegion{{base: cUint64(base), stride: 1 << 30, page_bytes: pageBytes, pages: 1 << 40}}
	long := `{"connect": "unix:/nowhere", "rank": 0}` + strings.Repeat(" ", maxCString)
	ps, freeS := cStrings(`{"connect": "unix:/nowhere/kvf.sock", "rank": 0, "connect_timeout_ms": 30}`, long, `{"rank": 0}`)
	defer freeS()
	var w cWorker
	for _, c := range []struct {
		name    string
		cfg     *cChar
		regions []cRegion
		want    bridge.Status
		msg     string
	}{
		{"overflowing extent", ps[0], huge, bridge.StatusInvalidArgument, "overflows"},
		{"config over the limit", ps[1], good, bridge.StatusInvalidConfig, "config_json is longer than"},
		{"no connect", ps[2], good, bridge.StatusInvalidConfig, "connect missing"},
		{"no scheduler", ps[0], good, bridge.StatusNoDevice, "no scheduler at unix:/nowhere/kvf.sock"},
	} {
		wantCall(t, c.name, func() cStatus {
			return kvf_rank_worker_create(c.cfg, &c.regions[0], cSize(len(c.regions)), &w)
		}, c.want, c.msg)
	}
	if w != 0 {
		t.Errorf("a refused create wrote handle %#x", w)
	}
	for i, b := range buf {
		if b != 0xAB {
			t.Fatalf("byte %d of the shard was written", i)
		}
	}
	wantCall(t, "create without out", func() cStatus { return kvf_rank_worker_create(ps[0], &good[0], 1, nil) }, bridge.StatusNullPointer, "out")
	wantCall(t, "regions NULL", func() cStatus { return kvf_rank_worker_create(ps[0], nil, 1, &w) }, bridge.StatusNullPointer, "regions")
}
