package kvsim

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gonum.org/v1/plot"
)

var pngMagic = []byte("\x89PNG\r\n\x1a\n")

// requirePNGs checks that dir holds exactly the three plots, each a
// non-empty PNG, and nothing else (no temporary file left behind).
func requirePNGs(t *testing.T, dir string, paths []string) {
	t.Helper()
	require.Equal(t, []string{filepath.Join(dir, UtilisationPlot), filepath.Join(dir, LatencyCDFPlot), filepath.Join(dir, ScrubBWPlot)}, paths)
	for _, p := range paths {
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		assert.True(t, bytes.HasPrefix(b, pngMagic), "%s is a PNG (%d bytes)", p, len(b))
		fi, err := os.Stat(p)
		require.NoError(t, err)
		assert.Equal(t, os.FileMode(0o644), fi.Mode().Perm(), "%s readable by all, as os.Create would make it", p)
	}
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Len(t, entries, 3, "no temporary files left")
}

// A run in which no request was admitted has no latency and no fill to
// draw: the log axes have no range, which made gonum panic (exit status
// 2, a 0-byte PNG). The plots must say there is no data instead.
func TestWritePlotsNoData(t *testing.T) {
	samples := []UtilSample{{T: 0}, {T: 0.5}, {T: 1}}
	for name, runs := range map[string][]*RunResult{
		"nothing admitted": {
			{Policy: "zero", PoolPages: 64, Domains: DomainsPerTenant, Utilisation: samples},
			{Policy: "none", Unsafe: true, PoolPages: 64, Domains: DomainsPerTenant, Utilisation: samples},
		},
		"no samples": {{Policy: "zero", PoolPages: 64}},
		"no runs":    nil,
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			paths, err := WritePlots(dir, runs)
			require.NoError(t, err)
			requirePNGs(t, dir, paths)
		})
	}
}

// One admission, or fills all of one batch size, put all of a log axis's
// data at one value; gonum widens such a range to [x-1, x+1], which is
// not positive for x ≤ 1.
func TestWritePlotsSingleValue(t *testing.T) {
	runs := []*RunResult{{Policy: "zero", PoolPages: 64, Domains: DomainsPerTenant,
		Utilisation:  []UtilSample{{T: 0, InUse: 0.5}},
		Latencies:    []time.Duration{500 * time.Nanosecond},
		ScrubByBatch: []FillBucket{{Pages: 3, Fills: 3, GBps: 12}}}}
	dir := t.TempDir()
	paths, err := WritePlots(dir, runs)
	require.NoError(t, err)
	requirePNGs(t, dir, paths)
}

// A panic inside the plotting library is an error, and leaves no file
// behind: neither the PNG nor its temporary.
func TestSavePlotPanicIsError(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "bad.png")
	err := savePlot(path, func() (*plot.Plot, error) {
		p := plot.New()
		p.X.Scale, p.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{} // no data: a range of 0
		return p, nil
	})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "panicked")
	entries, rerr := os.ReadDir(dir)
	require.NoError(t, rerr)
	assert.Empty(t, entries)
}

// One plot that cannot be written does not stop the others.
func TestWritePlotsOneFails(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.Mkdir(filepath.Join(dir, LatencyCDFPlot), 0o755)) // the rename onto it fails
	paths, err := WritePlots(dir, []*RunResult{{Policy: "zero", Utilisation: []UtilSample{{T: 0}}}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), LatencyCDFPlot)
	assert.Equal(t, []string{filepath.Join(dir, UtilisationPlot), filepath.Join(dir, ScrubBWPlot)}, paths)
}
