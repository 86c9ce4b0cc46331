package main

import (
	"bytes"
	"context"
	"testing"
	"time"

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
	bin := buildDaemon(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	rep, err := run(ctx, []string{"--quick", "--daemon", bin, "--scenarios", "scale", "--scale-blocks", "4096", "--steps", "2", "--engine-blocks", "48",
		"--baselines=false", "--redis-server", "none", "--seed", "4"}, &stdout, &stderr)
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("kvbench: %v", err)
	}
	if len(rep.Scale) != 1 {
		t.Fatalf("scale rows: %+v", rep.Scale)
	}
	sc := rep.Scale[0]
	if sc.CPUStoredOK != 4096 || sc.CPUHeld != 4096 || sc.StatsMaxMs <= 0 {
		t.Fatalf("CPU tier: %+v", sc)
	}
	if sc.DiskSkipped != "" {
		t.Skipf("disk part skipped: %s", sc.DiskSkipped)
	}
	if sc.DiskStoredOK != 4096 || sc.DiskDropped != 0 || sc.DiskLost != 0 || sc.DiskOnDisk == 0 || sc.RecoveredBlocks < sc.DiskOnDisk || sc.BadSlots != 0 {
		t.Fatalf("disk tier: %+v", sc)
	}
}
