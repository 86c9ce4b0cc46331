package deploy

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

type ruleFile struct {
	Groups []struct {
		Name  string `json:"name"`
		Rules []struct {
			Alert       string            `json:"alert"`
			Record      string            `json:"record"`
			Expr        string            `json:"expr"`
			For         string            `json:"for"`
			Labels      map[string]string `json:"labels"`
			Annotations map[string]string `json:"annotations"`
		} `json:"rules"`
	} `json:"groups"`
}

type ruleTests struct {
	RuleFiles          []string `json:"rule_files"`
	EvaluationInterval string   `json:"evaluation_interval"`
	Tests              []struct {
		Name          string `json:"name"`
		Interval      string `json:"interval"`
		InputSeries   []any  `json:"input_series"`
		AlertRuleTest []struct {
			EvalTime  string `json:"eval_time"`
			Alertname string `json:"alertname"`
			ExpAlerts []any  `json:"exp_alerts"`
		} `json:"alert_rule_test"`
	} `json:"tests"`
}

func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool is not installed: it comes with Debian's prometheus package (scripts/test-deps.sh installs it)")
	}
	return p
}

// promtoolCheckExprs has promtool parse exprs, as recording rules.
func promtoolCheckExprs(t *testing.T, what string, exprs []string) {
	t.Helper()
	var b strings.Builder
	b.WriteString("groups:\n  - name: check\n    rules:\n")
	for i, e := range exprs {
		fmt.Fprintf(&b, "      - record: check:expr_%d\n        expr: %q\n", i, e)
	}
	path := filepath.Join(t.TempDir(), "exprs.yml")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool(t), "check", "rules", path).CombinedOutput(); err != nil {
		t.Fatalf("%s: promtool finds queries that are not PromQL: %v\n%s", what, err, out)
	}
}

// TestPrometheusAlerts checks the alert rules with promtool, runs their unit
// tests, requires a case where each rule fires and one where it does not,
// and checks every query against the real daemon's metrics.
func TestPrometheusAlerts(t *testing.T) {
	pt := promtool(t)
	if out, err := exec.Command(pt, "check", "rules", "prometheus/alerts.yml").CombinedOutput(); err != nil {
		t.Fatalf("promtool check rules: %v\n%s", err, out)
	}
	cmd := exec.Command(pt, "test", "rules", "alerts_test.yml")
	cmd.Dir = "prometheus"
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}

	var rules ruleFile
	if err := yaml.UnmarshalStrict(readFile(t, "prometheus/alerts.yml"), &rules); err != nil {
		t.Fatal(err)
	}
	var tests ruleTests
	if err := yaml.UnmarshalStrict(readFile(t, "prometheus/alerts_test.yml"), &tests); err != nil {
		t.Fatal(err)
	}
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname] = true
			} else {
				quiet[a.Alertname] = true
			}
		}
	}
	s := remoteSeries(t)
	alerts := map[string]bool{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			alerts[r.Alert] = true
			if !fires[r.Alert] || !quiet[r.Alert] {
				t.Errorf("alert %s: alerts_test.yml needs a case where it fires and one where it does not", r.Alert)
			}
			if r.Labels["severity"] == "" || r.Annotations["summary"] == "" || r.Annotations["description"] == "" {
				t.Errorf("alert %s: want a severity label, a summary and a description", r.Alert)
			}
			checkQuery(t, "alert "+r.Alert, r.Expr, s)
		}
	}
	// What issue 14 asks to be alerted on.
	for _, want := range []string{"KvoffloaddDown", "KvoffloaddDiskIOErrors", "KvoffloaddDiskCorruptReads",
		"KvoffloaddDiskSlotsQuarantined", "KvoffloaddDiskRefusingWrites", "KvoffloaddStoresNoSpace",
		// And issue 33: the remote tier down, invalidations not yet written.
		"KvoffloaddRemoteDown", "KvoffloaddRemoteInvalidationsPending"} {
		if !alerts[want] {
			t.Errorf("no alert %s", want)
		}
	}
}
