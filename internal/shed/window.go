package shed

// Window is the mean of the last N samples of a load: a node samples its
// load every interval and gossips the mean over `history` (OneFS
// SmartConnect samples connection counts every 10 s and averages them over
// a minute). A mean over a window, unlike an EWMA, forgets a sample
// completely after the window, so a node that shed connections is seen
// at its new load after `history` at the latest. The zero value is not
// usable; use NewWindow. A Window is not safe for concurrent use.
type Window struct {
	samples []float64
	next    int
	n       int
	sum     float64
}

// NewWindow returns a window of size samples (at least 1).
func NewWindow(size int) *Window {
	return &Window{samples: make([]float64, max(size, 1))}
}

// Size returns the window's capacity in samples.
func (w *Window) Size() int { return len(w.samples) }

// Add records a sample and returns the new mean.
func (w *Window) Add(v float64) float64 {
	if w.n == len(w.samples) {
		w.sum -= w.samples[w.next]
	} else {
		w.n++
	}
	w.samples[w.next] = v
	w.sum += v
	w.next = (w.next + 1) % len(w.samples)
	// Recompute now and then so float error cannot accumulate.
	if w.next == 0 {
		w.sum = 0
		for _, s := range w.samples[:w.n] {
			w.sum += s
		}
	}
	return w.Mean()
}

// Mean returns the mean of the samples in the window, 0 when empty.
func (w *Window) Mean() float64 {
	if w.n == 0 {
		return 0
	}
	return w.sum / float64(w.n)
}

// Sum returns the sum of the samples in the window.
func (w *Window) Sum() float64 { return w.sum }

// Fading returns the sum of the samples in the window, each weighted by
// how much of the window it has still to go: the newest by 1, the one
// before by 1 − 1/size, the oldest by 1/size. It is what is still out of
// what was sent at each sample, when each returns at a time drawn
// uniformly over the window (WithShedInFlight).
func (w *Window) Fading() float64 {
	size := len(w.samples)
	var sum float64
	for age := range w.n {
		v := w.samples[(w.next-1-age+2*size)%size]
		sum += v * float64(size-age) / float64(size)
	}
	return sum
}

// Len returns the number of samples in the window.
func (w *Window) Len() int { return w.n }

// Resize changes the window's size, keeping the most recent samples that
// fit (a reload may change history or interval).
func (w *Window) Resize(size int) {
	size = max(size, 1)
	if size == len(w.samples) {
		return
	}
	// Oldest to newest.
	recent := make([]float64, 0, w.n)
	for i := range w.n {
		recent = append(recent, w.samples[(w.next-w.n+i+len(w.samples))%len(w.samples)])
	}
	if len(recent) > size {
		recent = recent[len(recent)-size:]
	}
	nw := NewWindow(size)
	for _, v := range recent {
		nw.Add(v)
	}
	*w = *nw
}
