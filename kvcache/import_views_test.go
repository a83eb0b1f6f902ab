package kvcache

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// importOf begins an import into dst of the 10-token prompt out exports
// (3 pages), checked against out's checksum.
func importOf(t *testing.T, dst *Pool, out *Outgoing) *Incoming {
	t.Helper()
	in, err := dst.TryBeginImport(Request{ID: "r", Tenant: "a", PromptTokens: 10}, out.Domain(), mustChecksum(t, out))
	require.NoError(t, err)
	return in
}

// fillViews writes src into the concatenation of views, as a transport
// reading a message into them does.
func fillViews(t *testing.T, views [][]byte, src []byte) {
	t.Helper()
	for _, v := range views {
		src = src[copy(v, src):]
	}
	require.Empty(t, src, "the views hold less than the pages")
}

// pinsOf reports the pins of in's lease and of its pool.
func pinsOf(in *Incoming) (lease, pool int) {
	in.pool.mu.Lock()
	defer in.pool.mu.Unlock()
	return in.lease.pins, in.pool.mu.pins
}

// assertImportAborted checks that in has ended, before anything else
// could end it, without handing out its lease, and that every page it
// held was scrubbed back to its canary.
func assertImportAborted(t *testing.T, dst *Pool, in *Incoming) {
	t.Helper()
	assert.Equal(t, PhaseAborted, in.lease.Phase(), "the import is not aborted")
	assert.Zero(t, dst.Stats().LiveLeases)
	got, err := in.Complete()
	assert.Error(t, err, "an aborted import completed")
	assert.Nil(t, got)
	canarySweep(t, dst)
}

// TestImportPageViewsLandWhatWritePagesFromWrites: pages placed through
// views and landed are, to Complete and to the engine that gets the
// lease, the pages WritePagesFrom writes from the same bytes: the same
// per-page sums (so the same content checksum) and the same page memory.
// Views are each one region of one page, in WritePagesFrom's byte order,
// capped at the region, and may land in any order.
func TestImportPageViewsLandWhatWritePagesFromWrites(t *testing.T) {
	out, want := exported(t)
	pb := len(want) / 3
	g := out.Geometry()
	regions, rb := g.Regions(), int(g.RegionPageBytes())
	sums := map[string]uint32{}
	for _, how := range []string{"views", "WritePagesFrom"} {
		dst := handoffPool(t, 16)
		in := importOf(t, dst, out)
		if how == "views" {
			require.True(t, in.Viewable())
			v0, landed0, err := in.PageViews(0, 1, nil)
			require.NoError(t, err)
			v12, landed12, err := in.PageViews(1, 2, nil)
			require.NoError(t, err)
			require.Len(t, v0, regions)
			require.Len(t, v12, 2*regions)
			for i, v := range append(v0, v12...) {
				assert.Len(t, v, rb, "view %d is not one region of one page", i)
				assert.Equal(t, len(v), cap(v), "view %d reaches past its region", i)
			}
			fillViews(t, v12, want[pb:])
			fillViews(t, v0, want[:pb])
			require.NoError(t, landed12(true))
			require.NoError(t, landed0(true))
		} else {
			require.NoError(t, in.WritePagesFrom(0, split(want[:pb], 1, 100)))
			require.NoError(t, in.WritePagesFrom(1, split(want[pb:], 2, 100)))
		}
		in.mu.Lock()
		sums[how] = ContentChecksum(in.mu.sums)
		in.mu.Unlock()
		got, err := in.Complete()
		require.NoError(t, err, how)
		back := leaseBytes(t, dst.Device().(*cudaops.Host), regions, got, 3)
		assert.True(t, bytes.Equal(want, back), "%s: the pages hold other bytes", how)
		require.NoError(t, got.Release())
		require.NoError(t, dst.Check())
	}
	assert.Equal(t, sums["WritePagesFrom"], sums["views"], "views sum the pages otherwise")
	assert.Equal(t, mustChecksum(t, out), sums["views"])
}

// TestImportPageViewsOnADeviceWithoutHostMemory: a pool whose pages are
// not host memory lends none, refusing before anything changes: the
// import still takes its pages by copy and completes.
func TestImportPageViewsOnADeviceWithoutHostMemory(t *testing.T) {
	out, want := exported(t)
	g := out.Geometry()
	host := canaryDevice(t, g, 16, ScrubPolicy{Kind: ScrubCanary})
	dst, err := New(Config{Device: wholePagesOnly{host}, Geometry: g, Pages: 16, MaxContextTokens: 64,
		Tenants: []TenantConfig{{Name: "a"}}, Scrub: ScrubPolicy{Kind: ScrubCanary}})
	require.NoError(t, err)
	t.Cleanup(func() { dst.Close() })
	in := importOf(t, dst, out)
	assert.False(t, in.Viewable())
	before := [][]byte{{7}}
	views, landed, err := in.PageViews(0, 1, before)
	assert.ErrorIs(t, err, ErrInvalidArgument)
	assert.Nil(t, landed)
	assert.Equal(t, before, views)
	require.NoError(t, in.WritePagesFrom(0, [][]byte{want}), "the refusal ended the import")
	got, err := in.Complete()
	require.NoError(t, err)
	assert.True(t, bytes.Equal(want, leaseBytes(t, host.(*cudaops.Host), g.Regions(), got, 3)))
	require.NoError(t, got.Release())
	require.NoError(t, dst.Check())
}

// TestImportPageViewsOutsideTheImport: a range that is not whole pages
// of the import, including ones whose ends overflow, pins nothing, marks
// no page received and leaves the import usable.
func TestImportPageViewsOutsideTheImport(t *testing.T) {
	out, want := exported(t)
	dst := handoffPool(t, 16)
	in := importOf(t, dst, out)
	for _, r := range [][2]int{{0, 0}, {0, 4}, {3, 1}, {-1, 2}, {2, 2}, {0, -1}, {1 << 40, 1}, {0, 1 << 40}, {1, 1<<63 - 1}} {
		before := [][]byte{{7}}
		views, landed, err := in.PageViews(r[0], r[1], before)
		assert.ErrorIs(t, err, ErrInvalidArgument, "pages [%d, +%d)", r[0], r[1])
		assert.Nil(t, landed)
		assert.Equal(t, before, views)
	}
	lp, pp := pinsOf(in)
	assert.Zero(t, lp+pp, "a refused range pinned the lease")
	views, landed, err := in.PageViews(0, 3, nil)
	require.NoError(t, err, "a refused range ended the import or marked a page")
	fillViews(t, views, want)
	require.NoError(t, landed(true))
	got, err := in.Complete()
	require.NoError(t, err)
	require.NoError(t, got.Release())
	require.NoError(t, dst.Check())
}

// TestImportPageViewsOfAPageAlreadyReceived: a page is received once,
// whichever of WritePagesFrom and PageViews receives it; the second
// receipt, by either, aborts the import. A write of a page whose views
// are out is refused, and its abort waits for them to land.
func TestImportPageViewsOfAPageAlreadyReceived(t *testing.T) {
	out, want := exported(t)
	pb := len(want) / 3
	refusedViews := func(t *testing.T, in *Incoming, first, n int) error {
		views, landed, err := in.PageViews(first, n, nil)
		assert.Empty(t, views)
		assert.Nil(t, landed)
		return err
	}
	landedViews := func(t *testing.T, in *Incoming, first, n int) {
		views, landed, err := in.PageViews(first, n, nil)
		require.NoError(t, err)
		fillViews(t, views, want[first*pb:(first+n)*pb])
		require.NoError(t, landed(true))
	}
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, in *Incoming) error
	}{
		{"written, then viewed", func(t *testing.T, in *Incoming) error {
			require.NoError(t, in.WritePagesFrom(0, [][]byte{want[:2*pb]}))
			return refusedViews(t, in, 1, 2)
		}},
		{"viewed, then written", func(t *testing.T, in *Incoming) error {
			landedViews(t, in, 1, 1)
			return in.WritePages(0, want[:2*pb])
		}},
		{"viewed, then viewed", func(t *testing.T, in *Incoming) error {
			landedViews(t, in, 0, 2)
			return refusedViews(t, in, 1, 1)
		}},
		{"written while its views are out", func(t *testing.T, in *Incoming) error {
			views, landed, err := in.PageViews(0, 1, nil)
			require.NoError(t, err)
			lent := bytes.Clone(bytes.Join(views, nil))
			wrote := make(chan error, 1)
			go func() { wrote <- in.WritePages(0, want[:pb]) }()
			require.Eventually(t, func() bool {
				in.pool.mu.Lock()
				defer in.pool.mu.Unlock()
				return in.lease.draining || len(wrote) > 0
			}, 10*time.Second, time.Millisecond, "the refused write did not begin the abort")
			select {
			case err := <-wrote:
				t.Fatalf("the write returned (%v) while the page's views were out", err)
			default:
			}
			assert.Equal(t, lent, bytes.Join(views, nil), "the refused write wrote the page")
			require.NoError(t, landed(true))
			return <-wrote
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dst := handoffPool(t, 16)
			in := importOf(t, dst, out)
			assert.ErrorIs(t, tc.run(t, in), ErrDuplicatePage)
			assertImportAborted(t, dst, in)
		})
	}
}

// TestImportPageViewsNotLandedAbortTheImport: a transport whose read into
// the views failed part way (landed(false)) leaves pages of unknown
// bytes: the import is aborted, its pages scrubbed, and the pin is gone
// first, or the abort would wait for itself.
func TestImportPageViewsNotLandedAbortTheImport(t *testing.T) {
	out, want := exported(t)
	dst := handoffPool(t, 16)
	in := importOf(t, dst, out)
	views, landed, err := in.PageViews(0, 3, nil)
	require.NoError(t, err)
	fillViews(t, views, want) // the bytes landed, but the transport cannot vouch for them
	res := make(chan error, 1)
	go func() { res <- landed(false) }()
	select {
	case err := <-res:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("landed(false) waits for its own pin")
	}
	s := dst.Stats()
	assert.Zero(t, s.LiveLeases)
	assert.Zero(t, s.InUsePages)
	_, pp := pinsOf(in)
	assert.Zero(t, pp)
	assertImportAborted(t, dst, in)
}

// TestImportEndWaitsForPageViewsToLand: while views are out the pages
// are the transport's to write, so an Abort (a receiver's transfer
// timeout) or Close on another goroutine waits for landed, which may come
// from yet another goroutine; the pages are neither scrubbed nor reused
// meanwhile.
func TestImportEndWaitsForPageViewsToLand(t *testing.T) {
	for _, how := range []string{"abort", "close"} {
		t.Run(how, func(t *testing.T) {
			out, want := exported(t)
			dst := handoffPool(t, 16)
			in := importOf(t, dst, out)
			views, landed, err := in.PageViews(0, 3, nil)
			require.NoError(t, err)
			ended := make(chan error, 1)
			go func() {
				if how == "abort" {
					ended <- in.Abort()
				} else {
					ended <- dst.Close()
				}
			}()
			require.Eventually(t, func() bool {
				dst.mu.Lock()
				defer dst.mu.Unlock()
				return in.lease.draining || dst.mu.closed || len(ended) > 0
			}, 10*time.Second, time.Millisecond, "the %s did not begin", how)
			select {
			case err := <-ended:
				t.Fatalf("%s returned (%v) while the pages were lent for writing", how, err)
			default:
			}
			assert.Equal(t, 3, dst.Stats().InUsePages, "a page left the lease while lent")
			fillViews(t, views, want)
			landedErr := make(chan error, 1)
			go func() { landedErr <- landed(true) }()
			require.NoError(t, <-landedErr)
			select {
			case err := <-ended:
				require.NoError(t, err)
			case <-time.After(10 * time.Second):
				t.Fatalf("%s still waits once the views landed", how)
			}
			assert.Zero(t, dst.Stats().InUsePages)
			require.NoError(t, dst.Check())
			if how == "abort" {
				assertImportAborted(t, dst, in)
			}
		})
	}
}

// TestImportPageViewsOfWrongBytesFailTheChecksum: the pages are summed
// over what the views hold when they land, so a page that holds other
// bytes than the sender summed fails Complete.
func TestImportPageViewsOfWrongBytesFailTheChecksum(t *testing.T) {
	out, want := exported(t)
	pb := len(want) / 3
	dst := handoffPool(t, 16)
	in := importOf(t, dst, out)
	views, landed, err := in.PageViews(0, 3, nil)
	require.NoError(t, err)
	bad := bytes.Clone(want)
	bad[pb+5] ^= 1
	fillViews(t, views, bad)
	require.NoError(t, landed(true))
	_, err = in.Complete()
	assert.ErrorIs(t, err, ErrChecksumMismatch)
	assertImportAborted(t, dst, in)
}

// TestImportPageViewsLandedTwiceCountOnce: only the first landed counts;
// a second neither unpins again (the pin counts would go negative and a
// later end of the lease would not wait for a real copy), nor counts the
// pages twice (Complete would refuse a full import), nor aborts a landed
// import.
func TestImportPageViewsLandedTwiceCountOnce(t *testing.T) {
	out, want := exported(t)
	pb := len(want) / 3
	t.Run("landed, then again", func(t *testing.T) {
		dst := handoffPool(t, 16)
		in := importOf(t, dst, out)
		views, landed, err := in.PageViews(0, 1, nil)
		require.NoError(t, err)
		fillViews(t, views, want[:pb])
		require.NoError(t, landed(true))
		require.NoError(t, landed(true))
		require.NoError(t, landed(false))
		lp, pp := pinsOf(in)
		assert.Equal(t, [2]int{0, 0}, [2]int{lp, pp}, "lease and pool pins")
		require.NoError(t, in.WritePages(1, want[pb:]))
		got, err := in.Complete()
		require.NoError(t, err)
		require.NoError(t, got.Release())
		require.NoError(t, dst.Check())
	})
	t.Run("not landed, then landed", func(t *testing.T) {
		dst := handoffPool(t, 16)
		in := importOf(t, dst, out)
		_, landed, err := in.PageViews(0, 1, nil)
		require.NoError(t, err)
		require.NoError(t, landed(false))
		require.NoError(t, landed(true))
		require.NoError(t, landed(false))
		_, pp := pinsOf(in)
		assert.Zero(t, pp, "pool pins")
		in.mu.Lock()
		assert.Zero(t, in.mu.received, "pages that did not land were counted")
		in.mu.Unlock()
		assertImportAborted(t, dst, in)
	})
}

// shortViews is a host device whose PageBytes returns less than a page
// region.
type shortViews struct{ cudaops.Device }

func (d shortViews) PageBytes(r int, p int32) []byte {
	return d.Device.(*cudaops.Host).PageBytes(r, p)[:1]
}

// TestImportPageViewsOfAShortRegion: a device that lends less than a
// region would have the transport write a page in part, and the rest of
// it past the view: refused as a device failure, with nothing left
// pinned and the import aborted (its pages are marked received).
func TestImportPageViewsOfAShortRegion(t *testing.T) {
	out, _ := exported(t)
	g := out.Geometry()
	host := canaryDevice(t, g, 16, ScrubPolicy{Kind: ScrubCanary})
	dst, err := New(Config{Device: shortViews{host}, Geometry: g, Pages: 16, MaxContextTokens: 64,
		Tenants: []TenantConfig{{Name: "a"}}, Scrub: ScrubPolicy{Kind: ScrubCanary}})
	require.NoError(t, err)
	t.Cleanup(func() { dst.Close() })
	in := importOf(t, dst, out)
	require.True(t, in.Viewable())
	before := [][]byte{{7}}
	views, landed, err := in.PageViews(0, 2, before)
	assert.ErrorIs(t, err, ErrDevice)
	assert.Nil(t, landed)
	assert.Equal(t, before, views)
	_, pp := pinsOf(in)
	assert.Zero(t, pp)
	assertImportAborted(t, dst, in)
}

// TestImportPageViewsSumThePagesNotTheCallersSlice: a transport may reuse
// its slice of views (for the next message's) once it has read into
// them, before it calls landed. What landed vouches for is the pages'
// memory: summing the slice's entries instead would sum whatever they
// point at by then (here the next pages), not the bytes the engine will
// read.
func TestImportPageViewsSumThePagesNotTheCallersSlice(t *testing.T) {
	out, want := exported(t)
	pb := len(want) / 3
	dst := handoffPool(t, 16)
	in := importOf(t, dst, out)
	buf, landed0, err := in.PageViews(0, 1, nil)
	require.NoError(t, err)
	fillViews(t, buf, want[:pb])
	buf, landed12, err := in.PageViews(1, 2, buf[:0]) // page 0's entries now point at pages 1 and 2
	require.NoError(t, err)
	fillViews(t, buf, want[pb:])
	require.NoError(t, landed0(true))
	require.NoError(t, landed12(true))
	got, err := in.Complete()
	require.NoError(t, err)
	require.NoError(t, got.Release())
	require.NoError(t, dst.Check())
}
