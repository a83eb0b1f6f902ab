// Command kvbench replays a multi-tenant serving workload against kvfence
// pools and reports what scrubbing costs and what the isolation audit saw.
//
// It simulates an inference engine with continuous batching on a virtual
// clock: requests arrive (from a synthetic generator, a kvbench JSONL
// trace, or a Mooncake or Azure trace imported as it is read),
// are admitted by a kvfence pool (or refused, with the reason counted),
// compute their prompts within a per-step prefill budget (skipping the
// prefix shared from kvfence's prefix cache and publishing the prompt for
// later requests of their sharing domain), write one token's KV per
// decode step, and release their pages when they finish or their client
// aborts. The kvfence calls and the KV writes run for real, on the chosen
// device, and are timed; the engine's compute is not simulated. The same
// trace is replayed once per scrub policy, pool size, sharing-domain
// layout and lease sizing (full reservation, or on demand: the lease
// grows as the request generates and a refused growth preempts), and
// each policy is compared with the unsafe "none" baseline, which skips
// the fills. Each run's prefix-cache hit rate is printed beside the
// trace's own bound (an infinite cache). With -model the pools are a
// model preset's caches (a miniature, bytes reported at the model's
// size); a hybrid model (glm-5.3-flash, qwen3-next-80b-a3b) shares
// prefixes through state checkpoints, and its hit rate is printed beside
// the same trace's on its per-token pages alone.
//
//	go run ./bench/cmd/kvbench -duration 5s -out DIR
//	go run ./bench/cmd/kvbench -trace mooncake.jsonl -pool-tokens 1M,3M,10M,50M -policies zero
//
// Run with -help for the flags, the exit statuses and the trace format.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/kvfence/kvfence/bench/internal/kvsim"
	"github.com/kvfence/kvfence/cudaops"
	"github.com/kvfence/kvfence/isolation"
	"github.com/kvfence/kvfence/kvcache"
)

// Exit statuses.
const (
	exitOK       = 0
	exitFailure  = 1 // a run failed: pool error, device unavailable, a safe policy's audit failed; or a plot failed
	exitBadInput = 2 // bad flag, bad flag value, bad trace
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr, term.IsTerminal(int(os.Stderr.Fd()))))
}

// usageError is bad input: exit status 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func badFlag(name, format string, args ...any) error {
	return &usageError{fmt.Sprintf("flag -%s: %s", name, fmt.Sprintf(format, args...))}
}

type options struct {
	duration, step, queueTimeout time.Duration
	trace, traceFormat           string
	traceTenants                 int
	emitTrace, out               string
	seed                         uint64
	rate, overlong, abort        float64
	tenants, orgSize             int
	prefixCache                  bool
	domains                      []string
	prefillTokens                int
	policies                     []string
	sizings                      []string
	headroom                     int
	watermark                    float64
	budget                       string
	poolPages                    []int
	tierPages                    []int // host-tier sizes to compare; 0: none
	// tierCkpts is a hybrid model's host-tier checkpoints
	// (-host-tier-checkpoints); 0: tierCheckpoints derives them.
	tierCkpts            int
	maxContext, maxBatch int
	geometry             kvcache.Geometry
	reportGeometry       *kvcache.Geometry
	// model runs pools of a preset's cache spec (kvsim.ModelPool),
	// stateShrink its miniature's state divisor.
	model          *kvsim.ModelPool
	stateShrink    int
	audit, writeKV bool
	progressEvery  time.Duration
	device         string
	bandwidth      float64
	durationSet    bool
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("kvbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.DurationVar(&o.duration, "duration", 30*time.Second, "virtual serving time to replay (synthetic arrivals span it; with -trace, default: last arrival + 1m)")
	fs.StringVar(&o.trace, "trace", "", "replay this trace (\"-\" for stdin) instead of the synthetic workload: kvbench JSONL, Mooncake JSONL or Azure CSV (see -trace-format)")
	fs.StringVar(&o.traceFormat, "trace-format", kvsim.FormatAuto, "format of -trace: "+strings.Join(kvsim.TraceFormats, ", ")+" (auto: told by its first record)")
	fs.IntVar(&o.traceTenants, "trace-tenants", 1, "spread an imported (Mooncake, Azure) trace's requests over this many tenants, round robin in file order (1..255); with -domains shared they form domains of -org-size tenants")
	fs.StringVar(&o.emitTrace, "emit-trace", "", "also write the replayed workload as a JSONL trace to this file")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the synthetic workload (same seed, same workload)")
	fs.Float64Var(&o.rate, "rate", 10, "synthetic mean arrivals per second (Poisson)")
	fs.IntVar(&o.tenants, "tenants", 8, "synthetic tenants (Zipf popularity; the last has a quota of 1/4 of the pool)")
	fs.IntVar(&o.orgSize, "org-size", 4, "tenants per organisation, of the synthetic workload or of an imported trace spread with -trace-tenants: with -domains shared they share a sharing domain (synthetic ones also a system prompt; 1: every tenant alone)")
	prefixCache := fs.String("prefix-cache", "on", "prefix caching: on (requests carry token IDs, hits skip prefill, prompts are published after prefill) or off")
	domains := fs.String("domains", kvsim.DomainsPerTenant, "sharing-domain layouts to compare, comma-separated: per-tenant (one domain per tenant), shared (the trace's or the organisations' domains)")
	fs.IntVar(&o.prefillTokens, "prefill-tokens", 8192, "engine prefill budget in tokens per step, shared by running prompts (0: no limit)")
	fs.Float64Var(&o.overlong, "overlong", 0.02, "synthetic share of requests longer than the pool or the context window")
	fs.Float64Var(&o.abort, "abort", 0.05, "synthetic share of requests aborted by their client")
	policies := fs.String("policies", strings.Join(kvsim.Policies, ","), "scrub policies to compare: zero, poison, canary, none (none = UNSAFE baseline that skips fills)")
	sizings := fs.String("sizing", kvsim.SizingFull, "lease sizings to compare, comma-separated: full (admission reserves prompt + output budget) or on-demand "+
		"(the prompt and -headroom output tokens; the lease grows a page at a time as it generates, and a refused growth preempts the newest request)")
	fs.IntVar(&o.headroom, "headroom", 0, "on-demand sizing: output tokens admission reserves beyond the prompt (0: the prompt alone, as vLLM)")
	fs.Float64Var(&o.watermark, "watermark", 0.01, fmt.Sprintf("on-demand sizing: share of the pool new admissions leave free for growth, 0..%v (vLLM's default is 0.01); full runs keep none", kvcache.MaxGrowthWatermark))
	fs.StringVar(&o.budget, "budget", kvsim.BudgetTrace, "output budget of each request: trace (its max_new; an imported trace's output length) or window (the rest of the context window, as for a client that sends no max_tokens)")
	pools := fs.String("pool-pages", "8192", "pool sizes in pages to compare, comma-separated")
	poolTokens := fs.String("pool-tokens", "", "pool sizes in tokens instead of -pool-pages, comma-separated, with an optional k, M, G (powers of 1000) or Ki, Mi, Gi suffix (e.g. 1M,3M,10M,50M); rounded up to whole pages")
	tierTokens := fs.String("host-tier-tokens", "0", "host-tier sizes in tokens to compare, comma-separated, suffixes as -pool-tokens (0: no tier): each pool size runs with each; "+
		"cached pages the device evicts are kept in the tier and copied back into admissions whose prefix continues there")
	fs.IntVar(&o.tierCkpts, "host-tier-checkpoints", 0, "-model with a state group and -host-tier-tokens: state checkpoints the tier keeps beside its pages (kvcache HostTierConfig.Checkpoints): "+
		"those the device evicts go there and hits restore them. 0: the device pool's ratio, its checkpoint room per page times the tier's pages, rounded up "+
		"(the room: -checkpoint-slots, or -max-leases when that is 0, at most -max-checkpoints if set; e.g. 256 slots in a pool of 1M tokens give a tier of 10M tokens 2560)")
	fs.IntVar(&o.maxContext, "max-context", 262144, "engine context window in tokens")
	fs.IntVar(&o.geometry.TokensPerPage, "page-tokens", 16, "tokens per page")
	fs.IntVar(&o.geometry.Layers, "layers", 4, "model layers (regions = 2 × layers)")
	fs.IntVar(&o.geometry.KVHeads, "kv-heads", 4, "KV heads")
	fs.IntVar(&o.geometry.HeadDim, "head-dim", 64, "head dimension")
	dtype := fs.String("dtype", "fp16", "KV dtype: fp8_e4m3, fp8_e5m2, fp16, bf16, fp32")
	model := fs.String("model", "", "run pools of this model preset's caches (one of: "+presetNames()+"), allocated as a miniature (one layer of each cache group, "+
		"fewer bytes per page) with every byte reported at the model's size; its page size replaces -page-tokens, and -layers/-kv-heads/-head-dim/-dtype/-report-geometry do not apply. "+
		"A hybrid model (a state group: glm-5.3-flash, qwen3-next-80b-a3b) shares prefixes through state checkpoints, and is also replayed on its per-token pages alone for comparison. "+
		"Models with a sliding-window group (gpt-oss-120b) are refused: the simulated engine does not slide windows")
	maxLeases := fs.Int("max-leases", 0, "-model with a state group: leases live at once, which sizes the state slots (kvcache Config.MaxLeases; 0: -max-batch)")
	checkpointSlots := fs.Int("checkpoint-slots", 256, "-model with a state group: state slots for checkpoints beside the leases' (kvcache PrefixConfig.CheckpointSlots)")
	maxCheckpoints := fs.Int("max-checkpoints", 0, "-model with a state group: most checkpoints held at once (kvcache PrefixConfig.MaxCheckpoints; 0: the slots' room)")
	fs.IntVar(&o.stateShrink, "state-shrink", 1, "-model with a state group: the miniature's state slot is one layer's divided by this (1: one layer at its full size, so that a checkpoint copies what a real layer's does)")
	reportGeometry := fs.String("report-geometry", "", "report bytes at this model's KV geometry, e.g. layers=32,kv-heads=8,head-dim=128,dtype=bf16 (same page size), while the pools are allocated at -layers/-kv-heads/-head-dim/-dtype")
	fs.DurationVar(&o.step, "step", 20*time.Millisecond, "virtual time of one decode step")
	fs.IntVar(&o.maxBatch, "max-batch", 256, "most requests running at once")
	fs.DurationVar(&o.queueTimeout, "queue-timeout", 30*time.Second, "virtual time a request waits for pages before it is dropped")
	fs.BoolVar(&o.audit, "audit", false, "check every reused page before the engine writes it (marker check; canary policy also verifies in the pool)")
	fs.BoolVar(&o.writeKV, "write-kv", true, "simulate the engine's KV writes into the pages (needed for the audit to see stale KV)")
	fs.StringVar(&o.device, "device", "host", "device backend: host or cuda")
	bw := fs.String("device-bandwidth", "", "device fill bandwidth (e.g. 4TB/s, 900GB/s, 3.2e12) to estimate device fill time per second of serving")
	fs.StringVar(&o.out, "out", "", "directory for report.json and the plots (default: a new ./kvbench-* directory)")
	fs.DurationVar(&o.progressEvery, "progress-interval", 5*time.Second, "when stderr is not a terminal, print a progress line this often (0: never); a terminal gets a progress bar")
	fs.Usage = func() { usage(fs) }
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, &usageError{fmt.Sprintf("unexpected argument %q (flags only; see -help)", fs.Arg(0))}
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	o.durationSet = set["duration"]

	for _, p := range strings.Split(*policies, ",") {
		p = strings.TrimSpace(p)
		if _, _, err := kvsim.ParsePolicy(p); err != nil {
			return nil, badFlag("policies", "unknown policy %q (want %s)", p, strings.Join(kvsim.Policies, ", "))
		}
		if !contains(o.policies, p) {
			o.policies = append(o.policies, p)
		}
	}
	for _, z := range strings.Split(*sizings, ",") {
		z = strings.TrimSpace(z)
		if !contains(kvsim.SizingModes, z) {
			return nil, badFlag("sizing", "unknown sizing %q (want %s)", z, strings.Join(kvsim.SizingModes, ", "))
		}
		if !contains(o.sizings, z) {
			o.sizings = append(o.sizings, z)
		}
	}
	switch {
	case o.headroom < 0 || o.headroom > isolation.MaxHeadroomTokens:
		return nil, badFlag("headroom", "%d tokens, want 0..%d", o.headroom, isolation.MaxHeadroomTokens)
	case set["headroom"] && !contains(o.sizings, kvsim.SizingOnDemand):
		return nil, badFlag("headroom", "sizes on-demand leases, and -sizing %s has none (add on-demand)", *sizings)
	case !(o.watermark >= 0 && o.watermark <= kvcache.MaxGrowthWatermark): // NaN fails too
		return nil, badFlag("watermark", "%v, want a share of the pool in 0..%v", o.watermark, kvcache.MaxGrowthWatermark)
	case set["watermark"] && !contains(o.sizings, kvsim.SizingOnDemand):
		return nil, badFlag("watermark", "keeps pages for on-demand leases to grow into, and -sizing %s has none (add on-demand)", *sizings)
	case !contains(kvsim.Budgets, o.budget):
		return nil, badFlag("budget", "unknown budget %q (want %s)", o.budget, strings.Join(kvsim.Budgets, ", "))
	}
	switch *prefixCache {
	case "on", "off":
		o.prefixCache = *prefixCache == "on"
	default:
		return nil, badFlag("prefix-cache", "unknown value %q (want on or off)", *prefixCache)
	}
	for _, d := range strings.Split(*domains, ",") {
		d = strings.TrimSpace(d)
		if !contains(kvsim.DomainModes, d) {
			return nil, badFlag("domains", "unknown layout %q (want %s)", d, strings.Join(kvsim.DomainModes, ", "))
		}
		if !contains(o.domains, d) {
			o.domains = append(o.domains, d)
		}
	}
	if !o.prefixCache && len(o.domains) > 1 {
		return nil, badFlag("domains", "%s compares prefix sharing, which -prefix-cache off turns off", *domains)
	}
	var err error
	if o.geometry.DType, err = isolation.ParseDType(*dtype); err != nil {
		return nil, badFlag("dtype", "unknown dtype %q (want fp8_e4m3, fp8_e5m2, fp16, bf16, fp32)", *dtype)
	}
	if err := o.geometry.Validate(); err != nil {
		return nil, &usageError{fmt.Sprintf("flags -page-tokens/-layers/-kv-heads/-head-dim/-dtype: %v", err)}
	}
	if *model != "" {
		for _, f := range []string{"page-tokens", "layers", "kv-heads", "head-dim", "dtype", "report-geometry"} {
			if set[f] {
				return nil, badFlag(f, "does not apply with -model %s, whose cache spec sets the pools' layout and the bytes reported", *model)
			}
		}
		spec, err := kvcache.Preset(*model)
		if err != nil {
			return nil, badFlag("model", "%v", err)
		}
		if o.stateShrink < 1 {
			return nil, badFlag("state-shrink", "%d, want ≥ 1", o.stateShrink)
		}
		mini, err := kvsim.Miniature(spec, o.stateShrink)
		if err != nil {
			return nil, badFlag("model", "%v", err)
		}
		m := &kvsim.ModelPool{Spec: spec, Miniature: mini}
		if len(spec.Groups) > 1 {
			m.MaxLeases, m.CheckpointSlots, m.MaxCheckpoints = *maxLeases, *checkpointSlots, *maxCheckpoints
			if m.MaxLeases == 0 {
				m.MaxLeases = o.maxBatch
			}
			switch {
			case *maxLeases < 0:
				return nil, badFlag("max-leases", "%d, want ≥ 0 (0: -max-batch)", *maxLeases)
			case *checkpointSlots < 0:
				return nil, badFlag("checkpoint-slots", "%d, want ≥ 0", *checkpointSlots)
			case *maxCheckpoints < 0:
				return nil, badFlag("max-checkpoints", "%d, want ≥ 0 (0: the slots' room)", *maxCheckpoints)
			}
		}
		if err := m.Validate(); err != nil {
			return nil, badFlag("model", "%v", err)
		}
		o.model = m
	}
	if o.model == nil || !o.model.Hybrid() {
		for _, f := range []string{"max-leases", "checkpoint-slots", "max-checkpoints", "state-shrink"} {
			if set[f] {
				return nil, badFlag(f, "sizes a hybrid model's state (-model glm-5.3-flash or qwen3-next-80b-a3b), and %s",
					map[bool]string{true: "-model " + *model + " has no state group", false: "no -model is given"}[*model != ""])
			}
		}
	}
	switch {
	case *poolTokens != "" && set["pool-pages"]:
		return nil, badFlag("pool-tokens", "give pool sizes in pages (-pool-pages) or in tokens, not both")
	case *poolTokens != "":
		for _, s := range strings.Split(*poolTokens, ",") {
			n, err := parseTokens(s)
			if err != nil {
				return nil, badFlag("pool-tokens", "%v", err)
			}
			pages := (n + int64(o.tokensPerPage()) - 1) / int64(o.tokensPerPage())
			if pages > math.MaxInt32 {
				return nil, badFlag("pool-tokens", "%q is %d pages of %d tokens, more than a pool holds", s, pages, o.tokensPerPage())
			}
			o.poolPages = append(o.poolPages, int(pages))
		}
	default:
		for _, s := range strings.Split(*pools, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil || n < 1 {
				return nil, badFlag("pool-pages", "%q is not a positive page count", s)
			}
			o.poolPages = append(o.poolPages, n)
		}
	}
	for _, s := range strings.Split(*tierTokens, ",") {
		var n int64
		if strings.TrimSpace(s) != "0" {
			var err error
			if n, err = parseTokens(s); err != nil {
				return nil, badFlag("host-tier-tokens", "%v (or 0 for none)", err)
			}
		}
		pages := (n + int64(o.tokensPerPage()) - 1) / int64(o.tokensPerPage())
		if pages > math.MaxInt32 {
			return nil, badFlag("host-tier-tokens", "%q is %d pages of %d tokens, more than a tier holds", s, pages, o.tokensPerPage())
		}
		if pages > 0 && !o.prefixCache {
			return nil, badFlag("host-tier-tokens", "the host tier keeps the prefix cache's pages, which -prefix-cache off turns off")
		}
		if !slices.Contains(o.tierPages, int(pages)) {
			o.tierPages = append(o.tierPages, int(pages))
		}
	}
	switch {
	case o.tierCkpts < 0:
		return nil, badFlag("host-tier-checkpoints", "%d, want ≥ 0 (0: the device pool's ratio)", o.tierCkpts)
	case set["host-tier-checkpoints"] && !o.model.Hybrid():
		return nil, badFlag("host-tier-checkpoints", "sizes the state checkpoints of a hybrid model's host tier, and %s",
			map[bool]string{true: "-model " + *model + " has no state group", false: "no -model is given"}[*model != ""])
	case set["host-tier-checkpoints"] && slices.Max(o.tierPages) == 0:
		return nil, badFlag("host-tier-checkpoints", "sizes the state checkpoints of the host tier, and -host-tier-tokens gives none")
	}
	if *reportGeometry != "" {
		g, err := parseGeometry(*reportGeometry, o.tokensPerPage())
		if err != nil {
			return nil, badFlag("report-geometry", "%v", err)
		}
		o.reportGeometry = &g
	}
	if !slices.Contains(kvsim.TraceFormats, o.traceFormat) {
		return nil, badFlag("trace-format", "unknown format %q (want %s)", o.traceFormat, strings.Join(kvsim.TraceFormats, ", "))
	}
	if o.bandwidth, err = parseBandwidth(*bw); err != nil {
		return nil, badFlag("device-bandwidth", "%v", err)
	}
	switch o.device {
	case "host", "cuda":
	default:
		return nil, badFlag("device", "unknown device %q (want host or cuda)", o.device)
	}
	checks := []struct {
		name string
		ok   bool
		msg  string
	}{
		{"duration", o.duration > 0, "want > 0"},
		{"step", o.step > 0, "want > 0"},
		{"rate", o.rate > 0 && o.rate <= 1e6, "want (0, 1e6] requests/s"},
		{"tenants", o.tenants >= 1 && o.tenants <= 255, "want 1..255"},
		{"org-size", o.orgSize >= 1 && o.orgSize <= 255, "want 1..255 tenants"},
		{"prefill-tokens", o.prefillTokens >= 0, "want ≥ 0 tokens per step (0: no limit)"},
		{"overlong", o.overlong >= 0 && o.overlong < 1, "want a share in [0, 1)"},
		{"abort", o.abort >= 0 && o.abort < 1, "want a share in [0, 1)"},
		{"max-context", o.maxContext >= 1, "want ≥ 1 token"},
		{"max-batch", o.maxBatch >= 1, "want ≥ 1"},
		{"queue-timeout", o.queueTimeout > 0, "want > 0"},
		{"trace-tenants", o.traceTenants >= 1 && o.traceTenants <= 255, "want 1..255"},
		{"progress-interval", o.progressEvery >= 0, "want ≥ 0 (0: no progress lines)"},
	}
	for _, c := range checks {
		if !c.ok {
			return nil, badFlag(c.name, "%s", c.msg)
		}
	}
	if o.duration/o.step > 10_000_000 {
		return nil, badFlag("duration", "%v is more than 10M steps of %v", o.duration, o.step)
	}
	return o, nil
}

// tierCheckpoints is the state checkpoints a hybrid model's host tier of
// tier pages keeps under a pool of pages pages: -host-tier-checkpoints,
// else the pool's checkpoint room per page (its checkpoint slots, or its
// leases' slots when it has none, at most MaxCheckpoints) times the
// tier's pages, rounded up: the tier holds a checkpoint for as many of
// its pages as the device does. 0 without a tier or a hybrid model.
func (o *options) tierCheckpoints(pages, tier int) int {
	m := o.model
	switch {
	case tier == 0 || !m.Hybrid():
		return 0
	case o.tierCkpts > 0:
		return o.tierCkpts
	}
	room := m.CheckpointSlots
	if room == 0 {
		room = m.MaxLeases
	}
	if m.MaxCheckpoints > 0 {
		room = min(room, m.MaxCheckpoints)
	}
	n := (int64(tier)*int64(room) + int64(pages) - 1) / int64(pages)
	return int(min(max(n, 1), math.MaxInt32))
}

// tokensPerPage is the pools' page size: the model's, or -page-tokens.
func (o *options) tokensPerPage() int {
	if o.model != nil {
		return o.model.Spec.TokensPerPage()
	}
	return o.geometry.TokensPerPage
}

// parseTokens reads a token count: an integer with an optional k, M, G
// (powers of 1000) or Ki, Mi, Gi (powers of 1024) suffix.
func parseTokens(s string) (int64, error) {
	t := strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"k", 1e3}, {"K", 1e3}, {"M", 1e6}, {"G", 1e9}} {
		if rest, ok := strings.CutSuffix(t, u.suffix); ok {
			t, mult = rest, u.mult
			break
		}
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n < 1 || n > math.MaxInt64/mult {
		return 0, fmt.Errorf("%q is not a positive token count (e.g. 3M, 262144, 256Ki)", s)
	}
	return n * mult, nil
}

// parseGeometry reads a model's KV geometry as
// layers=L,kv-heads=H,head-dim=D,dtype=T, every key given once, at
// tokensPerPage tokens per page.
func parseGeometry(s string, tokensPerPage int) (kvcache.Geometry, error) {
	g := kvcache.Geometry{TokensPerPage: tokensPerPage}
	ints := map[string]*int{"layers": &g.Layers, "kv-heads": &g.KVHeads, "head-dim": &g.HeadDim}
	seen := map[string]bool{}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		switch {
		case !ok:
			return g, fmt.Errorf("%q is not key=value (keys: layers, kv-heads, head-dim, dtype)", kv)
		case seen[k]:
			return g, fmt.Errorf("%s given twice", k)
		}
		seen[k] = true
		if k == "dtype" {
			dt, err := isolation.ParseDType(v)
			if err != nil {
				return g, fmt.Errorf("unknown dtype %q (want fp8_e4m3, fp8_e5m2, fp16, bf16, fp32)", v)
			}
			g.DType = dt
			continue
		}
		p, known := ints[k]
		if !known {
			return g, fmt.Errorf("unknown key %q (keys: layers, kv-heads, head-dim, dtype)", k)
		}
		n, err := strconv.Atoi(v)
		if err != nil {
			return g, fmt.Errorf("%s=%q is not an integer", k, v)
		}
		*p = n
	}
	for _, k := range []string{"layers", "kv-heads", "head-dim", "dtype"} {
		if !seen[k] {
			return g, fmt.Errorf("%s missing (give layers, kv-heads, head-dim and dtype)", k)
		}
	}
	if err := g.Validate(); err != nil {
		return g, err
	}
	return g, nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// parseBandwidth reads bytes per second: a number with an optional K, M,
// G, T (powers of 1000) or Ki, Mi, Gi, Ti (powers of 1024) prefix, an
// optional B and an optional /s.
func parseBandwidth(s string) (float64, error) {
	if s == "" {
		return 0, nil
	}
	t := strings.TrimSuffix(strings.TrimSpace(s), "/s")
	t = strings.TrimSuffix(t, "B")
	mult := 1.0
	for _, u := range []struct {
		suffix string
		mult   float64
	}{{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"Ti", 1 << 40},
		{"K", 1e3}, {"k", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12}} {
		if rest, ok := strings.CutSuffix(t, u.suffix); ok {
			t, mult = rest, u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(t), 64)
	if err != nil || !(v > 0) || math.IsInf(v, 0) {
		return 0, fmt.Errorf("%q is not a bandwidth in bytes/s (e.g. 4TB/s, 900GB/s, 3.2e12)", s)
	}
	return v * mult, nil
}

func usage(fs *flag.FlagSet) {
	w := fs.Output()
	fmt.Fprint(w, `Usage: kvbench [flags]

kvbench replays a multi-tenant serving workload (synthetic, or a trace)
against kvfence pools on a virtual clock with continuous batching,
once per scrub policy, pool size, sharing-domain layout and lease sizing,
and reports admissions per second, admission latency percentiles, pages
and bytes scrubbed, the share of run time spent filling, pool
utilisation over time, refusals by reason, the prefix cache's hit rate
and prefill avoided (-domains per-tenant,shared compares the layouts),
time to first token, requests running at once, the share of held pages
holding KV, growth and preemptions (-sizing full,on-demand compares
full reservation with leases that grow), and the isolation audit. Each policy is compared with the UNSAFE "none"
baseline, which skips the fills. It prints a table and writes report.json
and PNG plots (hit rate against pool size with the trace's bound, queue
length, utilisation, admission latency CDF, scrub bandwidth per batch
size) into -out. Traces: kvbench's JSONL, Mooncake's JSONL (prompts as
chains of hashed 512-token blocks) or Azure's CSV (below).

Flags:
`)
	fs.PrintDefaults()
	fmt.Fprintf(w, `
Exit status: 0 success; 1 a run failed (pool or device error, or a safe
policy failed its isolation audit) or a plot could not be written
(report.json is written before the plots, so it is there all the same);
2 bad input (unknown flag or flag value,
bad trace line: the message names the line and field).

-model PRESET runs pools of a model's caches: its miniature (one layer of
each cache group, fewer bytes per page) is allocated, and every byte
figure is the model's. A hybrid model (a state group: glm-5.3-flash,
qwen3-next-80b-a3b) shares a prefix only with a state checkpoint at its
end: the engine ends prefill chunks on page boundaries and checkpoints
there and at the last page boundary before each prompt's last token. Its
report adds a table of state checkpoints: the hit rate beside the same
trace replayed on the per-token pages alone (one more run per pool,
layout and sizing), checkpoint hits and misses, checkpoints taken,
evicted and skipped, the state memory they held at the model's size, and
the pool's state copies (host memcpy of the miniature's slots; a plain
memcpy of one slot of the model's size is printed as reference). Size
the state with -max-leases, -checkpoint-slots, -max-checkpoints and
-state-shrink.

-device cuda runs on GPU 0 through the driver (libcuda.so.1); without one
it exits 1 naming the driver's error. The engine's KV writes are then not
simulated, and the audit reads pages back from the device.

%s

%s
`, kvsim.TraceFormat, kvsim.ImportFormat)
}

func run(args []string, stdout, stderr io.Writer, stderrIsTerminal bool) int {
	o, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		var ue *usageError
		if errors.As(err, &ue) {
			fmt.Fprintf(stderr, "kvbench: %v\n", err)
		} // the flag package has already printed its own errors
		return exitBadInput
	}
	if err := bench(o, args, stdout, stderr, stderrIsTerminal); err != nil {
		fmt.Fprintf(stderr, "kvbench: %v\n", err)
		var ue *usageError
		if errors.As(err, &ue) || errors.Is(err, kvsim.ErrBadTrace) || errors.Is(err, kvsim.ErrBadConfig) {
			return exitBadInput
		}
		return exitFailure
	}
	return exitOK
}

// openDevice returns a constructor for the device of one run.
func openDevice(name string) (func() (cudaops.Device, error), error) {
	switch name {
	case "host":
		return func() (cudaops.Device, error) { return cudaops.NewHost(), nil }, nil
	case "cuda":
		return func() (cudaops.Device, error) {
			d, err := cudaops.OpenCUDA(0)
			if err != nil {
				return nil, fmt.Errorf("-device cuda: %w", err)
			}
			return d, nil
		}, nil
	}
	return nil, badFlag("device", "unknown device %q", name)
}

func bench(o *options, args []string, stdout, stderr io.Writer, tty bool) error {
	open, err := openDevice(o.device)
	if err != nil {
		return err
	}
	minPool := o.poolPages[0]
	maxPool := o.poolPages[0]
	for _, n := range o.poolPages {
		minPool, maxPool = min(minPool, n), max(maxPool, n)
	}
	capTokens := minPool * o.tokensPerPage()

	var tr *kvsim.Trace
	source, format := "synthetic", "synthetic"
	var seed *uint64
	if o.trace != "" {
		source = o.trace
		if tr, format, err = readTrace(o.trace, o.traceFormat, kvsim.ImportConfig{Tenants: o.traceTenants, OrgSize: o.orgSize}); err != nil {
			return err
		}
		if !o.durationSet {
			o.duration = tr.Duration() + time.Minute
		}
	} else {
		if o.traceTenants > 1 {
			return badFlag("trace-tenants", "spreads an imported trace (-trace) over tenants; the synthetic workload has -tenants")
		}
		tr, err = kvsim.Generate(kvsim.GenConfig{Seed: o.seed, Duration: o.duration, Rate: o.rate, Tenants: o.tenants, OrgSize: o.orgSize,
			OverlongFraction: o.overlong, AbortFraction: o.abort, CapacityTokens: capTokens,
			MaxContext: o.maxContext, TokensPerPage: o.tokensPerPage()})
		if err != nil {
			return err
		}
		seed = &o.seed
	}
	if o.budget == kvsim.BudgetWindow {
		tr = tr.WithWindowBudgets(o.maxContext)
	}
	if contains(o.domains, kvsim.DomainsShared) && !namesDomains(tr) {
		fmt.Fprintln(stdout, "kvbench: note: the trace's tenants name no domain, so -domains shared is per-tenant")
	}
	if o.emitTrace != "" {
		if err := writeTrace(o.emitTrace, tr); err != nil {
			return err
		}
	}

	dir, err := outDir(o.out)
	if err != nil {
		return err
	}
	if o.out == "" {
		fmt.Fprintf(stdout, "kvbench: writing into %s\n", dir)
	}
	cacheState := "off"
	if o.prefixCache {
		cacheState = "on"
	}
	maxTier, tiers := slices.Max(o.tierPages), ""
	if maxTier > 0 {
		tiers = fmt.Sprintf(", host tiers of %v pages", o.tierPages)
	}
	hostPool, maxTierCkpts := int64(maxPool+maxTier)*o.geometry.PageBytes(), 0
	for _, pages := range o.poolPages {
		for _, tier := range o.tierPages {
			maxTierCkpts = max(maxTierCkpts, o.tierCheckpoints(pages, tier))
		}
	}
	if maxTierCkpts > 0 {
		tiers += fmt.Sprintf(" and up to %d state checkpoints", maxTierCkpts)
	}
	if m := o.model; m != nil {
		hostPool = m.Miniature.BytesFor(maxPool+maxTier, m.MaxLeases+m.CheckpointSlots+maxTierCkpts)
	}
	fmt.Fprintf(stdout, "kvbench: %d requests, %v of serving, policies %s, pools of %v pages%s (up to %s of host memory), prefix cache %s, domains %s, sizing %s, %s budgets\n",
		len(tr.Requests), o.duration, strings.Join(o.policies, ","), o.poolPages, tiers,
		kvsim.FormatBytes(float64(hostPool)), cacheState, strings.Join(o.domains, ","),
		strings.Join(o.sizings, ","), o.budget)

	rep := &kvsim.Report{Tool: "kvbench", Version: kvsim.ReportVersion, Started: time.Now().UTC(), Args: args,
		Machine: kvsim.ThisMachine(), Workload: kvsim.SummarizeWorkload(tr, source, capTokens, o.maxContext),
		Geometry: kvsim.ReportGeometry(o.geometry), MaxContext: o.maxContext, Step: o.step.Seconds(),
		MaxBatch: o.maxBatch, DeviceBandwidth: o.bandwidth, PrefixCache: cacheState, Domains: o.domains,
		PrefillTokens: o.prefillTokens, Sizings: o.sizings, Budget: o.budget}
	if contains(o.sizings, kvsim.SizingOnDemand) {
		rep.HeadroomTokens, rep.GrowthWatermark = o.headroom, o.watermark
	}
	rep.Workload.Seed, rep.Workload.Format = seed, format
	if o.reportGeometry != nil {
		g := kvsim.ReportGeometry(*o.reportGeometry)
		rep.ReportGeometry = &g
	}
	if o.model != nil {
		g := kvsim.ModelReport(o.model.Spec, o.tokensPerPage())
		rep.ReportGeometry = &g
		rep.Model = kvsim.DescribeModel(o.model, o.stateShrink)
		if rep.Model.Hybrid {
			rep.Model.SlotCopyNs = kvsim.HostCopyNs(rep.Model.SlotBytes, 5)
			debug.FreeOSMemory()
		}
	}
	if o.prefixCache {
		for _, d := range o.domains {
			rep.Workload.PrefixBounds = append(rep.Workload.PrefixBounds, kvsim.Bound(tr, o.tokensPerPage(), o.maxContext, d))
		}
	}

	steps := int64((o.duration + o.step - 1) / o.step)
	// A hybrid model's runs are compared with the same trace on its
	// per-token pages alone: one more run per pool, layout and sizing.
	perTokenOnly := o.model.Hybrid() && o.prefixCache
	runs := len(o.poolPages) * len(o.tierPages) * len(o.domains) * len(o.sizings)
	if perTokenOnly {
		runs *= len(o.policies) + 1
	} else {
		runs *= len(o.policies)
	}
	var bar *progressbar.ProgressBar
	var lines *progressLines
	switch {
	case tty:
		bar = progressbar.NewOptions64(steps*int64(runs),
			progressbar.OptionSetWriter(stderr), progressbar.OptionSetDescription("kvbench"),
			progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish(),
			progressbar.OptionShowElapsedTimeOnFinish(), progressbar.OptionSetPredictTime(true))
	case o.progressEvery > 0:
		lines = &progressLines{w: stderr, every: o.progressEvery, last: time.Now(), runs: runs}
	}
	var auditErr error
	for _, pages := range o.poolPages {
		for _, tier := range o.tierPages {
			pool := fmt.Sprintf("%dp", pages)
			if tier > 0 {
				pool = fmt.Sprintf("%dp+%dt", pages, tier)
			}
			for _, domains := range o.domains {
				for _, sizing := range o.sizings {
					progress := func(cfg *kvsim.RunConfig, label string) {
						if len(o.sizings) > 1 {
							label += "/" + sizing
						}
						switch {
						case bar != nil:
							bar.Describe(label)
							cfg.Progress = func(kvsim.Progress) { _ = bar.Add(1) }
						case lines != nil:
							lines.run++
							lines.label = label
							cfg.Progress = lines.update
						}
					}
					base := kvsim.RunConfig{ReportGeometry: o.reportGeometry, PoolPages: pages, MaxContext: o.maxContext,
						Step: o.step, MaxBatch: o.maxBatch, QueueTimeout: o.queueTimeout, Duration: o.duration,
						Audit: o.audit, WriteKV: o.writeKV, OpenDevice: open, PrefixCache: o.prefixCache,
						Domains: domains, Seed: o.seed, PrefillTokens: o.prefillTokens, Sizing: sizing, HostTierPages: tier,
						HostTierCheckpoints: o.tierCheckpoints(pages, tier)}
					if o.model != nil {
						base.Model = o.model
					} else {
						base.Geometry = o.geometry
					}
					if sizing == kvsim.SizingOnDemand {
						base.HeadroomTokens, base.GrowthWatermark = o.headroom, o.watermark
					}
					var perToken *kvsim.PerTokenFigures
					if perTokenOnly {
						// Hits depend on neither the policy nor the KV
						// written: one run, the first policy's, no writes.
						cfg := base
						m := *o.model
						m.PerTokenOnly = true
						cfg.Model, cfg.Policy, cfg.Audit, cfg.WriteKV = &m, o.policies[0], false, false
						cfg.HostTierCheckpoints = 0 // its pages alone: no state to keep
						progress(&cfg, fmt.Sprintf("per-token only/%s/%s", pool, domains))
						res, err := kvsim.Run(tr, cfg)
						if err != nil {
							return fmt.Errorf("per-token-only run, pool of %d pages, %s domains, %s sizing: %w", pages, domains, sizing, err)
						}
						perToken = kvsim.PerTokenFiguresOf(res)
						debug.FreeOSMemory()
					}
					for _, policy := range o.policies {
						cfg := base
						cfg.Policy = policy
						progress(&cfg, fmt.Sprintf("%s/%s/%s", policy, pool, domains))
						res, err := kvsim.Run(tr, cfg)
						switch {
						case errors.Is(err, kvsim.ErrAuditFailed) && res != nil:
							auditErr = errors.Join(auditErr, err)
						case err != nil:
							return fmt.Errorf("policy %s, pool of %d pages, host tier of %d, %s domains, %s sizing: %w", policy, pages, tier, domains, sizing, err)
						}
						if res.Checkpoints != nil {
							res.Checkpoints.PerTokenOnly = perToken
						}
						rep.Runs = append(rep.Runs, res)
						debug.FreeOSMemory() // the next pool allocates afresh
					}
				}
			}
		}
	}
	if bar != nil {
		_ = bar.Finish()
	}
	kvsim.CompareWithBaseline(rep.Runs, o.bandwidth)
	rep.DomainComparison = kvsim.CompareDomains(rep.Runs)
	rep.SizingComparison = kvsim.CompareSizings(rep.Runs)

	// The report is written before the plots, so that a plot that cannot
	// be drawn never costs the figures, and written again once the plots
	// are, to list them (and any plot that failed).
	jsonPath := filepath.Join(dir, "report.json")
	rep.Plots = []string{}
	if err := writeReport(jsonPath, rep); err != nil {
		return err
	}
	fmt.Fprintln(stdout)
	rep.WriteTable(stdout)
	plots, plotErr := kvsim.WritePlots(dir, rep.Runs)
	for _, p := range plots {
		rep.Plots = append(rep.Plots, filepath.Base(p))
	}
	if plotErr != nil {
		rep.PlotErrors = strings.Split(plotErr.Error(), "\n")
	}
	if err := writeReport(jsonPath, rep); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\nwrote %s\n", strings.Join(append([]string{jsonPath}, plots...), ", "))
	if plotErr != nil {
		return errors.Join(fmt.Errorf("%w (%s is written)", plotErr, jsonPath), auditErr)
	}
	return auditErr
}

// writeReport writes rep to path through a temporary file renamed into
// place, so that a failed write never leaves a truncated report, nor
// replaces one written before.
func writeReport(path string, rep *kvsim.Report) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if err := rep.WriteJSON(f); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	// CreateTemp makes the file private to its owner; a report is not.
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return os.Rename(f.Name(), path)
}

func namesDomains(tr *kvsim.Trace) bool {
	for _, t := range tr.Tenants {
		if t.Domain != "" {
			return true
		}
	}
	return false
}

func readTrace(path, format string, ic kvsim.ImportConfig) (*kvsim.Trace, string, error) {
	if path == "-" {
		return kvsim.ReadTrace(os.Stdin, "stdin", format, ic)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, "", &usageError{fmt.Sprintf("flag -trace: %v", err)}
	}
	defer f.Close()
	return kvsim.ReadTrace(f, path, format, ic)
}

// progressLines prints a line of progress every so often, for a stderr
// that is not a terminal (a log, a CI job), where a progress bar would be
// a stream of carriage returns.
type progressLines struct {
	w         io.Writer
	every     time.Duration
	last      time.Time
	run, runs int
	label     string
}

func (p *progressLines) update(pr kvsim.Progress) {
	// One clock read per step is a few tens of nanoseconds; a step costs
	// microseconds.
	now := time.Now()
	if now.Sub(p.last) < p.every {
		return
	}
	p.last = now
	fmt.Fprintf(p.w, "kvbench: run %d/%d %s: %d of %d requests done, %.1f of %.1f s simulated, %d queued, %d running, %d refusals\n",
		p.run, p.runs, p.label, pr.Done, pr.Requests, pr.Now.Seconds(), pr.Duration.Seconds(), pr.Queued, pr.Running, pr.Refusals)
}

func writeTrace(path string, tr *kvsim.Trace) error {
	f, err := os.Create(path)
	if err != nil {
		return &usageError{fmt.Sprintf("flag -emit-trace: %v", err)}
	}
	if err := kvsim.WriteTrace(f, tr); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// outDir creates the output directory: the one given, or a new
// kvbench-<time>-* directory in the working directory.
func outDir(dir string) (string, error) {
	if dir == "" {
		dir, err := os.MkdirTemp(".", "kvbench-"+time.Now().Format("20060102-150405")+"-")
		return filepath.Clean(dir), err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", &usageError{fmt.Sprintf("flag -out: %v", err)}
	}
	return dir, nil
}

// presetNames lists the model presets for -model's help.
func presetNames() string {
	var names []string
	for _, p := range kvcache.Presets() {
		names = append(names, p.Name)
	}
	return strings.Join(names, ", ")
}
