package bridge

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// hybridJSON is a host pool of three cache groups: MLA-like per-token
// pages (208 bytes), a sliding window of 8 tokens (128-byte pages) and a
// state slot of 9,096 bytes, three ranges of UnitRangeAlign or less.
// shard is the cache's "shard" member, or "".
func hybridJSON(shard string) string {
	return `{"cache": {"model": "bridge-hybrid", ` + shard + ` "groups": [
	  {"name": "kv", "kind": "per_token", "tokens_per_page": 4, "regions": [
	    {"name": "l1.latent", "dtype": "bf16", "page_bytes": 128},
	    {"name": "l1.indexer", "dtype": "fp8_e4m3", "also_holds": ["fp32"], "page_bytes": 80}]},
	  {"name": "swa", "kind": "sliding_window", "tokens_per_page": 4, "window_tokens": 8, "regions": [
	    {"name": "l2.k", "dtype": "bf16", "page_bytes": 64}, {"name": "l2.v", "dtype": "bf16", "page_bytes": 64}]},
	  {"name": "state", "kind": "state", "regions": [
	    {"name": "l0.conv", "dtype": "bf16", "page_bytes": 96}, {"name": "l0.state", "dtype": "fp32", "page_bytes": 9000}]}]},
	 "max_leases": 4, "pages": 64, "max_context_tokens": 128, "scrub": {"kind": "poison"},
	 "tenants": [{"name": "a"}]}`
}

// hybridPrompt is 22 tokens: 6 per-token pages, the window's pages 3 to
// 5, one state slot: 10 units.
const hybridPrompt = 22

// stamp is what prefillHybrid writes into region r of logical page lp of
// group g of request id: every byte names all four.
func stamp(id string, g, lp, r, n int) []byte {
	b := make([]byte, n)
	tag := fmt.Sprintf("%s/%d/%d/%d;", id, g, lp, r)
	for i := range b {
		b[i] = tag[i%len(tag)] ^ byte(i/len(tag))
	}
	return b
}

var hybridGroups = []string{"kv", "swa", "state"}

// prefillHybrid admits id in pool, writes its prompt's cache in every
// group (each window slid to the prompt's end) and walks it to prefilled.
func prefillHybrid(t *testing.T, pool Handle, id string) Handle {
	t.Helper()
	l := must(Admit(pool, id, "a", hybridPrompt, 8, 0))
	noErr(t, BeginPrefill(l))
	noErr(t, Commit(l, hybridPrompt))
	must(SlideWindows(l, cudaops.Ordering{}))
	eachPage(t, l, func(g, lp, r int, lease *kvcache.Lease, index int, n int) {
		noErr(t, lease.WritePage(hybridGroups[g], index, r, stamp(id, g, lp, r, n)))
	})
	noErr(t, FinishPrefill(l))
	return l
}

// eachPage calls f for every region page of the prompt's units of lease
// h: group g, logical page lp, region r, and where the lease holds it.
func eachPage(t *testing.T, h Handle, f func(g, lp, r int, l *kvcache.Lease, index, n int)) {
	t.Helper()
	noErr(t, withLease(h, func(pe *poolEntry, l *kvcache.Lease) error {
		spec := pe.pool.Spec()
		for g, e := range spec.HandoffExtents(hybridPrompt) {
			first, _, err := l.GroupTable(e.Group, nil)
			if err != nil {
				return err
			}
			if first != e.First {
				return fmt.Errorf("group %q starts at logical page %d, the prompt's units at %d", e.Group, first, e.First)
			}
			for j := range e.Units {
				for r, reg := range spec.Groups[g].Regions {
					f(g, e.First+j, r, l, j, int(reg.PageBytes))
				}
			}
		}
		return nil
	}))
}

// verifyHybrid checks that lease h holds exactly what prefillHybrid wrote
// for id, in every group.
func verifyHybrid(t *testing.T, h Handle, id string) {
	t.Helper()
	eachPage(t, h, func(g, lp, r int, l *kvcache.Lease, index, n int) {
		got := make([]byte, n)
		noErr(t, l.ReadPage(hybridGroups[g], index, r, got))
		if !bytes.Equal(got, stamp(id, g, lp, r, n)) {
			t.Errorf("group %q logical page %d region %d does not hold the prefill's bytes", hybridGroups[g], lp, r)
		}
	})
}

type hybridTransfer struct {
	src, dst, lease, exp, imp Handle
	x                         Extents
}

// newHybridTransfer exports a prefilled hybrid prompt of src and begins
// its import into dst.
func newHybridTransfer(t *testing.T, id string) hybridTransfer {
	t.Helper()
	tr := hybridTransfer{src: must(CreatePool([]byte(hybridJSON("")))), dst: must(CreatePool([]byte(hybridJSON(""))))}
	recv := must(CreateReceiver(tr.dst, testKey, nil))
	tr.lease = prefillHybrid(t, tr.src, id)
	tr.exp = must(Export(tr.lease, testKey, 8, 0))
	tr.imp = must(BeginImport(recv, manifestOf(t, tr.exp)))
	tr.x = must(ExportExtents(tr.exp))
	t.Cleanup(func() {
		FreeImport(tr.imp)
		DestroyReceiver(recv)
		FreeExport(tr.exp)
		Free(tr.lease)
		DestroyPool(tr.src)
		DestroyPool(tr.dst)
	})
	return tr
}

func manifestOf(t *testing.T, exp Handle) []byte {
	t.Helper()
	n, _ := ExportManifest(exp, nil)
	m := make([]byte, n)
	must(ExportManifest(exp, m))
	return m
}

// TestHybridExtents: both sides describe the same units, group by group,
// with the totals, and the page calls' transfer is the per-token group.
func TestHybridExtents(t *testing.T) {
	tr := newHybridTransfer(t, "extents")
	want := Extents{Units: 10, Bytes: 6*208 + 3*128 + 9096, Groups: []Extent{
		{Group: "kv", Kind: GroupPerToken, FirstUnit: 0, FirstPage: 0, Units: 6, UnitBytes: 208},
		{Group: "swa", Kind: GroupSlidingWindow, FirstUnit: 6, FirstPage: 3, Units: 3, UnitBytes: 128},
		{Group: "state", Kind: GroupState, FirstUnit: 9, FirstPage: 0, Units: 1, UnitBytes: 9096},
	}}
	for name, x := range map[string]Extents{"export": tr.x, "import": must(ImportExtents(tr.imp))} {
		if fmt.Sprint(x) != fmt.Sprint(want) {
			t.Errorf("%s extents\n%+v, want\n%+v", name, x, want)
		}
	}
	if info := must(DescribeExport(tr.exp)); info.Pages != 6 || info.PageBytes != 208 {
		t.Errorf("describe: %d pages of %d bytes, want the per-token group's 6 of 208", info.Pages, info.PageBytes)
	}
	_, err := ExportExtents(tr.imp)
	wantStatus(t, err, StatusInvalidHandle)
	_, err = ImportExtents(tr.exp)
	wantStatus(t, err, StatusInvalidHandle)
}

// TestHybridHandoffThroughBridge: every group crosses, the per-token
// pages through the page call, the window's units in one run, the state
// slot in ranges; the decode lease holds exactly the prefill's bytes in
// every group, its window where the prompt's is, and both pools end
// clean.
func TestHybridHandoffThroughBridge(t *testing.T) {
	tr := newHybridTransfer(t, "whole")
	buf := make([]byte, tr.x.Bytes)
	// The prefill side reads every unit in one run, across the groups...
	noErr(t, ExportReadUnits(tr.exp, 0, buf))
	// ... and the state slot again in ranges of any size, which agree.
	state := tr.x.Groups[2]
	at := tr.x.Bytes - state.UnitBytes
	part := make([]byte, 1000)
	for off := int64(0); off < state.UnitBytes; off += int64(len(part)) {
		p := part[:min(int64(len(part)), state.UnitBytes-off)]
		noErr(t, ExportReadUnitRange(tr.exp, state.FirstUnit, off, p))
		if !bytes.Equal(p, buf[at+off:at+off+int64(len(p))]) {
			t.Fatalf("range at %d of the state slot differs from the whole unit's read", off)
		}
	}
	// The decode side: the pages with the page call, the window's units
	// as a run, the slot in ranges of UnitRangeAlign.
	kv, swa := tr.x.Groups[0], tr.x.Groups[1]
	noErr(t, ImportWritePages(tr.imp, 0, buf[:kv.Units*kv.UnitBytes]))
	noErr(t, ImportWriteUnits(tr.imp, swa.FirstUnit, buf[kv.Units*kv.UnitBytes:at]))
	for off := int64(0); off < state.UnitBytes; off += kvcache.UnitRangeAlign {
		end := min(off+kvcache.UnitRangeAlign, state.UnitBytes)
		noErr(t, ImportWriteUnitRange(tr.imp, state.FirstUnit, off, buf[at+off:at+end]))
	}
	dl := must(CompleteImport(tr.imp))
	verifyHybrid(t, dl, "whole")
	if first, _ := groupFirst(t, dl, "swa"); first != swa.FirstPage {
		t.Errorf("the decode lease's window starts at logical page %d, the prompt's at %d", first, swa.FirstPage)
	}
	noErr(t, ExportAck(tr.exp))
	noErr(t, Free(dl))
	noErr(t, Free(tr.lease))
	mustCheck(t, tr.src)
	mustCheck(t, tr.dst)
	for _, p := range []Handle{tr.src, tr.dst} {
		if n := inUse(t, p); n != 0 {
			t.Errorf("pool %#x has %d pages (slots) in use after the handoff", p, n)
		}
	}
}

// inUse is the pages (slots) pool h has in use, in every group.
func inUse(t *testing.T, h Handle) int {
	t.Helper()
	pe, err := lookupPool(h)
	noErr(t, err)
	n := 0
	for _, g := range pe.pool.Stats().Groups {
		n += g.InUse
	}
	return n
}

func groupFirst(t *testing.T, l Handle, group string) (int64, int) {
	t.Helper()
	table := make([]int32, 16)
	n, first, err := GroupTable(l, group, table)
	noErr(t, err)
	return int64(first), n
}

// TestHybridImportByPagesIsIncomplete: the page calls alone move the
// per-token group; completing then is refused as incomplete, naming the
// window, and scrubs every group.
func TestHybridImportByPagesIsIncomplete(t *testing.T) {
	tr := newHybridTransfer(t, "pages-only")
	info := must(DescribeExport(tr.exp))
	pages := make([]byte, info.Pages*info.PageBytes)
	noErr(t, ExportReadPages(tr.exp, 0, pages))
	noErr(t, ImportWritePages(tr.imp, 0, pages))
	_, err := CompleteImport(tr.imp)
	wantStatus(t, err, StatusIncompleteTransfer)
	if !strings.Contains(err.Error(), `cache group "swa": 0 of 3`) {
		t.Errorf("incomplete import names %v, want the window group", err)
	}
	if must(DescribeImport(tr.imp)).Live {
		t.Error("the incomplete import is still live")
	}
	mustCheck(t, tr.dst)
	if n := inUse(t, tr.dst); n != 0 {
		t.Errorf("the refused import holds %d pages (slots)", n)
	}

	// Every unit but the state slot: incomplete, naming the state group.
	tr = newHybridTransfer(t, "no-state")
	buf := make([]byte, tr.x.Bytes-tr.x.Groups[2].UnitBytes)
	noErr(t, ExportReadUnits(tr.exp, 0, buf))
	noErr(t, ImportWriteUnits(tr.imp, 0, buf))
	_, err = CompleteImport(tr.imp)
	wantStatus(t, err, StatusIncompleteTransfer)
	if !strings.Contains(err.Error(), `cache group "state": 0 of 1`) {
		t.Errorf("incomplete import names %v, want the state group", err)
	}
	mustCheck(t, tr.dst)
}

// TestUnitRanges: runs and ranges a transfer does not have, however large
// or negative, are refused with ErrInvalidArgument naming the numbers
// before the export or import is touched: nothing copied or written,
// both live.
func TestUnitRanges(t *testing.T) {
	tr := newHybridTransfer(t, "ranges")
	total, sb := tr.x.Units, tr.x.Groups[2].UnitBytes
	for _, c := range []struct {
		first int64
		n     int64
	}{
		{math.MaxInt64, 208},
		{math.MinInt64, 208},
		{-1, 208},
		{total, 128},
		{0, 0},
		{0, 207},
		{0, 209},
		{5, 208 + 64},     // ends inside the window's first unit
		{5, 208 + 128},    // a run across two groups: fine, so checked below
		{8, 128 + sb + 1}, // one byte past the end
		{9, sb - 1},
		{0, tr.x.Bytes + 208},
	} {
		if c.first == 5 && c.n == 208+128 {
			continue
		}
		buf := bytes.Repeat([]byte{0xA5}, int(c.n))
		for _, op := range []struct {
			name string
			f    func() error
		}{
			{"read", func() error { return ExportReadUnits(tr.exp, c.first, buf) }},
			{"write", func() error { return ImportWriteUnits(tr.imp, c.first, buf) }},
		} {
			err := op.f()
			wantStatus(t, err, StatusInvalidArgument)
			for _, num := range []string{fmt.Sprint(c.first), fmt.Sprint(c.n)} {
				if !strings.Contains(err.Error(), num) {
					t.Errorf("%s units %d+%d: message %q does not name %s", op.name, c.first, c.n, err, num)
				}
			}
		}
		if !bytes.Equal(buf, bytes.Repeat([]byte{0xA5}, int(c.n))) {
			t.Errorf("a refused read of units %d+%d wrote into the buffer", c.first, c.n)
		}
	}
	for _, c := range []struct {
		unit, off, n int64
		write        bool // refused for a write only
	}{
		{math.MaxInt64, 0, 1, false},
		{-1, 0, 1, false},
		{total, 0, 1, false},
		{9, -1, 1, false},
		{9, math.MinInt64, 1, false},
		{9, math.MaxInt64, 1, false},
		{9, 0, 0, false},
		{9, 0, sb + 1, false},
		{9, sb, 1, false},
		{9, 4096, sb - 4095, false},
		{0, 200, 9, false},
		{9, 100, 4096, true},      // not at a multiple of 4096
		{9, 0, 4000, true},        // short of a multiple, not the unit's end
		{9, 4096, 4096 + 1, true}, // neither
	} {
		buf := bytes.Repeat([]byte{0x5A}, int(c.n))
		ops := []struct {
			name string
			f    func() error
		}{{"write", func() error { return ImportWriteUnitRange(tr.imp, c.unit, c.off, buf) }}}
		if !c.write {
			ops = append(ops, struct {
				name string
				f    func() error
			}{"read", func() error { return ExportReadUnitRange(tr.exp, c.unit, c.off, buf) }})
		} else {
			noErr(t, ExportReadUnitRange(tr.exp, c.unit, c.off, buf)) // any range reads
		}
		for _, op := range ops {
			err := op.f()
			wantStatus(t, err, StatusInvalidArgument)
			for _, num := range []string{fmt.Sprint(c.unit), fmt.Sprint(c.off), fmt.Sprint(c.n)} {
				if !strings.Contains(err.Error(), num) {
					t.Errorf("%s unit %d at %d+%d: message %q does not name %s", op.name, c.unit, c.off, c.n, err, num)
				}
			}
		}
		if !c.write && !bytes.Equal(buf, bytes.Repeat([]byte{0x5A}, int(c.n))) {
			t.Errorf("a refused range read of unit %d at %d+%d wrote into the buffer", c.unit, c.off, c.n)
		}
	}
	if !must(DescribeExport(tr.exp)).Live || !must(DescribeImport(tr.imp)).Live {
		t.Fatal("a refused run or range ended the export or the import")
	}
	// Both still work: a run across groups, then the rest, and it completes.
	buf := make([]byte, tr.x.Bytes)
	noErr(t, ExportReadUnits(tr.exp, 0, buf))
	noErr(t, ImportWriteUnits(tr.imp, 5, buf[5*208:6*208+128]))
	noErr(t, ImportWriteUnits(tr.imp, 0, buf[:5*208]))
	noErr(t, ImportWriteUnits(tr.imp, 7, buf[6*208+128:]))
	dl := must(CompleteImport(tr.imp))
	verifyHybrid(t, dl, "ranges")
	noErr(t, Free(dl))
	mustCheck(t, tr.dst)
}

// TestUnitRangeFaults: what depends on the import's state is the
// transfer's fault and ends the import: a range out of order, a range of
// a unit received whole, a unit twice. Each leaves the decode pool clean,
// and the request may be imported again.
func TestUnitRangeFaults(t *testing.T) {
	for _, c := range []struct {
		name  string
		steps func(tr hybridTransfer, buf []byte) error
		want  Status
		has   string
	}{
		{"a range before the first", func(tr hybridTransfer, buf []byte) error {
			return ImportWriteUnitRange(tr.imp, 9, 4096, slot(tr, buf)[4096:8192])
		}, StatusInvalidArgument, "in order"},
		{"a range skipped", func(tr hybridTransfer, buf []byte) error {
			noErr(t, ImportWriteUnitRange(tr.imp, 9, 0, slot(tr, buf)[:4096]))
			return ImportWriteUnitRange(tr.imp, 9, 8192, slot(tr, buf)[8192:])
		}, StatusInvalidArgument, "in order"},
		{"a range twice", func(tr hybridTransfer, buf []byte) error {
			noErr(t, ImportWriteUnitRange(tr.imp, 9, 0, slot(tr, buf)[:4096]))
			return ImportWriteUnitRange(tr.imp, 9, 0, slot(tr, buf)[:4096])
		}, StatusInvalidArgument, "in order"},
		{"a range of a unit received whole", func(tr hybridTransfer, buf []byte) error {
			noErr(t, ImportWriteUnits(tr.imp, 9, slot(tr, buf)))
			return ImportWriteUnitRange(tr.imp, 9, 0, slot(tr, buf)[:4096])
		}, StatusDuplicatePage, "received already"},
		{"a unit twice", func(tr hybridTransfer, buf []byte) error {
			noErr(t, ImportWriteUnits(tr.imp, 6, buf[6*208:6*208+128]))
			return ImportWriteUnits(tr.imp, 6, buf[6*208:6*208+128])
		}, StatusDuplicatePage, "unit 6"},
		{"a unit received in ranges, then whole", func(tr hybridTransfer, buf []byte) error {
			noErr(t, ImportWriteUnitRange(tr.imp, 9, 0, slot(tr, buf)[:4096]))
			return ImportWriteUnits(tr.imp, 9, slot(tr, buf))
		}, StatusDuplicatePage, "unit 9"},
	} {
		t.Run(c.name, func(t *testing.T) {
			tr := newHybridTransfer(t, "fault")
			buf := make([]byte, tr.x.Bytes)
			noErr(t, ExportReadUnits(tr.exp, 0, buf))
			err := c.steps(tr, buf)
			wantStatus(t, err, c.want)
			if !strings.Contains(err.Error(), c.has) {
				t.Errorf("%v does not say %q", err, c.has)
			}
			if must(DescribeImport(tr.imp)).Live {
				t.Fatal("the import outlived the fault")
			}
			mustCheck(t, tr.dst)
			if n := inUse(t, tr.dst); n != 0 {
				t.Errorf("the aborted import holds %d pages (slots)", n)
			}
			// Imported again, whole: it completes.
			recv := must(CreateReceiver(tr.dst, testKey, nil))
			defer DestroyReceiver(recv)
			imp := must(BeginImport(recv, manifestOf(t, tr.exp)))
			defer FreeImport(imp)
			noErr(t, ImportWriteUnits(imp, 0, buf))
			dl := must(CompleteImport(imp))
			verifyHybrid(t, dl, "fault")
			noErr(t, Free(dl))
		})
	}
}

// slot is the state slot's bytes in a buffer of every unit.
func slot(tr hybridTransfer, buf []byte) []byte { return buf[tr.x.Bytes-tr.x.Groups[2].UnitBytes:] }

// TestHybridMismatch: a decode pool of another spec (by one region's
// size) refuses the manifest naming the difference, one of another shard
// names the shards; neither admits anything.
func TestHybridMismatch(t *testing.T) {
	sharded := func(rank int) string { return fmt.Sprintf(`"shard": {"rank": %d, "size": 2},`, rank) }
	src := must(CreatePool([]byte(hybridJSON(sharded(0)))))
	defer DestroyPool(src)
	l := prefillHybrid(t, src, "mismatch")
	defer Free(l)
	exp := must(Export(l, testKey, 8, 0))
	defer FreeExport(exp)
	m := manifestOf(t, exp)
	for _, c := range []struct {
		name, config string
		want         Status
		has          []string
	}{
		{"another shard", hybridJSON(sharded(1)), StatusShardMismatch, []string{"rank 0 of 2", "rank 1 of 2"}},
		{"unsharded", hybridJSON(""), StatusShardMismatch, []string{"rank 0 of 2", "unsharded"}},
		{"another region size", strings.Replace(hybridJSON(sharded(0)), `"page_bytes": 9000`, `"page_bytes": 8996`, 1),
			StatusGeometryMismatch, []string{"9000", "8996"}},
		{"the same", hybridJSON(sharded(0)), OK, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			dst := must(CreatePool([]byte(c.config)))
			defer DestroyPool(dst)
			recv := must(CreateReceiver(dst, testKey, nil))
			defer DestroyReceiver(recv)
			imp, err := BeginImport(recv, m)
			if c.want == OK {
				noErr(t, err)
				noErr(t, FreeImport(imp))
				return
			}
			wantStatus(t, err, c.want)
			for _, s := range c.has {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("%v does not name %q", err, s)
				}
			}
			mustCheck(t, dst)
			if n := inUse(t, dst); n != 0 {
				t.Errorf("a refused manifest admitted %d pages (slots)", n)
			}
		})
	}
}

// TestParseShard: the cache's "shard" is a rank of a size, both given;
// anything else is refused naming the field, before a pool exists.
func TestParseShard(t *testing.T) {
	for _, c := range []struct {
		shard   string
		want    kvcache.Shard
		wantErr string
	}{
		{``, kvcache.Shard{}, ""},
		{`"shard": null,`, kvcache.Shard{}, ""},
		{`"shard": {"rank": 0, "size": 1},`, kvcache.Shard{Rank: 0, Size: 1}, ""},
		{`"shard": {"rank": 3, "size": 8},`, kvcache.Shard{Rank: 3, Size: 8}, ""},
		{`"shard": {},`, kvcache.Shard{}, "cache.shard: size missing"},
		{`"shard": {"rank": 1},`, kvcache.Shard{}, "cache.shard: size missing"},
		{`"shard": {"size": 4},`, kvcache.Shard{}, "cache.shard: rank missing"},
		{`"shard": {"rank": 0, "size": 0},`, kvcache.Shard{}, "cache.shard: size 0"},
		{`"shard": {"rank": 0, "size": -2},`, kvcache.Shard{}, "cache.shard: size -2"},
		{`"shard": {"rank": 4, "size": 4},`, kvcache.Shard{}, "cache.shard: rank 4 of size 4, want 0 to 3"},
		{`"shard": {"rank": -1, "size": 4},`, kvcache.Shard{}, "cache.shard: rank -1 of size 4"},
		{`"shard": {"rank": 0, "size": 4, "heads": 2},`, kvcache.Shard{}, `unknown field "heads"`},
		{`"shard": {"rank": "0", "size": 4},`, kvcache.Shard{}, "config JSON"},
		{`"shard": [0, 4],`, kvcache.Shard{}, "config JSON"},
		{`"shard": {"rank": 0, "size": 99999999999999999999},`, kvcache.Shard{}, "config JSON"},
	} {
		t.Run(c.shard, func(t *testing.T) {
			cfg, err := ParseConfig([]byte(hybridJSON(c.shard)))
			if c.wantErr != "" {
				if !errors.Is(err, kvcache.ErrInvalidConfig) || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("err = %v, want ErrInvalidConfig containing %q", err, c.wantErr)
				}
				_, err := CreatePool([]byte(hybridJSON(c.shard)))
				wantStatus(t, err, StatusInvalidConfig)
				return
			}
			noErr(t, err)
			if cfg.Cache.Shard != c.want {
				t.Fatalf("shard %+v, want %+v", cfg.Cache.Shard, c.want)
			}
			p := must(CreatePool([]byte(hybridJSON(c.shard))))
			noErr(t, DestroyPool(p))
		})
	}
	// Beyond kvcache's bound: kvcache.New's own error, through the C
	// status of a config.
	_, err := CreatePool([]byte(hybridJSON(`"shard": {"rank": 0, "size": 1000000},`)))
	wantStatus(t, err, StatusInvalidConfig)
	if err == nil || !strings.Contains(err.Error(), "shard rank 0 of 1000000") {
		t.Errorf("oversized shard: %v", err)
	}
}
