package cudaops

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
)

// Group is one Device over the GPUs of a tensor-parallel group in one
// process. Every rank numbers pages the same way and holds its own shard of
// every region, so a page of the group is the concatenation of the
// members' shards, rank 0 first: region r of the group has the members'
// region r side by side. A Fill fans out to every member and its Fence
// completes when all of theirs have; the first error wins, and a member
// that fails to queue fails the whole fill (the pages must then be taken
// as dirty on every rank).
//
// AllocRegion splits a page's bytes over the members in 4-byte words,
// as evenly as they go (the first members take the remainder). Regions
// reports the group's view: Base 0 (there is no one address; an engine
// takes each member's own Regions for its kernels), Stride = PageBytes =
// the sum of the shards, Pages the smallest member's.
//
// Orderings: 0, StreamLegacy and StreamPerThread name the same thing in
// every member's context and apply to all. A specific stream or event
// belongs to one member's context: that member waits for it and the others
// take the zero Ordering (a context synchronisation). An engine with a
// stream per GPU passes them all with FillAfter.
type Group struct {
	members []Device
	name    string
	closed  atomic.Bool
}

var (
	_ Device          = (*Group)(nil)
	_ OrderingChecker = (*Group)(nil)
)

// NewGroup returns the group of members, rank order. The group owns them:
// its Close closes them.
func NewGroup(members ...Device) (*Group, error) {
	if len(members) == 0 {
		return nil, fmt.Errorf("%w: a group needs at least one device", ErrInvalidArgument)
	}
	names := make([]string, len(members))
	for i, m := range members {
		if m == nil {
			return nil, fmt.Errorf("%w: group member %d is nil", ErrInvalidArgument, i)
		}
		names[i] = m.Name()
	}
	return &Group{members: members, name: "group[" + strings.Join(names, ", ") + "]"}, nil
}

// Members returns the group's devices, rank order.
func (g *Group) Members() []Device { return append([]Device(nil), g.members...) }

// Name implements Device.
func (g *Group) Name() string { return g.name }

// shardWords is how many of a page's words member i holds.
func shardWords(words int64, n, i int) int64 {
	w := words / int64(n)
	if int64(i) < words%int64(n) {
		w++
	}
	return w
}

// AllocRegion implements Device. A member that fails leaves the members
// before it with a region the group does not have: the group is then
// unusable for a pool, and the error says so.
func (g *Group) AllocRegion(pages int, pageBytes int64) (int, error) {
	if g.closed.Load() {
		return 0, ErrClosed
	}
	r := Region{Stride: pageBytes, PageBytes: pageBytes, Pages: pages}
	if err := r.Validate(); err != nil {
		return 0, err
	}
	if pageBytes/4 < int64(len(g.members)) {
		return 0, fmt.Errorf("%w: a page of %d bytes cannot be split over %d devices", ErrInvalidArgument, pageBytes, len(g.members))
	}
	idx := -1
	for i, m := range g.members {
		j, err := m.AllocRegion(pages, 4*shardWords(pageBytes/4, len(g.members), i))
		if err != nil {
			return 0, fmt.Errorf("allocating the shard of member %d (%s): %w", i, m.Name(), err)
		}
		if idx >= 0 && j != idx {
			return 0, fmt.Errorf("%w: member %d added region %d, member 0 region %d: members must hold the same regions", ErrInvalidArgument, i, j, idx)
		}
		idx = j
	}
	return idx, nil
}

// Regions implements Device: the group's view (see the type).
func (g *Group) Regions() []Region {
	var out []Region
	for i, m := range g.members {
		rs := m.Regions()
		if i == 0 {
			out = make([]Region, len(rs))
			for r := range out {
				out[r].Pages = rs[r].Pages
			}
		}
		for r := range min(len(rs), len(out)) {
			out[r].PageBytes += rs[r].PageBytes
			out[r].Pages = min(out[r].Pages, rs[r].Pages)
		}
		out = out[:min(len(rs), len(out))]
	}
	for r := range out {
		out[r].Stride = out[r].PageBytes
	}
	return out
}

// Fill implements Device; see the type for how after is applied.
func (g *Group) Fill(pages []int32, spec FillSpec, after Ordering) (Fence, error) {
	if g.closed.Load() {
		return nil, ErrClosed
	}
	orders := make([]Ordering, len(g.members))
	if contextRelative(after) {
		for i := range orders {
			orders[i] = after
		}
	} else {
		owner := -1
		for i, m := range g.members {
			if c, ok := m.(OrderingChecker); !ok || c.CheckOrdering(after) == nil {
				owner = i
				break
			}
		}
		if owner < 0 {
			return nil, badOrdering("stream %#x / event %#x belongs to no device of %s", after.Stream, after.Event, g.name)
		}
		orders[owner] = after
	}
	return g.FillAfter(pages, spec, orders)
}

// contextRelative reports whether after means the same in every context.
func contextRelative(after Ordering) bool {
	return after.Event == 0 && (after.Stream == 0 || after.Stream == StreamLegacy || after.Stream == StreamPerThread)
}

// FillAfter is Fill with one Ordering per member, rank order.
func (g *Group) FillAfter(pages []int32, spec FillSpec, after []Ordering) (Fence, error) {
	if g.closed.Load() {
		return nil, ErrClosed
	}
	if len(after) != len(g.members) {
		return nil, fmt.Errorf("%w: %d orderings for %d devices", ErrInvalidArgument, len(after), len(g.members))
	}
	if err := CheckPages(g.Regions(), pages); err != nil {
		return nil, err
	}
	for i, m := range g.members {
		if c, ok := m.(OrderingChecker); ok {
			if err := c.CheckOrdering(after[i]); err != nil {
				return nil, fmt.Errorf("member %d (%s): %w", i, m.Name(), err)
			}
		}
	}
	fences := make(groupFence, 0, len(g.members))
	for i, m := range g.members {
		f, err := m.Fill(pages, spec, after[i])
		if err != nil {
			// The members before this one have queued their fill: the
			// batch is dirty as far as anyone knows.
			return nil, fmt.Errorf("member %d (%s) of %d: %w", i, m.Name(), len(g.members), err)
		}
		fences = append(fences, f)
	}
	return fences, nil
}

// CheckOrdering implements OrderingChecker: a context-relative ordering
// must suit every member, a specific one some member.
func (g *Group) CheckOrdering(after Ordering) error {
	var errs []error
	for i, m := range g.members {
		c, ok := m.(OrderingChecker)
		if !ok {
			if !contextRelative(after) {
				return nil
			}
			continue
		}
		err := c.CheckOrdering(after)
		if err == nil && !contextRelative(after) {
			return nil
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("member %d (%s): %w", i, m.Name(), err))
		}
	}
	if contextRelative(after) || len(errs) == 0 {
		return errors.Join(errs...)
	}
	return badOrdering("stream %#x / event %#x belongs to no device of %s: %w", after.Stream, after.Event, g.name, errors.Join(errs...))
}

// groupFence completes when every member's fence has.
type groupFence []Fence

func (f groupFence) Done() (bool, error) {
	var first error
	for _, m := range f {
		done, err := m.Done()
		if !done {
			return false, nil
		}
		if first == nil {
			first = err
		}
	}
	return true, first
}

func (f groupFence) Wait() error {
	var first error
	for _, m := range f {
		if err := m.Wait(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// shards splits a buffer of one group page of region r into the members'
// shards.
func (g *Group) shards(r int, n int) ([][2]int, error) {
	if g.closed.Load() {
		return nil, ErrClosed
	}
	regs := g.Regions()
	if r < 0 || r >= len(regs) {
		return nil, fmt.Errorf("%w: region %d of %d", ErrInvalidArgument, r, len(regs))
	}
	if int64(n) != regs[r].PageBytes {
		return nil, fmt.Errorf("%w: buffer of %d bytes for a page of %d", ErrInvalidArgument, n, regs[r].PageBytes)
	}
	spans := make([][2]int, len(g.members))
	off := 0
	for i, m := range g.members {
		pb := int(m.Regions()[r].PageBytes)
		spans[i] = [2]int{off, off + pb}
		off += pb
	}
	return spans, nil
}

// ReadPage implements Device: each member's shard, rank order.
func (g *Group) ReadPage(r int, p int32, dst []byte) error {
	spans, err := g.shards(r, len(dst))
	if err != nil {
		return err
	}
	for i, m := range g.members {
		if err := m.ReadPage(r, p, dst[spans[i][0]:spans[i][1]]); err != nil {
			return fmt.Errorf("member %d: %w", i, err)
		}
	}
	return nil
}

// WritePage implements Device: each member's shard, rank order.
func (g *Group) WritePage(r int, p int32, src []byte) error {
	spans, err := g.shards(r, len(src))
	if err != nil {
		return err
	}
	for i, m := range g.members {
		if err := m.WritePage(r, p, src[spans[i][0]:spans[i][1]]); err != nil {
			return fmt.Errorf("member %d: %w", i, err)
		}
	}
	return nil
}

// Counters implements Device: the members' sums, except PagesFilled and
// FillCalls, which count the group's own (each member fills every page).
func (g *Group) Counters() Counters {
	var c Counters
	for i, m := range g.members {
		mc := m.Counters()
		if i == 0 {
			c.FillCalls, c.PagesFilled = mc.FillCalls, mc.PagesFilled
		}
		c.Launches += mc.Launches
		c.BytesFilled += mc.BytesFilled
	}
	return c
}

// Close implements Device: it closes every member.
func (g *Group) Close() error {
	if g.closed.Swap(true) {
		return nil
	}
	var errs []error
	for _, m := range g.members {
		errs = append(errs, m.Close())
	}
	return errors.Join(errs...)
}
