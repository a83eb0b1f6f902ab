package bridge

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// State checkpoints through the bridge (ABI 10): the config's keys, a
// checkpoint and the hit that restores it, every refusal with its status
// and the pool unchanged, and the figures in the stats JSON.

// hybridJSONWith is hybridJSON's pool (4-token pages, a window of 8
// tokens, a state slot of 9,096 bytes, max_leases 4) with prefix members
// and one tenant's members, scrubbed to zeros.
func hybridJSONWith(prefix, tenant string) string {
	js := strings.Replace(hybridJSON(""), `"scrub": {"kind": "poison"}`, `"prefix": {`+prefix+`}`, 1)
	return strings.Replace(js, `"tenants": [{"name": "a"}]`, `"tenants": [{`+tenant+`}, {"name": "b"}]`, 1)
}

// checkpointPrompt is 22 tokens; the checkpoint of its prefill is at 20
// (5 pages), where the window's pages inside it are logical pages 3 and 4.
const checkpointPrompt = 22

// ckUnits are the units of a handoff of 20 tokens beside the per-token
// pages: the window's pages 3 and 4 (two regions of 64 bytes) and the
// state slot (96 + 9,000 bytes).
var ckUnits = []struct {
	group       string
	first, n    int
	regionBytes []int
}{
	{"swa", 3, 2, []int{64, 64}},
	{"state", 0, 1, []int{96, 9000}},
}

// ckStateBytes is the bytes a checkpoint of 20 tokens holds.
const ckStateBytes = 2*128 + 96 + 9000

// writeCheckpointState writes tag's bytes into lease h's window pages and
// state slot at 20 tokens, as an engine whose state reflects them.
func writeCheckpointState(t *testing.T, h Handle, tag string) {
	t.Helper()
	noErr(t, withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		for g, u := range ckUnits {
			first, _, err := l.GroupTable(u.group, nil)
			if err != nil {
				return err
			}
			for j := range u.n {
				for r, n := range u.regionBytes {
					if err := l.WritePage(u.group, u.first+j-first, r, stamp(tag, g, u.first+j, r, n)); err != nil {
						return err
					}
				}
			}
		}
		return nil
	}))
}

// checkpointStateErr says where lease h does not hold tag's state at 20
// tokens, its windows starting there, every other unit of those groups it
// holds scrubbed (zeros).
func checkpointStateErr(h Handle, tag string) error {
	return withLease(h, func(_ *poolEntry, l *kvcache.Lease) error {
		for g, u := range ckUnits {
			first, table, err := l.GroupTable(u.group, nil)
			if err != nil {
				return err
			}
			if first != u.first {
				return fmt.Errorf("group %q starts at logical page %d, the checkpoint's at %d", u.group, first, u.first)
			}
			for i := range table {
				for r, n := range u.regionBytes {
					got := make([]byte, n)
					if err := l.ReadPage(u.group, i, r, got); err != nil {
						return err
					}
					want := make([]byte, n)
					if i < u.n {
						want = stamp(tag, g, first+i, r, n)
					}
					if !bytes.Equal(got, want) {
						return fmt.Errorf("group %q logical page %d region %d holds %x…, want %x…", u.group, first+i, r, got[:8], want[:8])
					}
				}
			}
		}
		return nil
	})
}

// checkpointsOf is the stats JSON's "checkpoints".
func checkpointsOf(t *testing.T, p Handle) CheckpointsDoc {
	t.Helper()
	var doc StatsDoc
	noErr(t, json.Unmarshal(statsOf(t, p), &doc))
	return doc.Checkpoints
}

// prefillTo commits lease h to n tokens and slides its windows there.
func prefillTo(t *testing.T, h Handle, n int64) {
	t.Helper()
	noErr(t, Commit(h, n))
	must(SlideWindows(h, cudaops.Ordering{}))
}

// TestCheckpointRestoredByAHit: a checkpoint at the prefill's checkpoint
// is restored, byte for byte, into the next lease of the domain with the
// same prompt, whose window ring is otherwise scrubbed; the stats JSON
// counts it; another domain hits nothing.
func TestCheckpointRestoredByAHit(t *testing.T) {
	p := must(CreatePool([]byte(hybridJSONWith(`"checkpoint_slots": 2`, `"name": "a"`))))
	t.Cleanup(func() { DestroyPool(p) })
	prompt := tokens(checkpointPrompt, 500)
	a := must(AdmitTokens(p, "a", "a", prompt, 8, "", 0))
	if n := must(PrefillCheckpoint(a)); n != 20 {
		t.Fatalf("prefill checkpoint %d, want 20", n)
	}
	noErr(t, BeginPrefill(a))
	prefillTo(t, a, 20)
	writeCheckpointState(t, a, "a@20")
	noErr(t, CheckpointState(a, 20, cudaops.Ordering{}))
	noErr(t, CheckpointState(a, 20, cudaops.Ordering{Stream: cudaops.StreamLegacy})) // kept: one there already
	c := checkpointsOf(t, p)
	if c.Live != 1 || c.Taken != 1 || c.Existing != 1 || c.StateBytes != ckStateBytes || c.CopyNanos == 0 {
		t.Fatalf("after the checkpoint: %+v", c)
	}
	prefillTo(t, a, checkpointPrompt) // the state moves on; the checkpoint does not
	writeCheckpointState(t, a, "a@22")
	noErr(t, Release(a, cudaops.Ordering{}))
	noErr(t, Free(a))

	b := must(AdmitTokens(p, "b", "a", prompt, 8, "", 0))
	if n := must(HitTokens(b)); n != 20 {
		t.Fatalf("hit %d tokens, want 20", n)
	}
	if info := must(DescribeLease(b)); info.Written != 20 {
		t.Errorf("written %d after the restore, want 20", info.Written)
	}
	noErr(t, checkpointStateErr(b, "a@20"))
	c = checkpointsOf(t, p)
	if c.Hits != 1 || c.HitTokens != 20 || c.Misses != 0 || c.RestoreNanos == 0 {
		t.Errorf("after the hit: %+v", c)
	}
	noErr(t, Free(b))

	other := must(AdmitTokens(p, "other", "b", prompt, 8, "", 0))
	if n := must(HitTokens(other)); n != 0 {
		t.Errorf("another domain hit %d tokens", n)
	}
	noErr(t, Free(other))
	mustCheck(t, p)
}

// TestCheckpointRefusals: each bad checkpoint gets its own status and
// leaves the pool as it was, the stats JSON byte for byte (a refusal for
// lack of room counts a skip, nothing else).
func TestCheckpointRefusals(t *testing.T) {
	p := must(CreatePool([]byte(hybridJSONWith(`"checkpoint_slots": 2, "max_checkpoints": 2`, `"name": "a", "max_checkpoints": 1`))))
	t.Cleanup(func() { DestroyPool(p) })
	l := must(AdmitTokens(p, "l", "a", tokens(checkpointPrompt, 1), 8, "", 0))
	noErr(t, BeginPrefill(l))
	prefillTo(t, l, 8)
	unchanged := func(what string, err error, want Status, says string) {
		t.Helper()
		before := statsOf(t, p)
		wantStatus(t, err, want)
		if !strings.Contains(err.Error(), says) {
			t.Errorf("%s: %v, want it to say %q", what, err, says)
		}
		if after := statsOf(t, p); !bytes.Equal(before, after) {
			t.Errorf("%s changed the pool:\n%s\n%s", what, before, after)
		}
		mustCheck(t, p)
	}
	for _, c := range []struct {
		what   string
		tokens int64
		says   string
	}{
		{"not at a page boundary", 6, "not a positive multiple"},
		{"zero", 0, "not a positive multiple"},
		{"negative", -4, "not a positive multiple"},
		{"the most negative", math.MinInt64, "not a positive multiple"},
		{"beyond the written tokens", 12, "which has 8 written"},
		{"beyond the prompt", 24, "past lease"},
		{"the largest", math.MaxInt64, "past lease"},
	} {
		unchanged(c.what, CheckpointState(l, c.tokens, cudaops.Ordering{}), StatusInvalidArgument, c.says)
	}

	// The tenant's bound: its second checkpoint is refused and counted.
	noErr(t, CheckpointState(l, 8, cudaops.Ordering{}))
	prefillTo(t, l, 12)
	before := checkpointsOf(t, p)
	err := CheckpointState(l, 12, cudaops.Ordering{})
	wantStatus(t, err, StatusCheckpointCapacity)
	if !strings.Contains(err.Error(), "MaxCheckpoints is 1") {
		t.Errorf("over the tenant's bound: %v", err)
	}
	after := checkpointsOf(t, p)
	if after.CapacitySkips != before.CapacitySkips+1 {
		t.Errorf("skips %d, then %d", before.CapacitySkips, after.CapacitySkips)
	}
	after.CapacitySkips = before.CapacitySkips
	if after != before {
		t.Errorf("a refused checkpoint changed the figures: %+v, then %+v", before, after)
	}
	mustCheck(t, p)
	// The ABI-1 update changes the quota and keeps the bound; the JSON
	// update replaces it (0: the pool's, 2).
	noErr(t, UpdateTenantQuota(p, kvcache.TenantConfig{Name: "a", QuotaPages: 60}))
	wantStatus(t, CheckpointState(l, 12, cudaops.Ordering{}), StatusCheckpointCapacity)
	noErr(t, UpdateTenant(p, must(ParseTenant([]byte(`{"name": "a", "quota_pages": 60}`)))))
	noErr(t, CheckpointState(l, 12, cudaops.Ordering{}))
	// The pool's bound.
	m := must(AdmitTokens(p, "m", "b", tokens(checkpointPrompt, 2), 0, "", 0))
	prefillTo(t, m, 8)
	err = CheckpointState(m, 8, cudaops.Ordering{})
	wantStatus(t, err, StatusCheckpointCapacity)
	if !strings.Contains(err.Error(), "Prefix.MaxCheckpoints is 2") {
		t.Errorf("over the pool's bound: %v", err)
	}
	noErr(t, Free(m))

	// A window slid past the checkpoint's pages.
	prefillTo(t, l, 20)
	unchanged("the window slid past it", CheckpointState(l, 16, cudaops.Ordering{}), StatusInvalidArgument, "has moved past")
	// An exported lease takes no writes.
	prefillTo(t, l, checkpointPrompt)
	noErr(t, FinishPrefill(l))
	exp := must(Export(l, testKey, 8, 0))
	unchanged("an exported lease", CheckpointState(l, 20, cudaops.Ordering{}), StatusLeasePhase, "take no writes")
	noErr(t, FreeExport(exp))
	// A lease admitted without token IDs has nothing to publish under.
	n := must(Admit(p, "n", "b", checkpointPrompt, 0, 0))
	prefillTo(t, n, 8)
	unchanged("no token IDs", CheckpointState(n, 8, cudaops.Ordering{}), StatusInvalidArgument, "carries no prompt tokens")
	// A released lease, a freed one.
	noErr(t, Release(n, cudaops.Ordering{}))
	unchanged("a released lease", CheckpointState(n, 8, cudaops.Ordering{}), StatusLeaseReleased, "released")
	if at := must(PrefillCheckpoint(n)); at != 20 {
		t.Errorf("a released lease's prefill checkpoint %d, want 20", at)
	}
	noErr(t, Free(n))
	unchanged("a freed lease", CheckpointState(n, 8, cudaops.Ordering{}), StatusInvalidHandle, "not a live lease")
	_, err = PrefillCheckpoint(n)
	wantStatus(t, err, StatusInvalidHandle)
	unchanged("a pool's handle", CheckpointState(p, 8, cudaops.Ordering{}), StatusInvalidHandle, "not a live lease")
	noErr(t, Free(l))

	// A pool without window or state groups.
	q := newTestPool(t)
	g := must(AdmitTokens(q, "g", "a", tokens(40, 3), 0, "", 0))
	noErr(t, Commit(g, 32))
	if at := must(PrefillCheckpoint(g)); at != 0 {
		t.Errorf("prefill checkpoint %d in a pool of one group", at)
	}
	before2 := statsOf(t, q)
	wantStatus(t, CheckpointState(g, 16, cudaops.Ordering{}), StatusNoStateGroup)
	if !bytes.Equal(before2, statsOf(t, q)) {
		t.Error("a refused checkpoint changed a pool of one group")
	}
	noErr(t, Free(g))
	mustCheck(t, q)
	mustCheck(t, p)
}

// TestCheckpointConfigRefusals: each bad value of the checkpoint keys is
// refused with the config's (or the tenant's) status, naming its field.
func TestCheckpointConfigRefusals(t *testing.T) {
	geometryPool := strings.Replace(testPool, `"pages": 64`, `"pages": 64, "prefix": {"checkpoint_slots": 2}`, 1)
	for _, c := range []struct {
		js, says string
	}{
		{hybridJSONWith(`"max_checkpoints": -1`, `"name": "a"`), "Prefix.MaxCheckpoints = -1"},
		{hybridJSONWith(`"max_checkpoints": 16777217`, `"name": "a"`), "Prefix.MaxCheckpoints = 16777217"},
		{hybridJSONWith(`"checkpoint_slots": -1`, `"name": "a"`), "Prefix.CheckpointSlots = -1"},
		{hybridJSONWith(`"checkpoint_slots": 16777213`, `"name": "a"`), "Prefix.CheckpointSlots = 16777213, want 0..16777212"},
		{geometryPool, "Prefix.CheckpointSlots = 2, but the pool has no sliding-window or state group"},
		{hybridJSONWith(``, `"name": "a", "max_checkpoints": -1`), `tenant "a" MaxCheckpoints -1`},
		{hybridJSONWith(``, `"name": "a", "max_checkpoints": 16777217`), `tenant "a" MaxCheckpoints 16777217`},
		{hybridJSONWith(`"max_checkpoints": "2"`, `"name": "a"`), "prefix.max_checkpoints"},
		{hybridJSONWith(``, `"name": "a", "max_checkpoints": 1.5`), "tenants.max_checkpoints"},
	} {
		h, err := CreatePool([]byte(c.js))
		if h != 0 {
			DestroyPool(h)
		}
		wantStatus(t, err, StatusInvalidConfig)
		if !strings.Contains(err.Error(), c.says) {
			t.Errorf("%v, want it to say %q", err, c.says)
		}
	}
	p := must(CreatePool([]byte(hybridJSONWith(`"max_checkpoints": 4, "checkpoint_slots": 4`, `"name": "a", "max_checkpoints": 2`))))
	defer DestroyPool(p)
	before := statsOf(t, p)
	for _, c := range []struct {
		js, says string
	}{
		{`{"name": "c", "max_checkpoints": -1}`, `tenant "c" MaxCheckpoints -1`},
		{`{"name": "c", "max_checkpoints": "1"}`, "max_checkpoints"},
	} {
		tc, err := ParseTenant([]byte(c.js))
		if err == nil {
			err = AddTenant(p, tc)
		}
		wantStatus(t, err, StatusInvalidTenant)
		if !strings.Contains(err.Error(), c.says) {
			t.Errorf("%v, want it to say %q", err, c.says)
		}
		tc, err = ParseTenant([]byte(strings.Replace(c.js, `"c"`, `"a"`, 1)))
		if err == nil {
			err = UpdateTenant(p, tc)
		}
		wantStatus(t, err, StatusInvalidTenant)
	}
	if after := statsOf(t, p); !bytes.Equal(before, after) {
		t.Errorf("refused tenants changed the pool:\n%s\n%s", before, after)
	}
	mustCheck(t, p)
}
