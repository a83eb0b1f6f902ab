package kvcache

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/allocator"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/internal/invariants"
)

// Regression tests of admission, release and close, named after what went
// wrong.

// An import that carried the prompt's tokens shared the domain's cached
// pages and overwrote them: another lease read the new bytes, and the
// overwritten pages were still served as hits after the import aborted.
func TestImportCannotShareOrOverwriteCachedPrefix(t *testing.T) {
	p := newPrefixPool(t, 16, PrefixConfig{}, TenantConfig{Name: "a"})
	toks := tokens(3*prefixTPP, 0, 1)
	owner := admitComputeCache(t, p, "owner", "a", toks, 0)
	host := hostOf(t, p)
	markWith(t, host, owner, 0x5a)
	before := leaseBytes(t, host, p.geom.Regions(), owner, 2)

	for name, req := range map[string]Request{
		"token IDs": {ID: "imp", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks},
		"page keys": {ID: "imp", Tenant: "a", PromptTokens: len(toks), PageKeys: owner.keys[:2]},
	} {
		t.Run(name, func(t *testing.T) {
			st := state(p)
			in, err := p.BeginImport(context.Background(), req, owner.Domain(), 0)
			require.ErrorIs(t, err, ErrImportPrefix)
			assert.Nil(t, in)
			assert.Equal(t, st, state(p), "a refused import changed the pool")
			require.NoError(t, p.Check())
		})
	}

	// Without prefix material the import gets pages of its own, and
	// writing every one of them leaves the cached prefix as it was.
	in, err := p.BeginImport(context.Background(), Request{ID: "imp", Tenant: "a", PromptTokens: len(toks)}, owner.Domain(), 0)
	require.NoError(t, err)
	assert.Zero(t, commonPages(tableOf(t, in.lease), tableOf(t, owner)), "an import shares no page")
	require.ErrorIs(t, in.lease.AttachTokens("", toks), ErrLeasePhase, "no prefix material while importing")
	junk := bytes.Repeat([]byte{0xee}, in.Units()*int(p.geom.PageBytes()))
	require.NoError(t, in.WriteUnits(0, junk))
	require.NoError(t, in.Abort())
	assert.Equal(t, before, leaseBytes(t, host, p.geom.Regions(), owner, 2))
	hit := admitComputeCache(t, p, "reader", "a", toks, 0)
	assert.Equal(t, 2*prefixTPP, hit.HitTokens())
	assert.Equal(t, before, leaseBytes(t, host, p.geom.Regions(), hit, 2), "the hit reads the owner's KV")
	require.NoError(t, p.Check())
}

// An import writes only pages its lease holds alone: should a page of it
// be shared or published (it cannot be, today), the write is refused
// before a byte lands.
func TestImportWritesOnlyItsOwnPages(t *testing.T) {
	if invariants.Enabled {
		t.Skip("the test holds a page behind the lease table's back, which the self-checks rightly refuse")
	}
	p := newPrefixPool(t, 16, PrefixConfig{}, TenantConfig{Name: "a"})
	in, err := p.BeginImport(context.Background(), Request{ID: "imp", Tenant: "a", PromptTokens: 2 * prefixTPP}, "tenant:a", 0)
	require.NoError(t, err)
	p.mu.Lock()
	h, err := p.groups[0].alloc.Retain(in.lease.holds[0].handles[1].Page, in.lease.domain.ID) // someone else holds page 1 too
	require.NoError(t, err)
	p.mu.Unlock()
	page := make([]byte, p.geom.PageBytes())
	err = in.WriteUnits(1, page)
	require.ErrorIs(t, err, ErrStaleTransfer)
	assert.False(t, in.lease.Live(), "the refused write aborted the import")
	// The other holder lets go: the page is scrubbed like any other.
	p.mu.Lock()
	q, err := p.groups[0].alloc.Release(nil, []allocator.Handle{h}, in.lease.domain.ID)
	require.NoError(t, err)
	p.q.BeginLocked(0, len(q))
	p.fills.Add(1)
	p.mu.Unlock()
	require.NoError(t, p.scrub(scrubBatch{spaces: [][]int32{q}}, cudaops.Ordering{}))
	require.NoError(t, p.Check())
}

// A Lease exported, released and admitted again (same tokens, so its first
// page, cached meanwhile, kept its handle) was taken over by its first
// export: the stale Outgoing said Live again, and its Abort or its reclaim
// timer killed the second export.
func TestRecycledLeaseIsNotTakenOverByItsEarlierExport(t *testing.T) {
	p := newPrefixPool(t, 16, PrefixConfig{}, TenantConfig{Name: "a"})
	toks := tokens(3*prefixTPP, 0, 1)
	var l Lease
	export := func(reclaim time.Duration) *Outgoing {
		t.Helper()
		require.NoError(t, p.TryAdmitInto(Request{ID: "r", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks}, &l))
		require.NoError(t, l.BeginPrefill())
		require.NoError(t, l.Commit(len(toks)))
		_, err := l.CachePrefix(len(toks))
		require.NoError(t, err)
		require.NoError(t, l.FinishPrefill())
		o, err := l.Export(time.Now().Add(reclaim))
		require.NoError(t, err)
		return o
	}
	first := export(50 * time.Millisecond)
	require.NoError(t, l.Release()) // the engine gives up on the transfer
	assert.False(t, first.Live())

	second := export(time.Hour)
	require.Equal(t, 2*prefixTPP, l.HitTokens(), "the cached pages came back with their handles")
	assert.Equal(t, first.units[0].handle, second.units[0].handle, "the same first page at the same generation")
	assert.False(t, first.Live(), "a stale export is not live again")
	require.NoError(t, first.Abort())
	assert.True(t, second.Live(), "a stale export's Abort leaves the later one alone")
	time.Sleep(150 * time.Millisecond) // past the first export's reclaim deadline
	assert.True(t, second.Live(), "a stale export's timer leaves the later one alone")
	assert.ErrorIs(t, first.Ack(), ErrReclaimed)
	require.NoError(t, second.Ack())
	require.NoError(t, p.Check())
}

// Close returned while a concurrent end of a lease (or eviction, or
// ClearPrefixCache) was still filling its pages; the late fill met the
// closed device, the pages were retired and the closed pool faulted.
func TestCloseWaitsForFillsIssuedBeforeOrDuringIt(t *testing.T) {
	type setup struct {
		p   *Pool
		dev *scriptedDevice
		l   *Lease
	}
	newSetup := func(t *testing.T) setup {
		dev := newScripted()
		cfg := tinyConfig(8)
		cfg.Device = dev
		p, err := New(cfg)
		require.NoError(t, err)
		toks := tokens(5*tinyGeometry.TokensPerPage-1, 0, 1) // 4 full pages to publish, 1 private
		l, err := p.TryAdmit(Request{ID: "l", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
		require.NoError(t, err)
		require.NoError(t, l.Commit(len(toks)))
		_, err = l.CachePrefix(len(toks))
		require.NoError(t, err)
		return setup{p, dev, l}
	}
	for _, tc := range []struct {
		name string
		prep func(s setup) // untimed, before the gated fill
		end  func(s setup) error
		want error
	}{
		{name: "release", end: func(s setup) error { return s.l.Release() }},
		{name: "abort", end: func(s setup) error { return s.l.Abort() }},
		{
			name: "clear prefix cache",
			prep: func(s setup) { require.NoError(t, s.l.Release()) }, // 4 pages stay cached
			end:  func(s setup) error { return s.p.ClearPrefixCache() },
		},
		{
			name: "eviction by an admission",
			prep: func(s setup) { require.NoError(t, s.l.Release()) },
			end: func(s setup) error {
				// 4 free, 4 cached of another domain: b's admission evicts
				// and, when its fill ends, finds the pool closed.
				_, err := s.p.TryAdmit(Request{ID: "b", Tenant: "b", PromptTokens: 8 * tinyGeometry.TokensPerPage})
				return err
			},
			want: ErrPoolClosed,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSetup(t)
			if tc.prep != nil {
				tc.prep(s)
			}
			gate := s.dev.gateNextFill()
			ended := make(chan error, 1)
			go func() { ended <- tc.end(s) }()
			<-gate.entered
			closed := make(chan error, 1)
			go func() { closed <- s.p.Close() }()
			select {
			case err := <-closed:
				t.Fatalf("Close returned (%v) while a fill it must wait for was in the driver", err)
			case <-time.After(50 * time.Millisecond):
			}
			close(gate.proceed)
			require.NoError(t, <-closed)
			err := <-ended
			if tc.want != nil {
				require.ErrorIs(t, err, tc.want)
			} else {
				require.NoError(t, err)
			}
			st := s.p.Stats()
			assert.Zero(t, st.RetiredPages, "shutdown retired pages")
			assert.Empty(t, st.Fault)
			assert.Equal(t, 8, st.FreePages)
			require.NoError(t, s.p.Check())
		})
	}
}

// A tenant with 16 reserved pages and nothing in use was refused
// ErrPoolExhausted while another tenant kept trying to take one page:
// the other tenant's page claim came before its reservation check.
func TestReservationHonouredWhileOthersContend(t *testing.T) {
	p := newPool(t, tinyConfig(64, TenantConfig{Name: "gold", ReservedPages: 16}, TenantConfig{Name: "other"}))
	admit(t, p, "hog", "other", 48*tinyGeometry.TokensPerPage) // every page not reserved
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var tries atomic.Int64
	for w := range 2 {
		wg.Go(func() {
			id := string(rune('x' + w))
			for {
				select {
				case <-stop:
					return
				default:
				}
				l, err := p.TryAdmit(Request{ID: id, Tenant: "other", PromptTokens: 1})
				if err == nil {
					l.Release()
					panic("a page reserved for gold went to another tenant")
				}
				tries.Add(1)
			}
		})
	}
	var l Lease
	// At least 3,000 rounds, and on until the others have contended a
	// while: on a loaded machine their goroutines may start late.
	deadline := time.Now().Add(30 * time.Second)
	for i := 0; i < 3000 || (tries.Load() < 100 && time.Now().Before(deadline)); i++ {
		err := p.TryAdmitInto(Request{ID: "g", Tenant: "gold", PromptTokens: 16 * tinyGeometry.TokensPerPage}, &l)
		require.NoError(t, err, "attempt %d", i)
		require.NoError(t, l.Release())
	}
	close(stop)
	wg.Wait()
	assert.Positive(t, tries.Load())
	require.NoError(t, p.Check())
}

// Outgoing.ReadUnits(math.MaxInt, …) and Incoming.WriteUnits(math.MaxInt,
// …) panicked: first+n overflowed the range check.
func TestPageRangesCannotOverflow(t *testing.T) {
	out, good := exported(t)
	pb := int(out.Geometry().PageBytes())
	dst := handoffPool(t, 16)
	in, err := dst.BeginImport(context.Background(), Request{ID: "r", Tenant: "a", PromptTokens: 10}, out.Domain(), mustChecksum(t, out))
	require.NoError(t, err)
	for _, first := range []int{math.MaxInt, math.MaxInt - 1, math.MinInt, -1, 3, 2} {
		buf := make([]byte, 2*pb)
		require.ErrorIs(t, out.ReadUnits(first, buf), ErrInvalidArgument, "read at %d", first)
		require.ErrorIs(t, in.WriteUnits(first, buf), ErrInvalidArgument, "write at %d", first)
	}
	require.ErrorIs(t, in.WriteUnits(0, good[:pb+1]), ErrInvalidArgument, "not whole pages")
	assert.True(t, out.Live())
	// Nothing changed: the import is still usable.
	require.NoError(t, in.WriteUnits(0, good))
	l, err := in.Complete()
	require.NoError(t, err)
	require.NoError(t, l.Release())
	require.NoError(t, dst.Check())
}

// New(Config{Pages: math.MaxInt32, …}) died with "fatal error: out of
// memory"; the same JSON through kvf_pool_create killed the host process.
func TestAbsurdPoolSizeIsRefusedBeforeAllocating(t *testing.T) {
	huge := tinyConfig(1)
	huge.Pages = math.MaxInt32
	huge.MaxContextTokens = 1 << 20
	_, err := New(huge) // 2^31 pages of 256 bytes: 512 GiB of host memory
	require.ErrorIs(t, err, ErrInvalidConfig)
	assert.Contains(t, err.Error(), "needs 618475290336 bytes of host memory")

	// With a device of its own, the pool still needs page metadata.
	restore := availableMemory
	t.Cleanup(func() { availableMemory = restore })
	availableMemory = func() (int64, bool) { return 1 << 30, true }
	huge.Device = newScripted()
	_, err = New(huge)
	require.ErrorIs(t, err, ErrInvalidConfig)
	assert.Contains(t, err.Error(), "needs 68719476704 bytes of host memory (68719476704 for page metadata, 0 for host page memory), this process can use 1073741824 more")
}

// Exporting a nil lease panicked: an engine that ignores a refusal and
// exports what it got must get an error.
func TestNilLeaseIsAnError(t *testing.T) {
	var l *Lease
	_, err := l.Export(time.Now())
	assert.ErrorIs(t, err, ErrInvalidArgument)
	for name, err := range map[string]error{
		"release": l.Release(), "abort": l.Abort(), "commit": l.Commit(1),
		"begin prefill": l.BeginPrefill(), "finish prefill": l.FinishPrefill(),
		"attach tokens": l.AttachTokens("", []int32{1}),
	} {
		assert.ErrorIs(t, err, ErrInvalidArgument, name)
	}
	_, err = l.BlockTable()
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = l.CachePrefix(0)
	assert.ErrorIs(t, err, ErrInvalidArgument)
	assert.False(t, l.Live())
	assert.Empty(t, l.ID())
}

// Admit with a cancelled context admitted the request, and a context that
// could only be cancelled never waited.
func TestDoneContextNeverAdmits(t *testing.T) {
	p := newPool(t, tinyConfig(8))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	st := state(p)
	l, err := p.Admit(ctx, Request{ID: "r", Tenant: "a", PromptTokens: 4})
	assert.Nil(t, l)
	require.ErrorIs(t, err, ErrContextDone)
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, st, state(p))
	// A bad request is still named as such.
	_, err = p.Admit(ctx, Request{ID: "r", Tenant: "a"})
	require.ErrorIs(t, err, ErrInvalidRequest)
}

func TestCancelOnlyContextWaits(t *testing.T) {
	p := newPool(t, tinyConfig(8))
	hog := admit(t, p, "hog", "a", 32)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	got := make(chan error, 1)
	go func() {
		_, err := p.Admit(ctx, Request{ID: "w", Tenant: "b", PromptTokens: 4})
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("Admit with a cancellable context returned at once: %v", err)
	case <-time.After(30 * time.Millisecond):
	}
	require.NoError(t, hog.Release())
	require.NoError(t, <-got, "admitted once the pages were back")

	hog = admit(t, p, "hog2", "a", 28)
	go func() {
		_, err := p.Admit(ctx, Request{ID: "w2", Tenant: "b", PromptTokens: 8})
		got <- err
	}()
	time.Sleep(10 * time.Millisecond)
	cancel()
	err := <-got
	require.ErrorIs(t, err, ErrPoolExhausted, "the refusal that kept it waiting")
	require.ErrorIs(t, err, context.Canceled, "and why it stopped")
	s := p.Stats()
	assert.Equal(t, uint64(1), s.Refused.PoolExhausted, "a wait is counted once, when it ends")
	require.NoError(t, hog.Release())
	require.NoError(t, p.Check())
}

// A waiting admission hashes its prompt at most once, however often it is
// woken and tries again: never while its domain's pages are all in the
// trie (it matches by the tokens themselves), once while the domain holds
// a page published by keys alone (it then matches by keys).
func TestWaitingAdmissionHashesAtMostOnce(t *testing.T) {
	for _, tc := range []struct {
		name    string
		keyOnly bool
		want    int64
	}{{"trie", false, 0}, {"by keys", true, 1}} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPrefixPool(t, 9, PrefixConfig{}, TenantConfig{Name: "a"}, TenantConfig{Name: "b"})
			if tc.keyOnly { // b publishes a page it knows by key only
				keys, err := p.PageKeys("b", "", tokens(2*prefixTPP, 0, 9), nil)
				require.NoError(t, err)
				l, err := p.TryAdmit(Request{ID: "k", Tenant: "b", PromptTokens: 2 * prefixTPP, PageKeys: keys[:1]})
				require.NoError(t, err)
				require.NoError(t, l.Commit(2*prefixTPP))
				_, err = l.CachePrefix(prefixTPP)
				require.NoError(t, err)
				require.NoError(t, l.Release()) // its first page stays cached
			}
			var derived atomic.Int64
			testHookDeriveKeys = func() { derived.Add(1) }
			t.Cleanup(func() { testHookDeriveKeys = nil })
			var hogs []*Lease
			for i := range p.Stats().FreePages {
				hogs = append(hogs, admit(t, p, fmt.Sprint("h", i), "a", prefixTPP))
			}
			toks := tokens(6*prefixTPP, 0, 2)
			got := make(chan error, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				_, err := p.Admit(ctx, Request{ID: "w", Tenant: "b", PromptTokens: len(toks), TokenIDs: toks})
				got <- err
			}()
			for _, h := range hogs[:6] { // each release wakes it; the sixth lets it in
				time.Sleep(5 * time.Millisecond)
				require.NoError(t, h.Release())
			}
			require.NoError(t, <-got)
			assert.Equal(t, tc.want, derived.Load())
		})
	}
}

// Refusals while the pool was faulted were not counted.
func TestRefusalsWhileFaultedAreCounted(t *testing.T) {
	dev := newScripted()
	cfg := tinyConfig(8)
	cfg.Device = dev
	p := newPool(t, cfg)
	l := admit(t, p, "r", "a", 4)
	dev.mu.Lock()
	dev.mu.failNext = errors.New("injected")
	dev.mu.Unlock()
	require.ErrorIs(t, l.Release(), ErrPoolFaulted)
	for i := range 3 {
		_, err := p.TryAdmit(Request{ID: "x", Tenant: "b", PromptTokens: 1})
		require.ErrorIs(t, err, ErrPoolFaulted, "try %d", i)
		var ae *AdmissionError
		require.ErrorAs(t, err, &ae)
		require.ErrorIs(t, err, ErrScrubFailed, "the cause is the fault")
	}
	assert.Equal(t, uint64(3), p.Stats().Refused.PoolFaulted)
	p.ClearFault()
	admit(t, p, "y", "b", 4)
}

// A request of a tenant whose quota is the whole pool was refused
// ErrExceedsQuota on a full pool, so a scheduler let smaller requests
// overtake it; the pool is what it waits for.
func TestWholePoolQuotaWaitsForThePool(t *testing.T) {
	p := newPool(t, tinyConfig(16))
	admit(t, p, "mine", "a", 12*tinyGeometry.TokensPerPage)
	_, err := p.TryAdmit(Request{ID: "big", Tenant: "a", PromptTokens: 8 * tinyGeometry.TokensPerPage})
	var ae *AdmissionError
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, ErrPoolExhausted, ae.Err)
	assert.Equal(t, 8, ae.Need)
	assert.Equal(t, 4, ae.Have)
	assert.True(t, ae.Retryable())
}

// A waiter for pages holds the line: smaller requests that come later do
// not overtake it, except those inside their tenant's reservation.
func TestWaitersForPagesAreServedInOrder(t *testing.T) {
	p := newPool(t, tinyConfig(16, TenantConfig{Name: "a"}, TenantConfig{Name: "b"}, TenantConfig{Name: "gold", ReservedPages: 2}))
	hog := admit(t, p, "hog", "a", 12*tinyGeometry.TokensPerPage) // 2 left beyond gold's 2
	got := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := p.Admit(ctx, Request{ID: "big", Tenant: "b", PromptTokens: 6 * tinyGeometry.TokensPerPage})
		got <- err
	}()
	require.Eventually(t, func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.mu.poolWaiters == 1
	}, 5*time.Second, time.Millisecond)
	_, err := p.TryAdmit(Request{ID: "small", Tenant: "b", PromptTokens: 1})
	require.ErrorIs(t, err, ErrPoolExhausted, "a later small request does not pass the waiter")
	admit(t, p, "gold", "gold", 2*tinyGeometry.TokensPerPage) // inside its reservation: no waiting
	require.NoError(t, hog.Release())
	require.NoError(t, <-got)
	require.NoError(t, p.Check())
}

// AdmitInto into a recycled Lease allocates nothing, with or without a
// prefix.
func TestAdmitIntoAllocatesNothing(t *testing.T) {
	if invariants.Enabled {
		t.Skip("self-checks allocate")
	}
	p := newPrefixPool(t, 64, PrefixConfig{}, TenantConfig{Name: "a"})
	toks := tokens(10*prefixTPP, 0, 1)
	admitComputeCache(t, p, "published", "a", toks, 0).Release()
	for name, req := range map[string]Request{
		"plain":     {ID: "r", Tenant: "a", PromptTokens: 40, MaxNewTokens: 8},
		"prefix":    {ID: "r", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks},
		"page keys": {ID: "r", Tenant: "a", PromptTokens: len(toks), PageKeys: mustPageKeys(t, p, toks)},
	} {
		t.Run(name, func(t *testing.T) {
			var l Lease
			cycle := func() {
				if err := p.TryAdmitInto(req, &l); err != nil {
					t.Fatal(err)
				}
				if err := l.Release(); err != nil {
					t.Fatal(err)
				}
			}
			cycle() // the Lease grows its buffers once
			assert.Zero(t, testing.AllocsPerRun(100, cycle))
		})
	}
}

func mustPageKeys(t *testing.T, p *Pool, toks []int32) []BlockKey {
	keys, err := p.PageKeys("a", "", toks, nil)
	require.NoError(t, err)
	return keys
}

// A method named ...Locked asserts, under the invariants build tag, that
// Pool.mu is held.
func TestLockedMethodsAssertTheLock(t *testing.T) {
	if !invariants.Enabled {
		t.Skip("assertions are on under -race or the invariants tag")
	}
	p := newPool(t, tinyConfig(8))
	assert.PanicsWithValue(t, "kvcache: a Locked method was called without Pool.mu", func() { p.stateErrLocked() })
	assert.Panics(t, func() { p.q.FaultLocked() }, "isolation's Locked methods too")
	p.mu.Lock()
	assert.NotPanics(t, func() { p.stateErrLocked() })
	p.mu.Unlock()
}

// Check reports every problem it finds, each wrapping ErrCorrupt.
func TestCheckReportsEveryProblem(t *testing.T) {
	p := newPool(t, tinyConfig(8))
	l := admit(t, p, "r", "a", 8)
	p.mu.Lock()
	l.tenant.Used += 3        // a charge with no page
	p.groups[0].claimed = 100 // a claim no page covers
	l.holds[0].pages[0] = 7   // a block table that lies
	p.mu.Unlock()
	err := p.Check()
	require.ErrorIs(t, err, ErrCorrupt)
	var joined interface{ Unwrap() []error }
	require.ErrorAs(t, err, &joined)
	assert.GreaterOrEqual(t, len(joined.Unwrap()), 3, "%v", err)
	for _, e := range joined.Unwrap() {
		assert.ErrorIs(t, e, ErrCorrupt)
	}
	p.mu.Lock()
	l.tenant.Used -= 3
	p.groups[0].claimed = 0
	l.holds[0].pages[0] = l.holds[0].handles[0].Page
	p.mu.Unlock()
	require.NoError(t, p.Check())
}

// A fill that fails while an admission evicts for a claim faults the
// pool; the claim is void, the books stay sound, and after ClearFault
// admissions go on with the pages left.
func TestFailedEvictionVoidsTheClaim(t *testing.T) {
	dev := newScripted()
	cfg := tinyConfig(8)
	cfg.Device = dev
	p := newPool(t, cfg)
	toks := tokens(5*tinyGeometry.TokensPerPage-1, 0, 1)
	l, err := p.TryAdmit(Request{ID: "l", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
	require.NoError(t, err)
	require.NoError(t, l.Commit(len(toks)))
	_, err = l.CachePrefix(len(toks))
	require.NoError(t, err)
	require.NoError(t, l.Release()) // 4 cached, 4 free
	dev.mu.Lock()
	dev.mu.failFence = errors.New("injected")
	dev.mu.Unlock()
	_, err = p.TryAdmit(Request{ID: "b", Tenant: "b", PromptTokens: 6 * tinyGeometry.TokensPerPage})
	require.ErrorIs(t, err, ErrPoolFaulted)
	require.NoError(t, p.Check())
	s := p.Stats()
	assert.Equal(t, 2, s.RetiredPages, "the two evicted pages whose fill failed")
	p.ClearFault()
	admit(t, p, "c", "b", 6*tinyGeometry.TokensPerPage) // 4 free + 2 cached left
	require.NoError(t, p.Check())
}

// A release looks up only a lease's first published pages in the prefix
// index (releasePagesLocked): a lease with an indexed page past them
// would release that page as private, leaving the index pointing at a
// quarantined page. Check names such a lease.
func TestCheckFindsAnIndexedPagePastWhatTheLeasePublished(t *testing.T) {
	p := newPrefixPool(t, 16, PrefixConfig{}, TenantConfig{Name: "a"})
	toks := tokens(4*prefixTPP+1, 0, 1)
	l := admitComputeCache(t, p, "l", "a", toks, 0)
	p.mu.Lock()
	published := l.published
	require.Equal(t, 4, published)
	l.published = 2 // pages 2 and 3 are in the index all the same
	p.mu.Unlock()
	err := p.Check()
	require.ErrorIs(t, err, ErrCorrupt)
	assert.ErrorContains(t, err, "past the 2 pages it published or shared")
	p.mu.Lock()
	l.published = published
	p.mu.Unlock()
	require.NoError(t, p.Check())
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())
	assert.Equal(t, 4, p.Stats().CachedPages, "every published page is cached after the release")
}
