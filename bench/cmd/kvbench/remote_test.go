package main

import (
	"bytes"
	"context"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/leakcheck"
	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
)

// TestQuickRemote runs the remote scenario, short, against the daemon
// built from this tree: node B must find A's blocks in the cluster, load
// them all byte for byte (the run fails on a wrong or re-offered block),
// and the report must carry the scenario's rows, its baseline and ratio.
func TestQuickRemote(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds and runs the daemon and a Redis Cluster")
	}
	if err := rediscluster.Available(); err != nil && !rediscluster.Required() {
		t.Skip(err)
	}
	defer leakcheck.VerifyNone(t)
	bin := filepath.Join(t.TempDir(), "kvoffloadd")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/kvoffloadd/kvoffloadd/cmd/kvoffloadd").CombinedOutput(); err != nil {
		t.Fatalf("go build kvoffloadd: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	rep, err := run(ctx, []string{"--quick", "--daemon", bin, "--scenarios", "remote", "--steps", "6", "--engine-blocks", "48",
		"--redis-server", "none", "--seed", "4"}, &stdout, &stderr)
	t.Logf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	if err != nil {
		t.Fatalf("kvbench: %v", err)
	}
	lk, ld := rep.Find("remote", "lookup"), rep.Find("remote", "load-remote")
	if lk == nil || ld == nil || rep.Find("remote", "store") == nil {
		t.Fatalf("remote rows missing: %+v", rep.Results)
	}
	if lk.HitRate["remote"] <= 0 || ld.Blocks == 0 || ld.Bytes == 0 {
		t.Fatalf("node B found nothing of node A's: lookup %+v, load %+v", lk, ld)
	}
	if n := ld.Failed["MISSING"] + ld.Failed["IO_ERROR"] + ld.Failed["CORRUPT"]; n != 0 {
		t.Fatalf("remote loads failed on a healthy cluster: %v", ld.Failed)
	}
	if rep.Baselines.RedisClusterGetGBps == nil || rep.Ratios.RemoteLoadVsClusterGet == nil {
		t.Fatalf("no cluster GET baseline or ratio: %+v %+v", rep.Baselines, rep.Ratios)
	}
}
