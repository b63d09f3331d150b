package lbpolicy

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func init() {
	caddy.RegisterModule(notASelector{})
}

// notASelector is a Caddyfile unmarshaler registered in the selection
// policies' namespace that is not a selection policy, so that the panic
// wrapper's check for that can be exercised.
type notASelector struct{}

func (notASelector) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.lbx_test_not_a_selector",
		New: func() caddy.Module { return new(notASelector) },
	}
}

func (*notASelector) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	return nil
}

// percent returns a pointer to v, for the optional percentage fields.
func percent(v float64) *float64 { return &v }

// TestLeastTimeUnmarshalCaddyfile parses the least_time policy's block,
// mostly under its earlier name, ewma, which must read as it always did;
// errors name the policy as written.
func TestLeastTimeUnmarshalCaddyfile(t *testing.T) {
	for _, tt := range []struct {
		name  string
		input string
		// Expected fields on success.
		choices Choices
		decay   time.Duration
		weights []int
		panic   *float64
		// Expected error substring, including the "Testfile:N" line;
		// "" means success.
		err string
	}{
		{name: "bare", input: `ewma`},
		{name: "bare least_time", input: `least_time`},
		{name: "empty block", input: "ewma {\n}"},
		{name: "least_time options", input: "least_time {\n\tchoices 3\n\tdecay 2s\n\tweights 1 2\n\tpanic_threshold 10%\n}", choices: 3, decay: 2 * time.Second, weights: []int{1, 2}, panic: percent(10)},
		{name: "least_time error", input: "least_time {\n\tchoices 1\n}", err: `lb_policy least_time: choices "1": must be a number of 2 or more, "all" or "auto", at Testfile:2`},
		{name: "choices 2", input: "ewma {\n\tchoices 2\n}", choices: 2},
		{name: "choices 3", input: "ewma {\n\tchoices 3\n}", choices: 3},
		{name: "choices all", input: "ewma {\n\tchoices all\n}", choices: choicesAll},
		{name: "choices auto", input: "ewma {\n\tchoices auto\n}", choices: choicesAuto},
		{name: "decay", input: "ewma {\n\tdecay 1m30s\n}", decay: 90 * time.Second},
		{name: "decay in days", input: "ewma {\n\tdecay 1d\n}", decay: 24 * time.Hour},
		{name: "one weight", input: "ewma {\n\tweights 4\n}", weights: []int{4}},
		{name: "weights", input: "ewma {\n\tweights 1 2 3\n}", weights: []int{1, 2, 3}},
		{name: "panic_threshold with percent sign", input: "ewma {\n\tpanic_threshold 50%\n}", panic: percent(50)},
		{name: "panic_threshold without percent sign", input: "ewma {\n\tpanic_threshold 100\n}", panic: percent(100)},
		{name: "panic_threshold 0%", input: "ewma {\n\tpanic_threshold 0%\n}", panic: percent(0)},
		{name: "panic_threshold off", input: "ewma {\n\tpanic_threshold off\n}", panic: percent(0)},
		{name: "panic_threshold fraction", input: "ewma {\n\tpanic_threshold 12.5%\n}", panic: percent(12.5)},
		{
			name:    "every option",
			input:   "ewma {\n\tchoices all\n\tdecay 30s\n\tweights 1 1 2\n\tpanic_threshold 25%\n}",
			choices: choicesAll, decay: 30 * time.Second, weights: []int{1, 1, 2}, panic: percent(25),
		},

		{name: "argument after the name", input: "ewma foo", err: `lb_policy ewma: unexpected argument "foo"; options go in a block, at Testfile:1`},
		{name: "argument before the block", input: "ewma 2 {\n\tdecay 1s\n}", err: `lb_policy ewma: unexpected argument "2"; options go in a block, at Testfile:1`},
		{name: "unknown option", input: "ewma {\n\tchoices 2\n\tslow_begin 30s\n}", err: `lb_policy ewma: unknown option "slow_begin" (want choices, decay, weights, panic_threshold, retry_budget, slow_start, outlier or load_reports), at Testfile:3`},
		{name: "repeated option", input: "ewma {\n\tdecay 10s\n\tchoices 2\n\tdecay 20s\n}", err: "lb_policy ewma: decay specified more than once, at Testfile:4"},
		{name: "repeated weights", input: "ewma {\n\tweights 1 2\n\tweights 3\n}", err: "lb_policy ewma: weights specified more than once, at Testfile:3"},

		{name: "choices missing", input: "ewma {\n\tchoices\n}", err: "lb_policy ewma: choices: missing value, at Testfile:2"},
		{name: "choices 1", input: "ewma {\n\tchoices 1\n}", err: `lb_policy ewma: choices "1": must be a number of 2 or more, "all" or "auto", at Testfile:2`},
		{name: "choices 0", input: "ewma {\n\tchoices 0\n}", err: `lb_policy ewma: choices "0": must be a number of 2 or more, "all" or "auto", at Testfile:2`},
		{name: "choices -1", input: "ewma {\n\tchoices -1\n}", err: `lb_policy ewma: choices "-1": must be a number of 2 or more, "all" or "auto", at Testfile:2`},
		{name: "choices x", input: "ewma {\n\tchoices x\n}", err: `lb_policy ewma: choices "x": must be a number of 2 or more, "all" or "auto", at Testfile:2`},
		{name: "choices extra argument", input: "ewma {\n\tchoices 2 3\n}", err: `lb_policy ewma: choices: one value expected, got another: "3", at Testfile:2`},

		{name: "decay missing", input: "ewma {\n\tdecay\n}", err: "lb_policy ewma: decay: missing value, at Testfile:2"},
		{name: "decay not a duration", input: "ewma {\n\tdecay fast\n}", err: `lb_policy ewma: decay "fast": want a duration such as 1s, at Testfile:2`},
		{name: "decay without unit", input: "ewma {\n\tdecay 10\n}", err: `lb_policy ewma: decay "10": want a duration such as 1s, at Testfile:2`},
		{name: "decay zero", input: "ewma {\n\tdecay 0s\n}", err: `lb_policy ewma: decay 0s is below the minimum 1ms, at Testfile:2`},
		{name: "decay negative", input: "ewma {\n\tdecay -1s\n}", err: `lb_policy ewma: decay -1s is below the minimum 1ms, at Testfile:2`},
		{name: "decay extra argument", input: "ewma {\n\tdecay 10s 20s\n}", err: `lb_policy ewma: decay: one value expected, got another: "20s", at Testfile:2`},

		{name: "weights missing", input: "ewma {\n\tweights\n}", err: "lb_policy ewma: weights: missing value, at Testfile:2"},
		{name: "weights block", input: "ewma {\n\tweights {\n\t}\n}", err: "lb_policy ewma: weights: missing value, at Testfile:2"},
		{name: "weight zero", input: "ewma {\n\tweights 1 0\n}", err: `lb_policy ewma: weight 0 is below the minimum 1, at Testfile:2`},
		{name: "weight negative", input: "ewma {\n\tweights -1 1\n}", err: `lb_policy ewma: weight -1 is below the minimum 1, at Testfile:2`},
		{name: "weight not a number", input: "ewma {\n\tweights 1 heavy\n}", err: `lb_policy ewma: weight "heavy": want a whole number of at least 1, at Testfile:2`},
		{name: "weight fraction", input: "ewma {\n\tweights 1.5\n}", err: `lb_policy ewma: weight "1.5": want a whole number of at least 1, at Testfile:2`},

		{name: "panic_threshold missing", input: "ewma {\n\tpanic_threshold\n}", err: "lb_policy ewma: panic_threshold: missing value, at Testfile:2"},
		{name: "panic_threshold over 100", input: "ewma {\n\tpanic_threshold 150%\n}", err: `lb_policy ewma: panic_threshold "150%": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{name: "panic_threshold just over 100", input: "ewma {\n\tpanic_threshold 100.01\n}", err: `lb_policy ewma: panic_threshold "100.01": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{name: "panic_threshold negative", input: "ewma {\n\tpanic_threshold -5%\n}", err: `lb_policy ewma: panic_threshold "-5%": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{name: "panic_threshold word", input: "ewma {\n\tpanic_threshold abc\n}", err: `lb_policy ewma: panic_threshold "abc": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{name: "panic_threshold NaN", input: "ewma {\n\tpanic_threshold NaN\n}", err: `lb_policy ewma: panic_threshold "NaN": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{name: "panic_threshold Inf", input: "ewma {\n\tpanic_threshold Inf%\n}", err: `lb_policy ewma: panic_threshold "Inf%": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{name: "panic_threshold two percent signs", input: "ewma {\n\tpanic_threshold 50%%\n}", err: `lb_policy ewma: panic_threshold "50%%": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{name: "panic_threshold extra argument", input: "ewma {\n\tpanic_threshold 50% 60%\n}", err: `lb_policy ewma: panic_threshold: one value expected, got another: "60%", at Testfile:2`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := new(LeastTimeSelection)
			err := s.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tt.input))
			if !wantErr(t, err, tt.err) {
				return
			}
			if s.Choices != tt.choices {
				t.Errorf("Choices = %v, want %v", s.Choices, tt.choices)
			}
			if got := time.Duration(s.Decay); got != tt.decay {
				t.Errorf("Decay = %v, want %v", got, tt.decay)
			}
			if !slices.Equal(s.Weights, tt.weights) {
				t.Errorf("Weights = %v, want %v", s.Weights, tt.weights)
			}
			if !equalPercent(s.PanicThreshold, tt.panic) {
				t.Errorf("PanicThreshold = %s, want %s", fmtPercent(s.PanicThreshold), fmtPercent(tt.panic))
			}
		})
	}
}

func TestPanicUnmarshalCaddyfile(t *testing.T) {
	for _, tt := range []struct {
		name      string
		input     string
		threshold *float64
		policy    string // the wrapped policy's JSON; "" for none
		// consecutive is the outlier block's consecutive_failures; 0
		// when there is no outlier block
		consecutive int
		err         string // error substring with its line; "" means success
	}{
		{name: "bare", input: `panic`},
		{name: "empty block", input: "panic {\n}"},
		{name: "threshold", input: "panic {\n\tthreshold 25%\n}", threshold: percent(25)},
		{name: "threshold without percent sign", input: "panic {\n\tthreshold 75\n}", threshold: percent(75)},
		{name: "threshold off", input: "panic {\n\tthreshold off\n}", threshold: percent(0)},
		{name: "policy without arguments", input: "panic {\n\tpolicy least_conn\n}", policy: `{"policy":"least_conn"}`},
		{name: "policy with an argument", input: "panic {\n\tpolicy random_choose 3\n}", policy: `{"choose":3,"policy":"random_choose"}`},
		{name: "policy cookie", input: "panic {\n\tpolicy cookie lb_cookie\n}", policy: `{"name":"lb_cookie","policy":"cookie"}`},
		{name: "policy header", input: "panic {\n\tpolicy header X-Upstream\n}", policy: `{"field":"X-Upstream","policy":"header"}`},
		{
			name:   "policy header with fallback block",
			input:  "panic {\n\tpolicy header X-Upstream {\n\t\tfallback first\n\t}\n}",
			policy: `{"fallback":{"policy":"first"},"field":"X-Upstream","policy":"header"}`,
		},
		{
			name:   "policy ewma with block",
			input:  "panic {\n\tpolicy ewma {\n\t\tchoices all\n\t\tweights 2 1\n\t}\n}",
			policy: `{"choices":"all","policy":"ewma","weights":[2,1]}`,
		},
		{
			name:      "threshold after a nested block",
			input:     "panic {\n\tpolicy ewma {\n\t\tchoices 2\n\t}\n\tthreshold 30%\n}",
			threshold: percent(30),
			policy:    `{"choices":2,"policy":"ewma"}`,
		},
		{
			name:      "threshold before policy",
			input:     "panic {\n\tthreshold 10\n\tpolicy first\n}",
			threshold: percent(10),
			policy:    `{"policy":"first"}`,
		},

		{name: "argument after the name", input: "panic least_conn", err: `lb_policy panic: unexpected argument "least_conn"; options go in a block, at Testfile:1`},
		{name: "unknown option", input: "panic {\n\tfallback least_conn\n}", err: `lb_policy panic: unknown option "fallback" (want threshold, outlier, load_reports, slow_start or policy), at Testfile:2`},

		{name: "threshold missing", input: "panic {\n\tthreshold\n}", err: "lb_policy panic: threshold: missing value, at Testfile:2"},
		{name: "threshold over 100", input: "panic {\n\tthreshold 150%\n}", err: `lb_policy panic: threshold "150%": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{name: "threshold negative", input: "panic {\n\tthreshold -5%\n}", err: `lb_policy panic: threshold "-5%": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{name: "threshold word", input: "panic {\n\tthreshold abc\n}", err: `lb_policy panic: threshold "abc": want a percentage from 0% to 100%, or 'off', at Testfile:2`},
		{name: "threshold extra argument", input: "panic {\n\tthreshold 50% 60%\n}", err: `lb_policy panic: threshold: one value expected, got another: "60%", at Testfile:2`},
		{name: "threshold repeated", input: "panic {\n\tthreshold 50%\n\tthreshold 60%\n}", err: "lb_policy panic: threshold specified more than once, at Testfile:3"},
		{name: "threshold off repeated", input: "panic {\n\tthreshold off\n\tthreshold off\n}", err: "lb_policy panic: threshold specified more than once, at Testfile:3"},

		{name: "policy missing", input: "panic {\n\tpolicy\n}", err: "lb_policy panic: policy: missing value, at Testfile:2"},
		{name: "policy panic", input: "panic {\n\tpolicy panic\n}", err: "lb_policy panic: cannot wrap the panic policy in itself, at Testfile:2"},
		{
			name:  "policy unknown",
			input: "panic {\n\tpolicy nosuch\n}",
			err:   "getting module named 'http.reverse_proxy.selection_policies.nosuch': module not registered: http.reverse_proxy.selection_policies.nosuch, at Testfile:2",
		},
		{
			name:  "policy not a selection policy",
			input: "panic {\n\tpolicy lbx_test_not_a_selector\n}",
			err:   "lb_policy panic: module http.reverse_proxy.selection_policies.lbx_test_not_a_selector (*lbpolicy.notASelector) is not a selection policy, at Testfile:2",
		},
		{name: "policy repeated", input: "panic {\n\tpolicy least_conn\n\tpolicy first\n}", err: "lb_policy panic: policy specified more than once, at Testfile:3"},
		{name: "policy argument error", input: "panic {\n\tpolicy least_conn extra\n}", err: "wrong argument count or unexpected line ending after 'extra', at Testfile:2"},
		{name: "policy block error", input: "panic {\n\tpolicy ewma {\n\t\tchoices 2\n\t\tchoices 1\n\t}\n}", err: "lb_policy ewma: choices specified more than once, at Testfile:4"},
		{name: "outlier", input: "panic {\n\toutlier {\n\t\tconsecutive_failures 2\n\t}\n\tpolicy first\n}", policy: `{"policy":"first"}`, consecutive: 2},
		{name: "outlier error", input: "panic {\n\toutlier {\n\t\tconsecutive_failures 0\n\t}\n}", err: `outlier: consecutive_failures 0 is below the minimum 1, at Testfile:3`},
		{name: "outlier repeated", input: "panic {\n\toutlier\n\toutlier\n}", err: "lb_policy panic: outlier specified more than once, at Testfile:3"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := new(PanicSelection)
			err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tt.input))
			if !wantErr(t, err, tt.err) {
				return
			}
			if !equalPercent(p.Threshold, tt.threshold) {
				t.Errorf("Threshold = %s, want %s", fmtPercent(p.Threshold), fmtPercent(tt.threshold))
			}
			if got := string(p.PolicyRaw); got != tt.policy {
				t.Errorf("PolicyRaw = %s, want %s", got, tt.policy)
			}
			if got := p.Outlier; (got == nil) != (tt.consecutive == 0) || got != nil && got.Consecutive != tt.consecutive {
				t.Errorf("Outlier = %+v, want consecutive_failures %d", got, tt.consecutive)
			}
		})
	}
}

// TestCaddyfileOptionsDoNotLeakPastTheirBlock checks that a policy reads
// only its own segment: tokens after the policy's block belong to the
// enclosing directive.
func TestCaddyfileOptionsDoNotLeakPastTheirBlock(t *testing.T) {
	d := caddyfile.NewTestDispenser("ewma {\n\tchoices 2\n}\nnext_directive arg")
	s := new(LeastTimeSelection)
	if err := s.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if !d.Next() || d.Val() != "next_directive" {
		t.Errorf("after the block the dispenser is at %q, want next_directive", d.Val())
	}
}

func equalPercent(a, b *float64) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

func fmtPercent(p *float64) string {
	if p == nil {
		return "nil"
	}
	b, _ := json.Marshal(*p)
	return string(b) + "%"
}

func TestChoicesMarshalJSON(t *testing.T) {
	for _, tt := range []struct {
		c    Choices
		want string
	}{
		{2, `2`},
		{3, `3`},
		{100, `100`},
		{choicesAll, `"all"`},
		{choicesAuto, `"auto"`},
	} {
		got, err := json.Marshal(tt.c)
		if err != nil {
			t.Errorf("Marshal(%v): %v", tt.c, err)
			continue
		}
		if string(got) != tt.want {
			t.Errorf("Marshal(%v) = %s, want %s", tt.c, got, tt.want)
		}
	}
}

func TestChoicesUnmarshalJSON(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want Choices
		err  string // "" means success
	}{
		{in: `2`, want: 2},
		{in: `7`, want: 7},
		{in: `"all"`, want: choicesAll},
		{in: `"auto"`, want: choicesAuto},
		{in: `0`, want: choicesAuto}, // the value of an absent field
		{in: `"2"`, want: 2},

		{in: `1`, err: `choices 1: must be a number of 2 or more, "all" or "auto"`},
		{in: `-1`, err: `choices -1: must be a number of 2 or more, "all" or "auto"`},
		{in: `-2`, err: `choices -2: must be a number of 2 or more, "all" or "auto"`},
		{in: `2.5`, err: `choices 2.5: must be a number of 2 or more, "all" or "auto"`},
		{in: `true`, err: `choices true: must be a number of 2 or more, "all" or "auto"`},
		{in: `{}`, err: `choices {}: must be a number of 2 or more, "all" or "auto"`},
		{in: `"1"`, err: `choices "1": must be a number of 2 or more, "all" or "auto"`},
		{in: `"0"`, err: `choices "0": must be a number of 2 or more, "all" or "auto"`},
		{in: `"-1"`, err: `choices "-1": must be a number of 2 or more, "all" or "auto"`},
		{in: `"most"`, err: `choices "most": must be a number of 2 or more, "all" or "auto"`},
		{in: `""`, err: `choices "": must be a number of 2 or more, "all" or "auto"`},
	} {
		var c Choices
		err := json.Unmarshal([]byte(tt.in), &c)
		switch {
		case tt.err == "" && err != nil:
			t.Errorf("Unmarshal(%s): %v", tt.in, err)
		case tt.err == "" && c != tt.want:
			t.Errorf("Unmarshal(%s) = %v, want %v", tt.in, c, tt.want)
		case tt.err != "" && err == nil:
			t.Errorf("Unmarshal(%s) = %v, want an error containing %q", tt.in, c, tt.err)
		case tt.err != "" && !strings.Contains(err.Error(), tt.err):
			t.Errorf("Unmarshal(%s): error %q, want it to contain %q", tt.in, err, tt.err)
		}
	}

	// null is no value: it leaves the field as it was.
	c := Choices(3)
	if err := json.Unmarshal([]byte(`null`), &c); err != nil || c != 3 {
		t.Errorf("Unmarshal(null) over 3 = %v, %v; want 3, nil", c, err)
	}
}

func TestChoicesJSONRoundTrip(t *testing.T) {
	for _, c := range []Choices{2, 3, 16, 1000, choicesAll, choicesAuto} {
		b, err := json.Marshal(c)
		if err != nil {
			t.Fatalf("Marshal(%v): %v", c, err)
		}
		var back Choices
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatalf("Unmarshal(%s): %v", b, err)
		}
		if back != c {
			t.Errorf("%v -> %s -> %v", c, b, back)
		}
		if err := back.validate(); err != nil {
			t.Errorf("%v does not validate after a round trip: %v", c, err)
		}
	}

	// Inside the policy, the default is omitted and the rest is kept.
	for _, tt := range []struct {
		c    Choices
		want string
	}{
		{choicesAuto, `{}`},
		{choicesAll, `{"choices":"all"}`},
		{2, `{"choices":2}`},
	} {
		b, err := json.Marshal(&LeastTimeSelection{Choices: tt.c})
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != tt.want {
			t.Errorf("LeastTimeSelection{Choices: %v} = %s, want %s", tt.c, b, tt.want)
		}
		var s LeastTimeSelection
		if err := json.Unmarshal(b, &s); err != nil || s.Choices != tt.c {
			t.Errorf("%s decodes to Choices %v (%v), want %v", b, s.Choices, err, tt.c)
		}
	}
}

func TestChoicesValidate(t *testing.T) {
	for _, c := range []Choices{choicesAll, choicesAuto, 2, 50} {
		if err := c.validate(); err != nil {
			t.Errorf("Choices(%d).validate() = %v, want nil", int(c), err)
		}
	}
	for _, c := range []Choices{1, -2, -100} {
		err := c.validate()
		if err == nil || !strings.Contains(err.Error(), `must be a number of 2 or more, "all" or "auto"`) {
			t.Errorf("Choices(%d).validate() = %v, want an error", int(c), err)
		}
	}
}

func TestChoicesString(t *testing.T) {
	for c, want := range map[Choices]string{choicesAll: "all", choicesAuto: "auto", 2: "2", 10: "10"} {
		if got := c.String(); got != want {
			t.Errorf("Choices(%d).String() = %q, want %q", int(c), got, want)
		}
	}
}

// wantErr checks err against want: an error containing want, or no error
// when want is empty. It reports whether the test should go on to check
// the parsed value (no error was wanted).
func wantErr(t *testing.T, err error, want string) bool {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Fatalf("unexpected error: %v", err)
	case want != "" && err == nil:
		t.Fatalf("no error; want one containing %q", want)
	case want != "" && !strings.Contains(err.Error(), want):
		t.Fatalf("wrong error\n got: %v\nwant it to contain: %s", err, want)
	}
	return want == ""
}
