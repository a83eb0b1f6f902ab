package bridge

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// The host tier through the bridge (ABI 12): its config and tenants'
// shares from JSON, its figures in the stats JSON, the medium of events,
// and its statuses; a hybrid pool's state checkpoints in it (ABI 13).

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
	// A hybrid pool with a tier of no checkpoints: its own status, as
	// in ABI 12.
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

// tierHybridJSON is hybridJSONWith's pool of two leases and no checkpoint
// slots of its own (a second checkpoint evicts the first), with a host
// tier: tier is its object's members.
func tierHybridJSON(tier string) string {
	js := strings.Replace(hybridJSONWith("", `"name": "a"`), `"max_leases": 4`, `"max_leases": 2`, 1)
	return strings.Replace(js, `"prefix": {}`, `"prefix": {}, "host_tier": {`+tier+`}`, 1)
}

// tierOf is the stats JSON's "tier".
func tierOf(t *testing.T, p Handle) TierDoc {
	t.Helper()
	var doc StatsDoc
	noErr(t, json.Unmarshal(statsOf(t, p), &doc))
	return doc.Tier
}

// checkpointAt20 admits prompt for tenant a, prefills it to 20 tokens
// holding tag's state, checkpoints it there and frees it.
func checkpointAt20(t *testing.T, p Handle, id string, prompt []int32, tag string) {
	t.Helper()
	l := must(AdmitTokens(p, id, "a", prompt, 8, "", 0))
	noErr(t, BeginPrefill(l))
	prefillTo(t, l, 20)
	writeCheckpointState(t, l, tag)
	noErr(t, CheckpointState(l, 20, cudaops.Ordering{}))
	noErr(t, Free(l))
	mustCheck(t, p)
}

// The host tier of a hybrid pool (ABI 13): "checkpoints" from JSON; a
// checkpoint the device evicts kept there and restored byte for byte by a
// hit, its figures in the stats JSON; the key's refusals, and a tier
// without it refused with the status of ABI 12.
func TestHostTierCheckpoints(t *testing.T) {
	cfg, err := ParseConfig([]byte(tierHybridJSON(`"pages": 32, "checkpoints": 2, "no_swap": true`)))
	if err != nil || cfg.HostTier != (kvcache.HostTierConfig{Pages: 32, Checkpoints: 2, NoSwap: true}) {
		t.Fatalf("%+v, %v", cfg.HostTier, err)
	}
	p := must(CreatePool([]byte(tierHybridJSON(`"pages": 32, "checkpoints": 2`))))
	t.Cleanup(func() { DestroyPool(p) })
	if tr := tierOf(t, p); tr.Slots != 34 || tr.CheckpointSlots != 2 || tr.CheckpointSlotBytes != ckStateBytes || tr.Free != 34 {
		t.Fatalf("tier %+v", tr)
	}
	first, second := tokens(checkpointPrompt, 500), tokens(checkpointPrompt, 900)
	checkpointAt20(t, p, "first", first, "first@20")
	checkpointAt20(t, p, "second", second, "second@20") // takes first's slot: first's checkpoint to the tier
	tr := tierOf(t, p)
	if tr.CheckpointsStored != 1 || tr.Checkpoints != 1 || tr.CheckpointsDropped != 0 || tr.CheckpointsFailed != 0 {
		t.Fatalf("after the device's eviction: %+v", tr)
	}
	l := must(AdmitTokens(p, "again", "a", first, 8, "", 0))
	if n := must(HitTokens(l)); n != 20 {
		t.Fatalf("hit %d tokens, want 20", n)
	}
	if info := must(DescribeLease(l)); info.Written != 20 {
		t.Errorf("written %d after the restore, want 20", info.Written)
	}
	noErr(t, checkpointStateErr(l, "first@20"))
	noErr(t, Free(l))
	other := must(AdmitTokens(p, "other", "b", first, 8, "", 0))
	if n := must(HitTokens(other)); n != 0 {
		t.Errorf("another domain hit %d tokens", n)
	}
	noErr(t, Free(other))
	mustCheck(t, p)
	tr = tierOf(t, p)
	if tr.CheckpointsRestored != 1 || tr.CheckpointRestoreBytes != ckStateBytes || tr.CheckpointRestoresFailed != 0 || tr.Checkpoints != 1 ||
		tr.Free+tr.Cached+tr.Swapped+tr.Checkpoints+tr.InFlight+tr.Quarantined+tr.Retired != tr.Slots {
		t.Fatalf("after the restore: %+v", tr)
	}
	if c := checkpointsOf(t, p); c.Hits != 1 || c.HitTokens != 20 {
		t.Errorf("checkpoints %+v", c)
	}
	noErr(t, ClearPrefixCache(p))
	if tr = tierOf(t, p); tr.Checkpoints != 0 || tr.CheckpointsEvicted != 1 || tr.Free != tr.Slots {
		t.Errorf("cleared: %+v", tr)
	}

	for _, tc := range []struct {
		js   string
		want Status
		says string
	}{
		{tierHybridJSON(`"pages": 32`), StatusTierUnsupported, "set HostTier.Checkpoints"},
		{tierHybridJSON(`"pages": 32, "checkpoints": -1`), StatusInvalidConfig, "Checkpoints -1"},
		{tierHybridJSON(`"pages": 32, "checkpoints": 2.5`), StatusInvalidConfig, "host_tier.checkpoints"},
		{tierHybridJSON(`"checkpoints": 2`), StatusInvalidConfig, "no size"},
		{`{` + geom + `, "pages": 8, "max_context_tokens": 8, "host_tier": {"pages": 4, "checkpoints": 1}}`, StatusInvalidConfig, "no window or state group"},
	} {
		h, err := CreatePool([]byte(tc.js))
		wantStatus(t, err, tc.want)
		if h != 0 || err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: handle %d, %v; want it to say %q", tc.js, h, err, tc.says)
		}
	}
}
