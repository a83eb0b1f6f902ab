package handoff_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/handoff/internal/testkit"
	"github.com/kvfence/kvfence/kvcache"
)

// The canary soak through the handoff, on miniatures of the hybrid
// presets: many tenants prefill, hand off and decode at random, and every
// page and slot of every group any lease receives is read back before
// the lease writes it. A page a prefill lease or a decode lease receives
// must hold the scrub pattern and nothing else; the units a decode lease
// receives through the handoff must hold exactly what their prefill
// wrote. Check runs after every step on both pools, and both end with
// every free page clean.

// soakPresets are the presets whose miniatures the soak runs: a state
// slot beside MLA latents and indexer keys, a state slot beside K and V,
// and a sliding window beside K and V.
var soakPresets = []string{"glm-5.3-flash", "qwen3-next-80b-a3b", "gpt-oss-120b"}

// soak runs steps of the soak on miniatures of preset, on the devices
// newDev makes for the prefill and the decode pool, and returns the first
// page found holding what it should not (nil when there is none). A
// failure of the machinery itself fails t.
func soak(t *testing.T, preset string, steps int, newDev func() cudaops.Device) error {
	full, err := kvcache.Preset(preset)
	require.NoError(t, err)
	spec, err := full.Miniature(1, 128)
	require.NoError(t, err)
	const tenants = 12
	var tcs []kvcache.TenantConfig
	for i := range tenants {
		tcs = append(tcs, kvcache.TenantConfig{Name: fmt.Sprintf("t%d", i)})
	}
	newPool := func() *kvcache.Pool {
		p, err := kvcache.New(kvcache.Config{Cache: spec, Pages: 24 * 1024 / spec.TokensPerPage(), MaxLeases: 6,
			MaxContextTokens: 4096, AllowUndersizedPool: true, Tenants: tcs,
			Scrub: kvcache.ScrubPolicy{Kind: kvcache.ScrubPoison}, Device: newDev()})
		require.NoError(t, err)
		t.Cleanup(func() { p.Close() })
		return p
	}
	prefill, decode := newPool(), newPool()
	recv, err := handoff.NewReceiver(handoff.ReceiverConfig{Pool: decode, Key: testkit.Key()})
	require.NoError(t, err)
	send, err := handoff.NewSender(handoff.SenderConfig{Key: testkit.Key(), FrameBytes: 16 << 10})
	require.NoError(t, err)
	tr := handoff.NewInProcess(recv)
	rng := rand.New(rand.NewPCG(uint64(len(preset)), 30))
	var decoding []*kvcache.Lease
	for step := range steps {
		if len(decoding) > 0 && (rng.IntN(3) == 0 || len(decoding) > 4) {
			i := rng.IntN(len(decoding))
			require.NoError(t, decoding[i].Release())
			decoding = append(decoding[:i], decoding[i+1:]...)
			continue
		}
		tenant := rng.IntN(tenants)
		id := fmt.Sprintf("s%d", step)
		prompt := 1 + rng.IntN(2000)
		l, err := prefill.TryAdmit(kvcache.Request{ID: id, Tenant: fmt.Sprintf("t%d", tenant), PromptTokens: prompt})
		require.NoError(t, err, "step %d", step)
		if err := holdsScrubbed(prefill, l, nil); err != nil {
			return fmt.Errorf("step %d, prefill: %w", step, err)
		}
		require.NoError(t, l.BeginPrefill())
		require.NoError(t, l.Commit(prompt))
		_, err = l.SlideWindows(cudaops.Ordering{})
		require.NoError(t, err)
		require.NoError(t, writeUnits(prefill, l, id))
		require.NoError(t, l.FinishPrefill())
		exp, err := send.Export(l, 64)
		require.NoError(t, err)
		require.NoError(t, exp.Send(context.Background(), tr), "step %d", step)
		dl, ok := recv.Take(id)
		require.True(t, ok)
		// The decode lease: the units hold exactly the prefill's bytes,
		// every other page it holds is scrubbed.
		if err := holdsScrubbed(decode, dl, func(group string, logical int) bool {
			return unitOf(decode.Spec(), prompt, group, logical)
		}); err != nil {
			return fmt.Errorf("step %d, decode: %w", step, err)
		}
		if err := testkitUnits(decode, dl, id); err != nil {
			return fmt.Errorf("step %d, decode: %w", step, err)
		}
		// Decoding writes the tenant's KV past the prompt.
		require.NoError(t, dl.Commit(prompt+64))
		_, err = dl.SlideWindows(cudaops.Ordering{})
		require.NoError(t, err)
		require.NoError(t, writeAll(decode, dl, fmt.Sprintf("decode of %s by t%d", id, tenant)))
		decoding = append(decoding, dl)
		require.NoError(t, prefill.Check(), "step %d", step)
		require.NoError(t, decode.Check(), "step %d", step)
	}
	for _, dl := range decoding {
		require.NoError(t, dl.Release())
	}
	tr.Wait()
	for _, p := range []*kvcache.Pool{prefill, decode} {
		require.NoError(t, p.Check())
		if _, err := p.AuditFreePages(); err != nil {
			return fmt.Errorf("after the soak: %w", err)
		}
	}
	return nil
}

// unitOf reports whether logical page logical of group is one of the
// units of a handoff of prompt tokens.
func unitOf(spec kvcache.CacheSpec, prompt int, group string, logical int) bool {
	for _, e := range spec.HandoffExtents(prompt) {
		if e.Group == group {
			return logical >= e.First && logical < e.First+e.Units
		}
	}
	return false
}

// holdsScrubbed reads back every page (slot) l holds in every group,
// every region, and returns an error for the first that does not hold
// exactly the pool's scrub pattern, but for those skip names.
func holdsScrubbed(p *kvcache.Pool, l *kvcache.Lease, skip func(group string, logical int) bool) error {
	fill := p.FillSpec()
	for _, g := range p.Spec().Groups {
		first, table, err := l.GroupTable(g.Name, nil)
		if err != nil {
			return err
		}
		for i, page := range table {
			if skip != nil && skip(g.Name, first+i) {
				continue
			}
			var word [4]byte
			binary.LittleEndian.PutUint32(word[:], fill.WordFor(page))
			for r, reg := range g.Regions {
				got := make([]byte, reg.PageBytes)
				if err := l.ReadPage(g.Name, i, r, got); err != nil {
					return err
				}
				if want := bytes.Repeat(word[:], len(got)/4); !bytes.Equal(got, want) {
					return fmt.Errorf("lease %q received page %d of group %q (region %d) holding %q, not its scrub pattern",
						l.ID(), page, g.Name, r, got[:min(len(got), 24)])
				}
			}
		}
	}
	return nil
}

// writeUnits writes, into every unit of a handoff of l's prompt, bytes
// naming the request, the group, the logical page and the region.
func writeUnits(p *kvcache.Pool, l *kvcache.Lease, id string) error {
	spec := p.Spec()
	for gi, e := range spec.HandoffExtents(l.PromptTokens()) {
		for j := range e.Units {
			for r, reg := range spec.Groups[gi].Regions {
				if err := l.WritePage(e.Group, j, r, unitBytes(id, e.Group, e.First+j, r, reg.PageBytes)); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// testkitUnits checks that l holds, in the units of its prompt, what
// writeUnits wrote for id.
func testkitUnits(p *kvcache.Pool, l *kvcache.Lease, id string) error {
	spec := p.Spec()
	for gi, e := range spec.HandoffExtents(l.PromptTokens()) {
		for j := range e.Units {
			for r, reg := range spec.Groups[gi].Regions {
				got := make([]byte, reg.PageBytes)
				if err := l.ReadPage(e.Group, j, r, got); err != nil {
					return err
				}
				if want := unitBytes(id, e.Group, e.First+j, r, reg.PageBytes); !bytes.Equal(got, want) {
					return fmt.Errorf("lease %q unit %d of group %q region %d holds %q, prefill wrote %q",
						id, e.First+j, e.Group, r, got[:min(len(got), 24)], want[:min(len(want), 24)])
				}
			}
		}
	}
	return nil
}

func unitBytes(id, group string, logical, r int, n int64) []byte {
	return bytes.Repeat([]byte(fmt.Sprintf("%s|%s|%d|%d;", id, group, logical, r)), int(n))[:n]
}

// writeAll writes marker bytes into every page of every group l holds.
func writeAll(p *kvcache.Pool, l *kvcache.Lease, marker string) error {
	for _, g := range p.Spec().Groups {
		_, table, err := l.GroupTable(g.Name, nil)
		if err != nil {
			return err
		}
		for i := range table {
			for r, reg := range g.Regions {
				if i < l.HitTokens()/p.TokensPerPage() && g.Kind == kvcache.GroupPerToken {
					continue
				}
				if err := l.WritePage(g.Name, i, r, bytes.Repeat([]byte(marker), int(reg.PageBytes))[:reg.PageBytes]); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func TestHybridHandoffCanarySoak(t *testing.T) {
	steps := 600
	if testing.Short() {
		steps = 100
	}
	for _, preset := range soakPresets {
		t.Run(preset, func(t *testing.T) {
			require.NoError(t, soak(t, preset, steps, func() cudaops.Device { return cudaops.NewHost() }))
		})
	}
}

// skippingDevice is a Host that leaves one fill in every few undone,
// and says it is done: the bug the soak exists to catch.
type skippingDevice struct {
	*cudaops.Host
	mu    sync.Mutex
	every int
	fills int
	// sideOnly skips only the window's or state's pages of a skipped
	// fill, filling the per-token pages (region 0 on): a leak the
	// per-token pages would not show.
	sideOnly bool
}

func (d *skippingDevice) skip() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.fills++
	return d.fills > 2 && d.fills%d.every == 0 // never the pool's first scrub
}

func (d *skippingDevice) Fill(pages []int32, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	if d.skip() {
		return cudaops.Completed(nil), nil
	}
	return d.Host.Fill(pages, spec, after)
}

func (d *skippingDevice) FillSpans(spans []cudaops.Span, spec cudaops.FillSpec, after cudaops.Ordering) (cudaops.Fence, error) {
	if d.skip() {
		if !d.sideOnly {
			return cudaops.Completed(nil), nil
		}
		var kept []cudaops.Span
		for _, s := range spans {
			if s.First == 0 {
				kept = append(kept, s)
			}
		}
		if len(kept) == 0 {
			return cudaops.Completed(nil), nil
		}
		return d.Host.FillSpans(kept, spec, after)
	}
	return d.Host.FillSpans(spans, spec, after)
}

// The detector run: the soak on a device that skips one fill in 7 must
// find a page holding another request's bytes, on every preset; and so
// it must when only a window's or a state slot's pages go unscrubbed.
func TestHybridHandoffSoakCatchesASkippedFill(t *testing.T) {
	for _, preset := range soakPresets {
		for _, sideOnly := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/side-only=%v", preset, sideOnly), func(t *testing.T) {
				err := soak(t, preset, 300, func() cudaops.Device {
					return &skippingDevice{Host: cudaops.NewHost(), every: 7, sideOnly: sideOnly}
				})
				require.Error(t, err, "a device that skips one fill in 7 went unnoticed")
				if sideOnly {
					require.NotContains(t, err.Error(), `group "kv"`, "only a window's or state's pages were left unscrubbed")
				}
				t.Logf("caught: %v", err)
			})
		}
	}
}
