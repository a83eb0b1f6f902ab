package allocator

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func mustNew(t testing.TB, n int) *Allocator {
	t.Helper()
	a, err := New(n)
	require.NoError(t, err)
	return a
}

func pagesOf(hs []Handle) []int32 {
	out := make([]int32, len(hs))
	for i, h := range hs {
		out[i] = h.Page
	}
	return out
}

func TestMetadataIs12Bytes(t *testing.T) {
	assert.Equal(t, uintptr(12), unsafe.Sizeof(pageMeta{}))
}

func TestNewRejectsBadSizes(t *testing.T) {
	for _, n := range []int{0, -1, MaxPages + 1} {
		_, err := New(n)
		assert.ErrorIs(t, err, ErrInvalidArgument, "n=%d", n)
	}
}

func TestAllocHandsOutLowPagesFirstAndReturnsThemInOrder(t *testing.T) {
	a := mustNew(t, 8)
	hs, err := a.Alloc(nil, 3, 1)
	require.NoError(t, err)
	assert.Equal(t, []int32{0, 1, 2}, pagesOf(hs))
	q, err := a.Release(nil, hs, 1)
	require.NoError(t, err)
	assert.Equal(t, []int32{0, 1, 2}, q)
	require.NoError(t, a.Clean(q))
	again, err := a.Alloc(nil, 3, 2)
	require.NoError(t, err)
	assert.Equal(t, []int32{0, 1, 2}, pagesOf(again), "a cleaned batch comes back in the same order")
	for i := range again {
		assert.Equal(t, hs[i].Gen+1, again[i].Gen, "generation advanced")
	}
	require.NoError(t, a.Check())
}

// snapshot captures everything observable, to prove failed calls change
// nothing.
func snapshot(a *Allocator) string {
	return fmt.Sprintf("%v|%v|%v", a.pages, a.free, a.count)
}

func TestBadOperationsChangeNothing(t *testing.T) {
	a := mustNew(t, 16)
	held, err := a.Alloc(nil, 4, 7)
	require.NoError(t, err)
	other, err := a.Alloc(nil, 2, 9)
	require.NoError(t, err)
	gone, err := a.Alloc(nil, 2, 7)
	require.NoError(t, err)
	q, err := a.Release(nil, gone, 7)
	require.NoError(t, err)
	require.NoError(t, a.Clean(q))
	stale := gone[0]
	reused, err := a.Alloc(nil, 2, 7) // same pages again, new generation
	require.NoError(t, err)
	require.Equal(t, stale.Page, reused[0].Page)

	cases := []struct {
		name string
		op   func() error
		want error
	}{
		{"alloc too many", func() error { _, err := a.Alloc(nil, 100, 7); return err }, ErrNoSpace},
		{"alloc negative", func() error { _, err := a.Alloc(nil, -1, 7); return err }, ErrInvalidArgument},
		{"alloc no owner", func() error { _, err := a.Alloc(nil, 1, 0); return err }, ErrInvalidArgument},
		{"release other owner's page", func() error { _, err := a.Release(nil, other[:1], 7); return err }, ErrNotOwner},
		{"release stale generation", func() error { _, err := a.Release(nil, []Handle{stale}, 7); return err }, ErrStaleHandle},
		{"release out of range", func() error { _, err := a.Release(nil, []Handle{{Page: 99}}, 7); return err }, ErrInvalidArgument},
		{"release negative page", func() error { _, err := a.Release(nil, []Handle{{Page: -1}}, 7); return err }, ErrInvalidArgument},
		{"release duplicate in batch", func() error { _, err := a.Release(nil, []Handle{held[0], held[1], held[0]}, 7); return err }, ErrDoubleFree},
		{"release free page", func() error { _, err := a.Release(nil, []Handle{{Page: 15}}, 7); return err }, ErrDoubleFree},
		{"partly bad batch", func() error { _, err := a.Release(nil, []Handle{held[0], held[1], other[0]}, 7); return err }, ErrNotOwner},
		{"clean in-use page", func() error { return a.Clean([]int32{held[0].Page}) }, ErrWrongState},
		{"retire free page", func() error { return a.Retire([]int32{15}) }, ErrWrongState},
		{"evict in-use page", func() error { return a.Evict([]int32{held[0].Page}) }, ErrWrongState},
		{"unclean in-use page", func() error { return a.Unclean([]int32{15, held[0].Page}) }, ErrWrongState},
		{"unclean duplicate", func() error { return a.Unclean([]int32{15, 15}) }, ErrInvalidArgument},
		{"release shared page twice", func() error {
			h, err := a.Retain(held[2].Page, 7)
			if err != nil {
				return err
			}
			defer a.Release(nil, []Handle{h}, 7)
			_, err = a.Release(nil, []Handle{held[3], held[2], held[2]}, 7)
			return err
		}, ErrDoubleFree},
		{"park a page of another owner after shared ones", func() error {
			_, err := a.Park(nil, []Handle{held[2], held[3], other[1]}, 7)
			return err
		}, ErrNotOwner},
		{"retain free page", func() error { _, err := a.Retain(15, 7); return err }, ErrWrongState},
		{"retain other owner's page", func() error { _, err := a.Retain(other[0].Page, 7); return err }, ErrNotOwner},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := snapshot(a)
			assert.ErrorIs(t, tc.op(), tc.want)
			assert.Equal(t, before, snapshot(a), "a failed call changed the allocator")
			require.NoError(t, a.Check())
		})
	}
}

// A batch that names one page twice is refused, and the pages before the
// repeat, already applied in the one pass, are put back.
func TestBatchWithTheSamePageTwiceChangesNothing(t *testing.T) {
	a := mustNew(t, 8)
	hs, err := a.Alloc(nil, 4, 1)
	require.NoError(t, err)
	q, err := a.Release(nil, hs[:3], 1)
	require.NoError(t, err)
	parked, err := a.Park(nil, hs[3:], 1)
	require.NoError(t, err)
	for name, op := range map[string]func() error{
		"clean":  func() error { return a.Clean([]int32{q[0], q[1], q[2], q[1]}) },
		"retire": func() error { return a.Retire([]int32{q[2], q[0], q[2]}) },
		"evict":  func() error { return a.Evict([]int32{parked[0], parked[0]}) },
	} {
		before := snapshot(a)
		assert.ErrorIs(t, op(), ErrInvalidArgument, name)
		assert.Equal(t, before, snapshot(a), "%s changed the allocator", name)
		require.NoError(t, a.Check(), name)
	}
}

func TestDoubleFree(t *testing.T) {
	a := mustNew(t, 4)
	hs, err := a.Alloc(nil, 2, 1)
	require.NoError(t, err)
	_, err = a.Release(nil, hs, 1)
	require.NoError(t, err)
	_, err = a.Release(nil, hs, 1)
	assert.ErrorIs(t, err, ErrDoubleFree)
	require.NoError(t, a.Check())
}

func TestRefcountsAndCaching(t *testing.T) {
	a := mustNew(t, 4)
	hs, err := a.Alloc(nil, 1, 3)
	require.NoError(t, err)
	h2, err := a.Retain(hs[0].Page, 3)
	require.NoError(t, err)
	assert.Equal(t, hs[0], h2)
	q, err := a.Release(nil, hs, 3)
	require.NoError(t, err)
	assert.Empty(t, q, "one reference remains")
	parked, err := a.Park(nil, hs, 3)
	require.NoError(t, err)
	assert.Equal(t, []int32{hs[0].Page}, parked)
	assert.Equal(t, 1, a.Count(Cached))
	require.NoError(t, a.Check())
	back, err := a.Retain(hs[0].Page, 3)
	require.NoError(t, err)
	assert.Equal(t, hs[0].Gen, back.Gen, "a cached page keeps its generation")
	_, err = a.Park(nil, []Handle{back}, 3)
	require.NoError(t, err)
	require.NoError(t, a.Evict(parked))
	info, err := a.Info(hs[0].Page)
	require.NoError(t, err)
	assert.Equal(t, Quarantined, info.State)
	assert.Equal(t, hs[0].Gen+1, info.Gen)
	require.NoError(t, a.Retire(parked))
	assert.Equal(t, 1, a.Count(Retired))
	require.NoError(t, a.Check())
}

func TestUncleanTakesFreePagesBack(t *testing.T) {
	a := mustNew(t, 6)
	require.NoError(t, a.Unclean([]int32{0, 3, 5}))
	assert.Equal(t, 3, a.Count(Quarantined))
	require.NoError(t, a.Check())
	hs, err := a.Alloc(nil, 3, 1)
	require.NoError(t, err)
	assert.Equal(t, []int32{1, 2, 4}, pagesOf(hs))
	assert.Equal(t, []int32(nil), a.PeekFree(nil, 5))
}

func TestCheckFindsCorruption(t *testing.T) {
	a := mustNew(t, 4)
	a.count[InUse]++ // a counter that disagrees with the pages
	assert.ErrorIs(t, a.Check(), ErrCorrupt)
	a = mustNew(t, 4)
	a.free = a.free[:3] // a free page lost from the stack
	assert.ErrorIs(t, a.Check(), ErrCorrupt)
	a = mustNew(t, 4)
	a.free[0] = a.free[1] // a page twice on the free stack, another lost
	assert.ErrorIs(t, a.Check(), ErrCorrupt)
	a = mustNew(t, 4)
	a.free = append(a.free[:3], 9) // a page that does not exist
	assert.ErrorIs(t, a.Check(), ErrCorrupt)
	a = mustNew(t, 4)
	a.pages[1].word = packed(InUse, 0)
	a.count[InUse]++
	assert.ErrorIs(t, a.Check(), ErrCorrupt, "in use with no references")
}

// Every batch operation checks and applies each page in one pass and
// undoes what it applied when a page fails: a bad entry at any place of a
// batch, of every kind, leaves the allocator exactly as it was.
func TestBatchWithABadEntryAnywhereChangesNothing(t *testing.T) {
	const owner = 5
	setup := func(t *testing.T) (a *Allocator, private, shared []Handle, quarantined, cached []int32, other Handle) {
		a = mustNew(t, 32)
		hs, err := a.Alloc(nil, 17, owner)
		require.NoError(t, err)
		private, shared = hs[:6], hs[6:10] // shared pages have a second reference
		for _, h := range shared {
			_, err := a.Retain(h.Page, owner)
			require.NoError(t, err)
		}
		quarantined, err = a.Release(nil, hs[10:13], owner)
		require.NoError(t, err)
		cached, err = a.Park(nil, hs[13:16], owner)
		require.NoError(t, err)
		require.NoError(t, a.Check())
		return a, private, shared, quarantined, cached, hs[16] // other: in use, in no batch
	}
	a, private, shared, quarantined, cached, other := setup(t)
	freePage := a.PeekFree(nil, 1)[0]
	good := append(append([]Handle(nil), private...), shared...) // interleaved below
	good = []Handle{good[0], good[6], good[1], good[7], good[2], good[8], good[3], good[9], good[4], good[5]}
	badHandles := []struct {
		name string
		h    Handle
		want error
	}{
		{"out of range", Handle{Page: 99}, ErrInvalidArgument},
		{"negative", Handle{Page: -3}, ErrInvalidArgument},
		{"stale", Handle{Page: other.Page, Gen: other.Gen + 1}, ErrStaleHandle},
		{"free", Handle{Page: freePage}, ErrDoubleFree},
		{"quarantined", Handle{Page: quarantined[0], Gen: 1}, ErrDoubleFree},
		{"cached", Handle{Page: cached[0]}, ErrDoubleFree},
		{"a private page twice", private[3], ErrDoubleFree},
		{"a shared page twice", shared[1], ErrDoubleFree},
	}
	for _, op := range []struct {
		name string
		f    func([]int32, []Handle, Owner) ([]int32, error)
	}{{"release", a.Release}, {"park", a.Park}} {
		for _, bad := range badHandles {
			for at := 0; at <= len(good); at++ {
				batch := slices.Insert(slices.Clone(good), at, bad.h)
				if bad.h == private[3] && at <= slices.Index(good, private[3]) ||
					bad.h == shared[1] && at <= slices.Index(good, shared[1]) {
					continue // then the repeat is the good one, after the bad
				}
				before := snapshot(a)
				out, err := op.f([]int32{-7}, batch, owner)
				require.ErrorIs(t, err, bad.want, "%s, %s at %d", op.name, bad.name, at)
				require.Equal(t, []int32{-7}, out, "%s, %s at %d: the output slice grew", op.name, bad.name, at)
				require.Equal(t, before, snapshot(a), "%s, %s at %d changed the allocator", op.name, bad.name, at)
				require.NoError(t, a.Check())
			}
		}
		before := snapshot(a)
		_, err := op.f(nil, good, owner+1)
		require.ErrorIs(t, err, ErrNotOwner, "%s of another owner's pages", op.name)
		require.Equal(t, before, snapshot(a))
	}

	for _, op := range []struct {
		name   string
		f      func([]int32) error
		pages  []int32
		wrong  int32 // a page in another state
		repeat int   // index into pages of a page to repeat
	}{
		{"clean", a.Clean, quarantined, private[0].Page, 1},
		{"retire", a.Retire, quarantined, cached[0], 2},
		{"evict", a.Evict, cached, quarantined[0], 0},
		{"unclean", a.Unclean, a.PeekFree(nil, 4), private[0].Page, 3},
	} {
		for _, bad := range []struct {
			name string
			p    int32
			want error
		}{
			{"out of range", 99, ErrInvalidArgument},
			{"negative", -1, ErrInvalidArgument},
			{"in the wrong state", op.wrong, ErrWrongState},
			{"twice", op.pages[op.repeat], ErrInvalidArgument},
		} {
			for at := 0; at <= len(op.pages); at++ {
				if bad.name == "twice" && at <= op.repeat {
					continue
				}
				batch := slices.Insert(slices.Clone(op.pages), at, bad.p)
				before := snapshot(a)
				require.ErrorIs(t, op.f(batch), bad.want, "%s, %s at %d", op.name, bad.name, at)
				require.Equal(t, before, snapshot(a), "%s, %s at %d changed the allocator", op.name, bad.name, at)
				require.NoError(t, a.Check())
			}
		}
	}
	// And the good batches still apply in full.
	_, err := a.Release(nil, good, owner)
	require.NoError(t, err)
	require.NoError(t, a.Check())
	assert.Equal(t, 5, a.Count(InUse), "one reference left on each shared page, and other")
}

// model is the reference: a map from page to its state and holder.
type model struct {
	state map[int32]State
	owner map[int32]Owner
	gen   map[int32]uint32
	refs  map[int32]int
}

func TestAllocOneRefusesAndChangesNothing(t *testing.T) {
	a := mustNew(t, 2)
	_, ok := a.AllocOne(0)
	assert.False(t, ok, "owner 0 is nobody")
	assert.Equal(t, 2, a.Count(Free))
	h1, ok1 := a.AllocOne(7)
	h2, ok2 := a.AllocOne(7)
	require.True(t, ok1 && ok2)
	assert.Equal(t, []int32{0, 1}, []int32{h1.Page, h2.Page}, "low pages first, as Alloc")
	_, ok = a.AllocOne(7)
	assert.False(t, ok, "no page is free")
	assert.Equal(t, 2, a.Count(InUse))
	info, err := a.Info(1)
	require.NoError(t, err)
	assert.Equal(t, PageInfo{State: InUse, Owner: 7, Gen: h2.Gen, Refs: 1}, info)
	require.NoError(t, a.Check())
}

func TestRandomOperationsAgainstModel(t *testing.T) {
	const n = 64
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 1))
		runModel(t, n, func() int { return rng.IntN(1 << 16) }, 400)
	}
}

// runModel drives random operations chosen by next() and compares the
// allocator with the model after each step.
func runModel(t *testing.T, n int, next func() int, steps int) {
	a := mustNew(t, n)
	m := model{map[int32]State{}, map[int32]Owner{}, map[int32]uint32{}, map[int32]int{}}
	for p := range int32(n) {
		m.state[p] = Free
	}
	var held []Handle // one entry per reference
	owners := func(h Handle) Owner { return m.owner[h.Page] }
	inState := func(s State) []int32 {
		var out []int32
		for p := range int32(n) {
			if m.state[p] == s {
				out = append(out, p)
			}
		}
		return out
	}
	for range steps {
		switch next() % 7 {
		case 0: // alloc
			k := next() % 6
			owner := Owner(1 + next()%3)
			hs, err := a.Alloc(nil, k, owner)
			if k == 1 && next()%2 == 0 { // the same page by AllocOne
				require.NoError(t, a.Check())
				if err == nil {
					_, err = a.Release(nil, hs, owner)
					require.NoError(t, err)
					// back on top of the stack, its generation advanced
					require.NoError(t, a.Clean([]int32{hs[0].Page}))
					h, ok := a.AllocOne(owner)
					require.True(t, ok)
					require.Equal(t, hs[0].Page, h.Page, "AllocOne took another page than Alloc")
					m.gen[h.Page]++
					hs[0] = h
				} else {
					_, ok := a.AllocOne(owner)
					require.False(t, ok)
				}
			}
			if k > len(inState(Free)) {
				require.ErrorIs(t, err, ErrNoSpace)
				break
			}
			require.NoError(t, err)
			for _, h := range hs {
				require.Equal(t, Free, m.state[h.Page], "allocated a page that was not free")
				require.Equal(t, m.gen[h.Page], h.Gen)
				m.state[h.Page], m.owner[h.Page], m.refs[h.Page] = InUse, owner, 1
				held = append(held, h)
			}
		case 1, 2: // release or park one reference
			if len(held) == 0 {
				break
			}
			i := next() % len(held)
			h := held[i]
			park := next()%2 == 0
			var out []int32
			var err error
			if park {
				out, err = a.Park(nil, []Handle{h}, owners(h))
			} else {
				out, err = a.Release(nil, []Handle{h}, owners(h))
			}
			require.NoError(t, err)
			held = append(held[:i], held[i+1:]...)
			m.refs[h.Page]--
			if m.refs[h.Page] == 0 {
				require.Equal(t, []int32{h.Page}, out)
				if park {
					m.state[h.Page] = Cached
				} else {
					m.state[h.Page] = Quarantined
					m.gen[h.Page]++
				}
			} else {
				require.Empty(t, out)
			}
		case 3: // retain a held or cached page
			cands := append(inState(InUse), inState(Cached)...)
			if len(cands) == 0 {
				break
			}
			p := cands[next()%len(cands)]
			h, err := a.Retain(p, m.owner[p])
			require.NoError(t, err)
			m.state[p] = InUse
			m.refs[p]++
			held = append(held, h)
		case 4: // evict a cached page
			if c := inState(Cached); len(c) > 0 {
				p := c[next()%len(c)]
				require.NoError(t, a.Evict([]int32{p}))
				m.state[p] = Quarantined
				m.gen[p]++
			}
		case 5: // clean or retire quarantined pages
			if qs := inState(Quarantined); len(qs) > 0 {
				if next()%5 == 0 {
					require.NoError(t, a.Retire(qs[:1]))
					m.state[qs[0]] = Retired
				} else {
					require.NoError(t, a.Clean(qs))
					for _, p := range qs {
						m.state[p] = Free
					}
				}
			}
		case 6: // a bad release: stale or foreign handle
			if len(held) == 0 {
				break
			}
			h := held[next()%len(held)]
			before := snapshot(a)
			_, err := a.Release(nil, []Handle{{Page: h.Page, Gen: h.Gen + 1}}, owners(h))
			require.True(t, errors.Is(err, ErrStaleHandle))
			_, err = a.Release(nil, []Handle{h}, owners(h)+7)
			require.True(t, errors.Is(err, ErrNotOwner))
			require.Equal(t, before, snapshot(a))
			// A batch of good handles of h's owner (each page once) with a
			// stale one at any place: the pages before it, already applied
			// in the one pass, are put back.
			var batch []Handle
			seen := map[int32]bool{}
			for _, g := range held {
				if owners(g) == owners(h) && !seen[g.Page] && len(batch) < 6 {
					seen[g.Page] = true
					batch = append(batch, g)
				}
			}
			at := next() % (len(batch) + 1)
			batch = append(batch[:at], append([]Handle{{Page: h.Page, Gen: h.Gen + 1}}, batch[at:]...)...)
			if next()%2 == 0 {
				_, err = a.Park(nil, batch, owners(h))
			} else {
				_, err = a.Release(nil, batch, owners(h))
			}
			require.Error(t, err)
			require.Equal(t, before, snapshot(a), "a batch with a bad handle at %d of %d changed the allocator", at, len(batch))
			// The same for a Clean of the quarantined pages with a page that
			// is not quarantined in it.
			if qs := inState(Quarantined); len(qs) > 0 {
				at := next() % (len(qs) + 1)
				bad := append(append(append([]int32(nil), qs[:at]...), h.Page), qs[at:]...)
				require.ErrorIs(t, a.Clean(bad), ErrWrongState)
				require.Equal(t, before, snapshot(a), "a clean with a bad page at %d of %d changed the allocator", at, len(bad))
			}
		}
		require.NoError(t, a.Check())
		for p := range int32(n) {
			info, err := a.Info(p)
			require.NoError(t, err)
			require.Equal(t, m.state[p], info.State, "page %d", p)
			require.Equal(t, m.gen[p], info.Gen, "page %d", p)
			require.Equal(t, m.refs[p], info.Refs, "page %d", p)
		}
	}
}

// FuzzAllocatorOps drives operation sequences taken from the fuzz input.
func FuzzAllocatorOps(f *testing.F) {
	f.Add([]byte{0, 3, 1, 0, 2, 5, 5, 4, 3, 0, 0})
	f.Add([]byte{0, 5, 0, 5, 1, 1, 2, 2, 3, 4, 5, 6, 6, 6})
	f.Add([]byte("random allocator operation sequence"))
	f.Fuzz(func(t *testing.T, ops []byte) {
		i := 0
		next := func() int {
			if i >= len(ops) {
				return 0
			}
			i++
			return int(ops[i-1])
		}
		runModel(t, 8, next, min(len(ops)/2+1, 256)) // bounded work per input
	})
}

// BenchmarkAllocFree takes and gives back 128-page batches (Alloc +
// Release + Clean) on a churned free list, and reports ns per page and
// x_floor, its ratio to the same cycle on a plain stack of page IDs
// (stackFloor). The two run in alternating slices of the same loop, so
// that a change in the machine's load shows in both.
func BenchmarkAllocFree(b *testing.B) {
	const batch, slice = 128, 1024 // cycles per slice of each side
	for _, n := range []int{1024, 1 << 20} {
		b.Run(fmt.Sprintf("pages=%d", n), func(b *testing.B) {
			a := mustNew(b, n)
			// Churn once so the free list is not in pristine order.
			hs, _ := a.Alloc(nil, n/2, 1)
			rand.New(rand.NewPCG(1, 2)).Shuffle(len(hs), func(i, j int) { hs[i], hs[j] = hs[j], hs[i] })
			q, _ := a.Release(nil, hs, 1)
			if err := a.Clean(q); err != nil {
				b.Fatal(err)
			}
			floor := newStackFloor(n, batch)
			handles := make([]Handle, 0, batch)
			scratch := make([]int32, 0, batch)
			var failed error
			var own, base time.Duration
			cycles, floorCycles := 0, 0
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if cycles%slice == 0 && cycles > 0 {
					own += time.Since(floor.mark)
					b.StopTimer()
					base += floor.run(slice)
					floorCycles += slice
					b.StartTimer()
					floor.mark = time.Now()
				} else if cycles == 0 {
					floor.mark = time.Now()
				}
				var err1, err2, err3 error
				handles, err1 = a.Alloc(handles[:0], batch, 1)
				scratch, err2 = a.Release(scratch[:0], handles, 1)
				err3 = a.Clean(scratch)
				if err1 != nil || err2 != nil || err3 != nil {
					failed = errors.Join(err1, err2, err3)
				}
				cycles++
			}
			own += time.Since(floor.mark)
			b.StopTimer()
			if floorCycles == 0 { // too few cycles for a slice: one of the same length
				base += floor.run(cycles)
				floorCycles = cycles
			}
			perPage := float64(own.Nanoseconds()) / float64(cycles*batch)
			b.ReportMetric(perPage, "ns/page")
			b.ReportMetric(perPage/(float64(base.Nanoseconds())/float64(floorCycles*batch)), "x_floor")
			// Checked after the loop, so that the check costs nothing per
			// cycle: every cycle took and gave back the whole batch.
			if failed != nil {
				b.Fatal(failed)
			}
			if len(handles) != batch || len(scratch) != batch || a.Count(Free) != n {
				b.Fatalf("last cycle: %d handles, %d released, %d of %d free", len(handles), len(scratch), a.Count(Free), n)
			}
			if err := a.Check(); err != nil {
				b.Fatal(err)
			}
			if err := floor.check(n); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// stackFloor is the floor BenchmarkAllocFree is measured against: the
// same cycles on a plain stack of page IDs with one metadata store per
// page taken and one per page given back (what any allocator must at
// least do), on a churned stack of n pages.
type stackFloor struct {
	stack, taken []int32
	meta         []pageMeta
	batch        int
	mark         time.Time // scratch of the benchmark's own timing
}

func newStackFloor(n, batch int) *stackFloor {
	f := &stackFloor{stack: make([]int32, n), meta: make([]pageMeta, n), taken: make([]int32, 0, batch), batch: batch}
	for i, p := range rand.New(rand.NewPCG(3, 4)).Perm(n) {
		f.stack[i] = int32(p)
	}
	return f
}

// run runs cycles cycles and returns the time they took.
func (f *stackFloor) run(cycles int) time.Duration {
	start := time.Now()
	stack, taken, meta, batch := f.stack, f.taken, f.meta, f.batch
	for range cycles {
		top := len(stack)
		taken = append(taken[:0], stack[top-batch:]...)
		stack = stack[:top-batch]
		for _, p := range taken {
			meta[p].word = packed(InUse, 1)
		}
		for i := len(taken) - 1; i >= 0; i-- {
			meta[taken[i]].word = packed(Free, 0)
			stack = append(stack, taken[i])
		}
	}
	f.stack, f.taken = stack, taken
	return time.Since(start)
}

// check verifies that every cycle gave back what it took.
func (f *stackFloor) check(n int) error {
	if len(f.stack) != n || (len(f.taken) > 0 && f.meta[f.taken[0]].state() != Free) {
		return fmt.Errorf("floor: %d of %d pages back", len(f.stack), n)
	}
	return nil
}
