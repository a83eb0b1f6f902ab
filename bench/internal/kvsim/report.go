package kvsim

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvfence/kvfence/kvcache"
)

// ReportVersion changes when the JSON report's shape does. 3 added
// plot_errors and each run's prefix_cache.key_derivations and key_seconds.
// 4 replaced the runs' prefix_shareable_tokens and _fraction, and the
// workload's shared_prefix_percent, with the trace's own bound
// (prefix_cache.bound, workload.prefix_bounds), and added the workload's
// format and block_tokens, report_geometry, and each run's pool_tokens,
// host_pool_bytes and host_bytes_scrubbed. 5 added sizings,
// headroom_tokens, growth_watermark, budget and sizing_comparison, and
// each run's sizing, headroom_tokens, growth_watermark, kv_utilisation,
// concurrency, growth and utilisation samples' written_pages; a run's
// prefix_cache figures now leave out the re-admissions of preempted
// requests (in growth). 6 added model (-model runs pools of the preset's
// cache spec, a miniature of it) and each run's checkpoints (a hybrid
// model's state checkpoints, with the per-token-only run's figures). 7
// added each run's host_tier_checkpoints and the tier's checkpoint
// figures (a hybrid model's host tier; host_tier_pages, host_tier_tokens
// and tier came under 6).
const ReportVersion = 7

// Report is the whole output of one kvbench invocation.
type Report struct {
	Tool     string         `json:"tool"`
	Version  int            `json:"version"`
	Started  time.Time      `json:"started"`
	Args     []string       `json:"args"`
	Machine  Machine        `json:"machine"`
	Workload Workload       `json:"workload"`
	Geometry GeometryReport `json:"geometry"`
	// ReportGeometry, when set, is the model whose bytes the figures are
	// given at (pool, KV written, scrubbed, prefill avoided); the pools
	// were allocated at Geometry.
	ReportGeometry *GeometryReport `json:"report_geometry,omitempty"`
	// Model, when set, is the model whose cache spec the pools ran
	// (RunConfig.Model); Geometry is then not used.
	Model           *ModelPoolReport `json:"model,omitempty"`
	MaxContext      int              `json:"max_context_tokens"`
	Step            float64          `json:"decode_step_seconds"`
	MaxBatch        int              `json:"max_batch"`
	DeviceBandwidth float64          `json:"device_bandwidth_bytes_per_s,omitempty"`
	// PrefixCache is "on" or "off"; Domains the sharing-domain layouts
	// replayed; PrefillTokens the engine's prefill budget per step (0: no
	// limit).
	PrefixCache   string   `json:"prefix_cache"`
	Domains       []string `json:"domains"`
	PrefillTokens int      `json:"prefill_tokens_per_step"`
	// Sizings are the lease sizings replayed (SizingModes); HeadroomTokens
	// and GrowthWatermark are the on-demand runs'. Budget is how output
	// budgets were set: BudgetTrace or BudgetWindow.
	Sizings         []string `json:"sizings"`
	HeadroomTokens  int      `json:"headroom_tokens"`
	GrowthWatermark float64  `json:"growth_watermark"`
	Budget          string   `json:"budget"`
	// DomainComparison sets, for every pool size and policy replayed with
	// both layouts, shared domains against one domain per tenant.
	DomainComparison []DomainComparison `json:"domain_comparison,omitempty"`
	// SizingComparison sets, for every pool size, layout and policy
	// replayed with both sizings, on-demand against full.
	SizingComparison []SizingComparison `json:"sizing_comparison,omitempty"`
	Runs             []*RunResult       `json:"runs"`
	// Plots are the PNG files written beside the report; PlotErrors say
	// why a plot is missing (the report is written before the plots, so a
	// plot that fails never costs the figures).
	Plots      []string `json:"plots"`
	PlotErrors []string `json:"plot_errors,omitempty"`
}

// Machine identifies where the figures were measured.
type Machine struct {
	GOOS   string `json:"goos"`
	GOARCH string `json:"goarch"`
	CPUs   int    `json:"cpus"`
	Go     string `json:"go"`
	Host   string `json:"host"`
}

// ThisMachine describes the running machine.
func ThisMachine() Machine {
	h, _ := os.Hostname()
	return Machine{GOOS: runtime.GOOS, GOARCH: runtime.GOARCH, CPUs: runtime.NumCPU(), Go: runtime.Version(), Host: h}
}

// GeometryReport is the simulated model's KV geometry; for a model
// preset (ModelReport) its name and bytes only.
type GeometryReport struct {
	Model         string `json:"model,omitempty"`
	TokensPerPage int    `json:"tokens_per_page"`
	Layers        int    `json:"layers"`
	KVHeads       int    `json:"kv_heads"`
	HeadDim       int    `json:"head_dim"`
	DType         string `json:"dtype"`
	PageBytes     int64  `json:"page_bytes"`
	TokenBytes    int64  `json:"token_bytes"`
}

// ReportGeometry describes g.
func ReportGeometry(g kvcache.Geometry) GeometryReport {
	return GeometryReport{TokensPerPage: g.TokensPerPage, Layers: g.Layers, KVHeads: g.KVHeads, HeadDim: g.HeadDim,
		DType: g.DType.String(), PageBytes: g.PageBytes(), TokenBytes: g.TokenBytes()}
}

// ModelReport describes a cache spec (a model preset) at a pool of
// tokensPerPage tokens per page: its per-token group's bytes per token.
func ModelReport(s kvcache.CacheSpec, tokensPerPage int) GeometryReport {
	return GeometryReport{Model: s.Model, TokensPerPage: tokensPerPage,
		PageBytes: s.TokenBytes() * int64(tokensPerPage), TokenBytes: s.TokenBytes()}
}

// ModelPoolReport describes the pools of a model run (RunConfig.Model).
type ModelPoolReport struct {
	Model  string `json:"model"`
	Hybrid bool   `json:"hybrid"` // it has a state group: prefixes are shared through checkpoints
	// Groups names each cache group and its kind, the per-token group
	// first.
	Groups        []string `json:"groups"`
	TokensPerPage int      `json:"tokens_per_page"`
	// PageBytes and TokenBytes are the per-token group's at the model's
	// size, SlotBytes one lease's state (every other group); the Host
	// figures are the miniature's, which the pools allocated.
	PageBytes     int64 `json:"page_bytes"`
	TokenBytes    int64 `json:"token_bytes"`
	SlotBytes     int64 `json:"slot_bytes"`
	HostPageBytes int64 `json:"host_page_bytes"`
	HostSlotBytes int64 `json:"host_slot_bytes"`
	// StateShrink divided the miniature's one layer of state.
	StateShrink int `json:"state_shrink,omitempty"`
	// SlotCopyNs is a plain memcpy of SlotBytes on this host (HostCopyNs,
	// median of 5): what a checkpoint of the model's size costs a host
	// pool; not a GPU's copy.
	SlotCopyNs      int64 `json:"host_slot_memcpy_ns,omitempty"`
	MaxLeases       int   `json:"max_leases,omitempty"`
	CheckpointSlots int   `json:"checkpoint_slots,omitempty"`
	MaxCheckpoints  int   `json:"max_checkpoints,omitempty"`
}

// DescribeModel describes m's pools; stateShrink is what its miniature's
// state was divided by (Miniature).
func DescribeModel(m *ModelPool, stateShrink int) *ModelPoolReport {
	r := &ModelPoolReport{Model: m.Spec.Model, Hybrid: m.Hybrid(), TokensPerPage: m.Spec.TokensPerPage(),
		PageBytes: m.Spec.PageBytes(), TokenBytes: m.Spec.TokenBytes(), HostPageBytes: m.Miniature.PageBytes()}
	for _, g := range m.Spec.Groups {
		r.Groups = append(r.Groups, fmt.Sprintf("%s (%s, %d regions)", g.Name, g.Kind, len(g.Regions)))
	}
	if r.Hybrid {
		r.SlotBytes, r.HostSlotBytes = stateBytes(m.Spec), stateBytes(m.Miniature)
		r.StateShrink, r.MaxLeases, r.CheckpointSlots, r.MaxCheckpoints = stateShrink, m.MaxLeases, m.CheckpointSlots, m.MaxCheckpoints
	}
	return r
}

// Workload summarises a trace.
type Workload struct {
	Source string `json:"source"` // "synthetic" or the trace file
	// Format is the trace's (FormatKvbench, FormatMooncake, FormatAzure),
	// "synthetic" for a generated workload.
	Format         string  `json:"format"`
	BlockTokens    int     `json:"block_tokens,omitempty"` // of the requests' block chains
	Seed           *uint64 `json:"seed,omitempty"`
	Requests       int     `json:"requests"`
	Tenants        int     `json:"tenants"`
	SpanSeconds    float64 `json:"arrival_span_seconds"`
	PromptP50      int     `json:"prompt_p50"`
	PromptP99      int     `json:"prompt_p99"`
	PromptMax      int     `json:"prompt_max"`
	OutputP50      int     `json:"output_p50"`
	OutputP99      int     `json:"output_p99"`
	MaxNewP50      int     `json:"max_new_p50"`
	OverMaxContext int     `json:"over_max_context"`   // prompt + max_new above the context window
	OverCapacity   int     `json:"over_pool_capacity"` // within the window, above the smallest pool
	Aborting       int     `json:"aborting"`
	// PrefixBounds are the trace's bounds on the prefix cache's hit rate,
	// one per domain layout replayed, at the pools' page size.
	PrefixBounds []PrefixBound `json:"prefix_bounds,omitempty"`
}

// SummarizeWorkload describes tr as replayed against pools of at least
// capacityTokens with a context window of maxContext.
func SummarizeWorkload(tr *Trace, source string, capacityTokens, maxContext int) Workload {
	w := Workload{Source: source, Requests: len(tr.Requests), Tenants: len(tr.Tenants), SpanSeconds: tr.Duration().Seconds()}
	w.BlockTokens = tr.BlockTokens
	var prompts, outputs, maxNew []int
	for _, r := range tr.Requests {
		prompts = append(prompts, r.Prompt)
		outputs = append(outputs, r.Output)
		maxNew = append(maxNew, r.MaxNew)
		switch total := r.Prompt + r.MaxNew; {
		case total > maxContext:
			w.OverMaxContext++
		case total > capacityTokens:
			w.OverCapacity++
		}
		if r.AbortAfter >= 0 {
			w.Aborting++
		}
	}
	slices.Sort(prompts)
	slices.Sort(outputs)
	slices.Sort(maxNew)
	w.PromptP50, w.PromptP99 = Percentile(prompts, 0.5), Percentile(prompts, 0.99)
	if len(prompts) > 0 {
		w.PromptMax = prompts[len(prompts)-1]
	}
	w.OutputP50, w.OutputP99 = Percentile(outputs, 0.5), Percentile(outputs, 0.99)
	w.MaxNewP50 = Percentile(maxNew, 0.5)
	return w
}

// DomainComparison is one pool size, policy and sizing replayed with one
// domain per tenant and with shared domains.
type DomainComparison struct {
	PoolPages int           `json:"pool_pages"`
	Policy    string        `json:"policy"`
	Sizing    string        `json:"sizing"`
	PerTenant PrefixFigures `json:"per_tenant"`
	Shared    PrefixFigures `json:"shared"`
	// PrefillAvoidedRatio is shared ÷ per-tenant prefill bytes avoided
	// (0 when per-tenant avoided none).
	PrefillAvoidedRatio float64 `json:"prefill_avoided_ratio"`
}

// PrefixFigures are the headline prefix-cache figures of one run.
type PrefixFigures struct {
	Domains             int     `json:"domains"`
	HitRate             float64 `json:"hit_rate"`
	HitTokens           uint64  `json:"hit_tokens"`
	PromptHitShare      float64 `json:"prompt_hit_share"`
	PrefillBytesAvoided uint64  `json:"prefill_bytes_avoided"`
	EvictedPages        uint64  `json:"evicted_pages"`
	TTFTP99             float64 `json:"ttft_p99_s"`
}

func figuresOf(r *RunResult) PrefixFigures {
	return PrefixFigures{Domains: r.Prefix.Domains, HitRate: r.Prefix.HitRate, HitTokens: r.Prefix.HitTokens,
		PromptHitShare: r.Prefix.PromptHitShare, PrefillBytesAvoided: r.Prefix.PrefillBytesAvoided,
		EvictedPages: r.Prefix.EvictedPages, TTFTP99: r.TTFT.P99}
}

// CompareDomains pairs the runs of each pool size, policy and sizing
// replayed with both domain layouts.
func CompareDomains(runs []*RunResult) []DomainComparison {
	var out []DomainComparison
	for _, pt := range runs {
		if pt.Domains != DomainsPerTenant {
			continue
		}
		for _, sh := range runs {
			if sh.Domains == DomainsShared && sh.PoolPages == pt.PoolPages && sh.HostTierPages == pt.HostTierPages && sh.Policy == pt.Policy && sh.Sizing == pt.Sizing {
				c := DomainComparison{PoolPages: pt.PoolPages, Policy: pt.Policy, Sizing: pt.Sizing, PerTenant: figuresOf(pt), Shared: figuresOf(sh)}
				c.PrefillAvoidedRatio = ratio(float64(sh.Prefix.PrefillBytesAvoided), float64(pt.Prefix.PrefillBytesAvoided))
				out = append(out, c)
				break
			}
		}
	}
	return out
}

// SizingComparison is one pool size, domain layout and policy replayed
// with full and with on-demand sizing.
type SizingComparison struct {
	PoolPages int           `json:"pool_pages"`
	Domains   string        `json:"domains"`
	Policy    string        `json:"policy"`
	Full      SizingFigures `json:"full"`
	OnDemand  SizingFigures `json:"on_demand"`
	// ConcurrencyRatio is on-demand ÷ full mean concurrency (0 when full
	// ran nothing).
	ConcurrencyRatio float64 `json:"concurrency_ratio"`
}

// SizingFigures are the headline figures of one run for the comparison
// of sizings.
type SizingFigures struct {
	ConcurrencyMean   float64 `json:"concurrency_mean"`
	ConcurrencyMax    int     `json:"concurrency_max"`
	KVUtilisation     float64 `json:"kv_utilisation"`
	TTFTP50           float64 `json:"ttft_p50_s"`
	TTFTP99           float64 `json:"ttft_p99_s"`
	Admitted          uint64  `json:"admitted"`
	Completed         uint64  `json:"completed"`
	Preempted         uint64  `json:"preempted"`
	ReadmitHitTokens  uint64  `json:"readmit_hit_tokens"`
	ScrubPerKVWritten float64 `json:"scrub_bytes_per_kv_byte_written"`
}

func sizingFiguresOf(r *RunResult) SizingFigures {
	return SizingFigures{ConcurrencyMean: r.Concurrency.Mean, ConcurrencyMax: r.Concurrency.Max, KVUtilisation: r.KVUtilisation,
		TTFTP50: r.TTFT.P50, TTFTP99: r.TTFT.P99, Admitted: r.Admitted, Completed: r.Completed,
		Preempted: r.Growth.Preempted, ReadmitHitTokens: r.Growth.ReadmitHitTokens, ScrubPerKVWritten: r.ScrubPerKVWritten}
}

// CompareSizings pairs the runs of each pool size, layout and policy
// replayed with both sizings.
func CompareSizings(runs []*RunResult) []SizingComparison {
	var out []SizingComparison
	for _, f := range runs {
		if f.Sizing != SizingFull {
			continue
		}
		for _, od := range runs {
			if od.Sizing == SizingOnDemand && od.PoolPages == f.PoolPages && od.HostTierPages == f.HostTierPages && od.Domains == f.Domains && od.Policy == f.Policy {
				out = append(out, SizingComparison{PoolPages: f.PoolPages, Domains: f.Domains, Policy: f.Policy,
					Full: sizingFiguresOf(f), OnDemand: sizingFiguresOf(od), ConcurrencyRatio: ratio(od.Concurrency.Mean, f.Concurrency.Mean)})
				break
			}
		}
	}
	return out
}

// writeSizingTable prints, per run, what lease sizing changed: how many
// requests ran at once, how much of what leases held was written, time to
// first token, growth and preemption.
func (r *Report) writeSizingTable(w io.Writer, many Variety) {
	fmt.Fprintln(w)
	head := "sizing (concurrent: requests running per step, mean over the steps that ran any, and max; KV util: pages holding written KV ÷ pages held by leases; " +
		"preempted: leases preempted when a growth was refused, newest first; readmit hits: tokens their re-admissions shared back from the prefix cache, " +
		"recomputed: tokens they computed again; truncated: ended before their output, their lease could never grow to it"
	if slices.Contains(r.Sizings, SizingOnDemand) {
		head += fmt.Sprintf("; on-demand headroom %d tokens, growth watermark %.3g", r.HeadroomTokens, r.GrowthWatermark)
	}
	fmt.Fprintln(w, head+"):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tsizing\tconcurrent\tmax\tKV util\tTTFT p50\tp99\tadmitted\tcompleted\tgrown pages\tpreempted\treadmitted\treadmit hits\trecomputed\ttruncated\tscrub÷KV\t")
	for _, run := range r.Runs {
		g := run.Growth
		fmt.Fprintf(tw, "%s\t%s\t%.1f\t%d\t%.1f%%\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%.2f\t\n", RunLabel(run, many), run.Sizing,
			run.Concurrency.Mean, run.Concurrency.Max, 100*run.KVUtilisation, fmtSeconds(run.TTFT.P50), fmtSeconds(run.TTFT.P99),
			run.Admitted, run.Completed, g.PagesGrown, g.Preempted, g.Readmitted, g.ReadmitHitTokens, g.RecomputedTokens,
			sumCounts(g.Truncated), run.ScrubPerKVWritten)
	}
	tw.Flush()
	for _, c := range r.SizingComparison {
		fmt.Fprintf(w, "on-demand vs full sizing (%d pages, %s, %s): concurrent %.1f vs %.1f (%s), max %d vs %d, KV util %.1f%% vs %.1f%%, "+
			"TTFT p50 %s vs %s, p99 %s vs %s, completed %d vs %d, %d preemptions, scrub÷KV %.2f vs %.2f\n",
			c.PoolPages, c.Domains, c.Policy, c.OnDemand.ConcurrencyMean, c.Full.ConcurrencyMean, fmtRatio(c.ConcurrencyRatio),
			c.OnDemand.ConcurrencyMax, c.Full.ConcurrencyMax, 100*c.OnDemand.KVUtilisation, 100*c.Full.KVUtilisation,
			fmtSeconds(c.OnDemand.TTFTP50), fmtSeconds(c.Full.TTFTP50), fmtSeconds(c.OnDemand.TTFTP99), fmtSeconds(c.Full.TTFTP99),
			c.OnDemand.Completed, c.Full.Completed, c.OnDemand.Preempted, c.OnDemand.ScrubPerKVWritten, c.Full.ScrubPerKVWritten)
	}
}

// WriteJSON writes the report, indented.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// writePrefixTable prints what the prefix cache saved, per run, and the
// domain layouts against each other.
func (r *Report) writePrefixTable(w io.Writer, many Variety) {
	fmt.Fprintln(w)
	if r.PrefixCache != "on" {
		fmt.Fprintln(w, "prefix cache: off (-prefix-cache on to measure hits)")
		return
	}
	fmt.Fprintln(w, "prefix cache (hit rate: full prompt pages found in the tenant's domain ÷ looked up; "+
		"bound: the same for an infinite cache that every request of the trace this pool can take fills before the next arrives, "+
		"the most the trace allows; served: that bound over the requests this run admitted, never below its hit rate; "+
		"of prompt: hit tokens ÷ prompt tokens admitted; "+
		"hashed: requests whose prompt was hashed into page keys, once each, and the time it took):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tdomains\thit rate\tbound\tserved\thit tokens\tof prompt\tprefill avoided\tstored\tevicted\thashed\tin\tTTFT p50\tp99\t")
	for _, run := range r.Runs {
		px := run.Prefix
		fmt.Fprintf(tw, "%s\t%d %s\t%s\t%.1f%%\t%s\t%d\t%.1f%%\t%s\t%d\t%d\t%d\t%s\t%s\t%s\t\n", RunLabel(run, many), px.Domains, run.Domains,
			fmtHitRate(px.HitRate, px.LookupPages), 100*px.Bound.HitRate, fmtHitRate(px.ServedBound.HitRate, px.ServedBound.LookupPages),
			px.HitTokens, 100*px.PromptHitShare, FormatBytes(float64(px.PrefillBytesAvoided)),
			px.StoredPages, px.EvictedPages, px.KeyDerivations, fmtSeconds(px.KeySeconds), fmtSeconds(run.TTFT.P50), fmtSeconds(run.TTFT.P99))
	}
	tw.Flush()
	for _, c := range r.DomainComparison {
		if c.Policy != r.DomainComparison[0].Policy {
			continue // hits do not depend on the scrub policy: one line per pool says it
		}
		what := c.Policy
		if many.Sizings {
			what += ", " + c.Sizing + " sizing"
		}
		fmt.Fprintf(w, "shared vs per-tenant domains (%d pages, %s): hit rate %.1f%% vs %.1f%%, prefill avoided %s vs %s (×%.2f), "+
			"%d vs %d domains, TTFT p99 %s vs %s\n", c.PoolPages, what, 100*c.Shared.HitRate, 100*c.PerTenant.HitRate,
			FormatBytes(float64(c.Shared.PrefillBytesAvoided)), FormatBytes(float64(c.PerTenant.PrefillBytesAvoided)),
			c.PrefillAvoidedRatio, c.Shared.Domains, c.PerTenant.Domains, fmtSeconds(c.Shared.TTFTP99), fmtSeconds(c.PerTenant.TTFTP99))
	}
}

// writeTierTable prints what the host tier did, for the runs that had
// one.
func (r *Report) writeTierTable(w io.Writer, many Variety) {
	has := false
	for _, run := range r.Runs {
		has = has || run.Tier != nil
	}
	if !has {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "host tier (offloaded: cached pages the device evicted, copied into the tier; onloaded: copied back into "+
		"admissions' pages, hits counted in the prefix cache's hit rate; tier hits: of those, first admissions' and re-admissions'):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "run\ttier tokens\thit rate\toffloaded\tdropped\tonloaded\ttier hits\tevicted\tcached at end\toffload time\tonload time\t")
	for _, run := range r.Runs {
		t := run.Tier
		if t == nil {
			continue
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d (%s)\t%d\t%d (%s)\t%d\t%d\t%d\t%s\t%s\t\n", RunLabel(run, many), run.HostTierTokens,
			fmtHitRate(run.Prefix.HitRate, run.Prefix.LookupPages), t.OffloadedPages, FormatBytes(float64(t.OffloadedBytes)), t.OffloadsDropped,
			t.OnloadedPages, FormatBytes(float64(t.OnloadedBytes)), t.TierHitPages, t.EvictedSlots, t.CachedAtEnd,
			fmtSeconds(t.OffloadSeconds), fmtSeconds(t.OnloadSeconds))
	}
	tw.Flush()
	if !slices.ContainsFunc(r.Runs, func(run *RunResult) bool { return run.Tier != nil && run.Tier.CheckpointSlots > 0 }) {
		return
	}
	fmt.Fprintln(w, "host tier, state checkpoints (slots: the checkpoints it holds, and their host memory at the model's size; "+
		"stored: checkpoints the device evicted, copied into the tier; dropped: no room; "+
		"restored: copied back into admitted leases by hits, counted in the state checkpoints' hits, bytes at the model's size; "+
		"evicted: for room, or with their page):")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "run	slots	stored	dropped	failed	restored	ckpt hits	evicted	at end	")
	for _, run := range r.Runs {
		t := run.Tier
		if t == nil || t.CheckpointSlots == 0 {
			continue
		}
		var hits uint64
		var slotBytes int64
		if c := run.Checkpoints; c != nil {
			hits, slotBytes = c.Hits, c.SlotBytes
		}
		fmt.Fprintf(tw, "%s\t%d (%s)\t%d\t%d\t%d\t%d (%s)\t%d\t%d\t%d\t\n", RunLabel(run, many), t.CheckpointSlots,
			FormatBytes(float64(int64(t.CheckpointSlots)*slotBytes)), t.CheckpointsStored,
			t.CheckpointsDropped, t.CheckpointsFailed, t.CheckpointsRestored, FormatBytes(float64(t.CheckpointRestoreBytes)), hits,
			t.CheckpointsEvicted, t.CheckpointsAtEnd)
	}
	tw.Flush()
}

// writeCheckpointTable prints, per run of a hybrid model, what its state
// checkpoints did.
func (r *Report) writeCheckpointTable(w io.Writer, many Variety) {
	if !slices.ContainsFunc(r.Runs, func(run *RunResult) bool { return run.Checkpoints != nil }) {
		return
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "state checkpoints (hit rate: as above, prefixes shared with the state at their end; "+
		"per-token only: the same trace on the same pages of the per-token group alone, whole prompts published, no state needed; "+
		"ckpt misses: admissions, and their tokens, that matched cached pages past their last checkpoint; "+
		"matched: hit and checkpoint-miss tokens ÷ looked up, the same pool's matches with checkpoints ignored; "+
		"taken/existing/evicted/skipped: checkpoints copied, found there already, evicted (scrubbed), not taken for want of room; "+
		"state: bytes checkpoints held at the model's size, most at a sample and at the end; "+
		"copy, restore: the pool's state copies per checkpoint and per hit, HOST memcpy of the miniature's slot, "+
		"and at model size the same rate over the model's slot; not GPU times):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\thit rate\tper-token only\tbound\tmatched\tckpt hits\thit tokens\tckpt misses\tmiss tokens\ttaken\texisting\tevicted\tskipped\t"+
		"state peak\tat end\tcopy\trestore\thost GB/s\tcopy at model size\t")
	for _, run := range r.Runs {
		c := run.Checkpoints
		if c == nil {
			continue
		}
		pto := "-"
		if p := c.PerTokenOnly; p != nil {
			pto = fmtHitRate(p.HitRate, p.LookupPages)
		}
		px := run.Prefix
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.1f%%\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t%.2f\t%s\t\n", RunLabel(run, many),
			fmtHitRate(px.HitRate, px.LookupPages), pto, 100*px.Bound.HitRate, fmtHitRate(c.MatchedRate, px.LookupPages), c.Hits, c.HitTokens, c.Misses, c.MissTokens,
			c.Taken, c.Existing, c.Evicted, c.CapacitySkips, FormatBytes(float64(c.PeakStateBytes)), FormatBytes(float64(c.StateBytesAtEnd)),
			fmtNs(int64(c.CopyNs)), fmtNs(int64(c.RestoreNs)), c.HostCopyGBps, fmtNs(int64(c.ModelCopyNs)))
	}
	tw.Flush()
}

// fmtHitRate prints a hit rate, or "-" when nothing was looked up (no
// request admitted).
func fmtHitRate(rate float64, lookups uint64) string {
	if lookups == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*rate)
}

func fmtSeconds(s float64) string {
	if s == 0 {
		return "-"
	}
	return fmtNs(int64(s * 1e9))
}

func fmtNs(ns int64) string {
	d := time.Duration(ns)
	switch {
	case d == 0:
		return "-"
	case d < time.Microsecond:
		return fmt.Sprintf("%dns", ns)
	case d < time.Millisecond:
		return fmt.Sprintf("%.1fµs", float64(ns)/1e3)
	}
	return fmt.Sprintf("%.2fms", float64(ns)/1e6)
}

// FormatBytes prints n in binary units.
func FormatBytes(n float64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	i := 0
	for n >= 1024 && i < len(units)-1 {
		n /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%.0f B", n)
	}
	return fmt.Sprintf("%.1f %s", n, units[i])
}

// FormatRate prints bytes per second in decimal units, as bandwidths are
// quoted.
func FormatRate(bps float64) string {
	units := []string{"B/s", "kB/s", "MB/s", "GB/s", "TB/s", "PB/s"}
	i := 0
	for bps >= 1000 && i < len(units)-1 {
		bps /= 1000
		i++
	}
	return fmt.Sprintf("%.3g %s", bps, units[i])
}

func fmtRatio(v float64) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf("×%.2f", v)
}

// WriteTable prints the report for people.
func (r *Report) WriteTable(w io.Writer) {
	wl := r.Workload
	format := wl.Format
	if wl.BlockTokens > 0 {
		format += fmt.Sprintf(", blocks of %d tokens", wl.BlockTokens)
	}
	fmt.Fprintf(w, "workload: %s (%s), %d requests from %d tenants over %.1fs; prompt p50/p99/max %d/%d/%d tokens, "+
		"output p50/p99 %d/%d, max_new p50 %d; %d over the context window, %d over the pool, %d aborting",
		wl.Source, format, wl.Requests, wl.Tenants, wl.SpanSeconds, wl.PromptP50, wl.PromptP99, wl.PromptMax,
		wl.OutputP50, wl.OutputP99, wl.MaxNewP50, wl.OverMaxContext, wl.OverCapacity, wl.Aborting)
	for i, b := range wl.PrefixBounds {
		sep := "; "
		if i == 0 {
			sep = "; infinite-cache hit rate (the trace's bound): "
		}
		fmt.Fprintf(w, "%s%.1f%% %s", sep, 100*b.HitRate, b.Domains)
	}
	fmt.Fprintln(w)
	if m := r.Model; m != nil {
		fmt.Fprintf(w, "model: %s, groups %s, %d tokens/page: %s/page, %s/token",
			m.Model, strings.Join(m.Groups, ", "), m.TokensPerPage, FormatBytes(float64(m.PageBytes)), FormatBytes(float64(m.TokenBytes)))
		if m.Hybrid {
			fmt.Fprintf(w, ", %s of state per lease; state slots for %d leases and %d checkpoints", FormatBytes(float64(m.SlotBytes)), m.MaxLeases, m.CheckpointSlots)
			if m.MaxCheckpoints > 0 {
				fmt.Fprintf(w, " (at most %d held)", m.MaxCheckpoints)
			}
		}
		fmt.Fprintf(w, "; max context %d tokens; step %v, batch ≤ %d\n", r.MaxContext, time.Duration(r.Step*1e9), r.MaxBatch)
		fmt.Fprintf(w, "  the pools are its miniature (one layer of each group): %s/page", FormatBytes(float64(m.HostPageBytes)))
		if m.Hybrid {
			fmt.Fprintf(w, ", %s/state slot (one layer's state ÷ %d)", FormatBytes(float64(m.HostSlotBytes)), m.StateShrink)
		}
		fmt.Fprintln(w, "; every byte figure is at the model's size")
		if m.SlotCopyNs > 0 {
			fmt.Fprintf(w, "  a plain host memcpy of one state slot of the model's size (%s) takes %s here (median of 5; host memory, not a GPU)\n",
				FormatBytes(float64(m.SlotBytes)), fmtNs(m.SlotCopyNs))
		}
	} else {
		r.writeGeometry(w)
	}
	fmt.Fprintf(w, "machine: %s/%s, %d CPUs, %s\n\n", r.Machine.GOOS, r.Machine.GOARCH, r.Machine.CPUs, r.Machine.Go)
	r.writeRuns(w)
}

// writeGeometry prints the pools' geometry, and the one bytes are
// reported at.
func (r *Report) writeGeometry(w io.Writer) {
	g := r.Geometry
	fmt.Fprintf(w, "geometry: %d layers × %d KV heads × %d dim %s, %d tokens/page: %s/page, %s/token; max context %d tokens; step %v, batch ≤ %d\n",
		g.Layers, g.KVHeads, g.HeadDim, g.DType, g.TokensPerPage, FormatBytes(float64(g.PageBytes)), FormatBytes(float64(g.TokenBytes)),
		r.MaxContext, time.Duration(r.Step*1e9), r.MaxBatch)
	if rg := r.ReportGeometry; rg != nil && rg.Model != "" {
		fmt.Fprintf(w, "bytes reported at model %s: %s/page, %s/token of its per-token caches (the pools were allocated at the geometry above)\n",
			rg.Model, FormatBytes(float64(rg.PageBytes)), FormatBytes(float64(rg.TokenBytes)))
	} else if rg != nil {
		fmt.Fprintf(w, "bytes reported at %d layers × %d KV heads × %d dim %s: %s/page, %s/token (the pools were allocated at the geometry above)\n",
			rg.Layers, rg.KVHeads, rg.HeadDim, rg.DType, FormatBytes(float64(rg.PageBytes)), FormatBytes(float64(rg.TokenBytes)))
	}
}

// writeRuns prints the runs' tables.
func (r *Report) writeRuns(w io.Writer) {
	many := VarietyOf(r.Runs)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	gpuHead := ""
	if r.DeviceBandwidth > 0 {
		gpuHead = fmt.Sprintf("GPU fill/s @%s\t", FormatRate(r.DeviceBandwidth))
	}
	fmt.Fprintf(tw, "policy\tpool\tadmit/s\tadmit p50\tp99\tp999\tscrubbed\tB/gen tok\tscrub÷KV\tfill share\t%srun×base\tp99×base\tmean use\taudit\t\n", gpuHead)
	for _, run := range r.Runs {
		label := RunLabel(run, many)
		if run.Unsafe {
			label += " (UNSAFE)"
		}
		gpu := ""
		if r.DeviceBandwidth > 0 {
			gpu = "-\t"
			if run.GPUFillPerServingSecond != nil {
				gpu = fmt.Sprintf("%.3f%%\t", 100**run.GPUFillPerServingSecond)
			}
		}
		var rt, p99 string = "-", "-"
		if run.VsBaseline != nil {
			rt, p99 = fmtRatio(run.VsBaseline.RunTime), fmtRatio(run.VsBaseline.AdmitP99)
		} else if run.Unsafe {
			rt, p99 = "×1.00", "×1.00"
		}
		audit := "off"
		if run.Audit.Enabled {
			audit = "pass"
			if !run.Audit.Passed {
				audit = fmt.Sprintf("LEAK %d pages", run.Audit.StalePages+run.Audit.CanaryFailures+run.Audit.PoolCanaryFaults)
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%.1f\t%s\t%s\t%s\t%s\t%.0f\t%.2f\t%.1f%%\t%s%s\t%s\t%.0f%%\t%s\t\n",
			label, FormatBytes(float64(run.PoolBytes)), run.AdmissionsPerServingSecond,
			fmtNs(run.AdmitLatency.P50), fmtNs(run.AdmitLatency.P99), fmtNs(run.AdmitLatency.P999),
			FormatBytes(float64(run.BytesScrubbed)), run.ScrubBytesPerGeneratedToken, run.ScrubPerKVWritten,
			100*run.FillShare, gpu, rt, p99, 100*run.MeanInUse, audit)
	}
	tw.Flush()

	fmt.Fprintln(w)
	reasons := map[string]bool{}
	for _, run := range r.Runs {
		for k := range run.Refusals {
			reasons["refused:"+k] = true
		}
		for k, v := range run.Dropped {
			if v > 0 {
				reasons["dropped:"+k] = true
			}
		}
	}
	keys := make([]string, 0, len(reasons))
	for k := range reasons {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "policy\tarrived\tadmitted\tcompleted\taborted\tshutdown\t%s\t\n", strings.Join(keys, "\t"))
	for _, run := range r.Runs {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t", RunLabel(run, many), run.Arrived, run.Admitted, run.Completed, run.Aborted, run.ShutdownReleases)
		for _, k := range keys {
			kind, name, _ := strings.Cut(k, ":")
			m := run.Refusals
			if kind == "dropped" {
				m = run.Dropped
			}
			fmt.Fprintf(tw, "%d\t", m[name])
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	fmt.Fprintln(w, "  (refused: admission attempts the pool refused, retries included; dropped: requests never served)")

	fmt.Fprintln(w)
	for _, run := range r.Runs {
		fmt.Fprintf(w, "audit %s: %s [%s]\n", RunLabel(run, many), run.Audit.Summary, run.Audit.Method)
		for _, ex := range run.Audit.Examples {
			fmt.Fprintf(w, "    %s\n", ex)
		}
	}
	r.writePrefixTable(w, many)
	r.writeTierTable(w, many)
	r.writeCheckpointTable(w, many)
	r.writeSizingTable(w, many)
	if r.DeviceBandwidth == 0 {
		fmt.Fprintln(w, "GPU estimate: pass -device-bandwidth (e.g. 4TB/s) to estimate device fill time per second of serving")
	}
	fmt.Fprintln(w, "fill share and run× are CPU figures of this host simulation (Host backend); "+
		"B/gen tok and scrub÷KV hold on any device")
}
