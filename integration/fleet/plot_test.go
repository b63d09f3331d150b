package fleet

import (
	"bytes"
	"image/png"
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
	var buf bytes.Buffer
	if err := tl.WritePNG(&buf, "test", 0.2); err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() != plotW || b.Dy() != plotH {
		t.Fatalf("size %v", b)
	}
	found := map[int]int{}
	for y := marginT; y < plotH-marginB; y++ {
		for x := marginL; x < plotW-marginR; x++ {
			r, g, b, _ := img.At(x, y).RGBA()
			for i := range 3 {
				p := palette[i]
				if uint8(r>>8) == p.R && uint8(g>>8) == p.G && uint8(b>>8) == p.B {
					found[i]++
				}
			}
		}
	}
	for i, name := range tl.names {
		if found[i] < 100 {
			t.Errorf("%s's line: %d pixels of its colour in the plot area; want a line", name, found[i])
		}
	}
	if err := NewTimeline().WritePNG(&buf, "empty", 0.2); err == nil {
		t.Error("an empty timeline drew a plot")
	}
}
