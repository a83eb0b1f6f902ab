package kvsim

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A pool too small for the synthetic workload's prefixes, with a host
// tier: evictions are offloaded, hits never fall and never pass the
// served bound, every hit page still holds its own domain's KV (the audit
// reads onloaded pages as it reads shared ones), and the audit passes.
func TestRunHostTier(t *testing.T) {
	tr, err := Generate(GenConfig{Seed: 5, Duration: 3 * time.Second, Rate: 40, Tenants: 8, OrgSize: 4,
		AbortFraction: 0.1, CapacityTokens: 256 * 16, MaxContext: 8192, TokensPerPage: 16})
	require.NoError(t, err)
	for _, domains := range DomainModes {
		t.Run(domains, func(t *testing.T) {
			run := func(tier int) *RunResult {
				cfg := prefixConfig("zero", domains)
				cfg.PoolPages, cfg.MaxContext, cfg.Duration, cfg.QueueTimeout = 256, 8192, 3*time.Second, 500*time.Millisecond
				cfg.PrefillTokens, cfg.HostTierPages = 512, tier
				res, err := Run(tr, cfg)
				require.NoError(t, err)
				return res
			}
			plain, tiered := run(0), run(1024)
			require.Nil(t, plain.Tier)
			require.NotNil(t, tiered.Tier)
			assert.Equal(t, 1024*16, tiered.HostTierTokens)
			assert.Positive(t, tiered.Tier.OffloadedPages)
			assert.Equal(t, tiered.Tier.OnloadedPages, tiered.Tier.TierHitPages, "no preemption here: every onload is a prefix hit")
			assert.GreaterOrEqual(t, tiered.Prefix.HitPages, plain.Prefix.HitPages, "the tier keeps what the device evicts")
			assert.LessOrEqual(t, tiered.Prefix.HitPages, tiered.Prefix.ServedBound.HitPages)
			assert.True(t, tiered.Prefix.LeaseHitTokensMatch)
			assert.Positive(t, tiered.Audit.HitPagesChecked)
			assert.Zero(t, tiered.Audit.ForeignHitPages+tiered.Audit.EmptyHitPages)
			assert.True(t, tiered.Audit.Passed, tiered.Audit.Summary)
		})
	}
}

// tierTrace: a's prompt is published, a request of most of the pool
// evicts it, and the prompt comes back: into the tier, and out again.
const tierTrace = `{"type":"tenant","name":"a"}
{"type":"tenant","name":"b"}
{"type":"request","at":0,"id":"r1","tenant":"a","prompt":200,"prefix":192,"output":2}
{"type":"request","at":0.5,"id":"r2","tenant":"b","prompt":960,"output":2}
{"type":"request","at":1.5,"id":"r3","tenant":"a","prompt":200,"prefix":192,"output":2}
{"type":"request","at":1.6,"id":"r4","tenant":"b","prompt":200,"prefix":192,"output":2}
`

// The hand trace's r2 evicts 9 of a's 12 cached pages (64-page pool: r2
// takes 61): r3 finds the other 3 on the device, and the 9 in the tier
// only with one; b's request of the same tokens (another domain) finds
// none either way.
func TestRunHostTierHandTrace(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(tierTrace), "tier")
	require.NoError(t, err)
	for _, policy := range []string{"zero", "canary"} {
		t.Run(policy, func(t *testing.T) {
			run := func(tier int) *RunResult {
				cfg := prefixConfig(policy, DomainsPerTenant)
				cfg.HostTierPages = tier
				res, err := Run(tr, cfg)
				require.NoError(t, err)
				require.True(t, res.Audit.Passed, res.Audit.Summary)
				return res
			}
			plain, tiered := run(0), run(32)
			assert.EqualValues(t, 3, plain.Prefix.HitPages, "evicted: r3 computes 9 pages again")
			assert.EqualValues(t, 12, tiered.Prefix.HitPages, "r3 onloads the 9")
			assert.GreaterOrEqual(t, tiered.Tier.OffloadedPages, uint64(9))
			assert.EqualValues(t, 9, tiered.Tier.OnloadedPages)
			assert.EqualValues(t, 9, tiered.Tier.TierHitPages)
			assert.Positive(t, tiered.Audit.HitPagesChecked, "the onloaded pages were read back")
			assert.Zero(t, tiered.Audit.ForeignHitPages+tiered.Audit.EmptyHitPages)
		})
	}
}

// A hybrid model's host tier keeps the state checkpoints the device
// evicts. With state slots for one lease and one checkpoint, r3's
// checkpoint at 128 evicts r1's at 192 (hybridTrace): r4, r1's prompt
// again, hits 128 on the device alone and 192 with a tier, whose
// checkpoint it restores; the audit reads the restored state as any
// other and passes, and the tier's figures count it.
func TestRunHybridHostTier(t *testing.T) {
	tr, err := ParseTrace(strings.NewReader(hybridTrace), "hybrid")
	require.NoError(t, err)
	run := func(tier, ckpts int) *RunResult {
		m := modelPool(t, "qwen3-next-80b-a3b")
		m.MaxLeases, m.CheckpointSlots = 1, 1
		cfg := hybridConfig(m, "zero")
		cfg.MaxBatch, cfg.Domains = 1, DomainsPerTenant
		cfg.HostTierPages, cfg.HostTierCheckpoints = tier, ckpts
		res, err := Run(tr, cfg)
		require.NoError(t, err)
		require.True(t, res.Audit.Passed, res.Audit.Summary)
		return res
	}
	plain, tiered := run(0, 0), run(64, 2)
	require.Nil(t, plain.Tier)
	require.NotNil(t, tiered.Tier)
	assert.Equal(t, 2, tiered.HostTierCheckpoints)
	tc := tiered.Tier
	assert.Equal(t, 2, tc.CheckpointSlots)
	assert.Positive(t, tc.CheckpointsStored)
	assert.Positive(t, tc.CheckpointsRestored)
	assert.Equal(t, tc.CheckpointsRestored*uint64(tiered.Checkpoints.SlotBytes), tc.CheckpointRestoreBytes, "at the model's size")
	assert.Zero(t, tc.CheckpointsDropped+tc.CheckpointsFailed)
	assert.Greater(t, tiered.Prefix.HitTokens, plain.Prefix.HitTokens, "r4 restores r1's checkpoint from the tier")
	assert.Greater(t, tiered.Checkpoints.HitTokens, plain.Checkpoints.HitTokens)
}
