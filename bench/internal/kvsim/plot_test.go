package kvsim

import (
	"bytes"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

var pngMagic = []byte("\x89PNG\r\n\x1a\n")

// requirePNGs checks that dir holds exactly the plots, each a non-empty
// PNG, and nothing else (no temporary file left behind).
func requirePNGs(t *testing.T, dir string, paths []string) {
	t.Helper()
	var want []string
	for _, f := range PlotFiles {
		want = append(want, filepath.Join(dir, f))
	}
	require.Equal(t, want, paths)
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
	assert.Len(t, entries, len(PlotFiles), "no temporary files left")
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
	err := savePlot(path, func() (*figure, error) {
		f := newFigure("bad", "x", "y")
		f.X.Scale, f.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{} // no data: a range of 0
		return f, nil
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
	assert.Equal(t, []string{filepath.Join(dir, HitRatePlot), filepath.Join(dir, QueuePlot), filepath.Join(dir, UtilisationPlot),
		filepath.Join(dir, ScrubBWPlot)}, paths)
}

// manyRuns is a report of five pool sizes × two layouts × four policies,
// with data in every plot.
func manyRuns() []*RunResult {
	var runs []*RunResult
	for i, pages := range []int{1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18} {
		for _, domains := range DomainModes {
			for _, policy := range Policies {
				r := &RunResult{Policy: policy, Unsafe: policy == Baseline, PoolPages: pages, PoolTokens: 16 * pages, Domains: domains,
					Latencies: []time.Duration{time.Duration(i+1) * time.Microsecond, time.Duration(i+2) * time.Millisecond}}
				r.Prefix.Enabled = true
				r.Prefix.LookupPages, r.Prefix.HitPages = 100, uint64(10*(i+1))
				r.Prefix.HitRate = float64(r.Prefix.HitPages) / 100
				r.Prefix.Bound = PrefixBound{Domains: domains, HitRate: 0.6}
				r.Prefix.ServedBound = r.Prefix.Bound
				for s := range 20 {
					r.Utilisation = append(r.Utilisation, UtilSample{T: float64(s), InUse: 0.5, Written: 0.3, Cached: 0.1, Queued: s * i})
				}
				if !r.Unsafe {
					r.ScrubByBatch = []FillBucket{{Pages: 4, Fills: 2, GBps: 10}, {Pages: 64, Fills: 4, GBps: 20}}
				}
				runs = append(runs, r)
			}
		}
	}
	return runs
}

// With many pools the legends used to sit inside the frame, over the
// lines (40 entries in the utilisation plot), with seven colours shared
// by 40 runs. Now every legend is a column beside the frame, and every
// series of a plot has a style (colour and dashes) of its own.
func TestPlotsManyPoolsLegendBesideData(t *testing.T) {
	runs := manyRuns()
	for _, pl := range []struct {
		name    string
		make    func([]*RunResult) (*figure, error)
		entries int
	}{
		{HitRatePlot, hitRatePlot, 2 * 2},          // per layout: the rate and the bound
		{QueuePlot, queuePlot, 10},                 // per pool and layout
		{UtilisationPlot, utilisationPlot, 3 * 10}, // reserved, written, cached per pool and layout
		{LatencyCDFPlot, latencyCDFPlot, 40},       // per run
		{ScrubBWPlot, scrubBandwidthPlot, 30},      // per run that fills
	} {
		t.Run(pl.name, func(t *testing.T) {
			f, err := pl.make(runs)
			require.NoError(t, err)
			styles := map[string]bool{}
			entries := 0
			for _, p := range f.drawn {
				if l, ok := p.(*plotter.Line); ok {
					key := fmt.Sprint(l.Color, l.Dashes)
					require.False(t, styles[key], "two series styled %s", key)
					styles[key] = true
					entries++
				}
			}
			assert.Equal(t, pl.entries, entries, "series drawn")
			w, h := f.size()
			c, err := draw.NewFormattedCanvas(w, h, "png")
			require.NoError(t, err)
			plotArea, legendArea, hasLegend := f.layout(draw.New(c))
			require.True(t, hasLegend)
			data := f.Plot.DataCanvas(plotArea)
			assert.LessOrEqual(t, data.Max.X, legendArea.Min.X, "the legend is right of the data")
			legend := f.legend.Rectangle(legendArea)
			assert.GreaterOrEqual(t, legend.Min.Y, vg.Length(0), "every legend entry fits the image")
			assert.LessOrEqual(t, legend.Max.X, w)
		})
	}
	dir := t.TempDir()
	paths, err := WritePlots(dir, runs)
	require.NoError(t, err)
	requirePNGs(t, dir, paths)
}

// The palette's colours are told apart: no two closer than a set distance
// in RGB, none too pale for a white background.
func TestPaletteDistinct(t *testing.T) {
	for i, a := range palette {
		assert.Less(t, int(a.R)+int(a.G)+int(a.B), 3*235, "colour %d is too pale", i)
		for j, b := range palette[:i] {
			dr, dg, db := float64(a.R)-float64(b.R), float64(a.G)-float64(b.G), float64(a.B)-float64(b.B)
			assert.Greater(t, math.Sqrt(dr*dr+dg*dg+db*db), 50.0, "colours %d and %d are too close", j, i)
		}
	}
}

// One point per pool size, in order of size, per layout; the bound is a
// line across them at its value, or through each pool's bound where they
// differ.
func TestHitRatePlotPoints(t *testing.T) {
	runs := manyRuns()
	f, err := hitRatePlot(runs)
	require.NoError(t, err)
	var points []plotter.XYs
	var bounds []float64
	for _, p := range f.drawn {
		switch p := p.(type) {
		case *plotter.Scatter:
			points = append(points, p.XYs)
		case *plotter.Line:
			if len(p.Dashes) > 0 {
				bounds = append(bounds, p.XYs[0].Y, p.XYs[1].Y)
			}
		}
	}
	want := plotter.XYs{{X: 16 << 10, Y: 10}, {X: 16 << 12, Y: 20}, {X: 16 << 14, Y: 30}, {X: 16 << 16, Y: 40}, {X: 16 << 18, Y: 50}}
	assert.Equal(t, []plotter.XYs{want, want}, points, "per layout")
	assert.Equal(t, []float64{60, 60, 60, 60}, bounds)
	assert.Equal(t, plot.LogScale{}, f.X.Scale, "sizes spanning ×256 on a log axis")

	for _, r := range runs {
		if r.PoolPages == 1<<10 {
			r.Prefix.Bound.HitRate = 0.5 // the smallest pool cannot take some requests
		}
	}
	f, err = hitRatePlot(runs)
	require.NoError(t, err)
	var line plotter.XYs
	for _, p := range f.drawn {
		if l, ok := p.(*plotter.Line); ok && len(l.Dashes) > 0 {
			line = l.XYs
			break
		}
	}
	assert.Equal(t, plotter.XYs{{X: 16 << 10, Y: 50}, {X: 16 << 12, Y: 60}, {X: 16 << 14, Y: 60}, {X: 16 << 16, Y: 60}, {X: 16 << 18, Y: 60}}, line)
}
