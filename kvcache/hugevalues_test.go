package kvcache

import (
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Token and page counts at and past the limits, and negative ones: each
// is refused with its own error, the pool is left exactly as it was, and
// Check passes.
func TestHugeAndNegativeCountsAreRefusedWithNothingChanged(t *testing.T) {
	p := onDemandPool(t, 16, 4, 0)
	l, err := p.TryAdmit(Request{ID: "live", Tenant: "a", PromptTokens: 6, MaxNewTokens: 20, TokenIDs: tokens(6, 0, 1)})
	require.NoError(t, err)
	require.NoError(t, l.Commit(6))
	before := state(p)
	for name, req := range map[string]Request{
		"huge max new":          {PromptTokens: 1, MaxNewTokens: math.MaxInt},
		"huge prompt":           {PromptTokens: math.MaxInt},
		"sum overflows":         {PromptTokens: math.MaxInt / 2, MaxNewTokens: math.MaxInt/2 + 2},
		"negative prompt":       {PromptTokens: -1},
		"negative max new":      {PromptTokens: 1, MaxNewTokens: -1},
		"min int max new":       {PromptTokens: 1, MaxNewTokens: math.MinInt},
		"huge headroom":         {PromptTokens: 1, Sizing: Sizing{Mode: SizeOnDemand, HeadroomTokens: math.MaxInt}},
		"past the max context":  {PromptTokens: 16*4 + 1},
		"past the pool's pages": {PromptTokens: 1, MaxNewTokens: 1 << 39},
	} {
		req.ID, req.Tenant = "r", "a"
		_, err := p.TryAdmit(req)
		var ae *AdmissionError
		require.ErrorAs(t, err, &ae, name)
		assert.True(t, ae.Permanent() || errors.Is(err, ErrInvalidRequest), "%s: %v", name, err)
		assert.False(t, ae.Retryable(), "%s: %v", name, err)
		assert.Equal(t, before, state(p), name)
	}
	for name, err := range map[string]error{
		"commit huge":     l.Commit(math.MaxInt),
		"commit negative": l.Commit(-1),
		"commit min int":  l.Commit(math.MinInt),
		"commit back":     l.Commit(5),
		"grow huge":       l.TryGrow(math.MaxInt),
		"grow negative":   l.TryGrow(-1),
		"grow min int":    l.TryGrow(math.MinInt),
	} {
		assert.Error(t, err, name)
		assert.Equal(t, before, state(p), name)
	}
	for name, r := range map[string][2]int{
		"slots to max int":   {0, math.MaxInt},
		"slots near max int": {math.MaxInt - 1, math.MaxInt},
		"slots negative":     {-1, 1},
		"slots backwards":    {4, 3},
		"slots min int":      {math.MinInt, 0},
	} {
		out, err := l.SlotMapping(r[0], r[1], nil)
		assert.ErrorIs(t, err, ErrInvalidArgument, name)
		assert.Empty(t, out, name)
	}
	for _, n := range []int{math.MaxInt, -1, math.MinInt, 7} {
		_, err := l.CachePrefix(n)
		assert.ErrorIs(t, err, ErrInvalidArgument, "CachePrefix(%d)", n)
	}
	assert.Equal(t, before, state(p))
	assert.Equal(t, 6, l.Written())
	require.NoError(t, p.Check())
	require.NoError(t, l.Release())
	require.NoError(t, p.Check())
}
