package main

import (
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestKeyStream checks that a seed's key stream is the same every time,
// differs between seeds, stays within the keys, and follows the Zipf law:
// the hottest key's share is 1/H(keys, s), within sampling error.
func TestKeyStream(t *testing.T) {
	const keys, n, s = 1000, 1 << 16, 1.1
	a := keyStream(7, s, keys, n)
	if b := keyStream(7, s, keys, n); !slices.Equal(a, b) {
		t.Fatal("the same seed drew two different streams")
	}
	c := keyStream(8, s, keys, n)
	if slices.Equal(a, c) {
		t.Fatal("seeds 7 and 8 drew the same stream")
	}
	hottest := func(stream []int32) (int32, float64) {
		count := map[int32]int{}
		for _, k := range stream {
			if k < 0 || k >= keys {
				t.Fatalf("key %d outside [0, %d)", k, keys)
			}
			count[k]++
		}
		var top int32
		for k, c := range count {
			if c > count[top] || (c == count[top] && k < top) {
				top = k
			}
		}
		return top, float64(count[top]) / float64(len(stream))
	}
	topA, share := hottest(a)
	want := zipfTopShare(s, keys)
	// n = 65536 draws of p ≈ 0.13: the standard error is ≈0.0013
	if math.Abs(share-want) > 0.01 {
		t.Errorf("the hottest key has %.4f of the stream, want %.4f (1/H)", share, want)
	}
	if topC, _ := hottest(c); topC == topA {
		// the ranks are permuted per seed; a tie is 1 chance in 1000
		t.Errorf("seeds 7 and 8 have the same hottest key %d", topA)
	}
	// H(1, s) is 1; H(2, 1) is 1.5
	if got := zipfTopShare(1, 2); math.Abs(got-2.0/3) > 1e-12 {
		t.Errorf("zipfTopShare(1, 2) = %v, want 2/3", got)
	}
}

// TestMovementOf checks the removal's counts on a made-up placement of
// 16 keys on 4 backends, with backend 1 removed.
func TestMovementOf(t *testing.T) {
	before := []int{0, 1, 2, 3, 1, 1, 1, 0, 2, 3, 0, 2, -1, 3, 1, 0}
	after := []int{0, 2, 2, 3, 3, 0, 2, 0, 2, 0, 0, 2, 2, 3, 0, -1}
	m := movementOf(before, after, 1, 4)
	want := movement{
		Keys: 14, Failed: 2,
		Owned: 5, Moved: 6, MovedOther: 1, // keys 1, 4, 5, 6, 14 must move; key 9 moves needlessly
		Receivers: 3, LargestPart: 40, // 0 and 2 take two each, 3 one
		MovedPct: 100 * 6.0 / 14, OfMinimum: 6 / (14.0 / 4),
	}
	if m != want {
		t.Errorf("movementOf:\n got %+v\nwant %+v", m, want)
	}
	if m := movementOf([]int{1, 1}, []int{1, 0}, 1, 2); m.RemovedAfter != 1 {
		t.Errorf("a key still on the removed backend: RemovedAfter %d, want 1", m.RemovedAfter)
	}
}

// TestBalanceOf checks the balance of made-up samples of 8 backends.
func TestBalanceOf(t *testing.T) {
	if got := hashBound(1.25, 64, 8); got != 11 { // ceil(1.25 × 65 ÷ 8) = ceil(10.16)
		t.Errorf("hashBound(1.25, 64, 8) = %d, want 11", got)
	}
	var samples []inFlight
	for range 97 {
		samples = append(samples, inFlight{max: 10, total: 64}) // 1.25 ×: within both
	}
	samples = append(samples,
		inFlight{max: 11, total: 64}, // 1.375 ×: at the bound, above 1.25 ×
		inFlight{max: 12, total: 64}, // above both
		inFlight{max: 16, total: 64}, // 2 ×
		inFlight{},                   // nothing in flight: left out
	)
	b := balanceOf(samples, 8, 1.25, 64)
	if b.Samples != 100 || b.MeanInFlight != 8 {
		t.Fatalf("%d samples of mean %v, want 100 of 8", b.Samples, b.MeanInFlight)
	}
	if b.RatioP50 != 1.25 || b.RatioP99 != 1.5 || b.RatioMax != 2 || b.BoundRatio != 1.375 {
		t.Errorf("ratios p50 %v p99 %v max %v bound %v, want 1.25, 1.5, 2 and 1.375", b.RatioP50, b.RatioP99, b.RatioMax, b.BoundRatio)
	}
	if b.OverBoundPct != 2 || b.OverFactorPct != 3 || b.OverCapPct != 2 {
		t.Errorf("above the bound %v%%, above 1.25 × %v%%, above the clients' bound %v%%, want 2%%, 3%% and 2%%", b.OverBoundPct, b.OverFactorPct, b.OverCapPct)
	}
	// fewer in flight at the backends than the front can hold: 10 of 48
	// is above the bound at 48 (ceil(1.25 × 49 ÷ 8) = 8) but not at 64
	if b := balanceOf([]inFlight{{max: 10, total: 48}}, 8, 1.25, 64); b.OverBoundPct != 100 || b.OverCapPct != 0 {
		t.Errorf("10 of 48: above the bound %v%%, above the clients' bound %v%%, want 100%% and 0%%", b.OverBoundPct, b.OverCapPct)
	}
	if b := balanceOf(nil, 8, 1.25, 64); b.Samples != 0 || !math.IsNaN(b.RatioP99) {
		t.Errorf("no samples: %+v, want NaN ratios", b)
	}
	// under half of the 64 the front can hold: left out as thin
	if b := balanceOf([]inFlight{{max: 5, total: 5}, {max: 10, total: 31}, {max: 4, total: 32}}, 8, 1.25, 64); b.Samples != 1 || b.Thin != 2 || b.RatioMax != 1 {
		t.Errorf("thin samples: %d counted, %d left out, max ratio %v, want 1, 2 and 1", b.Samples, b.Thin, b.RatioMax)
	}
}

// TestHashFrontConfigs renders every front's config as `bench hash` runs
// it, with 8 upstreams and with one removed, and checks it: Caddy's
// through the Caddyfile adapter, HAProxy's for its balance lines and
// server ids (and with haproxy -c when installed).
func TestHashFrontConfigs(t *testing.T) {
	all := []string{"127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9004",
		"127.0.0.1:9005", "127.0.0.1:9006", "127.0.0.1:9007", "127.0.0.1:9008"}
	ids := []int{1, 2, 3, 4, 5, 6, 7, 8}
	rest := slices.Delete(slices.Clone(all), 2, 3)
	restIDs := slices.Delete(slices.Clone(ids), 2, 3)
	for _, f := range hashFronts {
		for _, ups := range [][]string{all, rest} {
			dir := t.TempDir()
			o := proxyOptions{ServerIDs: ids}
			if len(ups) < len(all) {
				o.ServerIDs = restIDs
			}
			c, err := newProxyConfig(f, dir, ups, o)
			if err != nil {
				t.Fatal(err)
			}
			c.Port, c.AdminPort = 18080, 12019
			switch f.kind {
			case kindCaddy:
				path := filepath.Join(dir, "Caddyfile")
				if err := writeTemplate(caddyfileTemplate, path, c); err != nil {
					t.Fatal(err)
				}
				body, _ := os.ReadFile(path)
				js, warn, err := caddyconfig.GetAdapter("caddyfile").Adapt(body, nil)
				if err != nil || len(warn) > 0 {
					t.Fatalf("%s: adapt: %v %v\n%s", f.key, err, warn, body)
				}
				s := string(js)
				if !strings.Contains(s, `"policy":"`+f.caddyPolicy+`"`) || strings.Count(s, `"dial":`) != len(ups) {
					t.Errorf("%s, %d upstreams: config %s", f.key, len(ups), s)
				}
				if f.key == "consistent_hash" && (strings.Contains(s, "balance_factor") || strings.Contains(s, `"key"`)) {
					t.Errorf("consistent_hash must run with no options, the form users write first: %s", s)
				}
			case kindHAProxy:
				path := filepath.Join(dir, "haproxy.cfg")
				if err := writeTemplate(haproxyTemplate, path, c); err != nil {
					t.Fatal(err)
				}
				body, _ := os.ReadFile(path)
				s := string(body)
				for _, line := range []string{"balance uri", "hash-type consistent", "hash-balance-factor 125", "127.0.0.1:9008 id 8"} {
					if !strings.Contains(s, line) {
						t.Errorf("haproxy, %d upstreams: no %q in\n%s", len(ups), line, s)
					}
				}
				if strings.Contains(s, "leastconn") || strings.Contains(s, "127.0.0.1:9003") != (len(ups) == len(all)) {
					t.Errorf("haproxy, %d upstreams:\n%s", len(ups), s)
				}
				if bin, err := exec.LookPath("haproxy"); err == nil {
					if out, err := exec.Command(bin, "-c", "-q", "-f", path).CombinedOutput(); err != nil {
						t.Errorf("haproxy -c, %d upstreams: %v\n%s\n%s", len(ups), err, out, s)
					}
				}
			}
		}
	}
	if _, err := newProxyConfig(hashFronts[2], t.TempDir(), all, proxyOptions{ServerIDs: restIDs}); err == nil {
		t.Error("7 server ids for 8 upstreams: no error")
	}
}

// TestHashFlags checks that `bench hash` rejects bad flags, naming them.
func TestHashFlags(t *testing.T) {
	for _, args := range [][]string{
		{"-seeds", "0"}, {"-keys", "10"}, {"-zipf", "1"}, {"-clients", "0"}, {"-duration", "100ms"},
		{"-service", "0s"}, {"-sample", "5s"}, {"-fronts", "nginx"}, {"-fronts", ","}, {"extra"},
	} {
		if _, err := parseHashFlags(args, io.Discard); err == nil {
			t.Errorf("%q: no error", args)
		} else if name := strings.TrimPrefix(args[0], "-"); args[0] != "extra" && !strings.Contains(err.Error(), name) {
			t.Errorf("%q: error %q does not name the flag", args, err)
		}
	}
	c, err := parseHashFlags([]string{"-quick", "-keys", "5000"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.seeds != 1 || c.keys != 5000 || len(c.fronts) != len(hashFronts) {
		t.Errorf("-quick -keys 5000: seeds %d keys %d fronts %d, want 1, 5000 (given wins) and all %d", c.seeds, c.keys, len(c.fronts), len(hashFronts))
	}
}
