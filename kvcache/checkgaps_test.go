package kvcache

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Invariants the docs state that Check did not verify: each one broken
// on its own is reported (wrapping ErrCorrupt, naming what broke), and
// the books are sound again once it is mended.
func TestCheckReportsInvariantsItDidNotVerify(t *testing.T) {
	for name, c := range map[string]struct {
		hybrid bool
		want   string
		breaks func(p *Pool, l *Lease) (mend func())
	}{
		"block table readers see is not the table": {want: "block table its readers see",
			breaks: func(p *Pool, l *Lease) func() {
				n := l.viewLen.Load()
				l.viewLen.Store(n - 1) // a change of the table left unpublished
				return func() { l.viewLen.Store(n) }
			}},
		"watermark past the lease's capacity": {want: "written watermark",
			breaks: func(p *Pool, l *Lease) func() {
				l.written.Store(int64(l.CapacityTokens() + 1))
				return func() { l.written.Store(0) }
			}},
		"sealed lease in a phase that takes writes": {want: "sealed",
			breaks: func(p *Pool, l *Lease) func() {
				l.written.Store(writeSealed)
				return func() { l.written.Store(0) }
			}},
		"exported lease that takes writes": {want: "sealed",
			breaks: func(p *Pool, l *Lease) func() {
				l.phase.Store(uint32(PhaseExported))
				return func() { l.phase.Store(uint32(PhaseAdmitted)) }
			}},
		"shared pages past what the lease published": {want: "published",
			breaks: func(p *Pool, l *Lease) func() {
				l.hitPages = 1 // hits are published pages: published is 0
				return func() { l.hitPages = 0 }
			}},
		"copies in flight that no lease holds": {want: "copies in flight",
			breaks: func(p *Pool, l *Lease) func() {
				p.mu.pins++
				return func() { p.mu.pins-- }
			}},
		"window slid past the written watermark": {hybrid: true, want: "window",
			breaks: func(p *Pool, l *Lease) func() {
				l.holds[1].first = 2 // nothing written: nothing may have slid out
				return func() { l.holds[1].first = 0 }
			}},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := tinyConfig(16)
			if c.hybrid {
				cfg = hybridConfig(64, 2)
			}
			p := newPool(t, cfg)
			l := admit(t, p, "r", "a", 40)
			p.mu.Lock()
			mend := c.breaks(p, l)
			p.mu.Unlock()
			mended := false
			fix := func() {
				if !mended {
					mended = true
					p.mu.Lock()
					mend()
					p.mu.Unlock()
				}
			}
			t.Cleanup(fix) // before Close, which waits for pins
			err := p.Check()
			assert.ErrorIs(t, err, ErrCorrupt)
			assert.ErrorContains(t, err, c.want)
			fix()
			require.NoError(t, p.Check())
		})
	}
}
