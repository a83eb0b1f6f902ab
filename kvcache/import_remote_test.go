package kvcache

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// lendSetup exports a prefilled lease of prompt tokens from one pool and
// begins its import into another, and returns the export and the
// import.
func lendSetup(t *testing.T, prompt int) (src, dst *Pool, out *Outgoing, in *Incoming) {
	t.Helper()
	src, dst = handoffPool(t, 32), handoffPool(t, 32)
	out, err := prefilled(t, src, "r", prompt).Export(time.Now().Add(time.Minute))
	require.NoError(t, err)
	in, err = dst.TryBeginImport(Request{ID: "r", Tenant: "a", PromptTokens: prompt}, out.Domain(), mustChecksum(t, out))
	require.NoError(t, err)
	return src, dst, out, in
}

// writeRuns copies the export's units into the loan's runs, as a
// transport writing remote memory does.
func writeRuns(t *testing.T, dst *Pool, out *Outgoing, l *PageLoan) {
	t.Helper()
	units := make([]byte, out.Bytes())
	require.NoError(t, out.ReadUnits(0, units))
	at := make([]int64, out.Units()+1) // where each unit starts in units
	for u := range out.Units() {
		at[u+1] = at[u] + out.UnitBytes(u)
	}
	for _, run := range l.Runs() {
		var g *group
		for gi := range dst.groups {
			if gg := &dst.groups[gi]; gg.first <= run.Region && run.Region < gg.first+gg.count {
				g = gg
			}
		}
		var roff int64 // the region's offset in a unit of its group
		for r := g.first; r < run.Region; r++ {
			roff += dst.lay.regions[r].PageBytes
		}
		rb := int(dst.lay.regions[run.Region].PageBytes)
		for i := range run.Units {
			src := units[at[run.First+i]+roff:]
			copy(run.Mem[i*rb:(i+1)*rb], src[:rb])
		}
	}
}

func loanPins(in *Incoming) int {
	in.pool.mu.Lock()
	defer in.pool.mu.Unlock()
	return in.lease.pins
}

// A loan lists every prompt page of every region exactly once, adjacent
// pages in one run; what the transport writes into it, once landed and
// the loan returned, completes the import against the sender's checksum.
func TestLendPagesRoundTrip(t *testing.T) {
	_, dst, out, in := lendSetup(t, 10) // 3 pages of 4 tokens
	require.True(t, in.Lendable())
	l, err := in.LendPages()
	require.NoError(t, err)
	assert.Equal(t, 1, loanPins(in))
	seen := map[[2]int]bool{}
	for _, run := range l.Runs() {
		assert.Equal(t, run.Units*int(dst.lay.regions[run.Region].PageBytes), len(run.Mem))
		for i := range run.Units {
			key := [2]int{run.Region, run.First + i}
			assert.False(t, seen[key], "page %d of region %d lent twice", run.First+i, run.Region)
			seen[key] = true
		}
	}
	regions := len(dst.Spec().Groups[0].Regions)
	assert.Len(t, seen, 3*regions)
	assert.Len(t, l.Runs(), regions, "a fresh pool's pages are adjacent: one run per region")

	writeRuns(t, dst, out, l)
	require.NoError(t, l.Landed(0, 2))
	require.NoError(t, l.Landed(2, 1))
	l.Return()
	l.Return() // later calls do nothing
	assert.Zero(t, loanPins(in))
	lease, err := in.Complete()
	require.NoError(t, err)
	assert.Equal(t, PhasePrefilled, lease.Phase())
	pb := int(out.UnitBytes(0))
	want, got := make([]byte, 3*pb), make([]byte, 3*pb)
	require.NoError(t, out.ReadUnits(0, want))
	table, err := lease.BlockTable()
	require.NoError(t, err)
	host := hostOf(t, dst)
	for i, pg := range table[:3] {
		off := i * pb
		for r := range dst.Geometry().Regions() {
			off += copy(got[off:], host.PageBytes(r, pg))
		}
	}
	assert.Equal(t, want, got)
	require.NoError(t, lease.Release())
	require.NoError(t, out.Ack())
	require.NoError(t, dst.Check())
}

// Pages that are not adjacent in the pool are lent in runs of their own.
func TestLendPagesRunsFollowThePool(t *testing.T) {
	src, dst := handoffPool(t, 32), handoffPool(t, 32)
	// Pages 0..5 taken, every other one released: the import gets holes.
	var held []*Lease
	for i := range 6 {
		l, err := dst.TryAdmit(Request{ID: string(rune('a' + i)), Tenant: "a", PromptTokens: 4})
		require.NoError(t, err)
		held = append(held, l)
	}
	for i, l := range held {
		if i%2 == 0 {
			require.NoError(t, l.Release())
		}
	}
	out, err := prefilled(t, src, "r", 20).Export(time.Now().Add(time.Minute)) // 5 pages
	require.NoError(t, err)
	in, err := dst.TryBeginImport(Request{ID: "r", Tenant: "a", PromptTokens: 20}, out.Domain(), mustChecksum(t, out))
	require.NoError(t, err)
	l, err := in.LendPages()
	require.NoError(t, err)
	assert.Greater(t, len(l.Runs()), 2, "runs: %+v", l.Runs())
	covered := 0
	for _, run := range l.Runs() {
		covered += run.Units
	}
	assert.Equal(t, 5*len(dst.Spec().Groups[0].Regions), covered)
	writeRuns(t, dst, out, l)
	require.NoError(t, l.Landed(0, 5))
	l.Return()
	lease, err := in.Complete()
	require.NoError(t, err)
	require.NoError(t, lease.Release())
	for i, l := range held {
		if i%2 == 1 {
			require.NoError(t, l.Release())
		}
	}
	require.NoError(t, out.Ack())
	require.NoError(t, dst.Check())
}

// Landed refuses a range outside the import, a page twice and a returned
// loan, without aborting the import; Complete refuses pages that never
// landed.
func TestLandedRefusals(t *testing.T) {
	_, dst, out, in := lendSetup(t, 10)
	l, err := in.LendPages()
	require.NoError(t, err)
	writeRuns(t, dst, out, l)
	assert.ErrorIs(t, l.Landed(-1, 1), ErrInvalidArgument)
	assert.ErrorIs(t, l.Landed(2, 2), ErrInvalidArgument)
	assert.ErrorIs(t, l.Landed(0, 0), ErrInvalidArgument)
	require.NoError(t, l.Landed(0, 1))
	assert.ErrorIs(t, l.Landed(0, 2), ErrDuplicatePage)
	require.NoError(t, l.Landed(1, 1), "a refused range lands nothing")
	l.Return()
	assert.ErrorIs(t, l.Landed(2, 1), ErrStaleTransfer)
	_, err = in.Complete()
	assert.ErrorIs(t, err, ErrIncompleteTransfer)
	require.NoError(t, out.Abort())
	assert.Zero(t, dst.Stats().InUsePages)
	require.NoError(t, dst.Check())
}

// Pages already received, or a loan already out, cannot be lent; pages
// lent cannot be written until the loan is returned, and those that never
// landed can be written then.
func TestLendAndWritePagesExclude(t *testing.T) {
	_, dst, out, in := lendSetup(t, 10)
	pb := int(out.UnitBytes(0))
	page := make([]byte, pb)
	require.NoError(t, out.ReadUnits(2, page))
	require.NoError(t, in.WriteUnits(2, page))
	_, err := in.LendPages()
	assert.ErrorIs(t, err, ErrDuplicatePage)
	assert.Zero(t, loanPins(in), "a refused loan pins nothing")
	require.NoError(t, out.Abort())
	require.NoError(t, in.Abort())

	_, dst, out, in = lendSetup(t, 10)
	l, err := in.LendPages()
	require.NoError(t, err)
	_, err = in.LendPages()
	assert.ErrorIs(t, err, ErrDuplicatePage, "a second loan")
	writeRuns(t, dst, out, l)
	require.NoError(t, l.Landed(0, 1))
	l.Return()
	// Pages 1 and 2 never landed: written now.
	pages := make([]byte, 2*pb)
	require.NoError(t, out.ReadUnits(1, pages))
	require.NoError(t, in.WriteUnits(1, pages))
	lease, err := in.Complete()
	require.NoError(t, err)
	require.NoError(t, lease.Release())
	require.NoError(t, out.Ack())
	require.NoError(t, dst.Check())
}

// Every end of the import waits for the loan: an abort that comes while
// the pages are lent scrubs them only once the loan is returned.
func TestAbortWaitsForTheLoan(t *testing.T) {
	_, dst, out, in := lendSetup(t, 10)
	l, err := in.LendPages()
	require.NoError(t, err)
	writeRuns(t, dst, out, l)
	aborted := make(chan struct{})
	go func() {
		in.Abort()
		close(aborted)
	}()
	select {
	case <-aborted:
		t.Fatal("the abort did not wait for the loan")
	case <-time.After(50 * time.Millisecond):
	}
	assert.Positive(t, dst.Stats().InUsePages, "pages scrubbed while lent")
	l.Return()
	<-aborted
	assert.Zero(t, dst.Stats().InUsePages)
	lease, err := in.Complete()
	assert.Error(t, err, "an aborted import completed")
	assert.Nil(t, lease)
	_, err = in.LendPages()
	assert.ErrorIs(t, err, ErrStaleTransfer, "a loan of an import that ended")
	require.NoError(t, out.Abort())
	require.NoError(t, dst.Check())
	// The pool's canary policy checks the scrubbed pages at their next
	// admission: the prefill's bytes are gone.
	lease, err = dst.TryAdmit(Request{ID: "next", Tenant: "a", PromptTokens: 32 * 4})
	require.NoError(t, err)
	require.NoError(t, lease.Release())
	assert.Zero(t, dst.Stats().Scrub.CanaryFailures)
}

// opaqueDevice hides the Host's page memory: a device whose pages are
// not host memory.
type opaqueDevice struct{ cudaops.Device }

// A pool whose pages are not host memory lends none.
func TestLendPagesNeedsHostMemory(t *testing.T) {
	g := Geometry{TokensPerPage: 4, Layers: 2, KVHeads: 1, HeadDim: 4, DType: FP16}
	dst, err := New(Config{
		Device:   opaqueDevice{canaryDevice(t, g, 8, ScrubPolicy{Kind: ScrubCanary})},
		Geometry: g, Pages: 8, MaxContextTokens: 32,
		Tenants: []TenantConfig{{Name: "a"}}, Scrub: ScrubPolicy{Kind: ScrubCanary},
	})
	require.NoError(t, err)
	defer dst.Close()
	in, err := dst.TryBeginImport(Request{ID: "r", Tenant: "a", PromptTokens: 8}, "tenant:a", 0)
	require.NoError(t, err)
	assert.False(t, in.Lendable())
	_, err = in.LendPages()
	assert.ErrorIs(t, err, ErrInvalidArgument)
	assert.Zero(t, loanPins(in))
	require.NoError(t, in.Abort())
}

// A hybrid prompt's every unit is lent: the per-token pages, the
// window's pages at the prompt's end and the state slot, each region's
// in runs; written through the loan and landed, it completes, and the
// decode lease holds exactly what prefill wrote, in every group.
func TestLendPagesOfEveryGroup(t *testing.T) {
	for _, prompt := range []int{3, 30} {
		src, dst := newPool(t, bigStateConfig()), newPool(t, bigStateConfig())
		l := prefillHybrid(t, src, "r", "a", prompt)
		out, err := l.Export(time.Now().Add(time.Minute))
		require.NoError(t, err)
		in, err := dst.TryBeginImport(Request{ID: "r", Tenant: "a", PromptTokens: prompt, MaxNewTokens: 40}, l.Domain(), mustChecksum(t, out))
		require.NoError(t, err)
		loan, err := in.LendPages()
		require.NoError(t, err)
		regions := map[int]int{} // units lent per region
		for _, run := range loan.Runs() {
			regions[run.Region] += run.Units
		}
		assert.Len(t, regions, len(dst.lay.regions), "every region of every group is lent")
		writeRuns(t, dst, out, loan)
		require.NoError(t, loan.Landed(0, in.Units()))
		loan.Return()
		lease, err := in.Complete()
		require.NoError(t, err)
		requireHybridContent(t, dst, lease, "r")
		require.NoError(t, lease.Release())
		require.NoError(t, out.Ack())
		require.NoError(t, dst.Check())
	}
}
