// Package testkit builds small pools, prefilled leases with recognisable
// content, and the end-of-test audit (accounting, canaries, no leaked
// marker bytes) shared by the handoff tests, the two-process test's peer
// binary and the benchmarks.
package testkit

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/kvcache"
)

// Geometry is small so that tests allocate little: 512-byte pages.
var Geometry = kvcache.Geometry{TokensPerPage: 16, Layers: 1, KVHeads: 1, HeadDim: 8, DType: kvcache.FP16}

// Secret is the HMAC key the test pools share.
var Secret = []byte("kvfence handoff test key, 32+ bytes long")

// Key returns the key for Secret.
func Key() *handoff.Key {
	k, err := handoff.NewKey(Secret)
	if err != nil {
		panic(err)
	}
	return k
}

// Auditor is the tenant every testkit pool has for sweeps.
const Auditor = "audit"

// PoolConfig describes a test pool.
type PoolConfig struct {
	Geometry   kvcache.Geometry // zero: Geometry, unless Spec is set
	Spec       kvcache.CacheSpec
	Pages      int
	MaxContext int // zero: the pool's capacity
	Undersized bool
	// MaxLeases sizes a Spec's window and state groups; zero means 8.
	MaxLeases int
	Tenants   []kvcache.TenantConfig
	// Device, if set, is the empty Host the pool is built on: a test that
	// must reach page memory behind the leases (to tamper with a page in
	// flight) keeps it. Nil: a Host of the pool's own.
	Device *cudaops.Host
	// Opaque, if set, gives the pool its device through the Device
	// interface alone (no page views, no part writes): to the handoff its
	// pages are not host memory, as a GPU's are not, and go through
	// copies.
	Opaque bool
}

// opaqueDevice is a device seen through the Device interface alone.
type opaqueDevice struct{ cudaops.Device }

// NewPool builds a canary-scrubbed pool on its own Host device. The pool
// fills every page with its canary at construction and the canary policy
// checks pages whenever they are handed out, so a byte written into a free
// page is caught at its next admission, and Sweep checks every page.
func NewPool(c PoolConfig) (*kvcache.Pool, error) {
	policy := kvcache.ScrubPolicy{Kind: kvcache.ScrubCanary}
	dev := c.Device
	if dev == nil {
		dev = cudaops.NewHost()
	}
	var pd cudaops.Device = dev
	if c.Opaque {
		pd = opaqueDevice{dev}
	}
	if !c.Spec.IsZero() {
		maxCtx := c.MaxContext
		if maxCtx == 0 {
			maxCtx = c.Pages * c.Spec.TokensPerPage()
		}
		maxLeases := 0
		if len(c.Spec.Groups) > 1 {
			maxLeases = c.MaxLeases
			if maxLeases == 0 {
				maxLeases = 8
			}
		}
		return kvcache.New(kvcache.Config{
			Cache: c.Spec, Pages: c.Pages, MaxContextTokens: maxCtx, AllowUndersizedPool: c.Undersized,
			MaxLeases: maxLeases,
			Tenants:   append([]kvcache.TenantConfig{{Name: Auditor}}, c.Tenants...),
			Scrub:     policy, Device: pd,
		})
	}
	g := c.Geometry
	if g == (kvcache.Geometry{}) {
		g = Geometry
	}
	for range g.Regions() {
		if _, err := dev.AllocRegion(c.Pages, g.RegionPageBytes()); err != nil {
			return nil, err
		}
	}
	maxCtx := c.MaxContext
	if maxCtx == 0 {
		maxCtx = c.Pages * g.TokensPerPage
	}
	return kvcache.New(kvcache.Config{
		Geometry: g, Pages: c.Pages, MaxContextTokens: maxCtx, AllowUndersizedPool: c.Undersized,
		Tenants: append([]kvcache.TenantConfig{{Name: Auditor}}, c.Tenants...),
		Scrub:   policy, Device: pd,
	})
}

// Marker starts every 16-byte block of test KV: finding it in memory
// that no live lease holds means a tenant's data survived a release.
var Marker = []byte("KVFLEAK!")

// fill writes the content of prompt page i of request id into b: blocks of
// Marker, the page index and a hash of the request and block.
func fill(b []byte, id string, page int) {
	h := fnv.New32a()
	h.Write([]byte(id))
	seed := h.Sum32()
	for off := 0; off+16 <= len(b); off += 16 {
		copy(b[off:], Marker)
		binary.LittleEndian.PutUint32(b[off+8:], uint32(page))
		binary.LittleEndian.PutUint32(b[off+12:], seed^uint32(off))
	}
}

// HybridSpec is a small hybrid model's cache, with a group of every
// kind: per-token MLA latents and indexer keys (pages of 16 tokens), a
// sliding window of 48 tokens, and a state slot of two linear-attention
// layers, 16 KiB: larger than a small transport message, so that it
// moves in parts.
func HybridSpec() kvcache.CacheSpec {
	return kvcache.CacheSpec{Model: "testkit-hybrid", Groups: []kvcache.CacheGroup{
		{Name: "kv", Kind: kvcache.GroupPerToken, TokensPerPage: 16, Regions: append(
			kvcache.MLALatent([]int{1, 3}, 12, 4, kvcache.BF16, 16), kvcache.IndexerKeys([]int{1, 3}, 16, 16)...)},
		{Name: "swa", Kind: kvcache.GroupSlidingWindow, TokensPerPage: 16, WindowTokens: 48,
			Regions: kvcache.AttentionKVOf([]int{2}, 1, 8, kvcache.BF16, 16)},
		{Name: "state", Kind: kvcache.GroupState,
			Regions: kvcache.LinearAttentionState([]int{0, 4}, 16, 4, kvcache.BF16, 4, 16, 32, kvcache.FP32)},
	}}
}

// Prefill admits a request, writes its prompt's KV in every cache group
// and walks it to prefilled, as a prefill engine would: each window
// slid to the prompt's end, every page (slot) holding content of its
// request, group, logical page and region (fill).
func Prefill(p *kvcache.Pool, id, tenant string, prompt int) (*kvcache.Lease, error) {
	l, err := p.Admit(context.Background(), kvcache.Request{ID: id, Tenant: tenant, PromptTokens: prompt})
	if err != nil {
		return nil, err
	}
	if err := l.BeginPrefill(); err != nil {
		return nil, err
	}
	if err := l.Commit(prompt); err != nil {
		return nil, err
	}
	if _, err := l.SlideWindows(cudaops.Ordering{}); err != nil {
		return nil, err
	}
	spec := p.Spec()
	for gi, e := range spec.HandoffExtents(prompt) {
		regions := spec.Groups[gi].Regions
		for j := range e.Units {
			for r, reg := range regions {
				buf := make([]byte, reg.PageBytes)
				fill(buf, id, label(gi, e.First+j, r, len(regions)))
				if err := l.WritePage(e.Group, j, r, buf); err != nil {
					return nil, err
				}
			}
		}
	}
	return l, l.FinishPrefill()
}

// label is what fill writes into region r of logical page lp of group gi
// (of regions regions): the page's number among the group's region pages,
// the group in its high byte.
func label(gi, lp, r, regions int) int { return gi<<24 | (lp*regions + r) }

// VerifyContent checks that lease l holds exactly the prompt KV Prefill
// wrote for request id, in every cache group.
func VerifyContent(p *kvcache.Pool, l *kvcache.Lease, id string) error {
	spec := p.Spec()
	for gi, e := range spec.HandoffExtents(l.PromptTokens()) {
		first, table, err := l.GroupTable(e.Group, nil)
		if err != nil {
			return err
		}
		if first != e.First || len(table) < e.Units {
			return fmt.Errorf("testkit: request %q group %q starts at logical page %d with %d pages; the prompt's window starts at %d with %d",
				id, e.Group, first, len(table), e.First, e.Units)
		}
		regions := spec.Groups[gi].Regions
		for j := range e.Units {
			for r, reg := range regions {
				want := make([]byte, reg.PageBytes)
				got := make([]byte, reg.PageBytes)
				fill(want, id, label(gi, e.First+j, r, len(regions)))
				if err := l.ReadPage(e.Group, j, r, got); err != nil {
					return err
				}
				if !bytes.Equal(want, got) {
					return fmt.Errorf("testkit: request %q group %q logical page %d (pool page %d) region %d differs from what prefill wrote",
						id, e.Group, e.First+j, table[j], r)
				}
			}
		}
	}
	return nil
}

// Sweep audits an idle pool (no live leases): the accounting, and that
// every page holds exactly its canary, so no Marker (no tenant's KV) and
// no half-scrubbed page is left anywhere.
func Sweep(p *kvcache.Pool) error {
	if err := p.Check(); err != nil {
		return err
	}
	// A release that just happened on another goroutine (a reclaim
	// deadline) may still be filling its pages.
	quarantined := func(s kvcache.Stats) (n int) {
		for _, g := range s.Groups {
			n += g.Quarantined
		}
		return n
	}
	s := p.Stats()
	for deadline := time.Now().Add(5 * time.Second); quarantined(s) != 0 && time.Now().Before(deadline); s = p.Stats() {
		time.Sleep(time.Millisecond)
	}
	for _, g := range s.Groups {
		if s.LiveLeases != 0 || g.InUse != 0 || g.Quarantined != 0 {
			return fmt.Errorf("testkit: sweep of a busy pool: %d leases; group %q has %d pages in use, %d quarantined",
				s.LiveLeases, g.Name, g.InUse, g.Quarantined)
		}
		if g.Retired != 0 || s.Fault != "" {
			return fmt.Errorf("testkit: group %q has %d pages retired, fault %q", g.Name, g.Retired, s.Fault)
		}
	}
	// Every page must hold exactly its canary: nothing a tenant wrote
	// (no Marker), nothing half-scrubbed.
	if _, err := p.AuditFreePages(); err != nil {
		return fmt.Errorf("testkit: %w", err)
	}
	if st := p.Stats(); st.Scrub.CanaryFailures != 0 {
		return fmt.Errorf("testkit: %d canary failures", st.Scrub.CanaryFailures)
	}
	return nil
}

// RecvWithin is st.Recv, failing t (as what) if it errs or has not
// returned within bound (its Recv is then left to return on its own):
// how a test tells a receiver that stopped waiting from one that waits
// for ever.
func RecvWithin(t testing.TB, st handoff.Stream, bound time.Duration, what string) []byte {
	t.Helper()
	type result struct {
		msg []byte
		err error
	}
	got := make(chan result, 1)
	go func() {
		msg, err := st.Recv()
		got <- result{append([]byte(nil), msg...), err}
	}()
	select {
	case r := <-got:
		if r.err != nil {
			t.Fatalf("%s: %v", what, r.err)
		}
		return r.msg
	case <-time.After(bound):
		t.Fatalf("%s: no message within %v", what, bound)
		return nil
	}
}

// ServeCommands runs the command loop of a decode-side peer process of
// the two-process tests, reading a command a line from in and answering
// each on out with "ok ..." or "err ...": "take ID" verifies the content
// of the lease imported for request ID (VerifyContent) and releases it,
// "sweep" audits the pool's free pages (Sweep), "stats" gives the
// receiver's counts. It returns when in ends.
func ServeCommands(in io.Reader, out io.Writer, pool *kvcache.Pool, recv *handoff.Receiver) error {
	lines := bufio.NewScanner(in)
	for lines.Scan() {
		cmd, arg, _ := strings.Cut(lines.Text(), " ")
		switch cmd {
		case "take":
			l, ok := recv.Take(arg)
			if !ok {
				fmt.Fprintln(out, "err no lease for", arg)
				continue
			}
			err := VerifyContent(pool, l, arg)
			written, phase := l.Written(), l.Phase()
			if rerr := l.Release(); err == nil {
				err = rerr
			}
			if err != nil {
				fmt.Fprintln(out, "err", err)
				continue
			}
			fmt.Fprintln(out, "ok", arg, phase, written)
		case "sweep":
			if err := Sweep(pool); err != nil {
				fmt.Fprintln(out, "err", err)
				continue
			}
			fmt.Fprintln(out, "ok sweep")
		case "stats":
			s := recv.Stats()
			fmt.Fprintln(out, "ok imported", s.Imported, "refused", s.Refused)
		default:
			fmt.Fprintln(out, "err unknown command", cmd)
		}
	}
	return lines.Err()
}
