package bridge

import (
	"errors"
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
