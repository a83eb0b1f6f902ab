package kvsim

import (
	"math"
	"slices"
	"time"
)

// RunResult is what one replay measured. Times called "serving" are
// virtual (the trace's clock); the others are wall-clock times of this
// process, on its device.
type RunResult struct {
	Policy     string `json:"policy"`
	Unsafe     bool   `json:"unsafe"` // the "none" baseline: fills skipped
	Device     string `json:"device"`
	PoolPages  int    `json:"pool_pages"`
	PoolTokens int    `json:"pool_tokens"`
	// PoolBytes is the pool at the report geometry (RunConfig.ReportGeometry,
	// else the pool's own); HostPoolBytes what was allocated.
	PoolBytes     int64  `json:"pool_bytes"`
	HostPoolBytes int64  `json:"host_pool_bytes"`
	Domains       string `json:"domains"` // DomainsPerTenant or DomainsShared
	// HostTierPages and HostTierTokens size the pool's host tier (0: none);
	// Tier is what it did.
	HostTierPages  int `json:"host_tier_pages"`
	HostTierTokens int `json:"host_tier_tokens"`
	// HostTierCheckpoints is the tier's checkpoint slots (a hybrid
	// model's; RunConfig.HostTierCheckpoints).
	HostTierCheckpoints int         `json:"host_tier_checkpoints,omitempty"`
	Tier                *TierResult `json:"tier,omitempty"`
	KVWritesSimulated   bool        `json:"kv_writes_simulated"`
	// Sizing is SizingFull or SizingOnDemand; HeadroomTokens and
	// GrowthWatermark are on-demand's (0 under full sizing).
	Sizing          string  `json:"sizing"`
	HeadroomTokens  int     `json:"headroom_tokens"`
	GrowthWatermark float64 `json:"growth_watermark"`

	ServingSeconds    float64 `json:"serving_seconds"`     // virtual time replayed
	WallSeconds       float64 `json:"wall_seconds"`        // the replay loop, everything included
	ServingCPUSeconds float64 `json:"serving_cpu_seconds"` // wall minus audit and sampling: the run time
	AdmitSeconds      float64 `json:"admit_seconds"`
	ReleaseSeconds    float64 `json:"release_seconds"` // includes the fills
	FillSeconds       float64 `json:"fill_seconds"`
	KVWriteSeconds    float64 `json:"kv_write_seconds"`
	AuditSeconds      float64 `json:"audit_seconds"`

	Arrived          uint64            `json:"arrived"`
	Admitted         uint64            `json:"admitted"`
	Completed        uint64            `json:"completed"`
	Aborted          uint64            `json:"aborted"`
	ShutdownReleases uint64            `json:"shutdown_releases"`
	Releases         uint64            `json:"releases"`
	Refusals         map[string]uint64 `json:"refusals"` // admission attempts refused, by reason (pool counters)
	Dropped          map[string]uint64 `json:"dropped"`  // requests never served, by reason
	QueueWaitSeconds float64           `json:"queue_wait_seconds"`

	AdmissionsPerServingSecond float64         `json:"admissions_per_serving_second"`
	AdmitThroughput            float64         `json:"admit_throughput_per_cpu_second"`
	AdmitLatency               LatencySummary  `json:"admit_latency"`
	Latencies                  []time.Duration `json:"-"`

	PromptTokens    uint64 `json:"prompt_tokens"`
	TokensGenerated uint64 `json:"tokens_generated"`
	KVBytesWritten  uint64 `json:"kv_bytes_written"`
	ScrubFills      uint64 `json:"scrub_fills"`
	PagesScrubbed   uint64 `json:"pages_scrubbed"`
	// BytesScrubbed is what the fills wrote, at the report geometry;
	// HostBytesScrubbed what the device actually wrote. KVBytesWritten
	// and the prefix cache's PrefillBytesAvoided are at the report
	// geometry too.
	BytesScrubbed               uint64  `json:"bytes_scrubbed"`
	HostBytesScrubbed           uint64  `json:"host_bytes_scrubbed"`
	ScrubBytesPerGeneratedToken float64 `json:"scrub_bytes_per_generated_token"`
	ScrubPerKVWritten           float64 `json:"scrub_bytes_per_kv_byte_written"`
	FillShare                   float64 `json:"fill_share_of_run_time"`
	// GPUFillPerServingSecond estimates the device seconds the fills
	// would take per second of serving, at the -device-bandwidth given.
	GPUFillPerServingSecond *float64     `json:"gpu_fill_seconds_per_serving_second"`
	ScrubByBatch            []FillBucket `json:"scrub_by_batch"`

	Prefix PrefixResult `json:"prefix_cache"`
	// Checkpoints is what a hybrid model's state checkpoints did
	// (RunConfig.Model with a state group); nil for other pools.
	Checkpoints *CheckpointResult `json:"checkpoints,omitempty"`
	// TTFT is the virtual time from arrival to the first generated token
	// (queueing and prefill), of requests that generate one.
	TTFT TTFTSummary `json:"ttft"`

	Utilisation []UtilSample `json:"utilisation"`
	PeakInUse   float64      `json:"peak_in_use"`
	MeanInUse   float64      `json:"mean_in_use"`
	// KVUtilisation is the pages holding written KV ÷ the pages leases
	// hold, summed over the utilisation samples (page-weighted): what
	// share of its reservations the engine used. 0 when no lease was held
	// at any sample.
	KVUtilisation float64 `json:"kv_utilisation"`
	// Concurrency is the requests running in each step (after its
	// admissions), over the steps that ran any.
	Concurrency Concurrency `json:"concurrency"`
	// Growth is what on-demand sizing did: growths, preemptions,
	// re-admissions (all zero under full sizing).
	Growth GrowthResult `json:"growth"`

	Audit      AuditResult `json:"audit"`
	VsBaseline *Ratios     `json:"vs_baseline,omitempty"`
}

// Concurrency is how many requests ran at once. The mean is over the
// steps that ran at least one request (BusySeconds of them, in virtual
// time): over the whole window it would be the work served ÷ the window,
// the same for any sizing that serves the same requests.
type Concurrency struct {
	Mean        float64 `json:"mean"`
	Max         int     `json:"max"`
	BusySeconds float64 `json:"busy_seconds"`
}

// GrowthResult counts the growth of on-demand leases, the preemptions
// refused growths caused and the re-admissions of the preempted requests.
type GrowthResult struct {
	Grown      uint64            `json:"grown"`       // growths that added pages (the pool's count)
	PagesGrown uint64            `json:"pages_grown"` // pages they added
	Refused    map[string]uint64 `json:"refused"`     // growths refused, by reason (the pool's count)
	// Preempted counts the leases preempted; PreemptKeptPages the pages
	// their preemption left in the prefix cache (the pool's count).
	Preempted        uint64 `json:"preempted"`
	PreemptKeptPages uint64 `json:"preempt_kept_pages"`
	// Readmitted counts the admissions of preempted requests, which
	// RunResult.Admitted does not count again; ReadmitWaitSeconds their
	// time back in the queue (virtual).
	Readmitted         uint64  `json:"readmitted"`
	ReadmitWaitSeconds float64 `json:"readmit_wait_seconds"`
	// Prefix hits of the re-admissions (pages as the pool counts a
	// lookup), which RunResult.Prefix leaves out so that its hit rate
	// stays comparable with the trace's bound: ReadmitHitTokens were
	// shared back rather than computed again, RecomputedTokens computed
	// again.
	ReadmitLookupPages uint64 `json:"readmit_lookup_pages"`
	ReadmitHitPages    uint64 `json:"readmit_hit_pages"`
	ReadmitHitTokens   uint64 `json:"readmit_hit_tokens"`
	RecomputedTokens   uint64 `json:"recomputed_tokens"`
	// Truncated counts, by reason, requests ended before their output
	// because their lease could never grow to it, or they could never be
	// admitted again (more than the pool in service or the tenant's whole
	// quota); they keep the tokens they generated.
	Truncated map[string]uint64 `json:"truncated"`
	// Stalls counts the steps a request wrote nothing because its growth
	// met a pool faulted by its own canary audit (cleared, as in
	// admission).
	Stalls uint64 `json:"stalls"`
	// PreemptedAtEnd counts preempted requests still waiting at the end
	// of the serving window.
	PreemptedAtEnd uint64 `json:"preempted_at_end"`
	// GrowSeconds and PreemptSeconds are the wall time of the growths
	// (TryGrow, refused ones included) and of the preemptions (Preempt and
	// hashing the computed tokens into page keys).
	GrowSeconds    float64 `json:"grow_seconds"`
	PreemptSeconds float64 `json:"preempt_seconds"`
}

// TierResult is what a run's host tier did (the pool's TierStats): pages
// copied into it by evictions and back by admissions (which the prefix
// figures count as hits, TierHitPages of them), in report bytes, and
// the time the copies took.
type TierResult struct {
	OffloadedPages  uint64  `json:"offloaded_pages"`
	OffloadedBytes  uint64  `json:"offloaded_bytes"`
	OffloadsDropped uint64  `json:"offloads_dropped"`
	OnloadedPages   uint64  `json:"onloaded_pages"`
	OnloadedBytes   uint64  `json:"onloaded_bytes"`
	TierHitPages    uint64  `json:"tier_hit_pages"`
	EvictedSlots    uint64  `json:"evicted_slots"`
	CachedAtEnd     int     `json:"cached_at_end"`
	OffloadSeconds  float64 `json:"offload_seconds"`
	OnloadSeconds   float64 `json:"onload_seconds"`
	// A hybrid model's state checkpoints in the tier
	// (kvcache.TierStats): its slots, those the device evicted that it
	// stored, had no room for (dropped) or failed to copy, restored by
	// hits (counted in the checkpoints' hits too) and their bytes at the
	// model's size, evicted (for room, or with their page), held at the
	// end.
	CheckpointSlots        int    `json:"checkpoint_slots,omitempty"`
	CheckpointsStored      uint64 `json:"checkpoints_stored,omitempty"`
	CheckpointsDropped     uint64 `json:"checkpoints_dropped,omitempty"`
	CheckpointsFailed      uint64 `json:"checkpoints_failed,omitempty"`
	CheckpointsRestored    uint64 `json:"checkpoints_restored,omitempty"`
	CheckpointRestoreBytes uint64 `json:"checkpoint_restore_bytes,omitempty"`
	CheckpointsEvicted     uint64 `json:"checkpoints_evicted,omitempty"`
	CheckpointsAtEnd       int    `json:"checkpoints_at_end,omitempty"`
}

// UtilSample is the pool at one virtual instant, as fractions of its pages.
type UtilSample struct {
	T     float64 `json:"t"`
	InUse float64 `json:"in_use"` // pages held by leases
	// WrittenPages are the pages leases hold that hold written KV (a page
	// shared by several leases counts once, as in InUse).
	WrittenPages float64 `json:"written_pages"`
	Written      float64 `json:"written"` // token slots holding KV (a shared page's once)
	Quarantined  float64 `json:"quarantined"`
	Cached       float64 `json:"cached"` // published pages no lease holds: evictable
	Queued       int     `json:"queued"`
	Running      int     `json:"running"`
}

// AuditResult is the isolation audit of a run.
type AuditResult struct {
	Enabled          bool   `json:"enabled"`
	Method           string `json:"method"`
	Passed           bool   `json:"passed"`
	Summary          string `json:"summary"`
	PagesChecked     uint64 `json:"pages_checked"`
	StalePages       uint64 `json:"stale_pages"`
	CrossTenantPages uint64 `json:"cross_tenant_pages"`
	ReadErrors       uint64 `json:"read_errors"`
	CanaryChecks     uint64 `json:"canary_checks"`
	CanaryFailures   uint64 `json:"canary_failures"`
	PoolCanaryFaults uint64 `json:"pool_canary_faults"`
	// Prefix hits: pages shared from the cache, checked for the KV of
	// the lease's own domain.
	HitPagesChecked uint64 `json:"hit_pages_checked"`
	ForeignHitPages uint64 `json:"foreign_hit_pages"` // another domain's KV
	EmptyHitPages   uint64 `json:"empty_hit_pages"`   // no KV: scrubbed or never written
	// A hybrid model's state slots, checked at each admission: a fresh
	// slot must hold the policy's scrub word (StaleStateSlots: it held
	// state, CrossTenantStateSlots of another tenant), a restored one its
	// own domain's state (ForeignStateSlots: it did not).
	StateSlotsChecked     uint64   `json:"state_slots_checked,omitempty"`
	StaleStateSlots       uint64   `json:"stale_state_slots,omitempty"`
	CrossTenantStateSlots uint64   `json:"cross_tenant_state_slots,omitempty"`
	ForeignStateSlots     uint64   `json:"foreign_state_slots,omitempty"`
	Examples              []string `json:"examples,omitempty"`
}

// PrefixResult is what the prefix cache saved in a run. Pages are full
// prompt pages that admitted requests looked up (the page holding the
// last prompt token is never shared, so it is not looked up).
type PrefixResult struct {
	Enabled        bool    `json:"enabled"`
	Domains        int     `json:"domains"` // sharing domains in the pool
	LookupPages    uint64  `json:"lookup_pages"`
	HitPages       uint64  `json:"hit_pages"`
	MissPages      uint64  `json:"miss_pages"`
	HitRate        float64 `json:"hit_rate"` // hit ÷ looked-up pages
	HitTokens      uint64  `json:"hit_tokens"`
	PromptHitShare float64 `json:"prompt_hit_share"` // hit tokens ÷ prompt tokens admitted
	// PrefillBytesAvoided is the KV the engine did not write (or compute)
	// because it was shared: hit tokens × bytes per token.
	PrefillBytesAvoided uint64 `json:"prefill_bytes_avoided"`
	StoredPages         uint64 `json:"stored_pages"`
	EvictedPages        uint64 `json:"evicted_pages"`
	CachedPagesAtEnd    int    `json:"cached_pages_at_end"`
	// KeyDerivations counts the requests whose prompts were tokenised and
	// hashed into page keys (Pool.PageKeys), and KeySeconds the wall time
	// it took: once per request, on its first admission attempt, however
	// often it is retried; admissions are given the keys (Request.PageKeys),
	// so the pool hashes nothing.
	KeyDerivations uint64  `json:"key_derivations"`
	KeySeconds     float64 `json:"key_seconds"`
	// LeaseHitTokensMatch: the pool's hit-token counters equal the sum of
	// the leases' HitTokens.
	LeaseHitTokensMatch bool `json:"lease_hit_tokens_match"`
	// Bound is the most this trace lets a prefix cache hit with this
	// run's page size, domain layout and longest admissible request (the
	// context window or the pool, if smaller; see PrefixBound).
	Bound PrefixBound `json:"bound"`
	// ServedBound is the same count over the requests the run admitted,
	// in the order it admitted them: the most an infinite cache could have
	// hit on what this run served. HitRate never exceeds it; it differs
	// from Bound when requests the pool could take were not served
	// (queue timeouts, still queued at the end).
	ServedBound PrefixBound    `json:"served_bound"`
	PerDomain   []DomainPrefix `json:"per_domain,omitempty"`
}

// DomainPrefix is one sharing domain's prefix-cache counters.
type DomainPrefix struct {
	Name         string `json:"name"`
	Shared       bool   `json:"shared"`
	Tenants      int    `json:"tenants"`
	HitPages     uint64 `json:"hit_pages"`
	MissPages    uint64 `json:"miss_pages"`
	HitTokens    uint64 `json:"hit_tokens"`
	StoredPages  uint64 `json:"stored_pages"`
	EvictedPages uint64 `json:"evicted_pages"`
}

// TTFTSummary are nearest-rank percentiles of virtual times, in seconds.
type TTFTSummary struct {
	N    int     `json:"n"`
	P50  float64 `json:"p50_s"`
	P99  float64 `json:"p99_s"`
	Mean float64 `json:"mean_s"`
}

func ttftSummary(sorted []time.Duration) TTFTSummary {
	if len(sorted) == 0 {
		return TTFTSummary{}
	}
	var sum time.Duration
	for _, d := range sorted {
		sum += d
	}
	return TTFTSummary{N: len(sorted), P50: Percentile(sorted, 0.5).Seconds(), P99: Percentile(sorted, 0.99).Seconds(),
		Mean: (sum / time.Duration(len(sorted))).Seconds()}
}

// LatencySummary are nearest-rank percentiles, in nanoseconds.
type LatencySummary struct {
	N    int   `json:"n"`
	P50  int64 `json:"p50_ns"`
	P99  int64 `json:"p99_ns"`
	P999 int64 `json:"p999_ns"`
	Max  int64 `json:"max_ns"`
	Mean int64 `json:"mean_ns"`
}

// Ratios compare a run with the unsafe baseline of the same pool size.
type Ratios struct {
	RunTime         float64 `json:"run_time"`
	AdmitP50        float64 `json:"admit_p50"`
	AdmitP99        float64 `json:"admit_p99"`
	AdmitThroughput float64 `json:"admit_throughput"`
	ReleaseTime     float64 `json:"release_time"`
}

func latencySummary(lat []time.Duration) LatencySummary {
	if len(lat) == 0 {
		return LatencySummary{}
	}
	s := slices.Clone(lat)
	slices.Sort(s)
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	return LatencySummary{N: len(s), P50: int64(Percentile(s, 0.50)), P99: int64(Percentile(s, 0.99)),
		P999: int64(Percentile(s, 0.999)), Max: int64(s[len(s)-1]), Mean: int64(sum) / int64(len(s))}
}

// Percentile is the nearest-rank q-quantile of sorted values.
func Percentile[T any](sorted []T, q float64) T {
	var zero T
	if len(sorted) == 0 {
		return zero
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// sumCounts adds up counts by reason.
func sumCounts(m map[string]uint64) uint64 {
	var n uint64
	for _, v := range m {
		n += v
	}
	return n
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// CompareWithBaseline fills in every run's ratios to the unsafe baseline
// of the same pool size, domain layout and sizing (runs without one are
// left alone) and, with a
// device bandwidth in bytes/s, its estimated device fill time per second
// of serving.
func CompareWithBaseline(runs []*RunResult, deviceBandwidth float64) {
	for _, r := range runs {
		if deviceBandwidth > 0 && r.ServingSeconds > 0 {
			v := float64(r.BytesScrubbed) / deviceBandwidth / r.ServingSeconds
			r.GPUFillPerServingSecond = &v
		}
		if r.Unsafe {
			continue
		}
		for _, b := range runs {
			if b.Unsafe && b.PoolPages == r.PoolPages && b.HostTierPages == r.HostTierPages && b.Domains == r.Domains && b.Sizing == r.Sizing {
				r.VsBaseline = &Ratios{
					RunTime:         ratio(r.ServingCPUSeconds, b.ServingCPUSeconds),
					AdmitP50:        ratio(float64(r.AdmitLatency.P50), float64(b.AdmitLatency.P50)),
					AdmitP99:        ratio(float64(r.AdmitLatency.P99), float64(b.AdmitLatency.P99)),
					AdmitThroughput: ratio(r.AdmitThroughput, b.AdmitThroughput),
					ReleaseTime:     ratio(r.ReleaseSeconds, b.ReleaseSeconds),
				}
				break
			}
		}
	}
}
