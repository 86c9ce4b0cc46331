package deploy

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

var (
	remoteSeriesOnce sync.Once
	remoteSeriesVal  series
)

// remoteSeries is one scrape of the daemon run as the sidecar runs it plus a
// remote tier (--remote-redis) that is down: a port nobody listens on. It
// stores, looks up and invalidates, so the remote tier's failures show
// (kvoffload_remote_up 0, failed batches, an invalidation whose generation
// records wait), and returns the scrape merged with workloadSeries': what
// the alerts and the dashboard query of the remote tier is checked against
// it.
func remoteSeries(t *testing.T) series {
	t.Helper()
	s := workloadSeries(t)
	remoteSeriesOnce.Do(func() {
		p := findSidecarPod(t, decodeManifests(t))
		port := freePort(t)
		args := hostArgs(t, "kvoffloadd args", p.args, t.TempDir(), map[string]string{
			"cpu-bytes": "32MiB", "disk-bytes": "64MiB", "metrics-addr": fmt.Sprintf("127.0.0.1:%d", port),
			"remote-redis": fmt.Sprintf("127.0.0.1:%d", freePort(t)), "remote-timeout": "200ms",
		})
		d := startDaemon(t, args)
		defer d.stop(t)
		socket, _ := flagValue(args, "socket")
		if code, out := health(t, "--socket", socket, "--wait", "1m"); code != 0 {
			t.Fatalf("daemon did not serve: %s", out)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		c, err := client.Dial(socket)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		const n = 8
		m := testenv.Model{Layers: 2, SegBytes: 64 << 10, Blocks: n}
		r := testenv.NewRegion(t, m.RegionBytes())
		reg, err := c.Register(ctx, []byte("deploy-remote-metrics"), m.Layout(), m.Regions(r), "deploy-test")
		if err != nil {
			t.Fatal(err)
		}
		hs := make([][]byte, n)
		blocks := make([]uint32, n)
		for i := range hs {
			hs[i], blocks[i] = m.Hash(1, i), uint32(i)
			m.Fill(r, i, hs[i])
		}
		if _, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(1, hs, blocks)}, true); err != nil {
			t.Fatal(err)
		}
		keys, err := client.Keys(0, 32, hs...)
		if err != nil {
			t.Fatal(err)
		}
		// Blocks the local tiers lack are asked of the remote tier.
		other := make([][]byte, n)
		for i := range other {
			other[i] = m.Hash(2, i)
		}
		okeys, err := client.Keys(0, 32, other...)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Lookup(ctx, []uint32{reg.NamespaceId}, okeys, 0); err != nil {
			t.Fatal(err)
		}
		// The cluster is down: the Invalidate answers UNAVAILABLE and its
		// generation records wait (kvoffload_remote_pending_deletes).
		if _, err := c.Invalidate(ctx, []uint32{reg.NamespaceId}, keys); err == nil {
			t.Fatal("an Invalidate with the remote tier down succeeded")
		}
		remoteSeriesVal = scrape(t, fmt.Sprintf("127.0.0.1:%d", port))
	})
	if remoteSeriesVal == nil {
		t.Fatal("the remote-tier daemon failed in an earlier test")
	}
	merged := series{}
	for _, src := range []series{s, remoteSeriesVal} {
		for name, labels := range src {
			for l, values := range labels {
				for v := range values {
					if merged[name] == nil {
						merged[name] = map[string]map[string]bool{}
					}
					if merged[name][l] == nil {
						merged[name][l] = map[string]bool{}
					}
					merged[name][l][v] = true
				}
			}
			if merged[name] == nil {
				merged[name] = map[string]map[string]bool{}
			}
		}
	}
	return merged
}

// TestRemoteSeries: the daemon with its remote tier down serves what the
// remote tier's alerts fire on.
func TestRemoteSeries(t *testing.T) {
	s := remoteSeries(t)
	for _, name := range []string{"kvoffload_remote_up", "kvoffload_remote_pending_deletes", "kvoffload_remote_errors_total",
		"kvoffload_remote_blocks_total", "kvoffload_remote_publish_queue_depth", "kvoffload_remote_op_duration_seconds_bucket"} {
		if _, ok := s[name]; !ok {
			t.Errorf("the daemon with a remote tier serves no %s", name)
		}
	}
	t.Logf("remote series: %v", func() map[string]map[string]map[string]bool {
		out := map[string]map[string]map[string]bool{}
		for k, v := range remoteSeriesVal {
			if len(k) > 16 && k[:16] == "kvoffload_remote" {
				out[k] = v
			}
		}
		return out
	}())
}
