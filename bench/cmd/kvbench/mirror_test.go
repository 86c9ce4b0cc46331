package main

import (
	"strings"
	"testing"

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
	rep, stdout := runQuick(t, "--scenarios", "mirror", "--layers", "4", "--steps", "80", "--seed", "5")
	// The mixed workload needs a disk tier; without, it says why.
	if len(rep.Mirror) != len(mirrorWorkloads) && (len(rep.Mirror) != len(mirrorWorkloads)-1 || !strings.Contains(stdout, "mirror scenario, mixed workload")) {
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
	if !strings.Contains(stdout, "stale (<=0.1%)") {
		t.Errorf("the mirror table is not printed")
	}
}
