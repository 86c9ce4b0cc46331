package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/report"
	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
)

// TestQuickScale runs the scale scenario at 4,096 blocks against the daemon
// built from this tree: every block stored with room is held, none reported
// stored is dropped over the disk tier, and after the kill -9 every block
// that was on disk comes back.
func TestQuickScale(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds and runs the daemon")
	}
	defer leakcheck.VerifyNone(t)
	rep, _ := runQuick(t, "--scenarios", "scale", "--scale-blocks", "4096", "--steps", "2", "--seed", "4")
	if len(rep.Scale) != 1 {
		t.Fatalf("scale rows: %+v", rep.Scale)
	}
	sc := rep.Scale[0]
	if sc.CPUStoredOK != 4096 || sc.CPUHeld != 4096 || sc.StatsMaxMs <= 0 {
		t.Fatalf("CPU tier: %+v", sc)
	}
	// The snapshot during Lookups: every block, each time (kvbench fails
	// otherwise), with Lookups all along (a snapshot of 4,096 blocks may
	// end within one Lookup).
	if sc.SnapshotBlocks != 4096 || len(sc.SnapshotSeconds) != 3 || sc.LookupsIdle == 0 {
		t.Fatalf("snapshot during Lookups: %+v", sc)
	}
	if sc.DiskSkipped != "" {
		t.Skipf("disk part skipped: %s", sc.DiskSkipped)
	}
	if sc.DiskStoredOK != 4096 || sc.DiskDropped != 0 || sc.DiskLost != 0 || sc.DiskOnDisk == 0 || sc.RecoveredBlocks < sc.DiskOnDisk || sc.BadSlots != 0 {
		t.Fatalf("disk tier: %+v", sc)
	}
}

// runQuick runs kvbench --quick with args (and --engine-blocks 48, no
// baselines, no Redis) against the daemon built from this tree, within 4
// minutes, logging its output; a kvbench error fails the test. It returns
// the report and what kvbench printed.
func runQuick(t *testing.T, args ...string) (*report.Report, string) {
	t.Helper()
	bin := buildDaemon(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	all := append([]string{"--quick", "--daemon", bin, "--engine-blocks", "48", "--baselines=false", "--redis-server", "none"}, args...)
	rep, err := run(ctx, all, &stdout, &stderr)
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("kvbench: %v", err)
	}
	return rep, stdout.String()
}
