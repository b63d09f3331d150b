package fleet

import (
	"bytes"
	"image"
	"image/color"
	"image/png"
	"io"
	"math"
	"testing"
)

// TestChartWritePNG draws a log-x chart of two series with points over
// cluster sizes, one of them with a gap, and checks the PNG: its size,
// and each series' colour in the plot area (the palette's first two).
// A chart without points, and a log-x chart with an x of 0, draw
// nothing.
func TestChartWritePNG(t *testing.T) {
	sizes := []float64{16, 32, 64, 128, 256}
	c := Chart{
		Title: "report age against cluster size", XLabel: "members", YLabel: "ms", LogX: true,
		Series: []Series{
			{Name: "reach 50%", X: sizes, Y: []float64{120, 180, 260, 330, 420}, Points: true},
			{Name: "reach 99% (a long legend entry)", X: sizes, Y: []float64{300, 450, math.NaN(), 800, 1000}, Points: true},
		},
		Marks: []ChartMark{{X: 100, Label: "100"}},
	}
	img := drawPNG(t, c.WritePNG)
	area := image.Rect(marginL, marginT, plotW-marginR-textWidth(c.Series[1].Name), plotH-marginB)
	for i, s := range c.Series {
		if n := countColour(img, area, palette[i]); n < 100 {
			t.Errorf("%s: %d pixels of its colour in the plot area; want a line", s.Name, n)
		}
	}

	for _, bad := range []Chart{
		{},
		{Series: []Series{{Name: "empty"}}},
		{Series: []Series{{Name: "gaps", X: []float64{1, 2}, Y: []float64{math.NaN(), math.NaN()}}}},
		{LogX: true, Series: []Series{{Name: "zero", X: []float64{0, 2}, Y: []float64{1, 2}}}},
	} {
		if err := bad.WritePNG(io.Discard); err == nil {
			t.Errorf("%+v: drew a plot", bad)
		}
	}
}

// TestChartColours: a series' own colour, and a dashed one's black, are
// what is drawn.
func TestChartColours(t *testing.T) {
	x := []float64{0, 10, 20, 30}
	teal := color.RGBA{0x00, 0x80, 0x80, 0xff}
	c := Chart{Series: []Series{
		{Name: "teal", X: x, Y: []float64{10, 20, 10, 20}, Color: teal},
		{Name: "average", X: x, Y: []float64{15, 15, 15, 15}, Dashed: true},
	}}
	img := drawPNG(t, c.WritePNG)
	// Inside the frame, off the axes.
	area := image.Rect(marginL+2, marginT, plotW-marginR, plotH-marginB-2)
	if n := countColour(img, area, teal); n < 100 {
		t.Errorf("teal: %d pixels", n)
	}
	if n := countColour(img, area, black); n < 100 || n > 3*(plotW-marginL-marginR)/4 {
		t.Errorf("dashed average: %d black pixels; want a dashed line", n)
	}
}

// TestRelativeBand: a span per point, up to the next one, ±frac around
// the middle.
func TestRelativeBand(t *testing.T) {
	got := RelativeBand([]float64{0, 1, 3}, []float64{100, 50, 10}, 0.2)
	want := []BandSpan{{0, 1, 80, 120}, {1, 3, 40, 60}, {3, 3, 8, 12}}
	if len(got) != len(want) {
		t.Fatalf("%v; want %v", got, want)
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.X0 != w.X0 || g.X1 != w.X1 || math.Abs(g.Lo-w.Lo) > 1e-9 || math.Abs(g.Hi-w.Hi) > 1e-9 {
			t.Errorf("span %d: %v; want %v", i, g, w)
		}
	}
}

// countColour counts the pixels of colour c in r.
// drawPNG draws with draw and decodes the PNG, failing the test on an
// error or a size other than the plots'.
func drawPNG(t *testing.T, draw func(io.Writer) error) image.Image {
	t.Helper()
	var buf bytes.Buffer
	if err := draw(&buf); err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() != plotW || b.Dy() != plotH {
		t.Fatalf("size %v; want %dx%d", b, plotW, plotH)
	}
	return img
}

func countColour(img image.Image, r image.Rectangle, c color.RGBA) int {
	n := 0
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			if color.RGBAModel.Convert(img.At(x, y)).(color.RGBA) == c {
				n++
			}
		}
	}
	return n
}
