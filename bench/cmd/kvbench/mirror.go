package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
	"github.com/kvoffloadd/kvoffloadd/bench/engine"
	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/report"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// The mirror scenario (issue 32): for each workload (cpu: the CPU tier
// holds the working set; tight: a CPU tier of 40 % of it, evicting;
// mixed: 55 % of it over a disk tier, with a disk directory), the
// run's steps on a fresh daemon twice: every lookup a round trip to the
// daemon, then every lookup answered from an engine.Mirror of the daemon's
// WatchEvents stream while it is live (the Python connector's rules), the
// daemon's Lookup still sent and timed, and a plain Go map of the same
// keys timed beside it. It reports the share answered in the step, the
// three lookup times, the stale answers (offered by the mirror, MISSING at
// the load) and both runs' hit rates.

// mirrorWorkloads are the mirror scenario's CPU tiers: a share of the
// working set (at least 2.5 engine-fulls), over a disk tier or not.
var mirrorWorkloads = []struct {
	name  string
	share float64
	disk  bool
}{{"cpu", 1.25, false}, {"tight", 0.4, false}, {"mixed", 0.55, true}}

func (b *bench) mirror(ctx context.Context) error {
	B := float64(b.o.shape.BlockBytes())
	D, E := float64(b.distinct)*B, float64(b.region.Blocks)*B
	size := func(x float64) uint64 { return (uint64(x) + 64<<20 - 1) / (64 << 20) * (64 << 20) }
	var errs []error
	for _, w := range mirrorWorkloads {
		cpu, disk := size(max(w.share*D, 2.5*E)), uint64(0)
		row := report.Mirror{Workload: w.name, Desc: "cpu tier " + model.FormatBytes(cpu)}
		if w.disk {
			disk = size(1.5*D + 2*E)
			why := ""
			switch {
			case !b.flags["disk-dir"] || !b.flags["disk-bytes"]:
				why = "the daemon has no disk tier"
			case b.diskDir == "":
				why = b.diskWhy
			case diskFree(b.diskDir) < disk+disk/8:
				why = fmt.Sprintf("%s has %s free, the disk tier needs %s", b.diskDir, model.FormatBytes(diskFree(b.diskDir)), model.FormatBytes(disk))
			}
			if why != "" {
				b.rep.Skipped = append(b.rep.Skipped, report.Skip{What: "mirror scenario, mixed workload", Reason: why})
				b.prog.advance(2 * len(b.steps))
				continue
			}
			row.Desc += ", disk tier " + model.FormatBytes(disk)
		}
		b.prog.phase(fmt.Sprintf("scenario mirror %s: %s, daemon lookups", w.name, row.Desc))
		plain, err := b.mirrorRun(ctx, w.name+"-daemon", cpu, disk, false)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s, daemon lookups: %w", w.name, err))
			continue
		}
		b.prog.phase(fmt.Sprintf("scenario mirror %s: %s, mirror lookups", w.name, row.Desc))
		res, err := b.mirrorRun(ctx, w.name+"-mirror", cpu, disk, true)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s, mirror lookups: %w", w.name, err))
			continue
		}
		m := res.Mirror
		row.Requests, row.Answered, row.NotLive, row.Recent, row.Remote = m.Requests, m.Answered, m.NotLive, m.Recent, m.Remote
		if m.Requests > 0 {
			row.AnsweredShare = float64(m.Answered) / float64(m.Requests)
		}
		p := func(op *engine.Op, q float64) float64 { return us(engine.Percentile(op.Latencies, q)) }
		row.MirrorP50us, row.MirrorP99us = p(&m.MirrorOp, 50), p(&m.MirrorOp, 99)
		row.MapP50us, row.MapP99us = p(&m.MapOp, 50), p(&m.MapOp, 99)
		row.DaemonP50us, row.DaemonP99us = p(&res.Lookup, 50), p(&res.Lookup, 99)
		row.Offered, row.OfferedDisk, row.Stale, row.FailedOther = m.Offered, m.OfferedDisk, m.Stale, m.FailedOther
		if m.Offered > 0 {
			row.StaleRate = float64(m.Stale) / float64(m.Offered)
		}
		row.Ahead, row.Behind, row.RecentLonger, row.Unknown, row.Corrupt = m.Ahead, m.Behind, m.RecentLonger, m.Unknown, res.CorruptDelivered
		row.HitRate, row.DaemonHitRate = hitRate(res), hitRate(plain)
		if h := plain.HitCPU + plain.HitDisk + plain.HitRemote; h > 0 {
			row.DaemonFailedRate = float64(plain.BlocksFailedLoaded) / float64(h)
		}
		row.MirrorBlocks, row.MirrorStreams = m.Blocks, m.Streams
		b.rep.Mirror = append(b.rep.Mirror, row)
		if m.Unknown > 0 || res.CorruptDelivered > 0 {
			errs = append(errs, fmt.Errorf("%s: the mirror offered %d blocks never stored, %d loaded with wrong bytes", w.name, m.Unknown, res.CorruptDelivered))
		}
		if ctx.Err() != nil {
			break
		}
	}
	return errors.Join(errs...)
}

func hitRate(r *engine.Result) float64 {
	if r.LookedUp == 0 {
		return 0
	}
	return float64(r.HitCPU+r.HitDisk+r.HitRemote) / float64(r.LookedUp)
}

// mirrorRun runs the steps on a fresh daemon with a CPU tier of cpu bytes
// (over a disk tier of disk bytes, if any), with a mirror or without.
func (b *bench) mirrorRun(ctx context.Context, name string, cpu, disk uint64, mirror bool) (*engine.Result, error) {
	dir, err := os.MkdirTemp(b.tmp, "mirror-"+name+"-")
	if err != nil {
		return nil, err
	}
	opts := daemon.Options{Binary: b.binary, Dir: dir, CPUBytes: cpu, IOWorkers: b.o.ioWorkers}
	if disk > 0 {
		ddir := filepath.Join(b.diskDir, "mirror-"+name)
		if err := os.Mkdir(ddir, 0o700); err != nil {
			return nil, err
		}
		defer os.RemoveAll(ddir)
		opts.DiskDir, opts.DiskBytes = ddir, disk
		if b.flags["disk-reset"] {
			opts.Extra = append(opts.Extra, "--disk-reset")
		}
		if b.flags["disk-queue-depth"] {
			opts.Extra = append(opts.Extra, "--disk-queue-depth", strconv.Itoa(b.o.queueDepth))
		}
		if b.flags["disk-chunk-bytes"] {
			opts.Extra = append(opts.Extra, "--disk-chunk-bytes", strconv.FormatUint(slots.DefaultChunkBytes(disk), 10))
		}
	}
	d, err := b.startDaemon(ctx, opts)
	if err != nil {
		return nil, err
	}
	defer d.Stop()
	b.meter.Track(d.Pid())
	defer b.meter.Untrack(d.Pid())
	c, err := client.Dial(d.Socket)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	cfg := engine.Config{
		Client:      c,
		Region:      b.region,
		Fingerprint: fmt.Appendf(nil, "kvbench/%s/mirror-%s/seed=%d/pid=%d/%d", b.o.shape.Name, name, b.o.seed, os.Getpid(), time.Now().UnixNano()),
		Steps:       b.steps,
		Progress:    func(int, int) { b.prog.advance(1) },
		Wait:        b.o.wait,
		Phase: func(ph string) func() {
			mk := b.meter.Start("mirror " + name + ": " + ph)
			return func() { b.meter.End(mk) }
		},
	}
	if mirror {
		mc, err := client.Dial(d.Socket)
		if err != nil {
			return nil, err
		}
		defer mc.Close()
		cfg.MirrorClient = mc
	}
	res, err := engine.Run(ctx, cfg)
	if err == nil && res.FirstReoffer != "" {
		err = fmt.Errorf("a failed block was offered again by the daemon: %s", res.FirstReoffer)
	}
	return res, errors.Join(err, d.Stop())
}
