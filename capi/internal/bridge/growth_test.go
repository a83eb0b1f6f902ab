package bridge

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

const growthPool = `{"geometry": {"tokens_per_page": 4, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp16"},
	"pages": 16, "max_context_tokens": 64, "growth_watermark": 0.25,
	"sizing": {"mode": "on_demand", "headroom_tokens": 2},
	"tenants": [{"name": "a"}, {"name": "f", "sizing": {"mode": "full"}}]}`

func TestSizingAndWatermarkFromJSON(t *testing.T) {
	cfg, err := ParseConfig([]byte(growthPool))
	if err != nil {
		t.Fatal(err)
	}
	if want := (kvcache.Sizing{Mode: kvcache.SizeOnDemand, HeadroomTokens: 2}); cfg.Sizing != want || cfg.GrowthWatermark != 0.25 {
		t.Fatalf("sizing %+v, watermark %v", cfg.Sizing, cfg.GrowthWatermark)
	}
	if cfg.Tenants[1].Sizing.Mode != kvcache.SizeFull || cfg.Tenants[0].Sizing.Mode != kvcache.SizeInherit {
		t.Fatalf("tenants %+v", cfg.Tenants)
	}
	for _, bad := range []string{
		`{` + geom + `, "pages": 8, "max_context_tokens": 8, "sizing": {"mode": "lazy"}}`,
		`{` + geom + `, "pages": 8, "max_context_tokens": 8, "tenants": [{"name": "x", "sizing": {"mode": "sometimes"}}]}`,
	} {
		_, err := ParseConfig([]byte(bad))
		if !errors.Is(err, kvcache.ErrInvalidConfig) || !errors.Is(err, isolation.ErrInvalidSizing) {
			t.Errorf("%s: %v", bad, err)
		}
	}
	if _, err := ParseTenant([]byte(`{"name": "x", "sizing": {"mode": "??"}}`)); !errors.Is(err, isolation.ErrInvalidTenant) {
		t.Errorf("tenant with a bad sizing: %v", err)
	}
}

func TestGrowAndPreemptThroughTheBridge(t *testing.T) {
	p, err := CreatePool([]byte(growthPool))
	if err != nil {
		t.Fatal(err)
	}
	defer DestroyPool(p)
	l := must(AdmitTokens(p, "r", "a", tokens(6, 1), 40, "", 0)) // 6 + 2 tokens: 2 pages
	if err := Commit(l, 6); err != nil {
		t.Fatal(err)
	}
	if err := Grow(l, 7, 0); err != nil { // 13 tokens: 4 pages
		t.Fatal(err)
	}
	if li, _ := DescribeLease(l); li.Pages != 4 {
		t.Fatalf("after growth: %+v", li)
	}
	wantStatus(t, Grow(l, 41, 0), StatusExceedsMaxContext)
	wantStatus(t, Grow(l, 1, -time.Millisecond), StatusInvalidArgument)
	hog := must(Admit(p, "hog", "f", 32, 0, 0)) // 8 pages: 4 free, kept for growth
	wantStatus(t, func() error { _, err := Admit(p, "new", "f", 1, 0, 0); return err }(), StatusPoolExhausted)
	if err := Grow(l, 26, 0); err != nil { // 32 tokens: 8 pages, 4 kept ones
		t.Fatal(err)
	}
	start := time.Now()
	wantStatus(t, Grow(l, 27, 20*time.Millisecond), StatusPoolExhausted)
	if time.Since(start) < 20*time.Millisecond {
		t.Error("a growth with wait_ms did not wait")
	}
	if err := Release(hog, cudaops.Ordering{}); err != nil {
		t.Fatal(err)
	}
	if err := Commit(l, 32); err != nil {
		t.Fatal(err)
	}
	all := tokens(32, 1)
	kept, err := Preempt(l, all)
	if err != nil || kept != 32 {
		t.Fatalf("preempt: kept %d, %v", kept, err)
	}
	again := must(AdmitTokens(p, "r", "a", all, 8, "", 0))
	if hit, _ := HitTokens(again); hit != 28 {
		t.Fatalf("readmitted with %d tokens shared, want 28 (all but the last page)", hit)
	}
	if err := Check(p); err != nil {
		t.Fatal(err)
	}
}

// growDuringCopy makes the next BlockTable or SlotMapping find lease
// grown by tokens after it checked its size against the caller's buffer,
// as a kvf_lease_grow on another thread can make it.
func growDuringCopy(t *testing.T, tokens int) {
	t.Helper()
	testHookSized = func(l *kvcache.Lease) {
		testHookSized = nil
		if err := l.TryGrow(tokens); err != nil {
			t.Errorf("growth during the copy: %v", err)
		}
	}
	t.Cleanup(func() { testHookSized = nil })
}

// TestTablesOfALeaseGrowingDuringTheCopy: a lease that grows between the
// check of its size and the copy of its table must not be reported as
// copied when it was not (append moved the longer table into new memory
// and left the caller's buffer as it was: stale page IDs, perhaps a
// former lease's, taken for this one's), nor with a length other than
// what was written. A table that no longer fits is BufferTooSmall with
// the new size and the buffer untouched; slots that fit are copied, with
// their count.
func TestTablesOfALeaseGrowingDuringTheCopy(t *testing.T) {
	p := must(CreatePool([]byte(growthPool)))
	defer DestroyPool(p)
	l := must(AdmitTokens(p, "r", "a", tokens(6, 1), 40, "", 0)) // 6 + 2 tokens: 2 pages of 4
	if err := Commit(l, 6); err != nil {
		t.Fatal(err)
	}

	growDuringCopy(t, 6) // 12 tokens: 3 pages
	buf := []int32{-1, -1}
	n, err := BlockTable(l, buf)
	wantStatus(t, err, StatusBufferTooSmall)
	if n != 3 || Classify(err).Need != 3 || !slices.Equal(buf, []int32{-1, -1}) {
		t.Fatalf("block table of a lease grown to 3 pages into 2: n %d, need %d, buffer %v", n, Classify(err).Need, buf)
	}
	table := make([]int32, 8)
	growDuringCopy(t, 10) // 16 tokens: 4 pages, room for them
	if n, err = BlockTable(l, table); err != nil || n != 4 {
		t.Fatalf("block table of a lease grown to 4 pages into 8: %d, %v", n, err)
	}
	full := must(BlockTable(l, table))
	if full != 4 {
		t.Fatalf("block table: %d pages", full)
	}

	// Tokens [0, 24) lie outside the 4 pages (16 slots) when checked, and
	// inside once the lease has grown to 6.
	growDuringCopy(t, 18) // 24 tokens: 6 pages
	slots := slices.Repeat([]int64{-1}, 24)
	if n, err = SlotMapping(l, 0, 24, slots); err != nil || n != 24 {
		t.Fatalf("slot mapping over a lease grown to cover it: %d, %v", n, err)
	}
	table = make([]int32, 6)
	must(BlockTable(l, table))
	for tok, s := range slots {
		if want := int64(table[tok/4])*4 + int64(tok%4); s != want {
			t.Fatalf("slot of token %d = %d, want %d", tok, s, want)
		}
	}
	growDuringCopy(t, 26) // 32 tokens: 8 pages
	short := slices.Repeat([]int64{-1}, 28)
	n, err = SlotMapping(l, 0, 30, short)
	wantStatus(t, err, StatusBufferTooSmall)
	if n != 30 || Classify(err).Need != 30 || slices.ContainsFunc(short, func(s int64) bool { return s != -1 }) {
		t.Fatalf("slots of 30 tokens into 28: n %d, need %d, buffer %v", n, Classify(err).Need, short)
	}
	mustCheck(t, p)
}

// TestQuotaUpdateKeepsSizing: the ABI-1 update (kvf_pool_update_tenant)
// changes the quota and reservation only; a tenant sized in full stays
// so, as its domain and checkpoint bound do.
func TestQuotaUpdateKeepsSizing(t *testing.T) {
	p := must(CreatePool([]byte(growthPool)))
	defer DestroyPool(p)
	capacity := func() int64 {
		t.Helper()
		l := must(Admit(p, "r", "f", 8, 24, 0))
		defer Free(l)
		return must(DescribeLease(l)).CapacityTokens
	}
	if c := capacity(); c != 32 {
		t.Fatalf("a full lease holds %d tokens, want 32", c)
	}
	noErr(t, UpdateTenantQuota(p, kvcache.TenantConfig{Name: "f", QuotaPages: 12}))
	if c := capacity(); c != 32 {
		t.Errorf("after a quota update the lease holds %d tokens, want 32 (still sized in full)", c)
	}
	noErr(t, UpdateTenant(p, must(ParseTenant([]byte(`{"name": "f", "quota_pages": 12}`)))))
	if c := capacity(); c != 12 {
		t.Errorf("after the JSON update (the pool's sizing) the lease holds %d tokens, want 8 + 2 headroom in pages of 4", c)
	}
}
