package kvsim

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/kvcache"
)

// modelPool is a pool of the named preset's miniature, its state (if
// any) shrunk 1024 times, with slots for 4 leases and 16 checkpoints.
func modelPool(t *testing.T, name string) *ModelPool {
	t.Helper()
	spec, err := kvcache.Preset(name)
	require.NoError(t, err)
	mini, err := Miniature(spec, 1024)
	require.NoError(t, err)
	m := &ModelPool{Spec: spec, Miniature: mini}
	if len(spec.Groups) > 1 {
		m.MaxLeases, m.CheckpointSlots = 4, 16
	}
	return m
}

// A model's pool is its miniature, and byte figures are the model's: the
// same counts as a geometry pool of the same pages, the bytes at the
// model's size.
func TestRunModelBytes(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(handTrace), "hand")
	require.NoError(t, err)
	m := modelPool(t, "llama-3.1-8b") // 16 tokens per page, as tinyGeometry
	for _, policy := range []string{"zero", Baseline} {
		host, err := Run(tr, handConfig(policy))
		require.NoError(t, err)
		cfg := handConfig(policy)
		cfg.Geometry, cfg.Model = kvcache.Geometry{}, m
		got, err := Run(tr, cfg)
		require.NoError(t, err)
		assert.Equal(t, host.Admitted, got.Admitted)
		assert.Equal(t, host.PagesScrubbed, got.PagesScrubbed)
		assert.Equal(t, 64*m.Spec.PageBytes(), got.PoolBytes)
		assert.Equal(t, 64*m.Miniature.PageBytes(), got.HostPoolBytes)
		tokens := host.KVBytesWritten / uint64(tinyGeometry.TokenBytes())
		require.Positive(t, tokens)
		assert.Equal(t, tokens*uint64(m.Spec.TokenBytes()), got.KVBytesWritten)
		pages := host.BytesScrubbed / uint64(tinyGeometry.PageBytes())
		assert.Equal(t, pages*uint64(m.Spec.PageBytes()), got.BytesScrubbed)
		assert.Equal(t, pages*uint64(m.Miniature.PageBytes()), got.HostBytesScrubbed)
		assert.Nil(t, got.Checkpoints, "no state group, no checkpoints")
		if policy == Baseline {
			assert.Zero(t, got.BytesScrubbed)
		}
	}
	cfg := handConfig("zero")
	cfg.Model = m
	_, err = Run(tr, cfg)
	assert.ErrorIs(t, err, ErrBadConfig, "a geometry and a model")
	cfg.Geometry, cfg.ReportGeometry = kvcache.Geometry{}, &tinyGeometry
	_, err = Run(tr, cfg)
	assert.ErrorIs(t, err, ErrBadConfig, "a report geometry and a model")
}

// hybridTrace is a hand-built trace of 64-token blocks whose prefix hits
// are known (see TestHybridReplayHits): every boundary is a multiple of
// 64 tokens, so that both hybrid presets' page sizes (16 and 64) give
// the same hits.
const hybridTrace = `{"type":"trace","block_tokens":64}
{"type":"tenant","name":"a","domain":"org"}
{"type":"tenant","name":"b","domain":"org"}
{"type":"request","at":0,"id":"r1","tenant":"a","prompt":200,"blocks":[1,2,3,4],"output":2}
{"type":"request","at":1,"id":"r2","tenant":"a","prompt":200,"blocks":[1,2,3,5],"output":2}
{"type":"request","at":2,"id":"r3","tenant":"a","prompt":150,"blocks":[1,2,6],"output":2}
{"type":"request","at":3,"id":"r4","tenant":"a","prompt":200,"blocks":[1,2,3,4],"output":2}
{"type":"request","at":4,"id":"r5","tenant":"b","prompt":200,"blocks":[1,2,3,4],"output":2}
{"type":"request","at":5,"id":"r6","tenant":"a","prompt":256,"blocks":[1,2,3,7],"output":2}
{"type":"request","at":6,"id":"r7","tenant":"a","prompt":300,"blocks":[1,2,3,7,8],"output":2}
`

func hybridConfig(m *ModelPool, policy string) RunConfig {
	return RunConfig{Model: m, PoolPages: 256, MaxContext: 4096, Policy: policy, Step: 10 * time.Millisecond,
		MaxBatch: 4, QueueTimeout: time.Second, Duration: 8 * time.Second, Audit: true, WriteKV: true, PrefixCache: true}
}

// A hybrid model's replay hits exactly what its checkpoints allow, which
// this trace makes known. Each request arrives a second after the one
// before has published its prompt. Without chunked prefill the engine
// checkpoints at each prompt's prefill checkpoint (the last page boundary
// before its last token) and at a prompt of whole pages (r6's 256):
//
//   - r2 shares blocks 1-3 (192 tokens) with r1, whose checkpoint is at 192: 192;
//   - r3 shares blocks 1-2 (128) with r1, with no checkpoint at 128: a
//     checkpoint miss of 128 tokens, 0 hit; the per-token-only pool hits 128;
//   - r4 is r1 again: 192 (identical prompts reuse);
//   - r5 is r1 from tenant b: 192 in the shared domain, 0 in its own;
//   - r6 shares blocks 1-3 with r1: 192; r7 shares r6's whole prompt, which
//     r6 checkpointed whole: 256.
//
// With chunks of 64 tokens the engine also checkpoints at 64 and 128, and
// r3 hits 128, as the per-token-only pool does.
func TestHybridReplayHits(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(hybridTrace), "hybrid")
	require.NoError(t, err)
	for _, model := range []string{"qwen3-next-80b-a3b", "glm-5.3-flash"} {
		for _, tc := range []struct {
			name           string
			domains        string
			prefill        int
			hits           map[string]int
			misses, missed uint64
		}{
			{"whole prefill, shared", DomainsShared, 0,
				map[string]int{"r2": 192, "r3": 0, "r4": 192, "r5": 192, "r6": 192, "r7": 256}, 1, 128},
			{"whole prefill, per tenant", DomainsPerTenant, 0,
				map[string]int{"r2": 192, "r3": 0, "r4": 192, "r5": 0, "r6": 192, "r7": 256}, 1, 128},
			{"chunks of 64, shared", DomainsShared, 64,
				map[string]int{"r2": 192, "r3": 128, "r4": 192, "r5": 192, "r6": 192, "r7": 256}, 0, 0},
		} {
			t.Run(model+"/"+tc.name, func(t *testing.T) {
				m := modelPool(t, model)
				cfg := hybridConfig(m, "zero")
				cfg.Domains, cfg.PrefillTokens = tc.domains, tc.prefill
				got := map[string]int{}
				cfg.afterAdmit = func(s *sim, a *active) { got[a.req.ID] = a.hit }
				res, err := Run(tr, cfg)
				require.NoError(t, err)
				require.EqualValues(t, 7, res.Completed)
				want := map[string]int{"r1": 0}
				var sum uint64
				for id, h := range tc.hits {
					want[id] = h
					sum += uint64(h)
				}
				assert.Equal(t, want, got, "hit tokens by request")
				assert.Equal(t, sum, res.Prefix.HitTokens)
				assert.True(t, res.Prefix.LeaseHitTokensMatch)
				c := res.Checkpoints
				require.NotNil(t, c)
				hits := uint64(0)
				for _, h := range tc.hits {
					if h > 0 {
						hits++
					}
				}
				assert.Equal(t, hits, c.Hits, "admissions that restored a checkpoint")
				assert.Equal(t, sum, c.HitTokens)
				assert.Equal(t, tc.misses, c.Misses)
				assert.Equal(t, tc.missed, c.MissTokens)
				assert.InDelta(t, float64(sum+tc.missed)/float64(res.Prefix.LookupPages*uint64(m.Spec.TokensPerPage())), c.MatchedRate, 1e-12)
				assert.Zero(t, c.CapacitySkips)
				assert.Positive(t, c.Taken)
				assert.GreaterOrEqual(t, c.Calls, c.Taken)
				assert.EqualValues(t, c.LiveAtEnd, c.StateBytesAtEnd/c.SlotBytes)
				assert.Equal(t, stateBytes(m.Spec), c.SlotBytes)
				assert.Positive(t, c.CopySeconds)
				assert.Positive(t, c.RestoreSeconds)
				assert.True(t, res.Audit.Passed, res.Audit.Summary)
				assert.EqualValues(t, sum/uint64(m.Spec.TokensPerPage()), res.Audit.HitPagesChecked)

				// The same trace on the per-token pages alone: every
				// shared block hits, chunked or not.
				pm := *m
				pm.PerTokenOnly = true
				cfg.Model, cfg.afterAdmit = &pm, nil
				pt, err := Run(tr, cfg)
				require.NoError(t, err)
				assert.Nil(t, pt.Checkpoints)
				wantPT := uint64(192 + 128 + 192 + 192 + 256)
				if tc.domains == DomainsShared {
					wantPT += 192
				}
				assert.Equal(t, wantPT, pt.Prefix.HitTokens)
				assert.Equal(t, pt.Prefix.Bound.HitTokens, pt.Prefix.HitTokens, "the per-token-only pool hits the trace's bound")
				assert.LessOrEqual(t, res.Prefix.HitTokens, pt.Prefix.HitTokens)
			})
		}
	}
}

// Checkpoints refused for lack of room are skipped and counted: with
// state slots for one lease and no checkpoint slots, a checkpoint takes
// the slot a lease would need next (it is evicted for it).
func TestHybridReplayCheckpointRoom(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(hybridTrace), "hybrid")
	require.NoError(t, err)
	m := modelPool(t, "qwen3-next-80b-a3b")
	m.MaxLeases, m.CheckpointSlots, m.MaxCheckpoints = 1, 0, 0
	cfg := hybridConfig(m, "zero")
	cfg.MaxBatch = 1
	res, err := Run(tr, cfg)
	require.NoError(t, err)
	c := res.Checkpoints
	require.NotNil(t, c)
	assert.EqualValues(t, 7, res.Completed)
	assert.Positive(t, c.CapacitySkips, "the one slot is the live lease's while it checkpoints")
	assert.Zero(t, c.Taken)
	assert.Zero(t, res.Prefix.HitTokens)
}

// The unsafe baseline takes and restores checkpoints as any engine; it
// leaks what it does not scrub, and the safe policies pass the audit.
func TestHybridReplayPolicies(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(hybridTrace), "hybrid")
	require.NoError(t, err)
	for _, policy := range Policies {
		t.Run(policy, func(t *testing.T) {
			cfg := hybridConfig(modelPool(t, "glm-5.3-flash"), policy)
			cfg.Domains, cfg.PoolPages = DomainsPerTenant, 24 // pages get reused
			res, err := Run(tr, cfg)
			require.NoError(t, err)
			assert.Positive(t, res.Checkpoints.Hits)
			if policy == Baseline {
				assert.False(t, res.Audit.Passed)
				assert.Zero(t, res.BytesScrubbed)
				return
			}
			assert.True(t, res.Audit.Passed, res.Audit.Summary)
			assert.Positive(t, res.Audit.PagesChecked)
			// Released leases' slots and evicted checkpoints are scrubbed
			// too, at the model's size.
			assert.Greater(t, res.BytesScrubbed, res.PagesScrubbed*uint64(cfg.Model.Spec.PageBytes()))
		})
	}
}

func TestModelPoolValidate(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(hybridTrace), "hybrid")
	require.NoError(t, err)
	for name, mend := range map[string]func(m *ModelPool, c *RunConfig){
		"no max leases":            func(m *ModelPool, c *RunConfig) { m.MaxLeases = 0 },
		"negative slots":           func(m *ModelPool, c *RunConfig) { m.CheckpointSlots = -1 },
		"prefill under a page":     func(m *ModelPool, c *RunConfig) { c.PrefillTokens = 8 },
		"a tier of no checkpoints": func(m *ModelPool, c *RunConfig) { c.HostTierPages = 64 },
		"checkpoints, no tier":     func(m *ModelPool, c *RunConfig) { c.HostTierCheckpoints = 4 },
		"tier checkpoints of a per-token model": func(m *ModelPool, c *RunConfig) {
			*m = *modelPool(t, "llama-3.1-8b")
			c.HostTierPages, c.HostTierCheckpoints = 64, 4
		},
		"miniature of another":  func(m *ModelPool, c *RunConfig) { m.Miniature = modelPool(t, "llama-3.1-8b").Miniature },
		"slots without a state": func(m *ModelPool, c *RunConfig) { *m = *modelPool(t, "llama-3.1-8b"); m.MaxLeases = 4 },
		"sliding window": func(m *ModelPool, c *RunConfig) {
			*m = *modelPool(t, "gpt-oss-120b")
		},
	} {
		m := modelPool(t, "qwen3-next-80b-a3b")
		cfg := hybridConfig(m, "zero")
		mend(m, &cfg)
		_, err := Run(tr, cfg)
		assert.ErrorIs(t, err, ErrBadConfig, name)
	}
	_, err = Miniature(modelPool(t, "qwen3-next-80b-a3b").Spec, 0)
	assert.ErrorIs(t, err, ErrBadConfig)
}

// The miniature keeps every group, page size and region name of the
// spec, one layer of each, with a word per token in its largest
// per-token region.
func TestMiniature(t *testing.T) {
	for _, name := range []string{"glm-5.3-flash", "qwen3-next-80b-a3b", "llama-3.1-8b", "deepseek-v3"} {
		spec, err := kvcache.Preset(name)
		require.NoError(t, err)
		mini, err := Miniature(spec, 1)
		require.NoError(t, err)
		require.Len(t, mini.Groups, len(spec.Groups))
		assert.Equal(t, spec.TokensPerPage(), mini.TokensPerPage())
		var largest int64
		for _, r := range mini.Groups[0].Regions {
			largest = max(largest, r.PageBytes)
		}
		assert.Equal(t, int64(4*spec.TokensPerPage()), largest, name)
		if len(spec.Groups) > 1 {
			// One layer's state at its full size.
			layers := 0
			for _, r := range spec.Groups[1].Regions {
				if strings.HasSuffix(r.Name, ".state") {
					layers++
				}
			}
			assert.Equal(t, stateBytes(spec), int64(layers)*stateBytes(mini), name)
		}
	}
}

// The audit reads every admitted lease's state slot: scrubbed when it
// restored nothing, its own domain's state when it did. The unsafe
// baseline hands out slots with the state of the lease before, another
// tenant's among them.
func TestHybridAuditState(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(hybridTrace), "hybrid")
	require.NoError(t, err)
	for _, policy := range []string{"zero", "canary", Baseline} {
		t.Run(policy, func(t *testing.T) {
			m := modelPool(t, "qwen3-next-80b-a3b")
			m.MaxLeases, m.CheckpointSlots = 1, 2 // three slots: reused all along
			cfg := hybridConfig(m, policy)
			cfg.MaxBatch, cfg.Domains = 1, DomainsPerTenant
			res, err := Run(tr, cfg)
			require.NoError(t, err)
			au := res.Audit
			assert.EqualValues(t, 7, au.StateSlotsChecked, "one slot per admission")
			assert.Zero(t, au.ForeignStateSlots, "restored slots hold their domain's state")
			assert.Positive(t, res.Checkpoints.Hits)
			if policy == Baseline {
				assert.Positive(t, au.StaleStateSlots)
				assert.Positive(t, au.CrossTenantStateSlots, "r5, tenant b, gets a slot of tenant a")
				assert.Contains(t, au.Summary, "state slots held stale state")
				return
			}
			assert.True(t, au.Passed, au.Summary)
			assert.Contains(t, au.Summary, "7 state slots checked")
		})
	}
}
