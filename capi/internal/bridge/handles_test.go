package bridge

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// 64 pages of 16 tokens; tenants a (quota 32) and b.
const testPool = `{"geometry": {"tokens_per_page": 16, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp32"},
 "pages": 64, "max_context_tokens": 1024, "tenants": [{"name": "a", "quota_pages": 32}, {"name": "b"}]}`

func newTestPool(t *testing.T) Handle {
	t.Helper()
	h, err := CreatePool([]byte(testPool))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { DestroyPool(h) })
	return h
}

func wantStatus(t *testing.T, err error, want Status) {
	t.Helper()
	if got := Classify(err).Status; got != want {
		t.Fatalf("status %v (%v), want %v", got, err, want)
	}
}

func mustCheck(t *testing.T, h Handle) {
	t.Helper()
	if err := Check(h); err != nil {
		t.Fatal(err)
	}
}

func TestLeaseLifecycle(t *testing.T) {
	p := newTestPool(t)
	l, err := Admit(p, "r1", "a", 100, 28, 0)
	if err != nil {
		t.Fatal(err)
	}
	mustCheck(t, p)

	n, err := BlockTable(l, nil)
	wantStatus(t, err, StatusBufferTooSmall)
	if n != 8 || Classify(err).Need != 8 {
		t.Fatalf("size query: n = %d, info %+v", n, Classify(err))
	}
	short := []int32{-1, -1, -1}
	_, err = BlockTable(l, short)
	wantStatus(t, err, StatusBufferTooSmall)
	if !slices.Equal(short, []int32{-1, -1, -1}) {
		t.Fatalf("short buffer written: %v", short)
	}
	table := make([]int32, 10)
	if n, err = BlockTable(l, table); err != nil || n != 8 {
		t.Fatalf("BlockTable = %d, %v", n, err)
	}
	slots := make([]int64, 17)
	if n, err = SlotMapping(l, 0, 17, slots); err != nil || n != 17 {
		t.Fatalf("SlotMapping = %d, %v", n, err)
	}
	if slots[16] != int64(table[1])*16 {
		t.Errorf("slot of token 16 = %d, want page %d × 16", slots[16], table[1])
	}
	_, err = SlotMapping(l, 0, 17, slots[:5])
	wantStatus(t, err, StatusBufferTooSmall)
	_, err = SlotMapping(l, 0, 129, slots)
	wantStatus(t, err, StatusInvalidArgument)

	wantStatus(t, Commit(l, 50), OK)
	wantStatus(t, Commit(l, 40), StatusInvalidArgument)
	li, err := DescribeLease(l)
	if err != nil || li != (LeaseInfo{Pages: 8, CapacityTokens: 128, PromptTokens: 100, MaxNewTokens: 28, Written: 50, Live: true}) {
		t.Fatalf("DescribeLease = %+v, %v", li, err)
	}

	wantStatus(t, Release(l, cudaops.Ordering{Stream: 1, Event: 2}), OK)
	wantStatus(t, Release(l, cudaops.Ordering{}), StatusLeaseReleased)
	_, err = BlockTable(l, table)
	wantStatus(t, err, StatusLeaseReleased)
	if li, _ := DescribeLease(l); li.Live {
		t.Error("released lease reports live")
	}
	wantStatus(t, Free(l), OK)
	wantStatus(t, Free(l), StatusInvalidHandle)
	wantStatus(t, Release(l, cudaops.Ordering{}), StatusInvalidHandle)
	_, err = DescribeLease(l)
	wantStatus(t, err, StatusInvalidHandle)
	mustCheck(t, p)
}

func TestHandlesDoNotCross(t *testing.T) {
	p := newTestPool(t)
	l, err := Admit(p, "r", "a", 1, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = BlockTable(p, make([]int32, 4)) // a pool is not a lease
	wantStatus(t, err, StatusInvalidHandle)
	_, err = Admit(l, "r2", "a", 1, 0, 0) // a lease is not a pool
	wantStatus(t, err, StatusInvalidHandle)
	for _, h := range []Handle{0, 1 << 62, p + 1000} {
		_, err = Admit(h, "r2", "a", 1, 0, 0)
		wantStatus(t, err, StatusInvalidHandle)
		wantStatus(t, Free(h), StatusInvalidHandle)
	}
}

func TestAdmissionRefusals(t *testing.T) {
	p := newTestPool(t)
	if _, err := Admit(p, "hold", "a", 500, 0, 0); err != nil { // 32 pages: all of a's quota
		t.Fatal(err)
	}
	tests := []struct {
		name          string
		id, tenant    string
		prompt, extra int64
		wait          time.Duration
		want          Status
	}{
		{"empty id", "", "a", 1, 0, 0, StatusInvalidRequest},
		{"zero prompt", "x", "a", 0, 0, 0, StatusInvalidRequest},
		{"overflow", "x", "a", 1 << 62, 1 << 62, 0, StatusInvalidRequest},
		{"unknown tenant", "x", "z", 1, 0, 0, StatusUnknownTenant},
		{"duplicate", "hold", "a", 1, 0, 0, StatusDuplicateRequest},
		{"max context", "x", "a", 1000, 25, 0, StatusExceedsMaxContext},
		{"quota", "x", "a", 600, 0, 0, StatusExceedsQuota},
		{"exhausted", "x", "b", 1024, 0, 0, StatusPoolExhausted},
		{"exhausted after waiting", "x", "b", 1024, 0, 10 * time.Millisecond, StatusPoolExhausted},
		{"negative wait", "x", "a", 1, 0, -time.Millisecond, StatusInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h, err := Admit(p, tt.id, tt.tenant, tt.prompt, tt.extra, tt.wait)
			if h != 0 {
				t.Errorf("refused admission returned handle %#x", h)
			}
			wantStatus(t, err, tt.want)
			mustCheck(t, p)
		})
	}
}

func TestTenantAdmin(t *testing.T) {
	p := newTestPool(t)
	wantStatus(t, AddTenant(p, kvcache.TenantConfig{Name: "c", QuotaPages: 8, ReservedPages: 4}), OK)
	wantStatus(t, AddTenant(p, kvcache.TenantConfig{Name: "c"}), StatusDuplicateTenant)
	wantStatus(t, AddTenant(p, kvcache.TenantConfig{Name: ""}), StatusInvalidTenant)
	wantStatus(t, AddTenant(p, kvcache.TenantConfig{Name: "d", ReservedPages: 61}), StatusOverReserved)
	wantStatus(t, UpdateTenant(p, kvcache.TenantConfig{Name: "c", QuotaPages: 16}), OK)
	wantStatus(t, UpdateTenant(p, kvcache.TenantConfig{Name: "nobody"}), StatusUnknownTenant)
	if _, err := Admit(p, "r", "c", 256, 0, 0); err != nil { // 16 pages: the raised quota
		t.Fatal(err)
	}
	wantStatus(t, AddTenant(0, kvcache.TenantConfig{Name: "e"}), StatusInvalidHandle)
	wantStatus(t, UpdateTenant(0, kvcache.TenantConfig{Name: "e"}), StatusInvalidHandle)
}

func TestDestroyPool(t *testing.T) {
	p, err := CreatePool([]byte(testPool))
	if err != nil {
		t.Fatal(err)
	}
	l, err := Admit(p, "r", "a", 64, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	wantStatus(t, DestroyPool(p), OK)
	wantStatus(t, DestroyPool(p), StatusInvalidHandle)
	_, err = StatsJSON(p)
	wantStatus(t, err, StatusInvalidHandle)
	wantStatus(t, Release(l, cudaops.Ordering{}), StatusPoolClosed)
	_, err = BlockTable(l, make([]int32, 8))
	wantStatus(t, err, StatusLeaseReleased)
	wantStatus(t, Free(l), OK)
}

// TestFreeRacesUse frees leases while other goroutines use their handles.
// A user either sees the lease it looked up or ErrInvalidHandle; it must
// never see a recycled lease now owned by another request (invariant 1).
func TestFreeRacesUse(t *testing.T) {
	p := newTestPool(t)
	const rounds = 300
	var wg sync.WaitGroup
	handles := make(chan Handle)
	errs := make(chan error, 16)
	for w := range 3 {
		wg.Go(func() {
			table := make([]int32, 8)
			for h := range handles {
				for range 20 {
					li, err := DescribeLease(h)
					if err != nil {
						if !errors.Is(err, ErrInvalidHandle) {
							errs <- fmt.Errorf("reader %d: %w", w, err)
						}
						break
					}
					if li.PromptTokens != 16*int64(h%4+1) {
						errs <- fmt.Errorf("handle %#x describes a lease of %d tokens: another request's", h, li.PromptTokens)
					}
					if _, err := BlockTable(h, table); err != nil && !errors.Is(err, ErrInvalidHandle) && !errors.Is(err, kvcache.ErrLeaseReleased) {
						errs <- err
					}
				}
			}
		})
	}
	for i := range rounds {
		// The prompt is a function of the handle, which readers check;
		// handles are unique, so admit until one fits the pattern.
		var h Handle
		for {
			var err error
			prompt := int64(16 * (i%4 + 1))
			if h, err = Admit(p, fmt.Sprint("r", i), "b", prompt, 0, time.Second); err != nil {
				t.Fatal(err)
			}
			if h%4 == uint64(i%4) {
				break
			}
			Free(h)
		}
		handles <- h
		handles <- h
		if err := Free(h); err != nil {
			t.Fatal(err)
		}
	}
	close(handles)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	mustCheck(t, p)
}

func TestStatsJSON(t *testing.T) {
	p := newTestPool(t)
	if _, err := Admit(p, "r", "a", 20, 0, 0); err != nil {
		t.Fatal(err)
	}
	Admit(p, "r2", "nobody", 1, 0, 0)
	js, err := StatsJSON(p)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"device":"host","total_pages":64,"free_pages":62,"in_use_pages":2,"cached_pages":0,"quarantined_pages":0,` +
		`"retired_pages":0,"tokens_per_page":16,"page_bytes":512,"groups":[{"name":"kv","kind":"per_token","pages":64,"page_bytes":512,"free":62,"in_use":2,"cached":0,"quarantined":0,"retired":0}],"live_leases":1,"admitted":1,"refused":{"invalid_request":0,` +
		`"unknown_tenant":1,"duplicate_request":0,"exceeds_max_context":0,"exceeds_capacity":0,"exceeds_quota":0,` +
		`"pool_exhausted":0,"pool_faulted":0,"total":1},"growth":{"grown":0,"pages_grown":0,"refused":{"invalid_request":0,"unknown_tenant":0,"duplicate_request":0,"exceeds_max_context":0,"exceeds_capacity":0,"exceeds_quota":0,"pool_exhausted":0,"pool_faulted":0,"total":0},"preempted":0,"preempt_kept_pages":0},"scrub":{"fills":1,"pages_scrubbed":64,"bytes_scrubbed":32768,` +
		`"fill_errors":0,"pages_retired":0,"canary_checks":0,"canary_failures":0},"tenants":[{"name":"a","used_pages":2,` +
		`"quota_pages":32,"reserved_pages":0,"domain":"tenant:a"},{"name":"b","used_pages":0,"quota_pages":64,"reserved_pages":0,` +
		`"domain":"tenant:b"}],"prefix":{"enabled":true,"domains":[{"name":"tenant:a","shared":false,"tenants":1,"indexed_pages":0,` +
		`"cached_pages":0,"hit_pages":0,"miss_pages":0,"hit_tokens":0,"stored_pages":0,"evicted_pages":0,` +
		`"tier_pages":0,"tier_bound":0,"tier_hit_pages":0,"tier_hit_tokens":0,"tier_stored_pages":0,"tier_evicted_pages":0,"tier_checkpoints":0,"tier_checkpoint_bound":0,"tier_checkpoints_stored":0,"tier_checkpoint_hits":0,"tier_checkpoints_evicted":0},{"name":"tenant:b",` +
		`"shared":false,"tenants":1,"indexed_pages":0,"cached_pages":0,"hit_pages":0,"miss_pages":0,"hit_tokens":0,` +
		`"stored_pages":0,"evicted_pages":0,"tier_pages":0,"tier_bound":0,"tier_hit_pages":0,"tier_hit_tokens":0,"tier_stored_pages":0,"tier_evicted_pages":0,"tier_checkpoints":0,"tier_checkpoint_bound":0,"tier_checkpoints_stored":0,"tier_checkpoint_hits":0,"tier_checkpoints_evicted":0}],"events_sent":0,"events_dropped":0},"checkpoints":{"live":0,"restoring":0,` +
		`"state_bytes":0,"taken":0,"existing":0,"hits":0,"hit_tokens":0,"misses":0,"miss_tokens":0,"evicted":0,` +
		`"capacity_skips":0,"restore_nanos":0,"copy_nanos":0},` +
		`"tier":{"enabled":false,"slots":0,"slot_bytes":0,"checkpoint_slots":0,"checkpoint_slot_bytes":0,` +
		`"free":0,"cached":0,"swapped":0,"checkpoints":0,"in_flight":0,"quarantined":0,"retired":0,` +
		`"offloads":0,"offload_bytes":0,"offloads_dropped":0,"offloads_failed":0,"onloads":0,"onload_bytes":0,"onloads_failed":0,` +
		`"swaps_out":0,"swap_out_pages":0,"swaps_full":0,"swaps_failed":0,"swaps_in":0,"swap_in_pages":0,"swaps_evicted":0,` +
		`"checkpoints_stored":0,"checkpoints_dropped":0,"checkpoints_failed":0,"checkpoints_restored":0,` +
		`"checkpoint_restore_bytes":0,"checkpoint_restores_failed":0,"checkpoints_evicted":0,` +
		`"evicted_slots":0,"scrubbed_slots":0,"retired_slots":0},"closed":false,"fault":""}`
	if string(js) != want {
		t.Errorf("stats\n%s\nwant\n%s", js, want)
	}
}
