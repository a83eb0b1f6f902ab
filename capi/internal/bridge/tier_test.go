package bridge

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// The host tier through the bridge (ABI 12): its config and tenants'
// shares from JSON, its figures in the stats JSON, the medium of events,
// and its statuses.

var noOrdering cudaops.Ordering

const tierPool = `{"geometry": {"tokens_per_page": 4, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp16"},
	"pages": 16, "max_context_tokens": 64, "prefix": {"event_buffer": 64},
	"host_tier": {"pages": 8}, "tenants": [{"name": "a", "tier_pages": 6}, {"name": "b"}]}`

func TestHostTierFromJSON(t *testing.T) {
	cfg, err := ParseConfig([]byte(tierPool))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.HostTier != (kvcache.HostTierConfig{Pages: 8}) || cfg.Tenants[0].TierPages != 6 || cfg.Tenants[1].TierPages != 0 {
		t.Fatalf("tier %+v, tenants %+v", cfg.HostTier, cfg.Tenants)
	}
	cfg, err = ParseConfig([]byte(`{` + geom + `, "pages": 8, "max_context_tokens": 8, "host_tier": {"bytes": 65536, "no_swap": true}}`))
	if err != nil || cfg.HostTier != (kvcache.HostTierConfig{Bytes: 65536, NoSwap: true}) {
		t.Fatalf("%+v, %v", cfg.HostTier, err)
	}
	if _, err := ParseConfig([]byte(`{` + geom + `, "pages": 8, "max_context_tokens": 8, "host_tier": {"slots": 4}}`)); !errors.Is(err, kvcache.ErrInvalidConfig) {
		t.Errorf("an unknown host_tier field: %v", err)
	}
	tc, err := ParseTenant([]byte(`{"name": "x", "tier_pages": 12}`))
	if err != nil || tc.TierPages != 12 {
		t.Fatalf("%+v, %v", tc, err)
	}
	p, err := CreatePool([]byte(`{` + geom + `, "pages": 8, "max_context_tokens": 8, "host_tier": {"pages": -1}}`))
	wantStatus(t, err, StatusInvalidConfig)
	if p != 0 {
		t.Fatal("a handle for a refused pool")
	}
	// A hybrid pool with a tier: its own status.
	hybrid := `{"cache": {"groups": [
		{"name": "kv", "kind": "per_token", "tokens_per_page": 4, "regions": [{"name": "k", "page_bytes": 64, "dtype": "fp16"}]},
		{"name": "state", "kind": "state", "regions": [{"name": "s", "page_bytes": 64, "dtype": "fp32"}]}]},
		"pages": 16, "max_leases": 2, "max_context_tokens": 64, "host_tier": {"pages": 4}}`
	_, err = CreatePool([]byte(hybrid))
	wantStatus(t, err, StatusTierUnsupported)
	p = must(CreatePool([]byte(tierPool)))
	defer DestroyPool(p)
	l := must(AdmitTokens(p, "r", "a", tokens(4, 1), 0, "", 0))
	wantStatus(t, AddTenant(p, kvcache.TenantConfig{Name: "neg", TierPages: -1}), StatusInvalidTenant)
	if err := Release(l, noOrdering); err != nil {
		t.Fatal(err)
	}
}

func TestHostTierStatsAndEvents(t *testing.T) {
	p := must(CreatePool([]byte(tierPool)))
	defer DestroyPool(p)
	toks := tokens(13, 100) // 3 full pages and a token
	l := must(AdmitTokens(p, "r", "a", toks, 0, "", 0))
	if err := Commit(l, 13); err != nil {
		t.Fatal(err)
	}
	must(CachePrefix(l, 13))
	if err := Release(l, noOrdering); err != nil {
		t.Fatal(err)
	}
	// A request of the whole pool evicts the prompt into the tier.
	hog := must(Admit(p, "hog", "b", 64, 0, 0))
	if err := Release(hog, noOrdering); err != nil {
		t.Fatal(err)
	}
	l = must(AdmitTokens(p, "r2", "a", toks, 0, "", 0))
	if hit := must(HitTokens(l)); hit != 12 {
		t.Fatalf("hit %d tokens from the tier", hit)
	}
	if err := Release(l, noOrdering); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, p)
	var s StatsDoc
	if err := json.Unmarshal(must(StatsJSON(p)), &s); err != nil {
		t.Fatal(err)
	}
	tr := s.Tier
	if !tr.Enabled || tr.Slots != 8 || tr.Offloads != 3 || tr.Onloads != 3 || tr.Cached != 3 ||
		tr.Free+tr.Cached+tr.Swapped+tr.InFlight+tr.Quarantined+tr.Retired != tr.Slots {
		t.Fatalf("tier %+v", tr)
	}
	if d := s.Prefix.Domains[0]; d.Name != isolation.PrivateDomainPrefix+"a" || d.TierPages != 3 || d.TierBound != 6 || d.TierHitPages != 3 || d.TierHitTokens != 12 {
		t.Fatalf("domain %+v", d)
	}
	buf := make([]byte, 1<<16)
	n := must(Events(p, buf))
	var doc EventsDoc
	if err := json.Unmarshal(buf[:n-1], &doc); err != nil {
		t.Fatal(err)
	}
	var media []string
	for _, ev := range doc.Events {
		media = append(media, ev.Kind+"/"+ev.Medium)
	}
	want := []string{"stored/device", "stored/host", "removed/device", "stored/device"}
	if len(media) != len(want) {
		t.Fatalf("events %v, want %v", media, want)
	}
	for i := range want {
		if media[i] != want[i] {
			t.Fatalf("events %v, want %v", media, want)
		}
	}
}

func TestOnloadFailureStatus(t *testing.T) {
	err := &kvcache.AdmissionError{Err: kvcache.ErrOnloadFailed, Cause: kvcache.ErrDevice}
	if info := Classify(err); info.Status != StatusOnloadFailed || !info.Retryable {
		t.Fatalf("%+v", info)
	}
}
