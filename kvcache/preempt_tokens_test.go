package kvcache

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An engine that preempts with token IDs whose prompt part is not the
// prompt it was admitted with would have the prefix cache index KV
// computed for one prompt under another's tokens: a later request with
// the claimed tokens would be handed pages it does not match.
func TestPreemptWithAnotherPromptIsRefused(t *testing.T) {
	p, l, all := grownLease(t)
	other := append([]int32(nil), all...)
	other[3]++ // a prompt token that is not the admitted one
	before := p.Stats()
	_, err := l.Preempt(other)
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.True(t, l.Live(), "a refused preemption leaves the lease as it was")
	assert.Equal(t, before.CachedPages, p.Stats().CachedPages)
	require.NoError(t, p.Check())

	// The request the forged tokens describe finds nothing of r's.
	kept, err := l.Preempt(all)
	require.NoError(t, err)
	require.Equal(t, 4*prefixTPP, kept)
	forged, err := p.TryAdmit(Request{ID: "f", Tenant: "a", PromptTokens: len(other), MaxNewTokens: 1, TokenIDs: other})
	require.NoError(t, err)
	assert.Zero(t, forged.HitTokens(), "pages computed for the admitted prompt match only it")
	require.NoError(t, forged.Release())
	require.NoError(t, p.Check())
}
