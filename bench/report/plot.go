package report

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// Plot draws the sweep, side by side: load and store throughput against
// the read fault rate, and load p99 latency against it. The format follows
// the extension of path: .svg or .png.
func Plot(path string, sweep []SweepPoint, title string) error {
	if len(sweep) == 0 {
		return fmt.Errorf("plot: no fault sweep to draw")
	}
	var c interface {
		vg.CanvasSizer
		io.WriterTo
	}
	w, h := 9*vg.Inch, 3.6*vg.Inch
	switch strings.ToLower(filepath.Ext(path)) {
	case ".svg":
		c = vgsvg.New(w, h)
	case ".png":
		c = vgimg.PngCanvas{Canvas: vgimg.NewWith(vgimg.UseWH(w, h), vgimg.UseDPI(144))}
	default:
		return fmt.Errorf("plot %s: want a .svg or .png file", path)
	}

	n := len(sweep)
	load, disk, store, p99, dp99 := make(plotter.XYs, n), make(plotter.XYs, n), make(plotter.XYs, n), make(plotter.XYs, n), make(plotter.XYs, n)
	for i, p := range sweep {
		x := 100 * p.Rate
		load[i] = plotter.XY{X: x, Y: p.LoadGBps}
		disk[i] = plotter.XY{X: x, Y: p.DiskLoadGBps}
		store[i] = plotter.XY{X: x, Y: p.StoreGBps}
		p99[i] = plotter.XY{X: x, Y: p.LoadP99us / 1000}
		dp99[i] = plotter.XY{X: x, Y: p.DiskLoadP99us / 1000}
	}
	tp := plot.New()
	tp.Title.Text = "throughput vs read fault rate\n" + title
	tp.X.Label.Text = "read fault rate (%)"
	tp.Y.Label.Text = "GB/s"
	lp := plot.New()
	lp.Title.Text = "load job p99 latency vs read fault rate\n" + title
	lp.X.Label.Text = "read fault rate (%)"
	lp.Y.Label.Text = "ms"
	for _, x := range []struct {
		p    *plot.Plot
		name string
		pts  plotter.XYs
		i    int
	}{
		{tp, "load (steps: CPU and disk hits)", load, 0}, {tp, "load of disk-only blocks", disk, 1}, {tp, "store (steps)", store, 2},
		{lp, "load job p99 (steps)", p99, 0}, {lp, "load job p99 (disk-only blocks)", dp99, 1},
	} {
		l, s, err := plotter.NewLinePoints(x.pts)
		if err != nil {
			return err
		}
		l.Color = plotutil.Color(x.i)
		s.Color = l.Color
		s.Shape = plotutil.Shape(x.i)
		x.p.Add(l, s)
		x.p.Legend.Add(x.name, l, s)
	}
	for _, p := range []*plot.Plot{tp, lp} {
		p.Y.Min = 0
		// Bottom left: the lines stay above it, from 0.
		p.Legend.Top, p.Legend.Left = false, true
		p.Legend.XOffs = vg.Millimeter
		p.Legend.TextStyle.Font.Size = vg.Points(9)
		p.Add(plotter.NewGrid())
	}
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadX: 0.3 * vg.Inch, PadTop: vg.Millimeter, PadLeft: vg.Millimeter, PadRight: 2 * vg.Millimeter, PadBottom: vg.Millimeter}
	canvases := plot.Align([][]*plot.Plot{{tp, lp}}, tiles, draw.New(c))
	tp.Draw(canvases[0][0])
	lp.Draw(canvases[0][1])

	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
