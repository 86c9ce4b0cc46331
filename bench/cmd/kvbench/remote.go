package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvoffloadd/kvoffloadd/bench/baseline"
	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
	"github.com/kvoffloadd/kvoffloadd/bench/engine"
	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/report"
	"github.com/kvoffloadd/kvoffloadd/internal/rediscluster"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	"github.com/kvoffloadd/kvoffloadd/tiers/remote"
)

// The remote scenario: two daemons share one Redis Cluster (three masters
// kvbench starts on loopback). Node A runs the steps, publishing every
// block it stores; node B, with an empty local cache, looks up each of A's
// requests once and loads every block it is offered from the cluster.
// Beside it, raw GETs of the same values from the same cluster, grouped
// the same way (remoteLoadBlocks per round, remoteJobBlocks per pipeline).
const (
	remoteLoadBlocks = 32
	remoteJobBlocks  = 8
)

// remoteSkip says why the remote scenario cannot run, "" when it can.
func (b *bench) remoteSkip() string {
	switch {
	case b.o.socket != "":
		return "--socket: kvbench cannot give a daemon it did not start a remote tier"
	case !b.flags["remote-redis"]:
		return "daemon has no remote tier (its --help lists no --remote-redis)"
	}
	if err := rediscluster.Available(); err != nil {
		return err.Error()
	}
	return ""
}

// remote runs the scenario and adds its rows and its baseline.
func (b *bench) remote(ctx context.Context, sc scenario) error {
	o := b.o
	b.prog.phase(fmt.Sprintf("scenario remote: a Redis Cluster of 3 masters, node A (cpu tier %s) publishes, node B loads", model.FormatBytes(sc.cpuBytes)))
	dir, err := os.MkdirTemp(b.tmp, "remote-")
	if err != nil {
		return err
	}
	// go-redis's own log lines (a refused dial while the cluster starts)
	// would garble the progress; kvbench reports failures as errors.
	rediscluster.QuietLogs()
	cluster, err := rediscluster.Start(ctx, rediscluster.Options{Dir: filepath.Join(dir, "cluster")})
	if err != nil {
		return fmt.Errorf("redis cluster: %w", err)
	}
	defer cluster.Close()
	seeds := strings.Join(cluster.Addrs(), ",")
	fp := fmt.Appendf(nil, "kvbench/%s/remote/seed=%d/pid=%d/%d", o.shape.Name, o.seed, os.Getpid(), time.Now().UnixNano())
	common := []string{"--remote-redis", seeds, "--remote-timeout", "5s"}

	// Node A: the steps, every stored block published write-behind.
	resA, metricsA, err := b.remoteNode(ctx, dir, "a", sc, append(common, "--remote-write", "all", "--remote-queue", strconv.Itoa(min(1<<16, b.distinct+1024))),
		func(c *client.Client) (*engine.Result, error) {
			// Keep: an Invalidate at the end would delete A's blocks
			// from the cluster before B reads them.
			return engine.Run(ctx, engine.Config{Client: c, Region: b.region, Fingerprint: fp, Steps: b.steps, LeaseMs: uint32(o.leaseMs),
				Progress: func(int, int) { b.prog.advance(1) }, Keep: true})
		}, true)
	if err != nil {
		return fmt.Errorf("node A: %w", err)
	}
	published := int(daemon.Sum(metricsA, "kvoffload_remote_blocks_total", `op="publish"`, `result="published"`))
	dropped := int(daemon.Sum(metricsA, "kvoffload_remote_blocks_total", `op="publish"`, `result="dropped"`))
	desc := fmt.Sprintf("node A cpu tier %s, published %d blocks (%d dropped)", model.FormatBytes(sc.cpuBytes), published, dropped)
	store := resultRow("remote", "store", &resA.Store, resA.StoreFailed, resA, desc)
	b.rep.Results = append(b.rep.Results, store)

	// Node B: empty, reads A's blocks through the cluster.
	resB, _, err := b.remoteNode(ctx, dir, "b", sc, append(common, "--remote-write", "none"),
		func(c *client.Client) (*engine.Result, error) {
			return engine.RemoteLoads(ctx, engine.Config{Client: c, Region: b.region, Fingerprint: fp, Steps: b.steps, StepTimeout: time.Minute, Keep: true},
				min(remoteLoadBlocks, b.region.Blocks), remoteJobBlocks)
		}, false)
	if resB != nil {
		descB := fmt.Sprintf("node B cpu tier %s, empty; %d blocks per Load in jobs of %d", model.FormatBytes(sc.cpuBytes), min(remoteLoadBlocks, b.region.Blocks), remoteJobBlocks)
		lk := resultRow("remote", "lookup", &resB.Lookup, nil, resB, descB)
		if resB.LookedUp > 0 {
			lk.HitRate = map[string]float64{
				"remote": float64(resB.HitRemote) / float64(resB.LookedUp),
				"cpu":    float64(resB.HitCPU) / float64(resB.LookedUp),
				"disk":   float64(resB.HitDisk) / float64(resB.LookedUp),
				"all":    float64(resB.HitRemote+resB.HitCPU+resB.HitDisk) / float64(resB.LookedUp),
			}
		}
		lk.Blocks = resB.LookedUp
		b.rep.Results = append(b.rep.Results, lk, resultRow("remote", "load-remote", &resB.RemoteLoad, resB.RemoteLoadFailed, resB, descB))
		if resB.FirstCorrupt != "" {
			err = errors.Join(err, fmt.Errorf("node B: wrong bytes delivered by a load: %s", resB.FirstCorrupt))
		}
		if resB.FirstReoffer != "" {
			err = errors.Join(err, fmt.Errorf("node B: a failed block was offered again: %s", resB.FirstReoffer))
		}
	}
	if err != nil {
		return fmt.Errorf("node B: %w", err)
	}

	// The baseline: raw GETs of the same values from the same cluster.
	b.prog.phase("baseline: raw GETs of the same blocks from the same cluster (go-redis, same grouping)")
	keys, err := clusterKeys(ctx, cluster)
	if err == nil && len(keys) == 0 {
		err = errors.New("the cluster holds no values")
	}
	if err != nil {
		return fmt.Errorf("cluster GET baseline: %w", err)
	}
	g, err := baseline.MeasureClusterGet(ctx, cluster.Addrs(), keys, remote.HeaderSize+o.shape.BlockBytes(), min(remoteLoadBlocks, b.region.Blocks), remoteJobBlocks)
	if err != nil {
		return fmt.Errorf("cluster GET baseline: %w", err)
	}
	b.rep.Baselines.RedisClusterGetGBps = report.F(g.GBps)
	b.rep.Baselines.RedisClusterGetP99us = report.F(us(g.P99))
	b.rep.Baselines.RedisClusterBlocks = g.Blocks
	b.prog.advance(1)
	return nil
}

// remoteNode runs one node of the scenario: it starts the daemon with
// extra flags, runs drive against it, and (for the publishing node) waits
// until its publish queue is empty before reading its metrics and
// stopping it.
func (b *bench) remoteNode(ctx context.Context, dir, name string, sc scenario, extra []string, drive func(*client.Client) (*engine.Result, error), publishes bool) (*engine.Result, map[string]float64, error) {
	ndir, err := os.MkdirTemp(dir, name+"-")
	if err != nil {
		return nil, nil, err
	}
	if b.flags["cpu-chunk-bytes"] {
		// One chunk for the arena: a class's policy holds what its
		// chunks hold, and a class takes another chunk only when a
		// store finds fewer free slots than it asks for, so with
		// several chunks node A's policy rejects stores while most of
		// the arena is free, and node B misses what A never kept. The
		// scenario measures the remote tier, not that.
		extra = append(extra, "--cpu-chunk-bytes", strconv.FormatUint(sc.cpuBytes, 10))
	}
	d, err := b.startDaemon(ctx, daemon.Options{Binary: b.binary, Dir: ndir, CPUBytes: sc.cpuBytes, IOWorkers: b.o.ioWorkers, Extra: extra})
	if err != nil {
		return nil, nil, err
	}
	defer d.Stop()
	c, err := client.Dial(d.Socket)
	if err != nil {
		return nil, nil, errors.Join(err, d.Stop())
	}
	defer c.Close()
	res, runErr := drive(c)
	var metrics map[string]float64
	if publishes && runErr == nil {
		runErr = waitPublished(ctx, d)
	}
	mctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	metrics, err = d.Metrics(mctx)
	cancel()
	runErr = errors.Join(runErr, err)
	if b.o.keepDir != "" {
		runErr = errors.Join(runErr, keep(b.o.keepDir, "remote-"+name, d, metrics))
	}
	c.Close()
	return res, metrics, errors.Join(runErr, d.Stop())
}

// waitPublished waits until the daemon's publish queue is empty.
func waitPublished(ctx context.Context, d *daemon.Daemon) error {
	deadline := time.Now().Add(5 * time.Minute)
	for {
		mctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		m, err := d.Metrics(mctx)
		cancel()
		if err != nil {
			return err
		}
		if daemon.Sum(m, "kvoffload_remote_publish_queue_depth") == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New("the publish queue did not drain within 5m")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// clusterKeys lists the key of every value in the cluster (kvbench's own:
// it started it), not the generation records beside them.
func clusterKeys(ctx context.Context, c *rediscluster.Cluster) ([]string, error) {
	var keys []string
	for _, n := range c.Nodes() {
		cl := n.Client()
		it := cl.Scan(ctx, 0, remote.KeyPrefix+"*", 1000).Iterator()
		for it.Next(ctx) {
			if !remote.IsRecordKey(it.Val()) {
				keys = append(keys, it.Val())
			}
		}
		err := it.Err()
		cl.Close()
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, err
		}
	}
	return keys, nil
}

// resultRow is a report row of one op.
func resultRow(scenario, op string, x *engine.Op, failed map[string]int, r *engine.Result, desc string) report.Result {
	return report.Result{Scenario: scenario, Op: op, GBps: x.GBps(), Blocks: x.Blocks, Bytes: x.Bytes, Calls: x.Calls, CompletionsCalls: x.Completions,
		P50us: us(engine.Percentile(x.Latencies, 50)), P99us: us(engine.Percentile(x.Latencies, 99)),
		Failed: failed, CorruptBlocksDelivered: r.CorruptDelivered, FailedBlocksReoffered: r.FailedReoffered, Daemon: desc}
}
