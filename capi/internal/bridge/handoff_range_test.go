package bridge

import (
	"bytes"
	"fmt"
	"math"
	"strings"
	"testing"
)

// transfer is an export of a 40-token prompt (3 pages) and its import,
// begun but not written.
type transfer struct {
	src, dst  Handle
	lease     Handle
	exp, imp  Handle
	pageBytes int64
	pages     int64
}

func newTransfer(t *testing.T) transfer {
	t.Helper()
	tr := transfer{src: newTestPool(t), dst: newTestPool(t)}
	recv := must(CreateReceiver(tr.dst, testKey, nil))
	t.Cleanup(func() { DestroyReceiver(recv) })
	tr.lease = must(Admit(tr.src, "range", "a", 40, 0, 0))
	prefill(t, tr.lease, 40)
	tr.exp = must(Export(tr.lease, testKey, 8, 0))
	n, _ := ExportManifest(tr.exp, nil)
	m := make([]byte, n)
	must(ExportManifest(tr.exp, m))
	tr.imp = must(BeginImport(recv, m))
	info := must(DescribeImport(tr.imp))
	tr.pageBytes, tr.pages = info.PageBytes, info.Pages
	t.Cleanup(func() {
		FreeImport(tr.imp)
		FreeExport(tr.exp)
		Free(tr.lease)
	})
	return tr
}

// TestPageRanges: page ranges that are absurd or merely wrong are refused
// with ErrInvalidArgument naming the numbers, before the export or import
// is touched: nothing is copied or written, and both stay usable.
func TestPageRanges(t *testing.T) {
	tr := newTransfer(t)
	pb, pages := int(tr.pageBytes), tr.pages
	for _, c := range []struct {
		first int64
		bytes int
	}{
		{math.MaxInt64, pb},
		{math.MaxInt64 - 1, 2 * pb},
		{math.MaxInt64, 3 * pb},
		{math.MinInt64, pb},
		{math.MinInt64 + 1, 3 * pb},
		{-1, pb},
		{-1, 2 * pb},
		{pages, pb},         // one past the end
		{pages - 1, 2 * pb}, // ends one past
		{1 << 32, pb},
		{0, 4 * pb},
		{0, 0},
		{0, pb - 1},
		{0, pb + 1},
		{1, 1},
	} {
		t.Run(fmt.Sprint(c.first, "+", c.bytes), func(t *testing.T) {
			buf := bytes.Repeat([]byte{0xA5}, c.bytes)
			for _, op := range []struct {
				name string
				f    func() error
			}{
				{"read", func() error { return ExportReadPages(tr.exp, c.first, buf) }},
				{"write", func() error { return ImportWritePages(tr.imp, c.first, buf) }},
			} {
				err := op.f()
				wantStatus(t, err, StatusInvalidArgument)
				for _, num := range []string{fmt.Sprint(c.first), fmt.Sprint(c.bytes)} {
					if !strings.Contains(err.Error(), num) {
						t.Errorf("%s: message %q does not name %s", op.name, err, num)
					}
				}
			}
			if !bytes.Equal(buf, bytes.Repeat([]byte{0xA5}, c.bytes)) {
				t.Error("a refused read wrote into the buffer")
			}
			if !must(DescribeExport(tr.exp)).Live || !must(DescribeImport(tr.imp)).Live {
				t.Fatal("a refused range ended the export or the import")
			}
		})
	}
	// Both still work: the pages move and the import completes.
	pagesBuf := make([]byte, pages*tr.pageBytes)
	noErr(t, ExportReadPages(tr.exp, 0, pagesBuf))
	noErr(t, ImportWritePages(tr.imp, 0, pagesBuf[:pb]))
	noErr(t, ImportWritePages(tr.imp, 1, pagesBuf[pb:]))
	dl := must(CompleteImport(tr.imp))
	noErr(t, ExportAck(tr.exp))
	noErr(t, Free(dl))
	mustCheck(t, tr.src)
	mustCheck(t, tr.dst)
}
