package docs_test

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// dashboardFile is the Grafana dashboard over the modules' metrics,
// relative to the repository root.
const dashboardFile = "docs/grafana/lbx.json"

// dashboardKeySeries must each be queried by some panel of the dashboard.
var dashboardKeySeries = []string{
	"caddy_lbx_rebalance_local_load",
	"caddy_lbx_rebalance_cluster_average",
	"caddy_lbx_rebalance_connections_shed_total",
	"caddy_lbx_upstream_ejections_total",
	"caddy_lbx_pool_panic",
}

// exportedLiteral is a metric name as the modules give it to prometheus:
// a Go string literal.
var exportedLiteral = regexp.MustCompile(`"(caddy_lbx_[a-z0-9_]+)"`)

// queriedName is a metric name in a PromQL expression (or any other text
// of the dashboard), recording rule names (with a colon) included. The
// modules export no histograms or summaries, so a name stands as written:
// a _bucket, _sum or _count suffix is part of it and makes it unknown.
var queriedName = regexp.MustCompile(`\bcaddy_lbx_[a-zA-Z0-9_]+(:[a-zA-Z0-9_:]+)?`)

// backticked is a code span of a Markdown table cell.
var backticked = regexp.MustCompile("`([^`]+)`")

// grafanaDatasource is a panel's, a target's or a variable's data source.
type grafanaDatasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

// grafanaPanel is a panel of the dashboard; a row holds its panels in
// Panels when it is collapsed, and precedes them otherwise.
type grafanaPanel struct {
	ID         int                `json:"id"`
	Type       string             `json:"type"`
	Title      string             `json:"title"`
	Datasource *grafanaDatasource `json:"datasource"`
	Targets    []struct {
		RefID      string             `json:"refId"`
		Expr       string             `json:"expr"`
		Datasource *grafanaDatasource `json:"datasource"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"`
}

type grafanaDashboard struct {
	SchemaVersion int            `json:"schemaVersion"`
	Panels        []grafanaPanel `json:"panels"`
	Templating    struct {
		List []struct {
			Name       string          `json:"name"`
			Type       string          `json:"type"`
			Query      json.RawMessage `json:"query"`
			Definition string          `json:"definition"`
		} `json:"list"`
	} `json:"templating"`
}

// TestGrafanaDashboard checks that every metric name the dashboard
// queries is one the modules export, that every exported name is in the
// Metrics table of docs/observability.md (and every name there is
// exported), and that the dashboard queries the key series. The exported
// names are read from the Go source, not kept by hand.
func TestGrafanaDashboard(t *testing.T) {
	chdirRoot(t)
	exported := exportedMetrics(t)
	// A scan that found nothing would make every other check vacuous.
	if len(exported) < 20 {
		t.Fatalf("found only %d caddy_lbx_ metric names in the Go source; is the scan broken?", len(exported))
	}

	documented := documentedMetrics(t, filepath.Join("docs", "observability.md"))
	for _, name := range slices.Sorted(maps.Keys(exported)) {
		if !documented[name] {
			t.Errorf("%s exports %s, which the Metrics table of docs/observability.md does not list", exported[name], name)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(documented)) {
		if exported[name] == "" {
			t.Errorf("docs/observability.md lists %s in its Metrics table, which no module exports", name)
		}
	}

	data, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var dash grafanaDashboard
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	if dash.SchemaVersion == 0 {
		t.Errorf("%s: no schemaVersion; is it a Grafana dashboard?", dashboardFile)
	}

	reported := map[string]bool{} // unknown names already reported
	queried := map[string][]string{}
	check := func(where, text string) {
		for _, name := range queriedName.FindAllString(text, -1) {
			if exported[name] == "" {
				t.Errorf("%s: %s: %s is not a metric the modules export", dashboardFile, where, name)
				reported[name] = true
			}
		}
	}

	hasDatasourceVar := false
	for _, v := range dash.Templating.List {
		if v.Type == "datasource" && v.Name == "datasource" && string(v.Query) == `"prometheus"` {
			hasDatasourceVar = true
		}
		var query any
		if len(v.Query) > 0 {
			if err := json.Unmarshal(v.Query, &query); err != nil {
				t.Errorf("%s: variable %q: query: %v", dashboardFile, v.Name, err)
			}
		}
		if q, ok := query.(map[string]any); ok {
			query = q["query"]
		}
		if q, ok := query.(string); ok {
			check("variable "+v.Name, q)
		}
		check("variable "+v.Name, v.Definition)
	}
	if !hasDatasourceVar {
		t.Errorf(`%s: no variable "datasource" of type datasource with query "prometheus"`, dashboardFile)
	}

	ids := map[int]string{}
	panels := 0
	var walk func([]grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			where := fmt.Sprintf("panel %q", p.Title)
			if other, dup := ids[p.ID]; p.ID == 0 {
				t.Errorf("%s: %s has no id", dashboardFile, where)
			} else if dup {
				t.Errorf("%s: %s has id %d, as panel %q has", dashboardFile, where, p.ID, other)
			}
			ids[p.ID] = p.Title
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			panels++
			if p.Title == "" {
				t.Errorf("%s: panel %d has no title", dashboardFile, p.ID)
			}
			if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
				t.Errorf("%s: %s: datasource %+v; want uid ${datasource}", dashboardFile, where, p.Datasource)
			}
			if len(p.Targets) == 0 {
				t.Errorf("%s: %s has no query", dashboardFile, where)
			}
			for _, q := range p.Targets {
				if q.Datasource != nil && q.Datasource.UID != "${datasource}" {
					t.Errorf("%s: %s, query %s: datasource %+v; want uid ${datasource}", dashboardFile, where, q.RefID, q.Datasource)
				}
				names := queriedName.FindAllString(q.Expr, -1)
				if len(names) == 0 {
					t.Errorf("%s: %s, query %s: expression %q queries no caddy_lbx_ metric", dashboardFile, where, q.RefID, q.Expr)
				}
				check(where+", query "+q.RefID, q.Expr)
				for _, name := range names {
					if exported[name] != "" && !slices.Contains(queried[name], p.Title) {
						queried[name] = append(queried[name], p.Title)
					}
				}
			}
		}
	}
	walk(dash.Panels)

	// Descriptions, legends and anything else that names a metric.
	for _, name := range queriedName.FindAllString(string(data), -1) {
		if exported[name] == "" && !reported[name] {
			t.Errorf("%s mentions %s, which is not a metric the modules export", dashboardFile, name)
			reported[name] = true
		}
	}

	if panels < 15 {
		t.Errorf("%s: %d panels; is the panel walk broken?", dashboardFile, panels)
	}
	if len(queried) < 15 {
		t.Errorf("%s queries %d distinct exported metrics; want at least 15", dashboardFile, len(queried))
	}
	for _, name := range dashboardKeySeries {
		if exported[name] == "" {
			t.Errorf("key series %s is not exported any more; update dashboardKeySeries", name)
		} else if len(queried[name]) == 0 {
			t.Errorf("%s: no panel queries %s", dashboardFile, name)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(exported)) {
		if len(queried[name]) == 0 {
			t.Logf("%s: no panel queries %s (exported by %s)", dashboardFile, name, exported[name])
		}
	}
}

// exportedMetrics returns the caddy_lbx_ metric names of the repository's
// non-test Go files (outside testdata and integration directories), each
// with the first file that has it. The working directory must be the
// repository root.
func exportedMetrics(t *testing.T) map[string]string {
	t.Helper()
	names := map[string]string{}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			switch d.Name() {
			case "testdata", "integration", ".git":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range exportedLiteral.FindAllStringSubmatch(string(src), -1) {
			if names[m[1]] == "" {
				names[m[1]] = path
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// documentedMetrics returns the metric names in the first column of the
// table under "## Metrics" in file. A cell may shorten its second name:
// `caddy_lbx_x_total`, `…_y_total` is caddy_lbx_x_total and
// caddy_lbx_x_y_total (the previous name without _total, then the rest).
func documentedMetrics(t *testing.T, file string) map[string]bool {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	inSection := false
	for line := range strings.Lines(string(data)) {
		if h, ok := strings.CutPrefix(line, "## "); ok {
			inSection = strings.TrimSpace(h) == "Metrics"
			continue
		}
		if !inSection || !strings.HasPrefix(line, "|") {
			continue
		}
		cells := strings.Split(line, "|")
		if len(cells) < 3 {
			continue
		}
		prev := ""
		for _, m := range backticked.FindAllStringSubmatch(cells[1], -1) {
			name := m[1]
			if rest, ok := strings.CutPrefix(name, "…"); ok {
				if prev == "" {
					t.Errorf("%s: %s: %s shortens no name before it", file, strings.TrimSpace(line), name)
					continue
				}
				name = strings.TrimSuffix(prev, "_total") + rest
			}
			if strings.HasPrefix(name, "caddy_lbx_") {
				names[name] = true
				prev = name
			}
		}
	}
	if len(names) == 0 {
		t.Fatalf("%s: no metric names in a table under ## Metrics", file)
	}
	return names
}
