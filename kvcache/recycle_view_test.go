package kvcache

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// A Lease recycled from a pool of one cache group into a pool of several
// (or back) holds its block table in another hold, whose page array may
// have the capacity of the array its lock-free view still showed: the
// view must show the new incarnation's table, never the old one's. A
// stale view gave an engine (the C ABI recycles its Leases across pools)
// page IDs it did not hold, and it wrote KV into them. Four Leases are
// admitted, grown and released in a random walk over three pools (one
// group of 64 and of 256 pages, three groups), and after each step the
// table readers see is the one the lease holds.
func TestRecycledLeaseShowsItsOwnBlockTable(t *testing.T) {
	pools := []*Pool{newPool(t, tinyConfig(64)), newPool(t, hybridConfig(64, 4)), newPool(t, tinyConfig(256))}
	rng := rand.New(rand.NewPCG(1, 2))
	var ls [4]Lease
	held := func(l *Lease) []int32 {
		l.pool.mu.Lock()
		defer l.pool.mu.Unlock()
		return slices.Clone(l.holds[0].pages)
	}
	for i := range 20000 {
		l := &ls[rng.IntN(len(ls))]
		if !l.Live() {
			p := pools[rng.IntN(len(pools))]
			req := Request{ID: fmt.Sprint("r", i), Tenant: "a", PromptTokens: 1 + rng.IntN(60), MaxNewTokens: rng.IntN(8)}
			if p.TryAdmitInto(req, l) != nil {
				continue
			}
		} else if rng.IntN(3) == 0 {
			_ = l.TryGrow(rng.IntN(20)) // refused when the pool is short: the table stays
		}
		table, err := l.BlockTable()
		require.NoError(t, err)
		require.Equal(t, held(l), table, "step %d", i)
		_, gt, err := l.GroupTable(l.pool.Spec().Groups[0].Name, nil)
		require.NoError(t, err)
		require.Equal(t, table, gt, "step %d: the per-token group's table", i)
		if rng.IntN(2) == 0 {
			require.NoError(t, l.Release())
		}
	}
	for _, p := range pools {
		require.NoError(t, p.Check())
	}
}
