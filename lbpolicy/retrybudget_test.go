package lbpolicy

import (
	"net/http"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/caddy-lbx/lbx/internal/hoststate"
)

func newBudget(t *testing.T, b *RetryBudget) *RetryBudget {
	t.Helper()
	if err := b.validate(); err != nil {
		t.Fatal(err)
	}
	b.provision(zap.NewNop())
	return b
}

func TestRetryBudgetAdmit(t *testing.T) {
	b := newBudget(t, &RetryBudget{})
	pool := reverseproxy.UpstreamPool{{Host: new(reverseproxy.Host), Dial: "a:80"}}

	if !b.admit(pool, nil) {
		t.Fatal("a selection without a request (not from reverse_proxy) must be admitted")
	}
	bare, _ := http.NewRequest(http.MethodGet, "http://example/", nil)
	if !b.admit(pool, bare) || !b.admit(pool, bare) {
		t.Fatal("a request without variables cannot be told apart from its retry: admit")
	}

	r := clientRequest()
	if !b.admit(pool, r) {
		t.Fatal("first attempt refused")
	}
	if b.isRetry(r.Context()) {
		t.Fatal("first attempt marked as a retry")
	}
	// Fewer retries in flight than the floor (3): admitted, however few
	// requests are in flight.
	b.inFlight.Store(2)
	if !b.admit(pool, r) {
		t.Fatal("retry under the floor refused")
	}
	if !b.isRetry(r.Context()) {
		t.Fatal("granted retry not marked as one")
	}
	// The retry is marked in the replacer: reverse_proxy's transport may
	// still be dialing for the first attempt and reading the variables.
	if vars := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any); len(vars) != 1 || vars[retryBudgetVar] != &b.first {
		t.Fatalf("a retry wrote the request's variables: %v", vars)
	}
	// At the floor, with nothing else in flight (20% of 0 is 0): refused.
	b.inFlight.Store(3)
	if b.admit(pool, r) {
		t.Fatal("retry at the floor with no requests in flight admitted")
	}
	if b.refused.Load() != 1 {
		t.Fatalf("refused = %d, want 1", b.refused.Load())
	}
	// Another request's first attempt is not a retry, whatever the budget.
	if !b.admit(pool, clientRequest()) {
		t.Fatal("first attempt of another request refused")
	}

	zero := newBudget(t, &RetryBudget{MinConcurrent: new(int)})
	r = clientRequest()
	zero.admit(pool, r)
	if zero.admit(pool, r) {
		t.Fatal("min_concurrent 0 and no requests in flight: a retry must be refused")
	}
}

// TestRetryBudgetCountsRetriesInFlight: the transport counts an attempt the
// budget granted as a retry while it is under way, and only that one.
func TestRetryBudgetCountsRetriesInFlight(t *testing.T) {
	b := newBudget(t, &RetryBudget{})
	table := hoststate.NewTable(hoststate.Config{})
	t.Cleanup(table.Release)
	u := &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: t.Name() + ":80"}
	release := make(chan struct{})
	ot := &observingTransport{inner: held(release), table: table}
	ot.budget = b

	r := clientRequest()
	attempt := func() <-chan error {
		done := make(chan error, 1)
		go func() {
			_, err := ot.RoundTrip(r.WithContext(withDialInfo(r.Context(), u)))
			done <- err
		}()
		return done
	}
	b.admit(reverseproxy.UpstreamPool{u}, r) // first attempt
	done := attempt()
	release <- struct{}{}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := b.inFlight.Load(); n != 0 {
		t.Fatalf("a first attempt counted as a retry: %d in flight", n)
	}

	b.admit(reverseproxy.UpstreamPool{u}, r) // the retry
	done = attempt()
	deadline := time.Now().Add(5 * time.Second)
	for b.inFlight.Load() != 1 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if n := b.inFlight.Load(); n != 1 {
		t.Fatalf("retry under way: %d in flight, want 1", n)
	}
	release <- struct{}{}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := b.inFlight.Load(); n != 0 {
		t.Fatalf("finished retry still counted: %d in flight", n)
	}
}

// held answers each request once it receives from release.
type held chan struct{}

func (h held) RoundTrip(*http.Request) (*http.Response, error) {
	<-h
	return &http.Response{StatusCode: 200, Body: http.NoBody}, nil
}

func TestRetryBudgetUnmarshalCaddyfile(t *testing.T) {
	for _, tc := range []struct {
		input, wantErr string
		percent        float64
		min            int
	}{
		{input: "retry_budget", percent: 20, min: 3},
		{input: "retry_budget 35%", percent: 35, min: 3},
		{input: "retry_budget 10 {\n min_concurrent 0\n}", percent: 10, min: 0},
		{input: "retry_budget {\n min_concurrent 8\n}", percent: 20, min: 8},
		{input: "retry_budget 120%", wantErr: `lb_policy ewma: retry_budget "120%": want a percentage from 0% to 100%, or 'off', at Testfile:1`},
		{input: "retry_budget 20% 30%", wantErr: `lb_policy ewma: retry_budget: one value expected, got another: "30%", at Testfile:1`},
		{input: "retry_budget {\n min_concurrent\n}", wantErr: "lb_policy ewma: retry_budget: min_concurrent: missing value, at Testfile:2"},
		{input: "retry_budget {\n min_concurrent -1\n}", wantErr: `min_concurrent -1 is below the minimum 0`},
		{input: "retry_budget {\n min_concurrent 1 2\n}", wantErr: `lb_policy ewma: retry_budget: min_concurrent: one value expected, got another: "2", at Testfile:2`},
		{input: "retry_budget {\n min_concurrent 1\n min_concurrent 2\n}", wantErr: "min_concurrent specified more than once"},
		{input: "retry_budget {\n percent 10\n}", wantErr: `lb_policy ewma: retry_budget: unknown option "percent" (want min_concurrent), at Testfile:2`},
	} {
		t.Run(tc.input, func(t *testing.T) {
			var b RetryBudget
			if !unmarshalOption(t, tc.input, tc.wantErr, func(d *caddyfile.Dispenser) error { return b.unmarshalCaddyfile(d, "lb_policy ewma") }) {
				return
			}
			b.provision(zap.NewNop())
			if *b.Percent != tc.percent || *b.MinConcurrent != tc.min {
				t.Fatalf("got percent %v, min_concurrent %d; want %v, %d", *b.Percent, *b.MinConcurrent, tc.percent, tc.min)
			}
		})
	}
}
