package tenancy

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/isolation"
)

// registry builds a registry of pages pages whose tenants already use the
// pages given in used (by name), without going through an admission.
func registry(t *testing.T, pages int, used map[string]int, tenants ...isolation.TenantConfig) *Registry {
	t.Helper()
	r := NewRegistry(pages)
	for _, tc := range tenants {
		tn, err := r.Add(tc)
		require.NoError(t, err)
		if n := used[tc.Name]; n > 0 {
			r.Apply(tn, isolation.Decision{Verdict: isolation.Grant, Demand: isolation.Demand{Charge: n, Take: n}})
		}
	}
	_, err := r.Check()
	require.NoError(t, err)
	return r
}

func TestDecideQuotaAndReservationArithmetic(t *testing.T) {
	tenants := []isolation.TenantConfig{
		{Name: "capped", QuotaPages: 10},
		{Name: "gold", ReservedPages: 16},
		{Name: "whole"}, // quota = the pool
		{Name: "silver", QuotaPages: 30, ReservedPages: 8},
	}
	for _, tc := range []struct {
		name   string
		used   map[string]int
		tenant string
		demand isolation.Demand
		supply isolation.Supply
		want   isolation.Decision
	}{
		{
			name: "fits everywhere", tenant: "capped",
			demand: isolation.Demand{Charge: 4, Take: 4}, supply: isolation.Supply{Pages: 100, InService: 100},
			// 100 pages, 24 of them others' unused reservations.
			want: isolation.Decision{Verdict: isolation.Grant, Have: 10, Limit: 100},
		},
		{
			name: "quota binds", tenant: "capped", used: map[string]int{"capped": 8},
			demand: isolation.Demand{Charge: 3, Take: 3}, supply: isolation.Supply{Pages: 92, InService: 100},
			want: isolation.Decision{Verdict: isolation.OverQuota, Have: 2, Limit: 10},
		},
		{
			name: "shared pages count against the quota, not the pool", tenant: "capped", used: map[string]int{"capped": 8},
			demand: isolation.Demand{Charge: 3, Take: 1}, supply: isolation.Supply{Pages: 92, InService: 100},
			want: isolation.Decision{Verdict: isolation.OverQuota, Have: 2, Limit: 10},
		},
		{
			name: "a whole-pool quota binds through the pool", tenant: "whole", used: map[string]int{"whole": 70},
			demand: isolation.Demand{Charge: 40, Take: 40}, supply: isolation.Supply{Pages: 30, InService: 100},
			want: isolation.Decision{Verdict: isolation.PoolShort, Have: 6, Limit: 100},
		},
		{
			name: "pool short", tenant: "capped",
			demand: isolation.Demand{Charge: 5, Take: 5}, supply: isolation.Supply{Pages: 4, InService: 100},
			want: isolation.Decision{Verdict: isolation.PoolShort, Have: 0, Limit: 100},
		},
		{
			name: "pages exist but are reserved for others", tenant: "capped",
			demand: isolation.Demand{Charge: 5, Take: 5}, supply: isolation.Supply{Pages: 26, InService: 100},
			want: isolation.Decision{Verdict: isolation.Reserved, Have: 2, Limit: 26},
		},
		{
			name: "own reservation is not someone else's", tenant: "gold",
			demand: isolation.Demand{Charge: 16, Take: 16}, supply: isolation.Supply{Pages: 24, InService: 100},
			// 24 pages: 8 are silver's, 16 gold's own.
			want: isolation.Decision{Verdict: isolation.Grant, Have: 16, Limit: 100},
		},
		{
			name: "a used reservation protects nothing", tenant: "capped", used: map[string]int{"gold": 16, "silver": 8},
			demand: isolation.Demand{Charge: 5, Take: 5}, supply: isolation.Supply{Pages: 5, InService: 100},
			want: isolation.Decision{Verdict: isolation.Grant, Have: 5, Limit: 100},
		},
		{
			name: "queued behind an earlier admission", tenant: "capped",
			demand: isolation.Demand{Charge: 1, Take: 1}, supply: isolation.Supply{Pages: 100, InService: 100, Queued: true},
			want: isolation.Decision{Verdict: isolation.PoolShort, Have: 0, Limit: 100},
		},
		{
			name: "inside its reservation a tenant passes the queue", tenant: "gold", used: map[string]int{"gold": 4},
			demand: isolation.Demand{Charge: 12, Take: 12}, supply: isolation.Supply{Pages: 40, InService: 100, Queued: true},
			want: isolation.Decision{Verdict: isolation.Grant, Have: 12, Limit: 100},
		},
		{
			name: "beyond its reservation it queues", tenant: "gold", used: map[string]int{"gold": 4},
			demand: isolation.Demand{Charge: 13, Take: 13}, supply: isolation.Supply{Pages: 40, InService: 100, Queued: true},
			want: isolation.Decision{Verdict: isolation.PoolShort, Have: 12, Limit: 100},
		},
		{
			name: "a fully shared admission takes nothing from the pool", tenant: "capped",
			demand: isolation.Demand{Charge: 6, Take: 0}, supply: isolation.Supply{Pages: 0, InService: 100, Queued: true},
			want: isolation.Decision{Verdict: isolation.Grant, Have: 0, Limit: 100},
		},
		{
			name: "retired pages shrink the pool below a quota", tenant: "silver", used: map[string]int{"silver": 20},
			demand: isolation.Demand{Charge: 9, Take: 9}, supply: isolation.Supply{Pages: 8, InService: 28},
			// Quota 30 ≥ 28 in service: the pool binds; and what there
			// is, is gold's reservation.
			want: isolation.Decision{Verdict: isolation.PoolShort, Have: 0, Limit: 28},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := registry(t, 100, tc.used, tenants...)
			tn, err := r.Lookup(tc.tenant)
			require.NoError(t, err)
			before := *tn
			tc.want.Demand = tc.demand
			got := r.Decide(tn, tc.demand, tc.supply)
			assert.Equal(t, tc.want, got)
			assert.Equal(t, before, *tn, "Decide changes nothing")
			if got.Verdict == isolation.Grant {
				r.Apply(tn, got)
				assert.Equal(t, before.Used+tc.demand.Charge, tn.Used)
			} else {
				assert.Panics(t, func() { r.Apply(tn, got) }, "a refusal cannot be applied")
			}
			_, err = r.Check()
			require.NoError(t, err)
		})
	}
}

// TestUnusedReservationsFollowUsage drives usage up and down and checks
// the registry's running sum of unused reservations after every step.
func TestUnusedReservationsFollowUsage(t *testing.T) {
	r := registry(t, 64, nil, isolation.TenantConfig{Name: "a", ReservedPages: 10}, isolation.TenantConfig{Name: "b", ReservedPages: 20, QuotaPages: 40})
	a, _ := r.Lookup("a")
	b, _ := r.Lookup("b")
	steps := []struct {
		t       *Tenant
		delta   int
		wantSum int
	}{
		{a, 4, 26}, {a, 8, 20}, {b, 25, 0}, {a, -12, 10}, {b, -25, 30}, {b, 19, 11},
	}
	for i, s := range steps {
		if s.delta > 0 {
			r.Apply(s.t, isolation.Decision{Verdict: isolation.Grant, Demand: isolation.Demand{Charge: s.delta}})
		} else {
			r.Uncharge(s.t, -s.delta)
		}
		assert.Equal(t, s.wantSum, r.unusedReserved, "step %d", i)
		_, err := r.Check()
		require.NoError(t, err, "step %d", i)
	}
	assert.Panics(t, func() { r.Uncharge(a, 1) }, "uncharging what a tenant does not hold")
}

func TestRegistryRefusesBadTenantsAndChangesNothing(t *testing.T) {
	r := registry(t, 10, nil, isolation.TenantConfig{Name: "a", ReservedPages: 6})
	for _, tc := range []struct {
		name string
		cfg  isolation.TenantConfig
		want error
	}{
		{"empty name", isolation.TenantConfig{}, isolation.ErrInvalidTenant},
		{"negative quota", isolation.TenantConfig{Name: "x", QuotaPages: -1}, isolation.ErrInvalidTenant},
		{"reservation above quota", isolation.TenantConfig{Name: "x", QuotaPages: 2, ReservedPages: 3}, isolation.ErrInvalidTenant},
		{"reservations above the pool", isolation.TenantConfig{Name: "x", ReservedPages: 5}, isolation.ErrOverReserved},
		{"duplicate", isolation.TenantConfig{Name: "a"}, isolation.ErrDuplicateTenant},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := r.Add(tc.cfg)
			require.ErrorIs(t, err, tc.want)
			assert.Len(t, r.Tenants(), 1)
			assert.Equal(t, 6, r.unusedReserved)
			_, err = r.Check()
			require.NoError(t, err)
		})
	}
	require.ErrorIs(t, r.Update(isolation.TenantConfig{Name: "nobody"}), isolation.ErrUnknownTenant)
	require.NoError(t, r.Update(isolation.TenantConfig{Name: "a", QuotaPages: 20}))
	a, _ := r.Lookup("a")
	assert.Equal(t, 10, a.Quota, "a quota above the pool is the pool")
}

func TestRegistryCheckFindsCorruption(t *testing.T) {
	r := registry(t, 10, nil, isolation.TenantConfig{Name: "a", ReservedPages: 2})
	r.unusedReserved = 5
	_, err := r.Check()
	require.ErrorIs(t, err, isolation.ErrCorrupt)
}

// Over random registries, supplies and demands (at the limits too: empty
// pools, zero quotas, reservations of the whole pool, usage above a
// lowered quota), a isolation.Grant never lets a tenant pass its quota, take more
// than the supply, cut into other tenants' unused reservations, take
// beyond its own reservation while others queue, or eat into the pages
// kept for growth outside its own reservation.
func TestDecideGrantTookAnotherTenantsReservation(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		total := rng.IntN(40)
		r := NewRegistry(total)
		var tenants []*Tenant
		left := total
		for i := range 1 + rng.IntN(3) {
			quota := rng.IntN(total + 2) // 0: the whole pool; above it: capped
			reserved := rng.IntN(min(left, max(quota, 1)) + 1)
			if quota != 0 && reserved > quota || reserved > total {
				reserved = 0
			}
			tn, err := r.Add(isolation.TenantConfig{Name: string(rune('a' + i)), QuotaPages: quota, ReservedPages: reserved})
			require.NoError(t, err)
			left -= reserved
			if n := rng.IntN(tn.Quota + 1); n > 0 && n <= left+tn.Reserved {
				r.Apply(tn, isolation.Decision{Verdict: isolation.Grant, Demand: isolation.Demand{Charge: n, Take: n}})
			}
			tenants = append(tenants, tn)
		}
		if rng.IntN(4) == 0 { // a lowered quota leaves usage above it
			tn := tenants[0]
			require.NoError(t, r.Update(isolation.TenantConfig{Name: tn.Name, QuotaPages: max(1, tn.Used/2), ReservedPages: min(tn.Reserved, max(1, tn.Used/2))}))
		}
		_, err := r.Check()
		require.NoError(t, err)
		tn := tenants[rng.IntN(len(tenants))]
		charge := rng.IntN(total + 2)
		d := isolation.Demand{Charge: charge, Take: rng.IntN(charge + 1)}
		s := isolation.Supply{Pages: rng.IntN(total + 1), InService: total - rng.IntN(total/4+1), Queued: rng.IntN(3) == 0, Keep: rng.IntN(4)}
		got := r.Decide(tn, d, s)
		if got.Verdict != isolation.Grant {
			continue
		}
		own := tn.unusedReservation()
		others := r.unusedReserved - own
		assert.LessOrEqual(t, d.Charge, max(0, tn.Quota-tn.Used), "quota passed: %+v %+v %+v", *tn, d, s)
		assert.LessOrEqual(t, d.Take, s.Pages, "supply passed: %+v %+v %+v", *tn, d, s)
		assert.LessOrEqual(t, d.Take, max(0, s.Pages-others), "others' reservations taken: %+v %+v %+v", *tn, d, s)
		if s.Queued {
			assert.LessOrEqual(t, d.Take, own, "queue passed beyond its own reservation: %+v %+v %+v", *tn, d, s)
		}
		assert.LessOrEqual(t, d.Take, own+max(0, s.Pages-others-own-s.Keep), "growth pages taken: %+v %+v %+v", *tn, d, s)
	}
}

// TestTryChargeGrowthIsDecideAndApply holds the growth shortcut to the one
// rule: on random tenants, usage and supplies, it grants exactly when
// Decide grants the same growth, and leaves the registry as Apply would,
// or untouched.
func TestTryChargeGrowthIsDecideAndApply(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 15))
	const pages = 64
	build := func(seed uint64) (*Registry, []*Tenant) {
		rng := rand.New(rand.NewPCG(seed, 1))
		r := NewRegistry(pages)
		var ts []*Tenant
		left := pages
		for i := range 1 + rng.IntN(3) {
			quota := rng.IntN(pages + 1) // 0: the whole pool
			reserved := 0
			if q := min(quota, left); q > 0 && rng.IntN(2) == 0 {
				reserved = rng.IntN(q + 1)
			}
			left -= reserved
			tn, err := r.Add(isolation.TenantConfig{Name: string(rune('a' + i)), QuotaPages: quota, ReservedPages: reserved})
			require.NoError(t, err)
			if used := rng.IntN(tn.Quota + 1); used > 0 {
				r.Apply(tn, isolation.Decision{Verdict: isolation.Grant, Demand: isolation.Demand{Charge: used, Take: used}})
			}
			ts = append(ts, tn)
		}
		return r, ts
	}
	grants := 0
	for range 20000 {
		seed := rng.Uint64()
		viaDecide, ts1 := build(seed)
		shortcut, ts2 := build(seed)
		i := rng.IntN(len(ts1))
		want, got := ts1[i], ts2[i]
		n := rng.IntN(8) // 0 is not a growth: the shortcut must refuse it
		supply := rng.IntN(pages+8) - 4
		dec := viaDecide.Decide(want, isolation.Demand{Charge: n, Take: n}, isolation.Supply{Pages: supply, InService: pages})
		granted := dec.Verdict == isolation.Grant && n >= 1
		if granted {
			viaDecide.Apply(want, dec)
			grants++
		}
		require.Equal(t, granted, shortcut.TryChargeGrowth(got, n, supply),
			"tenant %+v, %d pages of a supply of %d: Decide says %v", *want, n, supply, dec.Verdict)
		require.Equal(t, want.Used, got.Used)
		require.Equal(t, viaDecide.unusedReserved, shortcut.unusedReserved)
		_, err := shortcut.Check()
		require.NoError(t, err)
	}
	require.Greater(t, grants, 2000, "the random cases must grant often enough to test the charge")
}
