package isolation

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDecisionErrNamesTheNumbers(t *testing.T) {
	d := Decision{Verdict: OverQuota, Demand: Demand{Charge: 3, Take: 3}, Have: 2, Limit: 10}
	var qe *QuotaError
	require.ErrorAs(t, d.Err("a"), &qe)
	assert.Equal(t, QuotaError{Err: ErrQuotaExceeded, Tenant: "a", Need: 3, Have: 2, Limit: 10}, *qe)
	assert.False(t, qe.Permanent())

	d = Decision{Verdict: Reserved, Demand: Demand{Charge: 5, Take: 4}, Have: 2, Limit: 26}
	require.ErrorIs(t, d.Err("a"), ErrReserved)
	assert.Equal(t, `isolation: free pages are reserved for other tenants: tenant "a" needs 4 pages, 2 of 26 free pages are not reserved for others`, d.Err("a").Error())

	assert.NoError(t, Decision{Verdict: Grant}.Err("a"))
	assert.NoError(t, Decision{Verdict: PoolShort}.Err("a"), "the pool reports its own shortage")
	assert.Equal(t, "reserved for others", Reserved.String())
	assert.Equal(t, "Verdict(9)", Verdict(9).String())
}

// Decide is a pure function of its arguments: the same tenant state,
// demand and supply give the same decision, and the other tenants'
// unused reservations are the only thing it reads of them.
func TestDecideReadsOnlyItsArguments(t *testing.T) {
	st := TenantState{Quota: 10, Reserved: 4, Used: 2, OthersUnused: 20}
	d, s := Demand{Charge: 5, Take: 5}, Supply{Pages: 24, InService: 100}
	first := Decide(st, d, s)
	assert.Equal(t, first, Decide(st, d, s))
	// 24 pages, 20 of them others' reservations: 4 open, 2 of them its
	// own reservation left.
	assert.Equal(t, Decision{Verdict: Reserved, Demand: d, Have: 4, Limit: 24}, first)
	st.OthersUnused = 0
	assert.Equal(t, Grant, Decide(st, d, s).Verdict)
	st.Used = 8
	assert.Equal(t, Decision{Verdict: OverQuota, Demand: d, Have: 2, Limit: 10}, Decide(st, d, s))
}
