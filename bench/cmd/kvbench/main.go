// Command kvbench measures a kvoffloadd the way an inference engine uses
// it, next to the limits it is held to, in one run: it starts the daemon
// (or uses one at --socket), registers a /dev/shm region shaped like a
// model's KV cache, drives steps of a prefix-sharing workload through
// Lookup, Load, Store and Completions, checks every loaded block byte for
// byte, and measures memory copy, O_DIRECT, empty gRPC and Redis on the
// same blocks. See --help and docs/benchmarks.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvoffloadd/kvoffloadd/bench/baseline"
	"github.com/kvoffloadd/kvoffloadd/bench/interference"
	"github.com/kvoffloadd/kvoffloadd/bench/model"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
)

func main() {
	// kvbench starts itself as the same-segment copy baseline's helper
	// process (baseline.ProcessCopier).
	baseline.ServeIfHelper()
	serveSnapshotReader()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if _, err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "kvbench:", err)
		os.Exit(1)
	}
}

// allScenarios in the order they run; restart, scale and mirror run only
// when asked for (they fill --restart-bytes of disk, and memory and disk for
// --scale-blocks; mirror is a comparison for issue 32).
var allScenarios = []string{"cpu", "disk", "mixed", "tight", "faults", "corrupt", "remote", "hybrid", "restart", "scale", "mirror"}

// defaultScenarios run without --scenarios.
var defaultScenarios = allScenarios[:8]

// options is every flag, validated.
type options struct {
	daemon, socket string
	shape          model.Shape
	engineBlocks   int
	steps          int
	scenarios      []string
	faultSpec      string
	faultRates     []float64
	diskDir        string
	ioWorkers      int
	queueDepth     int
	seed           uint64
	quick          bool
	jsonPath       string
	plotPath       string
	redis          string
	leaseMs        uint
	restartBytes   uint64
	keepDir        string
	threshold      float64
	daemonArgs     []string
	wait           bool
	baselines      bool
	args           []string
	seedGiven      bool
	hybridModels   []string
	hybridRounds   int
	hybridProbes   int
	hybridOneStore bool
	hybridExpand   int
	hybridCPUShare float64
	scaleBlocks    []int
	scaleRanks     int
	scaleSnaps     int
	scaleDisk      bool
}

const usageHead = `kvbench drives a kvoffloadd like vLLM's connector does and measures it next
to its limits, in one run: Go copy() bandwidth, raw O_DIRECT reads and writes,
an empty gRPC round trip, and Redis SET/GET of the same blocks.

Usage: kvbench [flags]

It starts bin/kvoffloadd (next to kvbench, or --daemon) once per scenario on a
private unix socket, or uses a running daemon at --socket (cpu scenario only).
Every loaded block is checked byte for byte; a wrong block, a failed block
offered again, or a daemon that does not exit 0 on SIGTERM fails the run.

Scenarios: cpu (the CPU tier holds the working set), disk (CPU tier much
smaller: hits come from the disk tier), mixed (about half fits in CPU), tight
(a CPU tier of 40% of the working set and no disk: the policy chooses, and its
hit rate stands beside LRU's and Belady's of the same capacity), faults
(disk, with the daemon's --fault-spec at each --fault-rates read fault rate),
corrupt (disk, with bytes of the slot file flipped from outside while it runs),
remote (two daemons sharing a Redis Cluster of three masters kvbench starts from
redis-server: node A runs the steps and publishes, node B, empty, looks up A's
requests and loads their blocks from the cluster; beside it, raw GETs of the
same values from the same cluster),
hybrid (each --hybrid-models shape, a model whose KV cache groups differ in
kind, on a daemon whose CPU tier holds its working set: every request looked
up, loaded and stored under the windowed rule (full-attention groups' prefix,
then each windowed group's window at the hit's end, keys last block first)
and, on the same trace in the same run, as if every group were full
attention; bytes loaded per hit token, hit rates and keys looked up outside a
hit's window of both; at most 24 steps, 12 with --quick),
restart (only when named: fills a disk tier of --restart-bytes, restarts the
daemon on it and times the start to SERVING and the background recovery of
the files against a raw O_DIRECT sequential read of the same file),
scale (only when named: for each --scale-blocks N, N 4 KiB blocks stored by
--scale-ranks engines at once into a CPU tier with room for 2N, none may be
lost; Stats timed; the daemon's heap and RSS per block; an engine's Lookups,
idle and while a router reads a WatchEvents snapshot of every block; then over a disk tier
with room for N, stores faster than the disk, none may be dropped, a kill -9
and the recovery against a raw O_DIRECT read of the same slot file),
mirror (only when named: the steps twice per workload, cpu and tight, each on a
fresh daemon: every lookup a round trip to the daemon, then answered from an
in-process mirror of the daemon's WatchEvents stream as the Python connector
does, the daemon's Lookup still sent; the share of new requests answered in
their step, the mirror's, a plain Go map's and the daemon's lookup time per
call, the stale answers (offered by the mirror, MISSING at the load) and both
runs' hit rates).

Flags:
`

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{args: args}
	fs := flag.NewFlagSet("kvbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.daemon, "daemon", "", "kvoffloadd binary to start (default: kvoffloadd next to kvbench, else bin/kvoffloadd).")
	fs.StringVar(&o.socket, "socket", "", "use the daemon already serving on this unix socket instead of starting one; only the cpu scenario runs, as \"external\".")
	name := fs.String("model", "llama-8b", "model preset: llama-8b (2 MiB blocks) or llama-70b (5 MiB blocks); the flags below override its fields.")
	layers := fs.Int("layers", 0, "layers (K and V are separate regions, so 2 segments per layer).")
	tokens := fs.Int("block-tokens", 0, "tokens per block.")
	heads := fs.Int("kv-heads", 0, "KV heads (per GPU).")
	dim := fs.Int("head-dim", 0, "head dimension.")
	dtype := fs.Int("dtype-bytes", 0, "bytes per KV element (2 for fp16/bf16, 1 for fp8).")
	fs.IntVar(&o.engineBlocks, "engine-blocks", 0, "engine KV blocks in the /dev/shm region, the most one step moves (0: 256 MiB worth, 128 MiB with --quick).")
	fs.IntVar(&o.steps, "steps", 0, "scheduler steps per scenario (0: 48, 24 with --quick).")
	scen := fs.String("scenarios", strings.Join(defaultScenarios, ","), "scenarios to run, comma-separated: "+strings.Join(allScenarios, ", ")+".")
	scaleBlocks := fs.String("scale-blocks", "", "block counts of the scale scenario, comma-separated (default 10000,100000,1000000; 10000,100000 with --quick).")
	fs.IntVar(&o.scaleRanks, "scale-ranks", 4, "engines storing at once in the scale scenario (1..64).")
	fs.IntVar(&o.scaleSnaps, "scale-snapshots", 3, "WatchEvents snapshots the scale scenario reads during Lookups, each after a window of idle Lookups (0..20).")
	fs.BoolVar(&o.scaleDisk, "scale-disk", true, "run the scale scenario's disk-tier part (stores over a disk tier, kill -9, recovery).")
	restartBytes := fs.String("restart-bytes", "", "disk tier size of the restart scenario (default 4GiB, 1GiB with --quick); binary units as the daemon's flags (e.g. 4GiB).")
	fs.StringVar(&o.faultSpec, "fault-spec", "", "the faults scenario's plan in the daemon's syntax (e.g. read-eio=0.01,bitflip=0.001,seed=7), run once instead of the --fault-rates sweep.")
	rates := fs.String("fault-rates", "0.01,0.05,0.1", "read fault rates the faults scenario runs at, each split evenly over read-eio, short-read and bitflip.")
	fs.StringVar(&o.diskDir, "disk-dir", "", "directory for the disk tier and the O_DIRECT baseline; must take O_DIRECT (default: a temporary directory on the first of $TMPDIR, /var/tmp, . that does). A subdirectory is made and removed.")
	fs.IntVar(&o.ioWorkers, "io-workers", min(4, runtime.NumCPU()), "the daemon's --io-workers; also the memcpy threads and Redis connections of the baselines.")
	fs.IntVar(&o.queueDepth, "queue-depth", 8, "disk I/Os in flight: the O_DIRECT baseline's, and the daemon's when it has a flag for it.")
	fs.Uint64Var(&o.seed, "seed", 1, "fixes the workload, the fault plans and the corruption.")
	fs.BoolVar(&o.quick, "quick", false, "a smaller run: under a minute on 2 cores.")
	fs.StringVar(&o.jsonPath, "json", "", "write the report as JSON (schema kvbench/v1) to this file.")
	fs.StringVar(&o.plotPath, "plot", "", "draw throughput and p99 against the read fault rate to this .svg or .png file (needs the disk and faults scenarios).")
	fs.StringVar(&o.redis, "redis-server", "redis-server", "redis-server binary for the Redis baseline, looked up in PATH; \"none\" skips it.")
	fs.UintVar(&o.leaseMs, "lease-ms", 10000, "Lookup lease pinning the ready prefix until its Load (0: none).")
	fs.StringVar(&o.keepDir, "keep", "", "keep each scenario's daemon log and final metrics in this directory (created if missing).")
	fs.BoolVar(&o.baselines, "baselines", true, "measure the separate baselines after the scenarios (memcpy, O_DIRECT of a new file, Redis); the same-window ones (segment copies, tier-pattern reads, the busy empty call) run regardless. --baselines=false for A/B runs of daemon settings.")
	fs.BoolVar(&o.wait, "wait", true, "every Load and Store waits for its results in its reply, one round trip each; --wait=false reads them through Completions instead, as a connector that polls does.")
	hybridModels := fs.String("hybrid-models", "hybrid-swa,hybrid-mamba", "the hybrid scenario's model shapes, comma-separated: hybrid-swa (32 Llama-8B-sized layers, every 4th full attention, the rest a 128-token sliding window; 2 MiB per 16-token block of every group) and hybrid-mamba (1 attention layer beside 6 Mamba2 layers in vLLM's align mode; 272-token blocks, 7.4 MiB per block of every group).")
	fs.IntVar(&o.hybridRounds, "hybrid-rounds", 4, "the hybrid scenario's most lookup rounds per request: a round looks up every windowed group's window at the candidate hit, and a missing block moves the candidate before it; a request not settled after them gets no hit.")
	fs.IntVar(&o.hybridProbes, "hybrid-probes", 8, "the hybrid scenario's probes: for a model whose windows all fit in one unit (hybrid-mamba), how many candidates below the next one each round after the first also looks up, as peeks (the connector's window_probes); 0 looks up one candidate per round.")
	fs.IntVar(&o.hybridExpand, "hybrid-expand", 1, "the hybrid scenario cuts every block of the workload into this many blocks (chained keys kept): prompts this many times longer in tokens, and as many times the memory (hybrid-swa's working set is about 0.8 GiB per unit of it).")
	fs.Float64Var(&o.hybridCPUShare, "hybrid-cpu-share", 1.25, "the hybrid scenario's CPU tier: this share of the model's working set plus two engine-fulls of blocks; under 1 the daemon evicts, and the two treatments' hit rates show what each loses to it.")
	fs.BoolVar(&o.hybridOneStore, "hybrid-one-store", false, "the hybrid scenario sends each step's stores of every group in one Store (a connector's one call per step) instead of one Store per group (before 5409db1 the daemon then evicted blocks of groups that share a block size while its CPU tier had room: docs/benchmarks.md).")
	fs.Func("daemon-arg", "pass this argument to every daemon kvbench starts (repeat for more), e.g. --daemon-arg=--copy-nice=0.", func(v string) error {
		o.daemonArgs = append(o.daemonArgs, v)
		return nil
	})
	fs.Float64Var(&o.threshold, "interference-threshold", interference.DefaultThreshold, "flag a phase of the run, and every figure measured in it, when other processes used more than this share of the machine's CPU time (or the hypervisor stole it) while it ran.")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usageHead)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q (see --help)", fs.Arg(0))
	}
	fs.Visit(func(f *flag.Flag) { o.seedGiven = o.seedGiven || f.Name == "seed" })

	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	shape, ok := model.Presets[*name]
	if !ok {
		bad("--model %q: want llama-8b or llama-70b", *name)
	}
	for _, x := range []struct {
		v   int
		dst *int
	}{{*layers, &shape.Layers}, {*tokens, &shape.BlockTokens}, {*heads, &shape.KVHeads}, {*dim, &shape.HeadDim}, {*dtype, &shape.DTypeBytes}} {
		if x.v != 0 {
			*x.dst = x.v
			shape.Name = "custom"
		}
	}
	if ok {
		if err := shape.Validate(); err != nil {
			bad("%v", err)
		}
	}
	o.shape = shape
	for _, s := range strings.Split(*scen, ",") {
		s = strings.TrimSpace(s)
		if !slices.Contains(allScenarios, s) {
			bad("--scenarios: unknown scenario %q (known: %s)", s, strings.Join(allScenarios, ", "))
		} else if !slices.Contains(o.scenarios, s) {
			o.scenarios = append(o.scenarios, s)
		}
	}
	for _, s := range strings.Split(*hybridModels, ",") {
		s = strings.TrimSpace(s)
		if _, ok := model.HybridPresets[s]; !ok {
			bad("--hybrid-models: unknown model %q (known: hybrid-swa, hybrid-mamba)", s)
		} else if !slices.Contains(o.hybridModels, s) {
			o.hybridModels = append(o.hybridModels, s)
		}
	}
	for _, s := range strings.Split(*rates, ",") {
		r, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
		if err != nil || !(r > 0 && r <= 1) {
			bad("--fault-rates: %q is not a rate in (0,1]", s)
			continue
		}
		o.faultRates = append(o.faultRates, r)
	}
	if o.faultSpec != "" {
		if _, err := errorfs.ParsePlan(o.faultSpec); err != nil {
			bad("--fault-spec: %v", err)
		}
	}
	if !(o.hybridCPUShare > 0 && o.hybridCPUShare <= 4) {
		bad("--hybrid-cpu-share %g: want a share in (0,4]", o.hybridCPUShare)
	}
	if o.hybridExpand < 1 || o.hybridExpand > 64 {
		bad("--hybrid-expand %d: want 1..64", o.hybridExpand)
	}
	if o.hybridRounds < 1 || o.hybridRounds > 1024 {
		bad("--hybrid-rounds %d: want 1..1024", o.hybridRounds)
	}
	if o.hybridProbes < 0 || o.hybridProbes > 1024 {
		bad("--hybrid-probes %d: want 0..1024", o.hybridProbes)
	}
	if o.engineBlocks < 0 || o.engineBlocks > 1<<16 {
		bad("--engine-blocks %d: want 0..65536", o.engineBlocks)
	}
	if o.steps < 0 || o.steps > 100000 {
		bad("--steps %d: want 0..100000", o.steps)
	}
	if o.ioWorkers < 1 || o.ioWorkers > 256 {
		bad("--io-workers %d: want 1..256", o.ioWorkers)
	}
	if o.queueDepth < 1 || o.queueDepth > 256 {
		bad("--queue-depth %d: want 1..256", o.queueDepth)
	}
	if *scaleBlocks == "" {
		*scaleBlocks = "10000,100000,1000000"
		if o.quick {
			*scaleBlocks = "10000,100000"
		}
	}
	for _, f := range strings.Split(*scaleBlocks, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v < 1000 || v > 100_000_000 {
			bad("--scale-blocks: %q is not a count in 1000..100000000", f)
			continue
		}
		o.scaleBlocks = append(o.scaleBlocks, v)
	}
	if o.scaleSnaps < 0 || o.scaleSnaps > 20 {
		bad("--scale-snapshots %d: want 0..20", o.scaleSnaps)
	}
	if o.scaleRanks < 1 || o.scaleRanks > 64 {
		bad("--scale-ranks %d: want 1..64", o.scaleRanks)
	}
	o.restartBytes = 4 << 30
	if o.quick {
		o.restartBytes = 1 << 30
	}
	if *restartBytes != "" {
		v, err := parseSize(*restartBytes)
		if err != nil || v < 64<<20 {
			bad("--restart-bytes %q: want a size of at least 64MiB", *restartBytes)
		}
		o.restartBytes = v
	}
	if o.leaseMs > 30000 {
		bad("--lease-ms %d: the daemon allows at most 30000", o.leaseMs)
	}
	if !(o.threshold > 0 && o.threshold <= 1) {
		bad("--interference-threshold %g: want a share in (0,1]", o.threshold)
	}
	if o.plotPath != "" && !strings.HasSuffix(o.plotPath, ".svg") && !strings.HasSuffix(o.plotPath, ".png") {
		bad("--plot %q: want a .svg or .png file", o.plotPath)
	}
	if o.socket != "" && (o.daemon != "" || len(o.daemonArgs) > 0) {
		bad("--socket with --daemon or --daemon-arg: kvbench starts no daemon with --socket")
	}
	return o, errors.Join(errs...)
}

// command is the command line that reproduces the run.
func (o *options) command() string {
	parts := []string{"kvbench"}
	for _, a := range o.args {
		parts = append(parts, shellQuote(a))
	}
	if !o.seedGiven {
		parts = append(parts, "--seed", strconv.FormatUint(o.seed, 10))
	}
	return strings.Join(parts, " ")
}

func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./=,:@%+", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// parseSize reads 4096, 512MiB, 4GiB, 1TiB (binary units).
func parseSize(s string) (uint64, error) {
	t := strings.TrimSpace(s)
	mult := uint64(1)
	for _, u := range []struct {
		suffix string
		mult   uint64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSuffix(t, u.suffix), u.mult
			break
		}
	}
	n, err := strconv.ParseUint(strings.TrimSpace(t), 10, 64)
	if err != nil || n > ^uint64(0)/mult {
		return 0, fmt.Errorf("not a size: %q", s)
	}
	return n * mult, nil
}
