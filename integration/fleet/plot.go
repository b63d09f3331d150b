package fleet

import (
	"fmt"
	"io"
	"math"
)

// WritePNG draws the timeline as a PNG (a Chart): one line per node
// (connections held over time), the cluster average (dashed) with the
// ±band around it shaded, and a vertical line for each mark. title goes
// on top.
func (tl *Timeline) WritePNG(w io.Writer, title string, band float64) error {
	samples, marks, names := tl.Data()
	if len(samples) == 0 {
		return fmt.Errorf("the timeline has no samples")
	}
	x, avg := make([]float64, len(samples)), make([]float64, len(samples))
	for i, s := range samples {
		x[i] = s.T.Seconds()
		sum := 0
		for _, h := range s.Held {
			sum += h
		}
		if len(s.Held) > 0 {
			avg[i] = float64(sum) / float64(len(s.Held))
		}
	}
	c := Chart{Title: title, XLabel: "time since start (s)", YLabel: "connections held",
		Band: RelativeBand(x, avg, band), BandLabel: fmt.Sprintf("±%g%%", band*100)}
	for _, name := range names {
		held := make([]float64, len(samples))
		for i, s := range samples {
			h, ok := s.Held[name]
			held[i] = float64(h)
			if !ok {
				held[i] = math.NaN()
			}
		}
		c.Series = append(c.Series, Series{Name: name, X: x, Y: held})
	}
	c.Series = append(c.Series, Series{Name: "average", X: x, Y: avg, Dashed: true})
	for _, m := range marks {
		c.Marks = append(c.Marks, ChartMark{X: m.T.Seconds(), Label: m.Label})
	}
	return c.WritePNG(w)
}
