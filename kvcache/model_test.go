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

// poolModel is the reference: what a pool must do, in maps and integers.
type poolModel struct {
	pages, tpp, maxContext int
	closed                 bool
	quota, reserved, used  map[string]int
	leases                 map[string]modelLease // live, by ID
}

type modelLease struct {
	tenant       string
	pages, limit int
	written      int
}

func (m *poolModel) free() int {
	n := m.pages
	for _, u := range m.used {
		n -= u
	}
	return n
}

// admit predicts the outcome of an admission: the sentinel, or nil.
func (m *poolModel) admit(r Request) error {
	switch {
	case r.ID == "" || r.Tenant == "" || r.PromptTokens <= 0 || r.MaxNewTokens < 0 || r.PromptTokens > maxRequestTokens-r.MaxNewTokens:
		return ErrInvalidRequest
	case r.Tokens() > m.maxContext:
		return ErrExceedsMaxContext
	case m.closed:
		return ErrPoolClosed
	}
	quota, known := m.quota[r.Tenant]
	need := (r.Tokens() + m.tpp - 1) / m.tpp
	switch {
	case !known:
		return ErrUnknownTenant
	case m.leases[r.ID].tenant != "":
		return ErrDuplicateRequest
	case need > m.pages:
		return ErrExceedsCapacity
	case need > quota: // never fits
		return ErrExceedsQuota
	case m.used[r.Tenant]+need > quota && quota < m.pages:
		// Before free pages: a doomed request evicts nothing. A quota as
		// large as the pool binds only through the pool (below).
		return ErrExceedsQuota
	case need > m.free():
		return ErrPoolExhausted
	}
	othersReserved := 0
	for t, res := range m.reserved {
		if t != r.Tenant {
			othersReserved += max(0, res-m.used[t])
		}
	}
	if need > m.free()-othersReserved {
		return ErrPoolExhausted
	}
	m.used[r.Tenant] += need
	m.leases[r.ID] = modelLease{tenant: r.Tenant, pages: need, limit: r.Tokens()}
	return nil
}

func TestPoolAgainstReferenceModel(t *testing.T) {
	seeds := 12
	if testing.Short() {
		seeds = 3
	}
	for seed := range uint64(seeds) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { runPoolModel(t, seed, 400) })
	}
}

func runPoolModel(t *testing.T, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, 99))
	tenants := []TenantConfig{
		{Name: "a", QuotaPages: 20},
		{Name: "b", ReservedPages: 6},
		{Name: "c", QuotaPages: 12, ReservedPages: 4},
		{Name: "d"},
	}
	newPair := func() (*Pool, *poolModel) {
		cfg := tinyConfig(48, tenants...)
		cfg.MaxContextTokens = 40 * cfg.Geometry.TokensPerPage
		p, err := New(cfg)
		require.NoError(t, err)
		m := &poolModel{pages: 48, tpp: 4, maxContext: cfg.MaxContextTokens,
			quota: map[string]int{}, reserved: map[string]int{}, used: map[string]int{}, leases: map[string]modelLease{}}
		for _, tc := range tenants {
			m.quota[tc.Name] = tc.QuotaPages
			if tc.QuotaPages == 0 {
				m.quota[tc.Name] = 48
			}
			m.reserved[tc.Name] = tc.ReservedPages
		}
		return p, m
	}
	p, m := newPair()
	defer func() { p.Close() }()
	leases := map[string]*Lease{} // every lease ever admitted in this pool, by ID
	var released []*Lease
	outcomes := map[error]int{}
	for step := range steps {
		if m.closed && rng.IntN(8) == 0 { // carry on with a fresh pool
			require.NoError(t, p.Check())
			p, m = newPair()
			leases, released = map[string]*Lease{}, nil
		}
		switch op := rng.IntN(20); {
		case op < 9: // admit, sometimes malformed
			r := Request{
				ID:           fmt.Sprintf("r%d", rng.IntN(40)),
				Tenant:       []string{"a", "b", "c", "d", "a", "b", "d", "nobody", ""}[rng.IntN(9)],
				PromptTokens: rng.IntN(50) - 2,
				MaxNewTokens: rng.IntN(24) - 2,
			}
			if rng.IntN(30) == 0 {
				r.PromptTokens, r.MaxNewTokens = math.MaxInt-1, 7
			}
			want := m.admit(r)
			outcomes[want]++
			l, err := p.TryAdmit(r)
			if want == nil {
				require.NoError(t, err, "step %d %+v", step, r)
				require.Equal(t, m.leases[r.ID].pages, l.Pages())
				leases[r.ID] = l
			} else {
				require.ErrorIs(t, err, want, "step %d %+v", step, r)
				require.Nil(t, l)
			}
		case op < 12: // commit
			id := fmt.Sprintf("r%d", rng.IntN(40))
			l, ok := leases[id]
			if !ok {
				break
			}
			ml, live := m.leases[id]
			n := rng.IntN(80)
			err := l.Commit(n)
			switch {
			case m.closed:
				require.Error(t, err)
			case !live || !l.Live():
				require.ErrorIs(t, err, ErrLeaseReleased)
			case n < ml.written || n > ml.limit:
				require.ErrorIs(t, err, ErrInvalidArgument)
			default:
				require.NoError(t, err)
				ml.written = n
				m.leases[id] = ml
			}
		case op < 18: // release a lease if it is live
			id := fmt.Sprintf("r%d", rng.IntN(40))
			if l, ok := leases[id]; ok {
				err := l.Release()
				if m.closed {
					require.ErrorIs(t, err, ErrPoolClosed)
				} else {
					require.NoError(t, err)
					m.used[m.leases[id].tenant] -= m.leases[id].pages
					delete(m.leases, id)
					released = append(released, l)
				}
				delete(leases, id)
			}
		case op < 19: // release again
			if len(released) > 0 {
				err := released[rng.IntN(len(released))].Release()
				if m.closed {
					require.ErrorIs(t, err, ErrPoolClosed)
				} else {
					require.ErrorIs(t, err, ErrLeaseReleased)
				}
			}
		default: // close, now and then
			if m.closed {
				require.ErrorIs(t, p.Close(), ErrPoolClosed)
				break
			}
			if rng.IntN(3) != 0 {
				break
			}
			require.NoError(t, p.Close())
			m.closed = true
			for id, ml := range m.leases {
				m.used[ml.tenant] -= ml.pages
				delete(m.leases, id)
			}
		}
		require.NoError(t, p.Check(), "step %d", step)
		s := p.Stats()
		require.Equal(t, m.free(), s.FreePages, "step %d", step)
		require.Equal(t, len(m.leases), s.LiveLeases, "step %d", step)
		for _, ts := range s.Tenants {
			require.Equal(t, m.used[ts.Name], ts.UsedPages, "step %d tenant %s", step, ts.Name)
		}
	}
	// The sequence must have exercised both admissions and refusals.
	require.Greater(t, outcomes[nil], steps/20, "outcomes %v", outcomes)
	require.Greater(t, len(outcomes), 5, "outcomes %v", outcomes)
}

// FuzzAdmit throws arbitrary requests at a pool: each is admitted whole or
// refused with a known error and nothing changed.
func FuzzAdmit(f *testing.F) {
	f.Add("r1", "a", 10, 5, true)
	f.Add("", "a", 1, 0, false)
	f.Add("r", "nobody", 1, 1, true)
	f.Add("r", "a", -1, 3, true)
	f.Add("r", "b", math.MaxInt, math.MaxInt, false)
	f.Add("r", "a", 700_000, 1, true)
	f.Add("r", "a", 64, 0, true)
	f.Add("r", "b", 65, 0, true)
	p, err := New(tinyConfig(16, TenantConfig{Name: "a", QuotaPages: 12}, TenantConfig{Name: "b", ReservedPages: 2}))
	require.NoError(f, err)
	sentinels := []error{ErrInvalidRequest, ErrUnknownTenant, ErrDuplicateRequest, ErrExceedsMaxContext,
		ErrExceedsCapacity, ErrExceedsQuota, ErrPoolExhausted}
	f.Fuzz(func(t *testing.T, id, tenant string, prompt, maxNew int, release bool) {
		before := state(p)
		l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: prompt, MaxNewTokens: maxNew})
		if err != nil {
			known := false
			for _, s := range sentinels {
				known = known || errors.Is(err, s)
			}
			assert.True(t, known, "unexpected error %v", err)
			assert.Equal(t, before, state(p))
		} else {
			assert.GreaterOrEqual(t, l.CapacityTokens(), prompt+maxNew)
			assert.Less(t, l.CapacityTokens()-p.Geometry().TokensPerPage, prompt+maxNew, "no more pages than needed")
			if release {
				require.NoError(t, l.Release())
			}
		}
		require.NoError(t, p.Check())
	})
}
