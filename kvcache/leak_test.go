package kvcache

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// expectScrubbed checks every byte of every page of l in every region
// against the pool's scrub pattern, and returns the first offender.
func expectScrubbed(p *Pool, h *cudaops.Host, l *Lease) error {
	spec := p.q.Spec()
	bt, err := l.BlockTable()
	if err != nil {
		return err
	}
	for _, page := range bt {
		for r, reg := range h.Regions() {
			want := bytes.Repeat(wordLE(spec.WordFor(page)), int(reg.PageBytes/4))
			if got := h.PageBytes(r, page); !bytes.Equal(got, want) {
				i := 0
				for i < len(got) && got[i] == want[i] {
					i++
				}
				return fmt.Errorf("lease %q page %d region %d byte %d is %#02x, scrub pattern %#02x", l.ID(), page, r, i, got[i], want[i])
			}
		}
	}
	return nil
}

func wordLE(w uint32) []byte { return []byte{byte(w), byte(w >> 8), byte(w >> 16), byte(w >> 24)} }

// markWith writes a tenant's marker into every byte of every region of
// every page of l, as an engine writing that tenant's KV would.
func markWith(t *testing.T, h *cudaops.Host, l *Lease, marker byte) {
	bt, err := l.BlockTable()
	require.NoError(t, err)
	for _, page := range bt {
		for r := range h.Regions() {
			b := h.PageBytes(r, page)
			for i := range b {
				b[i] = marker
			}
		}
	}
}

// TestCanaryMarkerLeak is the leak test: many tenants fill every byte of
// their pages with their own marker; leases are released and re-admitted
// in random order across tenants; every page any lease receives must hold
// the scrub pattern and nothing else.
func TestCanaryMarkerLeak(t *testing.T) {
	for _, policy := range []ScrubPolicy{
		{Kind: ScrubZero},
		{Kind: ScrubPoison},
		{Kind: ScrubPoison, Pattern: 0x3c00 /* fp16-style 1.0 in bf16 bits: finite */},
		{Kind: ScrubCanary},
		{Kind: ScrubCanary, Pattern: 0xfeedf00d},
	} {
		t.Run(fmt.Sprintf("%v-%#x", policy.Kind, policy.Pattern), func(t *testing.T) {
			const tenants = 8
			var tcs []TenantConfig
			for i := range tenants {
				tcs = append(tcs, TenantConfig{Name: fmt.Sprintf("t%d", i)})
			}
			cfg := tinyConfig(96, tcs...)
			cfg.Scrub = policy
			p := newPool(t, cfg)
			h := hostOf(t, p)
			rng := rand.New(rand.NewPCG(uint64(policy.Kind), uint64(policy.Pattern)))
			var live []*Lease
			for step := range 600 {
				if len(live) > 0 && (rng.IntN(3) == 0 || p.Stats().FreePages < 12) {
					i := rng.IntN(len(live))
					require.NoError(t, live[i].Release())
					live = append(live[:i], live[i+1:]...)
				} else {
					tenant := rng.IntN(tenants)
					l, err := p.TryAdmit(Request{
						ID: fmt.Sprintf("s%d", step), Tenant: fmt.Sprintf("t%d", tenant),
						PromptTokens: 1 + rng.IntN(30), MaxNewTokens: rng.IntN(10),
					})
					require.NoError(t, err)
					require.NoError(t, expectScrubbed(p, h, l), "step %d: a lease received a page that was not scrubbed", step)
					// expectScrubbed compares with the exact pattern, so any
					// marker left behind is caught, whatever its value.
					markWith(t, h, l, byte(0xa0+tenant))
					live = append(live, l)
				}
				require.NoError(t, p.Check())
			}
			require.Greater(t, p.Stats().Scrub.PagesScrubbed, uint64(500), "the test reused pages")
		})
	}
}
