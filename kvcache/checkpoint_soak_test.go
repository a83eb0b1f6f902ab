package kvcache

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
)

// The canary soak with state checkpoints, on miniatures of the hybrid
// presets: tenants of four sharing domains prefill prompts over a few
// system prompts, checkpoint where an engine would, decode, preempt and
// release at random, with fewer checkpoint slots than checkpoints, so
// that checkpoints are evicted all along. Every unit a lease receives is
// read back before it writes: a restored unit must hold exactly the bytes
// of the checkpoint that the model says its hit restores (its domain's,
// taken last at that prefix), a shared page exactly the KV of its prefix
// in that domain, and every other unit the scrub pattern. Check runs
// after every step and every free page is clean at the end.

// checkpointSoakPresets have a state group: MLA latents and indexer keys
// beside a KDA state, and K and V beside a Gated DeltaNet state.
var checkpointSoakPresets = []string{"glm-5.3-flash", "qwen3-next-80b-a3b"}

// kvPageBytes is the KV the soak's engine writes into region r of the
// page holding the last tokens of prefix, in dom: a function of the
// domain and the prefix only, as real KV is of the tokens.
func kvPageBytes(dom string, prefix []int32, r int, n int64) []byte {
	h := sha256.New()
	h.Write([]byte(dom))
	binary.Write(h, binary.LittleEndian, prefix)
	return bytes.Repeat([]byte(fmt.Sprintf("%x|%d;", h.Sum(nil)[:8], r)), int(n))[:n]
}

// soakPerTokenErr checks l's per-token pages: its hits hold their
// prefix's KV in dom, every other page the scrub pattern.
func soakPerTokenErr(p *Pool, l *Lease, dom string, prompt []int32) error {
	g := p.Spec().Groups[0]
	fill := p.FillSpec()
	tpp := p.TokensPerPage()
	table, err := l.BlockTable()
	if err != nil {
		return err
	}
	for i, page := range table {
		var word [4]byte
		binary.LittleEndian.PutUint32(word[:], fill.WordFor(page))
		for r, reg := range g.Regions {
			got := make([]byte, reg.PageBytes)
			if err := l.ReadPage(g.Name, i, r, got); err != nil {
				return err
			}
			want := bytes.Repeat(word[:], len(got)/4)
			if i < l.HitTokens()/tpp {
				want = kvPageBytes(dom, prompt[:(i+1)*tpp], r, reg.PageBytes)
			}
			if !bytes.Equal(got, want) {
				return fmt.Errorf("lease %q page %d (its %dth, %d hit) region %d holds %q, want %q",
					l.ID(), page, i, l.HitTokens()/tpp, r, got[:min(24, len(got))], want[:min(24, len(want))])
			}
		}
	}
	return nil
}

// soakWriteKV writes the KV of l's pages [from, to) of prompt.
func soakWriteKV(t testing.TB, p *Pool, l *Lease, dom string, prompt []int32, from, to int) {
	g := p.Spec().Groups[0]
	tpp := p.TokensPerPage()
	for i := from; i < to; i++ {
		for r, reg := range g.Regions {
			end := min(len(prompt), (i+1)*tpp)
			require.NoError(t, l.WritePage(g.Name, i, r, kvPageBytes(dom, prompt[:end], r, reg.PageBytes)))
		}
	}
}

// soakTier, in checkpointSoak, gives the pool a host tier of as many
// pages as the pool (and a smaller pool, and more system prompts than it
// keeps, so that pages and checkpoints go to the tier and come back),
// holding checkpoints checkpoints, under policy; skipOneIn > 0 makes the
// tier skip one fill of a checkpoint slot in that many.
type soakTier struct {
	checkpoints int
	policy      ScrubPolicy
	skipOneIn   int
}

// checkpointSoak runs steps of the soak on a miniature of preset over
// dev, with the host tier tier (nil: none), and returns the first unit
// found holding what it should not, or the canary mismatch a tier's
// skipped fill caused (nil if none). A failure of the machinery fails t.
func checkpointSoak(t *testing.T, preset string, steps int, dev cudaops.Device, tier *soakTier) error {
	full, err := Preset(preset)
	require.NoError(t, err)
	spec, err := full.Miniature(1, 128)
	require.NoError(t, err)
	var tenants []TenantConfig
	for i := range 12 {
		tenants = append(tenants, TenantConfig{Name: fmt.Sprint("t", i), Domain: fmt.Sprint("d", i%4)})
	}
	tpp := spec.TokensPerPage()
	cfg := Config{Cache: spec, Pages: 64 * 1024 / tpp, MaxLeases: 6, MaxContextTokens: 8192, AllowUndersizedPool: true,
		Prefix: PrefixConfig{CheckpointSlots: 6}, Tenants: tenants,
		Scrub: ScrubPolicy{Kind: isolation.ScrubPoison}, Device: dev}
	if tier != nil {
		cfg.Pages = 64
		cfg.HostTier = HostTierConfig{Pages: cfg.Pages, Checkpoints: tier.checkpoints}
		cfg.Scrub = tier.policy
	}
	p := newPool(t, cfg)
	fills := 0
	if tier != nil && tier.skipOneIn > 0 {
		base := p.tier.sp[spaceCheckpoints].base
		p.tier.testSkipFill = func(s []int32) []int32 {
			var kept []int32
			for _, slot := range s {
				if slot < base {
					kept = append(kept, slot)
				} else if fills++; fills%tier.skipOneIn != 0 {
					kept = append(kept, slot)
				}
			}
			return kept
		}
	}
	rng := rand.New(rand.NewPCG(uint64(len(preset)), 31))
	systems := make([][]int32, 5)
	if tier != nil {
		systems = make([][]int32, 16) // more than the device keeps
	}
	for i := range systems {
		systems[i] = promptTokens(i+1, (1+i%5)*tpp, 0, (1+i%5)*tpp)
	}
	taken := map[string]string{} // domain + checkpointed prefix → the tag of the last taken there
	key := func(dom string, prefix []int32) string { return fmt.Sprint(dom, prefix) }
	type running struct {
		l      *Lease
		dom    string
		tokens []int32
	}
	var live []running
	// caught is the fault a detector run's skipped fill raised, which
	// ends the soak.
	var caught error
	detector := tier != nil && tier.skipOneIn > 0
	checkpoint := func(r running, n int, tag string) {
		before := p.Stats().Checkpoints.Taken
		err := r.l.CheckpointState(n, cudaops.Ordering{})
		if detector && errors.Is(err, ErrPoolFaulted) {
			caught = err
			return
		}
		if err != nil {
			require.ErrorIs(t, err, ErrCheckpointCapacity)
			return
		}
		if p.Stats().Checkpoints.Taken > before {
			taken[key(r.dom, r.tokens[:n])] = tag
		}
	}
	for step := range steps {
		if len(live) > 0 && (rng.IntN(3) == 0 || len(live) >= 4) {
			i := rng.IntN(len(live))
			r := live[i]
			live = slices.Delete(live, i, i+1)
			if w := r.l.Written(); w%tpp == 0 && rng.IntN(2) == 0 {
				kept, err := r.l.Preempt(r.tokens[:w])
				if detector && errors.Is(err, ErrPoolFaulted) {
					return err
				}
				require.NoError(t, err)
				if kept == w {
					taken[key(r.dom, r.tokens[:w])] = fmt.Sprintf("%s@%d", r.l.ID(), w)
				}
			} else {
				require.NoError(t, r.l.Release())
			}
			continue
		}
		tenant := tenants[rng.IntN(len(tenants))].Name
		dom, err := p.TenantDomain(tenant)
		require.NoError(t, err)
		sys := systems[rng.IntN(len(systems))]
		prompt := append(slices.Clone(sys), promptTokens(0, 0, step%40, 1+rng.IntN(3*tpp))...)
		id := fmt.Sprint("s", step)
		l, err := p.TryAdmit(Request{ID: id, Tenant: tenant, PromptTokens: len(prompt), MaxNewTokens: 2 * tpp, TokenIDs: prompt})
		if detector && errors.Is(err, ErrPoolFaulted) {
			return err // a canary mismatch faults the pool: caught
		}
		require.NoError(t, err, "step %d", step)
		hit := l.HitTokens()
		tag := ""
		if hit > 0 {
			var ok bool
			if tag, ok = taken[key(dom, prompt[:hit])]; !ok {
				return fmt.Errorf("step %d: lease %q of domain %s hit %d tokens, where its domain took no checkpoint", step, id, dom, hit)
			}
		}
		if err := stateErr(p, l, tag, hit); err != nil {
			return fmt.Errorf("step %d, admission: %w", step, err)
		}
		if err := soakPerTokenErr(p, l, dom, prompt); err != nil {
			return fmt.Errorf("step %d, admission: %w", step, err)
		}
		r := running{l: l, dom: dom, tokens: append(slices.Clone(prompt), promptTokens(0, 0, 500+step, 2*tpp)...)}
		// Prefill: to the system prompt's end, checkpoint; to the last
		// page boundary, checkpoint; to the prompt's end.
		require.NoError(t, l.BeginPrefill())
		at := hit
		for _, n := range []int{len(sys), l.PrefillCheckpoint()} {
			if n <= at || n >= len(prompt) {
				continue
			}
			soakWriteKV(t, p, l, dom, prompt, at/tpp, n/tpp)
			prefillTo(t, p, l, id, n)
			checkpoint(r, n, fmt.Sprintf("%s@%d", id, n))
			if caught != nil {
				return caught
			}
			at = n
		}
		soakWriteKV(t, p, l, dom, prompt, at/tpp, (len(prompt)+tpp-1)/tpp)
		prefillTo(t, p, l, id, len(prompt))
		require.NoError(t, l.FinishPrefill())
		// Decode to a page boundary or two.
		w := (len(prompt)/tpp + 1 + rng.IntN(2)) * tpp
		soakWriteKV(t, p, l, dom, r.tokens[:w], len(prompt)/tpp, w/tpp)
		prefillTo(t, p, l, id, w)
		live = append(live, r)
		require.NoError(t, p.Check(), "step %d", step)
		if detector {
			if _, err := p.AuditFreePages(); err != nil {
				return err
			}
			if f := p.Fault(); f != nil {
				return f
			}
		}
	}
	for _, r := range live {
		require.NoError(t, r.l.Release())
	}
	require.NoError(t, p.Check())
	s := p.Stats().Checkpoints
	require.Positive(t, s.Hits, "the soak must hit")
	require.Positive(t, s.Evicted, "the soak must evict checkpoints")
	t.Logf("%s: %d hits (%d tokens), %d misses, %d taken, %d evicted, %d not taken for room",
		preset, s.Hits, s.HitTokens, s.Misses, s.Taken, s.Evicted, s.CapacitySkips)
	if tier != nil {
		ts := p.Stats().Tier
		t.Logf("%s tier: %+v", preset, ts)
		require.Positive(t, ts.CheckpointsStored, "the soak must store checkpoints in the tier")
		require.Positive(t, ts.CheckpointsRestored, "the soak must restore checkpoints from the tier")
		require.Positive(t, ts.Offloads, "the soak must offload pages")
		require.Positive(t, ts.Onloads, "the soak must onload pages")
		t.Logf("%s tier: %d checkpoints stored, %d restored, %d evicted, %d dropped; %d pages offloaded, %d onloaded",
			preset, ts.CheckpointsStored, ts.CheckpointsRestored, ts.CheckpointsEvicted, ts.CheckpointsDropped, ts.Offloads, ts.Onloads)
	}
	if _, err := p.AuditFreePages(); err != nil {
		return fmt.Errorf("after the soak: %w", err)
	}
	return nil
}

func TestCheckpointCanarySoak(t *testing.T) {
	steps := 600
	if testing.Short() {
		steps = 150
	}
	for _, preset := range checkpointSoakPresets {
		t.Run(preset, func(t *testing.T) {
			require.NoError(t, checkpointSoak(t, preset, steps, cudaops.NewHost(), nil))
		})
		// Fills that end after the release returns, as a GPU's: units
		// wait in quarantine while checkpoints and admissions want them.
		t.Run(preset+"/async", func(t *testing.T) {
			dev := cudaops.NewHostWith(cudaops.HostConfig{AsyncFills: true})
			t.Cleanup(func() { dev.Close() }) // after the pool's Close
			require.NoError(t, checkpointSoak(t, preset, steps, dev, nil))
		})
	}
}

// The soak with a host tier a quarter of the pool, fewer checkpoint
// slots there than checkpoints: checkpoints and pages go to the tier and
// come back all along, every unit read back before use, under every
// scrub policy.
func TestCheckpointTierCanarySoak(t *testing.T) {
	steps := 600
	if testing.Short() {
		steps = 150
	}
	for _, preset := range checkpointSoakPresets {
		for _, policy := range []ScrubPolicy{{Kind: isolation.ScrubPoison}, {Kind: isolation.ScrubCanary}} {
			t.Run(preset+"/"+policy.Kind.String(), func(t *testing.T) {
				require.NoError(t, checkpointSoak(t, preset, steps, cudaops.NewHost(), &soakTier{checkpoints: 48, policy: policy}))
			})
		}
	}
}

// The detector run: a tier that skips the fill of one checkpoint slot in
// 5 is caught (the canary check of a free slot before it is taken, or
// the audit of the free slots).
func TestCheckpointTierSoakCatchesASkippedSlotFill(t *testing.T) {
	for _, preset := range checkpointSoakPresets {
		t.Run(preset, func(t *testing.T) {
			err := checkpointSoak(t, preset, 600, cudaops.NewHost(), &soakTier{checkpoints: 48, policy: ScrubPolicy{Kind: isolation.ScrubCanary}, skipOneIn: 5})
			require.Error(t, err, "a tier that skips one checkpoint slot fill in 5 went unnoticed")
			var mismatch *isolation.CanaryError
			require.ErrorAs(t, err, &mismatch)
			t.Logf("caught: %v", err)
		})
	}
}

// skipSideFills is a Host that leaves the window's and state's units of
// one fill in every few unfilled (a checkpoint's slots evicted, among
// others), and says it is done.
type skipSideFills struct {
	*cudaops.Host
	mu    sync.Mutex
	every int
	fills int
}

func (d *skipSideFills) FillSpans(spans []cudaops.Span, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	d.mu.Lock()
	d.fills++
	skip := d.fills > 2 && d.fills%d.every == 0
	d.mu.Unlock()
	if skip {
		var kept []cudaops.Span
		for _, s := range spans {
			if s.First == 0 { // the per-token group's regions come first
				kept = append(kept, s)
			}
		}
		spans = kept
	}
	return d.Host.FillSpans(spans, spec, after)
}

// The detector run: the soak on a device that skips the side units of
// one fill in 7 must find a restored or fresh slot holding what it
// should not.
func TestCheckpointSoakCatchesASkippedSlotFill(t *testing.T) {
	for _, preset := range checkpointSoakPresets {
		t.Run(preset, func(t *testing.T) {
			err := checkpointSoak(t, preset, 400, &skipSideFills{Host: cudaops.NewHost(), every: 7}, nil)
			require.Error(t, err, "a device that skips one slot fill in 7 went unnoticed")
			t.Logf("caught: %v", err)
		})
	}
}
