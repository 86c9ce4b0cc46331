package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
)

// TestQuickMirror runs the mirror scenario on a few thousand blocks (256 KiB) against
// the daemon built from this tree: the mirror answers requests in their
// step, never offers a block the engine did not store nor one whose bytes
// are wrong, and the stale answers and both runs' hit rates are reported.
func TestQuickMirror(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds and runs the daemon")
	}
	defer leakcheck.VerifyNone(t)
	bin := buildDaemon(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	rep, err := run(ctx, []string{"--quick", "--daemon", bin, "--scenarios", "mirror", "--layers", "4", "--steps", "80", "--engine-blocks", "48",
		"--baselines=false", "--redis-server", "none", "--seed", "5"}, &stdout, &stderr)
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("kvbench: %v", err)
	}
	// The mixed workload needs a disk tier; without, it says why.
	if len(rep.Mirror) != len(mirrorWorkloads) && (len(rep.Mirror) != len(mirrorWorkloads)-1 || !strings.Contains(stdout.String(), "mirror scenario, mixed workload")) {
		t.Fatalf("mirror rows: %+v", rep.Mirror)
	}
	for _, m := range rep.Mirror {
		if m.Unknown != 0 || m.Corrupt != 0 {
			t.Errorf("%s: wrong answers: %+v", m.Workload, m)
		}
		if m.Requests == 0 || m.Answered == 0 || m.Offered == 0 || m.Answered+m.NotLive+m.Recent+m.Remote != m.Requests {
			t.Errorf("%s: the mirror answered nothing, or the counts do not add up: %+v", m.Workload, m)
		}
		if m.Stale > m.Offered || m.StaleRate != float64(m.Stale)/float64(m.Offered) || m.HitRate <= 0 || m.DaemonHitRate <= 0 {
			t.Errorf("%s: stale rate or hit rates not reported: %+v", m.Workload, m)
		}
		if m.MirrorBlocks == 0 || m.MirrorStreams == 0 {
			t.Errorf("%s: the mirror held nothing at the end: %+v", m.Workload, m)
		}
		if m.Workload == "mixed" && m.OfferedDisk == 0 {
			t.Errorf("mixed: the mirror offered no block from the disk tier: %+v", m)
		}
	}
	if !bytes.Contains(stdout.Bytes(), []byte("stale (<=0.1%)")) {
		t.Errorf("the mirror table is not printed")
	}
}
