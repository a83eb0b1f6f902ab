package kvcache

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// presetFigures are a preset's sizes, computed by hand from the model's
// configuration numbers (see presets.go for where each comes from).
type presetFigures struct {
	// maxContext is the config's max_position_embeddings.
	maxContext    int
	tokensPerPage int
	// tokenBytes is the per-token group's bytes of one token.
	tokenBytes int64
	// regions counts regions per group, in spec order.
	regions []int
	// side describes each group after the per-token one.
	side []presetSideFigures
}

type presetSideFigures struct {
	name string
	kind GroupKind
	// pageBytes is one page (slot) of the group over all its regions;
	// perLease what one lease holds of it at most.
	pageBytes int64
	perLease  int
}

var presetWant = map[string]presetFigures{
	// 32 layers × K and V × 8 KV heads × head_dim 128 × bf16.
	"llama-3.1-8b": {maxContext: 131_072, tokensPerPage: 16, tokenBytes: 32 * 2 * 8 * 128 * 2, regions: []int{64}},
	// 61 layers × (kv_lora_rank 512 + qk_rope_head_dim 64) × bf16.
	"deepseek-v3": {maxContext: 163_840, tokensPerPage: 64, tokenBytes: 61 * (512 + 64) * 2, regions: []int{61}},
	// 61 layers × (512 fp8 + 512/128 fp32 scales + 64 bf16 rope).
	"deepseek-v3-fp8": {maxContext: 163_840, tokensPerPage: 64, tokenBytes: 61 * (512 + 512/128*4 + 64*2), regions: []int{61}},
	// 78 layers × ((512 + 64) bf16 latent + 128 fp8 indexer key + 1 fp32 scale).
	"glm-5": {maxContext: 202_752, tokensPerPage: 64, tokenBytes: 78 * ((512+64)*2 + 128 + 4), regions: []int{78 * 2}},
	// 11 sparse layers × (512 bf16 latent, no rope + one 132-byte indexer
	// entry per 4 tokens); 34 KDA layers per slot × (3 conv positions ×
	// 3 × 64 × 128 channels bf16 + 64 × 128 × 128 fp32 state).
	"glm-5.3-flash": {maxContext: 1_048_576, tokensPerPage: 64, tokenBytes: 11 * (512*2 + (128+4)/4), regions: []int{11 * 2, 34 * 2},
		side: []presetSideFigures{{name: "state", kind: GroupState, perLease: 1,
			pageBytes: 34 * ((4-1)*3*64*128*2 + 64*128*128*4)}}},
	// 12 full layers × K and V × 2 KV heads × 256 × bf16; 36 Gated
	// DeltaNet layers per slot × (3 conv positions × (32 × 128 + 2 × 16 ×
	// 128) channels bf16 + 32 × 128 × 128 fp32 state).
	"qwen3-next-80b-a3b": {maxContext: 262_144, tokensPerPage: 16, tokenBytes: 12 * 2 * 2 * 256 * 2, regions: []int{12 * 2, 36 * 2},
		side: []presetSideFigures{{name: "state", kind: GroupState, perLease: 1,
			pageBytes: 36 * ((4-1)*(32*128+2*16*128)*2 + 32*128*128*4)}}},
	// 18 full layers × K and V × 8 KV heads × 64 × bf16 per token; the 18
	// sliding layers the same per token, in a ring of 128/16 + 1 pages.
	"gpt-oss-120b": {maxContext: 131_072, tokensPerPage: 16, tokenBytes: 18 * 2 * 8 * 64 * 2, regions: []int{18 * 2, 18 * 2},
		side: []presetSideFigures{{name: "window", kind: GroupSlidingWindow, perLease: 128/16 + 1,
			pageBytes: 16 * 18 * 2 * 8 * 64 * 2}}},
}

func TestPresetBytesAreTheModelConfigsNumbers(t *testing.T) {
	require.Len(t, Presets(), len(presetWant), "a preset without hand-computed figures, or figures without a preset")
	for _, info := range Presets() {
		t.Run(info.Name, func(t *testing.T) {
			want, ok := presetWant[info.Name]
			require.True(t, ok, "no figures for preset %q", info.Name)
			s, err := Preset(info.Name)
			require.NoError(t, err)
			require.NoError(t, s.Validate())
			assert.Equal(t, info.Name, s.Model)
			assert.Equal(t, want.maxContext, info.MaxContextTokens)
			assert.Equal(t, want.tokensPerPage, s.TokensPerPage())
			assert.Equal(t, want.tokenBytes, s.TokenBytes(), "bytes per token")
			assert.Equal(t, want.tokenBytes*int64(want.tokensPerPage), s.PageBytes(), "bytes per page")
			require.Len(t, s.Groups, 1+len(want.side))
			assert.Equal(t, GroupPerToken, s.Groups[0].Kind)
			for gi, g := range s.Groups {
				assert.Len(t, g.Regions, want.regions[gi], "regions of group %q", g.Name)
			}
			var leaseBytes int64
			for i, ws := range want.side {
				g := s.Groups[1+i]
				assert.Equal(t, ws.name, g.Name)
				assert.Equal(t, ws.kind, g.Kind)
				assert.Equal(t, ws.pageBytes, g.bytes(), "bytes per page (slot) of group %q", g.Name)
				assert.Equal(t, ws.perLease, g.perLease(info.MaxContextTokens))
				leaseBytes += int64(ws.perLease) * ws.pageBytes
			}
			assert.Equal(t, leaseBytes, s.LeaseBytes(info.MaxContextTokens), "side-group bytes of one full-context lease")
			assert.Equal(t, 1000*s.PageBytes()+10*leaseBytes, s.BytesFor(1000, 10))
		})
	}
}

// presetPoolConfig is a pool small enough for a host test: the per-token
// pages, and MaxLeases where the spec has side groups (one 141 MiB slot
// of GLM-5.3-Flash is the largest).
func presetPoolConfig(t *testing.T, s CacheSpec) Config {
	t.Helper()
	cfg := Config{Cache: s, Pages: 16, MaxContextTokens: 16 * s.TokensPerPage(),
		Tenants: []TenantConfig{{Name: "a"}, {Name: "b"}}}
	if len(s.Groups) > 1 {
		cfg.MaxLeases = 1
	}
	return cfg
}

// presetFillPattern writes b over mem (doubling copies: the test runs
// over hundreds of MiB under -race).
func presetFillPattern(mem []byte, b byte) {
	if len(mem) == 0 {
		return
	}
	mem[0] = b
	for n := 1; n < len(mem); n *= 2 {
		copy(mem[n:], mem[:n])
	}
}

// presetLeaseEnds are the ways a lease gives its pages back to every
// group: Release, and Preempt with nothing to keep (its own path).
var presetLeaseEnds = []struct {
	name string
	end  func(*Lease) error
}{
	{"release", (*Lease).Release},
	{"preempt", func(l *Lease) error { _, err := l.Preempt(nil); return err }},
}

func TestPresetLeaseEndScrubsAndFreesEveryGroup(t *testing.T) {
	for _, info := range Presets() {
		for _, end := range presetLeaseEnds {
			t.Run(info.Name+"/"+end.name, func(t *testing.T) {
				s, err := Preset(info.Name)
				require.NoError(t, err)
				cfg := presetPoolConfig(t, s)
				p := newPool(t, cfg)
				require.NoError(t, p.Check())
				host := hostOf(t, p)
				require.Len(t, host.Regions(), len(p.lay.regions))

				// 200 tokens: 13 pages of 16 (a full window ring of 9) or 4
				// pages of 64.
				l, err := p.TryAdmit(Request{ID: "r1", Tenant: "a", PromptTokens: 190, MaxNewTokens: 10})
				require.NoError(t, err)
				require.NoError(t, p.Check())

				// Every page (slot) the lease holds, by device region, written
				// with the tenant's data.
				type held struct {
					region int
					page   int32
				}
				var pages []held
				first := 0
				for gi, g := range s.Groups {
					_, table, err := l.GroupTable(g.Name, nil)
					require.NoError(t, err)
					want := s.PagesFor(200)
					if gi > 0 {
						want = g.perLease(200)
					}
					assert.Len(t, table, want, "pages of group %q", g.Name)
					for r := first; r < first+len(g.Regions); r++ {
						for _, pg := range table {
							pages = append(pages, held{r, pg})
						}
					}
					first += len(g.Regions)
				}
				var largest int
				for _, h := range pages {
					mem := host.PageBytes(h.region, h.page)
					require.Equal(t, int(host.Regions()[h.region].PageBytes), len(mem))
					presetFillPattern(mem, 0xA5)
					largest = max(largest, len(mem))
				}

				if len(s.Groups) > 1 {
					// MaxLeases 1: a second lease finds no slot or ring, and
					// is refused with nothing taken.
					before := state(p)
					l2, err := p.TryAdmit(Request{ID: "r2", Tenant: "b", PromptTokens: 10})
					require.Nil(t, l2)
					var ae *AdmissionError
					require.ErrorAs(t, err, &ae)
					assert.ErrorIs(t, err, ErrPoolExhausted)
					assert.Equal(t, s.Groups[1].Name, ae.Group)
					assert.True(t, ae.Retryable())
					assert.Equal(t, before, state(p))
					require.NoError(t, p.Check())
				}

				require.NoError(t, end.end(l))
				require.NoError(t, p.Check())
				zero := make([]byte, largest)
				for _, h := range pages {
					mem := host.PageBytes(h.region, h.page)
					require.True(t, bytes.Equal(mem, zero[:len(mem)]), "region %d page %d still holds the lease's data", h.region, h.page)
				}
				for _, g := range p.Stats().Groups {
					assert.Equal(t, g.Pages, g.Free, "group %q: every page free after the lease ended", g.Name)
				}
				// And the freed slot or ring serves the next lease.
				l2, err := p.TryAdmit(Request{ID: "r2", Tenant: "b", PromptTokens: 190, MaxNewTokens: 10})
				require.NoError(t, err)
				require.NoError(t, p.Check())
				require.NoError(t, l2.Release())
				require.NoError(t, p.Check())
			})
		}
	}
}

func TestPresetUnknownNameIsRefusedWithTheKnownNames(t *testing.T) {
	for _, name := range []string{"", "llama", "GLM-5", "glm-5 ", "deepseek-v3-bf16"} {
		s, err := Preset(name)
		require.ErrorIs(t, err, ErrInvalidConfig, "name %q", name)
		assert.True(t, s.IsZero(), "name %q: no spec beside the error", name)
		for _, info := range Presets() {
			assert.Contains(t, err.Error(), info.Name)
		}
	}
}

func TestPresetsDescribeThemselvesAndTheirSources(t *testing.T) {
	seen := map[string]bool{}
	for _, info := range Presets() {
		assert.False(t, seen[info.Name], "two presets named %q", info.Name)
		seen[info.Name] = true
		assert.NotEmpty(t, info.Description, info.Name)
		assert.NotContains(t, info.Description, "\n", "%s: a one-line description", info.Name)
		assert.NotEmpty(t, info.Source, info.Name)
		assert.Positive(t, info.MaxContextTokens, info.Name)
	}
}

func TestPresetSpecIsNotSharedBetweenCalls(t *testing.T) {
	a, err := Preset("glm-5.3-flash")
	require.NoError(t, err)
	a.Groups[0].Regions[0].PageBytes = 4
	a.Groups[1].Regions[0].AlsoHolds = append(a.Groups[1].Regions[0].AlsoHolds, FP16)
	a.Groups[0].Regions[1].AlsoHolds[0] = FP16
	b, err := Preset("glm-5.3-flash")
	require.NoError(t, err)
	assert.Equal(t, int64(64*512*2), b.Groups[0].Regions[0].PageBytes)
	assert.Empty(t, b.Groups[1].Regions[0].AlsoHolds)
	assert.Equal(t, []DType{FP32}, b.Groups[0].Regions[1].AlsoHolds)
}

func TestPooledIndexerEntryNeverStraddlesTwoPages(t *testing.T) {
	rs, err := PooledIndexerKeys([]int{3, 7}, 128, 4, 64)
	require.NoError(t, err)
	require.Len(t, rs, 2)
	assert.Equal(t, "layer.7.indexer", rs[1].Name)
	assert.Equal(t, int64(64/4*(128+4)), rs[0].PageBytes)

	for _, c := range []struct{ headDim, perEntry, perPage int }{
		{128, 4, 62}, // 15.5 entries a page: one entry in two pages
		{128, 0, 64},
		{128, 4, 0},
		{0, 4, 64},
		{MaxHeadDim + 1, 4, 64},
	} {
		rs, err := PooledIndexerKeys([]int{0}, c.headDim, c.perEntry, c.perPage)
		assert.ErrorIs(t, err, ErrInvalidConfig, "%+v", c)
		assert.Nil(t, rs, "%+v", c)
	}
}

func TestMiniatureKeepsEveryGroupAndTheFirstLayersOfEach(t *testing.T) {
	full, err := Preset("glm-5.3-flash")
	require.NoError(t, err)
	m, err := full.Miniature(2, 64)
	require.NoError(t, err)
	require.NoError(t, m.Validate())
	require.Len(t, m.Groups, len(full.Groups))
	assert.True(t, strings.HasPrefix(m.Model, full.Model))
	names := func(rs []CacheRegion) []string {
		var ns []string
		for _, r := range rs {
			ns = append(ns, r.Name)
		}
		return ns
	}
	// The first two sparse layers are 3 and 7; the first two KDA 0 and 1.
	assert.Equal(t, []string{"layer.3.latent", "layer.3.indexer", "layer.7.latent", "layer.7.indexer"}, names(m.Groups[0].Regions))
	assert.Equal(t, []string{"layer.0.conv", "layer.0.state", "layer.1.conv", "layer.1.state"}, names(m.Groups[1].Regions))
	for gi, g := range m.Groups {
		f := full.Groups[gi]
		assert.Equal(t, f.Name, g.Name)
		assert.Equal(t, f.Kind, g.Kind)
		assert.Equal(t, f.TokensPerPage, g.TokensPerPage)
		assert.Equal(t, f.WindowTokens, g.WindowTokens)
		for ri, r := range g.Regions {
			fr := f.Regions[ri]
			assert.Equal(t, fr.DType, r.DType)
			assert.Equal(t, fr.AlsoHolds, r.AlsoHolds)
			assert.Equal(t, roundUp4((fr.PageBytes+63)/64), r.PageBytes, r.Name)
		}
	}
	// The full spec is untouched.
	assert.Len(t, full.Groups[0].Regions, 22)
	assert.Equal(t, int64(64*512*2), full.Groups[0].Regions[0].PageBytes)

	// Regions laid out layer by layer or kind by kind keep the same layers.
	byKind := CacheSpec{Model: "by kind", Groups: []CacheGroup{{Name: "kv", Kind: GroupPerToken, TokensPerPage: 16,
		Regions: append(MLALatent([]int{0, 1, 2}, 512, 64, BF16, 16), IndexerKeys([]int{0, 1, 2}, 128, 16)...)}}}
	m, err = byKind.Miniature(1, 1)
	require.NoError(t, err)
	assert.Equal(t, []string{"layer.0.latent", "layer.0.indexer"}, names(m.Groups[0].Regions))
	assert.Equal(t, byKind.Groups[0].Regions[0].PageBytes, m.Groups[0].Regions[0].PageBytes, "shrink 1 keeps the bytes")
}

func TestMiniatureRefusesWhatItCannotShrink(t *testing.T) {
	full, err := Preset("gpt-oss-120b")
	require.NoError(t, err)
	for _, c := range []struct{ layers, shrink int }{{0, 1}, {1, 0}, {-1, 4}} {
		m, err := full.Miniature(c.layers, c.shrink)
		assert.ErrorIs(t, err, ErrInvalidConfig, "%+v", c)
		assert.True(t, m.IsZero(), "%+v", c)
	}
	_, err = CacheSpec{}.Miniature(1, 1)
	assert.ErrorIs(t, err, ErrInvalidConfig, "an invalid spec has no miniature")

	adopted, err := Preset("llama-3.1-8b")
	require.NoError(t, err)
	for i := range adopted.Groups[0].Regions {
		r := &adopted.Groups[0].Regions[i]
		r.Memory = &RegionMemory{Host: make([]byte, 4*r.PageBytes), Pages: 4}
	}
	_, err = adopted.Miniature(1, 64)
	assert.ErrorIs(t, err, ErrInvalidConfig, "engine tensors cannot shrink")
}

func TestMiniatureNeedsTheSamePagesAndSlotsAsTheFullSpec(t *testing.T) {
	for _, info := range Presets() {
		t.Run(info.Name, func(t *testing.T) {
			full, err := Preset(info.Name)
			require.NoError(t, err)
			m, err := full.Miniature(1, 64)
			require.NoError(t, err)
			assert.Equal(t, full.TokensPerPage(), m.TokensPerPage())
			for _, tokens := range []int{1, 200, info.MaxContextTokens} {
				assert.Equal(t, full.PagesFor(tokens), m.PagesFor(tokens))
				for gi := 1; gi < len(full.Groups); gi++ {
					assert.Equal(t, full.Groups[gi].perLease(tokens), m.Groups[gi].perLease(tokens))
				}
			}
			assert.Less(t, m.PageBytes(), full.PageBytes())
		})
	}
}
