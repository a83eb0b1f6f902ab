// Package metrics exports a kvfence pool to Prometheus: a Collector that
// reads kvcache.Pool.Stats (and, optionally, handoff and kvevents
// counters) at each scrape. The pool itself knows nothing of Prometheus:
// this package imports it, not the other way round, and a scrape costs the
// pool one Stats call under its lock, O(tenants + domains), and nothing
// on its admission or release paths. On the 2-core VM of bench/README.md
// (BenchmarkCollect, as busy as the VM was) that call holds the lock for
// 0.7–1.5 µs with one tenant and 22–55 µs with 64 tenants in domains of
// their own, mostly the allocation of the snapshot's per-tenant and
// per-domain slices; the rest of a scrape, the Prometheus client's, runs
// outside the lock: 0.17–0.27 ms with one tenant, 3–6.6 ms with 64 and
// TenantLabels.
//
// # Names
//
// Names follow Prometheus conventions (base units, _total on counters,
// kvfence_ prefix). Where kvfence measures what vLLM does, the metric has
// vLLM's name, so that dashboards and alerts written for vLLM carry over:
//
//	vllm:kv_cache_usage_perc        gauge, 0..1: 1 - (free + cached) / total pages;
//	                                cached pages no lease holds are evictable, as in vLLM
//	vllm:prefix_cache_queries_total counter, prompt tokens looked up in the prefix cache
//	vllm:prefix_cache_hits_total    counter, of those, tokens found cached
//
// (both prefix counters per sharing domain). Every other metric is listed
// by Describe, each with a help text that says what it counts. A pool
// with sliding-window or state groups (a hybrid model) adds its groups'
// pages by state (kvfence_cache_group_pages) and its state checkpoints
// (kvfence_state_checkpoint*: held by state, bytes, taken, hits and
// misses with their tokens, evictions, capacity skips, copy and restore
// seconds); a pool of one group sends neither.
//
// # Labels and cardinality
//
// Per-tenant series (admissions, refusals, usage) exist only with
// Options.TenantLabels: a service with many tenants would otherwise grow a
// series per tenant without being asked to. Prefix-cache series are per
// sharing domain; a tenant's own domain ("tenant:NAME") is a tenant label
// by another name, so without TenantLabels those domains are summed into
// domain="private" and only domains the operator named are kept apart.
// Options.ConstLabels (model_name, engine, pool, ...) are added to every
// series, as vLLM labels its own with model_name.
//
// # Host tier
//
// A pool with a host tier (kvcache.HostTierConfig) has the
// kvfence_host_tier_* series: its slots by state, the pages and bytes
// offloaded and onloaded, the copies' latency, failed copies, swaps by
// outcome, and per sharing domain (summed as the prefix-cache series are)
// the pages it holds there and the tokens admissions onloaded from it,
// which vllm:prefix_cache_hits_total counts too. In a pool with window or
// state groups the tier keeps state checkpoints too, in slots of their
// own (HostTierConfig.Checkpoints): the slots series count both spaces
// (the state "checkpoints" is theirs, kvfence_host_tier_checkpoint_slots
// their part of the capacity), and kvfence_host_tier_checkpoints_total
// and kvfence_host_tier_checkpoint_restore_bytes_total count what became
// of them; a pool without such groups sends none of these three.
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvfence/kvfence/handoff"
	"github.com/kvfence/kvfence/kvcache"
	"github.com/kvfence/kvfence/kvevents"
)

// Options configures a Collector.
type Options struct {
	// TenantLabels adds per-tenant series, and keeps tenants' own domains
	// apart in the prefix-cache series; see the package doc.
	TenantLabels bool
	// ConstLabels are added to every series.
	ConstLabels prometheus.Labels
	// Receivers and Senders are handoff endpoints whose transfers are
	// counted, summed per side.
	Receivers []*handoff.Receiver
	Senders   []*handoff.Sender
	// Events is a publisher whose figures are exported.
	Events *kvevents.Publisher
}

// PrivateDomains is the domain label of the prefix-cache series that sum
// tenants' own domains, without Options.TenantLabels.
const PrivateDomains = "private"

// Collector is a prometheus.Collector over one pool.
type Collector struct {
	pool *kvcache.Pool
	opts Options
	tier bool // the pool has a host tier
	// tierCkpts: that tier keeps state checkpoints (a hybrid pool's)
	tierCkpts bool
	d         descs
}

type descs struct {
	pages, capacity, usage, leases, faulted, closed *prometheus.Desc
	groupPages                                      *prometheus.Desc
	ckpts, ckptBytes, ckptTaken, ckptExisting       *prometheus.Desc
	ckptHits, ckptHitTokens                         *prometheus.Desc
	ckptMisses, ckptMissTokens                      *prometheus.Desc
	ckptEvicted, ckptSkips                          *prometheus.Desc
	ckptCopySeconds, ckptRestoreSeconds             *prometheus.Desc
	admissions, refusals                            *prometheus.Desc
	tenantAdmissions, tenantRefusals                *prometheus.Desc
	tenantUsed, tenantQuota, tenantReserved         *prometheus.Desc
	fills, fillPages, fillBytes, fillErrors         *prometheus.Desc
	fillSeconds                                     *prometheus.Desc
	retired, canaryChecks, canaryFailures           *prometheus.Desc
	prefixQueries, prefixHits                       *prometheus.Desc
	prefixIndexed, prefixCached                     *prometheus.Desc
	prefixStored, prefixEvicted                     *prometheus.Desc
	events                                          *prometheus.Desc
	handoff                                         *prometheus.Desc
	handoffResummed                                 *prometheus.Desc
	pubBatches, pubEvents, pubLost, pubResyncs      *prometheus.Desc
	pubSubscribers, pubDrops, pubDisconnects        *prometheus.Desc
	pubRefusals                                     *prometheus.Desc
	pubReplays, pubReplayed                         *prometheus.Desc
	tierSlots, tierCapacity                         *prometheus.Desc
	tierPages, tierBytes, tierCopySeconds           *prometheus.Desc
	tierFailures, tierDropped, tierSwaps            *prometheus.Desc
	tierEvicted, tierScrubbed, tierRetired          *prometheus.Desc
	tierDomainPages, tierHits                       *prometheus.Desc
	tierCkptSlots, tierCkpts, tierCkptRestoreBytes  *prometheus.Desc
}

// NewCollector returns a collector over pool; register it with a
// prometheus.Registerer.
func NewCollector(pool *kvcache.Pool, opts Options) *Collector {
	tier := pool.Stats().Tier
	c := &Collector{pool: pool, opts: opts, tier: tier.Enabled, tierCkpts: tier.CheckpointSlots > 0}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, opts.ConstLabels)
	}
	c.d = descs{
		pages:    d("kvfence_pool_pages", "Pages of the pool by state (free, in_use, cached, quarantined, retired).", "state"),
		capacity: d("kvfence_pool_capacity_pages", "Pages of the pool, all states."),
		groupPages: d("kvfence_cache_group_pages",
			"Pages (state slots) of each cache group of a pool made from a cache spec, by state; the per-token group's are kvfence_pool_pages.",
			"group", "kind", "state"),
		ckpts: d("kvfence_state_checkpoints",
			"State checkpoints the prefix cache of a pool with window or state groups holds, by state: idle, or restoring (being copied into an admitted lease); their sum is the checkpoints held.",
			"state"),
		ckptBytes:    d("kvfence_state_checkpoint_bytes", "Bytes of the state slots and window pages state checkpoints hold, every group."),
		ckptTaken:    d("kvfence_state_checkpoints_taken_total", "State checkpoints taken (copies of a lease's state at a page boundary)."),
		ckptExisting: d("kvfence_state_checkpoints_existing_total", "State checkpoint requests that found one at their prefix already (kept, nothing copied)."),
		ckptHits: d("kvfence_state_checkpoint_hits_total",
			"Admissions that restored a state checkpoint (their hit ends at it)."),
		ckptHitTokens: d("kvfence_state_checkpoint_hit_tokens_total", "Prompt tokens those admissions shared."),
		ckptMisses: d("kvfence_state_checkpoint_misses_total",
			"Admissions that matched cached pages past their last state checkpoint, or with none: the pages were there, the state was not."),
		ckptMissTokens: d("kvfence_state_checkpoint_miss_tokens_total", "Prompt tokens of those pages, the hit lost for want of a checkpoint."),
		ckptEvicted:    d("kvfence_state_checkpoints_evicted_total", "State checkpoints evicted (least recently used first, for slots or pages; scrubbed)."),
		ckptSkips: d("kvfence_state_checkpoint_capacity_skips_total",
			"State checkpoints not taken for lack of room: the pool's or the tenant's bound, the tenant's quota, no slot free or evictable."),
		ckptCopySeconds:    d("kvfence_state_checkpoint_copy_seconds_total", "Time spent copying leases' state into checkpoints."),
		ckptRestoreSeconds: d("kvfence_state_checkpoint_restore_seconds_total", "Time spent copying checkpoints into admitted leases, before the admission returns."),
		usage: d("vllm:kv_cache_usage_perc",
			"Fraction of KV-cache pages not available to a new request: 1 - (free + evictable cached) / total."),
		leases:  d("kvfence_pool_live_leases", "Leases that hold pages now."),
		faulted: d("kvfence_pool_faulted", "1 while the pool is faulted (a failed fill or canary mismatch) and refuses every admission."),
		closed:  d("kvfence_pool_closed", "1 once the pool is closed."),
		admissions: d("kvfence_admissions_total",
			"Admissions granted (leases and imports)."),
		refusals: d("kvfence_refusals_total", "Admissions refused, by reason.", "reason"),
		tenantAdmissions: d("kvfence_tenant_admissions_total",
			"Admissions granted to the tenant.", "tenant"),
		tenantRefusals: d("kvfence_tenant_refusals_total",
			"Admissions of the tenant refused, by reason (refusals naming no registered tenant count in kvfence_refusals_total only).",
			"tenant", "reason"),
		tenantUsed:     d("kvfence_tenant_used_pages", "Pages the tenant's leases hold.", "tenant"),
		tenantQuota:    d("kvfence_tenant_quota_pages", "The tenant's quota.", "tenant"),
		tenantReserved: d("kvfence_tenant_reserved_pages", "Pages reserved for the tenant.", "tenant"),
		fills:          d("kvfence_scrub_fills_total", "Scrub fills completed without error (batches)."),
		fillPages:      d("kvfence_scrub_pages_total", "Pages scrubbed."),
		fillBytes:      d("kvfence_scrub_bytes_total", "Bytes scrubbed, all regions."),
		fillErrors:     d("kvfence_scrub_fill_errors_total", "Scrub fills that failed (their pages were retired, the pool faulted)."),
		fillSeconds: d("kvfence_scrub_fill_duration_seconds",
			"Time from a scrub fill's issue to its fence's completion, for fills that succeeded (a fill ordered after engine work includes the wait for it)."),
		retired:        d("kvfence_retired_pages_total", "Pages taken out of service for good (failed fills, canary mismatches)."),
		canaryChecks:   d("kvfence_canary_checks_total", "Free pages checked for their canary before being handed out."),
		canaryFailures: d("kvfence_canary_failures_total", "Free pages found written while free."),
		prefixQueries: d("vllm:prefix_cache_queries_total",
			"Prompt tokens looked up in the prefix cache (full pages a hit could cover).", "domain"),
		prefixHits:    d("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", "domain"),
		prefixIndexed: d("kvfence_prefix_indexed_pages", "Published pages in the prefix cache, held by leases or not.", "domain"),
		prefixCached:  d("kvfence_prefix_cached_pages", "Published pages no lease holds (evictable).", "domain"),
		prefixStored:  d("kvfence_prefix_stored_pages_total", "Pages published to the prefix cache.", "domain"),
		prefixEvicted: d("kvfence_prefix_evicted_pages_total", "Cached pages evicted (and scrubbed).", "domain"),
		events: d("kvfence_kv_events_total",
			"KV events the pool produced, by outcome: sent to its channel, or dropped because the channel was full.", "outcome"),
		handoff: d("kvfence_handoff_transfers_total",
			"Prefill-to-decode transfers by side (send, receive) and outcome (ok, or the failure's reason).", "side", "outcome"),
		handoffResummed: d("kvfence_handoff_units_resummed_total",
			"Units a receiver summed again from memory because a block was summed before all of it landed (a transport whose writes land out of order)."),
		pubBatches:     d("kvfence_kv_event_batches_total", "Event batches published (the next sequence number)."),
		pubEvents:      d("kvfence_kv_events_published_total", "KV events published."),
		pubLost:        d("kvfence_kv_events_lost_total", "KV events the pool dropped before the publisher read them."),
		pubResyncs:     d("kvfence_kv_event_resyncs_total", "AllBlocksCleared batches sent after such losses."),
		pubSubscribers: d("kvfence_kv_event_subscribers", "Subscribers connected."),
		pubDrops:       d("kvfence_kv_event_subscriber_drops_total", "Batches dropped for a subscriber whose queue was full."),
		pubDisconnects: d("kvfence_kv_event_disconnects_total", "Subscribers and replay clients cut off."),
		pubRefusals: d("kvfence_kv_event_refusals_total",
			"Peers and requests refused, by reason: auth (CURVE: wrong server key, client key not let in, a NULL peer, a message that does not open), handshake_timeout, oversized_frame, replay_out_of_range.", "reason"),
		pubReplays:  d("kvfence_kv_event_replays_total", "Replay requests served."),
		pubReplayed: d("kvfence_kv_event_replayed_batches_total", "Batches sent again by replays."),
		tierSlots: d("kvfence_host_tier_slots",
			"Slots of the host tier (one per-token page each, or in a pool with window or state groups one state checkpoint) by state: free, cached, swapped (preempted requests' pages), checkpoints (state checkpoints; hybrid pools only), in_flight (copies write or read them), quarantined, retired.", "state"),
		tierCapacity: d("kvfence_host_tier_capacity_slots", "Slots of the host tier, all states: its page slots and, in a pool with window or state groups, its checkpoint slots (kvfence_host_tier_checkpoint_slots)."),
		tierPages: d("kvfence_host_tier_pages_total",
			"Pages copied by direction: offload (evicted device pages kept in the tier), onload (copied back into admissions' pages), swap_out, swap_in.", "direction"),
		tierBytes: d("kvfence_host_tier_bytes_total", "Bytes copied into (offload) and out of (onload) the host tier by evictions and admissions.", "direction"),
		tierCopySeconds: d("kvfence_host_tier_copy_duration_seconds",
			"Time of each batch's copy into (offload) or out of (onload) the host tier.", "direction"),
		tierFailures: d("kvfence_host_tier_copy_failures_total",
			"Pages whose copy failed, by direction: offload (not kept), onload (the admission refused; swaps back included), swap_out (swaps of preemptions: swaps, not pages).", "direction"),
		tierDropped: d("kvfence_host_tier_offloads_dropped_total",
			"Evicted device pages the host tier had no room for (their domain at its share with nothing to evict, or everything else pinned or being written)."),
		tierSwaps: d("kvfence_host_tier_swaps_total",
			"Preemption swaps by outcome: out (swapped), full (no room: kept what the prefix cache holds), in (swapped back), evicted (evicted or dropped unused).", "outcome"),
		tierEvicted:     d("kvfence_host_tier_evicted_slots_total", "Slots the host tier evicted."),
		tierScrubbed:    d("kvfence_host_tier_scrubbed_slots_total", "Slots filled with the scrub policy on their way to the free list."),
		tierRetired:     d("kvfence_host_tier_retired_slots_total", "Slots retired (a canary mismatch)."),
		tierDomainPages: d("kvfence_host_tier_domain_pages", "Host-tier slots the sharing domain holds (cached pages and swaps).", "domain"),
		tierHits:        d("kvfence_host_tier_hit_tokens_total", "Prompt tokens admissions onloaded from the host tier (also counted in vllm:prefix_cache_hits_total).", "domain"),
		tierCkptSlots: d("kvfence_host_tier_checkpoint_slots",
			"Slots of the host tier that hold state checkpoints, one whole checkpoint each (of kvfence_host_tier_capacity_slots)."),
		tierCkpts: d("kvfence_host_tier_checkpoints_total",
			"State checkpoints by outcome: stored (evicted by the device, kept in the tier), dropped (no room), failed (the copy in failed), restored (copied into an admitted lease: a hit), restore_failed (the copy back failed: the admission refused), evicted (for room, or with their page).", "outcome"),
		tierCkptRestoreBytes: d("kvfence_host_tier_checkpoint_restore_bytes_total", "Bytes of state checkpoints copied out of the host tier into admitted leases."),
	}
	return c
}

// Describe sends every metric's description.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	d := &c.d
	for _, x := range []*prometheus.Desc{
		d.pages, d.groupPages, d.capacity, d.usage, d.leases, d.faulted, d.closed, d.admissions, d.refusals,
		d.ckpts, d.ckptBytes, d.ckptTaken, d.ckptExisting, d.ckptHits, d.ckptHitTokens, d.ckptMisses, d.ckptMissTokens,
		d.ckptEvicted, d.ckptSkips, d.ckptCopySeconds, d.ckptRestoreSeconds,
		d.fills, d.fillPages, d.fillBytes, d.fillErrors, d.fillSeconds, d.retired, d.canaryChecks, d.canaryFailures,
		d.prefixQueries, d.prefixHits, d.prefixIndexed, d.prefixCached, d.prefixStored, d.prefixEvicted, d.events,
	} {
		ch <- x
	}
	if c.opts.TenantLabels {
		for _, x := range []*prometheus.Desc{d.tenantAdmissions, d.tenantRefusals, d.tenantUsed, d.tenantQuota, d.tenantReserved} {
			ch <- x
		}
	}
	if len(c.opts.Receivers)+len(c.opts.Senders) > 0 {
		ch <- d.handoff
	}
	if len(c.opts.Receivers) > 0 {
		ch <- d.handoffResummed
	}
	if c.opts.Events != nil {
		for _, x := range []*prometheus.Desc{d.pubBatches, d.pubEvents, d.pubLost, d.pubResyncs, d.pubSubscribers,
			d.pubDrops, d.pubDisconnects, d.pubRefusals, d.pubReplays, d.pubReplayed} {
			ch <- x
		}
	}
	if c.tier {
		for _, x := range []*prometheus.Desc{d.tierSlots, d.tierCapacity, d.tierPages, d.tierBytes, d.tierCopySeconds,
			d.tierFailures, d.tierDropped, d.tierSwaps, d.tierEvicted, d.tierScrubbed, d.tierRetired, d.tierDomainPages, d.tierHits} {
			ch <- x
		}
	}
	if c.tierCkpts {
		for _, x := range []*prometheus.Desc{d.tierCkptSlots, d.tierCkpts, d.tierCkptRestoreBytes} {
			ch <- x
		}
	}
}

// refusalReasons are the label values of kvcache.Refusals' fields.
func refusalReasons(r kvcache.Refusals) []struct {
	name string
	n    uint64
} {
	return []struct {
		name string
		n    uint64
	}{
		{"invalid_request", r.InvalidRequest}, {"unknown_tenant", r.UnknownTenant},
		{"duplicate_request", r.DuplicateRequest}, {"exceeds_max_context", r.ExceedsContext},
		{"exceeds_capacity", r.ExceedsCapacity}, {"exceeds_quota", r.ExceedsQuota},
		{"pool_exhausted", r.PoolExhausted}, {"pool_faulted", r.PoolFaulted},
	}
}

// Collect reads the pool's Stats once and sends every metric.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.pool.Stats()
	d := &c.d
	gauge := func(desc *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, v, labels...)
	}
	counter := func(desc *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.CounterValue, float64(v), labels...)
	}
	// byState reports one gauge per page state, in the states' order.
	byState := func(desc *prometheus.Desc, counts [5]int, labels ...string) {
		for i, name := range [5]string{"free", "in_use", "cached", "quarantined", "retired"} {
			gauge(desc, float64(counts[i]), append(labels, name)...)
		}
	}
	byState(d.pages, [5]int{s.FreePages, s.InUsePages, s.CachedPages, s.QuarantinedPages, s.RetiredPages})
	if len(s.Groups) > 1 { // a pool of one group has nothing to add, and no checkpoints
		for _, g := range s.Groups {
			byState(d.groupPages, [5]int{g.Free, g.InUse, g.Cached, g.Quarantined, g.Retired}, g.Name, g.Kind.String())
		}
		c.collectCheckpoints(ch, s.Checkpoints, gauge, counter)
	}
	gauge(d.capacity, float64(s.TotalPages))
	usage := 0.0
	if s.TotalPages > 0 {
		usage = 1 - float64(s.FreePages+s.CachedPages)/float64(s.TotalPages)
	}
	gauge(d.usage, usage)
	gauge(d.leases, float64(s.LiveLeases))
	gauge(d.faulted, boolGauge(s.Fault != ""))
	gauge(d.closed, boolGauge(s.Closed))
	counter(d.admissions, s.Admitted)
	for _, r := range refusalReasons(s.Refused) {
		counter(d.refusals, r.n, r.name)
	}
	if c.opts.TenantLabels {
		for _, t := range s.Tenants {
			counter(d.tenantAdmissions, t.Admitted, t.Name)
			for _, r := range refusalReasons(t.Refused) {
				if r.name != "unknown_tenant" {
					counter(d.tenantRefusals, r.n, t.Name, r.name)
				}
			}
			gauge(d.tenantUsed, float64(t.UsedPages), t.Name)
			gauge(d.tenantQuota, float64(t.QuotaPages), t.Name)
			gauge(d.tenantReserved, float64(t.ReservedPages), t.Name)
		}
	}

	sc := s.Scrub
	counter(d.fills, sc.Fills)
	counter(d.fillPages, sc.PagesScrubbed)
	counter(d.fillBytes, sc.BytesScrubbed)
	counter(d.fillErrors, sc.FillErrors)
	counter(d.retired, sc.PagesRetired)
	counter(d.canaryChecks, sc.CanaryChecks)
	counter(d.canaryFailures, sc.CanaryFailures)
	ch <- fillHistogram(d.fillSeconds, s.FillLatency)

	c.collectPrefix(ch, s, gauge, counter)
	if c.tier {
		c.collectTier(ch, s, gauge, counter)
	}
	counter(d.events, s.Prefix.EventsSent, "sent")
	counter(d.events, s.Prefix.EventsDropped, "dropped")

	if len(c.opts.Receivers)+len(c.opts.Senders) > 0 {
		var recv, sent [len(handoff.ReasonNames)]uint64
		var resummed uint64
		for _, r := range c.opts.Receivers {
			rs := r.Stats()
			recv[0] += rs.Imported
			for i, n := range rs.RefusedBy {
				recv[i] += n
			}
			resummed += rs.UnitsResummed
		}
		for _, snd := range c.opts.Senders {
			ss := snd.Stats()
			sent[0] += ss.Sent
			for i, n := range ss.FailedBy {
				sent[i] += n
			}
		}
		for i, name := range handoff.ReasonNames {
			counter(d.handoff, sent[i], "send", name)
			counter(d.handoff, recv[i], "receive", name)
		}
		if len(c.opts.Receivers) > 0 {
			counter(d.handoffResummed, resummed)
		}
	}
	if p := c.opts.Events; p != nil {
		ps := p.Stats()
		counter(d.pubBatches, ps.Batches)
		counter(d.pubEvents, ps.Events)
		counter(d.pubLost, ps.Lost)
		counter(d.pubResyncs, ps.Resyncs)
		gauge(d.pubSubscribers, float64(ps.Subscribers))
		counter(d.pubDrops, ps.SubscriberDrops)
		counter(d.pubDisconnects, ps.Disconnects)
		counter(d.pubRefusals, ps.AuthFailures, "auth")
		counter(d.pubRefusals, ps.HandshakeTimeouts, "handshake_timeout")
		counter(d.pubRefusals, ps.OversizedFrames, "oversized_frame")
		counter(d.pubRefusals, ps.OutOfRange, "replay_out_of_range")
		counter(d.pubReplays, ps.Replays)
		counter(d.pubReplayed, ps.ReplayedBatches)
	}
}

// collectCheckpoints sends the state checkpoints' series.
func (c *Collector) collectCheckpoints(ch chan<- prometheus.Metric, k kvcache.CheckpointStats,
	gauge func(*prometheus.Desc, float64, ...string), counter func(*prometheus.Desc, uint64, ...string)) {
	d := &c.d
	gauge(d.ckpts, float64(k.Live-k.Restoring), "idle")
	gauge(d.ckpts, float64(k.Restoring), "restoring")
	gauge(d.ckptBytes, float64(k.StateBytes))
	counter(d.ckptTaken, k.Taken)
	counter(d.ckptExisting, k.Existing)
	counter(d.ckptHits, k.Hits)
	counter(d.ckptHitTokens, k.HitTokens)
	counter(d.ckptMisses, k.Misses)
	counter(d.ckptMissTokens, k.MissTokens)
	counter(d.ckptEvicted, k.Evicted)
	counter(d.ckptSkips, k.CapacitySkips)
	ch <- prometheus.MustNewConstMetric(d.ckptCopySeconds, prometheus.CounterValue, float64(k.CopyNanos)/1e9)
	ch <- prometheus.MustNewConstMetric(d.ckptRestoreSeconds, prometheus.CounterValue, float64(k.RestoreNanos)/1e9)
}

// collectPrefix sends the per-domain prefix-cache series, summing
// tenants' own domains into PrivateDomains without TenantLabels.
func (c *Collector) collectPrefix(ch chan<- prometheus.Metric, s kvcache.Stats,
	gauge func(*prometheus.Desc, float64, ...string), counter func(*prometheus.Desc, uint64, ...string)) {
	type sums struct {
		queries, hits, stored, evicted uint64
		indexed, cached                int
	}
	var order []string
	by := map[string]*sums{}
	tpp := uint64(s.TokensPerPage)
	for _, dom := range s.Prefix.Domains {
		name := dom.Name
		if !c.opts.TenantLabels && !dom.Shared { // a tenant's own domain: isolation.PrivateDomainPrefix + name
			name = PrivateDomains
		}
		x := by[name]
		if x == nil {
			x = &sums{}
			by[name] = x
			order = append(order, name)
		}
		x.queries += (dom.HitPages + dom.MissPages) * tpp
		x.hits += dom.HitPages * tpp
		x.stored += dom.StoredPages
		x.evicted += dom.EvictedPages
		x.indexed += dom.IndexedPages
		x.cached += dom.CachedPages
	}
	d := &c.d
	for _, name := range order {
		x := by[name]
		counter(d.prefixQueries, x.queries, name)
		counter(d.prefixHits, x.hits, name)
		counter(d.prefixStored, x.stored, name)
		counter(d.prefixEvicted, x.evicted, name)
		gauge(d.prefixIndexed, float64(x.indexed), name)
		gauge(d.prefixCached, float64(x.cached), name)
	}
}

// collectTier sends the host tier's series.
func (c *Collector) collectTier(ch chan<- prometheus.Metric, s kvcache.Stats,
	gauge func(*prometheus.Desc, float64, ...string), counter func(*prometheus.Desc, uint64, ...string)) {
	d, t := &c.d, s.Tier
	for _, st := range []struct {
		name string
		n    int
	}{{"free", t.Free}, {"cached", t.Cached}, {"swapped", t.Swapped}, {"checkpoints", t.Checkpoints}, {"in_flight", t.InFlight},
		{"quarantined", t.Quarantined}, {"retired", t.Retired}} {
		if st.name != "checkpoints" || c.tierCkpts {
			gauge(d.tierSlots, float64(st.n), st.name)
		}
	}
	gauge(d.tierCapacity, float64(t.Slots))
	if c.tierCkpts {
		gauge(d.tierCkptSlots, float64(t.CheckpointSlots))
		counter(d.tierCkpts, t.CheckpointsStored, "stored")
		counter(d.tierCkpts, t.CheckpointsDropped, "dropped")
		counter(d.tierCkpts, t.CheckpointsFailed, "failed")
		counter(d.tierCkpts, t.CheckpointsRestored, "restored")
		counter(d.tierCkpts, t.CheckpointRestoresFailed, "restore_failed")
		counter(d.tierCkpts, t.CheckpointsEvicted, "evicted")
		counter(d.tierCkptRestoreBytes, t.CheckpointRestoreBytes)
	}
	counter(d.tierPages, t.Offloads, "offload")
	counter(d.tierPages, t.Onloads-t.SwapInPages, "onload")
	counter(d.tierPages, t.SwapOutPages, "swap_out")
	counter(d.tierPages, t.SwapInPages, "swap_in")
	counter(d.tierBytes, t.OffloadBytes, "offload")
	counter(d.tierBytes, t.OnloadBytes, "onload")
	ch <- fillHistogram(d.tierCopySeconds, t.OffloadLatency, "offload")
	ch <- fillHistogram(d.tierCopySeconds, t.OnloadLatency, "onload")
	counter(d.tierFailures, t.OffloadsFailed, "offload")
	counter(d.tierFailures, t.OnloadsFailed, "onload")
	counter(d.tierFailures, t.SwapsFailed, "swap_out")
	counter(d.tierDropped, t.OffloadsDropped)
	counter(d.tierSwaps, t.SwapsOut, "out")
	counter(d.tierSwaps, t.SwapsFull, "full")
	counter(d.tierSwaps, t.SwapsIn, "in")
	counter(d.tierSwaps, t.SwapsEvicted, "evicted")
	counter(d.tierEvicted, t.EvictedSlots)
	counter(d.tierScrubbed, t.ScrubbedSlots)
	counter(d.tierRetired, t.RetiredSlots)
	var order []string
	pages, hits := map[string]int{}, map[string]uint64{}
	for _, dom := range s.Prefix.Domains {
		name := dom.Name
		if !c.opts.TenantLabels && !dom.Shared {
			name = PrivateDomains
		}
		if _, ok := hits[name]; !ok {
			order = append(order, name)
		}
		pages[name] += dom.TierPages
		hits[name] += dom.TierHitTokens
	}
	for _, name := range order {
		gauge(d.tierDomainPages, float64(pages[name]), name)
		counter(d.tierHits, hits[name], name)
	}
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// fillHistogram turns kvcache.FillLatency into a Prometheus histogram
// (cumulative buckets, in seconds).
func fillHistogram(desc *prometheus.Desc, h kvcache.FillLatency, labels ...string) prometheus.Metric {
	bounds := kvcache.FillLatencyBounds()
	buckets := make(map[float64]uint64, len(bounds))
	var cum uint64
	for i, bound := range bounds {
		cum += h.Buckets[i]
		buckets[bound.Seconds()] = cum
	}
	return prometheus.MustNewConstHistogram(desc, h.Count, h.Sum.Seconds(), buckets, labels...)
}
