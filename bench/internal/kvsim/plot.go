package kvsim

import (
	"bufio"
	"errors"
	"fmt"
	"image/color"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// Plot files WritePlots writes.
const (
	HitRatePlot     = "hit-rate.png"
	QueuePlot       = "queue.png"
	UtilisationPlot = "utilisation.png"
	LatencyCDFPlot  = "admission-latency-cdf.png"
	ScrubBWPlot     = "scrub-bandwidth.png"
)

// PlotFiles are the plots WritePlots writes, in order.
var PlotFiles = []string{HitRatePlot, QueuePlot, UtilisationPlot, LatencyCDFPlot, ScrubBWPlot}

// Variety says what differs between the runs of a report besides the
// policy, so that labels name it.
type Variety struct{ Pools, Tiers, Domains, Sizings bool }

// VarietyOf looks at runs.
func VarietyOf(runs []*RunResult) Variety {
	var v Variety
	for _, r := range runs {
		v.Pools = v.Pools || r.PoolPages != runs[0].PoolPages
		v.Tiers = v.Tiers || r.HostTierPages != runs[0].HostTierPages
		v.Domains = v.Domains || r.Domains != runs[0].Domains
		v.Sizings = v.Sizings || r.Sizing != runs[0].Sizing
	}
	return v
}

// RunLabel names a run in legends and tables.
func RunLabel(r *RunResult, v Variety) string {
	label := r.Policy
	if v.Pools {
		label += fmt.Sprintf("/%dp", r.PoolPages)
	}
	if v.Tiers {
		label += fmt.Sprintf("+%dt", r.HostTierPages) // host-tier pages
	}
	if v.Domains {
		label += "/" + r.Domains
	}
	if v.Sizings {
		label += "/" + r.Sizing
	}
	return label
}

// WritePlots writes the PNG plots (PlotFiles) into dir and returns the
// paths it wrote. A plot with nothing to draw (no admission, no fill) is
// still written, saying so in its title and across its frame, so that a
// reader of the output directory never meets a missing or empty file
// without an explanation. Each plot is written to a temporary file and
// renamed into place, so a failure leaves no truncated PNG behind; a
// failure of one plot, a panic inside the plotting library included, is
// returned as an error after the other plots have been written.
func WritePlots(dir string, runs []*RunResult) ([]string, error) {
	var paths []string
	var errs []error
	for _, pl := range []struct {
		file string
		make func([]*RunResult) (*figure, error)
	}{
		{HitRatePlot, hitRatePlot},
		{QueuePlot, queuePlot},
		{UtilisationPlot, utilisationPlot},
		{LatencyCDFPlot, latencyCDFPlot},
		{ScrubBWPlot, scrubBandwidthPlot},
	} {
		path := filepath.Join(dir, pl.file)
		if err := savePlot(path, func() (*figure, error) { return pl.make(runs) }); err != nil {
			errs = append(errs, fmt.Errorf("plot %s: %w", pl.file, err))
			continue
		}
		paths = append(paths, path)
	}
	return paths, errors.Join(errs...)
}

// figure is a plot whose legend is drawn beside the data, never over it:
// with many runs a legend inside the frame covers the lines it explains.
type figure struct {
	*plot.Plot
	legend plot.Legend
	drawn  []plot.Plotter // what add added, in order, for tests to inspect
}

// add adds plotters to the plot.
func (f *figure) add(ps ...plot.Plotter) {
	f.Plot.Add(ps...)
	f.drawn = append(f.drawn, ps...)
}

func newFigure(title, x, y string) *figure {
	f := &figure{Plot: plot.New(), legend: plot.NewLegend()}
	f.Title.Text, f.X.Label.Text, f.Y.Label.Text = title, x, y
	f.legend.Top, f.legend.Left = true, true
	f.legend.TextStyle.Font.Size = vg.Points(10)
	f.add(plotter.NewGrid())
	return f
}

// Sizes of a saved plot: the frame, and the gap between it and the legend.
const (
	plotWidth  = 20 * vg.Centimeter
	plotHeight = 12 * vg.Centimeter
	legendGap  = 4 * vg.Millimeter
)

// layout splits c between the plot and, in a column on the right as wide
// as its longest entry, the legend (none without entries).
func (f *figure) layout(c draw.Canvas) (plotArea, legendArea draw.Canvas, hasLegend bool) {
	r := f.legend.Rectangle(c)
	if r.Size().X == 0 {
		return c, draw.Canvas{}, false
	}
	w := r.Size().X + 2*legendGap
	return draw.Crop(c, 0, -w, 0, 0), draw.Crop(c, c.Size().X-w+legendGap, -legendGap, 0, -legendGap), true
}

// draw renders f into c.
func (f *figure) draw(c draw.Canvas) {
	plotArea, legendArea, hasLegend := f.layout(c)
	f.Plot.Draw(plotArea)
	if hasLegend {
		f.legend.Draw(legendArea)
	}
}

// size is the canvas f needs: the frame and, beside it, a legend column
// tall enough for every entry.
func (f *figure) size() (vg.Length, vg.Length) {
	r := f.legend.Rectangle(draw.Canvas{})
	w, h := plotWidth, plotHeight
	if r.Size().X > 0 {
		w += r.Size().X + 2*legendGap
		h = max(h, r.Size().Y+4*legendGap)
	}
	return w, h
}

// savePlot builds a figure with make and saves it as a PNG at path. gonum
// reports some bad input (a log axis over a range that is not positive,
// for one) by panicking while it draws; that panic is returned as an
// error here, since a plot is an optional view of a report that has
// already been written and must not take the process down.
func savePlot(path string, make func() (*figure, error)) (err error) {
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
	f, err := make()
	if err != nil {
		return err
	}
	w, h := f.size()
	c := vgimg.New(w, h)
	f.draw(draw.New(c))
	// Plots are mostly flat colour: the fastest compression is nearly as
	// small as the default and several times quicker (more so under the
	// race detector, where encoding was most of a kvbench test's time).
	bw := bufio.NewWriter(tmp)
	enc := png.Encoder{CompressionLevel: png.BestSpeed}
	if err := enc.Encode(bw, c.Image()); err != nil {
		return fmt.Errorf("writing %s: %w", tmp.Name(), err)
	}
	if err := bw.Flush(); err != nil {
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

// noData turns f into a plot that says it has nothing to draw: the reason
// in its title and across its frame, on linear axes over [0, 1] without
// ticks (a log axis has no range to show without data, and gonum panics
// drawing one).
func noData(f *figure, why string) error {
	f.Title.Text += " (no data)"
	for _, ax := range []*plot.Axis{&f.X, &f.Y} {
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
	f.add(l)
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

// palette holds colours told apart at a glance, on white and from each
// other: Tableau's ten, then ten darker or stronger ones chosen at least 50
// apart in RGB from every other (TestPaletteDistinct).
var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xff, 0x7f, 0x0e, 0xff}, {0x2c, 0xa0, 0x2c, 0xff}, {0xd6, 0x27, 0x28, 0xff},
	{0x94, 0x67, 0xbd, 0xff}, {0x8c, 0x56, 0x4b, 0xff}, {0xe3, 0x77, 0xc2, 0xff}, {0x7f, 0x7f, 0x7f, 0xff},
	{0xbc, 0xbd, 0x22, 0xff}, {0x17, 0xbe, 0xcf, 0xff},
	{0x4b, 0x00, 0x82, 0xff}, {0x80, 0x80, 0x00, 0xff}, {0x00, 0x88, 0x56, 0xff}, {0x1a, 0x1a, 0x6e, 0xff},
	{0x88, 0x2d, 0x17, 0xff}, {0x8d, 0xb6, 0x00, 0xff}, {0x00, 0x64, 0x00, 0xff}, {0xe2, 0x58, 0x22, 0xff},
	{0x2b, 0x3d, 0x26, 0xff}, {0xff, 0x14, 0x93, 0xff},
}

// Line styles of series that share a colour (one pool size's reserved,
// written and cached shares; a hit rate and its bound).
var (
	solid  []vg.Length
	dashed = []vg.Length{vg.Points(5), vg.Points(3)}
	dotted = []vg.Length{vg.Points(1.5), vg.Points(2)}
	// dashDot marks a hybrid model's per-token-only hit rate.
	dashDot = []vg.Length{vg.Points(6), vg.Points(2), vg.Points(1.5), vg.Points(2)}
)

// seriesStyle is the i-th series' colour and, past the palette, a dash
// pattern that tells apart the series that reuse a colour.
func seriesStyle(i int) (color.Color, []vg.Length) {
	c := palette[i%len(palette)]
	switch (i / len(palette)) % 3 {
	case 1:
		return c, dashed
	case 2:
		return c, dotted
	}
	return c, solid
}

// addLine adds a line of colour and dashes and its legend entry.
func (f *figure) addLine(xys plotter.XYs, c color.Color, dashes []vg.Length, label string) error {
	if len(xys) == 0 {
		return nil
	}
	l, err := plotter.NewLine(xys)
	if err != nil {
		return err
	}
	l.Color, l.Dashes = c, dashes
	l.Width = vg.Points(1.5)
	f.add(l)
	f.legend.Add(label, l)
	return nil
}

// poolLayout is one pool size, domain layout and sizing: what the
// policies of a report share. The pool calls do not depend on the scrub
// policy, so neither do admissions, queues, occupancy or prefix hits: one
// series per poolLayout says them for every policy.
type poolLayout struct {
	pages   int
	domains string
	sizing  string
}

// byPoolLayout returns the first run of each pool size, layout and
// sizing, in report order.
func byPoolLayout(runs []*RunResult) []*RunResult {
	seen := map[poolLayout]bool{}
	var out []*RunResult
	for _, r := range runs {
		k := poolLayout{r.PoolPages, r.Domains, r.Sizing}
		if !seen[k] {
			seen[k] = true
			out = append(out, r)
		}
	}
	return out
}

// poolLayoutLabel names a run's pool size and layout where they vary.
func poolLayoutLabel(r *RunResult, many Variety) string {
	label := ""
	if many.Pools || !many.Domains {
		label = fmt.Sprintf("%s tokens (%dp)", formatCount(r.PoolTokens), r.PoolPages)
	}
	if many.Domains {
		if label != "" {
			label += ", "
		}
		label += r.Domains
	}
	if many.Sizings {
		label += ", " + r.Sizing
	}
	return label
}

// formatCount prints n in three significant digits with a k, M or G
// suffix (16.4k, 3M, 262k).
func formatCount(n int) string {
	v := float64(n)
	switch {
	case v >= 1e9:
		return fmt.Sprintf("%.3gG", v/1e9)
	case v >= 1e6:
		return fmt.Sprintf("%.3gM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.3gk", v/1e3)
	}
	return fmt.Sprint(n)
}

// hitRatePlot: the prefix cache's hit rate against pool size, one point
// per pool size (per layout), and the trace's bound as a line.
func hitRatePlot(runs []*RunResult) (*figure, error) {
	f := newFigure("Prefix cache hit rate against pool size (dashed: the trace's bound, an infinite cache)",
		"pool size (tokens)", "hit rate (% of full prompt pages looked up)")
	f.Y.Min, f.Y.Max = 0, 100
	// A series per domain layout and sizing: on-demand sizing admits more
	// requests at once, so it may hit otherwise.
	type layoutSizing struct{ domains, sizing string }
	var layouts []layoutSizing
	for _, r := range runs {
		if k := (layoutSizing{r.Domains, r.Sizing}); r.Prefix.Enabled && !slices.Contains(layouts, k) {
			layouts = append(layouts, k)
		}
	}
	many := VarietyOf(runs)
	if len(layouts) == 0 {
		return f, noData(f, "no run had the prefix cache on")
	}
	minX, maxX := math.Inf(1), math.Inf(-1)
	for _, r := range runs {
		minX, maxX = math.Min(minX, float64(r.PoolTokens)), math.Max(maxX, float64(r.PoolTokens))
	}
	if minX > 0 && maxX >= 4*minX {
		f.X.Scale = plot.LogScale{}
	}
	// A tick at each pool size replayed, named in tokens.
	var ticks plot.ConstantTicks
	for _, r := range byPoolLayout(runs) {
		if !slices.ContainsFunc(ticks, func(t plot.Tick) bool { return t.Value == float64(r.PoolTokens) }) {
			ticks = append(ticks, plot.Tick{Value: float64(r.PoolTokens), Label: formatCount(r.PoolTokens)})
		}
	}
	f.X.Tick.Marker = ticks
	if minX == maxX { // one pool: a frame around its point
		minX, maxX = minX/2, maxX*2
	}
	f.X.Min, f.X.Max = minX, maxX
	drawn := false
	for i, layout := range layouts {
		c, _ := seriesStyle(i)
		var xys, bounds, served, perToken plotter.XYs
		servedDiffers := false
		for _, r := range byPoolLayout(runs) {
			if (layoutSizing{r.Domains, r.Sizing}) != layout || !r.Prefix.Enabled {
				continue
			}
			px := r.Prefix
			bounds = append(bounds, plotter.XY{X: float64(r.PoolTokens), Y: 100 * px.Bound.HitRate})
			if px.LookupPages > 0 { // nothing admitted: no rate to show
				xys = append(xys, plotter.XY{X: float64(r.PoolTokens), Y: 100 * px.HitRate})
				served = append(served, plotter.XY{X: float64(r.PoolTokens), Y: 100 * px.ServedBound.HitRate})
				servedDiffers = servedDiffers || math.Abs(px.ServedBound.HitRate-px.Bound.HitRate) >= 0.0005
			}
			if c := r.Checkpoints; c != nil && c.PerTokenOnly != nil && c.PerTokenOnly.LookupPages > 0 &&
				!slices.ContainsFunc(perToken, func(p plotter.XY) bool { return p.X == float64(r.PoolTokens) }) {
				perToken = append(perToken, plotter.XY{X: float64(r.PoolTokens), Y: 100 * c.PerTokenOnly.HitRate})
			}
		}
		byX := func(a, b plotter.XY) int { return cmpFloat(a.X, b.X) }
		slices.SortFunc(xys, byX)
		slices.SortFunc(bounds, byX)
		slices.SortFunc(served, byX)
		slices.SortFunc(perToken, byX)
		suffix := ""
		if many.Domains {
			suffix += ", " + layout.domains
		}
		if many.Sizings {
			suffix += ", " + layout.sizing
		}
		// The bound is the trace's, the same for every pool that holds all
		// its requests: a level line across the plot. A pool too small for
		// some requests has the bound of those it can take.
		lo := slices.MinFunc(bounds, func(a, b plotter.XY) int { return cmpFloat(a.Y, b.Y) }).Y
		hi := slices.MaxFunc(bounds, func(a, b plotter.XY) int { return cmpFloat(a.Y, b.Y) }).Y
		label := fmt.Sprintf("bound%s: %.1f%%", suffix, hi)
		if lo == hi {
			bounds = plotter.XYs{{X: minX, Y: hi}, {X: maxX, Y: hi}}
		} else {
			label = fmt.Sprintf("bound%s: %.1f–%.1f%% (by the requests each pool can take)", suffix, lo, hi)
		}
		if err := f.addLine(bounds, c, dashed, label); err != nil {
			return nil, err
		}
		if servedDiffers {
			// Runs that left requests unserved: the bound of what they
			// served explains a hit rate above the trace's.
			if err := f.addLine(served, c, dotted, "bound of the requests served"+suffix); err != nil {
				return nil, err
			}
		}
		if len(perToken) > 0 {
			// A hybrid model's pool: the same trace on its per-token pages
			// alone, what its checkpoints are measured against.
			// Rings at the points: one pool size draws no line.
			l, s, err := plotter.NewLinePoints(perToken)
			if err != nil {
				return nil, err
			}
			l.Color, l.Dashes, l.Width, s.Color = c, dashDot, vg.Points(1.5), c
			s.Shape, s.Radius = draw.RingGlyph{}, vg.Points(4)
			f.add(l, s)
			f.legend.Add("per-token pages alone (no state)"+suffix, l, s)
		}
		if len(xys) == 0 {
			continue
		}
		l, s, err := plotter.NewLinePoints(xys)
		if err != nil {
			return nil, err
		}
		l.Color, s.Color, l.Width = c, c, vg.Points(1.5)
		s.Shape, s.Radius = draw.CircleGlyph{}, vg.Points(3)
		f.add(l, s)
		f.legend.Add("hit rate"+suffix, l, s)
		drawn = true
	}
	if !drawn {
		// The bound is drawn all the same: it is the trace's, not the run's.
		f.Title.Text += " (no request admitted: bound only)"
	}
	return f, nil
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// queuePlot: requests waiting for admission over serving time, one line
// per pool size and layout.
func queuePlot(runs []*RunResult) (*figure, error) {
	f := newFigure("Admission queue over serving time", "serving time (s)", "requests queued")
	f.Y.Min = 0
	many := VarietyOf(runs)
	for i, r := range byPoolLayout(runs) {
		xys := make(plotter.XYs, len(r.Utilisation))
		for j, u := range r.Utilisation {
			xys[j] = plotter.XY{X: u.T, Y: float64(u.Queued)}
		}
		c, dashes := seriesStyle(i)
		if err := f.addLine(xys, c, dashes, poolLayoutLabel(r, many)); err != nil {
			return nil, err
		}
	}
	if !hasSamples(runs) {
		return f, noData(f, "no sample was taken")
	}
	return f, nil
}

// utilisationPlot: the shares of the pool reserved by leases, holding
// written KV and cached, over serving time; a colour per pool size and
// layout, a line style per share.
func utilisationPlot(runs []*RunResult) (*figure, error) {
	f := newFigure("Pool utilisation over serving time (every policy alike)", "serving time (s)", "fraction of pool pages")
	f.Y.Min, f.Y.Max = 0, 1
	many := VarietyOf(runs)
	for i, r := range byPoolLayout(runs) {
		c := palette[i%len(palette)]
		label := poolLayoutLabel(r, many) + ": "
		series := []struct {
			name   string
			dashes []vg.Length
			value  func(UtilSample) float64
		}{
			{"reserved", solid, func(u UtilSample) float64 { return u.InUse }},
			{"KV written", dashed, func(u UtilSample) float64 { return u.Written }},
		}
		if r.Prefix.Enabled {
			series = append(series, struct {
				name   string
				dashes []vg.Length
				value  func(UtilSample) float64
			}{"prefix cached", dotted, func(u UtilSample) float64 { return u.Cached }})
		}
		for _, sr := range series {
			xys := make(plotter.XYs, len(r.Utilisation))
			for j, u := range r.Utilisation {
				xys[j] = plotter.XY{X: u.T, Y: sr.value(u)}
			}
			if err := f.addLine(xys, c, sr.dashes, label+sr.name); err != nil {
				return nil, err
			}
		}
	}
	if !hasSamples(runs) {
		return f, noData(f, "no utilisation sample was taken")
	}
	return f, nil
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

func latencyCDFPlot(runs []*RunResult) (*figure, error) {
	f := newFigure("Admission latency (CDF)", "Admit latency (µs, log scale)", "fraction of admissions")
	f.Y.Min, f.Y.Max = 0, 1
	f.X.Scale = plot.LogScale{}
	f.X.Tick.Marker = plot.LogTicks{Prec: -1}
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
		c, dashes := seriesStyle(i)
		if err := f.addLine(xys, c, dashes, RunLabel(r, many)); err != nil {
			return nil, err
		}
		drawn = true
	}
	if !drawn {
		return f, noData(f, "no request was admitted")
	}
	widenLogAxis(&f.X)
	return f, nil
}

func scrubBandwidthPlot(runs []*RunResult) (*figure, error) {
	f := newFigure("Scrub bandwidth per fill batch size (host)", "pages per fill batch (log2 buckets)", "fill bandwidth (GB/s)")
	f.X.Scale = plot.LogScale{}
	f.X.Tick.Marker = plot.LogTicks{Prec: -1}
	f.Y.Min = 0
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
		c, dashes := seriesStyle(i)
		l.Color, l.Dashes, s.Color = c, dashes, c
		s.Shape = draw.CircleGlyph{}
		f.add(l, s)
		f.legend.Add(RunLabel(r, many), l, s)
		drawn = true
	}
	if !drawn {
		return f, noData(f, "no scrub fill was measured (nothing was released, or only the unsafe baseline ran, which fills nothing)")
	}
	widenLogAxis(&f.X)
	return f, nil
}
