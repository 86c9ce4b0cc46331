package deploy

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"testing"
)

type grafanaPanel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	GridPos struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []struct {
		RefID      string `json:"refId"`
		Expr       string `json:"expr"`
		Datasource *struct {
			UID string `json:"uid"`
		} `json:"datasource"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // a collapsed row's
}

type grafanaDashboard struct {
	Title      string         `json:"title"`
	UID        string         `json:"uid"`
	Panels     []grafanaPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

// grafanaVars stand for the dashboard's variables in a query that
// Prometheus evaluates.
var grafanaVars = strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "3h", "${instance}", ".*", "$instance", ".*")

// TestGrafanaDashboard checks every query of the dashboard: it is PromQL
// (promtool), and every metric, label and label value it names is one the
// real daemon serves (a scrape after a workload; see workloadSeries). It
// also checks the panels are laid out and keep covering what operators
// need to see.
func TestGrafanaDashboard(t *testing.T) {
	var d grafanaDashboard
	dec := json.NewDecoder(strings.NewReader(string(readFile(t, "grafana/kvoffloadd.json"))))
	if err := dec.Decode(&d); err != nil {
		t.Fatal(err)
	}
	if d.UID == "" || d.Title == "" {
		t.Error("the dashboard has no uid or title")
	}
	s := remoteSeries(t)

	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			t.Fatalf("variable %s: %v", v.Name, err)
		}
		m := regexp.MustCompile(`^label_values\(([a-zA-Z_:][a-zA-Z0-9_:]*),\s*([a-zA-Z_]+)\)$`).FindStringSubmatch(q.Query)
		if m == nil {
			t.Errorf("variable %s: query %q is not label_values(metric, label)", v.Name, q.Query)
		} else if _, ok := s[m[1]]; !ok {
			t.Errorf("variable %s: the daemon serves no metric %s", v.Name, m[1])
		}
	}
	if !vars["datasource"] || !vars["instance"] {
		t.Error("want the variables datasource and instance")
	}

	var panels []grafanaPanel
	for _, p := range d.Panels {
		panels = append(panels, p)
		panels = append(panels, p.Panels...)
	}
	ids := map[int]bool{}
	var exprs []string
	queried := ""
	for _, p := range panels {
		if ids[p.ID] {
			t.Errorf("panel id %d is used twice", p.ID)
		}
		ids[p.ID] = true
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q: gridPos %+v is off the 24-column grid", p.Title, g)
		}
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q does not use the datasource variable", p.Title)
		}
		for _, tg := range p.Targets {
			where := fmt.Sprintf("panel %q query %s", p.Title, tg.RefID)
			if tg.Datasource == nil || tg.Datasource.UID != "${datasource}" {
				t.Errorf("%s does not use the datasource variable", where)
			}
			if !strings.Contains(tg.Expr, `instance=~"$instance"`) {
				t.Errorf("%s ignores the instance variable: %s", where, tg.Expr)
			}
			expr := grafanaVars.Replace(tg.Expr)
			if strings.Contains(expr, "$") {
				t.Errorf("%s: unknown variable in %s", where, tg.Expr)
			}
			checkQuery(t, where, expr, s)
			exprs = append(exprs, expr)
			queried += expr + "\n"
		}
	}
	promtoolCheckExprs(t, "grafana/kvoffloadd.json", exprs)

	// What operators must see (issue 14): hit rate by tier, bytes and
	// latency, failed blocks by status, tier use, evictions, disk errors and
	// quarantined slots, queue depths.
	for _, want := range []string{
		"kvoffload_lookup_blocks_total", `kvoffload_disk_blocks_total{op="read"`, "kvoffload_bytes_total", "kvoffload_disk_bytes_total",
		"kvoffload_job_duration_seconds_bucket", "kvoffload_disk_io_seconds_bucket", `sum by (op, status) (rate(kvoffload_blocks_total{status!="ok"`,
		"kvoffload_tier_used_bytes", "kvoffload_tier_capacity_bytes", "kvoffload_evictions_total", "kvoffload_disk_errors_total",
		"kvoffload_disk_quarantined_slots", "kvoffload_copy_queue_depth", "kvoffload_pending_jobs",
		// The remote tier (issue 33).
		"kvoffload_remote_up", "kvoffload_remote_pending_deletes", "kvoffload_remote_errors_total",
	} {
		if !strings.Contains(queried, want) {
			t.Errorf("no panel queries %s", want)
		}
	}
}
