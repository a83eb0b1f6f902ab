package kvcache

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/cudaops"
)

// engineTensors is host memory laid out as an engine allocates it, with
// guard bytes around every tensor: what kvfence may write (the pages of
// the regions) and what it must never touch (guards, gaps between
// strided pages, an engine's padding page).
type engineTensors struct {
	backing []byte
	guard   []bool // per byte: must stay as the engine left it
}

const guardBytes = 64

// tensor carves an n-byte tensor out of the backing store between two
// guards.
func (e *engineTensors) tensor(n int) []byte {
	start := len(e.backing) + guardBytes
	e.backing = append(e.backing, make([]byte, guardBytes+n+guardBytes)...)
	for i := len(e.guard); i < len(e.backing); i++ {
		e.guard = append(e.guard, i < start || i >= start+n)
	}
	return e.backing[start : start+n]
}

// layoutCase builds a cache spec whose regions adopt tensors laid out as
// an engine lays them out, and marks the bytes outside every region's
// pages as guards.
type layoutCase struct {
	name string
	// build allocates the tensors and returns the spec; it may mark bytes
	// of the tensors as guards (gaps, padding pages).
	build func(e *engineTensors, pages int) CacheSpec
}

// markUnpaged marks every byte of mem outside the pages of a region of
// stride stride as a guard.
func (e *engineTensors) markUnpaged(mem []byte, pages int, stride, pageBytes int64) {
	base := e.offsetOf(mem)
	for i := range int64(len(mem)) {
		if i/stride >= int64(pages) || i%stride >= pageBytes {
			e.guard[base+int(i)] = true
		}
	}
}

func (e *engineTensors) offsetOf(mem []byte) int {
	return int(cudaops.HostRegion(mem, 1, 4, 4).Base - cudaops.HostRegion(e.backing, 1, 4, 4).Base)
}

var engineLayouts = []layoutCase{
	{"vLLM [2, num_blocks, block, heads, dim]", func(e *engineTensors, pages int) CacheSpec {
		regs := AttentionKV(3, 2, 8, BF16, 4) // 128-byte pages
		pb := regs[0].PageBytes
		for l := range 3 {
			k, v, err := FusedKVMemory(KVSplit, pages, pb, 0, e.tensor(2*pages*int(pb)))
			if err != nil {
				panic(err)
			}
			regs[2*l].Memory, regs[2*l+1].Memory = k, v
		}
		return CacheSpec{Groups: []CacheGroup{{Name: "kv", Kind: GroupPerToken, TokensPerPage: 4, Regions: regs}}}
	}},
	{"vLLM [num_blocks, 2, block, heads, dim]", func(e *engineTensors, pages int) CacheSpec {
		regs := AttentionKV(3, 2, 8, BF16, 4)
		pb := regs[0].PageBytes
		for l := range 3 {
			k, v, err := FusedKVMemory(KVInterleaved, pages, pb, 0, e.tensor(2*pages*int(pb)))
			if err != nil {
				panic(err)
			}
			regs[2*l].Memory, regs[2*l+1].Memory = k, v
		}
		return CacheSpec{Groups: []CacheGroup{{Name: "kv", Kind: GroupPerToken, TokensPerPage: 4, Regions: regs}}}
	}},
	{"SGLang k_buffer/v_buffer with a padding page", func(e *engineTensors, pages int) CacheSpec {
		regs := AttentionKV(2, 2, 8, FP16, 4)
		pb := int(regs[0].PageBytes)
		for i := range regs {
			buf := e.tensor((pages + 1) * pb) // page 0 is SGLang's padding
			e.markUnpaged(buf[:pb], 0, int64(pb), int64(pb))
			regs[i].Memory = &RegionMemory{Host: buf[pb:]}
		}
		return CacheSpec{Groups: []CacheGroup{{Name: "kv", Kind: GroupPerToken, TokensPerPage: 4, Regions: regs}}}
	}},
	{"MLA latent + indexer keys, strided with gaps, and state slots", func(e *engineTensors, pages int) CacheSpec {
		spec := hybridSpec()
		spec.Groups = append(spec.Groups[:1], spec.Groups[2]) // per-token + state
		for gi := range spec.Groups {
			n := pages
			if spec.Groups[gi].Kind == GroupState {
				n = 2 // MaxLeases below
			}
			for ri := range spec.Groups[gi].Regions {
				r := &spec.Groups[gi].Regions[ri]
				stride := r.PageBytes + 12 // an engine that pads its pages
				buf := e.tensor(int(stride) * n)
				e.markUnpaged(buf, n, stride, r.PageBytes)
				r.Memory = &RegionMemory{Host: buf, Stride: stride}
			}
		}
		return spec
	}},
}

// Conformance over engine layouts: after a release every byte of every
// region of every group the lease held is scrubbed, the pages of other
// leases keep what the engine wrote, and no byte outside the regions'
// pages (guards around tensors, gaps between strided pages, padding
// pages) is ever written. The pool's regions are the engine's tensors
// (same addresses).
func TestAdoptedEngineLayoutsScrubOnlyTheirPages(t *testing.T) {
	for _, c := range engineLayouts {
		t.Run(c.name, func(t *testing.T) {
			const pages = 12
			var e engineTensors
			e.backing = make([]byte, 0, 1<<20) // no reallocation: tensors keep their addresses
			spec := c.build(&e, pages)
			for i := range e.backing {
				e.backing[i] = 0xcc
			}
			cfg := Config{Cache: spec, Pages: pages, MaxContextTokens: pages * 4, Tenants: []TenantConfig{{Name: "a"}, {Name: "b"}},
				Scrub: ScrubPolicy{Kind: ScrubPoison}}
			if len(spec.Groups) > 1 {
				cfg.MaxLeases = 2
			}
			p := newPool(t, cfg)
			h := hostOf(t, p)
			word := p.q.Spec().Word
			checkGuards := func(what string) {
				t.Helper()
				bad := 0
				for i, g := range e.guard {
					if g && e.backing[i] != 0xcc {
						bad++
					}
				}
				require.Zero(t, bad, "%s: %d guard bytes written", what, bad)
			}
			checkGuards("after the initial scrub")
			// The pool's regions are the engine's memory.
			lay := p.lay
			regions := h.Regions()
			for ri, r := range lay.regions {
				assert.Equal(t, cudaops.HostRegion(r.Memory.Host, 1, 4, 4).Base, regions[ri].Base, "region %q", r.Name)
			}
			victim := admit(t, p, "victim", "a", 18)
			other := admit(t, p, "other", "b", 10)
			// The engine writes its KV through its own tensors.
			write := func(l *Lease, m byte) map[int][]int32 {
				held := leaseRegionPages(t, p, l)
				for ri, pgs := range held {
					r := regions[ri]
					mem := lay.regions[ri].Memory.Host
					for _, pg := range pgs {
						off := int64(pg) * r.Stride
						fillMarker(mem[off:off+r.PageBytes], m)
					}
				}
				return held
			}
			vHeld := write(victim, 0x11)
			write(other, 0x22)
			checkGuards("after the engine's writes")
			require.NoError(t, victim.Release())
			checkGuards("after the release")
			poison := make([]byte, 4)
			binary.LittleEndian.PutUint32(poison, word)
			for ri, pgs := range vHeld {
				r := regions[ri]
				mem := lay.regions[ri].Memory.Host
				for _, pg := range pgs {
					off := int64(pg) * r.Stride
					assert.Equal(t, bytes.Repeat(poison, int(r.PageBytes/4)), mem[off:off+r.PageBytes], "region %d page %d", ri, pg)
				}
			}
			for ri, pgs := range leaseRegionPages(t, p, other) {
				r := regions[ri]
				mem := lay.regions[ri].Memory.Host
				for _, pg := range pgs {
					off := int64(pg) * r.Stride
					assert.Equal(t, bytes.Repeat([]byte{0x22}, int(r.PageBytes)), mem[off:off+r.PageBytes], "other's region %d page %d", ri, pg)
				}
			}
			require.NoError(t, p.Check())
			require.NoError(t, p.Close())
			checkGuards("after Close")
			assert.Equal(t, 0xcc, int(e.backing[0]), "Close left the adopted memory to the engine")
		})
	}
}

// addrDevice stands for a CUDA device: it adopts memory by device
// address (recording what it was given) and keeps the pages in host
// memory behind it.
type addrDevice struct {
	h       *cudaops.Host
	adopted []cudaops.Region
}

func (d *addrDevice) Name() string                                 { return "addr" }
func (d *addrDevice) AllocRegion(pages int, pb int64) (int, error) { return d.h.AllocRegion(pages, pb) }
func (d *addrDevice) Regions() []cudaops.Region                    { return d.h.Regions() }
func (d *addrDevice) Fill(p []int32, s cudaops.FillSpec, o cudaops.Ordering) (cudaops.Fence, error) {
	return d.h.Fill(p, s, o)
}
func (d *addrDevice) FillSpans(sp []cudaops.Span, s cudaops.FillSpec, o cudaops.Ordering) (cudaops.Fence, error) {
	return d.h.FillSpans(sp, s, o)
}
func (d *addrDevice) ReadPage(r int, p int32, b []byte) error  { return d.h.ReadPage(r, p, b) }
func (d *addrDevice) WritePage(r int, p int32, b []byte) error { return d.h.WritePage(r, p, b) }
func (d *addrDevice) Counters() cudaops.Counters               { return d.h.Counters() }
func (d *addrDevice) Close() error                             { return d.h.Close() }
func (d *addrDevice) AdoptRegion(base uint64, pages int, stride, pageBytes int64) (int, error) {
	d.adopted = append(d.adopted, cudaops.Region{Base: base, Stride: stride, PageBytes: pageBytes, Pages: pages})
	return d.h.AllocRegion(pages, pageBytes)
}

// On a device that adopts by address (CUDA), a spec's regions reach the
// device with the addresses, strides and page counts the engine's
// tensors have: vLLM's fused [num_blocks, 2, …] layer as two interleaved
// regions, and a state tensor as slots.
func TestAdoptByDeviceAddress(t *testing.T) {
	const blocks, base = 16, uint64(0x7f00_0000_0000)
	regs := AttentionKV(1, 2, 8, BF16, 4)
	pb := regs[0].PageBytes
	k, v, err := FusedKVMemory(KVInterleaved, blocks, pb, base, nil)
	require.NoError(t, err)
	regs[0].Memory, regs[1].Memory = k, v
	state := LinearAttentionState([]int{1}, 8, 4, BF16, 1, 4, 4, FP32)
	stateBase := base + uint64(2*blocks)*uint64(pb)
	state[0].Memory = &RegionMemory{Base: stateBase, Pages: 3}
	state[1].Memory = &RegionMemory{Base: stateBase + 3*uint64(state[0].PageBytes) + 64, Pages: 3}
	spec := CacheSpec{Groups: []CacheGroup{{Name: "kv", Kind: GroupPerToken, TokensPerPage: 4, Regions: regs},
		{Name: "state", Kind: GroupState, Regions: state}}}
	dev := &addrDevice{h: cudaops.NewHost()}
	defer dev.Close()
	p := newPool(t, Config{Cache: spec, Pages: blocks, MaxLeases: 3, MaxContextTokens: 64, Device: dev, Tenants: []TenantConfig{{Name: "a"}}})
	assert.Equal(t, []cudaops.Region{
		{Base: base, Stride: 2 * pb, PageBytes: pb, Pages: blocks},
		{Base: base + uint64(pb), Stride: 2 * pb, PageBytes: pb, Pages: blocks},
		{Base: stateBase, Stride: state[0].PageBytes, PageBytes: state[0].PageBytes, Pages: 3},
		{Base: stateBase + 3*uint64(state[0].PageBytes) + 64, Stride: state[1].PageBytes, PageBytes: state[1].PageBytes, Pages: 3},
	}, dev.adopted)
	admit(t, p, "r", "a", 10)
	// A host buffer on a device that adopts by address is refused.
	regs[0].Memory = &RegionMemory{Host: make([]byte, 4096)}
	regs[1].Memory = &RegionMemory{Host: make([]byte, 4096)}
	spec.Groups = spec.Groups[:1]
	_, err = New(Config{Cache: spec, Pages: blocks, MaxContextTokens: 64, Device: &addrDevice{h: cudaops.NewHost()}})
	assert.ErrorIs(t, err, ErrInvalidConfig)
	assert.ErrorContains(t, err, "adopts device memory")
}
