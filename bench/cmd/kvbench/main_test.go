package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvfence/kvfence/bench/internal/kvsim"
	"github.com/kvfence/kvfence/kvcache"
)

// small keeps test runs to a few MiB and well under a second each.
var small = []string{"-layers", "2", "-kv-heads", "1", "-head-dim", "16", "-pool-pages", "1024", "-max-context", "8192",
	"-rate", "20", "-step", "5ms"}

func runKvbench(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(args, &out, &errOut, false)
	return code, out.String(), errOut.String()
}

func TestEndToEnd(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "out")
	trace := filepath.Join(t.TempDir(), "trace.jsonl")
	args := append([]string{"-duration", "2s", "-out", dir, "-audit", "-device-bandwidth", "4TB/s", "-emit-trace", trace}, small...)
	code, stdout, stderr := runKvbench(t, args...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.NotContains(t, stderr, "\r", "no progress bar when stderr is not a terminal")
	for _, want := range []string{"policy", "zero", "poison", "canary", "none (UNSAFE)", "GPU fill/s", "prefix cache (", "hit rate", "prefill avoided",
		"audit none: FAILED", "audit zero: passed"} {
		assert.Contains(t, stdout, want)
	}

	raw, err := os.ReadFile(filepath.Join(dir, "report.json"))
	require.NoError(t, err)
	var rep struct {
		Tool  string
		Runs  []map[string]any
		Plots []string
	}
	require.NoError(t, json.Unmarshal(raw, &rep))
	assert.Equal(t, "kvbench", rep.Tool)
	require.Len(t, rep.Runs, 4)
	for _, r := range rep.Runs {
		assert.Contains(t, r, "admit_latency")
		assert.Contains(t, r, "scrub_bytes_per_kv_byte_written")
		px, ok := r["prefix_cache"].(map[string]any)
		require.True(t, ok, "prefix_cache in every run")
		assert.Equal(t, true, px["enabled"])
		assert.Contains(t, px, "hit_rate")
		assert.Contains(t, px, "prefill_bytes_avoided")
		assert.Equal(t, "per-tenant", r["domains"])
		if r["policy"] != "none" {
			assert.NotNil(t, r["vs_baseline"], "%s compared with the baseline", r["policy"])
		}
	}
	require.GreaterOrEqual(t, len(rep.Plots), 2)
	for _, p := range rep.Plots {
		b, err := os.ReadFile(filepath.Join(dir, p))
		require.NoError(t, err)
		assert.True(t, bytes.HasPrefix(b, []byte("\x89PNG\r\n\x1a\n")), "%s is a PNG", p)
	}

	// The emitted trace replays to the same workload.
	code, stdout2, stderr := runKvbench(t, append([]string{"-trace", trace, "-duration", "2s", "-out", dir, "-policies", "zero"}, small...)...)
	require.Equal(t, 0, code, stderr)
	firstLine := func(s string) string {
		_, after, _ := strings.Cut(s, "workload: ")
		l, _, _ := strings.Cut(after, "\n")
		_, rest, _ := strings.Cut(l, ",") // drop the source
		return rest
	}
	assert.Equal(t, firstLine(stdout), firstLine(stdout2))
}

// -domains per-tenant,shared replays the trace with both layouts and
// compares them; organisations share system prompts, so shared domains
// hit more.
func TestDomainComparison(t *testing.T) {
	dir := t.TempDir()
	args := append([]string{"-duration", "2s", "-out", dir, "-audit", "-policies", "zero,none", "-domains", "per-tenant,shared"}, small...)
	code, stdout, stderr := runKvbench(t, args...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	for _, want := range []string{"zero/per-tenant", "zero/shared", "none/shared", "shared vs per-tenant domains (1024 pages, zero): hit rate",
		"audit zero/shared: passed", "audit none/shared: FAILED"} {
		assert.Contains(t, stdout, want)
	}
	raw, err := os.ReadFile(filepath.Join(dir, "report.json"))
	require.NoError(t, err)
	var rep struct {
		Domains          []string
		DomainComparison []struct {
			Policy              string
			PerTenant           prefixFigures `json:"per_tenant"`
			Shared              prefixFigures
			PrefillAvoidedRatio float64 `json:"prefill_avoided_ratio"`
		} `json:"domain_comparison"`
		Runs []struct {
			Domains    string
			VsBaseline map[string]any `json:"vs_baseline"`
		}
	}
	require.NoError(t, json.Unmarshal(raw, &rep))
	assert.Equal(t, []string{"per-tenant", "shared"}, rep.Domains)
	require.Len(t, rep.Runs, 4)
	assert.NotNil(t, rep.Runs[0].VsBaseline, "zero/per-tenant against none/per-tenant")
	require.Len(t, rep.DomainComparison, 2, "zero and none")
	c := rep.DomainComparison[0]
	assert.Equal(t, "zero", c.Policy)
	assert.Greater(t, c.Shared.HitRate, c.PerTenant.HitRate)
	assert.Greater(t, c.Shared.PrefillBytesAvoided, c.PerTenant.PrefillBytesAvoided)
	assert.InDelta(t, float64(c.Shared.PrefillBytesAvoided)/float64(c.PerTenant.PrefillBytesAvoided), c.PrefillAvoidedRatio, 1e-9)
}

// -sizing full,on-demand replays the same trace with both sizings and
// compares them; with window budgets (-budget window) full leases hold
// the whole context window each, so on-demand runs more requests at once
// and uses more of what it holds. Each policy is compared with the
// baseline of its own sizing.
func TestSizingComparison(t *testing.T) {
	dir := t.TempDir()
	args := append([]string{"-duration", "2s", "-out", dir, "-audit", "-policies", "zero,none", "-sizing", "full,on-demand",
		"-headroom", "32", "-watermark", "0.02", "-budget", "window"}, small...)
	code, stdout, stderr := runKvbench(t, args...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	for _, want := range []string{"sizing full,on-demand, window budgets", "zero/full", "zero/on-demand", "none/on-demand (UNSAFE)",
		"on-demand headroom 32 tokens, growth watermark 0.02", "on-demand vs full sizing (1024 pages, per-tenant, zero): concurrent",
		"audit zero/on-demand: passed", "audit none/on-demand: FAILED"} {
		assert.Contains(t, stdout, want)
	}
	raw, err := os.ReadFile(filepath.Join(dir, "report.json"))
	require.NoError(t, err)
	var rep struct {
		Sizings          []string
		HeadroomTokens   int     `json:"headroom_tokens"`
		GrowthWatermark  float64 `json:"growth_watermark"`
		Budget           string
		SizingComparison []struct {
			Policy           string
			Full             sizingFigures
			OnDemand         sizingFigures `json:"on_demand"`
			ConcurrencyRatio float64       `json:"concurrency_ratio"`
		} `json:"sizing_comparison"`
		Runs []struct {
			Policy, Sizing  string
			HeadroomTokens  int            `json:"headroom_tokens"`
			GrowthWatermark float64        `json:"growth_watermark"`
			VsBaseline      map[string]any `json:"vs_baseline"`
			Growth          map[string]any
		}
	}
	require.NoError(t, json.Unmarshal(raw, &rep))
	assert.Equal(t, []string{"full", "on-demand"}, rep.Sizings)
	assert.Equal(t, 32, rep.HeadroomTokens)
	assert.InDelta(t, 0.02, rep.GrowthWatermark, 1e-12)
	assert.Equal(t, "window", rep.Budget)
	require.Len(t, rep.Runs, 4)
	for _, r := range rep.Runs {
		assert.Contains(t, r.Growth, "preempted")
		if r.Sizing == "full" {
			assert.Zero(t, r.HeadroomTokens, "full leases have no headroom")
			assert.Zero(t, r.GrowthWatermark, "nor keep pages for growth")
		} else {
			assert.Equal(t, 32, r.HeadroomTokens)
		}
		if r.Policy == "zero" {
			assert.NotNil(t, r.VsBaseline, "zero/%s against none/%s", r.Sizing, r.Sizing)
		}
	}
	require.Len(t, rep.SizingComparison, 2, "zero and none")
	c := rep.SizingComparison[0]
	assert.Equal(t, "zero", c.Policy)
	assert.Greater(t, c.OnDemand.ConcurrencyMean, c.Full.ConcurrencyMean)
	assert.Greater(t, c.OnDemand.KVUtilisation, c.Full.KVUtilisation)
	assert.InDelta(t, c.OnDemand.ConcurrencyMean/c.Full.ConcurrencyMean, c.ConcurrencyRatio, 1e-9)
}

type sizingFigures struct {
	ConcurrencyMean float64 `json:"concurrency_mean"`
	KVUtilisation   float64 `json:"kv_utilisation"`
}

type prefixFigures struct {
	HitRate             float64 `json:"hit_rate"`
	PrefillBytesAvoided uint64  `json:"prefill_bytes_avoided"`
}

func TestPrefixCacheOff(t *testing.T) {
	dir := t.TempDir()
	code, stdout, stderr := runKvbench(t, append([]string{"-duration", "1s", "-out", dir, "-policies", "zero", "-prefix-cache", "off"}, small...)...)
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, stdout, "prefix cache: off")
}

func TestDefaultOutDir(t *testing.T) {
	t.Chdir(t.TempDir())
	code, stdout, stderr := runKvbench(t, append([]string{"-duration", "200ms", "-policies", "zero"}, small...)...)
	require.Equal(t, 0, code, stderr)
	matches, err := filepath.Glob("kvbench-*")
	require.NoError(t, err)
	require.Len(t, matches, 1)
	assert.Contains(t, stdout, "writing into "+matches[0])
	assert.FileExists(t, filepath.Join(matches[0], "report.json"))
}

// readReport reads dir/report.json.
func readReport(t *testing.T, dir string) (rep struct {
	Runs []struct {
		Policy   string
		Admitted uint64
	}
	Plots      []string
	PlotErrors []string `json:"plot_errors"`
}) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, "report.json"))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &rep))
	return rep
}

// A trace of which no request is admitted (every one is longer than the
// context window) has no admission latency and no fill to plot. kvbench
// panicked in the plot code (exit status 2, no report.json, a 0-byte
// PNG); it must write everything, the plots saying there is no data.
func TestNothingAdmitted(t *testing.T) {
	dir := t.TempDir()
	trace := filepath.Join(t.TempDir(), "too-long.jsonl")
	require.NoError(t, os.WriteFile(trace, []byte(`{"type":"tenant","name":"a"}`+"\n"+
		`{"type":"request","at":0,"tenant":"a","prompt":100000,"output":1}`+"\n"), 0o644))
	code, stdout, stderr := runKvbench(t, append([]string{"-trace", trace, "-duration", "200ms", "-out", dir}, small...)...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.Contains(t, stdout, "wrote "+filepath.Join(dir, "report.json"))
	rep := readReport(t, dir)
	require.Len(t, rep.Runs, 4)
	for _, r := range rep.Runs {
		assert.Zero(t, r.Admitted, r.Policy)
	}
	assert.Empty(t, rep.PlotErrors)
	assert.Equal(t, []string{"hit-rate.png", "queue.png", "utilisation.png", "admission-latency-cdf.png", "scrub-bandwidth.png"}, rep.Plots)
	for _, p := range rep.Plots {
		b, err := os.ReadFile(filepath.Join(dir, p))
		require.NoError(t, err)
		assert.True(t, bytes.HasPrefix(b, []byte("\x89PNG\r\n\x1a\n")), "%s is a PNG (%d bytes)", p, len(b))
	}
}

// A plot that cannot be written is an error (exit status 1) that names
// it, not a panic, and the report is written all the same, saying which
// plot is missing.
func TestPlotFailureKeepsReport(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.Mkdir(filepath.Join(dir, "utilisation.png"), 0o755)) // in the plot's way
	code, stdout, stderr := runKvbench(t, append([]string{"-duration", "200ms", "-policies", "zero", "-out", dir}, small...)...)
	require.Equal(t, 1, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.Contains(t, stderr, "plot utilisation.png")
	assert.Contains(t, stderr, "report.json is written")
	rep := readReport(t, dir)
	require.Len(t, rep.Runs, 1)
	assert.Equal(t, []string{"hit-rate.png", "queue.png", "admission-latency-cdf.png", "scrub-bandwidth.png"}, rep.Plots)
	require.Len(t, rep.PlotErrors, 1)
	assert.Contains(t, rep.PlotErrors[0], "utilisation.png")
}

func TestBadInput(t *testing.T) {
	dir := t.TempDir()
	header := `{"type":"tenant","name":"acme"}` + "\n"
	traces := map[string]string{
		"malformed":      header + `{"type":"request","at":0,` + "\n",
		"negative":       header + `{"type":"request","at":0,"tenant":"acme","prompt":10,"output":-3}` + "\n",
		"unknown-tenant": header + "\n" + `{"type":"request","at":0,"tenant":"zed","prompt":10,"output":3}` + "\n",
		"bad-domain":     header + `{"type":"tenant","name":"b","domain":"tenant:acme"}` + "\n",
		"bad-prefix-id":  header + `{"type":"request","at":0,"tenant":"acme","prompt":10,"prefix_id":"sys","output":3}` + "\n",
		"no-requests":    "# a workload to come\n" + header,
		"empty":          "",
		"prose":          "hello\n",
		"bad-mooncake": `{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}` + "\n" +
			`{"timestamp": 1, "input_length": 1000, "output_length": 1, "hash_ids": [0]}` + "\n",
		"bad-azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.0,-2,44\n",
	}
	for name, body := range traces {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
	}
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{"malformed trace line", []string{"-trace", filepath.Join(dir, "malformed")}, []string{"malformed:2:", "malformed JSON"}},
		{"negative length", []string{"-trace", filepath.Join(dir, "negative")}, []string{"negative:2:", `field "output"`, "negative"}},
		{"unknown tenant", []string{"-trace", filepath.Join(dir, "unknown-tenant")}, []string{"unknown-tenant:3:", `field "tenant"`, `"zed"`}},
		{"reserved domain", []string{"-trace", filepath.Join(dir, "bad-domain")}, []string{"bad-domain:2:", `field "domain"`, "reserved"}},
		{"prefix_id without prefix", []string{"-trace", filepath.Join(dir, "bad-prefix-id")}, []string{"bad-prefix-id:2:", `field "prefix_id"`, "no prefix"}},
		{"trace without requests", []string{"-trace", filepath.Join(dir, "no-requests")}, []string{filepath.Join(dir, "no-requests") + ": no requests"}},
		{"empty trace file", []string{"-trace", filepath.Join(dir, "empty")}, []string{filepath.Join(dir, "empty") + ": no requests"}},
		{"unknown prefix-cache value", []string{"-prefix-cache", "maybe"}, []string{"flag -prefix-cache", `"maybe"`}},
		{"unknown domains layout", []string{"-domains", "per-tenant,global"}, []string{"flag -domains", `"global"`}},
		{"domains compared without cache", []string{"-domains", "per-tenant,shared", "-prefix-cache", "off"}, []string{"flag -domains", "-prefix-cache off"}},
		{"bad org size", []string{"-org-size", "0"}, []string{"flag -org-size"}},
		{"negative prefill budget", []string{"-prefill-tokens", "-1"}, []string{"flag -prefill-tokens"}},
		{"missing trace file", []string{"-trace", filepath.Join(dir, "nope")}, []string{"flag -trace", "no such file"}},
		{"unknown policy", []string{"-policies", "zero,bleach"}, []string{"flag -policies", `"bleach"`}},
		{"unknown dtype", []string{"-dtype", "fp7"}, []string{"flag -dtype", `"fp7"`}},
		{"unknown device", []string{"-device", "tpu"}, []string{"flag -device", `"tpu"`}},
		{"bad pool size", []string{"-pool-pages", "64,-1"}, []string{"flag -pool-pages", `"-1"`}},
		{"bad bandwidth", []string{"-device-bandwidth", "fast"}, []string{"flag -device-bandwidth", `"fast"`}},
		{"bad rate", []string{"-rate", "0"}, []string{"flag -rate"}},
		{"bad share", []string{"-overlong", "1.5"}, []string{"flag -overlong"}},
		{"bad geometry", []string{"-head-dim", "0"}, []string{"HeadDim = 0"}},
		{"unknown flag", []string{"-nope"}, []string{"flag provided but not defined: -nope"}},
		{"malformed flag value", []string{"-duration", "soon"}, []string{`invalid value "soon" for flag -duration`}},
		{"stray argument", []string{"trace.jsonl"}, []string{`unexpected argument "trace.jsonl"`}},
		{"unknown trace format", []string{"-trace-format", "parquet"}, []string{"flag -trace-format", `"parquet"`}},
		{"no tenants", []string{"-trace-tenants", "0"}, []string{"flag -trace-tenants", "1..255"}},
		{"too many tenants", []string{"-trace-tenants", "256"}, []string{"flag -trace-tenants"}},
		{"tenants spread on the synthetic workload", []string{"-trace-tenants", "2"}, []string{"flag -trace-tenants", "-tenants"}},
		{"tenants spread on a kvbench trace", []string{"-trace", filepath.Join(dir, "negative"), "-trace-tenants", "2", "-trace-format", "kvbench"},
			[]string{"declares its own tenants"}},
		{"bad pool tokens", []string{"-pool-tokens", "3M,lots"}, []string{"flag -pool-tokens", `"lots"`}},
		{"pool tokens and pages", []string{"-pool-tokens", "3M", "-pool-pages", "64"}, []string{"flag -pool-tokens", "not both"}},
		{"bad tier tokens", []string{"-host-tier-tokens", "0,lots"}, []string{"flag -host-tier-tokens", `"lots"`}},
		{"tier without cache", []string{"-host-tier-tokens", "1M", "-prefix-cache", "off"}, []string{"flag -host-tier-tokens", "-prefix-cache off"}},
		{"report geometry not key=value", []string{"-report-geometry", "llama"}, []string{"flag -report-geometry", "not key=value"}},
		{"report geometry key missing", []string{"-report-geometry", "layers=32,kv-heads=8,head-dim=128"}, []string{"flag -report-geometry", "dtype missing"}},
		{"report geometry unknown key", []string{"-report-geometry", "layers=32,heads=8"}, []string{"flag -report-geometry", `unknown key "heads"`}},
		{"report geometry bad dtype", []string{"-report-geometry", "layers=32,kv-heads=8,head-dim=128,dtype=fp4"}, []string{"flag -report-geometry", `"fp4"`}},
		{"report geometry invalid", []string{"-report-geometry", "layers=0,kv-heads=8,head-dim=128,dtype=bf16"}, []string{"flag -report-geometry", "Layers = 0"}},
		{"negative progress interval", []string{"-progress-interval", "-1s"}, []string{"flag -progress-interval"}},
		{"unknown sizing", []string{"-sizing", "full,lazy"}, []string{"flag -sizing", `"lazy"`, "full, on-demand"}},
		{"negative headroom", []string{"-sizing", "on-demand", "-headroom", "-1"}, []string{"flag -headroom", "-1 tokens", "0..1073741824"}},
		{"headroom too large", []string{"-sizing", "on-demand", "-headroom", "1073741825"}, []string{"flag -headroom", "0..1073741824"}},
		{"malformed headroom", []string{"-sizing", "on-demand", "-headroom", "lots"}, []string{`invalid value "lots" for flag -headroom`}},
		{"headroom without on-demand", []string{"-headroom", "16"}, []string{"flag -headroom", "-sizing full has none"}},
		{"watermark above the max", []string{"-sizing", "full,on-demand", "-watermark", "0.6"}, []string{"flag -watermark", "0.6", "0..0.5"}},
		{"negative watermark", []string{"-sizing", "on-demand", "-watermark", "-0.01"}, []string{"flag -watermark", "0..0.5"}},
		{"NaN watermark", []string{"-sizing", "on-demand", "-watermark", "NaN"}, []string{"flag -watermark", "NaN"}},
		{"watermark without on-demand", []string{"-watermark", "0.05"}, []string{"flag -watermark", "-sizing full has none"}},
		{"unknown budget", []string{"-budget", "infinite"}, []string{"flag -budget", `"infinite"`, "trace, window"}},
		{"undetectable trace", []string{"-trace", filepath.Join(dir, "prose")}, []string{"prose:1:", "cannot tell the trace format"}},
		{"bad Mooncake line", []string{"-trace", filepath.Join(dir, "bad-mooncake")}, []string{"bad-mooncake:2:", `field "hash_ids"`, "want 2"}},
		{"bad Azure row", []string{"-trace", filepath.Join(dir, "bad-azure")}, []string{"bad-azure:3:", `field "ContextTokens"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := runKvbench(t, append(tt.args, "-out", filepath.Join(dir, "out"))...)
			assert.Equal(t, 2, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
			for _, w := range tt.want {
				assert.Contains(t, stderr, w)
			}
		})
	}
}

// mooncakeTrace writes a Mooncake trace of n requests, one every 200 ms:
// every request starts with block 0 (a shared system prompt), odd ones
// continue the conversation of the request before them (its chain and one
// block more), even ones start a new one.
func mooncakeTrace(t *testing.T, n int) string {
	t.Helper()
	var b strings.Builder
	next := int64(1)
	var prev []int64
	for i := range n {
		ids := []int64{0}
		if i%2 == 1 {
			ids = append(slices.Clone(prev), next)
		} else {
			ids = append(ids, next)
		}
		next++
		prev = ids
		raw, err := json.Marshal(map[string]any{"timestamp": 200 * i, "input_length": 512*len(ids) - 100, "output_length": 5 + i%7, "hash_ids": ids})
		require.NoError(t, err)
		b.Write(raw)
		b.WriteByte('\n')
	}
	path := filepath.Join(t.TempDir(), "mooncake.jsonl")
	require.NoError(t, os.WriteFile(path, []byte(b.String()), 0o644))
	return path
}

// report is the part of report.json these tests read.
type report struct {
	Workload struct {
		Format       string
		BlockTokens  int `json:"block_tokens"`
		Requests     int
		Tenants      int
		PrefixBounds []struct {
			Domains string
			HitRate float64 `json:"hit_rate"`
		} `json:"prefix_bounds"`
	}
	ReportGeometry *struct {
		PageBytes int64 `json:"page_bytes"`
	} `json:"report_geometry"`
	Model *struct {
		Hybrid bool
	}
	Runs []struct {
		Policy, Domains string
		PoolPages       int               `json:"pool_pages"`
		PoolTokens      int               `json:"pool_tokens"`
		PoolBytes       int64             `json:"pool_bytes"`
		HostPoolBytes   int64             `json:"host_pool_bytes"`
		BytesScrubbed   uint64            `json:"bytes_scrubbed"`
		HostScrubbed    uint64            `json:"host_bytes_scrubbed"`
		Admitted        uint64            `json:"admitted"`
		Refusals        map[string]uint64 `json:"refusals"`
		Dropped         map[string]uint64 `json:"dropped"`
		Checkpoints     *struct {
			Hits           uint64
			PeakStateBytes int64   `json:"peak_state_bytes"`
			SlotBytes      int64   `json:"slot_bytes"`
			CopyNs         float64 `json:"copy_ns_per_checkpoint"`
			ModelCopyNs    float64 `json:"model_copy_ns_estimate"`
			PerTokenOnly   *struct {
				HitRate float64 `json:"hit_rate"`
			} `json:"per_token_only"`
		}
		Prefix struct {
			HitRate     float64 `json:"hit_rate"`
			HitTokens   uint64  `json:"hit_tokens"`
			HitPages    uint64  `json:"hit_pages"`
			LookupPages uint64  `json:"lookup_pages"`
			Bound       struct {
				HitRate  float64 `json:"hit_rate"`
				HitPages uint64  `json:"hit_pages"`
			}
		} `json:"prefix_cache"`
	}
	Plots      []string
	PlotErrors []string `json:"plot_errors"`
}

func readFullReport(t *testing.T, dir string) report {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, "report.json"))
	require.NoError(t, err)
	var rep report
	require.NoError(t, json.Unmarshal(raw, &rep))
	return rep
}

// A Mooncake trace is detected, replayed with its block chains, spread
// over tenants and domains, and reported with its bound; written back in
// kvbench's format (-emit-trace) it replays to the same hits.
func TestMooncakeTrace(t *testing.T) {
	trace := mooncakeTrace(t, 40)
	dir, emitted := t.TempDir(), filepath.Join(t.TempDir(), "emitted.jsonl")
	args := append([]string{"-trace", trace, "-out", dir, "-policies", "zero", "-trace-tenants", "4", "-org-size", "2",
		"-domains", "per-tenant,shared", "-emit-trace", emitted, "-audit"}, small...)
	code, stdout, stderr := runKvbench(t, args...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	for _, want := range []string{"(mooncake, blocks of 512 tokens)", "40 requests from 4 tenants", "infinite-cache hit rate (the trace's bound): ",
		"hit rate  bound  served", "audit zero/shared: passed"} {
		assert.Contains(t, stdout, want)
	}
	rep := readFullReport(t, dir)
	assert.Equal(t, "mooncake", rep.Workload.Format)
	assert.Equal(t, 512, rep.Workload.BlockTokens)
	require.Len(t, rep.Workload.PrefixBounds, 2)
	require.Len(t, rep.Runs, 2)
	for i, r := range rep.Runs {
		assert.EqualValues(t, 40, r.Admitted)
		px := r.Prefix
		assert.Positive(t, px.Bound.HitRate)
		assert.InDelta(t, rep.Workload.PrefixBounds[i].HitRate, px.Bound.HitRate, 1e-12, "the pool takes every request")
		assert.LessOrEqual(t, px.HitPages, px.Bound.HitPages)
		assert.Positive(t, px.HitPages)
	}
	perTenant, shared := rep.Runs[0].Prefix, rep.Runs[1].Prefix
	assert.Greater(t, shared.Bound.HitRate, perTenant.Bound.HitRate, "block 0 is shared across tenants only in shared domains")
	assert.Len(t, rep.Plots, 5)

	code, stdout2, stderr := runKvbench(t, append([]string{"-trace", emitted, "-out", t.TempDir(), "-policies", "zero",
		"-domains", "per-tenant,shared"}, small...)...)
	require.Equal(t, 0, code, stderr)
	assert.Contains(t, stdout2, "(kvbench, blocks of 512 tokens)")
	prefixRows := func(s string) string {
		_, table, _ := strings.Cut(s, "hit rate  bound  served")
		rows, _, _ := strings.Cut(table, "shared vs per-tenant")
		var hits []string
		for _, l := range strings.Split(rows, "\n") {
			if f := strings.Fields(l); len(f) > 6 {
				hits = append(hits, strings.Join(f[:7], " ")) // through hit tokens; the hashing time varies
			}
		}
		return strings.Join(hits, "\n")
	}
	assert.Equal(t, prefixRows(stdout), prefixRows(stdout2))
}

func TestAzureTrace(t *testing.T) {
	path := filepath.Join(t.TempDir(), "azure.csv")
	var b strings.Builder
	b.WriteString("TIMESTAMP,ContextTokens,GeneratedTokens\n")
	for i := range 30 {
		fmt.Fprintf(&b, "2023-11-16 18:15:%02d.%07d,%d,%d\n", 10+i, 123*i, 100+37*i, 10+i)
	}
	require.NoError(t, os.WriteFile(path, []byte(b.String()), 0o644))
	dir := t.TempDir()
	code, stdout, stderr := runKvbench(t, append([]string{"-trace", path, "-out", dir, "-policies", "zero"}, small...)...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.Contains(t, stdout, "(azure), 30 requests from 1 tenants over 29.0s")
	rep := readFullReport(t, dir)
	assert.Equal(t, "azure", rep.Workload.Format)
	require.Len(t, rep.Runs, 1)
	assert.EqualValues(t, 30, rep.Runs[0].Admitted)
	assert.Zero(t, rep.Runs[0].Prefix.Bound.HitRate, "no prefix information: every prompt is unique")
	assert.Zero(t, rep.Runs[0].Prefix.HitPages)
}

// The incident's shape: every request is longer than the context window
// (1,048,576 tokens) on a pool of 681,280 tokens. The replay runs to the
// end, refuses every request for good with its reason, hashes none of the
// prompts, and writes every plot (saying there is no data where there is
// none).
func TestIncidentTrace(t *testing.T) {
	const n = 200
	var b strings.Builder
	b.WriteString(`{"type":"tenant","name":"a"}` + "\n" + `{"type":"tenant","name":"b"}` + "\n")
	for i := range n {
		fmt.Fprintf(&b, `{"type":"request","at":%g,"tenant":"%s","prompt":%d,"output":%d}`+"\n", 0.05*float64(i), []string{"a", "b"}[i%2],
			1048576+1000*i, 1+i%50)
	}
	path := filepath.Join(t.TempDir(), "incident.jsonl")
	require.NoError(t, os.WriteFile(path, []byte(b.String()), 0o644))
	dir := t.TempDir()
	code, stdout, stderr := runKvbench(t, "-trace", path, "-out", dir, "-max-context", "1048576", "-pool-tokens", "681280",
		"-layers", "1", "-kv-heads", "1", "-head-dim", "2", "-audit")
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	rep := readFullReport(t, dir)
	require.Len(t, rep.Runs, 4)
	for _, r := range rep.Runs {
		assert.Zero(t, r.Admitted, r.Policy)
		assert.Equal(t, map[string]uint64{"exceeds_max_context": n}, r.Refusals, "%s: every request refused, by reason", r.Policy)
		assert.EqualValues(t, n, r.Dropped["exceeds_max_context"], r.Policy)
		assert.Zero(t, r.Prefix.LookupPages)
	}
	assert.Contains(t, stdout, "refused:exceeds_max_context")
	assert.Contains(t, stdout, "hashed") // the prefix table is there, with nothing hashed
	assert.Empty(t, rep.PlotErrors)
	assert.Equal(t, []string{"hit-rate.png", "queue.png", "utilisation.png", "admission-latency-cdf.png", "scrub-bandwidth.png"}, rep.Plots)
	for _, p := range rep.Plots {
		raw, err := os.ReadFile(filepath.Join(dir, p))
		require.NoError(t, err)
		assert.True(t, bytes.HasPrefix(raw, []byte("\x89PNG\r\n\x1a\n")), "%s is a PNG", p)
	}
}

// When stderr is not a terminal, progress is a line every
// -progress-interval, naming the run, the requests done, the simulated
// time and the refusals; never a bar's carriage returns.
func TestProgressLines(t *testing.T) {
	code, _, stderr := runKvbench(t, append([]string{"-duration", "1s", "-policies", "zero,none", "-out", t.TempDir(), "-progress-interval", "1ns"}, small...)...)
	require.Equal(t, 0, code, stderr)
	assert.NotContains(t, stderr, "\r")
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	require.Greater(t, len(lines), 10, "a line per step at this interval")
	for _, l := range lines {
		require.Regexp(t, `^kvbench: run [12]/2 (zero|none)/1024p/per-tenant: \d+ of \d+ requests done, [0-9.]+ of 1\.0 s simulated, \d+ queued, \d+ running, \d+ refusals$`, l)
	}
	assert.Contains(t, stderr, "run 2/2 none/1024p/per-tenant")
}

// -report-geometry reports bytes at the model's size; the pool allocated
// stays the small one. (And -progress-interval 0 prints no progress.)
func TestReportGeometry(t *testing.T) {
	dir := t.TempDir()
	code, stdout, stderr := runKvbench(t, append([]string{"-duration", "1s", "-policies", "zero", "-out", dir,
		"-report-geometry", "layers=32,kv-heads=8,head-dim=128,dtype=bf16", "-progress-interval", "0"}, small...)...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.Empty(t, stderr, "-progress-interval 0: no progress lines")
	assert.Contains(t, stdout, "bytes reported at 32 layers × 8 KV heads × 128 dim bf16: 2.0 MiB/page, 128.0 KiB/token")
	rep := readFullReport(t, dir)
	require.NotNil(t, rep.ReportGeometry)
	const modelPage = 16 * 32 * 2 * 8 * 128 * 2 // tokens × layers × K,V × heads × dim × bytes
	const hostPage = 16 * 2 * 2 * 1 * 16 * 2    // -layers 2 -kv-heads 1 -head-dim 16, fp16
	assert.EqualValues(t, modelPage, rep.ReportGeometry.PageBytes)
	r := rep.Runs[0]
	assert.EqualValues(t, 1024*modelPage, r.PoolBytes)
	assert.EqualValues(t, 1024*hostPage, r.HostPoolBytes, "allocated at the small geometry")
	assert.Positive(t, r.HostScrubbed)
	assert.EqualValues(t, r.HostScrubbed/hostPage*modelPage, r.BytesScrubbed)
}

func TestParseTokens(t *testing.T) {
	for in, want := range map[string]int64{"3M": 3_000_000, "262144": 262144, "256Ki": 262144, "1Mi": 1 << 20, "50M": 50_000_000, " 2k ": 2000, "1G": 1e9} {
		got, err := parseTokens(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "0", "-3M", "3.5M", "lots", "9999999999999999999G"} {
		_, err := parseTokens(in)
		assert.Error(t, err, in)
	}
}

func TestCUDAWithoutDriver(t *testing.T) {
	code, _, stderr := runKvbench(t, "-device", "cuda", "-duration", "200ms", "-out", t.TempDir())
	if code == 0 {
		t.Skip("a CUDA device is present")
	}
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "no usable device")
}

func TestHelp(t *testing.T) {
	code, _, stderr := runKvbench(t, "-help")
	assert.Equal(t, 0, code)
	for _, want := range []string{"Usage: kvbench", "-policies", "Exit status", "Trace format (JSONL)", "abort_after", "-prefix-cache", "-domains", "prefix_id",
		"block_tokens", "Imported traces", "hash_ids", "ContextTokens", "-trace-tenants", "-report-geometry", "-pool-tokens", "-progress-interval", "-host-tier-tokens"} {
		assert.Contains(t, stderr, want)
	}
}

func TestParseBandwidth(t *testing.T) {
	tests := []struct {
		in   string
		want float64
		ok   bool
	}{
		{"", 0, true},
		{"4TB/s", 4e12, true},
		{"900GB/s", 9e11, true},
		{"3.2e12", 3.2e12, true},
		{"1GiB/s", 1 << 30, true},
		{"500M", 5e8, true},
		{"fast", 0, false},
		{"-1GB/s", 0, false},
		{"0", 0, false},
		{"Inf", 0, false},
	}
	for _, tt := range tests {
		got, err := parseBandwidth(tt.in)
		if !tt.ok {
			assert.Error(t, err, tt.in)
			continue
		}
		require.NoError(t, err, tt.in)
		assert.InDelta(t, tt.want, got, tt.want*1e-12, tt.in)
	}
}

// -model runs pools of a preset's miniature and reports bytes at the
// model's size; flags of another layout, unknown presets, and state flags
// without a state group are refused.
func TestModelPreset(t *testing.T) {
	noGeometry := []string{"-pool-pages", "1024", "-max-context", "8192", "-rate", "20", "-step", "5ms"}
	dir := t.TempDir()
	code, stdout, stderr := runKvbench(t, append([]string{"-duration", "1s", "-policies", "zero", "-out", dir,
		"-model", "deepseek-v3", "-progress-interval", "0"}, noGeometry...)...)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	spec, err := kvcache.Preset("deepseek-v3")
	require.NoError(t, err)
	assert.Contains(t, stdout, "model: deepseek-v3, groups kv (per_token, 61 regions), 64 tokens/page")
	assert.Contains(t, stdout, "the pools are its miniature")
	rep := readFullReport(t, dir)
	require.NotNil(t, rep.Model)
	assert.False(t, rep.Model.Hybrid)
	require.NotNil(t, rep.ReportGeometry)
	assert.EqualValues(t, spec.PageBytes(), rep.ReportGeometry.PageBytes)
	assert.EqualValues(t, 1024*spec.PageBytes(), rep.Runs[0].PoolBytes)
	assert.EqualValues(t, 1024*64, rep.Runs[0].PoolTokens, "the model's pages of 64 tokens")
	assert.Nil(t, rep.Runs[0].Checkpoints)
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"-model", "gpt-5"}, "-model"},
		{[]string{"-model", "glm-5", "-report-geometry", "layers=32,kv-heads=8,head-dim=128,dtype=bf16"}, "-report-geometry"},
		{[]string{"-model", "glm-5", "-layers", "2"}, "-layers"},
		{[]string{"-model", "qwen3-next-80b-a3b", "-page-tokens", "32"}, "-page-tokens"},
		{[]string{"-model", "gpt-oss-120b"}, "-model"}, // a sliding window the engine does not slide
		{[]string{"-max-leases", "4"}, "-max-leases"},
		{[]string{"-model", "llama-3.1-8b", "-checkpoint-slots", "4"}, "-checkpoint-slots"},
		{[]string{"-model", "glm-5.3-flash", "-state-shrink", "0"}, "-state-shrink"},
		{[]string{"-model", "glm-5.3-flash", "-max-leases", "-1"}, "-max-leases"},
		{[]string{"-model", "glm-5.3-flash", "-host-tier-tokens", "1M", "-host-tier-checkpoints", "-1"}, "-host-tier-checkpoints"},
		{[]string{"-model", "glm-5.3-flash", "-host-tier-checkpoints", "4"}, "-host-tier-checkpoints"}, // no tier
		{[]string{"-model", "llama-3.1-8b", "-host-tier-tokens", "1M", "-host-tier-checkpoints", "4"}, "-host-tier-checkpoints"},
		{[]string{"-host-tier-tokens", "1M", "-host-tier-checkpoints", "4"}, "-host-tier-checkpoints"},
	} {
		code, _, stderr := runKvbench(t, append(tc.args, noGeometry...)...)
		assert.Equal(t, 2, code, "%v", tc.args)
		assert.Contains(t, stderr, "flag "+tc.flag, "%v", tc.args)
	}
}

// A hybrid model replays a Mooncake trace with state checkpoints: the
// report gives its hits against the same trace on its per-token pages
// alone, the checkpoints' memory at the model's size and their copies.
func TestHybridModel(t *testing.T) {
	var trace strings.Builder
	next := 1
	chain := []string{}
	for i := range 24 { // conversations of two turns, every one opening with block 0
		if i%2 == 0 {
			chain = []string{"0"}
		}
		chain = append(chain, strconv.Itoa(next))
		next++
		fmt.Fprintf(&trace, "{\"timestamp\": %d, \"input_length\": %d, \"output_length\": 4, \"hash_ids\": [%s]}\n",
			200*i, 512*len(chain)-100, strings.Join(chain, ", "))
	}
	path := filepath.Join(t.TempDir(), "mooncake.jsonl")
	require.NoError(t, os.WriteFile(path, []byte(trace.String()), 0o644))
	dir := t.TempDir()
	code, stdout, stderr := runKvbench(t, "-trace", path, "-model", "qwen3-next-80b-a3b", "-state-shrink", "64",
		"-pool-tokens", "64k", "-max-leases", "8", "-checkpoint-slots", "32", "-policies", "zero,none", "-audit",
		"-prefill-tokens", "512", "-out", dir, "-progress-interval", "0")
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.Contains(t, stdout, "state slots for 8 leases and 32 checkpoints")
	assert.Contains(t, stdout, "one layer's state ÷ 64")
	assert.Contains(t, stdout, "state checkpoints (hit rate")
	assert.Contains(t, stdout, "audit zero: passed")
	rep := readFullReport(t, dir)
	require.NotNil(t, rep.Model)
	assert.True(t, rep.Model.Hybrid)
	require.Len(t, rep.Runs, 2, "the per-token-only run is not one of the runs")
	for _, r := range rep.Runs {
		c := r.Checkpoints
		require.NotNil(t, c, r.Policy)
		require.NotNil(t, c.PerTokenOnly, r.Policy)
		assert.Positive(t, c.Hits, r.Policy)
		assert.Positive(t, c.PerTokenOnly.HitRate, r.Policy)
		assert.LessOrEqual(t, r.Prefix.HitRate, c.PerTokenOnly.HitRate, r.Policy)
		assert.Positive(t, c.PeakStateBytes, r.Policy)
		assert.Zero(t, c.PeakStateBytes%c.SlotBytes, "whole checkpoints of the model's size")
		assert.Positive(t, c.CopyNs, r.Policy)
		assert.Positive(t, c.ModelCopyNs, r.Policy)
	}
	assert.Equal(t, rep.Runs[0].Checkpoints.PerTokenOnly, rep.Runs[1].Checkpoints.PerTokenOnly, "one per-token-only run for both policies")
	assert.Equal(t, rep.Runs[0].Prefix.HitTokens, rep.Runs[1].Prefix.HitTokens, "hits do not depend on the policy")
}

// twoTurnTrace is a Mooncake trace of 12 conversations whose second turns
// all come after every first turn: a small pool has evicted a
// conversation's pages and state checkpoint by its second turn.
func twoTurnTrace(t *testing.T) string {
	var trace strings.Builder
	for turn := range 2 {
		for i := range 12 {
			chain := []string{"0", strconv.Itoa(i + 1)}
			if turn == 1 {
				chain = append(chain, strconv.Itoa(100+i))
			}
			fmt.Fprintf(&trace, "{\"timestamp\": %d, \"input_length\": %d, \"output_length\": 4, \"hash_ids\": [%s]}\n",
				200*(12*turn+i), 512*len(chain)-100, strings.Join(chain, ", "))
		}
	}
	path := filepath.Join(t.TempDir(), "mooncake.jsonl")
	require.NoError(t, os.WriteFile(path, []byte(trace.String()), 0o644))
	return path
}

// A hybrid model's pool with a host tier (issue 32): the tier keeps the
// state checkpoints the device evicts, as many as the device pool's
// ratio gives it (2 checkpoint slots in 500 pages: 16 in a tier of 4,000),
// and the second turns restore them from there: the tier's run hits more
// than the pool alone, up to the trace's bound, and the report shows the
// tier's checkpoint figures.
func TestHybridModelHostTier(t *testing.T) {
	dir := t.TempDir()
	code, stdout, stderr := runKvbench(t, "-trace", twoTurnTrace(t), "-model", "qwen3-next-80b-a3b", "-state-shrink", "64",
		"-pool-tokens", "8k", "-host-tier-tokens", "0,64k", "-max-leases", "4", "-checkpoint-slots", "2", "-policies", "zero",
		"-audit", "-prefill-tokens", "512", "-out", dir, "-progress-interval", "0")
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	assert.Contains(t, stdout, "host tiers of [0 4000] pages and up to 16 state checkpoints")
	assert.Contains(t, stdout, "host tier, state checkpoints (slots")
	assert.Contains(t, stdout, "16 (1.2 GiB)", "16 checkpoints of 73.7 MiB at the model's size")
	assert.Contains(t, stdout, "audit zero+4000t: passed")
	rep := readKvsimReport(t, dir)
	require.Len(t, rep.Runs, 2)
	plain, tiered := rep.Runs[0], rep.Runs[1]
	require.Nil(t, plain.Tier)
	require.NotNil(t, tiered.Tier)
	assert.Equal(t, 16, tiered.HostTierCheckpoints)
	tc := tiered.Tier
	assert.Equal(t, 16, tc.CheckpointSlots)
	assert.Positive(t, tc.CheckpointsStored)
	assert.Positive(t, tc.CheckpointsRestored)
	assert.Greater(t, tiered.Prefix.HitRate, plain.Prefix.HitRate, "the second turns' checkpoints came back from the tier")
	assert.LessOrEqual(t, tiered.Prefix.HitRate, tiered.Prefix.Bound.HitRate)

	// -host-tier-checkpoints sets them.
	dir = t.TempDir()
	code, stdout, stderr = runKvbench(t, "-trace", twoTurnTrace(t), "-model", "qwen3-next-80b-a3b", "-state-shrink", "64",
		"-pool-tokens", "8k", "-host-tier-tokens", "64k", "-host-tier-checkpoints", "3", "-max-leases", "4", "-checkpoint-slots", "2",
		"-policies", "zero", "-prefill-tokens", "512", "-out", dir, "-progress-interval", "0")
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", stdout, stderr)
	rep = readKvsimReport(t, dir)
	require.Len(t, rep.Runs, 1)
	assert.Equal(t, 3, rep.Runs[0].HostTierCheckpoints)
	assert.Equal(t, 3, rep.Runs[0].Tier.CheckpointSlots)
}

// readKvsimReport reads dir's report.json whole.
func readKvsimReport(t *testing.T, dir string) kvsim.Report {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, "report.json"))
	require.NoError(t, err)
	var rep kvsim.Report
	require.NoError(t, json.Unmarshal(raw, &rep))
	return rep
}
