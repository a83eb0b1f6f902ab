package kvsim

import (
	"fmt"
	"math"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
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

// WritePlots writes the three PNG plots into dir and returns their paths.
func WritePlots(dir string, runs []*RunResult) ([]string, error) {
	var paths []string
	for _, pl := range []struct {
		file string
		make func([]*RunResult) (*plot.Plot, error)
	}{
		{UtilisationPlot, utilisationPlot},
		{LatencyCDFPlot, latencyCDFPlot},
		{ScrubBWPlot, scrubBandwidthPlot},
	} {
		p, err := pl.make(runs)
		if err != nil {
			return paths, fmt.Errorf("plot %s: %w", pl.file, err)
		}
		path := filepath.Join(dir, pl.file)
		if err := p.Save(20*vg.Centimeter, 12*vg.Centimeter, path); err != nil {
			return paths, fmt.Errorf("saving %s: %w", path, err)
		}
		paths = append(paths, path)
	}
	return paths, nil
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
	return p, nil
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
	}
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
		p.Title.Text += " (no fills measured)"
		p.X.Scale = plot.LinearScale{}
		p.X.Tick.Marker = plot.DefaultTicks{}
		p.X.Min, p.X.Max, p.Y.Max = 1, 2, 1
	}
	return p, nil
}
