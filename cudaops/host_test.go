package cudaops

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func wordBytes(w uint32, n int64) []byte {
	b := make([]byte, n)
	for i := int64(0); i < n; i += 4 {
		binary.LittleEndian.PutUint32(b[i:], w)
	}
	return b
}

func TestHostFillCoversEveryRegionAndOnlyTheBatch(t *testing.T) {
	h := NewHost()
	defer h.Close()
	const pages = 10
	_, err := h.AllocRegion(pages, 64)
	require.NoError(t, err)
	// An adopted region with a gap between pages: the gap must stay untouched.
	backing := bytes.Repeat([]byte{0xee}, pages*96)
	_, err = h.AdoptRegion(backing, pages, 96, 32)
	require.NoError(t, err)
	for r, reg := range h.Regions() {
		for p := range int32(pages) {
			require.NoError(t, h.WritePage(r, p, bytes.Repeat([]byte{0xaa}, int(reg.PageBytes))))
		}
	}
	batch := []int32{1, 2, 3, 7, 5}
	spec := FillSpec{Word: 0x12345678, PageSalt: 0x9e3779b1, ClearMask: 0x40004000}
	f, err := h.Fill(batch, spec, Ordering{Stream: 1})
	require.NoError(t, err)
	require.NoError(t, f.Wait())
	for r, reg := range h.Regions() {
		for p := range int32(pages) {
			got := h.PageBytes(r, p)
			if slices.Contains(batch, p) {
				assert.Equal(t, wordBytes(spec.WordFor(p), reg.PageBytes), got, "region %d page %d", r, p)
			} else {
				assert.Equal(t, bytes.Repeat([]byte{0xaa}, int(reg.PageBytes)), got, "region %d page %d untouched", r, p)
			}
		}
	}
	for p := range pages {
		assert.Equal(t, bytes.Repeat([]byte{0xee}, 64), backing[p*96+32:p*96+96], "gap after page %d untouched", p)
	}
	c := h.Counters()
	assert.Equal(t, uint64(1), c.FillCalls)
	assert.Equal(t, uint64(1), c.Launches, "one batch, one pass")
	assert.Equal(t, uint64(len(batch)), c.PagesFilled)
	assert.Equal(t, uint64(len(batch)*(64+32)), c.BytesFilled)
}

func TestHostRejectsBadInputAndWritesNothing(t *testing.T) {
	h := NewHost()
	_, err := h.AllocRegion(4, 16)
	require.NoError(t, err)
	require.NoError(t, h.WritePage(0, 1, bytes.Repeat([]byte{1}, 16)))

	_, err = h.Fill([]int32{0, 1, 4}, FillSpec{}, Ordering{})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = h.Fill([]int32{-1}, FillSpec{}, Ordering{})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	assert.Equal(t, bytes.Repeat([]byte{1}, 16), h.PageBytes(0, 1), "a refused fill wrote")

	for _, tc := range []struct {
		name string
		err  error
	}{
		{"read bad region", h.ReadPage(1, 0, make([]byte, 16))},
		{"read bad page", h.ReadPage(0, 4, make([]byte, 16))},
		{"read short buffer", h.ReadPage(0, 0, make([]byte, 15))},
		{"write long buffer", h.WritePage(0, 0, make([]byte, 17))},
	} {
		assert.ErrorIs(t, tc.err, ErrInvalidArgument, tc.name)
	}
	for _, r := range []struct {
		pages            int
		stride, pageSize int64
	}{{0, 16, 16}, {4, 16, 6}, {4, 8, 16}, {4, 18, 16}, {-1, 4, 4}} {
		_, err := h.AdoptRegion(make([]byte, 1024), r.pages, r.stride, r.pageSize)
		assert.ErrorIs(t, err, ErrInvalidArgument, "%+v", r)
	}
	_, err = h.AdoptRegion(make([]byte, 10), 4, 4, 4)
	assert.ErrorIs(t, err, ErrInvalidArgument, "buffer too short")
	assert.Len(t, h.Regions(), 1, "refused regions were added")

	require.NoError(t, h.Close())
	_, err = h.Fill([]int32{0}, FillSpec{}, Ordering{})
	assert.ErrorIs(t, err, ErrClosed)
	_, err = h.AllocRegion(1, 4)
	assert.ErrorIs(t, err, ErrClosed)
	assert.ErrorIs(t, h.ReadPage(0, 0, make([]byte, 16)), ErrClosed)
	require.NoError(t, h.Close(), "second close")
}

func TestCompletedFence(t *testing.T) {
	done, err := Completed(nil).Done()
	assert.True(t, done)
	assert.NoError(t, err)
	boom := fmt.Errorf("boom")
	assert.Equal(t, boom, Completed(boom).Wait())
}

func TestHostWritePagePart(t *testing.T) {
	h := NewHost()
	_, err := h.AllocRegion(3, 16)
	require.NoError(t, err)
	require.NoError(t, h.WritePage(0, 1, bytes.Repeat([]byte{1}, 16)))

	require.NoError(t, h.WritePagePart(0, 1, 4, []byte{7, 8, 9}))
	require.NoError(t, h.WritePagePart(0, 1, 13, []byte{5, 5, 5}), "a part that ends the page")
	require.NoError(t, h.WritePagePart(0, 1, 16, nil), "an empty part at the end")
	want := []byte{1, 1, 1, 1, 7, 8, 9, 1, 1, 1, 1, 1, 1, 5, 5, 5}
	assert.Equal(t, want, h.PageBytes(0, 1))
	page2 := make([]byte, 16)
	require.NoError(t, h.ReadPage(0, 2, page2))

	for name, err := range map[string]error{
		"past the end":    h.WritePagePart(0, 1, 14, []byte{1, 2, 3}),
		"negative offset": h.WritePagePart(0, 1, -1, []byte{1}),
		"offset past end": h.WritePagePart(0, 1, 17, nil),
		"bad region":      h.WritePagePart(1, 0, 0, []byte{1}),
		"bad page":        h.WritePagePart(0, 3, 0, []byte{1}),
	} {
		assert.ErrorIs(t, err, ErrInvalidArgument, name)
	}
	assert.Equal(t, want, h.PageBytes(0, 1), "a refused part wrote")
	after := make([]byte, 16)
	require.NoError(t, h.ReadPage(0, 2, after))
	assert.Equal(t, page2, after, "a write spilled into the next page")

	require.NoError(t, h.Close())
	assert.ErrorIs(t, h.WritePagePart(0, 1, 0, []byte{1}), ErrClosed)
}

// An asynchronous fill that is still running when Close is called must
// finish before Close returns: adopted memory belongs to the caller again
// once Close has returned, and a late write would corrupt it.
func TestHostAsyncFillEndsBeforeCloseReturns(t *testing.T) {
	h := NewHostWith(HostConfig{AsyncFills: true})
	const pages, pageBytes = 64, 1 << 20 // large enough to be in flight
	mem := bytes.Repeat([]byte{0xaa}, pages*pageBytes)
	_, err := h.AdoptRegion(mem, pages, pageBytes, pageBytes)
	require.NoError(t, err)
	all := make([]int32, pages)
	for i := range all {
		all[i] = int32(i)
	}
	spec := FillSpec{Word: 0x5a5a5a5a}
	f, err := h.Fill(all, spec, Ordering{})
	require.NoError(t, err)
	require.NoError(t, h.Close())
	done, err := f.Done()
	require.True(t, done, "Close returned before the fill it had let in finished")
	require.NoError(t, err)
	require.Equal(t, wordBytes(spec.Word, int64(len(mem))), mem, "every adopted byte filled")

	_, err = h.Fill(all[:1], spec, Ordering{})
	require.ErrorIs(t, err, ErrClosed)
}

// The caller may reuse its page list once Fill returns, as on every
// device, even though the fill has not run yet.
func TestHostAsyncFillOwnsItsPageList(t *testing.T) {
	h := NewHostWith(HostConfig{AsyncFills: true})
	defer h.Close()
	const pages = 8
	_, err := h.AllocRegion(pages, 4<<20)
	require.NoError(t, err)
	for p := range int32(pages) {
		require.NoError(t, h.WritePage(0, p, bytes.Repeat([]byte{0xaa}, 4<<20)))
	}
	batch := []int32{1, 2, 3}
	spans := []Span{{First: 0, Count: 1, Pages: []int32{5, 6}}}
	spec := FillSpec{Word: 0x01020304}
	f1, err := h.Fill(batch, spec, Ordering{})
	require.NoError(t, err)
	f2, err := h.FillSpans(spans, spec, Ordering{})
	require.NoError(t, err)
	copy(batch, []int32{0, 4, 7}) // reused at once
	spans[0].Pages[0], spans[0].Pages[1] = 0, 7
	require.NoError(t, f1.Wait())
	require.NoError(t, f2.Wait())
	for p := range int32(pages) {
		want := bytes.Repeat([]byte{0xaa}, 4<<20)
		if slices.Contains([]int32{1, 2, 3, 5, 6}, p) {
			want = wordBytes(spec.Word, 4<<20)
		}
		require.Equal(t, want, h.PageBytes(0, p), "page %d", p)
	}
	c := h.Counters()
	require.Equal(t, uint64(2), c.FillCalls)
	require.Equal(t, uint64(5), c.PagesFilled)
}

// A batch that fails validation is refused by the call itself, as with
// synchronous fills: nothing is written, no goroutine keeps the device's
// lock, and Close does not hang.
func TestHostAsyncFillRefusesBadInputAtTheCall(t *testing.T) {
	h := NewHostWith(HostConfig{AsyncFills: true})
	_, err := h.AllocRegion(4, 64)
	require.NoError(t, err)
	require.NoError(t, h.WritePage(0, 0, bytes.Repeat([]byte{0xaa}, 64)))
	f, err := h.Fill([]int32{0, 4}, FillSpec{Word: 1}, Ordering{})
	require.ErrorIs(t, err, ErrInvalidArgument)
	require.Nil(t, f)
	f, err = h.FillSpans([]Span{{First: 0, Count: 2, Pages: []int32{0}}}, FillSpec{Word: 1}, Ordering{})
	require.Error(t, err)
	require.Nil(t, f)
	require.Equal(t, bytes.Repeat([]byte{0xaa}, 64), h.PageBytes(0, 0))
	require.Zero(t, h.Counters().FillCalls)
	require.NoError(t, h.Close())
}

// A synchronous fill stays free of allocations: the asynchronous path
// copies what outlives the call, and that copy must not leak into the
// default one (a release on the host backend allocates nothing).
func TestHostSyncFillAllocatesNothing(t *testing.T) {
	h := NewHost()
	defer h.Close()
	_, err := h.AllocRegion(8, 64)
	require.NoError(t, err)
	pages := []int32{1, 2, 5}
	spans := []Span{{First: 0, Count: 1, Pages: pages}}
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := h.Fill(pages, FillSpec{Word: 1}, Ordering{}); err != nil {
			t.Fatal(err)
		}
		if _, err := h.FillSpans(spans, FillSpec{Word: 2}, Ordering{}); err != nil {
			t.Fatal(err)
		}
	})
	require.Zero(t, allocs)
}
