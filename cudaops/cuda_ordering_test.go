package cudaops_test

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache"
)

// Regression tests of the CUDA backend as an engine drives it, over the
// simulated driver, which runs queued work only when something forces it:
// a fill not ordered after the engine's write runs before it, and the
// engine's old word survives in a page the fill should have cleaned.

const poison = 0x80008000

// engineOn opens an engine on the given kind of stream of d.
func engineOn(t *testing.T, d *cudaops.CUDA, kind cudaops.EngineStream) *cudaops.TestEngine {
	t.Helper()
	e, err := d.NewTestEngineOn(kind, 4096)
	require.NoError(t, err)
	t.Cleanup(e.Close)
	return e
}

func fillAndWait(t *testing.T, d *cudaops.CUDA, pages []int32, after cudaops.Ordering) {
	t.Helper()
	f, err := d.Fill(pages, cudaops.FillSpec{Word: poison}, after)
	require.NoError(t, err)
	require.NoError(t, f.Wait())
}

// A release with no ordering (what PyTorch's default stream hands over,
// what kvf_lease_free does) used to record nothing: the fill ran on
// kvfence's non-blocking stream, concurrently with the engine's kernels,
// and their writes landed after it. Zero now means "after all work of the
// context", on the legacy default stream and on the engine's own streams.
func TestCUDAZeroOrderingLeftEngineWritesInCleanPage(t *testing.T) {
	for _, kind := range []cudaops.EngineStream{cudaops.EngineLegacyStream, cudaops.EngineOwnStream, cudaops.EnginePerThreadStream} {
		t.Run([]string{"own", "legacy", "perthread"}[kind], func(t *testing.T) {
			d, _ := openFake(t)
			_, err := d.AllocRegion(8, 64)
			require.NoError(t, err)
			e := engineOn(t, d, kind)
			_, err = e.Write(0, 3, 0xe0e0e0e0)
			require.NoError(t, err)
			fillAndWait(t, d, []int32{3}, cudaops.Ordering{})
			require.NoError(t, e.Sync())
			assert.Equal(t, uniform(poison, 16), pageWords(t, d, 0, 3), "the engine's write landed after the fill")
			assert.Equal(t, uint64(1), d.Stats().ContextSyncs)
		})
	}
}

// CU_STREAM_LEGACY and CU_STREAM_PER_THREAD are accepted as what they
// name, and order the fill after the engine's work on them.
func TestCUDASpecialStreamHandlesOrderFill(t *testing.T) {
	for _, c := range []struct {
		kind   cudaops.EngineStream
		stream uintptr
	}{{cudaops.EngineLegacyStream, cudaops.StreamLegacy}, {cudaops.EnginePerThreadStream, cudaops.StreamPerThread}} {
		d, _ := openFake(t)
		_, err := d.AllocRegion(8, 64)
		require.NoError(t, err)
		e := engineOn(t, d, c.kind)
		_, err = e.Write(0, 5, 0xe0e0e0e0)
		require.NoError(t, err)
		o := cudaops.Ordering{Stream: c.stream}
		require.NoError(t, d.CheckOrdering(o))
		fillAndWait(t, d, []int32{5}, o)
		require.NoError(t, e.Sync())
		assert.Equal(t, uniform(poison, 16), pageWords(t, d, 0, 5), "stream %#x", c.stream)
		assert.Zero(t, d.Stats().ContextSyncs, "a named stream needs no context synchronisation")
	}
}

// Recording kvfence's event on a stream that captures a CUDA graph puts
// kvfence's work into the engine's graph and breaks the capture; it is
// refused instead, with nothing queued.
func TestCUDAOrderingOnCapturingStreamBrokeCapture(t *testing.T) {
	d, f := openFake(t)
	_, err := d.AllocRegion(8, 64)
	require.NoError(t, err)
	e := engineOn(t, d, cudaops.EngineOwnStream)
	_, err = e.Write(0, 1, 0xe0e0e0e0) // records e.Event() before the capture
	require.NoError(t, err)
	end := f.Capture(e.Stream())
	o := cudaops.Ordering{Stream: e.Stream()}
	require.ErrorIs(t, d.CheckOrdering(o), cudaops.ErrBadOrdering)
	require.ErrorContains(t, d.CheckOrdering(o), "capturing a CUDA graph")
	_, err = d.Fill([]int32{1}, cudaops.FillSpec{}, o)
	require.ErrorIs(t, err, cudaops.ErrBadOrdering)
	require.ErrorIs(t, err, cudaops.ErrInvalidArgument)
	assert.Zero(t, d.Counters().FillCalls)
	assert.Equal(t, 1, end(), "the engine's capture is no longer active")
}

// An event the engine recorded inside its capture cannot order a fill
// outside it: refused, the capture intact.
func TestCUDAOrderingOnCapturedEventBrokeCapture(t *testing.T) {
	d, f := openFake(t)
	_, err := d.AllocRegion(8, 64)
	require.NoError(t, err)
	e := engineOn(t, d, cudaops.EngineOwnStream)
	end := f.Capture(e.Stream())
	o, err := e.Write(0, 1, 0xe0e0e0e0) // the record is part of the capture
	require.NoError(t, err)
	o.Stream = 0
	require.ErrorIs(t, d.CheckOrdering(o), cudaops.ErrBadOrdering)
	_, err = d.Fill([]int32{1}, cudaops.FillSpec{}, o)
	require.ErrorIs(t, err, cudaops.ErrBadOrdering)
	assert.Equal(t, 1, end(), "the engine's capture is no longer active")
}

// While the engine captures a graph in global mode (PyTorch's default) on
// one stream, kvfence's fills after another stream, the reaper's waits
// and page copies must not invalidate the capture: they run in relaxed
// capture mode.
func TestCUDAFillsDuringCaptureInvalidatedIt(t *testing.T) {
	d, f := openFake(t)
	_, err := d.AllocRegion(8, 64)
	require.NoError(t, err)
	capturing := engineOn(t, d, cudaops.EngineOwnStream)
	other := engineOn(t, d, cudaops.EngineOwnStream)
	end := f.Capture(capturing.Stream())
	o, err := other.Write(0, 2, 0xe0e0e0e0)
	require.NoError(t, err)
	fillAndWait(t, d, []int32{2}, o)
	assert.Equal(t, uniform(poison, 16), pageWords(t, d, 0, 2))
	assert.Equal(t, 1, end(), "kvfence invalidated the engine's capture")
}

// An engine stream of another CUDA context cannot take kvfence's event:
// the driver rejects the record, which used to fail the fill (and fault
// the pool). It is refused as a bad ordering, naming the contexts.
func TestCUDAOrderingStreamOfAnotherContext(t *testing.T) {
	d, f := openFake(t)
	_, err := d.AllocRegion(8, 64)
	require.NoError(t, err)
	s, free := f.ForeignStream()
	defer free()
	err = d.CheckOrdering(cudaops.Ordering{Stream: s})
	require.ErrorIs(t, err, cudaops.ErrBadOrdering)
	require.ErrorContains(t, err, "belongs to CUDA context")
}

// AdoptRegion used to accept any address: memory of another GPU or another
// context made the fill kernel fault, a sticky error in the context the
// engine shares. Both ends of the extent are now checked.
func TestCUDAAdoptAcceptedForeignMemory(t *testing.T) {
	f := cudaops.NewFakeDriver()
	f.SetDevices(2)
	d, err := cudaops.OpenOn(f, 0)
	require.NoError(t, err)
	defer d.Close()
	const pages, pb = 16, 64
	for _, c := range []struct {
		name string
		base uint64
		want string
	}{
		{"another device", f.ForeignAlloc(pages*pb, 1, false), "memory of device 1"},
		{"another context", f.ForeignAlloc(pages*pb, 0, true), "allocated in context"},
		{"unknown to the driver", 0x1000_0000, "not device memory the driver knows"},
		{"extent past the allocation", f.ForeignAlloc(pages*pb/2, 0, false), "not device memory the driver knows"},
	} {
		_, err := d.AdoptRegion(c.base, pages, pb, pb)
		require.ErrorIs(t, err, cudaops.ErrInvalidArgument, c.name)
		require.ErrorContains(t, err, c.want, c.name)
	}
	assert.Empty(t, d.Regions())
	ok := f.ForeignAlloc(pages*pb, 0, false) // this device, its primary context
	_, err = d.AdoptRegion(ok, pages, pb, pb)
	require.NoError(t, err)
}

// Fence events used to be created without CU_EVENT_BLOCKING_SYNC, so a
// thread waiting on one spun a CPU next to the engine's.
func TestCUDAFenceEventsSpun(t *testing.T) {
	d, f := openFake(t)
	_, err := d.AllocRegion(64, 64)
	require.NoError(t, err)
	var fences []cudaops.Fence
	for p := range int32(32) {
		fc, err := d.Fill([]int32{p}, cudaops.FillSpec{}, cudaops.Ordering{Stream: cudaops.StreamLegacy})
		require.NoError(t, err)
		fences = append(fences, fc)
	}
	for _, fc := range fences {
		require.NoError(t, fc.Wait())
	}
	// The one exception is the event recorded on engine streams, which
	// nothing on the host waits for.
	assert.Equal(t, 1, f.EventsWithoutFlags(cudaops.EventBlockingSync|cudaops.EventDisableTiming))
}

// Every waiter of a fence used to block in its own cuEventSynchronize, on
// an OS thread of its own. One reaper per device waits now; waiters and
// pollers never call the driver.
func TestCUDAEveryWaiterCalledTheDriver(t *testing.T) {
	d, f := openFake(t)
	_, err := d.AllocRegion(8, 64)
	require.NoError(t, err)
	release := f.HoldSyncs()
	fc, err := d.Fill([]int32{1, 2}, cudaops.FillSpec{}, cudaops.Ordering{Stream: cudaops.StreamLegacy})
	require.NoError(t, err)
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() { assert.NoError(t, fc.Wait()) })
		wg.Go(func() { _, err := fc.Done(); assert.NoError(t, err) })
	}
	time.Sleep(10 * time.Millisecond) // let the waiters block
	release()
	wg.Wait()
	assert.Equal(t, 1, f.Calls("cuEventSynchronize"), "one wait, the reaper's")
	assert.Zero(t, f.Calls("cuEventQuery"), "Done polled the driver")
}

// With more than 16 fills in flight, Fill used to block on the oldest
// fence while holding the device lock. Fills in flight never block a new
// one while the staging ring has room.
func TestCUDAFillBlockedOnOldestFence(t *testing.T) {
	d, f := openFake(t)
	const pages = 256
	_, err := d.AllocRegion(pages, 64)
	require.NoError(t, err)
	release := f.HoldSyncs()
	defer release()
	fences := make(chan cudaops.Fence, pages)
	go func() {
		defer close(fences)
		for p := range int32(pages) {
			fc, err := d.Fill([]int32{p}, cudaops.FillSpec{Word: uint32(p) + 1}, cudaops.Ordering{Stream: cudaops.StreamLegacy})
			if !assert.NoError(t, err) {
				return
			}
			fences <- fc
		}
	}()
	deadline := time.After(5 * time.Second)
	for range pages {
		select {
		case <-fences:
		case <-deadline:
			t.Fatal("Fill blocked while earlier fills were in flight")
		}
	}
	assert.Zero(t, d.Stats().StagingWaits)
	release()
	for p := range int32(pages) {
		assert.Equal(t, uniform(uint32(p)+1, 16), pageWords(t, d, 0, p), "page %d", p)
	}
}

// Growing staging buffers called cuMemAllocHost, cuMemAlloc and cuMemFree
// (which can synchronise the device) on the release path. The ring and
// the region table are allocated with the regions; fills of any size
// allocate and free nothing.
func TestCUDAFillAllocatedOnReleasePath(t *testing.T) {
	for _, mode := range []cudaops.FillMode{cudaops.FillKernel, cudaops.FillMemset} {
		d, f := openFake(t)
		require.NoError(t, d.SetFillMode(mode))
		const pages = 1024
		for range 4 {
			_, err := d.AllocRegion(pages, 64)
			require.NoError(t, err)
		}
		calls := func() (n int) {
			for _, c := range []string{"cuMemAlloc_v2", "cuMemAllocHost_v2", "cuMemFree_v2", "cuMemFreeHost"} {
				n += f.Calls(c)
			}
			return n
		}
		before := calls()
		var fences []cudaops.Fence
		for _, n := range []int{1, 16, 300, pages, 7, pages} {
			batch := make([]int32, n)
			for i := range batch {
				batch[i] = int32(i)
			}
			fc, err := d.Fill(batch, cudaops.FillSpec{Word: uint32(n)}, cudaops.Ordering{Stream: cudaops.StreamLegacy})
			require.NoError(t, err)
			fences = append(fences, fc)
		}
		for _, fc := range fences {
			require.NoError(t, fc.Wait())
		}
		assert.Equal(t, before, calls(), "%v fills allocated or freed driver memory", mode)
		assert.Equal(t, uniform(pages, 16), pageWords(t, d, 3, pages-1))
	}
}

// A batch naming more pages than a region holds names one twice.
func TestCUDAFillBatchLongerThanRegion(t *testing.T) {
	d, _ := openFake(t)
	_, err := d.AllocRegion(4, 64)
	require.NoError(t, err)
	_, err = d.Fill([]int32{0, 1, 2, 3, 0}, cudaops.FillSpec{}, cudaops.Ordering{})
	require.ErrorIs(t, err, cudaops.ErrInvalidArgument)
}

// The kernel is loaded and warmed up at open: a launch of no items, so
// that a kernel which cannot run is found before the first release.
func TestCUDAKernelNotWarmedUpAtOpen(t *testing.T) {
	d, f := openFake(t)
	assert.Equal(t, 1, f.Calls("cuLaunchKernel"))
	assert.Equal(t, cudaops.FillKernel, d.Stats().Mode)
	assert.Empty(t, d.Stats().KernelError)

	f = cudaops.NewFakeDriver()
	f.FailNext("cuLaunchKernel", 209) // CUDA_ERROR_NO_BINARY_FOR_GPU
	d2, err := cudaops.OpenOn(f, 0)
	require.NoError(t, err)
	defer d2.Close()
	st := d2.Stats()
	assert.Equal(t, cudaops.FillMemset, st.Mode, "a kernel that fails its warm-up falls back to memsets")
	assert.Contains(t, st.KernelError, "warming up")
	assert.Contains(t, st.KernelError, "CUDA_ERROR_NO_BINARY_FOR_GPU")
	_, err = d2.AllocRegion(8, 64)
	require.NoError(t, err)
	fc, err := d2.Fill([]int32{3}, cudaops.FillSpec{Word: 5}, cudaops.Ordering{})
	require.NoError(t, err)
	require.NoError(t, fc.Wait())
	assert.Equal(t, uniform(5, 16), pageWords(t, d2, 0, 3))
}

// The JIT's error log used to be dropped: KernelError said only the
// CUresult.
func TestCUDAKernelErrorLostJITLog(t *testing.T) {
	f := cudaops.NewFakeDriver()
	f.SetLoadError(218) // CUDA_ERROR_INVALID_PTX
	f.SetLoadLog("ptxas application ptx input, line 42; error: unknown symbol")
	d, err := cudaops.OpenOn(f, 0)
	require.NoError(t, err)
	defer d.Close()
	require.ErrorContains(t, d.KernelError(), "line 42; error: unknown symbol")
	assert.Contains(t, d.Stats().KernelError, "CUDA_ERROR_INVALID_PTX")
	assert.Equal(t, cudaops.FillMemset, d.Stats().Mode)
}

// A Close that cannot enter the context used to return without releasing
// its retain of the primary context, which then outlived the device.
func TestCUDACloseKeptPrimaryContextRetained(t *testing.T) {
	f := cudaops.NewFakeDriver()
	d, err := cudaops.OpenOn(f, 0)
	require.NoError(t, err)
	_, err = d.AllocRegion(8, 64)
	require.NoError(t, err)
	f.FailNext("cuCtxPushCurrent_v2", 201)
	require.ErrorIs(t, d.Close(), cudaops.ErrDriver)
	assert.Empty(t, f.Leaks(), "the retain, and with it the context's resources, stayed")
	require.NoError(t, d.Close(), "second Close")
}

// newCUDAPool is a pool over the CUDA device on the simulated driver.
func newCUDAPool(t *testing.T) (*kvcache.Pool, *cudaops.CUDA, *cudaops.FakeDriver) {
	t.Helper()
	d, f := openFake(t)
	p, err := kvcache.New(kvcache.Config{
		Geometry:         kvcache.Geometry{TokensPerPage: 4, Layers: 2, KVHeads: 1, HeadDim: 4, DType: kvcache.FP32},
		Pages:            16,
		MaxContextTokens: 64,
		Tenants:          []kvcache.TenantConfig{{Name: "acme"}},
		Scrub:            kvcache.ScrubPolicy{Kind: kvcache.ScrubPoison},
		Device:           d,
	})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p, d, f
}

// One bad ordering handle used to fail the fill, retire the lease's pages
// and fault the pool for every tenant until ClearFault. It is the
// caller's error now: the lease stays live, the pool healthy.
func TestPoolFaultedByBadOrderingHandle(t *testing.T) {
	p, d, f := newCUDAPool(t)
	foreign, free := f.ForeignStream()
	defer free()
	e := engineOn(t, d, cudaops.EngineOwnStream)
	end := f.Capture(e.Stream())
	defer end()
	for _, o := range []cudaops.Ordering{
		{Stream: 0xdead0}, {Event: 0xbeef0}, {Stream: foreign}, {Stream: e.Stream()},
	} {
		l, err := p.TryAdmit(kvcache.Request{ID: "r", Tenant: "acme", PromptTokens: 8})
		require.NoError(t, err)
		err = l.ReleaseAfter(o)
		require.ErrorIs(t, err, kvcache.ErrInvalidArgument, "%+v", o)
		require.ErrorIs(t, err, cudaops.ErrBadOrdering, "%+v", o)
		assert.True(t, l.Live(), "the lease was given up")
		require.NoError(t, p.Check())
		st := p.Stats()
		assert.Empty(t, st.Fault, "%+v", o)
		assert.Zero(t, st.RetiredPages)
		require.NoError(t, l.ReleaseAfter(cudaops.Ordering{Stream: cudaops.StreamLegacy}))
	}
	require.NoError(t, p.Check())
}

// An ordering that passes the check and fails when the fill queues it
// (the engine destroyed its stream in between) takes the conservative
// ordering instead of faulting the pool.
func TestPoolFaultedByOrderingThatWentBad(t *testing.T) {
	p, d, f := newCUDAPool(t)
	e := engineOn(t, d, cudaops.EngineOwnStream)
	l, err := p.TryAdmit(kvcache.Request{ID: "r", Tenant: "acme", PromptTokens: 8})
	require.NoError(t, err)
	table, err := l.BlockTable()
	require.NoError(t, err)
	o, err := e.Write(0, table[0], 0xe0e0e0e0)
	require.NoError(t, err)
	o.Event = 0
	f.FailNext("cuEventRecord", 400) // after CheckOrdering, at the fill
	require.NoError(t, l.ReleaseAfter(o))
	require.NoError(t, e.Sync())
	// ReadPage follows the fill, whatever ordering it took.
	assert.Equal(t, uniform(0x80000000, 16), pageWords(t, d, 0, table[0]), "the fallback did not wait for the engine (fp32 poison)")
	require.Eventually(t, func() bool { return p.Stats().QuarantinedPages == 0 }, 5*time.Second, time.Millisecond)
	st := p.Stats()
	assert.Empty(t, st.Fault)
	assert.Zero(t, st.RetiredPages)
	require.NoError(t, p.Check())
}

// TestCUDAOrderingGPU checks the ordering rule on a real GPU, where the
// engine's kernel is still running when the release is issued: 64 MiB of
// engine work precede each page write. It covers the legacy default
// stream (as zero and as StreamLegacy), the per-thread default stream and
// an engine stream of its own, each named and as the zero Ordering. It
// skips without a GPU.
func TestCUDAOrderingGPU(t *testing.T) {
	d := openGPU(t)
	defer d.Close()
	const pages, pb = 64, 4096
	for range 4 {
		_, err := d.AllocRegion(pages, pb)
		require.NoError(t, err)
	}
	// The per-thread default stream is the calling thread's: keep the
	// engine's writes and the fills on one OS thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for _, c := range []struct {
		name  string
		kind  cudaops.EngineStream
		named cudaops.Ordering
	}{
		{"legacy", cudaops.EngineLegacyStream, cudaops.Ordering{Stream: cudaops.StreamLegacy}},
		{"perthread", cudaops.EnginePerThreadStream, cudaops.Ordering{Stream: cudaops.StreamPerThread}},
		{"own", cudaops.EngineOwnStream, cudaops.Ordering{}}, // named below: its own handle
	} {
		for _, zero := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/zero=%v", c.name, zero), func(t *testing.T) {
				e, err := d.NewTestEngineOn(c.kind, 64<<20)
				require.NoError(t, err)
				defer e.Close()
				batch := []int32{3, 4, 9, 63}
				var o cudaops.Ordering
				for _, p := range batch {
					for r := range 4 {
						if o, err = e.Write(r, p, 0xe0e0e0e0); err != nil {
							t.Fatal(err)
						}
					}
				}
				after := c.named
				if c.kind == cudaops.EngineOwnStream {
					after = cudaops.Ordering{Stream: o.Stream}
				}
				if zero {
					after = cudaops.Ordering{}
				}
				require.NoError(t, d.CheckOrdering(after))
				fc, err := d.Fill(batch, cudaops.FillSpec{Word: poison}, after)
				require.NoError(t, err)
				require.NoError(t, fc.Wait())
				require.NoError(t, e.Sync())
				for _, p := range batch {
					for r := range 4 {
						assert.Equal(t, uniform(poison, pb/4), pageWords(t, d, r, p), "region %d page %d: the engine's write landed after the fill", r, p)
					}
				}
			})
		}
	}
	t.Logf("stats %+v", d.Stats())
}
