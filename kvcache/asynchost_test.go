package kvcache

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// TestAsyncHostFillsHandOutOnlyScrubbedPages is the canary-marker leak
// test on a host device whose fills complete after Release returns, as a
// GPU's do: every page a lease receives must hold the scrub pattern, so a
// page handed out while its fill was still running is caught. The pages
// are read through views taken before the first release, which do not
// wait for fills in flight (Host.PageBytes, like every copy, would).
func TestAsyncHostFillsHandOutOnlyScrubbedPages(t *testing.T) {
	for _, policy := range []ScrubPolicy{{Kind: ScrubZero}, {Kind: ScrubCanary}} {
		t.Run(policy.Kind.String(), func(t *testing.T) {
			dev := cudaops.NewHostWith(cudaops.HostConfig{AsyncFills: true})
			t.Cleanup(func() { dev.Close() }) // after the pool's Close
			const tenants = 6
			var tcs []TenantConfig
			for i := range tenants {
				tcs = append(tcs, TenantConfig{Name: fmt.Sprintf("t%d", i)})
			}
			cfg := tinyConfig(64, tcs...)
			cfg.Scrub, cfg.Device = policy, dev
			p := newPool(t, cfg)

			views := make([][][]byte, len(dev.Regions()))
			for r := range views {
				for page := range int32(p.Pages()) {
					views[r] = append(views[r], dev.PageBytes(r, page))
				}
			}
			spec := p.q.Spec()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			rng := rand.New(rand.NewPCG(7, uint64(policy.Kind)))
			var live []*Lease
			inFlight := 0 // releases that returned with their pages still quarantined
			for step := range 500 {
				if len(live) > 0 && (rng.IntN(3) == 0 || len(live) > 8) {
					i := rng.IntN(len(live))
					require.NoError(t, live[i].Release())
					if p.Stats().QuarantinedPages > 0 {
						inFlight++
					}
					live = append(live[:i], live[i+1:]...)
				} else {
					tenant := rng.IntN(tenants)
					l, err := p.Admit(ctx, Request{
						ID: fmt.Sprintf("s%d", step), Tenant: fmt.Sprintf("t%d", tenant),
						PromptTokens: 1 + rng.IntN(24),
					})
					require.NoError(t, err)
					bt, err := l.BlockTable()
					require.NoError(t, err)
					for _, page := range bt {
						for r := range views {
							want := bytes.Repeat(wordLE(spec.WordFor(page)), len(views[r][page])/4)
							require.Equal(t, want, views[r][page], "step %d: lease %s got page %d (region %d) before its scrub ended", step, l.ID(), page, r)
							for i := range views[r][page] {
								views[r][page][i] = byte(0xa0 + tenant)
							}
						}
					}
					live = append(live, l)
				}
				require.NoError(t, p.Check())
			}
			for _, l := range live {
				require.NoError(t, l.Release())
			}
			t.Logf("%d releases returned before their fill ended", inFlight)
			require.Positive(t, inFlight, "no fill was still running when its Release returned: the device did not fill asynchronously")
			require.NoError(t, p.Close())
			require.NoError(t, p.Check())
		})
	}
}
