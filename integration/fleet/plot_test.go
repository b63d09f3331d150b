package fleet

import (
	"image"
	"io"
	"testing"
	"time"
)

// TestWritePNG draws a small timeline and checks the PNG: its size, and
// that each node's line is there in its colour.
func TestWritePNG(t *testing.T) {
	tl := NewTimeline()
	for i := range 40 {
		held := map[string]int{"n1": 100 - i, "n2": 70 - i}
		if i >= 10 {
			held["n3"] = 2 * (i - 10)
		}
		tl.samples = append(tl.samples, Sample{T: time.Duration(i) * 250 * time.Millisecond, Held: held})
	}
	tl.names = []string{"n1", "n2", "n3"}
	tl.marks = []Mark{{T: 2500 * time.Millisecond, Label: "n3 joins"}}
	img := drawPNG(t, func(w io.Writer) error { return tl.WritePNG(w, "test", 0.2) })
	area := image.Rect(marginL, marginT, plotW-marginR, plotH-marginB)
	for i, name := range tl.names {
		if n := countColour(img, area, palette[i]); n < 100 {
			t.Errorf("%s's line: %d pixels of its colour in the plot area; want a line", name, n)
		}
	}
	if err := NewTimeline().WritePNG(io.Discard, "empty", 0.2); err == nil {
		t.Error("an empty timeline drew a plot")
	}
}
