package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/kvoffloadd/kvoffloadd/dma/host"
	"github.com/kvoffloadd/kvoffloadd/events"
	"github.com/kvoffloadd/kvoffloadd/offload"
	"github.com/kvoffloadd/kvoffloadd/rpc/server"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/errorfs"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

// config is every flag of the daemon, validated before anything starts.
type config struct {
	socket          string
	socketMode      string
	cpuBytes        uint64
	cpuChunkBytes   uint64
	cpuPolicy       string
	cpuArenaDir     string
	ioWorkers       int
	copyNice        int
	copyIdle        bool
	shmDir          string
	metricsAddr     string
	metricsExpose   bool
	logLevel        slog.Level
	logFormat       string
	shutdownTimeout time.Duration
	resultsWait     time.Duration // --shutdown-results-wait
	showVersion     bool

	diskDirs       []string
	diskBytes      uint64
	diskChunkBytes uint64
	diskQueueDepth int
	diskDirect     string
	diskReset      bool
	writeThrough   bool
	faultSpec      string
	faultPlan      errorfs.Plan

	// Bounds on what clients may make the daemon hold (docs/operations.md, Limits).
	maxRegistrations        int
	maxRegistrationsPerUID  int
	maxRegions              int
	maxRegionsPerUID        int
	maxMappedBytes          uint64
	maxConnections          int
	maxConnectionsPerUID    int
	maxInflightRequestBytes uint64

	// The daemon's own publisher of vLLM KV events (docs/events.md).
	eventsZMQ          string
	eventsZMQExpose    bool
	eventsZMQTopic     string
	eventsZMQFormat    string
	eventsZMQHashes    string
	eventsZMQBlockSize int
	// vLLM's replay socket beside it.
	eventsZMQReplay        string
	eventsZMQReplayBatches int
	eventsZMQReplayBytes   uint64

	cuda cudaConfig // the CUDA build's flags (copier_cuda.go); empty otherwise

	namespaceLinger time.Duration
	debugChecks     bool
	debugHoldCPU    bool

	remote remoteFlags
}

// DefaultCopyNice is --copy-nice's default (docs/architecture.md, The copy
// engine, says why).
const DefaultCopyNice = 10

func defaultSocket() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "kvoffloadd", "kvoffloadd.sock")
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("kvoffloadd-%d", os.Getuid()), "kvoffloadd.sock")
}

// byteSize is a flag.Value taking 4096, 64MiB, 1GiB, 2G (binary units).
type byteSize struct{ v *uint64 }

func (b byteSize) String() string {
	if b.v == nil {
		return "0"
	}
	return formatBytes(*b.v)
}

func (b byteSize) Set(s string) error {
	n, err := parseBytes(s)
	if err != nil {
		return err
	}
	*b.v = n
	return nil
}

func parseBytes(s string) (uint64, error) {
	t := strings.TrimSpace(s)
	units := []struct {
		suffix string
		mult   uint64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10}, {"B", 1}}
	mult := uint64(1)
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSuffix(t, u.suffix), u.mult
			break
		}
	}
	n, err := strconv.ParseUint(strings.TrimSpace(t), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%q is not a size (use e.g. 4096, 512MiB, 8GiB)", s)
	}
	if n > ^uint64(0)/mult {
		return 0, fmt.Errorf("%q is too large", s)
	}
	return n * mult, nil
}

func formatBytes(n uint64) string {
	for _, u := range []struct {
		s string
		m uint64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n >= u.m && n%u.m == 0 {
			return strconv.FormatUint(n/u.m, 10) + u.s
		}
	}
	return strconv.FormatUint(n, 10)
}

const usageHead = `kvoffloadd keeps LLM KV-cache blocks for an inference engine (vLLM) in host
memory (and, with --disk-dir, on NVMe; with --remote-redis, in a Redis Cluster
shared by a fleet of nodes), so prefixes evicted from the GPU can be loaded
back instead of recomputed. The engine's connector talks to it over gRPC on a unix socket;
block bytes move between the engine's registered memory and a pinned arena,
never through the socket.

Usage: kvoffloadd [flags]

Sizes take binary units: 4096, 64MiB, 8GiB. Every flag has a default that runs
on a laptop; the daemon refuses to start, with a message, on a bad value.

Flags:
`

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	c := &config{
		socketMode:      "0600",
		cpuBytes:        1 << 30,
		cpuPolicy:       string(slots.SLRU),
		ioWorkers:       min(4, runtime.NumCPU()),
		copyNice:        DefaultCopyNice,
		shmDir:          "/dev/shm",
		metricsAddr:     "127.0.0.1:9464",
		logFormat:       "text",
		shutdownTimeout: 30 * time.Second,
		resultsWait:     2 * time.Second,
		diskBytes:       8 << 30,
		diskQueueDepth:  8,
		diskDirect:      "require",

		eventsZMQFormat:    "map",
		eventsZMQHashes:    "int",
		eventsZMQBlockSize: 16,

		eventsZMQReplayBatches: events.DefaultReplayBatches,
		eventsZMQReplayBytes:   events.DefaultReplayBytes,

		maxRegistrations:        offload.DefaultLimits.MaxRegistrations,
		maxRegistrationsPerUID:  offload.DefaultLimits.MaxRegistrationsPerUID,
		maxRegions:              offload.DefaultLimits.MaxRegions,
		maxRegionsPerUID:        offload.DefaultLimits.MaxRegionsPerUID,
		maxMappedBytes:          host.DefaultMaxMappedBytes,
		maxConnections:          server.DefaultConfig.MaxConnections,
		maxConnectionsPerUID:    server.DefaultConfig.MaxConnectionsPerUID,
		maxInflightRequestBytes: uint64(server.DefaultConfig.MaxInflightRequestBytes),
	}
	fs := flag.NewFlagSet("kvoffloadd", flag.ContinueOnError)
	fs.StringVar(&c.socket, "socket", defaultSocket(), "unix socket to serve the API on. Its directory is created with mode 0700 and must be owned by the daemon's user; a stale socket is removed only after a dial finds nobody listening. Beside it, <socket>.life is locked for the daemon's whole life, so a connector that cannot see the daemon's pid knows when it has exited.")
	fs.StringVar(&c.socketMode, "socket-mode", c.socketMode, "permission bits of the socket: 0600 (only this user) or 0660 (also this user's group).")
	fs.Var(byteSize{&c.cpuBytes}, "cpu-bytes", "size of the CPU tier: one host arena, mapped once and locked in memory where RLIMIT_MEMLOCK allows. A size that, with 64MiB for the daemon itself, does not fit under the memory limit of the daemon's cgroup (memory.max) is refused at start.")
	fs.StringVar(&c.cpuPolicy, "cpu-policy", c.cpuPolicy, "which blocks the CPU tier keeps when it is full: slru (a segmented LRU: new blocks on probation, blocks used again protected; one-off prompts churn only the probation part) or tinylfu (frequency-based admission and eviction, ristretto's algorithm). docs/benchmarks.md has both against LRU on kvbench's traces.")
	fs.Var(byteSize{&c.cpuChunkBytes}, "cpu-chunk-bytes", "arena chunk size; each chunk serves one block size and bounds the largest block (0: arena/16, clamped to 4MiB..256MiB).")
	fs.StringVar(&c.cpuArenaDir, "cpu-arena-dir", "", "keep the CPU tier's arena in a file of this directory, so its blocks survive a restart, crash or upgrade of the daemon: DIR/kvoffload-cpu.arena (the arena plus one 128-byte record per 4KiB), DIR/kvoffload-cpu.namespaces and DIR/kvoffload-cpu.lock. DIR must be on tmpfs (/dev/shm, /run) or hugetlbfs, owned by the daemon's user, mode 0700 (created so if missing); one daemon per directory. A restarted daemon serves at once and brings the blocks back in the background, each verified before it is offered. The file holds --cpu-bytes (plus 1/32 for the records) of memory after the daemon exits, until it is removed with the daemon stopped (docs/operations.md) or the host reboots; an arena of another --cpu-bytes or --cpu-chunk-bytes is discarded; one its tmpfs cannot hold while leaving 5% of it (at most 1GiB) free is refused at start. Empty (the default): a private arena that goes with the process.")
	fs.IntVar(&c.ioWorkers, "io-workers", c.ioWorkers, "copy workers moving blocks between engine memory and the arena. The daemon runs with at least io-workers+1 Go processors (GOMAXPROCS, unless set in the environment), so the copies never hold every one and the API is served while they run.")
	fs.IntVar(&c.copyNice, "copy-nice", c.copyNice, "nice value (0..19) of the copy workers' threads, host build: the kernel runs the daemon's other threads (the API, the policy) first when both want a CPU, so a Lookup does not wait behind a memmove. 0 leaves them at the daemon's priority.")
	fs.BoolVar(&c.copyIdle, "copy-sched-idle", false, "run the copy workers' threads in SCHED_IDLE instead of at --copy-nice (host build): they get a CPU only when nothing else on the machine wants it.")
	fs.StringVar(&c.shmDir, "shm-dir", c.shmDir, "the only directory clients may register region files from.")
	fs.StringVar(&c.metricsAddr, "metrics-addr", c.metricsAddr, "loopback host:port serving Prometheus metrics on /metrics; empty disables.")
	fs.BoolVar(&c.metricsExpose, "metrics-expose", false, "let --metrics-addr listen beyond loopback (e.g. :9464 in a Kubernetes pod, for Prometheus to scrape). Metrics hold counts, sizes and latencies, never keys or block bytes.")
	level := fs.String("log-level", "info", "log level: debug, info, warn or error.")
	fs.StringVar(&c.logFormat, "log-format", c.logFormat, "log format on stderr: text or json.")
	fs.DurationVar(&c.shutdownTimeout, "shutdown-timeout", c.shutdownTimeout, "on SIGTERM, SIGINT or SIGHUP, the longest the daemon takes to exit: in-flight jobs and calls may finish until then; past it connections are closed and the daemon exits even with copies still running (their jobs are never reported done, so the engine recomputes those blocks).")
	fs.DurationVar(&c.resultsWait, "shutdown-results-wait", c.resultsWait, "on a stop, once the jobs have drained and the socket is removed, how long the daemon keeps its open connections answering Completions (and only that, Unregister and Stats) for clients that have not yet read the results of the jobs it finished; it goes on as soon as every result was sent. Never past the --shutdown-timeout's drain deadline; 0: no wait (the results not yet read are lost and the engine recomputes those blocks).")
	fs.IntVar(&c.maxRegistrations, "max-registrations", c.maxRegistrations, "registrations live at once, over all clients; past it Register gets RESOURCE_EXHAUSTED.")
	fs.IntVar(&c.maxRegistrationsPerUID, "max-registrations-per-uid", c.maxRegistrationsPerUID, "registrations live at once per client uid; past it Register gets RESOURCE_EXHAUSTED.")
	fs.IntVar(&c.maxRegions, "max-regions", c.maxRegions, "regions mapped at once, over all clients (each costs at least one entry of the daemon's memory map, vm.max_map_count); past it Register gets RESOURCE_EXHAUSTED.")
	fs.IntVar(&c.maxRegionsPerUID, "max-regions-per-uid", c.maxRegionsPerUID, "regions mapped at once per client uid; past it Register gets RESOURCE_EXHAUSTED.")
	fs.Var(byteSize{&c.maxMappedBytes}, "max-mapped-bytes", "bytes of region files mapped at once (host build; a region file is mapped whole and may be sparse); past it Register gets RESOURCE_EXHAUSTED.")
	fs.IntVar(&c.maxConnections, "max-connections", c.maxConnections, "client connections open at once; a connection past it is closed at accept (the client sees UNAVAILABLE).")
	fs.IntVar(&c.maxConnectionsPerUID, "max-connections-per-uid", c.maxConnectionsPerUID, "client connections open at once per client uid; a connection past it is closed at accept.")
	fs.Var(byteSize{&c.maxInflightRequestBytes}, "max-inflight-request-bytes", "request bytes being received or handled at once over all connections (each request books the largest request size until it is decoded; one client uid may hold a quarter); a request that finds none free waits up to 30s, then gets RESOURCE_EXHAUSTED.")
	fs.Func("disk-dir", "directory of a disk-tier slot file; repeat to stripe across NVMe devices. Without it the daemon has no disk tier. One daemon per directory (it is locked). At start the daemon serves at once and brings back what the files hold in the background (Stats disk_recovery).", func(v string) error {
		c.diskDirs = append(c.diskDirs, v)
		return nil
	})
	fs.Var(byteSize{&c.diskBytes}, "disk-bytes", "size of the slot file in each --disk-dir, preallocated at start. A size the filesystem cannot hold while leaving 5% of it (at most 1GiB) free is refused before anything is allocated, with the free space in the message.")
	fs.Var(byteSize{&c.diskChunkBytes}, "disk-chunk-bytes", "disk chunk size; each chunk serves one block size (0: disk-bytes/16, clamped to 4MiB..256MiB).")
	fs.IntVar(&c.diskQueueDepth, "disk-queue-depth", c.diskQueueDepth, "I/Os in flight per slot file.")
	fs.StringVar(&c.diskDirect, "disk-direct", c.diskDirect, "O_DIRECT for the slot files: require (refuse to start where a --disk-dir's filesystem refuses it) or fallback (use the page cache there, with a warning).")
	fs.BoolVar(&c.diskReset, "disk-reset", false, "start with an empty disk tier: what the slot files hold is discarded and never comes back.")
	fs.BoolVar(&c.writeThrough, "write-through", false, "write every stored block to disk at once (default: write-back, a block goes to disk when the CPU tier evicts it).")
	fs.StringVar(&c.faultSpec, "fault-spec", "", "inject seeded disk faults, for tests and benchmarks only: comma-separated kind=rate with kinds read-eio, write-eio, short-read, torn-write, bitflip, enospc, plus latency=DURATION@rate and seed=N, e.g. read-eio=0.01,bitflip=0.001,latency=2ms@0.05,seed=7. Applies to the slot files once their background recovery has ended (see docs/faults.md).")
	fs.DurationVar(&c.namespaceLinger, "namespace-linger", offload.DefaultNamespaceLinger, "how long a namespace with no registration and no cached block is kept (a scheduler's namespace ids survive an engine restart); then it goes, with its id and, with their last namespace, its block sizes' policies.")
	fs.BoolVar(&c.debugHoldCPU, "debug-hold-cpu-recovery", false, "for tests only (with --debug-checks): the CPU arena's recovery waits before each chunk until POST /debug/cpu-recovery?chunks=N|all lets it go on (docs/model-test.md).")
	fs.BoolVar(&c.debugChecks, "debug-checks", false, "for tests only: also serve /debug/check (slot, pin and index accounting of a quiet daemon), /debug/goroutines, POST /debug/gc (a garbage collection) and /debug/heap (the heap profile after one) on --metrics-addr (see docs/model-test.md).")
	fs.StringVar(&c.eventsZMQ, "events-zmq", "", "publish what the tiers hold as vLLM KV events (BlockStored/BlockRemoved with medium CPU or STORAGE, locality LOCAL; STORAGE, REMOTE for blocks this node published to the remote tier, invalidated, or found gone from it; and the namespace_id of the engine identity; AllBlocksCleared) on a ZeroMQ PUB socket bound here: tcp://127.0.0.1:PORT or ipc://PATH; empty disables. See docs/events.md.")
	fs.BoolVar(&c.eventsZMQExpose, "events-zmq-expose", false, "let --events-zmq bind beyond loopback (a router in another pod). The events name the hashes of cached prefixes, never tokens or block bytes.")
	fs.StringVar(&c.eventsZMQTopic, "events-zmq-topic", "", "first frame of every --events-zmq message (vLLM's topic; llm-d expects kv@POD@MODEL).")
	fs.StringVar(&c.eventsZMQFormat, "events-zmq-format", c.eventsZMQFormat, "event encoding: map (vLLM main: each event a map with its class under \"type\") or array (vLLM up to 0.23: positional arrays).")
	fs.StringVar(&c.eventsZMQHashes, "events-zmq-hashes", c.eventsZMQHashes, "block hashes as int (the last 8 bytes, big-endian, vLLM's default) or bytes (as the client sent them, vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).")
	fs.IntVar(&c.eventsZMQBlockSize, "events-zmq-block-size", c.eventsZMQBlockSize, "BlockStored's block_size: the engine's tokens per block (the daemon does not know it).")
	fs.StringVar(&c.eventsZMQReplay, "events-zmq-replay", "", "vLLM's replay socket for --events-zmq (its replay_endpoint): a ZeroMQ ROUTER bound here (tcp://127.0.0.1:PORT or ipc://PATH, loopback unless --events-zmq-expose) answers a request [\"\", start_seq as 8 bytes big-endian] with every buffered batch from start_seq on, then END_SEQ (-1). Empty disables. See docs/events.md.")
	fs.IntVar(&c.eventsZMQReplayBatches, "events-zmq-replay-buffer", c.eventsZMQReplayBatches, "batches --events-zmq-replay keeps (vLLM's buffer_steps), within --events-zmq-replay-bytes.")
	fs.Var(byteSize{&c.eventsZMQReplayBytes}, "events-zmq-replay-bytes", "memory bound of the batches --events-zmq-replay keeps; the oldest go first.")
	c.cuda.addFlags(fs)
	c.remote.register(fs)
	fs.BoolVar(&c.showVersion, "version", false, "print the version and exit.")
	// A bad flag gets its error and a hint, not the whole --help after it
	// (which would push the error off the screen): the flag package's own
	// messages go nowhere, and the error is returned for main to print.
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(stderr)
			fmt.Fprint(stderr, usageHead)
			fs.PrintDefaults()
			return nil, err
		}
		return nil, fmt.Errorf("%w (see kvoffloadd --help)", err)
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q (all settings are flags; see --help)", fs.Arg(0))
	}
	if err := c.logLevel.UnmarshalText([]byte(*level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", *level)
	}
	return c, c.validate()
}

func (c *config) validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	if c.socket == "" || !filepath.IsAbs(c.socket) {
		bad("--socket %q: want an absolute path", c.socket)
	} else if len(c.socket) > 107 {
		bad("--socket %q: a unix socket path is at most 107 bytes", c.socket)
	}
	if c.socketMode != "0600" && c.socketMode != "0660" {
		bad("--socket-mode %q: want 0600 or 0660", c.socketMode)
	}
	if c.cpuBytes < 4<<20 {
		bad("--cpu-bytes %s: want at least 4MiB", formatBytes(c.cpuBytes))
	}
	if _, err := slots.ParsePolicy(c.cpuPolicy); err != nil {
		bad("--cpu-policy: %v", err)
	}
	if c.cpuChunkBytes != 0 && (c.cpuChunkBytes%4096 != 0 || c.cpuChunkBytes > c.cpuBytes) {
		bad("--cpu-chunk-bytes %s: want a multiple of 4096 no larger than --cpu-bytes", formatBytes(c.cpuChunkBytes))
	}
	if c.cpuArenaDir != "" && !filepath.IsAbs(c.cpuArenaDir) {
		bad("--cpu-arena-dir %q: want an absolute path", c.cpuArenaDir)
	}
	if c.ioWorkers < 1 || c.ioWorkers > 256 {
		bad("--io-workers %d: want 1..256", c.ioWorkers)
	}
	if c.copyNice < 0 || c.copyNice > 19 {
		bad("--copy-nice %d: want 0..19", c.copyNice)
	}
	if st, err := os.Stat(c.shmDir); err != nil || !st.IsDir() {
		bad("--shm-dir %q: not a directory", c.shmDir)
	}
	if c.metricsAddr != "" {
		host, _, err := net.SplitHostPort(c.metricsAddr)
		ip := net.ParseIP(host)
		if err != nil {
			bad("--metrics-addr %q: want host:port", c.metricsAddr)
		} else if !c.metricsExpose && host != "localhost" && (ip == nil || !ip.IsLoopback()) {
			bad("--metrics-addr %q: want a loopback host:port such as 127.0.0.1:9464, or add --metrics-expose to serve metrics beyond this host", c.metricsAddr)
		}
	}
	if c.namespaceLinger <= 0 {
		bad("--namespace-linger %s: want a positive duration", c.namespaceLinger)
	}
	if c.debugHoldCPU && !c.debugChecks {
		bad("--debug-hold-cpu-recovery needs --debug-checks: its gate is served beside the checks")
	}
	if c.debugChecks && c.metricsAddr == "" {
		bad("--debug-checks needs --metrics-addr: the checks are served beside the metrics")
	}
	if c.logFormat != "text" && c.logFormat != "json" {
		bad("--log-format %q: want text or json", c.logFormat)
	}
	if c.shutdownTimeout <= 0 {
		bad("--shutdown-timeout %s: want a positive duration", c.shutdownTimeout)
	}
	if c.resultsWait < 0 {
		bad("--shutdown-results-wait %s: want a duration of 0 or more", c.resultsWait)
	}
	seen := map[string]bool{}
	for _, d := range c.diskDirs {
		if !filepath.IsAbs(d) {
			bad("--disk-dir %q: want an absolute path", d)
		} else if seen[filepath.Clean(d)] {
			bad("--disk-dir %q is given twice", d)
		} else if st, err := os.Stat(d); err != nil || !st.IsDir() {
			bad("--disk-dir %q: not a directory", d)
		}
		seen[filepath.Clean(d)] = true
	}
	if len(c.diskDirs) > 0 && c.diskBytes < 16<<20 {
		bad("--disk-bytes %s: want at least 16MiB", formatBytes(c.diskBytes))
	}
	if c.diskChunkBytes != 0 && (c.diskChunkBytes%4096 != 0 || c.diskChunkBytes > c.diskBytes) {
		bad("--disk-chunk-bytes %s: want a multiple of 4096 no larger than --disk-bytes", formatBytes(c.diskChunkBytes))
	}
	if c.diskQueueDepth < 1 || c.diskQueueDepth > 256 {
		bad("--disk-queue-depth %d: want 1..256", c.diskQueueDepth)
	}
	if c.diskDirect != "require" && c.diskDirect != "fallback" {
		bad("--disk-direct %q: want require or fallback", c.diskDirect)
	}
	if len(c.diskDirs) == 0 && (c.diskReset || c.writeThrough || c.faultSpec != "") {
		bad("--disk-reset, --write-through and --fault-spec need a disk tier: add --disk-dir")
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"max-registrations", c.maxRegistrations}, {"max-registrations-per-uid", c.maxRegistrationsPerUID}, {"max-regions", c.maxRegions},
		{"max-regions-per-uid", c.maxRegionsPerUID}, {"max-connections", c.maxConnections}, {"max-connections-per-uid", c.maxConnectionsPerUID}} {
		if f.v < 1 {
			bad("--%s %d: want at least 1", f.name, f.v)
		}
	}
	if c.maxMappedBytes < 1<<20 {
		bad("--max-mapped-bytes %s: want at least 1MiB", formatBytes(c.maxMappedBytes))
	}
	if need := uint64(server.MaxRequestBytes(c.limits())); c.maxInflightRequestBytes < need || c.maxInflightRequestBytes > 1<<40 {
		bad("--max-inflight-request-bytes %s: want at least the largest request, %s, and at most 1TiB", formatBytes(c.maxInflightRequestBytes), formatBytes(need))
	}
	c.remote.validate(bad)
	if c.remote.stateDir != "" && len(c.diskDirs) > 0 {
		bad("--remote-state-dir is for a node without --disk-dir: with one, the remote tier's fences file is kept in every disk directory")
	}
	if c.faultSpec != "" {
		p, err := errorfs.ParsePlan(c.faultSpec)
		if err != nil {
			bad("--fault-spec: %v", err)
		}
		c.faultPlan = p
	}
	if c.eventsZMQ != "" {
		if err := checkEventsEndpoint("events-zmq", c.eventsZMQ, c.eventsZMQExpose); err != nil {
			errs = append(errs, err)
		}
	}
	if c.eventsZMQReplay != "" {
		if c.eventsZMQ == "" {
			bad("--events-zmq-replay needs --events-zmq: it replays that stream's batches")
		} else if c.eventsZMQReplay == c.eventsZMQ {
			bad("--events-zmq-replay %q: the same endpoint as --events-zmq", c.eventsZMQReplay)
		}
		if err := checkEventsEndpoint("events-zmq-replay", c.eventsZMQReplay, c.eventsZMQExpose); err != nil {
			errs = append(errs, err)
		}
	}
	if c.eventsZMQReplayBatches < 1 || c.eventsZMQReplayBatches > 1<<20 {
		bad("--events-zmq-replay-buffer %d: want 1 to %d batches", c.eventsZMQReplayBatches, 1<<20)
	}
	if c.eventsZMQReplayBytes < 1<<20 || c.eventsZMQReplayBytes > 64<<30 {
		bad("--events-zmq-replay-bytes %s: want 1MiB to 64GiB (a batch is up to about 140 KiB)", formatBytes(c.eventsZMQReplayBytes))
	}
	if c.eventsZMQFormat != "map" && c.eventsZMQFormat != "array" {
		bad("--events-zmq-format %q: want map or array", c.eventsZMQFormat)
	}
	if c.eventsZMQHashes != "int" && c.eventsZMQHashes != "bytes" {
		bad("--events-zmq-hashes %q: want int or bytes", c.eventsZMQHashes)
	}
	if c.eventsZMQBlockSize < 1 {
		bad("--events-zmq-block-size %d: want at least 1", c.eventsZMQBlockSize)
	}
	if err := c.cuda.validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// limits are the service's request bounds, with the flags' values.
func (c *config) limits() offload.Limits {
	l := offload.DefaultLimits
	l.MaxRegistrations, l.MaxRegistrationsPerUID = c.maxRegistrations, c.maxRegistrationsPerUID
	l.MaxRegions, l.MaxRegionsPerUID = c.maxRegions, c.maxRegionsPerUID
	return l
}

// checkEventsEndpoint accepts ipc://PATH and tcp://HOST:PORT, HOST a
// loopback address unless exposed.
func checkEventsEndpoint(flag, ep string, expose bool) error {
	if p, ok := strings.CutPrefix(ep, "ipc://"); ok {
		if !filepath.IsAbs(p) {
			return fmt.Errorf("--%s %q: want ipc:// and an absolute path", flag, ep)
		}
		return nil
	}
	hp, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return fmt.Errorf("--%s %q: want tcp://HOST:PORT or ipc://PATH", flag, ep)
	}
	host, _, err := net.SplitHostPort(hp)
	if err != nil {
		return fmt.Errorf("--%s %q: want tcp://HOST:PORT", flag, ep)
	}
	if ip := net.ParseIP(host); !expose && host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return fmt.Errorf("--%s %q: want a loopback address such as tcp://127.0.0.1:5557, or add --events-zmq-expose to publish beyond this host", flag, ep)
	}
	return nil
}

// eventsZMQConfig is the publisher's configuration from the flags.
func (c *config) eventsZMQConfig(log *slog.Logger) events.ZMQConfig {
	v := events.VLLM{BlockSize: c.eventsZMQBlockSize, BytesHashes: c.eventsZMQHashes == "bytes"}
	if c.eventsZMQFormat == "array" {
		v.Format = events.FormatArray
	}
	return events.ZMQConfig{Endpoint: c.eventsZMQ, Topic: c.eventsZMQTopic, VLLM: v, Logger: log,
		ReplayEndpoint: c.eventsZMQReplay, ReplayBatches: c.eventsZMQReplayBatches, ReplayBytes: int64(c.eventsZMQReplayBytes)}
}
