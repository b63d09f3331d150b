package fleet

import (
	"errors"
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"io"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// Chart is a line chart, drawn as a PNG by WritePNG: series of points
// joined by lines over a grid, a shaded band behind them, labelled
// vertical marks, and a legend on the right.
type Chart struct {
	// Title goes on top, XLabel under the x axis and YLabel above the y
	// axis.
	Title, XLabel, YLabel string
	// Series are the lines. The solid ones are drawn in order, then the
	// dashed ones over them; the legend lists them all in order.
	Series []Series
	// Marks are vertical lines across the plot, each labelled at the top.
	Marks []ChartMark
	// Band is shaded behind everything else, and BandLabel names it in the
	// legend (after the series; no entry when empty).
	Band      []BandSpan
	BandLabel string
	// LogX makes the x axis logarithmic, base 2, with a tick at each power
	// of two (for cluster sizes, say 16 to 256). Every X must then be
	// positive.
	LogX bool
}

// Series is one line of a Chart.
type Series struct {
	// Name is the series' legend entry.
	Name string
	// X and Y are the points, in order of X; a NaN in Y is a gap, where
	// the line breaks.
	X, Y []float64
	// Color is the line's colour. Nil means the chart palette's colour of
	// the series' index (the first series blue, the second orange, and so
	// on), or black for a dashed series.
	Color color.Color
	// Dashed draws the line thin and dashed, as for an average.
	Dashed bool
	// Points draws a small square at each point.
	Points bool
}

// ChartMark is a vertical line on a Chart at X, labelled at the top.
type ChartMark struct {
	X     float64
	Label string
}

// BandSpan is a shaded part of a Chart: from Lo to Hi over X0 to X1.
type BandSpan struct {
	X0, X1, Lo, Hi float64
}

// RelativeBand returns the band of ±frac around mid: a span per point,
// from its x to the next point's (the last one is empty), between
// mid×(1−frac) and mid×(1+frac) at that point. x and mid are as long as
// each other.
func RelativeBand(x, mid []float64, frac float64) []BandSpan {
	spans := make([]BandSpan, len(x))
	for i := range x {
		x1 := x[i]
		if i+1 < len(x) {
			x1 = x[i+1]
		}
		spans[i] = BandSpan{X0: x[i], X1: x1, Lo: mid[i] * (1 - frac), Hi: mid[i] * (1 + frac)}
	}
	return spans
}

// Chart sizes, in pixels. The right margin widens for long legend
// entries.
const (
	plotW, plotH                       = 1100, 560
	marginL, marginR, marginT, marginB = 70, 130, 60, 50
	charW                              = 7 // basicfont.Face7x13's advance
)

// palette colours the series that have no colour of their own, by index.
var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xff, 0x7f, 0x0e, 0xff}, {0x2c, 0xa0, 0x2c, 0xff}, {0xd6, 0x27, 0x28, 0xff},
	{0x94, 0x67, 0xbd, 0xff}, {0x8c, 0x56, 0x4b, 0xff}, {0xe3, 0x77, 0xc2, 0xff}, {0x7f, 0x7f, 0x7f, 0xff},
	{0xbc, 0xbd, 0x22, 0xff}, {0x17, 0xbe, 0xcf, 0xff},
}

var (
	white    = color.RGBA{0xff, 0xff, 0xff, 0xff}
	black    = color.RGBA{0, 0, 0, 0xff}
	grid     = color.RGBA{0xe4, 0xe4, 0xe4, 0xff}
	bandFill = color.RGBA{0xdd, 0xee, 0xff, 0xff}
	markGrey = color.RGBA{0x90, 0x90, 0x90, 0xff}
)

// WritePNG draws the chart as a PNG to w. The y axis starts at 0 (or
// below, for negative values) and ends a little above the highest point;
// a linear x axis starts at 0 (or below) and ends at the last point or
// mark. It returns an error when no series has a point.
func (c Chart) WritePNG(w io.Writer) error {
	ax, err := c.axes()
	if err != nil {
		return err
	}
	img := image.NewRGBA(image.Rect(0, 0, plotW, plotH))
	draw.Draw(img, img.Bounds(), &image.Uniform{white}, image.Point{}, draw.Src)

	// The band, behind everything.
	for _, s := range c.Band {
		fillRect(img, ax.px(s.X0), ax.py(s.Hi), ax.px(s.X1), ax.py(s.Lo), bandFill, ax.area)
	}
	c.drawAxes(img, ax)
	c.drawMarks(img, ax)

	// The solid lines, then the dashed ones over them.
	for _, dashed := range []bool{false, true} {
		for i, s := range c.Series {
			if s.Dashed != dashed {
				continue
			}
			p := c.pen(img, i)
			for k := range s.X {
				if k >= len(s.Y) || math.IsNaN(s.Y[k]) {
					p.lift()
					continue
				}
				x, y := ax.px(s.X[k]), ax.py(s.Y[k])
				p.to(x, y)
				if s.Points {
					fillRect(img, x-3, y-3, x+4, y+4, p.c, img.Bounds())
				}
			}
		}
	}

	// The legend.
	lx := ax.x1 + 12
	for i, s := range c.Series {
		ly := ax.y1 + 10 + 18*i
		if p := c.pen(img, i); s.Dashed {
			p.to(lx, ly-3)
			p.to(lx+14, ly-3)
		} else {
			fillRect(img, lx, ly-8, lx+14, ly+2, p.c, img.Bounds())
		}
		text(img, lx+20, ly+2, s.Name, black)
	}
	if c.BandLabel != "" {
		ly := ax.y1 + 10 + 18*len(c.Series)
		fillRect(img, lx, ly-8, lx+14, ly+2, bandFill, img.Bounds())
		text(img, lx+20, ly+2, c.BandLabel, black)
	}
	return png.Encode(w, img)
}

// chartAxes maps a Chart's values to pixels.
type chartAxes struct {
	x0, x1, y0, y1 int // the plot area's left, right, bottom and top
	area           image.Rectangle
	xLo, xHi       float64 // log2 of the values with LogX
	yLo, yHi       float64
	logX           bool
}

// axes returns the chart's axes: the ranges of its values, and the plot
// area left by the legend.
func (c Chart) axes() (chartAxes, error) {
	xLo, xHi := math.Inf(1), math.Inf(-1)
	yLo, yHi := 0.0, math.Inf(-1)
	seeX := func(x float64) {
		xLo, xHi = min(xLo, x), max(xHi, x)
	}
	for _, s := range c.Series {
		for k, x := range s.X {
			if k >= len(s.Y) || math.IsNaN(s.Y[k]) {
				continue
			}
			if c.LogX && !(x > 0) {
				return chartAxes{}, fmt.Errorf("series %q: x %g on a log axis", s.Name, x)
			}
			seeX(x)
			yLo, yHi = min(yLo, s.Y[k]), max(yHi, s.Y[k])
		}
	}
	if math.IsInf(yHi, -1) {
		return chartAxes{}, errors.New("the chart has no points")
	}
	for _, m := range c.Marks {
		if !c.LogX || m.X > 0 {
			seeX(m.X)
		}
	}
	ax := chartAxes{logX: c.LogX}
	if c.LogX {
		// A quarter of an octave either side keeps the end points off the
		// frame.
		ax.xLo, ax.xHi = math.Log2(xLo)-0.25, math.Log2(xHi)+0.25
	} else {
		ax.xLo, ax.xHi = min(0, xLo), xHi
		if ax.xHi <= ax.xLo {
			ax.xHi = ax.xLo + 1
		}
	}
	ax.yHi = niceCeil(yHi * 1.05)
	if yLo < 0 {
		ax.yLo = -niceCeil(-yLo * 1.05)
	}
	legend := 0
	for _, s := range c.Series {
		legend = max(legend, textWidth(s.Name))
	}
	legend = max(legend, textWidth(c.BandLabel))
	right := max(marginR, 12+20+legend+8)
	ax.x0, ax.x1, ax.y0, ax.y1 = marginL, plotW-right, plotH-marginB, marginT
	ax.area = image.Rect(ax.x0, ax.y1, ax.x1+1, ax.y0+1)
	return ax, nil
}

// px returns the column of x.
func (ax chartAxes) px(x float64) int {
	if ax.logX {
		x = math.Log2(x)
	}
	return ax.x0 + int(math.Round((x-ax.xLo)/(ax.xHi-ax.xLo)*float64(ax.x1-ax.x0)))
}

// py returns the row of y.
func (ax chartAxes) py(y float64) int {
	return ax.y0 - int(math.Round((y-ax.yLo)/(ax.yHi-ax.yLo)*float64(ax.y0-ax.y1)))
}

// drawAxes draws the grid, the axes, their ticks and labels, and the
// title.
func (c Chart) drawAxes(img *image.RGBA, ax chartAxes) {
	xTick := func(x int, label string) {
		vline(img, x, ax.y1, ax.y0, grid, 0)
		text(img, x-textWidth(label)/2, ax.y0+16, label, black)
	}
	if c.LogX {
		for k := math.Ceil(ax.xLo); k <= ax.xHi; k++ {
			v := math.Exp2(k)
			xTick(ax.px(v), strconv.FormatFloat(v, 'f', -1, 64))
		}
	} else {
		step := niceStep((ax.xHi - ax.xLo) / 10)
		for k := math.Ceil(ax.xLo / step); k*step <= ax.xHi+1e-9*step; k++ {
			xTick(ax.px(k*step), tickLabel(k*step, step))
		}
	}
	step := niceStep((ax.yHi - ax.yLo) / 8)
	for k := math.Ceil(ax.yLo / step); k*step <= ax.yHi+1e-9*step; k++ {
		y := ax.py(k * step)
		hline(img, ax.x0, ax.x1, y, grid)
		label := tickLabel(k*step, step)
		text(img, ax.x0-8-textWidth(label), y+4, label, black)
	}
	hline(img, ax.x0, ax.x1, ax.py(0), black)
	vline(img, ax.x0, ax.y1, ax.y0, black, 0)
	text(img, (ax.x0+ax.x1)/2-textWidth(c.XLabel)/2, plotH-12, c.XLabel, black)
	text(img, 8, ax.y1-14, c.YLabel, black)
	text(img, ax.x0, 22, c.Title, black)
}

// drawMarks draws the marks, each label in the first row where it does
// not overlap the one before it, right-aligned at the right edge.
func (c Chart) drawMarks(img *image.RGBA, ax chartAxes) {
	var rowEnd []int
	for _, m := range c.Marks {
		if c.LogX && !(m.X > 0) {
			continue
		}
		x := ax.px(m.X)
		vline(img, x, ax.y1, ax.y0, markGrey, 4)
		w := textWidth(m.Label)
		lx := x + 3
		if lx+w > ax.x1 {
			lx = x - 3 - w
		}
		row := 0
		for row < len(rowEnd) && rowEnd[row] > lx {
			row++
		}
		if row == len(rowEnd) {
			rowEnd = append(rowEnd, 0)
		}
		rowEnd[row] = lx + w + charW
		text(img, lx, ax.y1+12+13*row, m.Label, markGrey)
	}
}

// pen returns the pen that draws series i: 2 pixels wide in its colour,
// or 1 pixel wide and dashed.
func (c Chart) pen(img *image.RGBA, i int) *pen {
	s := c.Series[i]
	p := &pen{img: img, c: palette[i%len(palette)], width: 2}
	if s.Dashed {
		p.c, p.width, p.dashed = black, 1, true
	}
	if s.Color != nil {
		p.c = color.RGBAModel.Convert(s.Color).(color.RGBA)
	}
	return p
}

// pen draws polylines, solid or dashed (6 pixels on, 4 off, the pattern
// running on from one segment to the next).
type pen struct {
	img    *image.RGBA
	c      color.RGBA
	width  int
	dashed bool
	down   bool // a line goes from (x, y) to the next point
	x, y   int
	run    int // pixels drawn along the polyline, for the dashes
}

// to draws a line from the pen's point, if it is down, to (x, y), and
// puts the pen down there.
func (p *pen) to(x, y int) {
	if p.down {
		steps := max(abs(x-p.x), abs(y-p.y), 1)
		for i := 1; i <= steps; i++ {
			p.run++
			if p.dashed && p.run%10 >= 6 {
				continue
			}
			px, py := p.x+(x-p.x)*i/steps, p.y+(y-p.y)*i/steps
			for dx := range p.width {
				for dy := range p.width {
					p.img.SetRGBA(px+dx, py+dy, p.c)
				}
			}
		}
	}
	p.down, p.x, p.y = true, x, y
}

// lift breaks the line: the next point starts a new one.
func (p *pen) lift() { p.down = false }

// tickLabel formats the tick value v, a multiple of step, with as many
// decimals as step needs.
func tickLabel(v, step float64) string {
	decimals := max(0, -int(math.Floor(math.Log10(step)+1e-9)))
	return strconv.FormatFloat(v, 'f', decimals, 64)
}

// niceStep returns 1, 2 or 5 times a power of ten, at least raw.
func niceStep(raw float64) float64 {
	if raw <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

// niceCeil rounds v up to a multiple of a nice step.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	s := niceStep(v / 8)
	return math.Ceil(v/s) * s
}

// fillRect fills the rectangle between the two corners, clipped to clip.
func fillRect(img *image.RGBA, xa, ya, xb, yb int, c color.RGBA, clip image.Rectangle) {
	r := image.Rect(xa, ya, xb, yb).Intersect(clip)
	draw.Draw(img, r, &image.Uniform{c}, image.Point{}, draw.Src)
}

// hline draws a horizontal line.
func hline(img *image.RGBA, xa, xb, y int, c color.RGBA) {
	for x := xa; x <= xb; x++ {
		img.SetRGBA(x, y, c)
	}
}

// vline draws a vertical line, dashed every dash pixels when dash > 0.
func vline(img *image.RGBA, x, ya, yb int, c color.RGBA, dash int) {
	for y := ya; y <= yb; y++ {
		if dash > 0 && (y/dash)%2 == 1 {
			continue
		}
		img.SetRGBA(x, y, c)
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

// ascii spells the few non-ASCII characters the charts' texts use in
// ASCII, which is all basicfont has.
var ascii = strings.NewReplacer("×", "x", "±", "+/-", "–", "-", "—", "-", "→", "->", "≤", "<=", "≥", ">=", "µ", "u")

// text draws s with its baseline at (x, y).
func text(img *image.RGBA, x, y int, s string, c color.RGBA) {
	d := font.Drawer{Dst: img, Src: &image.Uniform{c}, Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
	d.DrawString(ascii.Replace(s))
}

// textWidth returns the width of s as text draws it, in pixels.
func textWidth(s string) int { return charW * utf8.RuneCountInString(ascii.Replace(s)) }
