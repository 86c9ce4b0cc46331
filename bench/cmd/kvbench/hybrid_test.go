package main

import (
	"bytes"
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
)

// TestQuickHybrid runs kvbench's hybrid scenario against the real daemon,
// built from this tree, with both hybrid shapes in their kinds and groups
// but fewer KV and Mamba heads (smaller still under the race detector). It
// asserts invariants, never timings: every loaded block held its bytes, no
// failed block was offered again, the daemon moved exactly what the hits
// need and the windowed treatment at most full layers' + window bytes per
// hit (and less than the all-full one), no windowed key was looked up
// outside a hit's window, the daemon evicted nothing, and the two
// treatments hit alike on the same trace.
func TestQuickHybrid(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds and runs the daemon")
	}
	if runtime.GOOS != "linux" {
		t.Skip("kvoffloadd is Linux-only")
	}
	defer leakcheck.VerifyNone(t)
	bin := buildDaemon(t)
	kvHeads, mambaHeads := 2, 8
	if raceDetector {
		kvHeads, mambaHeads = 1, 4
	}
	saved := hybridShapes
	defer func() { hybridShapes = saved }()
	hybridShapes = map[string]func() model.Hybrid{
		"hybrid-swa":   func() model.Hybrid { return model.HybridSWA(kvHeads) },
		"hybrid-mamba": func() model.Hybrid { return model.HybridMamba(mambaHeads) },
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	rep, err := run(ctx, []string{"--quick", "--daemon", bin, "--scenarios", "hybrid", "--baselines=false", "--seed", "5"}, &stdout, &stderr)
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("kvbench: %v", err)
	}
	if len(rep.Hybrid) != 2 {
		t.Fatalf("%d hybrid models reported, want 2", len(rep.Hybrid))
	}
	for _, h := range rep.Hybrid {
		w, f := h.Windowed, h.AllFull
		if h.Steps == 0 || w.Hits == 0 || w.LoadBytes == 0 {
			t.Errorf("%s: %d steps, %d hits, %d bytes loaded", h.Model, h.Steps, w.Hits, w.LoadBytes)
		}
		for name, x := range map[string]struct {
			corrupt, reoffered int
			moved, expected    uint64
		}{"windowed": {w.CorruptBlocksDelivered, w.FailedBlocksReoffered, w.LoadBytes, w.ExpectedBytes}, "all-full": {f.CorruptBlocksDelivered, f.FailedBlocksReoffered, f.LoadBytes, f.ExpectedBytes}} {
			if x.corrupt != 0 || x.reoffered != 0 || x.moved != x.expected {
				t.Errorf("%s %s: %d wrong blocks, %d re-offered, %d bytes moved for hits needing %d", h.Model, name, x.corrupt, x.reoffered, x.moved, x.expected)
			}
		}
		if w.LoadBytes > w.BoundBytes || w.LoadBytes >= f.LoadBytes {
			t.Errorf("%s: windowed moved %d bytes (ceiling %d), all-full %d", h.Model, w.LoadBytes, w.BoundBytes, f.LoadBytes)
		}
		if w.OutsideWindow != 0 || w.WindowKeys == 0 || w.KeysLookedUp >= f.KeysLookedUp {
			t.Errorf("%s: %d of %d windowed keys looked up outside a hit's window; %d keys in all, all-full %d", h.Model, w.OutsideWindow, w.WindowKeys, w.KeysLookedUp, f.KeysLookedUp)
		}
		if h.Evicted == nil || *h.Evicted != 0 || len(w.StoreFailed)+len(f.StoreFailed) != 0 {
			t.Errorf("%s: the daemon evicted %v blocks, stores failed %v %v: the tier holds the working set", h.Model, h.Evicted, w.StoreFailed, f.StoreFailed)
		}
		if w.HitTokens != f.HitTokens || w.Hits != f.Hits {
			t.Errorf("%s: windowed hit %d tokens in %d requests, all-full %d in %d", h.Model, w.HitTokens, w.Hits, f.HitTokens, f.Hits)
		}
		t.Logf("%s: hit rate %.3f both; bytes per hit token %.0f vs %.0f (ratio %.3f)", h.Model, w.HitRate, w.BytesPerHitToken, f.BytesPerHitToken, *h.BytesPerHitTokenRatio)
	}
}
