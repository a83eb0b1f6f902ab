//go:build cgo

package main

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvfence/kvfence/capi/internal/bridge"
)

// These tests call the exports as Go functions, with C memory from
// testhook.go, so that the translation of C arguments is tested without a
// C compiler; testdata/capi_test.c repeats the cases that matter from C.

// call runs an export and returns its status and, if it failed, the last
// error's status and message, read on the same thread.
func call(t *testing.T, f func() cStatus) (bridge.Status, string) {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	st := bridge.Status(f())
	if st == bridge.OK {
		return st, ""
	}
	last, msg := lastError()
	if last != st {
		t.Errorf("returned %v, last error %v (%s)", st, last, msg)
	}
	return st, msg
}

func wantCall(t *testing.T, what string, f func() cStatus, want bridge.Status, msgHas ...string) string {
	t.Helper()
	st, msg := call(t, f)
	if st != want {
		t.Errorf("%s: %v (%s), want %v", what, st, msg, want)
	}
	for _, s := range msgHas {
		if !strings.Contains(msg, s) {
			t.Errorf("%s: message %q lacks %q", what, msg, s)
		}
	}
	return msg
}

// testConfig: 64 pages of 16 tokens (2,048 bytes each), tenant acme.
const testConfig = `{"geometry": {"tokens_per_page": 16, "layers": 2, "kv_heads": 2, "head_dim": 8, "dtype": "fp16"},
 "pages": 64, "max_context_tokens": 1024, "tenants": [{"name": "acme"}]}`

func newPool(t *testing.T, config string) cPool {
	t.Helper()
	ps, free := cStrings(config)
	defer free()
	var pool cPool
	wantCall(t, "kvf_pool_create", func() cStatus { return kvf_pool_create(ps[0], &pool) }, bridge.OK)
	t.Cleanup(func() { kvf_pool_destroy(pool) })
	return pool
}

func checkPool(t *testing.T, pool cPool) {
	t.Helper()
	wantCall(t, "kvf_pool_check", func() cStatus { return kvf_pool_check(pool) }, bridge.OK)
}

// padded is js followed by spaces up to n bytes.
func padded(js string, n int) string { return js + strings.Repeat(" ", n-len(js)) }

// TestLongStrings: a string argument longer than the library scans gets
// the status the header promises for a bad value of that argument, not a
// boundary error, and changes nothing; a string as long as the JSON limit
// is parsed, as the bridge would.
func TestLongStrings(t *testing.T) {
	pool := newPool(t, testConfig)
	long := strings.Repeat("x", 2<<20)
	bigJSON := padded(`{"name": "big"}`, 2<<20)
	ps, free := cStrings(long, bigJSON, padded(testConfig, maxCString), padded(testConfig, maxCString+1), "acme", "r", "{}")
	defer free()
	longS, bigJS, atLimit, overLimit, acme, req, empty := ps[0], ps[1], ps[2], ps[3], ps[4], ps[5], ps[6]
	tokens := []int32{1, 2, 3}
	tok := (*cInt32)(unsafe.Pointer(&tokens[0]))

	var newPool cPool
	wantCall(t, "config at the limit", func() cStatus { return kvf_pool_create(atLimit, &newPool) }, bridge.OK)
	if newPool == 0 {
		t.Error("no pool")
	} else {
		kvf_pool_destroy(newPool)
		newPool = 0
	}
	wantCall(t, "config over the limit", func() cStatus { return kvf_pool_create(overLimit, &newPool) },
		bridge.StatusInvalidConfig, "config_json", "1048576")
	wantCall(t, "2 MiB config", func() cStatus { return kvf_pool_create(bigJS, &newPool) },
		bridge.StatusInvalidConfig, "config_json", "longer than 1048576 bytes")
	if newPool != 0 {
		t.Errorf("refused pool_create wrote handle %#x", newPool)
	}

	wantCall(t, "add_tenant", func() cStatus { return kvf_pool_add_tenant(pool, longS, 0, 0) }, bridge.StatusInvalidTenant, "name")
	wantCall(t, "update_tenant", func() cStatus { return kvf_pool_update_tenant(pool, longS, 0, 0) }, bridge.StatusUnknownTenant, "name")
	wantCall(t, "add_tenant_json", func() cStatus { return kvf_pool_add_tenant_json(pool, bigJS) }, bridge.StatusInvalidTenant, "tenant_json")
	wantCall(t, "update_tenant_json", func() cStatus { return kvf_pool_update_tenant_json(pool, bigJS) }, bridge.StatusInvalidTenant, "tenant_json")

	var lease cLease
	wantCall(t, "admit request_id", func() cStatus { return kvf_admit(pool, longS, acme, 16, 0, 0, &lease) }, bridge.StatusInvalidRequest, "request_id")
	wantCall(t, "admit tenant", func() cStatus { return kvf_admit(pool, req, longS, 16, 0, 0, &lease) }, bridge.StatusInvalidRequest, "tenant")
	wantCall(t, "admit_tokens request_id", func() cStatus {
		return kvf_admit_tokens(pool, longS, acme, tok, 3, 0, nil, 0, &lease)
	}, bridge.StatusInvalidRequest, "request_id")
	wantCall(t, "admit_tokens tenant", func() cStatus {
		return kvf_admit_tokens(pool, req, longS, tok, 3, 0, nil, 0, &lease)
	}, bridge.StatusInvalidRequest, "tenant")
	wantCall(t, "admit_tokens adapter", func() cStatus {
		return kvf_admit_tokens(pool, req, acme, tok, 3, 0, longS, 0, &lease)
	}, bridge.StatusInvalidRequest, "adapter")
	table := make([]int32, 4)
	tbl := (*cInt32)(unsafe.Pointer(&table[0]))
	var tableLen cSize
	for _, c := range []struct {
		what            string
		id, tenant, ada *cChar
	}{{"request_id", longS, acme, nil}, {"tenant", req, longS, nil}, {"adapter", req, acme, longS}} {
		wantCall(t, "admit_tokens_table "+c.what, func() cStatus {
			return kvf_admit_tokens_table(pool, c.id, c.tenant, tok, 3, 0, c.ada, 0, tbl, 4, &tableLen, &lease)
		}, bridge.StatusInvalidRequest, c.what)
	}
	if !slices.Equal(table, []int32{0, 0, 0, 0}) || tableLen != 0 {
		t.Errorf("refused admit_tokens_table wrote table %v, length %d", table, tableLen)
	}
	if lease != 0 {
		t.Errorf("refused admission wrote handle %#x", lease)
	}

	key := []byte("kvfence capi export test key, 32+ bytes")
	var rcv cReceiver
	wantCall(t, "receiver config", func() cStatus {
		return kvf_receiver_create(pool, (*cUint8)(&key[0]), cSize(len(key)), bigJS, &rcv)
	}, bridge.StatusInvalidConfig, "config_json")
	if rcv != 0 {
		t.Errorf("refused receiver_create wrote handle %#x", rcv)
	}
	wantCall(t, "receiver config {}", func() cStatus {
		return kvf_receiver_create(pool, (*cUint8)(&key[0]), cSize(len(key)), empty, &rcv)
	}, bridge.OK)
	kvf_receiver_destroy(rcv)

	// Nothing changed: acme is still the only tenant, nothing is leased.
	js, err := bridge.StatsJSON(uint64(pool))
	if err != nil {
		t.Fatal(err)
	}
	if s := string(js); !strings.Contains(s, `"live_leases":0`) || strings.Contains(s, `"name":"big"`) || strings.Count(s, `"used_pages"`) != 1 {
		t.Errorf("stats after refused calls: %s", s)
	}
	checkPool(t, pool)
}

// newHandoff sets up, through the bridge, an export of a 40-token prompt
// (3 pages) and its import into a second pool, begun but not written.
func newHandoff(t *testing.T) (exp, imp uint64, pageBytes, pages int64) {
	t.Helper()
	mustB := func(h uint64, err error) uint64 {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	src := uint64(newPool(t, testConfig))
	dst := uint64(newPool(t, testConfig))
	key := []byte("kvfence capi export test key, 32+ bytes")
	l := mustB(bridge.Admit(src, "h", "acme", 40, 0, 0))
	for _, err := range []error{bridge.BeginPrefill(l), bridge.Commit(l, 40), bridge.FinishPrefill(l)} {
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
	info, err := bridge.DescribeImport(imp)
	if err != nil {
		t.Fatal(err)
	}
	return exp, imp, info.PageBytes, info.Pages
}

// TestPageRangesThroughExports: first pages and lengths that overflow any
// sum, from C's int64_t and size_t, are refused as a range
// (KVF_ERR_INVALID_ARGUMENT naming the numbers), not a recovered panic,
// and leave the export and the import as they were.
func TestPageRangesThroughExports(t *testing.T) {
	exp, imp, pb, pages := newHandoff(t)
	p, buf, free := cBuffer(int(pages*pb), 0x5A)
	defer free()
	const sizeMax = ^cSize(0)
	for _, c := range []struct {
		first cInt64
		n     cSize
	}{
		{math.MaxInt64, cSize(pb)},
		{math.MaxInt64 - 1, cSize(2 * pb)},
		{math.MinInt64, cSize(pb)},
		{-1, cSize(pb)},
		{cInt64(pages), cSize(pb)},
		{0, sizeMax},
		{1, sizeMax - sizeMax%cSize(pb)},
		{0, maxBufferBytes}, // a whole number of pages, far too many
		{0, maxBufferBytes + cSize(pb)},
	} {
		for _, op := range []struct {
			name string
			f    func() cStatus
		}{
			{"kvf_export_read_pages", func() cStatus { return kvf_export_read_pages(cExport(exp), c.first, p, c.n) }},
			{"kvf_import_write_pages", func() cStatus { return kvf_import_write_pages(cImport(imp), c.first, p, c.n) }},
		} {
			wantCall(t, fmt.Sprintf("%s(first %d, %d bytes)", op.name, c.first, c.n), op.f, bridge.StatusInvalidArgument,
				fmt.Sprint(int64(c.first)), fmt.Sprint(uint64(c.n)))
		}
		for i, b := range buf {
			if b != 0x5A {
				t.Fatalf("byte %d of the buffer was written", i)
			}
		}
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
	wantCall(t, "read", func() cStatus { return kvf_export_read_pages(cExport(exp), 0, p, cSize(pages*pb)) }, bridge.OK)
	wantCall(t, "write", func() cStatus { return kvf_import_write_pages(cImport(imp), 0, p, cSize(pages*pb)) }, bridge.OK)
	var lease cLease
	wantCall(t, "complete", func() cStatus { return kvf_import_complete(cImport(imp), &lease) }, bridge.OK)
	kvf_lease_free(lease)
}

// TestSlotMappingRanges: a token range whose length no int64 holds is
// refused as a range, and the length reported is not the wrapped
// difference.
func TestSlotMappingRanges(t *testing.T) {
	pool := newPool(t, testConfig)
	ps, free := cStrings("slots", "acme")
	defer free()
	var lease cLease
	wantCall(t, "admit", func() cStatus { return kvf_admit(pool, ps[0], ps[1], 100, 0, 0, &lease) }, bridge.OK)
	defer kvf_lease_free(lease)
	slots := make([]cInt64, 4)
	for _, c := range []struct{ start, end cInt64 }{
		{math.MinInt64, math.MaxInt64},
		{-1, math.MaxInt64},
		{math.MinInt64, 0},
		{math.MaxInt64, math.MinInt64},
		{0, math.MaxInt64},
	} {
		n := cSize(12345)
		wantCall(t, fmt.Sprintf("slot_mapping(%d, %d)", c.start, c.end), func() cStatus {
			return kvf_lease_slot_mapping(lease, c.start, c.end, &slots[0], cSize(len(slots)), &n)
		}, bridge.StatusInvalidArgument, fmt.Sprint(int64(c.start)))
		if n > 1<<40 {
			t.Errorf("slot_mapping(%d, %d) reported length %d", c.start, c.end, n)
		}
	}
}

// TestAdmitNoWait: wait_ms = 0 refuses a busy pool at once, from
// kvf_admit and kvf_admit_tokens; wait_ms > 0 waits that long first.
func TestAdmitNoWait(t *testing.T) {
	pool := newPool(t, `{"geometry": {"tokens_per_page": 16, "layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": "fp16"},
	 "pages": 8, "max_context_tokens": 128, "tenants": [{"name": "a", "quota_pages": 4}, {"name": "b"}]}`)
	ps, free := cStrings("hold-a", "hold-b", "r", "a", "b")
	defer free()
	var hold [2]cLease
	wantCall(t, "hold a", func() cStatus { return kvf_admit(pool, ps[0], ps[3], 64, 0, 0, &hold[0]) }, bridge.OK)
	wantCall(t, "hold b", func() cStatus { return kvf_admit(pool, ps[1], ps[4], 64, 0, 0, &hold[1]) }, bridge.OK)
	defer kvf_lease_free(hold[0])
	defer kvf_lease_free(hold[1])
	toks := []int32{1, 2, 3}
	table := make([]int32, 1)
	var l cLease
	for _, c := range []struct {
		name string
		wait cInt64
		f    func(wait cInt64) cStatus
	}{
		{"kvf_admit", 0, func(w cInt64) cStatus { return kvf_admit(pool, ps[2], ps[4], 16, 0, w, &l) }},
		{"kvf_admit_tokens", 0, func(w cInt64) cStatus {
			return kvf_admit_tokens(pool, ps[2], ps[4], (*cInt32)(unsafe.Pointer(&toks[0])), 3, 0, nil, w, &l)
		}},
		{"kvf_admit_tokens_table", 0, func(w cInt64) cStatus {
			return kvf_admit_tokens_table(pool, ps[2], ps[4], (*cInt32)(unsafe.Pointer(&toks[0])), 3, 0, nil, w,
				(*cInt32)(unsafe.Pointer(&table[0])), cSize(len(table)), nil, &l)
		}},
		{"kvf_admit", 30, func(w cInt64) cStatus { return kvf_admit(pool, ps[2], ps[4], 16, 0, w, &l) }},
		{"kvf_admit_tokens_table", 30, func(w cInt64) cStatus {
			return kvf_admit_tokens_table(pool, ps[2], ps[4], (*cInt32)(unsafe.Pointer(&toks[0])), 3, 0, nil, w,
				(*cInt32)(unsafe.Pointer(&table[0])), cSize(len(table)), nil, &l)
		}},
	} {
		start := time.Now()
		wantCall(t, c.name, func() cStatus { return c.f(c.wait) }, bridge.StatusPoolExhausted)
		d, wait := time.Since(start), time.Duration(c.wait)*time.Millisecond
		if c.wait == 0 && d > 2*time.Second || d < wait {
			t.Errorf("%s with wait_ms = %d answered after %v", c.name, c.wait, d)
		}
	}
	if l != 0 {
		t.Errorf("refused admission wrote handle %#x", l)
	}
	checkPool(t, pool)
}

// TestHugeBufferLengths: a buffer length far beyond what is written
// (SIZE_MAX, or any length the buffer does not have) is not a size to
// allocate: every call that writes into a caller buffer writes what it
// has, and kvf_pool_regions used to make a Go copy of buf_len regions
// first, a terabyte, which killed the process (a fatal out of memory, no
// panic to recover). The buffers are C memory, as a C caller's are.
func TestHugeBufferLengths(t *testing.T) {
	pool := newPool(t, testConfig)
	const huge = cSize(1) << 62
	want := make([]cRegion, 4) // 2 layers' K and V
	var n cSize
	wantCall(t, "kvf_pool_regions", func() cStatus { return kvf_pool_regions(pool, &want[0], cSize(len(want)), &n) }, bridge.OK)
	p, _, free := cBuffer(1<<16, 0xFF)
	defer free()
	got := unsafe.Slice((*cRegion)(unsafe.Pointer(p)), 8)
	n = 0
	wantCall(t, "kvf_pool_regions with a huge length", func() cStatus { return kvf_pool_regions(pool, &got[0], huge, &n) }, bridge.OK)
	if n != 4 || !slices.Equal(got[:4], want) || got[4].pages != -1 {
		t.Fatalf("regions into a buffer said to hold %d: %d, %v", huge, n, got)
	}
	wantCall(t, "kvf_pool_regions of handle 0", func() cStatus { return kvf_pool_regions(0, &got[0], huge, &n) },
		bridge.StatusInvalidHandle)

	ps, freeStrings := cStrings("r", "acme")
	defer freeStrings()
	var lease cLease
	wantCall(t, "admit", func() cStatus { return kvf_admit(pool, ps[0], ps[1], 100, 0, 0, &lease) }, bridge.OK)
	defer kvf_lease_free(lease)
	wantCall(t, "kvf_lease_block_table", func() cStatus { return kvf_lease_block_table(lease, (*cInt32)(unsafe.Pointer(p)), huge, &n) }, bridge.OK)
	if n != 7 {
		t.Errorf("block table of 7 pages: %d", n)
	}
	text := (*cChar)(unsafe.Pointer(p))
	wantCall(t, "kvf_pool_stats_json", func() cStatus { return kvf_pool_stats_json(pool, text, huge, &n) }, bridge.OK)
	wantCall(t, "kvf_pool_events_json", func() cStatus { return kvf_pool_events_json(pool, text, huge, &n) }, bridge.OK)
	checkPool(t, pool)
}
