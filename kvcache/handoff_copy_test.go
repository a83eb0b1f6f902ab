package kvcache

import (
	"bytes"
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// wholePagesOnly hides the Host's PartWriter: the pool must then assemble
// split regions itself.
type wholePagesOnly struct{ cudaops.Device }

// split cuts b into parts of random lengths, some empty, with a given
// seed.
func split(b []byte, seed uint64, maxPart int) [][]byte {
	rng := rand.New(rand.NewPCG(seed, 1))
	var parts [][]byte
	for len(b) > 0 {
		n := min(len(b), rng.IntN(maxPart+1))
		parts = append(parts, b[:n])
		b = b[n:]
	}
	return parts
}

func TestImportWritePagesFromParts(t *testing.T) {
	out, want := exported(t)
	g := out.Geometry()
	pb, rb := int(g.PageBytes()), int(g.RegionPageBytes())

	for _, dev := range []struct {
		name string
		wrap func(cudaops.Device) cudaops.Device
	}{
		{"part writer", func(d cudaops.Device) cudaops.Device { return d }},
		{"whole pages only", func(d cudaops.Device) cudaops.Device { return wholePagesOnly{d} }},
	} {
		for _, maxPart := range []int{1, 3, rb - 1, rb + 5, 3 * pb} {
			host := canaryDevice(t, g, 8, ScrubPolicy{Kind: ScrubCanary})
			dst, err := New(Config{Device: dev.wrap(host), Geometry: g, Pages: 8,
				MaxContextTokens: 32, Tenants: []TenantConfig{{Name: "a"}}, Scrub: ScrubPolicy{Kind: ScrubCanary}})
			require.NoError(t, err)
			in, err := dst.BeginImport(context.Background(), Request{ID: "r", Tenant: "a", PromptTokens: 10}, out.Domain(), mustChecksum(t, out))
			require.NoError(t, err)
			// Page 0 alone, then pages 1 and 2 in one call.
			require.NoError(t, in.WriteUnitsFrom(0, split(want[:pb], uint64(maxPart), maxPart)), "%s, parts ≤ %d", dev.name, maxPart)
			require.NoError(t, in.WriteUnitsFrom(1, split(want[pb:], uint64(maxPart)+1, maxPart)))
			got, err := in.Complete()
			require.NoError(t, err, "%s, parts ≤ %d", dev.name, maxPart)
			back := leaseBytes(t, host.(*cudaops.Host), g.Regions(), got, 3)
			assert.True(t, bytes.Equal(want, back), "%s, parts ≤ %d: pages differ", dev.name, maxPart)
			require.NoError(t, got.Release())
			require.NoError(t, dst.Check())
			require.NoError(t, dst.Close())
		}
	}
}

func TestImportWritePagesFromRefusesBadParts(t *testing.T) {
	out, good := exported(t)
	pb := len(good) / 3

	for name, parts := range map[string][][]byte{
		"no parts":        nil,
		"empty parts":     {{}, {}},
		"a page short":    split(good[:2*pb-1], 7, 100),
		"a byte over":     append(split(good, 8, 100), []byte{0}),
		"past the end":    split(append(bytes.Clone(good), good[:pb]...), 9, 100),
		"not whole pages": {good[:pb], good[pb : 2*pb-1]},
	} {
		dst := handoffPool(t, 32)
		in, err := dst.BeginImport(context.Background(), Request{ID: "r", Tenant: "a", PromptTokens: 10}, out.Domain(), mustChecksum(t, out))
		require.NoError(t, err)
		assert.ErrorIs(t, in.WriteUnitsFrom(0, parts), ErrInvalidArgument, name)
		_, err = in.Complete()
		assert.Error(t, err, "%s: an aborted import completed", name)
		assert.Equal(t, 0, dst.Stats().InUsePages, name)
		require.NoError(t, dst.Check(), name)
	}
}

// gatedReads is a device whose ReadPage waits at a gate, so that a test
// can hold a page copy in flight.
type gatedReads struct {
	cudaops.Device
	entered chan struct{} // one send per ReadPage that reached the gate
	open    chan struct{} // closed to let them through
}

func (d *gatedReads) ReadPage(r int, p int32, dst []byte) error {
	d.entered <- struct{}{}
	<-d.open
	return d.Device.ReadPage(r, p, dst)
}

// TestReleaseWaitsForCopyInFlight: page copies run outside the pool lock,
// so a release (here the export's Abort, the reclaim path and Close)
// must wait for them: the pages of a copy in flight are never scrubbed or
// handed to another lease, and once the release has begun no new copy
// starts.
func TestReleaseWaitsForCopyInFlight(t *testing.T) {
	for _, how := range []string{"abort", "engine release", "close"} {
		t.Run(how, func(t *testing.T) {
			g := Geometry{TokensPerPage: 4, Layers: 1, KVHeads: 1, HeadDim: 4, DType: FP16}
			host := canaryDevice(t, g, 8, ScrubPolicy{Kind: ScrubZero})
			dev := &gatedReads{Device: host, entered: make(chan struct{}, 64), open: make(chan struct{})}
			p, err := New(Config{Device: dev, Geometry: g, Pages: 8, MaxContextTokens: 32,
				Tenants: []TenantConfig{{Name: "a"}}})
			require.NoError(t, err)
			defer p.Close()
			l, err := p.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 4})
			require.NoError(t, err)
			table, _ := l.BlockTable()
			for r := range g.Regions() {
				page := host.(*cudaops.Host).PageBytes(r, table[0])
				for i := range page {
					page[i] = 0xAB
				}
			}
			require.NoError(t, l.BeginPrefill())
			require.NoError(t, l.Commit(4))
			require.NoError(t, l.FinishPrefill())

			out, err := l.Export(time.Now().Add(time.Hour))
			require.NoError(t, err)

			buf := make([]byte, g.PageBytes())
			read := make(chan error, 1)
			go func() { read <- out.ReadUnits(0, buf) }()
			<-dev.entered // the copy is in flight, pinned

			ended := endExportAsync(how, p, l, out)
			select {
			case err := <-ended:
				t.Errorf("%s returned (%v) while a copy of the pages was in flight", how, err)
				ended <- err
			case <-time.After(50 * time.Millisecond):
			}
			assert.Equal(t, 1, p.Stats().InUsePages, "the page left the lease under a copy")
			if how != "close" {
				// The release has begun: a new read is refused at once.
				assert.ErrorIs(t, out.ReadUnits(0, make([]byte, g.PageBytes())), ErrReclaimed)
			}
			close(dev.open)
			require.NoError(t, <-read)
			require.NoError(t, <-ended)
			assert.Equal(t, bytes.Repeat([]byte{0xAB}, len(buf)), buf, "the copy saw the page change under it")
			assert.Equal(t, 0, p.Stats().InUsePages)
			require.NoError(t, p.Check())
		})
	}
}

// TestConcurrentExportReadsAndReleases races many readers of one export
// against its release, under -race: every read either copies the
// exported bytes whole or fails with ErrReclaimed, and the pool ends
// consistent.
func TestConcurrentExportReadsAndReleases(t *testing.T) {
	p := handoffPool(t, 16)
	for round := range 20 {
		l := prefilled(t, p, "r", 10)
		out, err := l.Export(time.Now().Add(time.Hour))
		require.NoError(t, err)
		pb := int(p.Geometry().PageBytes())
		want := make([]byte, 3*pb)
		require.NoError(t, out.ReadUnits(0, want))
		var wg sync.WaitGroup
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, 3*pb)
				for {
					err := out.ReadUnits(0, buf)
					if err != nil {
						assert.ErrorIs(t, err, ErrReclaimed)
						return
					}
					if !assert.True(t, bytes.Equal(want, buf), "round %d: a read saw other bytes", round) {
						return
					}
				}
			}()
		}
		time.Sleep(time.Millisecond)
		if round%2 == 0 {
			require.NoError(t, out.Abort())
		} else {
			require.NoError(t, l.Release())
		}
		wg.Wait()
		require.NoError(t, p.Check())
		assert.Equal(t, 0, p.Stats().InUsePages)
	}
}

// TestExportChecksumIsLazy: Export reads no page; Checksum reads them
// once, then keeps its value, and fails as ReadPages does when the export
// ended before it was computed. An import checked against a checksum that
// arrived after the pages accepts only that checksum.
func TestExportChecksumIsLazy(t *testing.T) {
	p := handoffPool(t, 16)
	l := prefilled(t, p, "r", 10)
	host := p.dev
	counted := &countingReads{Device: host}
	p.dev = counted // before any copy: only this test sees the pool
	out, err := l.Export(time.Now().Add(time.Hour))
	require.NoError(t, err)
	assert.Zero(t, counted.reads.Load(), "Export read pages")
	sum, err := out.Checksum()
	require.NoError(t, err)
	regions := int64(p.Geometry().Regions())
	assert.Equal(t, 3*regions, counted.reads.Load(), "Checksum reads each page once")
	_, err = out.Checksum()
	require.NoError(t, err)
	assert.Equal(t, 3*regions, counted.reads.Load(), "a second Checksum read again")
	p.dev = host
	buf := make([]byte, 3*p.Geometry().PageBytes())
	require.NoError(t, out.ReadUnits(0, buf))
	pb := int(p.Geometry().PageBytes())
	want := ContentChecksum([]uint64{PageChecksum(buf[:pb]), PageChecksum(buf[pb : 2*pb]), PageChecksum(buf[2*pb:])})
	assert.Equal(t, want, sum)

	for _, tc := range []struct {
		name  string
		claim uint32
		ok    bool
	}{{"sealed sum", sum, true}, {"another sum", sum ^ 1, false}} {
		dst := handoffPool(t, 32)
		in, err := dst.BeginImport(context.Background(), Request{ID: "r", Tenant: "a", PromptTokens: 10}, out.Domain(), 0)
		require.NoError(t, err)
		require.NoError(t, in.WriteUnits(0, buf))
		got, err := in.CompleteWithChecksum(tc.claim)
		if tc.ok {
			require.NoError(t, err, tc.name)
			require.NoError(t, got.Release())
		} else {
			assert.ErrorIs(t, err, ErrChecksumMismatch, tc.name)
			assert.Equal(t, 0, dst.Stats().InUsePages)
		}
		require.NoError(t, dst.Check())
	}

	require.NoError(t, out.Ack())
	again, err := out.Checksum()
	require.NoError(t, err, "a known checksum outlives the export")
	assert.Equal(t, sum, again)

	l2 := prefilled(t, p, "r2", 10)
	out2, err := l2.Export(time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.NoError(t, out2.Abort())
	_, err = out2.Checksum()
	assert.ErrorIs(t, err, ErrReclaimed)
	require.NoError(t, p.Check())
}

// countingReads counts ReadPage calls.
type countingReads struct {
	cudaops.Device
	reads atomic.Int64
}

func (d *countingReads) ReadPage(r int, p int32, dst []byte) error {
	d.reads.Add(1)
	return d.Device.ReadPage(r, p, dst)
}

// TestPageViewsLendThePagesUntilDone: a transport that sends the pages'
// memory itself (PageViews) reads it after the pool lock is let go, so
// the lease stays pinned until done: an Abort, the engine's Release or
// Close waits for it, the pages are neither scrubbed nor reused while
// lent, and the views hold exactly what ReadPages copies, checksum
// included. done twice unpins once.
func TestPageViewsLendThePagesUntilDone(t *testing.T) {
	for _, how := range []string{"abort", "engine release", "close"} {
		t.Run(how, func(t *testing.T) {
			p := handoffPool(t, 16)
			l := prefilled(t, p, "r", 10) // 3 pages
			out, err := l.Export(time.Now().Add(time.Hour))
			require.NoError(t, err)
			require.True(t, out.Viewable())
			pb := int(p.PageBytes())
			want := make([]byte, 3*pb)
			require.NoError(t, out.ReadUnits(0, want))
			views, done, err := out.UnitViews(1, 2, nil)
			require.NoError(t, err)
			require.Len(t, views, 2*p.Geometry().Regions())
			var lent []byte
			for _, v := range views {
				lent = append(lent, v...)
			}
			require.Equal(t, want[pb:], lent, "the views are the pages' bytes")
			regions := p.Geometry().Regions()
			assert.Equal(t, PageChecksum(want[pb:2*pb]), PageChecksumOf(views[:regions]))

			ended := endExportAsync(how, p, l, out)
			select {
			case err := <-ended:
				t.Fatalf("%s returned (%v) while the pages were lent", how, err)
			case <-time.After(50 * time.Millisecond):
			}
			assert.Equal(t, 3, p.Stats().InUsePages, "a page left the lease while lent")
			for i, v := range views {
				lent = append(lent[:0], v...)
				require.Equal(t, want[pb+i*len(v):pb+(i+1)*len(v)], lent, "view %d changed while lent", i)
			}
			if how != "close" {
				_, _, err := out.UnitViews(0, 1, nil)
				assert.ErrorIs(t, err, ErrReclaimed, "a view once the release has begun")
			}
			done()
			done() // once is what counts
			require.NoError(t, <-ended)
			assert.Equal(t, 0, p.Stats().InUsePages)
			require.NoError(t, p.Check())
		})
	}
}

// TestPageViewsRefusals: a bad range pins nothing, a pool whose pages
// are not host memory lends none, and an ended export none either.
func TestPageViewsRefusals(t *testing.T) {
	p := handoffPool(t, 16)
	l := prefilled(t, p, "r", 10) // 3 pages
	out, err := l.Export(time.Now().Add(time.Hour))
	require.NoError(t, err)
	for _, r := range [][2]int{{0, 0}, {0, 4}, {3, 1}, {-1, 2}, {2, 2}, {0, -1}, {1 << 40, 1}, {0, 1 << 40}} {
		views, done, err := out.UnitViews(r[0], r[1], nil)
		assert.ErrorIs(t, err, ErrInvalidArgument, "pages [%d, +%d)", r[0], r[1])
		assert.Nil(t, done)
		assert.Empty(t, views)
	}
	require.NoError(t, out.Abort()) // returns at once: nothing was pinned
	_, _, err = out.UnitViews(0, 1, nil)
	assert.ErrorIs(t, err, ErrReclaimed)
	require.NoError(t, p.Check())

	g := Geometry{TokensPerPage: 4, Layers: 1, KVHeads: 1, HeadDim: 4, DType: FP16}
	q, err := New(Config{Device: wholePagesOnly{cudaops.NewHost()}, Geometry: g, Pages: 8, MaxContextTokens: 32,
		Tenants: []TenantConfig{{Name: "a"}}})
	require.NoError(t, err)
	defer q.Close()
	ql, err := q.TryAdmit(Request{ID: "r", Tenant: "a", PromptTokens: 4})
	require.NoError(t, err)
	require.NoError(t, ql.BeginPrefill())
	require.NoError(t, ql.Commit(4))
	require.NoError(t, ql.FinishPrefill())
	qo, err := ql.Export(time.Now().Add(time.Hour))
	require.NoError(t, err)
	assert.False(t, qo.Viewable())
	_, _, err = qo.UnitViews(0, 1, nil)
	assert.ErrorIs(t, err, ErrInvalidArgument)
	require.NoError(t, qo.Abort())
	require.NoError(t, q.Check())
}

// endExportAsync ends an export the way how names ("abort", "engine
// release", "close") on another goroutine; the channel gets its result.
func endExportAsync(how string, p *Pool, l *Lease, out *Outgoing) chan error {
	ended := make(chan error, 1)
	go func() {
		switch how {
		case "abort":
			ended <- out.Abort()
		case "engine release":
			ended <- l.Release()
		case "close":
			ended <- p.Close()
		}
	}()
	return ended
}

// TestImportCompleteAfterItsAbortBegan: an abort of an import (the
// receiver's transfer timeout) that began while a write was in flight
// waits for it (drainLocked) and then takes Pool.mu again. Complete may
// take Pool.mu first, once the write is done: it must then refuse, as
// the import is ending, not hand out the lease the abort is about to
// end (it did, and the lease stayed live with its draining flag set, so
// that every later copy of its pages was refused as reclaimed).
func TestImportCompleteAfterItsAbortBegan(t *testing.T) {
	p := handoffPool(t, 16)
	l := prefilled(t, p, "r", 10)
	out, err := l.Export(time.Now().Add(time.Hour))
	require.NoError(t, err)
	sum, err := out.Checksum()
	require.NoError(t, err)
	in, err := p.TryBeginImport(Request{ID: "r2", Tenant: "a", PromptTokens: 10}, "tenant:a", sum)
	require.NoError(t, err)
	buf := make([]byte, out.Units()*int(p.PageBytes()))
	require.NoError(t, out.ReadUnits(0, buf))
	require.NoError(t, in.WriteUnits(0, buf))
	require.NoError(t, out.Ack())

	// A write in flight, as WritePages pins the lease for one.
	dl := in.lease
	p.mu.Lock()
	dl.pins++
	p.mu.pins++
	p.mu.Unlock()
	aborted := make(chan error, 1)
	go func() { aborted <- in.Abort() }()
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return dl.draining
	}, 5*time.Second, time.Millisecond, "the abort did not begin")
	// The write ends; the abort, woken only by the broadcast below, has
	// not taken Pool.mu again yet.
	p.mu.Lock()
	dl.pins--
	p.mu.pins--
	p.mu.Unlock()

	got, err := in.Complete()
	assert.ErrorIs(t, err, ErrStaleTransfer, "an import whose abort began completed")
	assert.True(t, got == nil, "Complete handed out the lease")
	p.mu.Lock()
	p.quiet.Broadcast()
	p.mu.Unlock()
	require.NoError(t, <-aborted)
	if got != nil {
		assert.False(t, got.draining, "a live lease is left draining")
		require.NoError(t, got.Release())
	}
	assert.Equal(t, PhaseAborted, dl.Phase())
	require.NoError(t, p.Check())
	canarySweep(t, p)
}

// TestImportWriteAfterItsAbortOnAnotherGoroutine: a receiver's writer
// and the end of its import (the transfer timeout, Close) run on
// different goroutines with nothing ordering them but the pool. A write
// that comes once the import has ended must be refused (ErrStaleTransfer)
// having read nothing of the lease that its end changes: run with -race,
// which reported the write's unlocked read of the lease's page handles
// against the release's reset of them.
func TestImportWriteAfterItsAbortOnAnotherGoroutine(t *testing.T) {
	for _, how := range []string{"abort", "close"} {
		t.Run(how, func(t *testing.T) {
			p := handoffPool(t, 16)
			in, err := p.TryBeginImport(Request{ID: "r", Tenant: "a", PromptTokens: 10}, "tenant:a", 0)
			require.NoError(t, err)
			page := make([]byte, p.PageBytes())
			require.NoError(t, in.WriteUnits(0, page))
			go func() {
				if how == "abort" {
					in.Abort()
				} else {
					p.Close()
				}
			}()
			// Seen through the lease's atomic state only, which the end sets
			// before it releases the pages.
			for in.lease.state.Load() == leaseLive {
				time.Sleep(time.Millisecond)
			}
			time.Sleep(20 * time.Millisecond)
			err = in.WriteUnits(1, page)
			if how == "abort" {
				assert.ErrorIs(t, err, ErrStaleTransfer)
			} else {
				assert.ErrorIs(t, err, ErrPoolClosed)
			}
		})
	}
}
