package bridge

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// must returns v, or fails the test by panicking (a call like
// must(CreatePool(…)) cannot also pass t).
func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func noErr(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func tokens(n int, seed int32) []int32 {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = seed + int32(i)
	}
	return ids
}

// prefill walks a lease to prefilled as an engine would.
func prefill(t *testing.T, l Handle, prompt int64) {
	t.Helper()
	for _, err := range []error{BeginPrefill(l), Commit(l, prompt), FinishPrefill(l)} {
		if err != nil {
			t.Fatal(err)
		}
	}
}

func TestPrefixThroughBridge(t *testing.T) {
	p := must(CreatePool([]byte(`{"geometry": {"tokens_per_page": 16, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp32"},
	 "pages": 64, "max_context_tokens": 1024, "prefix": {"event_buffer": 8},
	 "tenants": [{"name": "a", "domain": "team"}, {"name": "b", "domain": "team"}, {"name": "c"}]}`)))
	defer DestroyPool(p)
	prompt := tokens(100, 7) // 6 full pages + 4 tokens

	l1 := must(AdmitTokens(p, "r1", "a", prompt, 10, "", 0))
	if n := must(HitTokens(l1)); n != 0 {
		t.Fatalf("cold hit = %d", n)
	}
	_, err := CachePrefix(l1, 50)
	wantStatus(t, err, StatusInvalidArgument) // nothing written yet
	noErr(t, Commit(l1, 100))
	if n := must(CachePrefix(l1, 100)); n != 96 {
		t.Fatalf("published %d tokens, want 96", n)
	}
	// b shares a's domain: it hits; c does not; another adapter does not.
	l2 := must(AdmitTokens(p, "r2", "b", prompt, 10, "", 0))
	l3 := must(AdmitTokens(p, "r3", "c", prompt, 10, "", 0))
	l4 := must(AdmitTokens(p, "r4", "a", prompt, 10, "lora-1", 0))
	for _, c := range []struct {
		l    Handle
		want int64
	}{{l2, 96}, {l3, 0}, {l4, 0}} {
		if n := must(HitTokens(c.l)); n != c.want {
			t.Errorf("hit tokens %d, want %d", n, c.want)
		}
	}
	_, err = AdmitTokens(p, "r5", "a", nil, 10, "", 0)
	wantStatus(t, err, StatusInvalidRequest)
	_, err = AdmitTokens(p, "r5", "a", prompt, 10, strings.Repeat("x", 300), 0)
	wantStatus(t, err, StatusInvalidRequest)
	mustCheck(t, p)

	var doc StatsDoc
	noErr(t, json.Unmarshal(must(StatsJSON(p)), &doc))
	if d := doc.Prefix.Domains[0]; d.Name != "team" || !d.Shared || d.HitTokens != 96 || d.StoredPages != 6 {
		t.Errorf("domain stats %+v", d)
	}
	if doc.Tenants[0].Domain != "team" || doc.Tenants[2].Domain != "tenant:c" {
		t.Errorf("tenant domains %+v", doc.Tenants)
	}

	// Events: a size query keeps the batch; the next call delivers it once.
	need, err := Events(p, nil)
	wantStatus(t, err, StatusBufferTooSmall)
	buf := make([]byte, need)
	if _, err := Events(p, buf); err != nil {
		t.Fatal(err)
	}
	var ev EventsDoc
	noErr(t, json.Unmarshal(bytes.TrimRight(buf, "\x00"), &ev))
	if !ev.Enabled || len(ev.Events) != 1 || ev.Events[0].Kind != "stored" || ev.Events[0].Domain != "team" || len(ev.Events[0].Keys) != 6 {
		t.Fatalf("events %+v", ev)
	}
	n := must(Events(p, buf))
	if got := string(buf[:n-1]); got != `{"enabled":true,"events":[]}` {
		t.Fatalf("second batch %s", got)
	}

	// The ABI-1 update keeps the domain; the JSON update replaces it.
	noErr(t, UpdateTenantQuota(p, kvcache.TenantConfig{Name: "b", QuotaPages: 40}))
	l6 := must(AdmitTokens(p, "r6", "b", prompt, 10, "", 0))
	if n := must(HitTokens(l6)); n != 96 {
		t.Errorf("after a quota update b hits %d tokens, want 96", n)
	}
	noErr(t, UpdateTenant(p, must(ParseTenant([]byte(`{"name": "b", "quota_pages": 40}`)))))
	l7 := must(AdmitTokens(p, "r7", "b", prompt, 10, "", 0))
	if n := must(HitTokens(l7)); n != 0 {
		t.Errorf("b moved to its own domain still hits %d tokens", n)
	}
	for _, l := range []Handle{l1, l2, l3, l4, l6, l7} {
		noErr(t, Free(l))
	}
	mustCheck(t, p)
}

func TestParseTenant(t *testing.T) {
	tc := must(ParseTenant([]byte(`{"name": "x", "quota_pages": 4, "reserved_pages": 1, "domain": "d", "max_checkpoints": 3}`)))
	if tc != (kvcache.TenantConfig{Name: "x", QuotaPages: 4, ReservedPages: 1, Domain: "d", MaxCheckpoints: 3}) {
		t.Fatalf("%+v", tc)
	}
	for _, js := range []string{``, `{"name": "x", "salt": 1}`, `{"name": "x"} {}`, `[]`, `{"name": "x", "max_checkpoints": "3"}`,
		`{"name": "x", "max_checkpoints": 1.5}`} {
		_, err := ParseTenant([]byte(js))
		wantStatus(t, err, StatusInvalidTenant)
	}
}

func TestPhases(t *testing.T) {
	p := newTestPool(t)
	l := must(Admit(p, "r", "a", 40, 0, 0))
	wantStatus(t, FinishPrefill(l), StatusLeasePhase)
	noErr(t, BeginPrefill(l))
	wantStatus(t, BeginPrefill(l), StatusLeasePhase)
	noErr(t, Commit(l, 39))
	wantStatus(t, FinishPrefill(l), StatusLeasePhase) // one token short
	if ph := must(Phase(l)); ph != kvcache.PhasePrefilling {
		t.Fatalf("phase %v", ph)
	}
	noErr(t, Abort(l))
	wantStatus(t, Abort(l), StatusLeaseReleased)
	if ph := must(Phase(l)); ph != kvcache.PhaseAborted {
		t.Fatalf("phase %v", ph)
	}
	noErr(t, Free(l))
	wantStatus(t, Abort(l), StatusInvalidHandle)
	mustCheck(t, p)
}

func TestDeviceSelection(t *testing.T) {
	h, err := CreatePool([]byte(`{"geometry": {"tokens_per_page": 16, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp32"},
	 "pages": 8, "max_context_tokens": 128, "tenants": [{"name": "a"}], "device": {"kind": "cuda", "ordinal": 0}}`))
	if err != nil {
		// No driver or GPU here: the driver's reason, not a crash.
		wantStatus(t, err, StatusNoDevice)
		if !strings.Contains(err.Error(), "cudaops") {
			t.Fatalf("message %q", err)
		}
		return
	}
	defer DestroyPool(h)
	l := must(Admit(h, "r", "a", 100, 0, 0))
	noErr(t, Free(l))
	mustCheck(t, h)
	var doc StatsDoc
	noErr(t, json.Unmarshal(must(StatsJSON(h)), &doc))
	if !strings.Contains(strings.ToLower(doc.Device), "cuda") {
		t.Errorf("device %q", doc.Device)
	}
}

var testKey = []byte("kvfence capi handoff test key, 32+ bytes")

func TestHandoffThroughBridge(t *testing.T) {
	src := newTestPool(t)
	dst := newTestPool(t)
	recv := must(CreateReceiver(dst, testKey, nil))
	defer DestroyReceiver(recv)

	l := must(Admit(src, "r1", "a", 40, 0, 0))
	_, err := Export(l, testKey, 8, 0)
	wantStatus(t, err, StatusLeasePhase) // not prefilled
	_, err = Export(l, testKey[:8], 8, 0)
	wantStatus(t, err, StatusInvalidConfig) // short key
	prefill(t, l, 40)
	// Give the prompt's pages recognisable content.
	region := make([]byte, 256)
	for i := range 3 {
		for r := range 2 {
			for j := range region {
				region[j] = byte(i*7 + r*3 + j)
			}
			noErr(t, withLease(l, func(_ *poolEntry, kl *kvcache.Lease) error { return kl.WritePage("kv", i, r, region) }))
		}
	}
	exp := must(Export(l, testKey, 8, 0))
	info := must(DescribeExport(exp))
	pb := info.PageBytes
	if info.Pages != 3 || pb != 512 || info.PromptTokens != 40 || info.MaxNewTokens != 8 || !info.Live {
		t.Fatalf("export info %+v", info)
	}
	n, err := ExportManifest(exp, nil)
	wantStatus(t, err, StatusBufferTooSmall)
	manifest := make([]byte, n)
	must(ExportManifest(exp, manifest))

	// Bad manifests are refused before anything is admitted.
	forged := bytes.Clone(manifest)
	forged[30] ^= 1
	_, err = BeginImport(recv, forged)
	wantStatus(t, err, StatusBadMAC)
	_, err = BeginImport(recv, manifest[:10])
	wantStatus(t, err, StatusMalformedManifest)
	other := must(CreateReceiver(dst, bytes.Repeat([]byte{1}, 32), []byte(`{"max_ttl_ms": 60000}`)))
	_, err = BeginImport(other, manifest)
	wantStatus(t, err, StatusBadMAC)
	noErr(t, DestroyReceiver(other))
	wantStatus(t, DestroyReceiver(other), StatusInvalidHandle)

	imp := must(BeginImport(recv, manifest))
	_, err = BeginImport(recv, manifest)
	wantStatus(t, err, StatusInProgress) // a duplicate while the first is imported
	if in := must(DescribeImport(imp)); in.Checksum != info.Checksum || info.Checksum == 0 {
		t.Fatalf("export describes checksum %08x, the import's manifest %08x", info.Checksum, in.Checksum)
	}
	pages := make([]byte, info.Pages*info.PageBytes)
	wantStatus(t, ExportReadPages(exp, 0, pages[:5]), StatusInvalidArgument)
	wantStatus(t, ExportReadPages(exp, -1, pages[:pb]), StatusInvalidArgument)
	wantStatus(t, ExportReadPages(exp, 2, pages[:2*pb]), StatusInvalidArgument)
	noErr(t, ExportReadPages(exp, 0, pages))
	noErr(t, ImportWritePages(imp, 0, pages[:pb]))
	noErr(t, ImportWritePages(imp, 1, pages[pb:]))
	dl := must(CompleteImport(imp))
	got := make([]byte, 256)
	for i := range 3 {
		for r := range 2 {
			for j := range region {
				region[j] = byte(i*7 + r*3 + j)
			}
			noErr(t, withLease(dl, func(_ *poolEntry, kl *kvcache.Lease) error { return kl.ReadPage("kv", i, r, got) }))
			if !bytes.Equal(got, region) {
				t.Fatalf("page %d region %d did not arrive intact", i, r)
			}
		}
	}
	if li := must(DescribeLease(dl)); li.Written != 40 || li.PromptTokens != 40 || li.MaxNewTokens != 8 || !li.Live {
		t.Fatalf("imported lease %+v", li)
	}
	if ph := must(Phase(dl)); ph != kvcache.PhasePrefilled {
		t.Fatalf("imported phase %v", ph)
	}
	_, err = CompleteImport(imp)
	wantStatus(t, err, StatusStaleTransfer)
	noErr(t, ExportAck(exp))
	wantStatus(t, ExportAck(exp), StatusReclaimed)
	wantStatus(t, ExportReadPages(exp, 0, pages[:pb]), StatusReclaimed)
	if info := must(DescribeExport(exp)); info.Live {
		t.Fatal("export live after its ack")
	}
	noErr(t, FreeExport(exp))
	noErr(t, FreeImport(imp))
	wantStatus(t, FreeImport(imp), StatusInvalidHandle)
	wantStatus(t, FreeExport(exp), StatusInvalidHandle)
	// The source lease ended with the ack; its handle still needs a free.
	wantStatus(t, Release(l, cudaops.Ordering{}), StatusLeaseReleased)
	noErr(t, Free(l))
	noErr(t, Free(dl))
	mustCheck(t, src)
	mustCheck(t, dst)

	// A corrupted page aborts the import; freeing the export aborts it.
	l2 := must(Admit(src, "r2", "a", 20, 0, 0))
	prefill(t, l2, 20)
	exp2 := must(Export(l2, testKey, 0, 0))
	n = must(ExportManifest(exp2, manifest[:cap(manifest)]))
	imp2 := must(BeginImport(recv, manifest[:n]))
	noErr(t, ExportReadPages(exp2, 0, pages[:2*pb]))
	pages[3] ^= 0x40
	noErr(t, ImportWritePages(imp2, 0, pages[:2*pb]))
	_, err = CompleteImport(imp2)
	wantStatus(t, err, StatusChecksumMismatch)
	if info := must(DescribeImport(imp2)); info.Live {
		t.Fatal("import live after a checksum failure")
	}
	noErr(t, FreeImport(imp2))
	noErr(t, FreeExport(exp2))
	wantStatus(t, Release(l2, cudaops.Ordering{}), StatusLeaseReleased)
	noErr(t, Free(l2))
	mustCheck(t, src)
	mustCheck(t, dst)
	if s := must(StatsJSON(dst)); !bytes.Contains(s, []byte(`"live_leases":0`)) {
		t.Fatalf("decode pool still holds leases: %s", s)
	}
}

func TestReceiverConfig(t *testing.T) {
	p := newTestPool(t)
	for _, c := range []struct {
		js   string
		want Status
	}{
		{`{"admit_wait_ms": -1}`, StatusInvalidConfig},
		{`{"ttl": 1}`, StatusInvalidConfig},
		{`{} {}`, StatusInvalidConfig},
		{`nope`, StatusInvalidConfig},
	} {
		_, err := CreateReceiver(p, testKey, []byte(c.js))
		wantStatus(t, err, c.want)
	}
	_, err := CreateReceiver(p, nil, nil)
	wantStatus(t, err, StatusInvalidConfig)
	_, err = CreateReceiver(12345, testKey, nil)
	wantStatus(t, err, StatusInvalidHandle)
	_, err = BeginImport(p, nil) // a pool handle is not a receiver
	wantStatus(t, err, StatusInvalidHandle)
}

func TestRegions(t *testing.T) {
	p := newTestPool(t)
	n, err := Regions(p, nil)
	wantStatus(t, err, StatusBufferTooSmall)
	if n != 2 {
		t.Fatalf("%d regions, want K and V of 1 layer", n)
	}
	rs := make([]cudaops.Region, 2)
	if _, err := Regions(p, rs); err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		if r.Pages != 64 || r.PageBytes != 256 || r.Base == 0 {
			t.Errorf("region %+v", r)
		}
	}
	_, err = Regions(999999, rs)
	wantStatus(t, err, StatusInvalidHandle)
}

// FuzzBeginImport: any bytes offered as a manifest are refused with a
// status (or, for a genuine manifest, admitted), never a panic, and the
// decode pool stays consistent.
func FuzzBeginImport(f *testing.F) {
	src, err := CreatePool([]byte(testPool))
	if err != nil {
		f.Fatal(err)
	}
	defer DestroyPool(src)
	l := must(Admit(src, "seed", "a", 40, 0, 0))
	for _, err := range []error{BeginPrefill(l), Commit(l, 40), FinishPrefill(l)} {
		if err != nil {
			f.Fatal(err)
		}
	}
	exp := must(Export(l, testKey, 8, 0))
	n, _ := ExportManifest(exp, nil) // size query
	good := make([]byte, n)
	must(ExportManifest(exp, good))
	f.Add(good)
	f.Add(good[:len(good)-1])
	f.Add([]byte{})
	f.Add([]byte("KVFH"))
	dst := must(CreatePool([]byte(testPool)))
	defer DestroyPool(dst)
	recv := must(CreateReceiver(dst, testKey, nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		imp, err := BeginImport(recv, b)
		if err == nil {
			noErr(t, FreeImport(imp)) // aborts: the request ID may come again
		} else if st := Classify(err).Status; st == StatusInternal {
			t.Fatalf("unclassified: %v", err)
		}
		noErr(t, Check(dst))
	})
}

// FuzzParseTenant: tenant JSON parses or fails with ErrInvalidTenant's
// status; what parses is judged by the registry without panicking.
func FuzzParseTenant(f *testing.F) {
	f.Add([]byte(`{"name": "x", "quota_pages": 4, "domain": "d"}`))
	f.Add([]byte(`{"name": "", "domain": "tenant:y"}`))
	f.Add([]byte(`{"quota_pages": -1}`))
	f.Add([]byte(`{"name": "c", "max_checkpoints": 16777217}`))
	p, err := CreatePool([]byte(testPool))
	if err != nil {
		f.Fatal(err)
	}
	defer DestroyPool(p)
	f.Fuzz(func(t *testing.T, b []byte) {
		tc, err := ParseTenant(b)
		if err != nil {
			wantStatus(t, err, StatusInvalidTenant)
			return
		}
		if err := AddTenant(p, tc); err != nil && Classify(err).Status == StatusInternal {
			t.Fatalf("unclassified: %v", err)
		}
		noErr(t, Check(p))
	})
}

// TestHandoffDomains: KV computed in a shared domain on the prefill pool
// is only imported where the tenant is in that same domain.
func TestHandoffDomains(t *testing.T) {
	const cfg = `{"geometry": {"tokens_per_page": 16, "layers": 1, "kv_heads": 1, "head_dim": 4, "dtype": "fp32"},
	 "pages": 64, "max_context_tokens": 1024, "tenants": [{"name": "a", "domain": %s}]}`
	src := must(CreatePool([]byte(strings.Replace(cfg, "%s", `"team"`, 1))))
	defer DestroyPool(src)
	private := must(CreatePool([]byte(strings.Replace(cfg, "%s", `""`, 1))))
	defer DestroyPool(private)
	team := must(CreatePool([]byte(strings.Replace(cfg, "%s", `"team"`, 1))))
	defer DestroyPool(team)
	l := must(Admit(src, "r", "a", 20, 0, 0))
	prefill(t, l, 20)
	exp := must(Export(l, testKey, 0, 0))
	n, _ := ExportManifest(exp, nil)
	m := make([]byte, n)
	must(ExportManifest(exp, m))
	rp := must(CreateReceiver(private, testKey, nil))
	_, err := BeginImport(rp, m)
	wantStatus(t, err, StatusDomainMismatch)
	rt := must(CreateReceiver(team, testKey, nil))
	imp := must(BeginImport(rt, m))
	noErr(t, FreeImport(imp))
	noErr(t, FreeExport(exp))
	noErr(t, Free(l))
	for _, p := range []Handle{src, private, team} {
		mustCheck(t, p)
	}
}
