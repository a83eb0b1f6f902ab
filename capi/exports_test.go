//go:build cgo

package main

import (
	"runtime"
	"strings"
	"testing"
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
	tok := (*int32)(&tokens[0])

	var newPool cPool
	wantCall(t, "config at the limit", func() cStatus { return kvf_pool_create(atLimit, &newPool) }, bridge.OK)
	if newPool == 0 {
		t.Error("no pool")
	}
	kvf_pool_destroy(newPool)
	newPool = 0
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
		return kvf_admit_tokens(pool, longS, acme, (*cInt32)(unsafe.Pointer(tok)), 3, 0, nil, 0, &lease)
	}, bridge.StatusInvalidRequest, "request_id")
	wantCall(t, "admit_tokens tenant", func() cStatus {
		return kvf_admit_tokens(pool, req, longS, (*cInt32)(unsafe.Pointer(tok)), 3, 0, nil, 0, &lease)
	}, bridge.StatusInvalidRequest, "tenant")
	wantCall(t, "admit_tokens adapter", func() cStatus {
		return kvf_admit_tokens(pool, req, acme, (*cInt32)(unsafe.Pointer(tok)), 3, 0, longS, 0, &lease)
	}, bridge.StatusInvalidRequest, "adapter")
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
