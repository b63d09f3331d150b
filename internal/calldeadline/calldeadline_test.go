package calldeadline

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"
)

// slowReader returns its data after a delay.
type slowReader struct {
	data  io.Reader
	delay time.Duration
}

func (s *slowReader) Read(p []byte) (int, error) {
	time.Sleep(s.delay)
	return s.data.Read(p)
}

func TestStart(t *testing.T) {
	ctx := context.Background()
	if _, ok := Start(ctx, 0); ok {
		t.Error("no timeout and no outer deadline: want none")
	}
	before := time.Now()
	d, ok := Start(ctx, time.Second)
	if !ok || d.Before(before.Add(time.Second)) || d.After(time.Now().Add(time.Second)) {
		t.Errorf("timeout 1s: %v %v, want now + 1s", d, ok)
	}
	outer := time.Now().Add(time.Hour)
	if d, ok := Start(With(ctx, outer), time.Second); !ok || !d.Equal(outer) {
		t.Errorf("outer deadline: %v, want the outer one %v", d, outer)
	}
}

// A writer that cannot set read deadlines (a recorder) leaves the read
// unbounded, and a body that ends after the deadline is still a timeout;
// one that ends before it is read whole, and an HTTP/1 timeout is marked
// Connection: close.
func TestReadBody(t *testing.T) {
	r := httptest.NewRequest(http.MethodPost, "/", &slowReader{data: strings.NewReader("hello"), delay: 30 * time.Millisecond})
	w := httptest.NewRecorder()
	if _, err := ReadBody(w, r, 100, time.Now().Add(10*time.Millisecond)); !errors.Is(err, ErrBodyTimeout) {
		t.Fatalf("body after the deadline: %v, want ErrBodyTimeout", err)
	}
	if w.Header().Get("Connection") != "close" {
		t.Error("no Connection: close after a body timeout on HTTP/1")
	}
	r = httptest.NewRequest(http.MethodPost, "/", strings.NewReader("hello"))
	w = httptest.NewRecorder()
	b, err := ReadBody(w, r, 100, time.Now().Add(time.Minute))
	if err != nil || string(b) != "hello" || w.Header().Get("Connection") != "" {
		t.Fatalf("body in time: %q %v %v", b, err, w.Header())
	}
	r = httptest.NewRequest(http.MethodPost, "/", strings.NewReader("hello"))
	if b, err := ReadBody(httptest.NewRecorder(), r, 3, time.Time{}); err != nil || string(b) != "hell" {
		t.Fatalf("limit 3: %q %v, want the 4 bytes that tell it is larger", b, err)
	}
}

// errReader fails with err.
type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

func TestStreamLate(t *testing.T) {
	r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("hello"))
	s := StreamBody(httptest.NewRecorder(), r, time.Time{})
	if _, err := io.ReadAll(r.Body); err != nil || !s.Complete() || s.Late(time.Now().Add(-time.Second)) {
		t.Fatalf("a body read whole is never late: %v complete=%v", err, s.Complete())
	}
	r = httptest.NewRequest(http.MethodPost, "/", errReader{os.ErrDeadlineExceeded})
	s = StreamBody(httptest.NewRecorder(), r, time.Time{})
	_, _ = io.ReadAll(r.Body)
	if !s.Late(time.Time{}) {
		t.Error("a read that timed out: want late")
	}
	r = httptest.NewRequest(http.MethodPost, "/", strings.NewReader("hello"))
	s = StreamBody(httptest.NewRecorder(), r, time.Time{})
	if s.Late(time.Now().Add(time.Second)) || !s.Late(time.Now().Add(-time.Second)) {
		t.Error("an unread body is late once the deadline passed, not before")
	}
}

func TestBound(t *testing.T) {
	ctx := context.Background()
	got, cancel := Bound(ctx, time.Time{}, nil)
	cancel()
	if got != ctx {
		t.Error("no deadline: want ctx as it is")
	}
	cause := errors.New("call timeout")
	end := time.Now().Add(20 * time.Millisecond)
	got, cancel = Bound(ctx, end, cause)
	defer cancel()
	if d, ok := got.Deadline(); !ok || !d.Equal(end) {
		t.Errorf("context deadline %v %v, want %v", d, ok, end)
	}
	if d, ok := From(got); !ok || !d.Equal(end) {
		t.Errorf("carried deadline %v %v, want %v", d, ok, end)
	}
	<-got.Done()
	if !errors.Is(context.Cause(got), cause) {
		t.Errorf("cause %v, want %v", context.Cause(got), cause)
	}
}
