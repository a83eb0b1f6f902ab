package kvcache

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// TestTierCanarySoak is the canary-marker leak test with a host tier a
// quarter of the device pool's size: 64 tenants over 16 domains send the
// same prompts (equal tokens, different domains) and prompts of their
// own, far more than the device holds, so that evictions offload to the
// tier and admissions onload from it all the time; requests are also
// preempted (their private pages swapped to the tier) and resumed, and
// tenants move between domains while their pages sit in the tier.
//
// The engine side writes, into every byte of every page it computes, a
// marker that names the lease's domain and the page's content (its
// prompt prefix, or the request's own for a partial or output page).
// Every page of every lease is read back when it is admitted, before the
// engine uses it: a page shared or onloaded from the tier, or restored by
// a swap, must hold exactly its own domain's marker for its content, and
// a fresh page exactly the scrub pattern. So no lease ever receives
// another domain's KV, stale KV, or a half-copied page. Check runs after
// every step.
func TestTierCanarySoak(t *testing.T) {
	for _, policy := range []ScrubPolicy{{Kind: ScrubZero}, {Kind: ScrubPoison}, {Kind: ScrubCanary}} {
		t.Run(policy.Kind.String(), func(t *testing.T) {
			r := runTierSoak(t, policy, 2500, 0)
			require.NoError(t, r.err)
			require.Positive(t, r.stats.Tier.Offloads, "the soak must offload")
			require.Positive(t, r.stats.Tier.Onloads, "the soak must onload")
			require.Positive(t, r.stats.Tier.SwapsIn, "the soak must swap back")
			require.Positive(t, r.stats.Tier.EvictedSlots, "the soak must evict from the tier")
			t.Logf("%d onloaded and %d restored pages verified, %d shared, %d fresh; tier %+v",
				r.onloaded, r.restored, r.shared, r.fresh, r.stats.Tier)
		})
	}
}

// TestTierSoakDetector runs the soak on a tier that skips one scrub in n:
// the canary check of a free slot before it is taken, or the audit of
// the free slots between steps, must catch it.
func TestTierSoakDetector(t *testing.T) {
	for _, n := range []int{7, 31} {
		t.Run(fmt.Sprintf("one in %d", n), func(t *testing.T) {
			r := runTierSoak(t, ScrubPolicy{Kind: ScrubCanary}, 2500, n)
			require.Error(t, r.err, "a tier that skips one scrub in %d went unnoticed over %d steps", n, r.steps)
			require.ErrorIs(t, r.err, ErrCanaryMismatch)
			t.Logf("caught after %d steps: %v", r.steps, r.err)
		})
	}
}

type soakResult struct {
	err                               error // what caught a skipped scrub
	steps                             int
	onloaded, restored, shared, fresh int
	stats                             Stats
}

func runTierSoak(t *testing.T, policy ScrubPolicy, steps, skipOneIn int) soakResult {
	const (
		domains = 16
		perDom  = 4
		total   = 128
		slots   = total / 4
		tpp     = prefixTPP
	)
	var tenants []TenantConfig
	for i := range domains * perDom {
		tenants = append(tenants, TenantConfig{Name: fmt.Sprintf("t%02d", i), Domain: fmt.Sprintf("d%02d", i/perDom)})
	}
	p, err := New(Config{Geometry: prefixGeometry, Pages: total, MaxContextTokens: total * tpp,
		Tenants: tenants, Scrub: policy, HostTier: HostTierConfig{Pages: slots}})
	require.NoError(t, err)
	defer p.Close()
	host := p.dev.(*cudaops.Host)
	spec := p.q.Spec()
	regions := prefixGeometry.Regions()
	fills := 0
	if skipOneIn > 0 {
		p.tier.testSkipFill = func(s []int32) []int32 {
			var kept []int32
			for _, slot := range s {
				if fills++; fills%skipOneIn != 0 {
					kept = append(kept, slot)
				}
			}
			return kept
		}
	}
	seed := uint64(policy.Kind)<<8 | uint64(skipOneIn)
	rng := rand.New(rand.NewPCG(11, seed))
	// The same prompts in every domain, longer than the tier holds for a
	// domain alone; each request appends a few tokens of its own.
	systems := make([][]int32, 12)
	for i := range systems {
		systems[i] = tokens(16+8*i, 0, int32(i+1))
	}

	type live struct {
		l      *Lease
		tenant string
		toks   []int32 // everything it wrote: the prompt, then its output
		budget int
	}
	var leases []live
	type parked struct {
		id, tenant string
		toks       []int32
		budget     int
	}
	var preempted []parked
	var res soakResult
	contentOf := func(toks []int32, page int, id string) string {
		if (page+1)*tpp <= len(toks) {
			return fmt.Sprint(toks[:(page+1)*tpp]) // a full page: its prefix
		}
		return "private " + id // a partial page: the request's own
	}
	want := make([]byte, prefixGeometry.RegionPageBytes())
	// admitted reads every page of a lease just admitted back and writes
	// what the engine computes after its hits.
	admitted := func(step int, l *Lease, toks []int32) {
		table := tableOf(t, l)
		hit := l.HitTokens()
		verified := (hit + tpp - 1) / tpp
		for i, page := range table {
			if i < verified {
				marker(want, l.Domain(), contentOf(toks, i, l.ID()))
				if (i+1)*tpp <= hit {
					res.shared++
				} else {
					res.restored++
				}
			} else {
				w := spec.WordFor(page)
				for off := 0; off < len(want); off += 4 {
					binary.LittleEndian.PutUint32(want[off:], w)
				}
				res.fresh++
			}
			for r := range regions {
				got := host.PageBytes(r, page)
				if !slices.Equal(want, got) {
					t.Fatalf("step %d: lease %s (tenant %s, domain %s) page %d (index %d of %d, %d hit tokens) region %d holds %x…, want %x…",
						step, l.ID(), l.Tenant(), l.Domain(), page, i, len(table), hit, r, got[:8], want[:8])
				}
			}
		}
		// The engine computes the rest (a restored page too: it writes
		// the last token again).
		for i := hit / tpp; i < p.pagesFor(len(toks)); i++ {
			for r := range regions {
				marker(host.PageBytes(r, table[i]), l.Domain(), contentOf(toks, i, l.ID()))
			}
		}
		require.NoError(t, l.Commit(len(toks)))
	}
	onloadsBefore := uint64(0)
	for step := range steps {
		res.steps = step
		switch op := rng.IntN(10); {
		case op < 5: // a new request
			tn := tenants[rng.IntN(len(tenants))].Name
			var toks []int32
			if rng.IntN(4) > 0 {
				toks = slices.Clone(systems[rng.IntN(len(systems))])
			}
			for range 1 + rng.IntN(6) {
				toks = append(toks, int32(rng.IntN(3)))
			}
			id := fmt.Sprintf("r%d", step)
			budget := rng.IntN(12)
			l, err := p.TryAdmit(Request{ID: id, Tenant: tn, PromptTokens: len(toks), MaxNewTokens: budget, TokenIDs: toks})
			if err != nil {
				if errors.Is(err, ErrCanaryMismatch) || errors.Is(err, ErrPoolFaulted) {
					res.err = errors.Join(err, p.Fault())
					res.stats = p.Stats()
					return res
				}
				require.ErrorIs(t, err, ErrPoolExhausted)
				continue
			}
			admitted(step, l, toks)
			_, err = l.CachePrefix(rng.IntN(len(toks) + 1))
			require.NoError(t, err)
			// It generates some of its output (its own tokens).
			for range rng.IntN(budget + 1) {
				toks = append(toks, int32(10+rng.IntN(3)))
			}
			if len(toks) > l.PromptTokens() {
				for i := l.PromptTokens() / tpp; i < p.pagesFor(len(toks)); i++ {
					for r := range regions {
						marker(host.PageBytes(r, tableOf(t, l)[i]), l.Domain(), contentOf(toks, i, id))
					}
				}
				require.NoError(t, l.Commit(len(toks)))
			}
			leases = append(leases, live{l: l, tenant: tn, toks: toks, budget: budget})
		case op < 7: // a release
			if len(leases) == 0 {
				continue
			}
			i := rng.IntN(len(leases))
			require.NoError(t, leases[i].l.Release())
			leases = slices.Delete(leases, i, i+1)
		case op < 8: // a preemption: its private pages swap to the tier
			if len(leases) == 0 {
				continue
			}
			i := rng.IntN(len(leases))
			lv := leases[i]
			_, err := lv.l.Preempt(lv.toks)
			require.NoError(t, err)
			left := lv.budget - (len(lv.toks) - lv.l.PromptTokens())
			preempted = append(preempted, parked{id: lv.l.ID(), tenant: lv.tenant, toks: lv.toks, budget: max(0, left)})
			leases = slices.Delete(leases, i, i+1)
		case op < 9: // a preempted request resumes
			if len(preempted) == 0 {
				continue
			}
			i := rng.IntN(len(preempted))
			pr := preempted[i]
			l, err := p.TryAdmit(Request{ID: pr.id, Tenant: pr.tenant, PromptTokens: len(pr.toks), MaxNewTokens: pr.budget, TokenIDs: pr.toks})
			if err != nil {
				if errors.Is(err, ErrCanaryMismatch) || errors.Is(err, ErrPoolFaulted) {
					res.err = errors.Join(err, p.Fault())
					res.stats = p.Stats()
					return res
				}
				if errors.Is(err, ErrDuplicateRequest) {
					continue
				}
				require.ErrorIs(t, err, ErrPoolExhausted)
				continue
			}
			admitted(step, l, pr.toks)
			preempted = slices.Delete(preempted, i, i+1)
			leases = append(leases, live{l: l, tenant: pr.tenant, toks: pr.toks, budget: pr.budget})
		default: // a tenant moves to another domain (its pages stay)
			tn := tenants[rng.IntN(len(tenants))]
			tn.Domain = fmt.Sprintf("d%02d", rng.IntN(domains))
			require.NoError(t, p.UpdateTenant(tn))
		}
		require.NoError(t, p.Check(), "step %d", step)
		if s := p.Stats().Tier; s.Onloads > onloadsBefore {
			res.onloaded += int(s.Onloads - onloadsBefore)
			onloadsBefore = s.Onloads
		}
		if skipOneIn > 0 {
			if _, err := p.AuditFreePages(); err != nil {
				res.err = err
				res.stats = p.Stats()
				return res
			}
			if f := p.Fault(); f != nil {
				res.err = f
				res.stats = p.Stats()
				return res
			}
		}
	}
	res.stats = p.Stats()
	return res
}
