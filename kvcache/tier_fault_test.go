package kvcache

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/internal/testlog"
)

// Faults of the host tier: copies that fail (at once or half-way), a tier
// that fills up in the middle of an offload (tier_test.go), Close while
// copies run. Each has its own outcome, and after each the books add up
// (Check), every free page and slot holds the scrub pattern
// (AuditFreePages), and nothing a failed copy touched is served.

// audit requires every free page and slot to be clean and the books to
// add up.
func audit(t testing.TB, p *Pool) {
	t.Helper()
	require.NoError(t, p.Check())
	_, err := p.AuditFreePages()
	require.NoError(t, err)
	tierSlotsSum(t, p)
}

func TestTierOffloadCopyFails(t *testing.T) {
	for _, halfway := range []bool{false, true} {
		t.Run(map[bool]string{false: "at once", true: "half-way"}[halfway], func(t *testing.T) {
			var logs testlog.Buffer
			cfg := tierConfig(8, 8)
			cfg.Logger = logs.Logger()
			p, d := newTierDevicePool(t, cfg)
			toks := tierTokens(7, 4*4+1)
			publishPrompt(t, p, "A", "a", toks, 0xa7)
			d.failToHost, d.halfway = errors.New("DMA error"), halfway
			flushDevice(t, p, "a") // the eviction goes on without the tier
			s := p.Stats().Tier
			assert.Equal(t, uint64(4), s.OffloadsFailed)
			assert.Equal(t, uint64(0), s.Offloads)
			assert.Equal(t, 8, s.Free, "the slots are filled again and free")
			assert.Contains(t, logs.String(), ErrOffloadFailed.Error())
			audit(t, p)
			d.failToHost = nil
			l, err := p.TryAdmit(Request{ID: "A2", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
			require.NoError(t, err)
			assert.Equal(t, 0, l.HitTokens(), "nothing half-copied is served")
			require.NoError(t, l.Release())
			audit(t, p)
		})
	}
}

func TestTierOnloadCopyFails(t *testing.T) {
	for _, halfway := range []bool{false, true} {
		t.Run(map[bool]string{false: "at once", true: "half-way"}[halfway], func(t *testing.T) {
			p, d := newTierDevicePool(t, tierConfig(8, 8))
			toks := tierTokens(8, 4*4+1)
			publishPrompt(t, p, "A", "a", toks, 0xa8)
			flushDevice(t, p, "a")
			require.Equal(t, 4, p.Stats().Tier.Cached)
			before := p.Stats()
			d.failFromHost, d.halfway = errors.New("DMA error"), halfway
			l, err := p.TryAdmit(Request{ID: "A2", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
			require.Nil(t, l)
			var ae *AdmissionError
			require.ErrorAs(t, err, &ae)
			assert.ErrorIs(t, err, ErrOnloadFailed)
			assert.True(t, ae.Retryable())
			s := p.Stats()
			assert.Equal(t, 0, s.LiveLeases)
			assert.Equal(t, before.Admitted, s.Admitted, "not an admission")
			assert.Equal(t, 8, s.FreePages, "its pages were scrubbed and freed")
			assert.Equal(t, uint64(4), s.Tier.OnloadsFailed)
			assert.Equal(t, 8, s.Tier.Free, "the tier's copies were dropped and filled")
			audit(t, p)
			// Retried, it computes the prompt afresh.
			d.failFromHost = nil
			l, err = p.TryAdmit(Request{ID: "A2", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks})
			require.NoError(t, err)
			assert.Equal(t, 0, l.HitTokens())
			require.NoError(t, l.Release())
			audit(t, p)
		})
	}
}

// Close waits for the copies in flight, whichever way they go, and they
// end with nothing leaked: the admission that was onloading is refused
// with ErrPoolClosed, the one that was offloading finishes its eviction.
func TestTierCloseWithCopiesInFlight(t *testing.T) {
	for _, toHost := range []bool{true, false} {
		t.Run(map[bool]string{true: "offload", false: "onload"}[toHost], func(t *testing.T) {
			p, d := newTierDevicePool(t, tierConfig(8, 8))
			toks := tierTokens(9, 4*4+1)
			publishPrompt(t, p, "A", "a", toks, 0xa9)
			if !toHost {
				flushDevice(t, p, "a")
			}
			req := Request{ID: "A2", Tenant: "a", PromptTokens: len(toks), TokenIDs: toks}
			if toHost {
				req = Request{ID: "flush", Tenant: "a", PromptTokens: p.Pages() * p.tpp}
			}
			assert.ErrorIs(t, closeWithCopyHeld(t, p, d, req), ErrPoolClosed)
			s := p.Stats()
			assert.Equal(t, 8, s.FreePages)
			assert.Equal(t, 8, s.Tier.Free, "a closed pool's tier keeps nothing")
			require.NoError(t, p.Check())
			_, err := p.AuditFreePages()
			require.NoError(t, err)
		})
	}
}

// closeWithCopyHeld admits req (and releases its lease) with the next
// copy of d held at its entry, closes p while it is held, requires that
// Close waits for it, lets it go, and returns what the admission and
// release came to.
func closeWithCopyHeld(t *testing.T, p *Pool, d *tierDevice, req Request) error {
	t.Helper()
	gate := &fillGate{entered: make(chan struct{}, 1), proceed: make(chan struct{})}
	d.hold = gate
	admitted := make(chan error, 1)
	go func() {
		l, err := p.Admit(context.Background(), req)
		if err == nil {
			err = l.Release()
		}
		admitted <- err
	}()
	<-gate.entered
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) with a copy in flight", err)
	case <-time.After(20 * time.Millisecond):
	}
	close(gate.proceed)
	require.NoError(t, <-closed)
	return <-admitted
}

// A tier that skips one scrub in n is caught: under the canary policy a
// free slot is verified before it is taken, and a written one faults the
// pool; AuditFreePages finds it too.
func TestTierDetectsSkippedScrub(t *testing.T) {
	cfg := tierConfig(8, 8)
	cfg.Scrub = ScrubPolicy{Kind: ScrubCanary}
	p := newPool(t, cfg)
	n := 0
	p.tier.testSkipFill = func(slots []int32) []int32 {
		var kept []int32
		for _, s := range slots {
			if n++; n%5 != 0 {
				kept = append(kept, s)
			}
		}
		return kept
	}
	caught := false
	for round := range 20 {
		toks := tierTokens(100+round, 4*4+1)
		publishPrompt(t, p, "A", "a", toks, uint16(0xc000+round))
		l, err := p.TryAdmit(Request{ID: "flush", Tenant: "a", PromptTokens: p.Pages() * p.tpp})
		if err != nil {
			require.ErrorIs(t, err, ErrPoolFaulted)
			caught = true
			break
		}
		require.NoError(t, l.Release())
		if p.Fault() != nil {
			caught = true
			break
		}
		// Swapped-back or cleared slots return to the free list through a
		// fill: clear every few rounds.
		if round%2 == 1 {
			require.NoError(t, p.ClearPrefixCache())
			if _, err := p.AuditFreePages(); err != nil {
				require.ErrorIs(t, err, ErrCanaryMismatch)
				assert.True(t, strings.Contains(err.Error(), "host-tier slot"), err.Error())
				caught = true
				break
			}
		}
	}
	require.True(t, caught, "a tier that skips every fifth scrub went unnoticed")
	require.NoError(t, p.Check())
}
