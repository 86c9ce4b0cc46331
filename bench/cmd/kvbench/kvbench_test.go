package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
)

// buildDaemon builds kvoffloadd from this tree into a temporary directory.
func buildDaemon(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "kvoffloadd")
	build := exec.Command("go", "build", "-o", bin, "github.com/kvoffloadd/kvoffloadd/cmd/kvoffloadd")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build kvoffloadd: %v\n%s", err, out)
	}
	return bin
}

// faultSpec is the test's plan: read faults only, so that each injected
// fault must surface as a failed block.
const faultSpec = "read-eio=0.05,short-read=0.05,bitflip=0.05,seed=3"

// TestQuick runs kvbench --quick against the real daemon, built from this
// tree: with a fault plan when the daemon has a disk tier, else the CPU
// tier only. The daemon must deliver no wrong block, offer no failed block
// again, report every injected read fault as a failed block, and exit 0
// on SIGTERM (run fails otherwise).
func TestQuick(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds and runs the daemon")
	}
	if runtime.GOOS != "linux" {
		t.Skip("kvoffloadd is Linux-only")
	}
	defer leakcheck.VerifyNone(t)
	bin := buildDaemon(t)
	flags, err := daemon.Flags(bin)
	if err != nil {
		t.Fatal(err)
	}
	withFaults := flags["disk-dir"] && flags["disk-bytes"] && flags["fault-spec"]

	jsonPath := filepath.Join(t.TempDir(), "report.json")
	args := []string{"--quick", "--daemon", bin, "--json", jsonPath, "--seed", "5", "--scenarios", "cpu,tight"}
	if withFaults {
		args = append(args, "--scenarios", "cpu,tight,faults", "--fault-spec", faultSpec)
	}
	if raceDetector {
		// The same run in blocks an eighth the size (8 segments of 32
		// KiB), a 64-block engine, half the steps, a quarter of the idle
		// and empty calls and smaller separate baselines: every check is
		// the same, the work kvbench does under the race detector (it
		// fills, checks and copies every byte) a small part of it.
		args = append(args, "--layers", "4", "--engine-blocks", "64", "--steps", "12")
		saved := quickSizes
		defer func() { quickSizes = saved }()
		quickSizes.idleCalls, quickSizes.memcpyMax, quickSizes.odirectFile = 500, 16<<20, 64<<20
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	rep, err := run(ctx, args, &stdout, &stderr)
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("kvbench: %v", err)
	}

	// The JSON has the schema's keys.
	var doc map[string]any
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	for section, keys := range map[string][]string{
		"baselines": {"memcpy_gbps", "odirect_read_gbps", "odirect_write_gbps", "grpc_empty_p99_us", "redis_get_gbps", "redis_set_gbps",
			"segment_copy_load_gbps", "segment_copy_store_gbps", "segment_copy_own_load_gbps", "segment_copy_own_store_gbps",
			"tier_read", "grpc_empty_busy_p99_us"},
		"ratios": {"cpu_load_vs_memcpy", "cpu_store_vs_memcpy", "disk_load_vs_odirect_read", "disk_store_vs_odirect_write",
			"cpu_load_vs_redis_get", "lookup_p99_vs_grpc_empty_p99", "cpu_load_vs_segment_copy", "cpu_store_vs_segment_copy",
			"cpu_load_vs_own_segment_copy", "cpu_store_vs_own_segment_copy", "segment_copy_vs_own_load", "segment_copy_vs_own_store",
			"disk_load_vs_tier_read", "disk_load_p99_vs_raw_step_p99", "lookup_busy_p99_vs_grpc_empty_p99",
			"lookup_busy_p99_vs_empty_busy_p99", "lookup_idle_p99_vs_grpc_empty_p99"},
		"interference": {"threshold", "phases"},
	} {
		m, _ := doc[section].(map[string]any)
		for _, k := range keys {
			if _, ok := m[k]; !ok {
				t.Errorf("JSON %s has no %q", section, k)
			}
		}
	}
	if _, ok := doc["results"].([]any); !ok {
		t.Error("JSON has no results list")
	}

	for _, op := range []string{"lookup", "load", "store"} {
		r := rep.Find("cpu", op)
		if r == nil || r.Calls == 0 {
			t.Fatalf("cpu scenario has no %s calls: %+v", op, r)
		}
		if r.CorruptBlocksDelivered != 0 || r.FailedBlocksReoffered != 0 {
			t.Errorf("cpu %s: corrupt_blocks_delivered %d, failed_blocks_reoffered %d", op, r.CorruptBlocksDelivered, r.FailedBlocksReoffered)
		}
	}
	if r := rep.Find("cpu", "load"); r.Blocks == 0 || r.GBps <= 0 {
		t.Errorf("cpu scenario loaded nothing: %+v", r)
	}
	// The same-window baselines and references.
	for _, op := range []string{"load-copy", "store-copy", "load-copy-own", "store-copy-own", "lookup-busy", "empty-busy", "lookup-idle"} {
		if r := rep.Find("cpu", op); r == nil || r.Calls == 0 {
			t.Errorf("cpu scenario has no %s row: %+v", op, r)
		}
	}
	for _, op := range []string{"load-copy", "load-copy-own"} {
		if r := rep.Find("cpu", op); r != nil && r.Blocks != rep.Find("cpu", "load").Blocks {
			t.Errorf("the copy baseline %s copied %d blocks, the loads asked for %d", op, r.Blocks, rep.Find("cpu", "load").Blocks)
		}
	}
	if r := rep.Find("cpu", "lookup"); r.HitRateLRU == nil || r.HitRateBelady == nil || r.CapacityBlocks == 0 ||
		*r.HitRateBelady < *r.HitRateLRU || *r.HitRateBelady < r.HitRate["all"] {
		t.Errorf("cpu lookups: hit rate %v, LRU %v, Belady %v of %d blocks", r.HitRate["all"], r.HitRateLRU, r.HitRateBelady, r.CapacityBlocks)
	}
	// The tight scenario holds less than the working set: the hit rates
	// there are the policy's, beside LRU's and Belady's of its capacity.
	if r := rep.Find("tight", "lookup"); r == nil || r.HitRateLRU == nil || r.HitRateBelady == nil ||
		r.CapacityBlocks == 0 || r.CapacityBlocks >= rep.Model.WorkingSetBlocks || *r.HitRateBelady < r.HitRate["all"] {
		t.Errorf("tight lookups: %+v of a working set of %d blocks", r, rep.Model.WorkingSetBlocks)
	} else {
		t.Logf("tight: hit rate %.3f, LRU %.3f, Belady %.3f, %d of %d blocks", r.HitRate["all"], *r.HitRateLRU, *r.HitRateBelady, r.CapacityBlocks, rep.Model.WorkingSetBlocks)
	}
	phases := map[string]bool{}
	for _, p := range rep.Interference.Phases {
		phases[p.Name] = true
		// CPU time is counted in 10 ms ticks: a phase of a few ms (the
		// wait for a small arena) may see none of its own.
		if p.Seconds <= 0 || p.OtherCPUShare < 0 || p.OwnCPUShare < 0 || p.Seconds >= 0.5 && p.OwnCPUShare == 0 {
			t.Errorf("phase %+v", p)
		}
	}
	for _, want := range []string{"cpu: steps", "cpu: idle lookups", "baseline: memcpy"} {
		if !phases[want] {
			t.Errorf("no interference phase %q in %v", want, phases)
		}
	}

	if !withFaults {
		t.Skip("fault part skipped: the daemon's --help lists no --disk-dir/--disk-bytes/--fault-spec (no disk tier to inject faults into yet)")
	}
	f := rep.Faults
	if f == nil {
		t.Fatal("no faults section")
	}
	t.Logf("faults: %+v", *f)
	if f.Spec != faultSpec {
		t.Errorf("faults.spec %q, want %q", f.Spec, faultSpec)
	}
	if f.InjectedRead == 0 {
		t.Error("no read fault was injected: the plan did not reach the disk reads, or the daemon does not count injected faults in its metrics")
	}
	if f.CorruptBlocksDelivered != 0 || f.FailedBlocksReoffered != 0 {
		t.Errorf("corrupt_blocks_delivered %d, failed_blocks_reoffered %d; want 0", f.CorruptBlocksDelivered, f.FailedBlocksReoffered)
	}
	if f.ReadFailuresReported < f.InjectedRead || f.BlocksFailedReported < f.InjectedRead {
		t.Errorf("%d read faults injected, %d reported as failed reads (%d failed blocks)", f.InjectedRead, f.ReadFailuresReported, f.BlocksFailedReported)
	}
}
