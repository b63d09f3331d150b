package partition

import (
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// TestUnmarshalCaddyfileDirect checks the unmarshaler on its own, without
// the HTTP Caddyfile adapter around it.
func TestUnmarshalCaddyfileDirect(t *testing.T) {
	d := caddyfile.NewTestDispenser(`partition {
		to 10.0.0.1:80 0/2 10.0.0.2:80 1/2
		to 10.0.0.1:80 0/2
		fail_limit 2
		merge first
		lb_retries 3
	}`)
	var h Handler
	if err := h.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if len(h.Upstreams) != 3 || h.FailLimit != 2 || h.Retries == nil || *h.Retries != 3 || h.Proxy != nil {
		t.Errorf("upstreams %v fail_limit %d retries %v proxy %+v", h.Upstreams, h.FailLimit, h.Retries, h.Proxy)
	}
	if string(h.MergeRaw) != `{"merger":"first"}` {
		t.Errorf("merge %s", h.MergeRaw)
	}
}

// TestUnmarshalRejectAndRetries covers reject and lb_retries on the
// unmarshaler alone, error paths included.
func TestUnmarshalRejectAndRetries(t *testing.T) {
	d := caddyfile.NewTestDispenser("partition {\n" +
		"to 10.0.0.1:80 0/1\n" +
		"reject `{http.request.method} == 'DELETE'`\n" +
		"reject `{http.request.uri.query.n} == '0'` \"n must not be 0\"\n" +
		"lb_retries 0\n" +
		"}")
	var h Handler
	if err := h.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if h.Retries == nil || *h.Retries != 0 {
		t.Errorf("lb_retries 0: retries %v; want a pointer to 0", h.Retries)
	}
	if len(h.Reject) != 2 || h.Reject[0].Message != "" || h.Reject[1].Message != "n must not be 0" {
		t.Fatalf("reject rules %+v", h.Reject)
	}
	if got := string(h.Reject[1].MatchRaw["expression"]); got != `"{http.request.uri.query.n} == '0'"` {
		t.Errorf("reject[1] expression %s", got)
	}

	var absent Handler
	if err := absent.UnmarshalCaddyfile(caddyfile.NewTestDispenser("partition {\nto 10.0.0.1:80 0/1\n}")); err != nil {
		t.Fatal(err)
	}
	if absent.Retries != nil {
		t.Errorf("no lb_retries: retries %v; want nil (the default applies)", *absent.Retries)
	}

	for in, want := range map[string]string{
		"reject":                       "partition: reject: missing value, at Testfile:3",
		"reject `true` a b":            "got 3 argument(s)",
		"reject `1 +`":                 "reject: invalid expression `1 +`: compiling CEL program",
		"reject `'x'`":                 "CEL request matcher expects return type of bool",
		"reject ``":                    "reject: empty expression",
		"skip `{partition.index} = 1`": "skip: invalid expression",
		"lb_retries":                   "lb_retries: missing value",
		"lb_retries x":                 `partition: lb_retries "x": want a whole number, at Testfile:3`,
		"lb_retries 1 2":               `partition: lb_retries: one value expected, got another: "2", at Testfile:3`,
		"lb_retries 1\nlb_retries 1":   "lb_retries specified more than once",
		"lb_retries -2":                "partition: lb_retries -2 is below the minimum 0, at Testfile:3",
	} {
		var h Handler
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("partition {\nto 10.0.0.1:80 0/1\n" + in + "\n}"))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v; want one containing %q", in, err, want)
		}
	}
}

func TestResolveRetries(t *testing.T) {
	n := func(v int) *int { return &v }
	for _, tc := range []struct {
		name    string
		retries *int
		lb      reverseproxy.LoadBalancing
		want    int
		err     string
	}{
		{name: "absent: the default", want: defaultRetries},
		{name: "0 means none", retries: n(0), want: 0},
		{name: "explicit", retries: n(3), want: 3},
		{name: "proxy's own", lb: reverseproxy.LoadBalancing{Retries: 2}, want: 2},
		{name: "try_duration alone bounds retries", lb: reverseproxy.LoadBalancing{TryDuration: caddy.Duration(time.Second)}, want: 0},
		{name: "0 with try_duration", retries: n(0), lb: reverseproxy.LoadBalancing{TryDuration: caddy.Duration(time.Second)}, want: 0},
		{name: "both", retries: n(0), lb: reverseproxy.LoadBalancing{Retries: 2}, err: "retries given twice: 0, and 2 in proxy.load_balancing.retries"},
	} {
		got, err := resolveRetries(tc.retries, &tc.lb)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%s: error %v; want %q", tc.name, err, tc.err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s: %d, %v; want %d", tc.name, got, err, tc.want)
		}
	}
}
