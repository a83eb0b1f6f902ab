package kvcache

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// growthModel is the reference for on-demand sizing, growth, preemption
// and the growth watermark: what a pool must do, in maps and integers.
type growthModel struct {
	pages, tpp, maxContext int
	headroom, keep         int
	quota, reserved, used  map[string]int
	leases                 map[string]*modelLease
}

func (m *growthModel) free() int {
	n := m.pages
	for _, u := range m.used {
		n -= u
	}
	return n
}

func (m *growthModel) othersReserved(tenant string) int {
	n := 0
	for t, res := range m.reserved {
		if t != tenant {
			n += max(0, res-m.used[t])
		}
	}
	return n
}

// take is isolation.Decide over the model: nil, ErrExceedsQuota or
// ErrPoolExhausted for n more pages of tenant, keeping keep pages.
func (m *growthModel) take(tenant string, n, keep int) error {
	quota, used, free := m.quota[tenant], m.used[tenant], m.free()
	own := max(0, m.reserved[tenant]-used)
	unreserved := max(0, free-m.othersReserved(tenant))
	kept := min(unreserved, own+max(0, unreserved-own-keep))
	switch {
	case used+n > quota && quota < m.pages:
		return ErrExceedsQuota
	case n > kept:
		return ErrPoolExhausted
	case used+n > quota:
		return ErrExceedsQuota
	}
	return nil
}

func (m *growthModel) admit(r Request) error {
	switch {
	case r.ID == "" || r.Tenant == "" || r.PromptTokens <= 0 || r.MaxNewTokens < 0 || r.PromptTokens > maxRequestTokens-r.MaxNewTokens:
		return ErrInvalidRequest
	case r.Tokens() > m.maxContext:
		return ErrExceedsMaxContext
	}
	quota, known := m.quota[r.Tenant]
	need := (r.PromptTokens + min(r.MaxNewTokens, m.headroom) + m.tpp - 1) / m.tpp
	switch {
	case !known:
		return ErrUnknownTenant
	case m.leases[r.ID] != nil:
		return ErrDuplicateRequest
	case need > m.pages:
		return ErrExceedsCapacity
	case need > quota:
		return ErrExceedsQuota
	}
	if err := m.take(r.Tenant, need, m.keep); err != nil {
		return err
	}
	m.used[r.Tenant] += need
	m.leases[r.ID] = &modelLease{tenant: r.Tenant, pages: need, limit: r.Tokens()}
	return nil
}

func (m *growthModel) grow(id string, tokens int) error {
	ml := m.leases[id]
	switch {
	case ml == nil:
		return ErrLeaseReleased
	case tokens < 0:
		return ErrInvalidArgument
	case ml.written+tokens > ml.limit:
		return ErrExceedsMaxContext
	}
	fresh := (ml.written+tokens+m.tpp-1)/m.tpp - ml.pages
	if fresh <= 0 {
		return nil
	}
	switch total := ml.pages + fresh; {
	case total > m.pages:
		return ErrExceedsCapacity
	case total > m.quota[ml.tenant]:
		return ErrExceedsQuota
	}
	if err := m.take(ml.tenant, fresh, 0); err != nil {
		return err
	}
	m.used[ml.tenant] += fresh
	ml.pages += fresh
	return nil
}

func TestGrowthAgainstReferenceModel(t *testing.T) {
	seeds := 12
	if testing.Short() {
		seeds = 3
	}
	for seed := range uint64(seeds) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { runGrowthModel(t, seed, 500) })
	}
}

func runGrowthModel(t *testing.T, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, 15))
	tenants := []TenantConfig{
		{Name: "a", QuotaPages: 20},
		{Name: "b", ReservedPages: 6},
		{Name: "c", QuotaPages: 12, ReservedPages: 4},
		{Name: "d"},
	}
	headroom := []int{0, 3, 9}[seed%3]
	watermark := []float64{0, 0.1}[seed%2]
	cfg := tinyConfig(48, tenants...)
	cfg.MaxContextTokens = 60 * cfg.Geometry.TokensPerPage
	cfg.AllowUndersizedPool = true
	cfg.Sizing = onDemand(headroom)
	cfg.GrowthWatermark = watermark
	p := newPool(t, cfg)
	m := &growthModel{pages: 48, tpp: 4, maxContext: cfg.MaxContextTokens, headroom: headroom,
		keep:  int(math.Ceil(watermark * 48)),
		quota: map[string]int{}, reserved: map[string]int{}, used: map[string]int{}, leases: map[string]*modelLease{}}
	for _, tc := range tenants {
		m.quota[tc.Name] = tc.QuotaPages
		if tc.QuotaPages == 0 {
			m.quota[tc.Name] = 48
		}
		m.reserved[tc.Name] = tc.ReservedPages
	}
	leases := map[string]*Lease{}
	outcomes := map[string]int{}
	for step := range steps {
		id := fmt.Sprintf("r%d", rng.IntN(24))
		switch op := rng.IntN(10); {
		case op < 3: // admit
			r := Request{ID: id, Tenant: []string{"a", "b", "c", "d", "nobody"}[rng.IntN(5)],
				PromptTokens: rng.IntN(70) - 2, MaxNewTokens: rng.IntN(120)}
			want := m.admit(r)
			outcomes[fmt.Sprint("admit ", want)]++
			l, err := p.TryAdmit(r)
			if want != nil {
				require.ErrorIs(t, err, want, "step %d %+v", step, r)
				break
			}
			require.NoError(t, err, "step %d %+v", step, r)
			require.Equal(t, m.leases[id].pages, l.Pages(), "step %d", step)
			leases[id] = l
		case op < 6: // grow
			l, ok := leases[id]
			if !ok {
				break
			}
			tokens := rng.IntN(40) - 1
			want := m.grow(id, tokens)
			outcomes[fmt.Sprint("grow ", want)]++
			err := l.TryGrow(tokens)
			if want != nil {
				require.ErrorIs(t, err, want, "step %d grow %s by %d", step, id, tokens)
			} else {
				require.NoError(t, err, "step %d grow %s by %d", step, id, tokens)
			}
			if ml := m.leases[id]; ml != nil {
				require.Equal(t, ml.pages, l.Pages(), "step %d", step)
			}
		case op < 8: // commit what the capacity allows
			l, ok := leases[id]
			ml := m.leases[id]
			if !ok || ml == nil {
				break
			}
			n := ml.written + rng.IntN(12)
			err := l.Commit(n)
			if n > min(ml.limit, ml.pages*m.tpp) {
				require.ErrorIs(t, err, ErrInvalidArgument, "step %d commit %d", step, n)
				break
			}
			require.NoError(t, err, "step %d", step)
			ml.written = n
		default: // release or preempt (no prefix material: the same)
			l, ok := leases[id]
			if !ok || m.leases[id] == nil {
				break
			}
			if rng.IntN(2) == 0 {
				require.NoError(t, l.Release())
			} else {
				kept, err := l.Preempt(nil)
				require.NoError(t, err)
				require.Zero(t, kept)
			}
			m.used[m.leases[id].tenant] -= m.leases[id].pages
			delete(m.leases, id)
		}
		require.NoError(t, p.Check(), "step %d", step)
		s := p.Stats()
		require.Equal(t, m.free(), s.FreePages, "step %d", step)
		require.Equal(t, len(m.leases), s.LiveLeases, "step %d", step)
		for _, ts := range s.Tenants {
			require.Equal(t, m.used[ts.Name], ts.UsedPages, "step %d tenant %s", step, ts.Name)
		}
	}
	require.Greater(t, outcomes["grow <nil>"], steps/50, "outcomes %v", outcomes)
	require.Greater(t, len(outcomes), 6, "outcomes %v", outcomes)
}

// FuzzLeaseOps runs arbitrary sequences of admit / grow / commit / release
// on one on-demand pool: every step either succeeds or fails with a known
// error and nothing changed, no lease ever reaches past its own pages, and
// the books stay sound.
func FuzzLeaseOps(f *testing.F) {
	f.Add([]byte{0, 5, 1, 8, 2, 3, 3, 0})
	f.Add([]byte{0, 200, 1, 255, 1, 1, 2, 9, 3, 1, 0, 7})
	f.Add([]byte{0, 1, 0, 2, 0, 3, 1, 40, 1, 40, 3, 2})
	cfg := tinyConfig(32, TenantConfig{Name: "a", QuotaPages: 20}, TenantConfig{Name: "b", ReservedPages: 4})
	cfg.Sizing, cfg.GrowthWatermark = onDemand(2), 0.1
	p, err := New(cfg)
	require.NoError(f, err)
	known := []error{ErrInvalidRequest, ErrInvalidArgument, ErrExceedsMaxContext, ErrExceedsCapacity,
		ErrExceedsQuota, ErrPoolExhausted, ErrLeaseReleased, ErrDuplicateRequest}
	f.Fuzz(func(t *testing.T, ops []byte) {
		var leases [4]*Lease
		defer func() {
			for _, l := range leases {
				if l.Live() {
					require.NoError(t, l.Release())
				}
			}
			require.NoError(t, p.Check())
		}()
		for i := 0; i+1 < len(ops) && i < 64; i += 2 {
			slot, arg := int(ops[i]>>2)%len(leases), int(ops[i+1])
			before := state(p)
			var err error
			switch ops[i] & 3 {
			case 0:
				if leases[slot].Live() {
					continue
				}
				var l *Lease
				l, err = p.TryAdmit(Request{ID: fmt.Sprint("f", slot), Tenant: []string{"a", "b"}[arg&1], PromptTokens: arg/2 + 1, MaxNewTokens: arg})
				if err == nil {
					leases[slot] = l
				}
			case 1:
				if leases[slot] == nil {
					continue
				}
				err = leases[slot].TryGrow(arg - 8)
			case 2:
				if leases[slot] == nil {
					continue
				}
				err = leases[slot].Commit(leases[slot].Written() + arg%9)
			case 3:
				if leases[slot] == nil {
					continue
				}
				err = leases[slot].Release()
			}
			if err != nil {
				ok := false
				for _, k := range known {
					ok = ok || errors.Is(err, k)
				}
				require.True(t, ok, "unexpected error %v", err)
				if ops[i]&3 != 3 {
					assert.Equal(t, before, state(p), "a refused step changed the pool")
				}
			}
			for _, l := range leases {
				if !l.Live() {
					continue
				}
				table, err := l.BlockTable()
				require.NoError(t, err)
				require.Equal(t, l.Pages(), len(table))
				require.LessOrEqual(t, l.Written(), l.CapacityTokens())
				_, err = l.SlotMapping(0, l.CapacityTokens()+1, nil)
				require.ErrorIs(t, err, ErrInvalidArgument, "a slot beyond the lease's pages")
			}
			require.NoError(t, p.Check())
		}
	})
}
