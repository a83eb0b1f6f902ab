package bench

import (
	"testing"

	"github.com/kvfence/kvfence/bench/internal/kvsim"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// The benchmarks' result checks can fail: each passes on the operation
// done right and fails when it was not done. A benchmark that only times
// an operation reports a figure for whatever happened, a fill that wrote
// nothing included.

func TestFillCheckCatchesSkippedFill(t *testing.T) {
	g := tinyGeometry
	dev := cudaops.NewHost()
	t.Cleanup(func() { dev.Close() })
	for range g.Regions() {
		if _, err := dev.AllocRegion(8, g.RegionPageBytes()); err != nil {
			t.Fatal(err)
		}
	}
	pages := []int32{1, 2, 6}
	canary := cudaops.FillSpec{Word: 0x5ca1ab1e, PageSalt: 0x9e3779b1, ClearMask: 0x40004000}
	for _, tt := range []struct {
		name string
		dev  cudaops.Device
		ok   bool
	}{
		{"host", dev, true},
		{"fills skipped", kvsim.UnsafeNoScrub(dev), false},
	} {
		for _, spec := range []cudaops.FillSpec{{}, canary} {
			dirtyPages(t, dev, g, pages)
			f, err := tt.dev.Fill(pages, spec, cudaops.Ordering{})
			if err != nil {
				t.Fatal(err)
			}
			if err := f.Wait(); err != nil {
				t.Fatal(err)
			}
			err = checkFilled(dev, g, pages, spec)
			if tt.ok && err != nil {
				t.Errorf("%s, word %#x: %v", tt.name, spec.Word, err)
			}
			if !tt.ok && err == nil {
				t.Errorf("%s, word %#x: check passed pages that were not filled", tt.name, spec.Word)
			}
		}
	}
}

func TestStormCheckCatchesSkippedScrub(t *testing.T) {
	leases := make([]kvcache.Lease, 3)
	safeDev, unsafeDev := cudaops.NewHost(), kvsim.UnsafeNoScrub(cudaops.NewHost())
	safe := newPool(t, tinyGeometry, 16, safeDev)
	unsafe := newPool(t, tinyGeometry, 16, unsafeDev)
	if err := checkStorm(t, safe, safeDev, leases, true); err != nil {
		t.Errorf("safe pool: %v", err)
	}
	if err := checkStorm(t, unsafe, unsafeDev, leases, true); err == nil {
		t.Error("the check passed a pool whose releases scrub nothing as scrubbed")
	}
	if err := checkStorm(t, unsafe, unsafeDev, leases, false); err != nil {
		t.Errorf("unsafe pool: %v", err)
	}
	if err := checkStorm(t, safe, safeDev, leases, false); err == nil {
		t.Error("the check passed a scrubbing pool as the no-fill baseline")
	}
}

func TestAdmittedCheckCatchesMissingAdmissions(t *testing.T) {
	p := newPool(t, tinyGeometry, 64, nil)
	fill(t, p, 2)
	before := p.Stats()
	var l kvcache.Lease
	req := kvcache.Request{ID: "x", Tenant: "b", PromptTokens: 48, MaxNewTokens: 16}
	for range 3 {
		if err := p.TryAdmitInto(req, &l); err != nil {
			t.Fatal(err)
		}
		if err := l.Release(); err != nil {
			t.Fatal(err)
		}
	}
	if err := checkAdmitted(p, before, 3, 2); err != nil {
		t.Error(err)
	}
	if err := checkAdmitted(p, before, 4, 2); err == nil {
		t.Error("the check passed 3 admissions for 4")
	}
	if err := p.TryAdmitInto(req, &l); err != nil { // not released
		t.Fatal(err)
	}
	if err := checkAdmitted(p, before, 4, 2); err == nil {
		t.Error("the check passed a lease left live")
	}
}

func TestReplayCheckCatchesMiscount(t *testing.T) {
	tr := &kvsim.Trace{Requests: make([]kvsim.Request, 10)}
	good := func() *kvsim.RunResult {
		r := &kvsim.RunResult{Admitted: 8, Dropped: map[string]uint64{"queue_timeout": 2}}
		r.Prefix.HitPages, r.Prefix.ServedBound.HitPages = 5, 7
		return r
	}
	if err := checkReplay(tr, good(), false); err != nil {
		t.Error(err)
	}
	for name, bad := range map[string]func(*kvsim.RunResult){
		"a request lost":           func(r *kvsim.RunResult) { r.Dropped["queue_timeout"] = 1 },
		"no hits":                  func(r *kvsim.RunResult) { r.Prefix.HitPages = 0 },
		"more hits than the bound": func(r *kvsim.RunResult) { r.Prefix.HitPages = 8 },
	} {
		r := good()
		bad(r)
		if err := checkReplay(tr, r, false); err == nil {
			t.Errorf("%s: the check passed", name)
		}
	}
	if err := checkReplay(tr, good(), true); err == nil {
		t.Error("the check passed dropped requests on a pool that must admit all")
	}
	all := good()
	all.Admitted, all.Dropped = 10, map[string]uint64{}
	if err := checkReplay(tr, all, false); err == nil {
		t.Error("the check passed a too-small pool that dropped nothing")
	}
}
