package bridge

import "github.com/kvfence/kvfence/kvcache"

// StatsDoc is the JSON kvf_pool_stats_json writes: kvcache.Stats with
// snake_case keys, the same names the config uses.
type StatsDoc struct {
	Device           string        `json:"device"`
	TotalPages       int           `json:"total_pages"`
	FreePages        int           `json:"free_pages"`
	InUsePages       int           `json:"in_use_pages"`
	CachedPages      int           `json:"cached_pages"`
	QuarantinedPages int           `json:"quarantined_pages"`
	RetiredPages     int           `json:"retired_pages"`
	TokensPerPage    int           `json:"tokens_per_page"`
	PageBytes        int64         `json:"page_bytes"`
	LiveLeases       int           `json:"live_leases"`
	Admitted         uint64        `json:"admitted"`
	Refused          RefusalsDoc   `json:"refused"`
	Scrub            ScrubStatsDoc `json:"scrub"`
	Tenants          []TenantDoc   `json:"tenants"`
	Closed           bool          `json:"closed"`
	Fault            string        `json:"fault"`
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
}

func statsJSON(s kvcache.Stats) StatsDoc {
	d := StatsDoc{
		Device: s.Device, TotalPages: s.TotalPages, FreePages: s.FreePages, InUsePages: s.InUsePages,
		CachedPages: s.CachedPages, QuarantinedPages: s.QuarantinedPages, RetiredPages: s.RetiredPages,
		TokensPerPage: s.TokensPerPage, PageBytes: s.PageBytes, LiveLeases: s.LiveLeases, Admitted: s.Admitted,
		Refused: RefusalsDoc{
			InvalidRequest: s.Refused.InvalidRequest, UnknownTenant: s.Refused.UnknownTenant,
			DuplicateRequest: s.Refused.DuplicateRequest, ExceedsContext: s.Refused.ExceedsContext,
			ExceedsCapacity: s.Refused.ExceedsCapacity, ExceedsQuota: s.Refused.ExceedsQuota,
			PoolExhausted: s.Refused.PoolExhausted, PoolFaulted: s.Refused.PoolFaulted, Total: s.Refused.Total(),
		},
		Scrub: ScrubStatsDoc{
			Fills: s.Scrub.Fills, PagesScrubbed: s.Scrub.PagesScrubbed, BytesScrubbed: s.Scrub.BytesScrubbed,
			FillErrors: s.Scrub.FillErrors, PagesRetired: s.Scrub.PagesRetired,
			CanaryChecks: s.Scrub.CanaryChecks, CanaryFailures: s.Scrub.CanaryFailures,
		},
		Tenants: []TenantDoc{},
		Closed:  s.Closed, Fault: s.Fault,
	}
	for _, t := range s.Tenants {
		d.Tenants = append(d.Tenants, TenantDoc{Name: t.Name, UsedPages: t.UsedPages, QuotaPages: t.QuotaPages, ReservedPages: t.ReservedPages})
	}
	return d
}
