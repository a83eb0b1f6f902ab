// Command kvbench replays a multi-tenant serving workload against kvfence
// pools and reports what scrubbing costs and what the isolation audit saw.
//
// It simulates an inference engine with continuous batching on a virtual
// clock: requests arrive (from a synthetic generator or a JSONL trace),
// are admitted by a kvfence pool (or refused, with the reason counted),
// compute their prompts within a per-step prefill budget (skipping the
// prefix shared from kvfence's prefix cache and publishing the prompt for
// later requests of their sharing domain), write one token's KV per
// decode step, and release their pages when they finish or their client
// aborts. The kvfence calls and the KV writes run for real, on the chosen
// device, and are timed; the engine's compute is not simulated. The same
// trace is replayed once per scrub policy, pool size and sharing-domain
// layout, and each policy is compared with the unsafe "none" baseline,
// which skips the fills.
//
//	go run ./bench/cmd/kvbench -duration 5s -out DIR
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
	trace, emitTrace, out        string
	seed                         uint64
	rate, overlong, abort        float64
	tenants, orgSize             int
	prefixCache                  bool
	domains                      []string
	prefillTokens                int
	policies                     []string
	poolPages                    []int
	maxContext, maxBatch         int
	geometry                     kvcache.Geometry
	audit, writeKV               bool
	device                       string
	bandwidth                    float64
	durationSet                  bool
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("kvbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.DurationVar(&o.duration, "duration", 30*time.Second, "virtual serving time to replay (synthetic arrivals span it; with -trace, default: last arrival + 1m)")
	fs.StringVar(&o.trace, "trace", "", "replay this JSONL trace (\"-\" for stdin) instead of the synthetic workload")
	fs.StringVar(&o.emitTrace, "emit-trace", "", "also write the replayed workload as a JSONL trace to this file")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the synthetic workload (same seed, same workload)")
	fs.Float64Var(&o.rate, "rate", 10, "synthetic mean arrivals per second (Poisson)")
	fs.IntVar(&o.tenants, "tenants", 8, "synthetic tenants (Zipf popularity; the last has a quota of 1/4 of the pool)")
	fs.IntVar(&o.orgSize, "org-size", 4, "synthetic tenants per organisation: they share a system prompt and, with -domains shared, a sharing domain (1: every tenant alone)")
	prefixCache := fs.String("prefix-cache", "on", "prefix caching: on (requests carry token IDs, hits skip prefill, prompts are published after prefill) or off")
	domains := fs.String("domains", kvsim.DomainsPerTenant, "sharing-domain layouts to compare, comma-separated: per-tenant (one domain per tenant), shared (the trace's or the organisations' domains)")
	fs.IntVar(&o.prefillTokens, "prefill-tokens", 8192, "engine prefill budget in tokens per step, shared by running prompts (0: no limit)")
	fs.Float64Var(&o.overlong, "overlong", 0.02, "synthetic share of requests longer than the pool or the context window")
	fs.Float64Var(&o.abort, "abort", 0.05, "synthetic share of requests aborted by their client")
	policies := fs.String("policies", strings.Join(kvsim.Policies, ","), "scrub policies to compare: zero, poison, canary, none (none = UNSAFE baseline that skips fills)")
	pools := fs.String("pool-pages", "8192", "pool sizes in pages to compare, comma-separated")
	fs.IntVar(&o.maxContext, "max-context", 262144, "engine context window in tokens")
	fs.IntVar(&o.geometry.TokensPerPage, "page-tokens", 16, "tokens per page")
	fs.IntVar(&o.geometry.Layers, "layers", 4, "model layers (regions = 2 × layers)")
	fs.IntVar(&o.geometry.KVHeads, "kv-heads", 4, "KV heads")
	fs.IntVar(&o.geometry.HeadDim, "head-dim", 64, "head dimension")
	dtype := fs.String("dtype", "fp16", "KV dtype: fp8_e4m3, fp8_e5m2, fp16, bf16, fp32")
	fs.DurationVar(&o.step, "step", 20*time.Millisecond, "virtual time of one decode step")
	fs.IntVar(&o.maxBatch, "max-batch", 256, "most requests running at once")
	fs.DurationVar(&o.queueTimeout, "queue-timeout", 30*time.Second, "virtual time a request waits for pages before it is dropped")
	fs.BoolVar(&o.audit, "audit", false, "check every reused page before the engine writes it (marker check; canary policy also verifies in the pool)")
	fs.BoolVar(&o.writeKV, "write-kv", true, "simulate the engine's KV writes into the pages (needed for the audit to see stale KV)")
	fs.StringVar(&o.device, "device", "host", "device backend: host or cuda")
	bw := fs.String("device-bandwidth", "", "device fill bandwidth (e.g. 4TB/s, 900GB/s, 3.2e12) to estimate device fill time per second of serving")
	fs.StringVar(&o.out, "out", "", "directory for report.json and the plots (default: a new ./kvbench-* directory)")
	fs.Usage = func() { usage(fs) }
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, &usageError{fmt.Sprintf("unexpected argument %q (flags only; see -help)", fs.Arg(0))}
	}
	fs.Visit(func(f *flag.Flag) { o.durationSet = o.durationSet || f.Name == "duration" })

	for _, p := range strings.Split(*policies, ",") {
		p = strings.TrimSpace(p)
		if _, _, err := kvsim.ParsePolicy(p); err != nil {
			return nil, badFlag("policies", "unknown policy %q (want %s)", p, strings.Join(kvsim.Policies, ", "))
		}
		if !contains(o.policies, p) {
			o.policies = append(o.policies, p)
		}
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
	for _, s := range strings.Split(*pools, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return nil, badFlag("pool-pages", "%q is not a positive page count", s)
		}
		o.poolPages = append(o.poolPages, n)
	}
	var err error
	if o.geometry.DType, err = isolation.ParseDType(*dtype); err != nil {
		return nil, badFlag("dtype", "unknown dtype %q (want fp8_e4m3, fp8_e5m2, fp16, bf16, fp32)", *dtype)
	}
	if err := o.geometry.Validate(); err != nil {
		return nil, &usageError{fmt.Sprintf("flags -page-tokens/-layers/-kv-heads/-head-dim/-dtype: %v", err)}
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

kvbench replays a multi-tenant serving workload (synthetic, or a JSONL
trace) against kvfence pools on a virtual clock with continuous batching,
once per scrub policy, pool size and sharing-domain layout, and reports
admissions per second, admission latency percentiles, pages and bytes
scrubbed, the share of run time spent filling, pool utilisation over
time, refusals by reason, the prefix cache's hit rate and prefill avoided
(-domains per-tenant,shared compares the layouts), time to first token,
and the isolation audit. Each policy is compared with the UNSAFE "none"
baseline, which skips the fills. It prints a table and writes report.json
and PNG plots (utilisation, admission latency CDF, scrub bandwidth per
batch size) into -out.

Flags:
`)
	fs.PrintDefaults()
	fmt.Fprintf(w, `
Exit status: 0 success; 1 a run failed (pool or device error, or a safe
policy failed its isolation audit) or a plot could not be written
(report.json is written before the plots, so it is there all the same);
2 bad input (unknown flag or flag value,
bad trace line: the message names the line and field).

-device cuda runs on GPU 0 through the driver (libcuda.so.1); without one
it exits 1 naming the driver's error. The engine's KV writes are then not
simulated, and the audit reads pages back from the device.

%s
`, kvsim.TraceFormat)
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
	capTokens := minPool * o.geometry.TokensPerPage

	var tr *kvsim.Trace
	source := "synthetic"
	var seed *uint64
	if o.trace != "" {
		source = o.trace
		if tr, err = readTrace(o.trace); err != nil {
			return err
		}
		if !o.durationSet {
			o.duration = tr.Duration() + time.Minute
		}
	} else {
		tr, err = kvsim.Generate(kvsim.GenConfig{Seed: o.seed, Duration: o.duration, Rate: o.rate, Tenants: o.tenants, OrgSize: o.orgSize,
			OverlongFraction: o.overlong, AbortFraction: o.abort, CapacityTokens: capTokens,
			MaxContext: o.maxContext, TokensPerPage: o.geometry.TokensPerPage})
		if err != nil {
			return err
		}
		seed = &o.seed
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
	fmt.Fprintf(stdout, "kvbench: %d requests, %v of serving, policies %s, pools of %v pages (up to %s of host memory), prefix cache %s, domains %s\n",
		len(tr.Requests), o.duration, strings.Join(o.policies, ","), o.poolPages,
		kvsim.FormatBytes(float64(int64(maxPool)*o.geometry.PageBytes())), cacheState, strings.Join(o.domains, ","))

	rep := &kvsim.Report{Tool: "kvbench", Version: kvsim.ReportVersion, Started: time.Now().UTC(), Args: args,
		Machine: kvsim.ThisMachine(), Workload: kvsim.SummarizeWorkload(tr, source, capTokens, o.maxContext),
		Geometry: kvsim.ReportGeometry(o.geometry), MaxContext: o.maxContext, Step: o.step.Seconds(),
		MaxBatch: o.maxBatch, DeviceBandwidth: o.bandwidth, PrefixCache: cacheState, Domains: o.domains,
		PrefillTokens: o.prefillTokens}
	rep.Workload.Seed = seed

	steps := int64((o.duration + o.step - 1) / o.step)
	var bar *progressbar.ProgressBar
	if tty {
		bar = progressbar.NewOptions64(steps*int64(len(o.policies)*len(o.poolPages)*len(o.domains)),
			progressbar.OptionSetWriter(stderr), progressbar.OptionSetDescription("kvbench"),
			progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish(),
			progressbar.OptionShowElapsedTimeOnFinish(), progressbar.OptionSetPredictTime(true))
	}
	var auditErr error
	for _, pages := range o.poolPages {
		for _, domains := range o.domains {
			for _, policy := range o.policies {
				cfg := kvsim.RunConfig{Geometry: o.geometry, PoolPages: pages, MaxContext: o.maxContext, Policy: policy,
					Step: o.step, MaxBatch: o.maxBatch, QueueTimeout: o.queueTimeout, Duration: o.duration,
					Audit: o.audit, WriteKV: o.writeKV, OpenDevice: open, PrefixCache: o.prefixCache,
					Domains: domains, Seed: o.seed, PrefillTokens: o.prefillTokens}
				if bar != nil {
					bar.Describe(fmt.Sprintf("%s/%dp/%s", policy, pages, domains))
					cfg.Progress = func(kvsim.Progress) { _ = bar.Add(1) }
				}
				res, err := kvsim.Run(tr, cfg)
				switch {
				case errors.Is(err, kvsim.ErrAuditFailed) && res != nil:
					auditErr = errors.Join(auditErr, err)
				case err != nil:
					return fmt.Errorf("policy %s, pool of %d pages, %s domains: %w", policy, pages, domains, err)
				}
				rep.Runs = append(rep.Runs, res)
				debug.FreeOSMemory() // the next pool allocates afresh
			}
		}
	}
	if bar != nil {
		_ = bar.Finish()
	}
	kvsim.CompareWithBaseline(rep.Runs, o.bandwidth)
	rep.DomainComparison = kvsim.CompareDomains(rep.Runs)

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

func readTrace(path string) (*kvsim.Trace, error) {
	if path == "-" {
		return kvsim.ParseTrace(os.Stdin, "stdin")
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, &usageError{fmt.Sprintf("flag -trace: %v", err)}
	}
	defer f.Close()
	return kvsim.ParseTrace(f, path)
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
