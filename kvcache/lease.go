package kvcache

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/kvcache/internal/tenancy"
)

const (
	leaseUnused uint32 = iota
	leaseLive
	leaseReleased
)

// Lease is an admitted request's hold on its pages: every page the request
// can need, from admission until Release. Its page IDs are the only ones an
// engine may touch on the request's behalf.
//
// Ownership: the fields below are written by the admission that makes the
// lease live (under Pool.mu) and then, except where noted, only read until
// the lease ends.
type Lease struct {
	pool   *Pool
	id     string
	tenant *tenancy.Tenant
	prompt int
	maxNew int
	// The block table, holds[0].pages below, as the lease's own readers
	// see it: they take no lock (publishTable).
	view    atomic.Pointer[[]int32]
	viewLen atomic.Int64
	viewCap int // cap(*view), guarded by Pool.mu; 0 before the first view, -1 to force a new one
	// scrub is scratch for release, reused, guarded by Pool.mu: empty
	// while a scrub of the lease's pages reads its arrays (see
	// scrubBatch.scratch).
	scrub scrubBatch
	// seq is this incarnation's admission number (Pool.mu.seq): an export
	// or import of the lease belongs to one incarnation only.
	seq     uint64
	state   atomic.Uint32
	written atomic.Int64  // watermark in tokens, | writeSealed while the pages take no writes
	phase   atomic.Uint32 // handoff phase (phase.go); meaningful while state is leaseLive
	// Copies in flight on the pages outside Pool.mu (export.go,
	// import.go), and whether an end of the lease waits for them; both
	// guarded by Pool.mu.
	pins     int
	draining bool
	// export is the lease's export while it is exported (guarded by
	// Pool.mu): its end stops the export's reclaim timer.
	export *Outgoing

	// Prefix sharing (prefix.go). domain is where the lease's pages are
	// owned; tokens are its prompt's token IDs, copied at admission (nil
	// for a request without them); keys are the full-page keys known so
	// far (supplied by the engine, derived for keysFor, or the hits'); its
	// first hitPages pages are shared hits; CachePrefix has considered its
	// pages [0, published). tokens, keys, keysFor and published change
	// under Pool.mu.
	domain    *tenancy.Domain
	adapter   string
	tokens    []int32
	extra     [][]byte // per-page extra key material (pageextra.go), copied at admission
	keys      []BlockKey
	keysFor   *tenancy.Domain
	hitPages  int
	published int

	// Scratch of the admission in progress into this Lease (admit.go),
	// guarded by Pool.mu: its prefix match, its place in the queue and
	// its copies out of the host tier (tier_onload.go). restored is the
	// tokens a swap gave back (HitTokens), set when its copy landed.
	match    leaseMatch
	wait     waiter
	onload   *tierRead // nil until its first admission into a pool with a tier
	restored int
	// restore is the state checkpoint the admission in progress copies
	// into the lease before handing it out (checkpoint.go), guarded by
	// Pool.mu.
	restore *checkpoint

	// holds is what the lease holds in each cache group (groups.go),
	// written under Pool.mu; holds[0].pages is the block table, page IDs
	// in token order (written at admission; Grow appends). inline is
	// holds' array in a pool of one group, so that a Lease of such a pool
	// is one allocation. Last in the struct, away from the atomics above:
	// a growth writes these headers every time, and with them next to
	// view and viewLen a 16-page growth took 15 % longer (BenchmarkGrow,
	// 3 alternating rounds, 42.7-43.7 ns against 37.4-38.0).
	holds  []hold
	inline [1]hold
}

// leaseMatch is an admission's prefix match: entries of the cached prefix,
// found at the index's epoch in domain.
type leaseMatch struct {
	entries []*cacheEntry
	epoch   uint64
	domain  *tenancy.Domain
	valid   bool
	// In a hybrid pool: the checkpoint at the end of entries, and how
	// many matched pages past the last checkpoint were cut.
	ckpt *checkpoint
	cut  int
}

// holdsFor makes l.holds one hold per group of p, keeping what it can
// of the arrays of the lease's last incarnation (which may have lived in
// another pool).
func (l *Lease) holdsFor(p *Pool) []hold {
	if len(l.holds) != len(p.groups) {
		if len(p.groups) <= len(l.inline) {
			l.holds = l.inline[:len(p.groups)]
		} else {
			l.holds = make([]hold, len(p.groups))
		}
		// The block table moves to another hold's array, whose capacity
		// may be the one the view shows: publishTable, which tells
		// arrays by capacity, must store a new view. (A stale view gave
		// the engine page IDs the lease did not hold.)
		l.viewCap = -1
	}
	return l.holds
}

// reset makes l the live incarnation seq of req, admitted for t; its
// holds are taken (takeLocked) and its block table is holds[0].pages.
func (l *Lease) reset(p *Pool, req Request, t *tenancy.Tenant, seq uint64) {
	l.pool, l.id, l.tenant, l.domain, l.seq = p, req.ID, t, t.Domain, seq
	l.prompt, l.maxNew, l.adapter = req.PromptTokens, req.MaxNewTokens, req.Adapter
	l.publishTable(l.holds[0].pages)
	l.written.Store(0)
	l.phase.Store(uint32(PhaseAdmitted))
	l.pins, l.draining, l.export, l.restored = 0, false, nil, 0
	l.state.Store(leaseLive)
}

// publishTable makes the block table (table, which is holds[0].pages)
// what the lease's lock-free readers see. It runs under Pool.mu after every change of the
// table. A new view header is
// needed only when the table moved to a larger array (amortised: append
// doubles, and a lease's table moves to another array of the same
// capacity only with its holds, when holdsFor forces a new view);
// otherwise the readers' array already holds the new entries
// beyond the length they had, and the new length is all there is to
// publish. The view is stored before its length, and tableView loads the
// length first, so a reader never slices past the array it reads.
func (l *Lease) publishTable(table []int32) {
	if cap(table) != l.viewCap {
		l.publishView(table)
	}
	l.viewLen.Store(int64(len(table)))
}

// publishView stores a view of the block table's whole array.
func (l *Lease) publishView(table []int32) {
	hdr := table[:cap(table)]
	l.view.Store(&hdr)
	l.viewCap = cap(hdr)
}

// tableView is the block table as the lease's own readers see it. Its
// entries never change while the lease lives; it only grows.
func (l *Lease) tableView() []int32 {
	n := l.viewLen.Load()
	v := l.view.Load()
	if v == nil {
		return nil
	}
	return (*v)[:n]
}

// errNilLease is what every method of a nil *Lease returns: an engine that
// ignored a refusal and uses the nil lease it got must get an error.
var errNilLease = fmt.Errorf("%w: nil lease (was the admission refused?)", ErrInvalidArgument)

// isLive is live() == nil, cheap enough to inline where a call counts.
func (l *Lease) isLive() bool { return l != nil && l.state.Load() == leaseLive }

func (l *Lease) live() error {
	if l == nil {
		return errNilLease
	}
	switch l.state.Load() {
	case leaseLive:
		return nil
	case leaseReleased:
		return ErrLeaseReleased
	}
	return fmt.Errorf("%w: lease was never admitted", ErrInvalidArgument)
}

// ID returns the request ID.
func (l *Lease) ID() string {
	if l == nil {
		return ""
	}
	return l.id
}

// Tenant returns the tenant's name.
func (l *Lease) Tenant() string {
	if l == nil || l.tenant == nil {
		return ""
	}
	return l.tenant.Name
}

// PromptTokens and MaxNewTokens return the admitted request's sizes.
func (l *Lease) PromptTokens() int {
	if l == nil {
		return 0
	}
	return l.prompt
}

// MaxNewTokens returns the admitted request's output budget.
func (l *Lease) MaxNewTokens() int {
	if l == nil {
		return 0
	}
	return l.maxNew
}

// Pages returns how many pages the lease holds.
func (l *Lease) Pages() int {
	if l == nil {
		return 0
	}
	return int(l.viewLen.Load())
}

// CapacityTokens is the number of token slots the lease's pages hold: at
// least PromptTokens + MaxNewTokens under full sizing, at least the prompt
// (and its headroom) under on-demand sizing, where Grow adds more.
func (l *Lease) CapacityTokens() int {
	if l == nil || l.pool == nil {
		return 0
	}
	return l.Pages() * l.pool.tpp
}

// Live reports whether the lease still holds its pages.
func (l *Lease) Live() bool { return l != nil && l.state.Load() == leaseLive }

// BlockTable returns a copy of the lease's block table: the page IDs, in
// token order, that a paged-attention kernel reads.
func (l *Lease) BlockTable() ([]int32, error) {
	return l.AppendBlockTable(nil)
}

// AppendBlockTable appends the block table to dst, so that an engine can
// fill its own (pinned, reused) buffer without allocating.
func (l *Lease) AppendBlockTable(dst []int32) ([]int32, error) {
	if err := l.live(); err != nil {
		return dst, err
	}
	return append(dst, l.tableView()...), nil
}

// SlotMapping appends to dst the cache slot of each token in [start, end):
// slot = page × TokensPerPage + offset inside the page, the layout vLLM's
// reshape_and_cache kernels take. Slots are where KV is written, so an
// exported lease refuses with ErrLeasePhase (its block table still reads).
func (l *Lease) SlotMapping(start, end int, dst []int64) ([]int64, error) {
	if err := l.live(); err != nil {
		return dst, err
	}
	if l.written.Load()&writeSealed != 0 {
		return dst, l.sealedErr("slot mapping")
	}
	table := l.tableView()
	tpp := l.pool.tpp
	if slots := len(table) * tpp; start < 0 || end < start || end > slots {
		return dst, fmt.Errorf("%w: token range [%d, %d) outside the lease's %d slots",
			ErrInvalidArgument, start, end, slots)
	}
	for tok := start; tok < end; tok++ {
		dst = append(dst, int64(table[tok/tpp])*int64(tpp)+int64(tok%tpp))
	}
	return dst, nil
}

// writeSealed, set in the written watermark, means the lease's pages take
// no writes: they are exported (pinned for a transfer that reads them, and
// whose checksum is already computed) or still being imported. Export sets
// it with a compare-and-swap on the watermark itself, so a Commit racing
// an Export either lands before it (and the export, seeing a watermark
// past the prompt, is refused) or is refused.
const writeSealed int64 = 1 << 62

// sealedErr is the error of a write-path call on a sealed lease.
func (l *Lease) sealedErr(what string) error {
	return fmt.Errorf("%w: %s on lease %q, which is %v: its pages take no writes", ErrLeasePhase, what, l.id, l.Phase())
}

// Commit records that the first n tokens of the lease have been written
// to its pages (the written watermark). The watermark only moves forward
// and stays within the request's prompt + max new tokens and within the
// lease's capacity (an on-demand lease grows first). An exported
// lease refuses with ErrLeasePhase: its pages belong to the transfer. A
// lease delivered by an import takes commits for the tokens it generates.
func (l *Lease) Commit(n int) error {
	if err := l.live(); err != nil {
		return err
	}
	limit := min(l.prompt+l.maxNew, l.CapacityTokens())
	for {
		cur := l.written.Load()
		if cur&writeSealed != 0 {
			return l.sealedErr(fmt.Sprintf("commit of %d tokens", n))
		}
		switch {
		case n < 0 || n > limit:
			return fmt.Errorf("%w: commit of %d tokens, lease holds %d", ErrInvalidArgument, n, limit)
		case int64(n) < cur:
			return fmt.Errorf("%w: commit of %d tokens, %d already written", ErrInvalidArgument, n, cur)
		}
		if l.written.CompareAndSwap(cur, int64(n)) {
			return nil
		}
	}
}

// Written returns the written watermark in tokens.
func (l *Lease) Written() int {
	if l == nil {
		return 0
	}
	return int(l.written.Load() &^ writeSealed)
}

// Release ends the lease. Its pages are scrubbed and return to the pool
// once the scrub has completed. A second Release returns ErrLeaseReleased;
// after Pool.Close, ErrPoolClosed (Close released the lease). An error
// wrapping ErrPoolFaulted means the lease was released but its scrub
// failed: its pages were retired.
func (l *Lease) Release() error { return l.ReleaseAfter(cudaops.Ordering{}) }

// ReleaseAfter is Release for pages the engine's device work may still be
// reading or writing: the scrub is ordered after the named stream or event
// (cudaops.Ordering says what each value means on CUDA). An ordering the
// device refuses returns an error wrapping ErrInvalidArgument and
// cudaops.ErrBadOrdering, and the lease stays live.
func (l *Lease) ReleaseAfter(after cudaops.Ordering) error {
	if err := l.live(); err != nil && !errors.Is(err, ErrLeaseReleased) {
		return err
	} else if err == nil {
		if err := l.pool.checkOrdering(after); err != nil {
			return err
		}
	}
	ended, err := l.pool.endLease(l, nil, 0, after)
	if err == nil && !ended {
		return ErrLeaseReleased
	}
	return err
}
