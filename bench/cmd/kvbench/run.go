package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/bench/baseline"
	"github.com/kvoffloadd/kvoffloadd/bench/cachesim"
	"github.com/kvoffloadd/kvoffloadd/bench/corrupt"
	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
	"github.com/kvoffloadd/kvoffloadd/bench/engine"
	"github.com/kvoffloadd/kvoffloadd/bench/interference"
	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/bench/report"
	"github.com/kvoffloadd/kvoffloadd/bench/workload"
	"github.com/kvoffloadd/kvoffloadd/layout"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// run is kvbench: it returns the report it printed, and an error when the
// run could not finish or found the daemon breaking a promise (a wrong
// block delivered, a failed block offered again, an injected read fault
// not reported, an unclean exit).
func run(ctx context.Context, args []string, stdout, stderr io.Writer) (*report.Report, error) {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return nil, err
	}
	b := &bench{o: o, stdout: stdout, stderr: stderr}
	rep, err := b.run(ctx)
	if b.prog != nil {
		b.prog.end()
	}
	return rep, err
}

// bench is one run's state.
type bench struct {
	o              *options
	stdout, stderr io.Writer
	prog           *progress

	tmp       string // private: sockets, logs, redis
	diskDir   string // our subdirectory of the disk directory ("" when none takes O_DIRECT)
	diskWhy   string // why there is none
	binary    string
	flags     map[string]bool
	region    *model.Region
	steps     [][]workload.Request
	distinct  int
	grpcTimed bool
	meter     *interference.Meter
	copier    *baseline.ProcessCopier // the cpu scenario's same-segment copies, by another process
	ownCopier *baseline.SegmentCopier // and by kvbench's own
	trace     [][]cachesim.Request    // b.steps' keys, for the hit-rate references

	rep report.Report
}

// scenario is one daemon run.
type scenario struct {
	name      string // result label: cpu, disk, mixed, faults@0.05, corrupt
	kind      string
	cpuBytes  uint64
	diskBytes uint64
	spec      string
	rate      float64
}

func (b *bench) run(ctx context.Context) (*report.Report, error) {
	o := b.o
	rep := &b.rep
	rep.Schema, rep.Command, rep.Seed, rep.Quick = report.Schema, o.command(), o.seed, o.quick
	rep.Skipped = []report.Skip{}
	b.meter = interference.New(o.threshold)

	var err error
	if b.tmp, err = os.MkdirTemp("", "kvbench-"); err != nil {
		return nil, err
	}
	defer os.RemoveAll(b.tmp)
	if o.socket == "" {
		if b.binary, err = daemon.Find(o.daemon); err != nil {
			return nil, err
		}
		if b.flags, err = daemon.Flags(b.binary); err != nil {
			return nil, err
		}
		rep.Daemon = b.binary + " (" + daemon.Version(b.binary) + ")"
	} else {
		rep.Daemon = "external, at " + o.socket
	}
	if err := b.pickDiskDir(); err != nil {
		return nil, err
	}
	if b.diskDir != "" {
		defer os.RemoveAll(b.diskDir)
	}
	if b.diskDir != "" {
		rep.Machine = report.Describe(filepath.Dir(b.diskDir))
	} else {
		rep.Machine = report.Describe("")
	}

	// The workload, and the engine's memory.
	shape := o.shape
	wl := workload.Default(o.seed)
	E := o.engineBlocks
	if E == 0 {
		target := 256 << 20
		if o.quick {
			target = 128 << 20
		}
		E = max(target/shape.BlockBytes(), wl.MaxBlocks())
	}
	nsteps := o.steps
	if nsteps == 0 {
		nsteps = 48
		if o.quick {
			nsteps = 24
		}
	}
	if b.steps, err = workload.Steps(wl, nsteps, E); err != nil {
		return nil, err
	}
	b.distinct = workload.Distinct(b.steps)
	if b.region, err = model.NewRegion("/dev/shm", shape, E); err != nil {
		return nil, err
	}
	defer b.region.Close()
	if slices.Contains(o.scenarios, "cpu") {
		if b.ownCopier, err = baseline.NewSegmentCopier(b.region, 0, o.ioWorkers); err != nil {
			return nil, err
		}
		defer b.ownCopier.Close()
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("the segment copy baseline starts kvbench again: %w", err)
		}
		if b.copier, err = baseline.StartProcessCopier(exe, b.region, 0, o.ioWorkers); err != nil {
			return nil, err
		}
		defer b.copier.Close()
		// The helper's CPU time is the run's, not interference.
		b.meter.Track(b.copier.Pid())
		defer b.meter.Untrack(b.copier.Pid())
	}
	for _, st := range b.steps {
		var reqs []cachesim.Request
		for _, r := range st {
			keys := make(cachesim.Request, len(r.Keys))
			for i, k := range r.Keys {
				keys[i] = string(k)
			}
			reqs = append(reqs, keys)
		}
		b.trace = append(b.trace, reqs)
	}
	rep.Model = report.Model{Name: shape.Name, Layers: shape.Layers, BlockTokens: shape.BlockTokens, KVHeads: shape.KVHeads,
		HeadDim: shape.HeadDim, DTypeBytes: shape.DTypeBytes, Segments: shape.Segments(), SegmentBytes: shape.SegmentBytes(),
		BlockBytes: shape.BlockBytes(), EngineBlocks: E, StepsPerScenario: nsteps, WorkingSetBlocks: b.distinct}

	runs, skips := b.plan()
	rep.Skipped = append(rep.Skipped, skips...)
	units := 4
	for _, sc := range runs {
		if sc.kind == "hybrid" {
			units += len(o.hybridModels) * o.hybridSteps(nsteps)
		} else if sc.kind == "mirror" {
			units += 2 * len(mirrorWorkloads) * nsteps
		} else {
			units += nsteps
		}
	}
	b.prog = newProgress(b.stderr, units)
	b.prog.phase(fmt.Sprintf("%s; %d steps per scenario, working set %d blocks (%s)", shape, nsteps, b.distinct,
		model.FormatBytes(uint64(b.distinct)*uint64(shape.BlockBytes()))))

	var faults []report.Faults
	var sweep []report.SweepPoint
	var errs []error
	for _, sc := range runs {
		if sc.kind == "remote" {
			if err := b.remote(ctx, sc); err != nil {
				errs = append(errs, fmt.Errorf("scenario remote: %w", err))
			}
			continue
		}
		if sc.kind == "hybrid" {
			if err := b.hybrid(ctx, nsteps); err != nil {
				errs = append(errs, fmt.Errorf("scenario hybrid: %w", err))
			}
			continue
		}
		if sc.kind == "mirror" {
			if err := b.mirror(ctx); err != nil {
				errs = append(errs, fmt.Errorf("scenario mirror: %w", err))
				if ctx.Err() != nil {
					break
				}
			}
			continue
		}
		if sc.kind == "scale" {
			if err := b.scale(ctx); err != nil {
				errs = append(errs, fmt.Errorf("scenario scale: %w", err))
				if ctx.Err() != nil {
					break
				}
			}
			continue
		}
		if sc.kind == "restart" {
			if err := b.restart(ctx); err != nil {
				errs = append(errs, fmt.Errorf("scenario restart: %w", err))
				if ctx.Err() != nil {
					break
				}
			}
			continue
		}
		out, err := b.scenario(ctx, sc)
		if res, f := out.res, out.faults; res != nil {
			b.addResults(sc, out)
			if sc.kind == "faults" || sc.kind == "corrupt" {
				faults = append(faults, f)
			}
			if sc.kind == "disk" || (sc.kind == "faults" && sc.rate > 0) {
				sweep = append(sweep, report.SweepPoint{Rate: sc.rate, Spec: sc.spec,
					LoadGBps: res.Load.GBps(), LoadP99us: us(engine.Percentile(res.Load.Latencies, 99)),
					DiskLoadGBps: res.DiskLoad.GBps(), DiskLoadP99us: us(engine.Percentile(res.DiskLoad.Latencies, 99)),
					StoreGBps: res.Store.GBps(), Faults: f})
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("scenario %s: %w", sc.name, err))
			if ctx.Err() != nil {
				break
			}
		}
	}
	if ctx.Err() == nil && o.baselines {
		errs = append(errs, b.baselines(ctx))
	} else if !o.baselines {
		rep.Skipped = append(rep.Skipped, report.Skip{What: "memcpy, O_DIRECT and Redis baselines", Reason: "--baselines=false"})
	}
	b.summarize(faults, sweep)
	b.prog.end()
	rep.Interference = &report.Interference{Threshold: b.meter.Threshold()}
	for _, p := range b.meter.Phases() {
		rep.Interference.Phases = append(rep.Interference.Phases, report.Phase(p))
	}
	rep.Print(b.stdout)

	if o.jsonPath != "" {
		errs = append(errs, rep.WriteJSON(o.jsonPath))
	}
	if o.plotPath != "" {
		if len(rep.Sweep) < 2 {
			errs = append(errs, fmt.Errorf("--plot: needs the disk scenario and a fault sweep; ran %d points", len(rep.Sweep)))
		} else {
			errs = append(errs, report.Plot(o.plotPath, rep.Sweep, fmt.Sprintf("%s, %s blocks, %s", shape.Name,
				model.FormatBytes(uint64(shape.BlockBytes())), rep.Machine.DiskFS)))
		}
	}
	errs = append(errs, b.verdict())
	return rep, errors.Join(errs...)
}

// pickDiskDir makes a private directory on a filesystem that takes
// O_DIRECT: under --disk-dir, or the first candidate that does.
func (b *bench) pickDiskDir() error {
	cands := []string{os.TempDir(), "/var/tmp", "."}
	if b.o.diskDir != "" {
		cands = []string{b.o.diskDir}
	}
	var why []string
	for _, c := range cands {
		err := vfs.ProbeDirect(c)
		if err == nil {
			d, err := os.MkdirTemp(c, "kvbench-disk-")
			if err != nil {
				return err
			}
			b.diskDir, err = filepath.Abs(d)
			return err
		}
		if b.o.diskDir != "" {
			return fmt.Errorf("--disk-dir %s: %w", b.o.diskDir, err)
		}
		why = append(why, fmt.Sprintf("%s: %v", c, err))
	}
	b.diskWhy = "no directory takes O_DIRECT (" + strings.Join(why, "; ") + "); pass --disk-dir"
	return nil
}

// plan sizes each scenario's daemon against the working set.
func (b *bench) plan() ([]scenario, []report.Skip) {
	o := b.o
	B := uint64(o.shape.BlockBytes())
	D := uint64(b.distinct) * B
	E := uint64(b.region.Blocks) * B
	size := func(x float64) uint64 { return (uint64(x) + 64<<20 - 1) / (64 << 20) * (64 << 20) }
	// The CPU tier of the disk scenarios holds a step's blocks a few times
	// over (loads are promoted, stores land there first) and a small part
	// of the working set: most hits must come from disk.
	smallCPU := size(max(0.12*float64(D), 2.5*float64(E)))
	diskBytes := size(1.5*float64(D) + 2*float64(E))
	hasDisk := b.flags["disk-dir"] && b.flags["disk-bytes"]
	var runs []scenario
	var skips []report.Skip
	skip := func(what, why string) { skips = append(skips, report.Skip{What: what, Reason: why}) }
	for _, s := range o.scenarios {
		switch {
		case s == "mirror" && o.socket == "":
			runs = append(runs, scenario{name: s, kind: s})
			continue
		case s == "scale" && o.socket == "":
			// It sizes its own tiers, per N, and skips the disk part
			// itself without a disk directory or the room.
			runs = append(runs, scenario{name: s, kind: s})
			continue
		case o.socket != "" && s == "cpu":
			runs = append(runs, scenario{name: "external", kind: "cpu"})
			continue
		case s == "remote":
			if why := b.remoteSkip(); why != "" {
				skip("remote scenario", why)
				continue
			}
			cpu := size(1.25*float64(D) + 2*float64(E))
			if avail := memAvailable(); avail > 0 && cpu > avail/4 {
				cpu = avail / 4 / (64 << 20) * (64 << 20)
			}
			runs = append(runs, scenario{name: "remote", kind: s, cpuBytes: cpu})
			continue
		case o.socket != "":
			skip(s+" scenario", "--socket: kvbench cannot set the tiers or fault plan of a daemon it did not start")
			continue
		case s == "hybrid":
			runs = append(runs, scenario{name: s, kind: s})
			continue
		case s == "tight":
			// CPU only, smaller than the working set: what the policy
			// keeps decides the hits.
			runs = append(runs, scenario{name: s, kind: s, cpuBytes: size(max(0.4*float64(D), 2.5*float64(E)))})
			continue
		case s != "cpu" && !hasDisk:
			skip(s+" scenario", "daemon has no disk tier (its --help lists no --disk-dir/--disk-bytes)")
			continue
		case s != "cpu" && b.diskDir == "":
			skip(s+" scenario", b.diskWhy)
			continue
		case s == "restart" && diskFree(b.diskDir) < o.restartBytes+o.restartBytes/8:
			skip(s+" scenario", fmt.Sprintf("%s has %s free, the restart scenario needs %s; pass --disk-dir or a smaller --restart-bytes",
				b.diskDir, model.FormatBytes(diskFree(b.diskDir)), model.FormatBytes(o.restartBytes)))
			continue
		case s != "cpu" && s != "restart" && diskFree(b.diskDir) < diskBytes+diskBytes/8:
			skip(s+" scenario", fmt.Sprintf("%s has %s free, the disk tier needs %s; pass --disk-dir or fewer --steps",
				b.diskDir, model.FormatBytes(diskFree(b.diskDir)), model.FormatBytes(diskBytes)))
			continue
		}
		switch s {
		case "cpu":
			cpu := size(1.25*float64(D) + 2*float64(E))
			if avail := memAvailable(); avail > 0 && cpu > avail/2 {
				cpu = avail / 2 / (64 << 20) * (64 << 20)
				skip("cpu scenario: whole working set in CPU", fmt.Sprintf("the working set (%s) does not fit in half the available memory; CPU tier capped at %s",
					model.FormatBytes(D), model.FormatBytes(cpu)))
			}
			runs = append(runs, scenario{name: "cpu", kind: s, cpuBytes: cpu})
		case "disk", "corrupt":
			runs = append(runs, scenario{name: s, kind: s, cpuBytes: smallCPU, diskBytes: diskBytes})
		case "mixed":
			runs = append(runs, scenario{name: s, kind: s, cpuBytes: size(max(0.55*float64(D), 2*float64(E))), diskBytes: diskBytes})
		case "restart":
			runs = append(runs, scenario{name: s, kind: s, diskBytes: o.restartBytes})

		case "faults":
			if !b.flags["fault-spec"] {
				skip("faults scenario", "daemon has no --fault-spec flag")
				continue
			}
			if o.faultSpec != "" {
				runs = append(runs, scenario{name: "faults", kind: s, cpuBytes: smallCPU, diskBytes: diskBytes, spec: o.faultSpec, rate: readRate(o.faultSpec)})
				continue
			}
			for _, r := range o.faultRates {
				third := strconv.FormatFloat(r/3, 'g', 4, 64)
				spec := fmt.Sprintf("read-eio=%s,short-read=%s,bitflip=%s,seed=%d", third, third, third, o.seed)
				runs = append(runs, scenario{name: fmt.Sprintf("faults@%g", r), kind: s, cpuBytes: smallCPU, diskBytes: diskBytes, spec: spec, rate: r})
			}
		}
	}
	return runs, skips
}

// readRate is a spec's chance that a disk read gets a fault: the read
// kinds are drawn independently and any one spoils the read.
func readRate(spec string) float64 {
	p, _ := errorfs.ParsePlan(spec) // validated with the flags
	return 1 - (1-p.ReadEIO)*(1-p.ShortRead)*(1-p.BitFlip)
}

// outcome is what one scenario run gave.
type outcome struct {
	res         *engine.Result
	faults      report.Faults
	desc        string // the daemon's setup
	diskRead    uint64 // disk-tier bytes read and written, from the daemon's metrics
	diskWritten uint64
	// capacity is the blocks both tiers' slots hold (0: unknown).
	capacity int
	// noSpaceClean: stores refused NO_SPACE while clean copies existed
	// (nil: the daemon does not say).
	noSpaceClean *int
	tier         *report.TierRead
}

// arenaWait bounds waitArena: the arenas kvbench asks for (7 GiB at most)
// are backed in seconds on any host that has the memory.
const arenaWait = 5 * time.Minute

// waitArena waits until the daemon's CPU arena is backed by memory
// (kvoffload_cpu_arena_backed_bytes equal to the tier's capacity). The
// daemon serves at once and backs the arena in the background; a step run
// before that is done faults the arena's pages in itself and shares the
// CPUs with populate, which measures the daemon's first seconds (0.5-5 GB/s
// of 4K or 2 MiB page faults here), not its copies.
// A gauge that stops moving for arenaStall means the daemon stopped backing
// the arena (a kernel without MADV_POPULATE_WRITE, or a host without the
// memory: its log says which).
func waitArena(ctx context.Context, d *daemon.Daemon, limit time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	const arenaStall = 10 * time.Second
	last, moved := -1.0, time.Now()
	for {
		m, err := d.Metrics(ctx)
		if err == nil {
			if _, reports := m["kvoffload_cpu_arena_backed_bytes"]; !reports {
				return nil // a daemon from before the gauge
			}
			backed, capacity := daemon.Sum(m, "kvoffload_cpu_arena_backed_bytes"), daemon.Sum(m, "kvoffload_tier_capacity_bytes", `tier="cpu"`)
			if capacity > 0 && backed >= capacity {
				return nil
			}
			if backed != last {
				last, moved = backed, time.Now()
			} else if time.Since(moved) > arenaStall {
				return fmt.Errorf("the daemon stopped backing its arena at %.0f of %.0f bytes (see its log)", backed, capacity)
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the daemon's arena was not backed by memory after %v", limit)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// scenario starts a daemon set up for sc (or uses --socket's), drives it
// through every step, reads its metrics and stops it.
func (b *bench) scenario(ctx context.Context, sc scenario) (outcome, error) {
	o := b.o
	f := report.Faults{Spec: sc.spec, InjectedByKind: map[string]int{}}
	desc := fmt.Sprintf("cpu tier %s", model.FormatBytes(sc.cpuBytes))
	if sc.diskBytes > 0 {
		desc += fmt.Sprintf(", disk tier %s", model.FormatBytes(sc.diskBytes))
	}
	if sc.spec != "" {
		desc += ", --fault-spec " + sc.spec
	}
	if sc.kind == "corrupt" {
		desc += ", slot bytes flipped from outside after every step"
	}
	if len(o.daemonArgs) > 0 {
		desc += ", " + strings.Join(o.daemonArgs, " ")
	}
	if o.socket != "" {
		desc = "external daemon"
	}
	b.prog.phase(fmt.Sprintf("scenario %s: %s", sc.name, desc))

	var c *client.Client
	var d *daemon.Daemon
	var diskDir string
	var err error
	stop := func() error { return nil }
	if o.socket != "" {
		if c, err = client.Dial(o.socket); err != nil {
			return outcome{}, err
		}
		defer c.Close()
	} else {
		dir, err := os.MkdirTemp(b.tmp, sc.name+"-")
		if err != nil {
			return outcome{}, err
		}
		opts := daemon.Options{Binary: b.binary, Dir: dir, CPUBytes: sc.cpuBytes, IOWorkers: o.ioWorkers, FaultSpec: sc.spec}
		if sc.diskBytes > 0 {
			diskDir = filepath.Join(b.diskDir, sc.name)
			if err := os.Mkdir(diskDir, 0o700); err != nil {
				return outcome{}, err
			}
			defer os.RemoveAll(diskDir)
			opts.DiskDir, opts.DiskBytes = diskDir, sc.diskBytes
			if b.flags["disk-reset"] {
				opts.Extra = append(opts.Extra, "--disk-reset")
			}
			if b.flags["disk-queue-depth"] {
				opts.Extra = append(opts.Extra, "--disk-queue-depth", strconv.Itoa(o.queueDepth))
			}
			if b.flags["disk-chunk-bytes"] {
				opts.Extra = append(opts.Extra, "--disk-chunk-bytes", strconv.FormatUint(slots.DefaultChunkBytes(sc.diskBytes), 10))
			}
		}
		if d, err = b.startDaemon(ctx, opts); err != nil {
			return outcome{}, err
		}
		stop = d.Stop
		defer d.Stop()
		b.meter.Track(d.Pid())
		defer b.meter.Untrack(d.Pid())
		if c, err = client.Dial(d.Socket); err != nil {
			return outcome{}, errors.Join(err, d.Stop())
		}
		defer c.Close()
		end := b.meter.Start(sc.name + ": arena backed")
		err = waitArena(ctx, d, arenaWait)
		b.meter.End(end)
		if err != nil {
			b.prog.phase(fmt.Sprintf("scenario %s: %v; its figures include the arena's first-touch faults", sc.name, err))
		}
	}
	// The scheduler's connection: Lookups during transfers.
	socket := o.socket
	if d != nil {
		socket = d.Socket
	}
	prober, err := client.Dial(socket)
	if err != nil {
		return outcome{}, errors.Join(err, stop())
	}
	defer prober.Close()

	cfg := engine.Config{
		Client:      c,
		Region:      b.region,
		Fingerprint: fmt.Appendf(nil, "kvbench/%s/%s/seed=%d/pid=%d/%d", b.o.shape.Name, sc.name, o.seed, os.Getpid(), time.Now().UnixNano()),
		Steps:       b.steps,
		LeaseMs:     uint32(o.leaseMs),
		Progress:    func(int, int) { b.prog.advance(1) },
		DiskLoads:   sc.diskBytes > 0,
		Wait:        o.wait,
		Prober:      prober,
		Phase: func(name string) func() {
			mk := b.meter.Start(sc.name + ": " + name)
			return func() { b.meter.End(mk) }
		},
	}
	if sc.kind == "cpu" {
		cfg.Copier, cfg.OwnCopier = b.copier, b.ownCopier
	}
	var raw *diskRaw
	if (sc.kind == "disk" || sc.kind == "mixed") && diskDir != "" {
		raw = newDiskRaw(diskDir, int64(slots.DefaultChunkBytes(sc.diskBytes)), o.shape.BlockBytes(), o.queueDepth, o.seed, b.meter, sc.name)
		defer raw.Close()
		cfg.StepDisk, cfg.DiskBaseline = raw.step, raw.around
	}
	idle := 10000
	if o.quick {
		idle = quickSizes.idleCalls
	}
	if !b.grpcTimed {
		cfg.IdleLookups = idle
	}
	var flipper *corrupt.Flipper
	if sc.kind == "corrupt" {
		flipper, err = corrupt.New(diskDir, int64(slots.DefaultChunkBytes(sc.diskBytes)), int64(o.shape.BlockBytes()), o.seed)
		if err != nil {
			return outcome{}, errors.Join(err, stop())
		}
		defer flipper.Close()
		cfg.BetweenSteps = func(int) error {
			_, err := flipper.Flip(2)
			return err
		}
	}
	res, runErr := engine.Run(ctx, cfg)

	var metrics map[string]float64
	if d != nil {
		mctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		metrics, err = d.Metrics(mctx)
		cancel()
		runErr = errors.Join(runErr, err)
	}
	if o.keepDir != "" && d != nil {
		runErr = errors.Join(runErr, keep(o.keepDir, sc.name, d, metrics))
	}
	if !b.grpcTimed && runErr == nil {
		b.grpcTimed = true
		var lat []time.Duration
		mk := b.meter.Start(sc.name + ": empty gRPC baseline")
		lat, err = baseline.GRPCEmpty(ctx, c, idle)
		b.meter.End(mk)
		if err != nil {
			runErr = errors.Join(runErr, fmt.Errorf("empty gRPC baseline: %w", err))
		} else {
			b.rep.Baselines.GRPCEmptyP50us = report.F(us(engine.Percentile(lat, 50)))
			b.rep.Baselines.GRPCEmptyP99us = report.F(us(engine.Percentile(lat, 99)))
		}
	}
	c.Close()
	prober.Close()
	if err := stop(); err != nil {
		runErr = errors.Join(runErr, err)
	}
	if res == nil {
		return outcome{}, runErr
	}
	if res.FirstCorrupt != "" {
		runErr = errors.Join(runErr, fmt.Errorf("wrong bytes delivered by a load: %s", res.FirstCorrupt))
	}
	if res.FirstReoffer != "" {
		runErr = errors.Join(runErr, fmt.Errorf("a failed block was offered again: %s", res.FirstReoffer))
	}
	// The daemon counts injected faults by kind; a kind never injected has
	// no series (nor, with none injected, has the metric).
	for k, v := range metrics {
		if name, labels, _ := strings.Cut(k, "{"); name == "kvoffload_faults_injected_total" {
			kind := labelValue(labels, "kind")
			f.InjectedByKind[kind] += int(v)
			f.Injected += int(v)
			if kind == "read-eio" || kind == "short-read" || kind == "bitflip" {
				f.InjectedRead += int(v)
			}
		}
	}
	f.BlocksFailedReported = res.BlocksFailedLoaded
	f.ReadFailuresReported = res.ReadFailures
	f.CorruptBlocksDelivered = res.CorruptDelivered
	f.FailedBlocksReoffered = res.FailedReoffered
	f.FailedButDelivered = res.FailedButDelivered
	if flipper != nil {
		f.ExternalFlips = flipper.Flipped
		f.ExternalCorruptReported = res.LoadFailed["CORRUPT"] + res.DiskLoadFailed["CORRUPT"]
	}
	f.DaemonReadErrors = int(daemon.Sum(metrics, "kvoffload_disk_errors_total"))
	if sc.spec != "" && f.ReadFailuresReported < f.InjectedRead {
		runErr = errors.Join(runErr, fmt.Errorf("%d read faults injected (%v), only %d reported to kvbench as failed blocks (IO_ERROR or CORRUPT; the daemon counted %d failed disk reads); failures seen: steps %v, disk loads %v",
			f.InjectedRead, f.InjectedByKind, f.ReadFailuresReported, f.DaemonReadErrors, res.LoadFailed, res.DiskLoadFailed))
	}
	out := outcome{res: res, faults: f, desc: desc,
		diskRead:    uint64(daemon.Sum(metrics, "kvoffload_disk_bytes_total", `op="read"`)),
		diskWritten: uint64(daemon.Sum(metrics, "kvoffload_disk_bytes_total", `op="write"`))}
	if raw != nil {
		out.tier = raw.Tier
	}
	for k, v := range metrics {
		if strings.HasPrefix(k, "kvoffload_store_no_space_total{") && strings.Contains(k, `clean_copies="pinned_or_other_size"`) {
			n := int(v)
			out.noSpaceClean = &n
		}
	}
	if _, counts := metrics["kvoffload_cpu_clean_blocks"]; out.noSpaceClean == nil && counts {
		zero := 0
		out.noSpaceClean = &zero // the daemon counts them; none happened
	}
	if metrics != nil {
		// Both tiers' slots, from the capacities the daemon reports.
		B := uint64(o.shape.BlockBytes())
		cpuN, err1 := cachesim.Capacity(uint64(daemon.Sum(metrics, "kvoffload_tier_capacity_bytes", `tier="cpu"`)), slots.DefaultChunkBytes(sc.cpuBytes), layout.AlignUp(B))
		out.capacity = cpuN
		if sc.diskBytes > 0 {
			diskN, err2 := cachesim.Capacity(uint64(daemon.Sum(metrics, "kvoffload_tier_capacity_bytes", `tier="disk"`)), slots.DefaultChunkBytes(sc.diskBytes), disk.SlotBytes(B))
			out.capacity += diskN
			err1 = errors.Join(err1, err2)
		}
		if err1 != nil {
			out.capacity = 0
		}
	}
	return out, runErr
}

// keep saves a scenario's daemon command line, log and metrics.
func keep(dir, name string, d *daemon.Daemon, metrics map[string]float64) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "# kvoffloadd %s\n", strings.Join(d.Args, " "))
	names := make([]string, 0, len(metrics))
	for k := range metrics {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		fmt.Fprintf(&sb, "%s %g\n", k, metrics[k])
	}
	log, _ := os.ReadFile(d.LogPath)
	return errors.Join(os.WriteFile(filepath.Join(dir, name+".metrics"), []byte(sb.String()), 0o644),
		os.WriteFile(filepath.Join(dir, name+".log"), log, 0o644))
}

func labelValue(labels, name string) string {
	_, v, ok := strings.Cut(labels, name+`="`)
	if !ok {
		return "?"
	}
	v, _, _ = strings.Cut(v, `"`)
	return v
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// addResults turns a run into report rows.
func (b *bench) addResults(sc scenario, out outcome) {
	r := out.res
	hit := map[string]float64{}
	if r.LookedUp > 0 {
		hit["cpu"] = float64(r.HitCPU) / float64(r.LookedUp)
		hit["disk"] = float64(r.HitDisk) / float64(r.LookedUp)
		hit["all"] = float64(r.HitCPU+r.HitDisk) / float64(r.LookedUp)
	}
	for k := range workload.NumKinds {
		if r.KindLookedUp[k] > 0 {
			hit[k.String()] = float64(r.KindHit[k]) / float64(r.KindLookedUp[k])
		}
	}
	row := func(op, phase string, x *engine.Op, failed map[string]int) report.Result {
		share, flagged := b.phaseShare(sc.name + ": " + phase)
		return report.Result{Scenario: sc.name, Op: op, GBps: x.GBps(), Blocks: x.Blocks, Bytes: x.Bytes, Calls: x.Calls, CompletionsCalls: x.Completions,
			P50us: us(engine.Percentile(x.Latencies, 50)), P99us: us(engine.Percentile(x.Latencies, 99)),
			Failed: failed, CorruptBlocksDelivered: r.CorruptDelivered, FailedBlocksReoffered: r.FailedReoffered, Daemon: out.desc,
			Interference: share, Flagged: flagged}
	}
	lk := row("lookup", "steps", &r.Lookup, nil)
	lk.HitRate, lk.Blocks = hit, r.LookedUp
	if out.capacity > 0 {
		lk.CapacityBlocks = out.capacity
		lk.HitRateLRU = report.F(cachesim.LRU(b.trace, out.capacity).Rate())
		lk.HitRateBelady = report.F(cachesim.Belady(b.trace, out.capacity).Rate())
	}
	b.rep.Results = append(b.rep.Results, lk)
	if r.IdleLookup.Calls > 0 {
		b.rep.Results = append(b.rep.Results, row("lookup-idle", "idle lookups", &r.IdleLookup, nil))
	}
	if r.BusyLookup.Calls > 0 {
		b.rep.Results = append(b.rep.Results, row("lookup-busy", "steps", &r.BusyLookup, nil), row("empty-busy", "steps", &r.BusyEmpty, nil))
	}
	load, store := row("load", "steps", &r.Load, r.LoadFailed), row("store", "steps", &r.Store, r.StoreFailed)
	load.DiskBytes, store.DiskBytes = out.diskRead, out.diskWritten
	store.NoSpaceWithCleanCopies = out.noSpaceClean
	b.rep.Results = append(b.rep.Results, load, store)
	if r.LoadCopy.Calls > 0 {
		b.rep.Results = append(b.rep.Results, row("load-copy", "steps", &r.LoadCopy, nil), row("store-copy", "steps", &r.StoreCopy, nil))
	}
	if r.LoadCopyOwn.Calls > 0 {
		b.rep.Results = append(b.rep.Results, row("load-copy-own", "steps", &r.LoadCopyOwn, nil), row("store-copy-own", "steps", &r.StoreCopyOwn, nil))
	}
	if r.DiskLoad.Calls > 0 || sc.diskBytes > 0 {
		b.rep.Results = append(b.rep.Results, row("load-disk", "disk loads", &r.DiskLoad, r.DiskLoadFailed))
	}
	if len(r.StepsDisk) > 0 {
		// Raw O_DIRECT of each step's disk reads, as an op of its own:
		// one "call" per step.
		var raw engine.Op
		for _, sd := range r.StepsDisk {
			raw.Calls++
			raw.Blocks += sd.Blocks
			raw.Bytes += uint64(sd.Blocks) * uint64(b.o.shape.BlockBytes())
			raw.Busy += sd.Raw
			raw.Latencies = append(raw.Latencies, sd.Raw)
		}
		b.rep.Results = append(b.rep.Results, row("raw-step-read", "steps", &raw, nil))
	}
	bl := &b.rep.Baselines
	if sc.kind == "cpu" {
		if r.LoadCopy.Blocks > 0 {
			bl.SegmentCopyLoadGBps = report.F(r.LoadCopy.GBps())
		}
		if r.StoreCopy.Blocks > 0 {
			bl.SegmentCopyStoreGBps = report.F(r.StoreCopy.GBps())
		}
		if r.LoadCopyOwn.Blocks > 0 {
			bl.SegmentCopyOwnLoadGBps = report.F(r.LoadCopyOwn.GBps())
		}
		if r.StoreCopyOwn.Blocks > 0 {
			bl.SegmentCopyOwnStoreGBps = report.F(r.StoreCopyOwn.GBps())
		}
		if r.BusyEmpty.Calls > 0 {
			bl.GRPCEmptyBusyP50us = report.F(us(engine.Percentile(r.BusyEmpty.Latencies, 50)))
			bl.GRPCEmptyBusyP99us = report.F(us(engine.Percentile(r.BusyEmpty.Latencies, 99)))
		}
	}
	if sc.kind == "disk" && out.tier != nil {
		bl.TierRead = out.tier
	}
}

// startDaemon starts a daemon of opts with every --daemon-arg after the
// scenario's own flags (the user's word is the last).
func (b *bench) startDaemon(ctx context.Context, opts daemon.Options) (*daemon.Daemon, error) {
	opts.Extra = append(slices.Clip(opts.Extra), b.o.daemonArgs...)
	return daemon.Start(ctx, opts)
}

// phaseShare is the largest share of the machine other processes took in
// the phases named name (or starting with it), and whether any was flagged.
func (b *bench) phaseShare(name string) (float64, bool) {
	share, flagged := 0.0, false
	for _, p := range b.meter.Phases() {
		if strings.HasPrefix(p.Name, name) {
			share = max(share, p.OtherCPUShare, p.StealShare)
			flagged = flagged || p.Flagged
		}
	}
	return share, flagged
}

// measure runs f as a phase of the run.
func (b *bench) measure(name string, f func() error) error {
	mk := b.meter.Start(name)
	err := f()
	b.meter.End(mk)
	return err
}

// quickSizes are what --quick's idle Lookups, empty calls and separate
// baselines move. The test under the race detector, where kvbench's own
// copies and checks run several times slower, makes them smaller
// (kvbench_test.go): the same code runs, on less.
var quickSizes = struct {
	idleCalls   int   // idle Lookups, and as many empty gRPC calls
	memcpyMax   int64 // the memcpy baseline's largest buffer (it copies 4 times its buffer)
	odirectFile int64 // the O_DIRECT baseline's file
}{2000, 256 << 20, 256 << 20}

// baselines measures the limits on the same block size.
func (b *bench) baselines(ctx context.Context) error {
	o, bl := b.o, &b.rep.Baselines
	B := o.shape.BlockBytes()
	bl.Workers, bl.QueueDepth, bl.IOBytes, bl.ODirectIOBytes, bl.SegmentBytes = o.ioWorkers, o.queueDepth, B, int(slotBytes(B)), o.shape.SegmentBytes()
	var errs []error

	b.prog.phase(fmt.Sprintf("baseline: Go copy() of %s blocks, %d workers", model.FormatBytes(uint64(B)), o.ioWorkers))
	buf, total := int64(512<<20), int64(4<<30)
	if o.quick {
		// Larger than the caches, and in proportion to the run: a
		// quick run of small blocks copies less.
		buf = min(quickSizes.memcpyMax, max(32<<20, 4*int64(b.region.Blocks)*int64(B)))
		total = 4 * buf
	}
	errs = append(errs, b.measure("baseline: memcpy", func() error {
		if v, err := baseline.Memcpy(B, B, o.ioWorkers, buf, total); err != nil {
			return fmt.Errorf("memcpy baseline: %w", err)
		} else {
			bl.MemcpyGBps = report.F(v)
		}
		if v, err := baseline.Memcpy(B, o.shape.SegmentBytes(), o.ioWorkers, buf, total); err != nil {
			return fmt.Errorf("memcpy baseline: %w", err)
		} else {
			bl.MemcpySegmentGBps = report.F(v)
		}
		return nil
	}))
	b.prog.advance(1)

	if b.diskDir == "" {
		b.rep.Skipped = append(b.rep.Skipped, report.Skip{What: "O_DIRECT baseline", Reason: b.diskWhy})
	} else {
		b.prog.phase(fmt.Sprintf("baseline: O_DIRECT write and read, %d KiB I/Os, queue depth %d, in %s", slotBytes(B)>>10, o.queueDepth, b.diskDir))
		file := int64(1 << 30)
		if o.quick {
			file = quickSizes.odirectFile
		}
		errs = append(errs, b.measure("baseline: O_DIRECT", func() error {
			r, err := baseline.MeasureODirect(b.diskDir, int(slotBytes(B)), o.queueDepth, file, o.seed)
			if err != nil {
				return fmt.Errorf("O_DIRECT baseline: %w", err)
			}
			bl.ODirectReadGBps, bl.ODirectWriteGBps, bl.DiskDir = report.F(r.ReadGBps), report.F(r.WriteGBps), filepath.Dir(b.diskDir)
			return nil
		}))
	}
	b.prog.advance(1)

	if !b.grpcTimed {
		b.rep.Skipped = append(b.rep.Skipped, report.Skip{What: "empty gRPC baseline", Reason: "no scenario ran to completion"})
	}

	redis := ""
	if o.redis != "none" {
		p, err := exec.LookPath(o.redis)
		if err != nil {
			b.rep.Skipped = append(b.rep.Skipped, report.Skip{What: "Redis baseline", Reason: fmt.Sprintf("no %s binary (%v); install redis-server", o.redis, err)})
		}
		redis = p
	} else {
		b.rep.Skipped = append(b.rep.Skipped, report.Skip{What: "Redis baseline", Reason: "--redis-server none"})
	}
	if redis != "" {
		b.prog.phase(fmt.Sprintf("baseline: Redis SET/GET of %d %s blocks on 127.0.0.1, %d connections", b.region.Blocks, model.FormatBytes(uint64(B)), o.ioWorkers))
		if err := b.measure("baseline: redis", func() error { return b.redis(ctx, redis) }); err != nil {
			errs = append(errs, fmt.Errorf("redis baseline: %w", err))
		}
	}
	b.prog.advance(2)
	return errors.Join(errs...)
}

// slotBytes is what the disk tier reads and writes for one block: a 4 KiB
// header and the payload padded to 4 KiB.
func slotBytes(payload int) int64 { return 4096 + (int64(payload)+4095)/4096*4096 }

// redis stores the first engine blocks' worth of the workload's keys,
// each value the block's bytes, packed as a connector would send them.
func (b *bench) redis(ctx context.Context, binary string) error {
	shape := b.o.shape
	var keys, values [][]byte
	seen := map[string]bool{}
	for _, st := range b.steps {
		for _, r := range st {
			for _, k := range r.Keys {
				if len(keys) < b.region.Blocks && !seen[string(k)] {
					seen[string(k)] = true
					v := make([]byte, shape.BlockBytes())
					for s := range shape.Segments() {
						model.FillSegment(v[s*shape.SegmentBytes():(s+1)*shape.SegmentBytes()], k, s)
					}
					keys, values = append(keys, k), append(values, v)
				}
			}
		}
	}
	dir, err := os.MkdirTemp(b.tmp, "redis-")
	if err != nil {
		return err
	}
	port, err := daemon.FreePort()
	if err != nil {
		return err
	}
	r, err := baseline.MeasureRedis(ctx, binary, dir, port, keys, values, b.o.ioWorkers, b.meter.Track)
	if err != nil {
		return err
	}
	b.rep.Baselines.RedisGetGBps, b.rep.Baselines.RedisSetGBps, b.rep.Baselines.RedisVersion = report.F(r.GetGBps), report.F(r.SetGBps), r.Version
	return nil
}

// summarize computes ratios, goals and the fault summary.
func (b *bench) summarize(faults []report.Faults, sweep []report.SweepPoint) {
	rep := &b.rep
	gb := func(sc, op string) *float64 {
		if r := rep.Find(sc, op); r != nil && r.Blocks > 0 {
			return report.F(r.GBps)
		}
		return nil
	}
	cpu := "cpu"
	if b.o.socket != "" {
		cpu = "external"
	}
	var lookupP99 *float64
	if r := rep.Find(cpu, "lookup"); r != nil {
		lookupP99 = report.F(r.P99us)
	}
	bl := rep.Baselines
	rep.Ratios = report.Ratios{
		CPULoadVsMemcpy:         report.Ratio(gb(cpu, "load"), bl.MemcpyGBps),
		CPUStoreVsMemcpy:        report.Ratio(gb(cpu, "store"), bl.MemcpyGBps),
		DiskLoadVsODirectRead:   report.Ratio(gb("disk", "load-disk"), bl.ODirectReadGBps),
		DiskStoreVsODirectWrite: report.Ratio(gb("disk", "store"), bl.ODirectWriteGBps),
		CPULoadVsRedisGet:       report.Ratio(gb(cpu, "load"), bl.RedisGetGBps),
		RemoteLoadVsClusterGet:  report.Ratio(gb("remote", "load-remote"), bl.RedisClusterGetGBps),
		LookupP99VsGRPCEmptyP99: report.Ratio(lookupP99, bl.GRPCEmptyP99us),

		CPULoadVsSegmentCopy:        report.Ratio(gb(cpu, "load"), bl.SegmentCopyLoadGBps),
		CPUStoreVsSegmentCopy:       report.Ratio(gb(cpu, "store"), bl.SegmentCopyStoreGBps),
		CPULoadVsOwnSegmentCopy:     report.Ratio(gb(cpu, "load"), bl.SegmentCopyOwnLoadGBps),
		CPUStoreVsOwnSegmentCopy:    report.Ratio(gb(cpu, "store"), bl.SegmentCopyOwnStoreGBps),
		SegmentCopyVsOwnLoad:        report.Ratio(bl.SegmentCopyLoadGBps, bl.SegmentCopyOwnLoadGBps),
		SegmentCopyVsOwnStore:       report.Ratio(bl.SegmentCopyStoreGBps, bl.SegmentCopyOwnStoreGBps),
		DiskLoadP99VsRawStepP99:     report.Ratio(p99(rep, "disk", "load"), p99(rep, "disk", "raw-step-read")),
		LookupBusyP99VsGRPCEmptyP99: report.Ratio(p99(rep, cpu, "lookup-busy"), bl.GRPCEmptyP99us),
		LookupBusyP99VsEmptyBusyP99: report.Ratio(p99(rep, cpu, "lookup-busy"), p99(rep, cpu, "empty-busy")),
		LookupIdleP99VsGRPCEmptyP99: report.Ratio(p99(rep, cpu, "lookup-idle"), bl.GRPCEmptyP99us),
	}
	if t := bl.TierRead; t != nil && t.Min() > 0 {
		if v := gb("disk", "load-disk"); v != nil {
			rep.Ratios.DiskLoadVsTierRead = report.F(*v / ((t.BeforeGBps + t.AfterGBps) / 2))
			rep.Ratios.DiskLoadVsTierReadRange = []float64{*v / t.Max(), *v / t.Min()}
		}
	}
	if len(faults) > 0 {
		agg := report.Faults{InjectedByKind: map[string]int{}}
		var specs []string
		for _, f := range faults {
			// The corruption scenario adds only its own counts: its
			// CORRUPT blocks were not injected by a plan.
			agg.ExternalFlips += f.ExternalFlips
			agg.ExternalCorruptReported += f.ExternalCorruptReported
			agg.CorruptBlocksDelivered += f.CorruptBlocksDelivered
			agg.FailedBlocksReoffered += f.FailedBlocksReoffered
			agg.FailedButDelivered += f.FailedButDelivered
			if f.Spec == "" {
				continue
			}
			specs = append(specs, f.Spec)
			agg.Injected += f.Injected
			agg.InjectedRead += f.InjectedRead
			for k, v := range f.InjectedByKind {
				agg.InjectedByKind[k] += v
			}
			agg.BlocksFailedReported += f.BlocksFailedReported
			agg.ReadFailuresReported += f.ReadFailuresReported
			agg.DaemonReadErrors += f.DaemonReadErrors
		}
		agg.Spec = strings.Join(specs, "; ")
		rep.Faults = &agg
	}
	rep.Sweep = sweep

	// A goal is flagged when a phase it was measured in was: phases
	// named by the scenarios it reads (and the baselines).
	goal := func(name, target string, v *float64, ok func(float64) bool, phases ...string) *report.Goal {
		g := report.Goal{Name: name, Target: target, Value: v}
		if v != nil {
			m := ok(*v)
			g.Met = &m
		}
		for _, p := range phases {
			_, f := b.phaseShare(p)
			g.Flagged = g.Flagged || (f && v != nil)
		}
		rep.Goals = append(rep.Goals, g)
		return &rep.Goals[len(rep.Goals)-1]
	}
	q := rep.Ratios
	goal("cpu_load_vs_memcpy", ">= 0.8", q.CPULoadVsMemcpy, func(v float64) bool { return v >= 0.8 }, cpu+": steps", "baseline: memcpy")
	goal("disk_load_vs_odirect_read", ">= 0.85", q.DiskLoadVsODirectRead, func(v float64) bool { return v >= 0.85 }, "disk: disk loads", "baseline: O_DIRECT")
	goal("cpu_load_vs_redis_get", ">= 4", q.CPULoadVsRedisGet, func(v float64) bool { return v >= 4 }, cpu+": steps", "baseline: redis")
	goal("lookup_p99_vs_grpc_empty_p99", "<= 2", q.LookupP99VsGRPCEmptyP99, func(v float64) bool { return v <= 2 }, cpu+": steps", cpu+": empty gRPC baseline")
	goal("remote_load_vs_cluster_get", ">= 0.8", q.RemoteLoadVsClusterGet, func(v float64) bool { return v >= 0.8 })
	if rc := rep.Recovery; rc != nil {
		goal("restart_start_to_serving_ms", "<= 1000", report.F(rc.StartToServingMs), func(v float64) bool { return v <= 1000 })
		goal("restart_disk_open_to_serving_ms", "<= 1000", report.F(rc.DiskOpenToServingMs), func(v float64) bool { return v <= 1000 })
		goal("restart_recovery_vs_raw_seq_read", ">= 0.8", report.F(rc.RecoveryVsRawSeqRead), func(v float64) bool { return v >= 0.8 })
	}

	// Issue 34's goals, per N of the scale scenario.
	// A phase that failed leaves its goals unmet, with its error, not
	// read off figures it never filled in.
	scaleGoal := func(name, target string, failed string, v float64, ok func(float64) bool) {
		if failed == "" {
			goal(name, target, report.F(v), ok)
			return
		}
		g := goal(name, target, nil, ok)
		g.Met, g.Note = new(bool), "the phase failed: "+failed
	}
	for _, sc := range rep.Scale {
		n := strconv.Itoa(sc.Blocks)
		scaleGoal("scale_"+n+"_lost_while_room", "== 0", sc.CPUFailed, float64(sc.CPULostWhileRoom), func(v float64) bool { return v == 0 })
		scaleGoal("scale_"+n+"_stats_max_ms", "<= 5", sc.CPUFailed, sc.StatsMaxMs, func(v float64) bool { return v <= 5 })
		scaleGoal("scale_"+n+"_heap_bytes_per_block", "<= 150", sc.CPUFailed, sc.HeapBytesPerBlock, func(v float64) bool { return v <= 150 })
		if sc.LookupsDuring > 0 || sc.SnapshotFailed != "" {
			scaleGoal("scale_"+n+"_lookup_p99_snapshot_vs_idle", "<= 3", sc.SnapshotFailed, sc.LookupSnapP99Ratio, func(v float64) bool { return v <= 3 })
		}
		if sc.DiskSkipped == "" {
			scaleGoal("scale_"+n+"_disk_dropped_or_lost", "== 0", sc.DiskFailed, float64(sc.DiskDropped+sc.DiskLost), func(v float64) bool { return v == 0 })
			scaleGoal("scale_"+n+"_disk_heap_bytes_per_block", "<= 150", sc.DiskFailed, sc.DiskHeapBytesPerBlock, func(v float64) bool { return v <= 150 })
			scaleGoal("scale_"+n+"_recovery_vs_raw_seq_read", ">= 0.5", sc.DiskFailed, sc.RecoveryVsRaw, func(v float64) bool { return v >= 0.5 })
		}
	}

	// Issue 11's goals.
	le := func(x float64) func(float64) bool { return func(v float64) bool { return v <= x } }
	ge := func(x float64) func(float64) bool { return func(v float64) bool { return v >= x } }
	for _, sc := range []string{"disk", "mixed", "tight"} {
		if r := rep.Find(sc, "store"); r != nil && sc != "tight" {
			note := fmt.Sprintf("of %d blocks stored", r.Blocks)
			if n := r.NoSpaceWithCleanCopies; n != nil {
				note += fmt.Sprintf("; %d refused while clean CPU copies existed (pinned or of another size)", *n)
			}
			goal(sc+" store NO_SPACE blocks", "== 0", report.F(float64(r.Failed["NO_SPACE"])), le(0), sc+": steps").Note = note
		}
		if r := rep.Find(sc, "lookup"); r != nil && r.HitRateLRU != nil && *r.HitRateLRU > 0 {
			goal(sc+" hit rate vs LRU", ">= 1", report.F(r.HitRate["all"] / *r.HitRateLRU), ge(1), sc+": steps").Note =
				fmt.Sprintf("%.1f%% against LRU %.1f%% and Belady %.1f%% of %d blocks", 100*r.HitRate["all"], 100**r.HitRateLRU, 100**r.HitRateBelady, r.CapacityBlocks)
		}
	}
	goal("disk_load_p99_vs_raw_step_p99", "<= 2", q.DiskLoadP99VsRawStepP99, le(2), "disk: steps")
	var worst *float64
	for _, r := range rep.Results {
		if (r.Scenario == "cpu" || r.Scenario == "disk" || r.Scenario == "mixed" || r.Scenario == "external") &&
			(r.Op == "load" || r.Op == "store" || r.Op == "load-disk") && r.Calls > 0 && (worst == nil || r.P99us/1e3 > *worst) {
			worst = report.F(r.P99us / 1e3)
		}
	}
	goal("worst load or store p99 without faults (ms)", "<= 100", worst, le(100), cpu+": ", "disk: ", "mixed: ")
	goal("cpu_load_vs_segment_copy", ">= 0.9", q.CPULoadVsSegmentCopy, ge(0.9), cpu+": steps")
	goal("cpu_store_vs_segment_copy", ">= 0.85", q.CPUStoreVsSegmentCopy, ge(0.85), cpu+": steps")
	goal("lookup_busy_p99_vs_grpc_empty_p99", "<= 2", q.LookupBusyP99VsGRPCEmptyP99, le(2), cpu+": steps", cpu+": empty gRPC baseline")
	goal("lookup_idle_p99_vs_grpc_empty_p99", "<= 1.2", q.LookupIdleP99VsGRPCEmptyP99, le(1.2), cpu+": idle lookups", cpu+": empty gRPC baseline")
	goal("disk_load_vs_tier_read", ">= 0.9", q.DiskLoadVsTierRead, ge(0.9), "disk: disk loads", "disk: tier-pattern")
	for _, want := range []float64{0.01, 0.05, 0.1} {
		var v *float64
		for _, p := range sweep {
			if p.Rate == want {
				v = report.F(float64(p.Faults.CorruptBlocksDelivered))
			}
		}
		goal(fmt.Sprintf("corrupt_blocks_delivered at %g%% read faults", 100*want), "== 0", v, func(v float64) bool { return v == 0 })
	}

	// Issue 23's goal: a full-attention + 128-token-window model moves at
	// most full layers' + window bytes per hit, looks up no windowed key
	// outside a hit's window, and hits as the all-full treatment does.
	for _, h := range rep.Hybrid {
		if h.Model != "hybrid-swa" {
			continue
		}
		w, f := h.Windowed, h.AllFull
		var bound, hits *float64
		if w.BoundBytes > 0 {
			bound = report.F(float64(w.LoadBytes) / float64(w.BoundBytes))
		}
		if f.HitTokens > 0 {
			hits = report.F(float64(w.HitTokens) / float64(f.HitTokens))
		}
		goal("hybrid-swa bytes loaded vs full layers' + window bytes per hit", "<= 1", bound, le(1)).Note =
			fmt.Sprintf("%.3f of the all-full treatment's bytes per hit token", deref(h.BytesPerHitTokenRatio))
		goal("hybrid-swa windowed keys looked up outside a hit's window", "== 0", report.F(float64(w.OutsideWindow)), le(0)).Note =
			fmt.Sprintf("of %d windowed keys looked up", w.WindowKeys)
		goal("hybrid-swa hit tokens vs all-full attention's", "== 1", hits, func(v float64) bool { return v == 1 }).Note =
			fmt.Sprintf("hit rate %.1f%% against %.1f%%, same trace and cache", 100*w.HitRate, 100*f.HitRate)
	}
}

func deref(v *float64) float64 {
	if v == nil {
		return 0
	}
	return *v
}

// p99 is the p99 of a result row, nil when it has no calls.
func p99(rep *report.Report, scenario, op string) *float64 {
	if r := rep.Find(scenario, op); r != nil && r.Calls > 0 {
		return report.F(r.P99us)
	}
	return nil
}

// verdict fails the run when the daemon broke a promise.
func (b *bench) verdict() error {
	var errs []error
	for _, r := range b.rep.Results {
		if r.Op != "lookup" {
			continue
		}
		if r.CorruptBlocksDelivered > 0 {
			errs = append(errs, fmt.Errorf("scenario %s: %d loaded blocks held wrong bytes", r.Scenario, r.CorruptBlocksDelivered))
		}
		if r.FailedBlocksReoffered > 0 {
			errs = append(errs, fmt.Errorf("scenario %s: %d blocks offered by Lookup after their load failed, before being stored again", r.Scenario, r.FailedBlocksReoffered))
		}
	}
	return errors.Join(errs...)
}

// diskFree is the bytes an unprivileged user may still write under dir.
func diskFree(dir string) uint64 {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return 0
	}
	return st.Bavail * uint64(st.Bsize)
}

// memAvailable is the kernel's estimate of memory available to start new
// work, 0 if unknown.
func memAvailable() uint64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "MemAvailable:"); ok {
			kb, _ := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}
