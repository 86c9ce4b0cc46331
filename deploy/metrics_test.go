package deploy

import (
	"context"
	"fmt"
	"net/http"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

// series is what a scrape holds: for each metric name (a histogram as its
// _bucket, _sum and _count), each label name and the values seen for it.
type series map[string]map[string]map[string]bool

func (s series) add(name string, labels []*dto.LabelPair, extra ...string) {
	if s[name] == nil {
		s[name] = map[string]map[string]bool{}
	}
	set := func(k, v string) {
		if s[name][k] == nil {
			s[name][k] = map[string]bool{}
		}
		s[name][k][v] = true
	}
	for _, l := range labels {
		set(l.GetName(), l.GetValue())
	}
	for i := 0; i+1 < len(extra); i += 2 {
		set(extra[i], extra[i+1])
	}
}

func scrape(t *testing.T, addr string) series {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	s := series{}
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			switch f.GetType() {
			case dto.MetricType_HISTOGRAM:
				for _, b := range m.GetHistogram().GetBucket() {
					s.add(name+"_bucket", m.GetLabel(), "le", fmt.Sprint(b.GetUpperBound()))
				}
				s.add(name+"_sum", m.GetLabel())
				s.add(name+"_count", m.GetLabel())
			case dto.MetricType_SUMMARY:
				s.add(name, m.GetLabel())
				s.add(name+"_sum", m.GetLabel())
				s.add(name+"_count", m.GetLabel())
			default:
				s.add(name, m.GetLabel())
			}
		}
	}
	return s
}

var (
	daemonSeriesOnce sync.Once
	daemonSeries     series
)

// workloadSeries starts the daemon as the Kubernetes sidecar runs it, with a
// small arena and disk tier and seeded disk read faults, drives it through
// what makes its event-only series appear (stores past the arena's size,
// so blocks are evicted and written to disk; lookups that hit and miss;
// loads from both tiers, some failing on injected faults; an invalidation;
// a load of what it dropped; a refused request), and returns one scrape.
// Every test of what the dashboard and alerts query shares it.
func workloadSeries(t *testing.T) series {
	t.Helper()
	daemonSeriesOnce.Do(func() {
		p := findSidecarPod(t, decodeManifests(t))
		root := t.TempDir()
		port := freePort(t)
		args := hostArgs(t, "kvoffloadd args", p.args, root, map[string]string{
			"cpu-bytes": "32MiB", "disk-bytes": "64MiB", "metrics-addr": fmt.Sprintf("127.0.0.1:%d", port),
			"fault-spec": "read-eio=0.2,bitflip=0.2,write-eio=0.2,seed=3",
		})
		d := startDaemon(t, args)
		socket, _ := flagValue(args, "socket")
		if code, out := health(t, "--socket", socket, "--wait", "1m"); code != 0 {
			t.Fatalf("daemon did not serve: %s", out)
		}
		runWorkload(t, socket)
		daemonSeries = scrape(t, fmt.Sprintf("127.0.0.1:%d", port))
		// Not its exit status: the injected write errors may fail the
		// slot files' final sync, and the daemon then exits 1.
		d.stop(t)
	})
	if daemonSeries == nil {
		t.Fatal("the workload daemon failed in an earlier test")
	}
	return daemonSeries
}

func runWorkload(t *testing.T, socket string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := client.Dial(socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const n = 160 // 80 MiB of blocks: past the 32 MiB arena, past the 64 MiB disk
	m := testenv.Model{Layers: 4, SegBytes: 128 << 10, Blocks: 2 * n}
	r := testenv.NewRegion(t, m.RegionBytes())
	reg, err := c.Register(ctx, []byte("deploy-metrics"), m.Layout(), m.Regions(r), "deploy-test")
	if err != nil {
		t.Fatal(err)
	}
	id := reg.RegistrationId
	hs := make([][]byte, n)
	blocks := make([]uint32, n)
	for i := range hs {
		hs[i] = m.Hash(1, i)
		blocks[i] = uint32(i)
		m.Fill(r, i, hs[i])
	}
	// First all at once, more than the arena holds: stores in flight pin
	// their slots, so some find none (no_space). Then 16 at a time: the
	// arena evicts to disk (written, or failed on an injected write error).
	var jobs []*pb.Job
	for i := 0; i < n; i += 16 {
		jobs = append(jobs, testenv.Job(uint64(1+i), hs[i:i+16], blocks[i:i+16]))
	}
	if _, err := c.Store(ctx, id, jobs, true); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i += 16 {
		if _, err := c.Store(ctx, id, []*pb.Job{testenv.Job(uint64(500+i), hs[i:i+16], blocks[i:i+16])}, true); err != nil {
			t.Fatal(err)
		}
	}
	keys, err := client.Keys(0, 32, hs...)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Lookup(ctx, []uint32{reg.NamespaceId}, keys, 0); err != nil {
		t.Fatal(err)
	}
	// Load every block into the second half of the region: from the CPU
	// tier, from disk, or failing (missing, io_error, corrupt).
	for i := 0; i < n; i += 16 {
		into := make([]uint32, 16)
		for j := range into {
			into[j] = uint32(n + i + j)
		}
		if _, err := c.Load(ctx, id, []*pb.Job{testenv.Job(uint64(1000+i), hs[i:i+16], into)}, true); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Invalidate(ctx, []uint32{reg.NamespaceId}, keys); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Load(ctx, id, []*pb.Job{testenv.Job(2000, hs[:1], []uint32{uint32(n)})}, true); err != nil {
		t.Fatal(err)
	}
	// A block id past the region: refused as invalid.
	if _, err := c.Load(ctx, id, []*pb.Job{testenv.Job(3000, hs[:1], []uint32{uint32(3 * n)})}, true); err == nil {
		t.Fatal("a load past the region was accepted")
	}
}

// eventOnly are label values the daemon emits only on events the workload
// does not cause, read from its source (offload/disk.go, offload/jobs.go):
// a query may name them although the scrape lacks them.
var eventOnly = map[string]map[string][]string{
	"kvoffload_disk_demotions_total":   {"result": {"rejected", "no_space", "dropped"}},
	"kvoffload_requests_refused_total": {"reason": {"backlog", "shutting_down"}},
	// offload/remote.go: a value read from the cluster that failed
	// verification (remoteSeries' cluster is down: nothing is read).
	"kvoffload_remote_errors_total": {"op": {"verify"}},
}

// targetLabels are added by Prometheus to every scraped series; up is the
// series it records per target.
var targetLabels = map[string]bool{"job": true, "instance": true}

var (
	selectorRe = regexp.MustCompile(`([a-zA-Z_:][a-zA-Z0-9_:]*)?\{([^}]*)\}`)
	matcherRe  = regexp.MustCompile(`^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*$`)
	groupingRe = regexp.MustCompile(`\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)`)
	identRe    = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*(\s*\()?`)
	promqlKeys = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
		"bool": true, "and": true, "or": true, "unless": true, "offset": true, "atan2": true, "inf": true, "nan": true}
)

// checkQuery checks a PromQL expression against a scrape of the daemon:
// every metric it names is served (up aside), every label it matches or
// groups by is one those metrics carry (or a target label), and every value
// an = or =~ matcher names is one the daemon emits. It does not check the
// syntax: promtool does (promtoolCheckExprs).
func checkQuery(t *testing.T, where, expr string, s series) {
	t.Helper()
	for _, p := range queryProblems(expr, s) {
		t.Errorf("%s: %s", where, p)
	}
}

func queryProblems(expr string, s series) []string {
	var problems []string
	bad := func(format string, a ...any) { problems = append(problems, fmt.Sprintf(format, a...)) }
	metrics := map[string]bool{}
	for _, m := range selectorRe.FindAllStringSubmatch(expr, -1) {
		name := m[1]
		if name == "" {
			bad("selector {%s} names no metric", m[2])
			continue
		}
		metrics[name] = true
		for _, part := range splitMatchers(m[2]) {
			mm := matcherRe.FindStringSubmatch(part)
			if mm == nil {
				bad("cannot read matcher %q", part)
				continue
			}
			label, op, value := mm[1], mm[2], mm[3]
			if targetLabels[label] {
				continue
			}
			values, ok := s[name][label]
			if !ok {
				if _, served := s[name]; served {
					bad("%s has no label %s", name, label)
				}
				continue
			}
			if op != "=" && op != "=~" {
				continue
			}
			alts := []string{value}
			if op == "=~" {
				if strings.ContainsAny(value, `.*+?()[]{}^$\`) {
					continue // a pattern, not a list of values
				}
				alts = strings.Split(value, "|")
			}
			for _, v := range alts {
				if !values[v] && !slices.Contains(eventOnly[name][label], v) {
					bad("%s{%s=%q}: the daemon emits no such value (it emits %v)", name, label, v, keys(values))
				}
			}
		}
	}
	rest := selectorRe.ReplaceAllStringFunc(expr, func(sel string) string { return selectorRe.FindStringSubmatch(sel)[1] })
	rest = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`).ReplaceAllString(rest, "")
	rest = regexp.MustCompile(`\[[^\]]*\]`).ReplaceAllString(rest, "")
	var grouping []string
	for _, g := range groupingRe.FindAllStringSubmatch(rest, -1) {
		for _, l := range strings.Split(g[2], ",") {
			if l = strings.TrimSpace(l); l != "" {
				grouping = append(grouping, l)
			}
		}
	}
	rest = groupingRe.ReplaceAllString(rest, "")
	rest = regexp.MustCompile(`\b\d[0-9.e+-]*[a-z]*\b`).ReplaceAllString(rest, "")
	for _, id := range identRe.FindAllStringSubmatch(rest, -1) {
		if id[1] != "" || promqlKeys[strings.ToLower(id[0])] {
			continue // a function or a keyword
		}
		metrics[id[0]] = true
	}
	for name := range metrics {
		if _, ok := s[name]; !ok && name != "up" {
			bad("the daemon serves no metric %s", name)
		}
	}
	for _, l := range grouping {
		ok := targetLabels[l] || l == "le"
		for name := range metrics {
			_, has := s[name][l]
			ok = ok || has
		}
		if !ok {
			bad("no metric of the query has the label %s it groups by", l)
		}
	}
	return problems
}

// splitMatchers splits a selector's matchers on the commas between them.
func splitMatchers(s string) []string {
	var out []string
	inQuote, start := false, 0
	for i := 0; i < len(s); i++ {
		switch {
		case s[i] == '\\' && inQuote:
			i++
		case s[i] == '"':
			inQuote = !inQuote
		case s[i] == ',' && !inQuote:
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	if strings.TrimSpace(s[start:]) != "" {
		out = append(out, s[start:])
	}
	return out
}

func keys(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// TestCheckQuery shows the checker catches what it is for, against a
// scrape of the real daemon.
func TestCheckQuery(t *testing.T) {
	s := workloadSeries(t)
	for _, tc := range []struct {
		expr string
		bad  bool
	}{
		{`sum by (op, status) (rate(kvoffload_blocks_total{status!="ok",instance=~".*"}[5m]))`, false},
		{`histogram_quantile(0.99, sum by (le, op) (rate(kvoffload_job_duration_seconds_bucket[5m])))`, false},
		{`up == 0 and on (job, instance) max_over_time(kvoffload_tier_capacity_bytes{tier="cpu"}[1h])`, false},
		{`rate(kvoffload_disk_errors_total{kind=~"io|short"}[10m]) > 0.5`, false},
		{`rate(kvoffload_blocks_totl[5m])`, true},                         // no such metric
		{`kvoffload_index_entries + kvoffload_tier_byts`, true},           // a bare name
		{`rate(kvoffload_blocks_total{stat="ok"}[5m])`, true},             // no such label
		{`rate(kvoffload_blocks_total{status="nospace"}[5m])`, true},      // no such value
		{`rate(kvoffload_disk_errors_total{kind=~"io|shrt"}[10m])`, true}, // one value wrong
		{`sum by (tier) (kvoffload_lookups_total)`, true},                 // grouping by a label it lacks
	} {
		if p := queryProblems(tc.expr, s); (len(p) > 0) != tc.bad {
			t.Errorf("%s: problems %q, want some: %v", tc.expr, p, tc.bad)
		}
	}
}
