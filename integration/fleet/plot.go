package fleet

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"io"
	"math"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// Plot sizes, in pixels.
const (
	plotW, plotH                       = 1100, 560
	marginL, marginR, marginT, marginB = 70, 130, 60, 50
)

// palette colours the nodes' lines, in the order of their names.
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

// WritePNG draws the timeline as a PNG: one line per node (connections
// held over time), the cluster average (dashed) with the ±band around it
// shaded, and a vertical line for each mark. title goes on top.
func (tl *Timeline) WritePNG(w io.Writer, title string, band float64) error {
	samples, marks, names := tl.Data()
	if len(samples) == 0 {
		return fmt.Errorf("the timeline has no samples")
	}
	img := image.NewRGBA(image.Rect(0, 0, plotW, plotH))
	draw.Draw(img, img.Bounds(), &image.Uniform{white}, image.Point{}, draw.Src)

	tMax := samples[len(samples)-1].T.Seconds()
	yMax := 0
	for _, s := range samples {
		for _, h := range s.Held {
			yMax = max(yMax, h)
		}
	}
	yTop := niceCeil(float64(yMax) * 1.05)
	x0, x1, y0, y1 := marginL, plotW-marginR, plotH-marginB, marginT
	px := func(sec float64) int { return x0 + int(math.Round(sec/tMax*float64(x1-x0))) }
	py := func(v float64) int { return y0 - int(math.Round(v/yTop*float64(y0-y1))) }
	area := image.Rect(x0, y1, x1+1, y0+1)

	// The average and its band, behind everything.
	avgAt := func(s Sample) float64 {
		if len(s.Held) == 0 {
			return 0
		}
		sum := 0
		for _, h := range s.Held {
			sum += h
		}
		return float64(sum) / float64(len(s.Held))
	}
	for i := range samples {
		a := avgAt(samples[i])
		xa := px(samples[i].T.Seconds())
		xb := x1
		if i+1 < len(samples) {
			xb = px(samples[i+1].T.Seconds())
		}
		fillRect(img, xa, py(a*(1+band)), xb, py(a*(1-band)), bandFill, area)
	}

	// Grid and axes.
	xStep := niceStep(tMax / 10)
	for t := 0.0; t <= tMax+1e-9; t += xStep {
		x := px(t)
		vline(img, x, y1, y0, grid, 0)
		text(img, x-8, y0+16, fmt.Sprintf("%g", t), black)
	}
	yStep := niceStep(yTop / 8)
	for v := 0.0; v <= yTop+1e-9; v += yStep {
		y := py(v)
		hline(img, x0, x1, y, grid)
		label := fmt.Sprintf("%g", v)
		text(img, x0-8-7*len(label), y+4, label, black)
	}
	hline(img, x0, x1, y0, black)
	vline(img, x0, y1, y0, black, 0)
	text(img, (x0+x1)/2-70, plotH-12, "time since start (s)", black)
	text(img, 8, y1-14, "connections held", black)
	text(img, x0, 22, title, black)

	// Marks, each label in the first row where it does not overlap the
	// one before it, right-aligned at the right edge.
	var rowEnd []int
	for _, m := range marks {
		x := px(m.T.Seconds())
		vline(img, x, y1, y0, markGrey, 4)
		w := 7 * len(m.Label)
		lx := x + 3
		if lx+w > x1 {
			lx = x - 3 - w
		}
		row := 0
		for row < len(rowEnd) && rowEnd[row] > lx {
			row++
		}
		if row == len(rowEnd) {
			rowEnd = append(rowEnd, 0)
		}
		rowEnd[row] = lx + w + 7
		text(img, lx, y1+12+13*row, m.Label, markGrey)
	}

	// The average line, then the nodes.
	for i := 1; i < len(samples); i++ {
		a, b := samples[i-1], samples[i]
		if (i/3)%2 == 0 {
			line(img, px(a.T.Seconds()), py(avgAt(a)), px(b.T.Seconds()), py(avgAt(b)), black, 1)
		}
	}
	for ni, name := range names {
		c := palette[ni%len(palette)]
		for i := 1; i < len(samples); i++ {
			ha, okA := samples[i-1].Held[name]
			hb, okB := samples[i].Held[name]
			if okA && okB {
				line(img, px(samples[i-1].T.Seconds()), py(float64(ha)), px(samples[i].T.Seconds()), py(float64(hb)), c, 2)
			}
		}
		ly := y1 + 10 + 18*ni
		fillRect(img, x1+12, ly-8, x1+26, ly+2, c, img.Bounds())
		text(img, x1+32, ly+2, name, black)
	}
	ly := y1 + 10 + 18*len(names)
	hline(img, x1+12, x1+26, ly-3, black)
	text(img, x1+32, ly+2, "average", black)
	fillRect(img, x1+12, ly+10, x1+26, ly+20, bandFill, img.Bounds())
	// (basicfont has no ±.)
	text(img, x1+32, ly+20, fmt.Sprintf("+/-%g%%", band*100), black)
	return png.Encode(w, img)
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

// line draws a line of the given width from (xa, ya) to (xb, yb).
func line(img *image.RGBA, xa, ya, xb, yb int, c color.RGBA, width int) {
	steps := max(abs(xb-xa), abs(yb-ya), 1)
	for i := 0; i <= steps; i++ {
		x := xa + (xb-xa)*i/steps
		y := ya + (yb-ya)*i/steps
		for dx := range width {
			for dy := range width {
				img.SetRGBA(x+dx, y+dy, c)
			}
		}
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

// text draws s with its baseline at (x, y).
func text(img *image.RGBA, x, y int, s string, c color.RGBA) {
	d := font.Drawer{Dst: img, Src: &image.Uniform{c}, Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
	d.DrawString(s)
}
