package report

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func sample() *Report {
	r := &Report{Schema: Schema, Command: "kvbench --quick --seed 1", Machine: Describe(os.TempDir()), Skipped: []Skip{}}
	r.Results = []Result{
		{Scenario: "cpu", Op: "lookup", Blocks: 10, P50us: 100, P99us: 300, HitRate: map[string]float64{"cpu": 0.5, "disk": 0}},
		{Scenario: "cpu", Op: "load", GBps: 8, Blocks: 5},
	}
	r.Baselines = Baselines{MemcpyGBps: F(10), GRPCEmptyP99us: F(200), IOBytes: 2 << 20}
	r.Ratios = Ratios{CPULoadVsMemcpy: Ratio(F(8), r.Baselines.MemcpyGBps), LookupP99VsGRPCEmptyP99: Ratio(F(300), r.Baselines.GRPCEmptyP99us)}
	r.Faults = &Faults{Spec: "read-eio=0.1,seed=1", InjectedByKind: map[string]int{"read-eio": 3}, Injected: 3, InjectedRead: 3, ReadFailuresReported: 3}
	r.Sweep = []SweepPoint{{Rate: 0, LoadGBps: 3, DiskLoadGBps: 1, LoadP99us: 9000}, {Rate: 0.05, LoadGBps: 2.5, DiskLoadGBps: 0.8, LoadP99us: 12000}}
	return r
}

// The JSON keeps the names issue 4 fixes; a skipped baseline is null.
func TestJSONSchema(t *testing.T) {
	path := filepath.Join(t.TempDir(), "r.json")
	if err := sample().WriteJSON(path); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(path)
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	for section, keys := range map[string][]string{
		"baselines": {"memcpy_gbps", "odirect_read_gbps", "odirect_write_gbps", "grpc_empty_p99_us", "redis_get_gbps", "redis_set_gbps"},
		"ratios":    {"cpu_load_vs_memcpy", "cpu_store_vs_memcpy", "disk_load_vs_odirect_read", "disk_store_vs_odirect_write", "cpu_load_vs_redis_get", "lookup_p99_vs_grpc_empty_p99"},
		"faults":    {"spec", "injected", "blocks_failed_reported", "corrupt_blocks_delivered", "failed_blocks_reoffered"},
	} {
		m, ok := doc[section].(map[string]any)
		if !ok {
			t.Fatalf("no %s object", section)
		}
		for _, k := range keys {
			if _, ok := m[k]; !ok {
				t.Errorf("%s has no %q", section, k)
			}
		}
	}
	if doc["baselines"].(map[string]any)["redis_get_gbps"] != nil {
		t.Error("a skipped baseline is not null")
	}
	if got := doc["ratios"].(map[string]any)["cpu_load_vs_memcpy"]; got != 0.8 {
		t.Errorf("cpu_load_vs_memcpy = %v", got)
	}
	res := doc["results"].([]any)[0].(map[string]any)
	for _, k := range []string{"scenario", "op", "gbps", "blocks", "p50_us", "p99_us", "hit_rate"} {
		if _, ok := res[k]; !ok {
			t.Errorf("results[0] has no %q", k)
		}
	}
}

func TestPrint(t *testing.T) {
	var out bytes.Buffer
	sample().Print(&out)
	for _, want := range []string{"reproduce: kvbench --quick --seed 1", "cpu_load_vs_memcpy", "0.80", "skipped", "fault sweep"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}

func TestPlot(t *testing.T) {
	for _, ext := range []string{".svg", ".png"} {
		path := filepath.Join(t.TempDir(), "p"+ext)
		if err := Plot(path, sample().Sweep, "test"); err != nil {
			t.Fatal(err)
		}
		if st, err := os.Stat(path); err != nil || st.Size() < 1000 {
			t.Errorf("%s: %v, %v", path, st, err)
		}
	}
	if err := Plot(filepath.Join(t.TempDir(), "p.gif"), sample().Sweep, "test"); err == nil {
		t.Error("a .gif plot is accepted")
	}
}
