package bridge

import (
	"github.com/kvfence/kvfence/kvcache"
)

// StatsDoc is the JSON kvf_pool_stats_json writes: kvcache.Stats with
// snake_case keys, the same names the config uses.
type StatsDoc struct {
	Device           string         `json:"device"`
	TotalPages       int            `json:"total_pages"`
	FreePages        int            `json:"free_pages"`
	InUsePages       int            `json:"in_use_pages"`
	CachedPages      int            `json:"cached_pages"`
	QuarantinedPages int            `json:"quarantined_pages"`
	RetiredPages     int            `json:"retired_pages"`
	TokensPerPage    int            `json:"tokens_per_page"`
	PageBytes        int64          `json:"page_bytes"`
	Groups           []GroupDoc     `json:"groups"` // every cache group, the per-token one first (since ABI 4)
	LiveLeases       int            `json:"live_leases"`
	Admitted         uint64         `json:"admitted"`
	Refused          RefusalsDoc    `json:"refused"`
	Growth           GrowthDoc      `json:"growth"`
	Scrub            ScrubStatsDoc  `json:"scrub"`
	Tenants          []TenantDoc    `json:"tenants"`
	Prefix           PrefixDoc      `json:"prefix"`
	Checkpoints      CheckpointsDoc `json:"checkpoints"` // a hybrid pool's state checkpoints (since ABI 10)
	Tier             TierDoc        `json:"tier"`        // the host tier (since ABI 12)
	Closed           bool           `json:"closed"`
	Fault            string         `json:"fault"`
	// CUDA is the CUDA device's own figures; absent for a host pool.
	CUDA *CUDAStatsDoc `json:"cuda,omitempty"`
}

// CUDAStatsDoc is cudaops.Stats: how the device fills (kernel or memset,
// and why it fell back to memsets), how many releases with no ordering
// synchronised the context, and how often the staging ring was full.
type CUDAStatsDoc struct {
	FillMode      string `json:"fill_mode"`
	KernelError   string `json:"kernel_error"`
	ContextSyncs  uint64 `json:"context_syncs"`
	StagingWaits  uint64 `json:"staging_waits"`
	FencesPending int    `json:"fences_pending"`
}

func cudaStatsDoc(p *kvcache.Pool) *CUDAStatsDoc {
	s, ok := p.DeviceStats()
	if !ok {
		return nil
	}
	return &CUDAStatsDoc{FillMode: s.Mode.String(), KernelError: s.KernelError, ContextSyncs: s.ContextSyncs,
		StagingWaits: s.StagingWaits, FencesPending: s.FencesPending}
}

// RefusalsDoc is kvcache.Refusals.
type RefusalsDoc struct {
	InvalidRequest   uint64 `json:"invalid_request"`
	UnknownTenant    uint64 `json:"unknown_tenant"`
	DuplicateRequest uint64 `json:"duplicate_request"`
	ExceedsContext   uint64 `json:"exceeds_max_context"`
	ExceedsCapacity  uint64 `json:"exceeds_capacity"`
	ExceedsQuota     uint64 `json:"exceeds_quota"`
	PoolExhausted    uint64 `json:"pool_exhausted"`
	PoolFaulted      uint64 `json:"pool_faulted"`
	Total            uint64 `json:"total"`
}

// GrowthDoc is kvcache.GrowthStats.
type GrowthDoc struct {
	Grown            uint64      `json:"grown"`
	PagesGrown       uint64      `json:"pages_grown"`
	Refused          RefusalsDoc `json:"refused"`
	Preempted        uint64      `json:"preempted"`
	PreemptKeptPages uint64      `json:"preempt_kept_pages"`
}

func refusalsDoc(r kvcache.Refusals) RefusalsDoc {
	return RefusalsDoc{
		InvalidRequest: r.InvalidRequest, UnknownTenant: r.UnknownTenant,
		DuplicateRequest: r.DuplicateRequest, ExceedsContext: r.ExceedsContext,
		ExceedsCapacity: r.ExceedsCapacity, ExceedsQuota: r.ExceedsQuota,
		PoolExhausted: r.PoolExhausted, PoolFaulted: r.PoolFaulted, Total: r.Total(),
	}
}

// ScrubStatsDoc is isolation.ScrubStats.
type ScrubStatsDoc struct {
	Fills          uint64 `json:"fills"`
	PagesScrubbed  uint64 `json:"pages_scrubbed"`
	BytesScrubbed  uint64 `json:"bytes_scrubbed"`
	FillErrors     uint64 `json:"fill_errors"`
	PagesRetired   uint64 `json:"pages_retired"`
	CanaryChecks   uint64 `json:"canary_checks"`
	CanaryFailures uint64 `json:"canary_failures"`
}

// TenantDoc is kvcache.TenantStats.
type TenantDoc struct {
	Name          string `json:"name"`
	UsedPages     int    `json:"used_pages"`
	QuotaPages    int    `json:"quota_pages"`
	ReservedPages int    `json:"reserved_pages"`
	Domain        string `json:"domain"` // the sharing domain its new admissions use
}

// PrefixDoc is kvcache.PrefixStats.
type PrefixDoc struct {
	Enabled       bool        `json:"enabled"`
	Domains       []DomainDoc `json:"domains"`
	EventsSent    uint64      `json:"events_sent"`
	EventsDropped uint64      `json:"events_dropped"`
}

// DomainDoc is kvcache.DomainStats.
type DomainDoc struct {
	Name         string `json:"name"`
	Shared       bool   `json:"shared"`
	Tenants      int    `json:"tenants"`
	IndexedPages int    `json:"indexed_pages"`
	CachedPages  int    `json:"cached_pages"`
	HitPages     uint64 `json:"hit_pages"`
	MissPages    uint64 `json:"miss_pages"`
	HitTokens    uint64 `json:"hit_tokens"`
	StoredPages  uint64 `json:"stored_pages"`
	EvictedPages uint64 `json:"evicted_pages"`
	// The host tier's part (since ABI 12; 0 without one).
	TierPages        int    `json:"tier_pages"`
	TierBound        int    `json:"tier_bound"`
	TierHitPages     uint64 `json:"tier_hit_pages"`
	TierHitTokens    uint64 `json:"tier_hit_tokens"`
	TierStoredPages  uint64 `json:"tier_stored_pages"`
	TierEvictedPages uint64 `json:"tier_evicted_pages"`
	// A hybrid pool's state checkpoints in the tier (since ABI 13).
	TierCheckpoints        int    `json:"tier_checkpoints"`
	TierCheckpointBound    int    `json:"tier_checkpoint_bound"`
	TierCheckpointsStored  uint64 `json:"tier_checkpoints_stored"`
	TierCheckpointHits     uint64 `json:"tier_checkpoint_hits"`
	TierCheckpointsEvicted uint64 `json:"tier_checkpoints_evicted"`
}

// TierDoc is kvcache.TierStats without its latency histograms: the
// slots by state (slots = free + cached + swapped + checkpoints +
// in_flight + quarantined + retired: since ABI 13 slots counts the
// checkpoint slots too), what was copied each way, the swaps and (since
// ABI 13) a hybrid pool's state checkpoints.
type TierDoc struct {
	Enabled             bool   `json:"enabled"`
	Slots               int    `json:"slots"`
	SlotBytes           int64  `json:"slot_bytes"`
	CheckpointSlots     int    `json:"checkpoint_slots"`
	CheckpointSlotBytes int64  `json:"checkpoint_slot_bytes"`
	Free                int    `json:"free"`
	Cached              int    `json:"cached"`
	Swapped             int    `json:"swapped"`
	Checkpoints         int    `json:"checkpoints"`
	InFlight            int    `json:"in_flight"`
	Quarantined         int    `json:"quarantined"`
	Retired             int    `json:"retired"`
	Offloads            uint64 `json:"offloads"`
	OffloadBytes        uint64 `json:"offload_bytes"`
	OffloadsDropped     uint64 `json:"offloads_dropped"`
	OffloadsFailed      uint64 `json:"offloads_failed"`
	Onloads             uint64 `json:"onloads"`
	OnloadBytes         uint64 `json:"onload_bytes"`
	OnloadsFailed       uint64 `json:"onloads_failed"`
	SwapsOut            uint64 `json:"swaps_out"`
	SwapOutPages        uint64 `json:"swap_out_pages"`
	SwapsFull           uint64 `json:"swaps_full"`
	SwapsFailed         uint64 `json:"swaps_failed"`
	SwapsIn             uint64 `json:"swaps_in"`
	SwapInPages         uint64 `json:"swap_in_pages"`
	SwapsEvicted        uint64 `json:"swaps_evicted"`
	// State checkpoints (since ABI 13): see kvcache.TierStats.
	CheckpointsStored        uint64 `json:"checkpoints_stored"`
	CheckpointsDropped       uint64 `json:"checkpoints_dropped"`
	CheckpointsFailed        uint64 `json:"checkpoints_failed"`
	CheckpointsRestored      uint64 `json:"checkpoints_restored"`
	CheckpointRestoreBytes   uint64 `json:"checkpoint_restore_bytes"`
	CheckpointRestoresFailed uint64 `json:"checkpoint_restores_failed"`
	CheckpointsEvicted       uint64 `json:"checkpoints_evicted"`
	EvictedSlots             uint64 `json:"evicted_slots"`
	ScrubbedSlots            uint64 `json:"scrubbed_slots"`
	RetiredSlots             uint64 `json:"retired_slots"`
}

func tierDoc(t kvcache.TierStats) TierDoc {
	return TierDoc{Enabled: t.Enabled, Slots: t.Slots, SlotBytes: t.SlotBytes,
		CheckpointSlots: t.CheckpointSlots, CheckpointSlotBytes: t.CheckpointSlotBytes, Free: t.Free, Cached: t.Cached,
		Swapped: t.Swapped, Checkpoints: t.Checkpoints, InFlight: t.InFlight, Quarantined: t.Quarantined, Retired: t.Retired,
		Offloads: t.Offloads, OffloadBytes: t.OffloadBytes, OffloadsDropped: t.OffloadsDropped, OffloadsFailed: t.OffloadsFailed,
		Onloads: t.Onloads, OnloadBytes: t.OnloadBytes, OnloadsFailed: t.OnloadsFailed,
		SwapsOut: t.SwapsOut, SwapOutPages: t.SwapOutPages, SwapsFull: t.SwapsFull, SwapsFailed: t.SwapsFailed,
		SwapsIn: t.SwapsIn, SwapInPages: t.SwapInPages, SwapsEvicted: t.SwapsEvicted,
		CheckpointsStored: t.CheckpointsStored, CheckpointsDropped: t.CheckpointsDropped, CheckpointsFailed: t.CheckpointsFailed,
		CheckpointsRestored: t.CheckpointsRestored, CheckpointRestoreBytes: t.CheckpointRestoreBytes,
		CheckpointRestoresFailed: t.CheckpointRestoresFailed, CheckpointsEvicted: t.CheckpointsEvicted,
		EvictedSlots: t.EvictedSlots, ScrubbedSlots: t.ScrubbedSlots, RetiredSlots: t.RetiredSlots}
}

func statsJSON(s kvcache.Stats, domainOf func(tenant string) string) StatsDoc {
	d := StatsDoc{
		Device: s.Device, TotalPages: s.TotalPages, FreePages: s.FreePages, InUsePages: s.InUsePages,
		CachedPages: s.CachedPages, QuarantinedPages: s.QuarantinedPages, RetiredPages: s.RetiredPages,
		TokensPerPage: s.TokensPerPage, PageBytes: s.PageBytes, Groups: groupDocs(s.Groups), LiveLeases: s.LiveLeases, Admitted: s.Admitted,
		Refused: refusalsDoc(s.Refused),
		Growth: GrowthDoc{Grown: s.Growth.Grown, PagesGrown: s.Growth.PagesGrown, Refused: refusalsDoc(s.Growth.Refused),
			Preempted: s.Growth.Preempted, PreemptKeptPages: s.Growth.PreemptKeptPages},
		Scrub: ScrubStatsDoc{
			Fills: s.Scrub.Fills, PagesScrubbed: s.Scrub.PagesScrubbed, BytesScrubbed: s.Scrub.BytesScrubbed,
			FillErrors: s.Scrub.FillErrors, PagesRetired: s.Scrub.PagesRetired,
			CanaryChecks: s.Scrub.CanaryChecks, CanaryFailures: s.Scrub.CanaryFailures,
		},
		Tenants: []TenantDoc{},
		Prefix: PrefixDoc{Enabled: s.Prefix.Enabled, Domains: []DomainDoc{},
			EventsSent: s.Prefix.EventsSent, EventsDropped: s.Prefix.EventsDropped},
		Checkpoints: checkpointsDoc(s.Checkpoints),
		Tier:        tierDoc(s.Tier),
		Closed:      s.Closed, Fault: s.Fault,
	}
	for _, t := range s.Tenants {
		d.Tenants = append(d.Tenants, TenantDoc{Name: t.Name, UsedPages: t.UsedPages, QuotaPages: t.QuotaPages,
			ReservedPages: t.ReservedPages, Domain: domainOf(t.Name)})
	}
	for _, x := range s.Prefix.Domains {
		d.Prefix.Domains = append(d.Prefix.Domains, DomainDoc{Name: x.Name, Shared: x.Shared, Tenants: x.Tenants,
			IndexedPages: x.IndexedPages, CachedPages: x.CachedPages, HitPages: x.HitPages, MissPages: x.MissPages,
			HitTokens: x.HitTokens, StoredPages: x.StoredPages, EvictedPages: x.EvictedPages,
			TierPages: x.TierPages, TierBound: x.TierBound, TierHitPages: x.TierHitPages, TierHitTokens: x.TierHitTokens,
			TierStoredPages: x.TierStoredPages, TierEvictedPages: x.TierEvictedPages,
			TierCheckpoints: x.TierCheckpoints, TierCheckpointBound: x.TierCheckpointBound, TierCheckpointsStored: x.TierCheckpointsStored,
			TierCheckpointHits: x.TierCheckpointHits, TierCheckpointsEvicted: x.TierCheckpointsEvicted})
	}
	return d
}
