package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
	assert.Empty(t, stderr, "no progress bar when stderr is not a terminal")
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
	for _, want := range []string{"Usage: kvbench", "-policies", "Exit status", "Trace format (JSONL)", "abort_after", "-prefix-cache", "-domains", "prefix_id"} {
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
