package kvcache

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Two ends of one lease race (Release and Abort, or an export's reclaim
// deadline and the engine's Release): the loser returns ErrLeaseReleased
// at once, and the engine recycles the Lease while the winner's scrub is
// still filling. Nothing the next incarnation does (its admission's
// canary check, its own release) may write into the page list the first
// scrub still reads: that scrub would then fill and clean pages that are
// free or another lease's, and leave its own quarantined for ever.
func TestRecycledLeaseDoesNotOverwriteAnInFlightScrub(t *testing.T) {
	for _, canary := range []bool{false, true} {
		name := "zero"
		if canary {
			name = "canary"
		}
		t.Run(name, func(t *testing.T) {
			dev := newScripted()
			cfg := tinyConfig(8)
			cfg.Device = dev
			if canary {
				cfg.Scrub = ScrubPolicy{Kind: ScrubCanary}
			}
			p := newPool(t, cfg)
			var l Lease
			require.NoError(t, p.TryAdmitInto(Request{ID: "one", Tenant: "a", PromptTokens: 8}, &l))
			first, err := l.BlockTable()
			require.NoError(t, err)

			gate := dev.gateNextFill()
			var wg sync.WaitGroup
			var winner error
			wg.Add(1)
			go func() { defer wg.Done(); winner = l.Release() }()
			<-gate.entered // the winner's scrub fills, outside the lock
			require.ErrorIs(t, l.Abort(), ErrLeaseReleased, "the loser")
			require.False(t, l.Live())

			// The engine recycles the Lease at once.
			require.NoError(t, p.TryAdmitInto(Request{ID: "two", Tenant: "b", PromptTokens: 8}, &l))
			second, err := l.BlockTable()
			require.NoError(t, err)
			require.NotEqual(t, first, second)
			require.NoError(t, l.Release())
			close(gate.proceed)
			wg.Wait()
			require.NoError(t, winner)

			require.NoError(t, p.Check())
			s := p.Stats()
			assert.Equal(t, 8, s.FreePages, "every page is free again")
			assert.Zero(t, s.QuarantinedPages)
			assert.NoError(t, p.Fault())
			admit(t, p, "all", "a", 32) // and clean: the canary finds them so
		})
	}
}
