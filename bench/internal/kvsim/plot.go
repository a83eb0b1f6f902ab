package kvsim

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// Plot files WritePlots writes.
const (
	UtilisationPlot = "utilisation.png"
	LatencyCDFPlot  = "admission-latency-cdf.png"
	ScrubBWPlot     = "scrub-bandwidth.png"
)

// Variety says what differs between the runs of a report besides the
// policy, so that labels name it.
type Variety struct{ Pools, Domains bool }

// VarietyOf looks at runs.
func VarietyOf(runs []*RunResult) Variety {
	var v Variety
	for _, r := range runs {
		v.Pools = v.Pools || r.PoolPages != runs[0].PoolPages
		v.Domains = v.Domains || r.Domains != runs[0].Domains
	}
	return v
}

// RunLabel names a run in legends and tables.
func RunLabel(r *RunResult, v Variety) string {
	label := r.Policy
	if v.Pools {
		label += fmt.Sprintf("/%dp", r.PoolPages)
	}
	if v.Domains {
		label += "/" + r.Domains
	}
	return label
}

// WritePlots writes the three PNG plots into dir and returns the paths it
// wrote. A plot with nothing to draw (no admission, no fill) is still
// written, saying so in its title and across its frame, so that a reader
// of the output directory never meets a missing or empty file without an
// explanation. Each plot is written to a temporary file and renamed into
// place, so a failure leaves no truncated PNG behind; a failure of one
// plot, a panic inside the plotting library included, is returned as an
// error after the other plots have been written.
func WritePlots(dir string, runs []*RunResult) ([]string, error) {
	var paths []string
	var errs []error
	for _, pl := range []struct {
		file string
		make func([]*RunResult) (*plot.Plot, error)
	}{
		{UtilisationPlot, utilisationPlot},
		{LatencyCDFPlot, latencyCDFPlot},
		{ScrubBWPlot, scrubBandwidthPlot},
	} {
		path := filepath.Join(dir, pl.file)
		if err := savePlot(path, func() (*plot.Plot, error) { return pl.make(runs) }); err != nil {
			errs = append(errs, fmt.Errorf("plot %s: %w", pl.file, err))
			continue
		}
		paths = append(paths, path)
	}
	return paths, errors.Join(errs...)
}

// savePlot builds a plot with make and saves it as a PNG at path. gonum
// reports some bad input (a log axis over a range that is not positive,
// for one) by panicking while it draws; that panic is returned as an
// error here, since a plot is an optional view of a report that has
// already been written and must not take the process down.
func savePlot(path string, make func() (*plot.Plot, error)) (err error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("plotting library panicked: %v", r)
		}
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	p, err := make()
	if err != nil {
		return err
	}
	w, err := p.WriterTo(20*vg.Centimeter, 12*vg.Centimeter, "png")
	if err != nil {
		return err
	}
	if _, err := w.WriteTo(tmp); err != nil {
		return fmt.Errorf("writing %s: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("writing %s: %w", tmp.Name(), err)
	}
	// CreateTemp makes the file private to its owner; a plot is not.
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// noData turns p into a plot that says it has nothing to draw: the reason
// in its title and across its frame, on linear axes over [0, 1] without
// ticks (a log axis has no range to show without data, and gonum panics
// drawing one).
func noData(p *plot.Plot, why string) error {
	p.Title.Text += " (no data)"
	for _, ax := range []*plot.Axis{&p.X, &p.Y} {
		ax.Scale = plot.LinearScale{}
		ax.Tick.Marker = plot.ConstantTicks{}
		ax.Min, ax.Max = 0, 1
	}
	l, err := plotter.NewLabels(plotter.XYLabels{XYs: plotter.XYs{{X: 0.5, Y: 0.5}}, Labels: []string{"no data: " + why}})
	if err != nil {
		return err
	}
	for i := range l.TextStyle {
		l.TextStyle[i].XAlign, l.TextStyle[i].YAlign = draw.XCenter, draw.YCenter
	}
	p.Add(l)
	return nil
}

// widenLogAxis gives a log axis whose data all sit at one value a range
// around it: gonum would widen it to [x-1, x+1], which is not positive
// for x ≤ 1 and makes it panic (one admission, or fills all of one batch
// size, is enough).
func widenLogAxis(ax *plot.Axis) {
	if ax.Min == ax.Max && ax.Min > 0 {
		ax.Min, ax.Max = ax.Min/2, ax.Max*2
	}
}

func addLine(p *plot.Plot, xys plotter.XYs, i int, label string, dashed bool) error {
	if len(xys) == 0 {
		return nil
	}
	l, err := plotter.NewLine(xys)
	if err != nil {
		return err
	}
	l.Color = plotutil.Color(i)
	l.Width = vg.Points(1.5)
	if dashed {
		l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
	}
	p.Add(l)
	p.Legend.Add(label, l)
	return nil
}

func utilisationPlot(runs []*RunResult) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = "Pool utilisation over serving time"
	p.X.Label.Text = "serving time (s)"
	p.Y.Label.Text = "fraction of pool pages"
	p.Y.Min, p.Y.Max = 0, 1
	p.Add(plotter.NewGrid())
	p.Legend.Left, p.Legend.Top = true, true // the pool fills from empty: the top left stays clear
	many := VarietyOf(runs)
	for i, r := range runs {
		xys := make(plotter.XYs, len(r.Utilisation))
		for j, u := range r.Utilisation {
			xys[j] = plotter.XY{X: u.T, Y: u.InUse}
		}
		if err := addLine(p, xys, i, RunLabel(r, many)+" reserved", false); err != nil {
			return nil, err
		}
	}
	// The written and cached fractions depend only on the trace, the pool
	// size and the domain layout, not on the policy, so one line per pool
	// size and layout says each.
	type poolLayout struct {
		pages   int
		domains string
	}
	seen := map[poolLayout]bool{}
	for i, r := range runs {
		if seen[poolLayout{r.PoolPages, r.Domains}] {
			continue
		}
		seen[poolLayout{r.PoolPages, r.Domains}] = true
		xys := make(plotter.XYs, len(r.Utilisation))
		for j, u := range r.Utilisation {
			xys[j] = plotter.XY{X: u.T, Y: u.Written}
		}
		suffix := ""
		if many.Pools {
			suffix += fmt.Sprintf("/%dp", r.PoolPages)
		}
		if many.Domains {
			suffix += "/" + r.Domains
		}
		if err := addLine(p, xys, i, "KV written"+suffix, true); err != nil {
			return nil, err
		}
		if !r.Prefix.Enabled {
			continue
		}
		cached := make(plotter.XYs, len(r.Utilisation))
		for j, u := range r.Utilisation {
			cached[j] = plotter.XY{X: u.T, Y: u.Cached}
		}
		if err := addLine(p, cached, i+1, "prefix cached"+suffix, true); err != nil {
			return nil, err
		}
	}
	if !hasSamples(runs) {
		return p, noData(p, "no utilisation sample was taken")
	}
	return p, nil
}

func hasSamples(runs []*RunResult) bool {
	for _, r := range runs {
		if len(r.Utilisation) > 0 {
			return true
		}
	}
	return false
}

// maxCDFPoints bounds the points drawn per CDF.
const maxCDFPoints = 400

func latencyCDFPlot(runs []*RunResult) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = "Admission latency (CDF)"
	p.X.Label.Text = "Admit latency (µs, log scale)"
	p.Y.Label.Text = "fraction of admissions"
	p.Y.Min, p.Y.Max = 0, 1
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Add(plotter.NewGrid())
	p.Legend.Left, p.Legend.Top = true, true
	many := VarietyOf(runs)
	drawn := false
	for i, r := range runs {
		lat := slices.Clone(r.Latencies)
		slices.Sort(lat)
		n := len(lat)
		if n == 0 {
			continue
		}
		step := max(1, n/maxCDFPoints)
		var xys plotter.XYs
		for j := 0; j < n; j += step {
			xys = append(xys, plotter.XY{X: math.Max(lat[j].Seconds()*1e6, 0.01), Y: float64(j+1) / float64(n)})
		}
		xys = append(xys, plotter.XY{X: math.Max(lat[n-1].Seconds()*1e6, 0.01), Y: 1})
		if err := addLine(p, xys, i, RunLabel(r, many), false); err != nil {
			return nil, err
		}
		drawn = true
	}
	if !drawn {
		return p, noData(p, "no request was admitted")
	}
	widenLogAxis(&p.X)
	return p, nil
}

func scrubBandwidthPlot(runs []*RunResult) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = "Scrub bandwidth per fill batch size"
	p.X.Label.Text = "pages per fill batch (log2 buckets)"
	p.Y.Label.Text = "fill bandwidth (GB/s)"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Y.Min = 0
	p.Add(plotter.NewGrid())
	p.Legend.Left, p.Legend.Top = true, true
	many := VarietyOf(runs)
	drawn := false
	for i, r := range runs {
		var xys plotter.XYs
		for _, b := range r.ScrubByBatch {
			if b.GBps > 0 {
				xys = append(xys, plotter.XY{X: float64(b.Pages) / float64(b.Fills), Y: b.GBps})
			}
		}
		if len(xys) == 0 {
			continue // the unsafe baseline writes nothing
		}
		l, s, err := plotter.NewLinePoints(xys)
		if err != nil {
			return nil, err
		}
		l.Color, s.Color = plotutil.Color(i), plotutil.Color(i)
		s.Shape = plotutil.Shape(i)
		p.Add(l, s)
		p.Legend.Add(RunLabel(r, many), l, s)
		drawn = true
	}
	if !drawn {
		return p, noData(p, "no scrub fill was measured (nothing was released, or only the unsafe baseline ran, which fills nothing)")
	}
	widenLogAxis(&p.X)
	return p, nil
}
