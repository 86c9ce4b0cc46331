// Command kvoffloadd is the KV-cache offload daemon. See --help and docs/.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/net/netutil"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/events"
	"github.com/kvoffloadd/kvoffloadd/offload"
	"github.com/kvoffloadd/kvoffloadd/rpc/server"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/slots"
)

var version = "dev"

// wrapCopier, when set (by tests), wraps the copy engine.
var wrapCopier func(dma.Engine) dma.Engine

// failedShutdownTimeout bounds the shutdown after the copy engine failed: a
// sticky CUDA error fails every batch at once, so jobs end quickly; one
// whose copies cannot be known to have stopped never ends, and shutdown
// abandons it (the process exit stops the copies).
const failedShutdownTimeout = 10 * time.Second

// The metrics address's bounds: what a client there can make the daemon
// hold (a goroutine and a descriptor a connection). A Prometheus server
// keeps one connection and scrapes it every 15-60 s, well inside the idle
// timeout.
const (
	maxMetricsConns     = 64
	metricsIdleTimeout  = 2 * time.Minute
	metricsWriteTimeout = 2 * time.Minute
)

func main() {
	// SIGHUP stops the daemon like SIGTERM: it has no configuration to
	// reload and logs to stderr, with no file to reopen, and a hangup
	// (its terminal gone, a supervisor's stop) is best met with a drain
	// and a clean exit. SIGQUIT keeps Go's default: a goroutine dump and
	// exit 2, no drain (docs/operations.md, Signals).
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer stop()
	// A write to a broken stderr (journald restarted, the terminal gone)
	// fails rather than kills the daemon with SIGPIPE.
	signal.Ignore(syscall.SIGPIPE)
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "kvoffloadd:", err)
		os.Exit(1)
	}
}

// run starts the daemon and serves until ctx ends, then shuts down in order:
// health goes NOT_SERVING, new work is refused, in-flight jobs drain, the
// gRPC server stops, registrations unmap, the arena is released.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) (result error) {
	cfg, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if cfg.showVersion {
		fmt.Fprintf(stdout, "kvoffloadd %s (API protocol %d)\n", version, server.ProtocolVersion)
		return nil
	}
	if err := checkMemory(cfg); err != nil {
		return err
	}
	var h slog.Handler = slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: cfg.logLevel})
	if cfg.logFormat == "json" {
		h = slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: cfg.logLevel})
	}
	log := slog.New(h)
	server.Version = version
	procs := setProcs(cfg.ioWorkers)

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	copier, err := newCopier(cfg, log, reg)
	if err != nil {
		return fmt.Errorf("copy engine: %w", err)
	}
	if wrapCopier != nil {
		copier = wrapCopier(copier)
	}
	// A copy engine that fails as a whole (a CUDA context lost to a sticky
	// error) cannot serve again: the daemon stops and exits for a
	// supervisor to restart it.
	var copierFailed <-chan struct{}
	failer, _ := copier.(dma.Failer)
	if failer != nil {
		copierFailed = failer.Failed()
	}
	diskCfg, startFaults, err := diskConfig(cfg, log, reg)
	if err != nil {
		copier.Close()
		return err
	}
	remoteCfg, err := remoteConfig(&cfg.remote, log)
	if err != nil {
		copier.Close()
		return err
	}
	gate := newRecoveryGate(cfg.debugHoldCPU)
	svc, err := offload.New(offload.Config{
		CPU:          cpu.Config{Bytes: cfg.cpuBytes, ChunkBytes: cfg.cpuChunkBytes, Policy: slots.Policy(cfg.cpuPolicy)},
		CPUArenaDir:  cfg.cpuArenaDir,
		Disk:         diskCfg,
		WriteThrough: cfg.writeThrough,
		DMA:          copier,
		Limits:       cfg.limits(),
		Logger:       log,
		Registerer:   reg,
		Remote:       remoteCfg,

		NamespaceLinger: cfg.namespaceLinger,
		// Set only by tests: they hold the CPU tier's recovery before it
		// files a chunk.
		CPURecoveryHook: gate.hook(testHookCPURecovery),
	})
	if err != nil {
		if remoteCfg != nil {
			remoteCfg.Store.Close()
		}
		copier.Close()
		return err
	}
	// Whether the arena could be locked (mlock): without CAP_IPC_LOCK or a
	// large enough RLIMIT_MEMLOCK (a Pod Security baseline or restricted
	// pod) it serves unlocked, said once in the log and here.
	cpuTier := svc.CPU()
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvoffload_cpu_arena_locked",
		Help: "1 when the CPU tier's arena is locked in memory (mlock), 0 when it could not be (no CAP_IPC_LOCK, RLIMIT_MEMLOCK too small) and may be swapped out.",
	}, func() float64 {
		if cpuTier.Locked() {
			return 1
		}
		return 0
	}))
	stopFaults := faultsAfterRecovery(svc.DiskRecovered(), startFaults)
	// From the start: its first message is a reset, then the blocks the
	// disk tier's recovery brings back as they come.
	var pub *events.Publisher
	if cfg.eventsZMQ != "" {
		if pub, err = events.NewPublisher(svc.Events(), cfg.eventsZMQConfig(log)); err != nil {
			stopFaults()
			gate.open()
			svc.Close()
			copier.Close()
			return err
		}
		if cfg.eventsZMQReplay != "" {
			registerReplayMetrics(reg, pub)
			log.Info("events: replay socket bound", "endpoint", pub.ReplayAddr(), "batches", cfg.eventsZMQReplayBatches, "bytes", cfg.eventsZMQReplayBytes)
		}
	}
	closeAll := func() error {
		stopFaults()
		gate.open() // a held recovery must not hold up the stop
		var pubErr error
		if pub != nil {
			pubErr = pub.Close()
		}
		return errors.Join(pubErr, svc.Close(), copier.Close())
	}

	mode := os.FileMode(0o600)
	if cfg.socketMode == "0660" {
		mode = 0o660
	}
	lis, err := listenUnix(cfg.socket, mode)
	if err != nil {
		closeAll()
		return err
	}
	// The socket goes as the listener closes (the gRPC server's stop
	// closes it before the teardown): a successor may take the path while
	// this daemon still tears down, and it keeps it.
	defer lis.Close()
	// The life file's lock says "exited" to connectors that cannot see
	// this process (life.go): released after everything else, and not at
	// all when the shutdown left copies running (the exit releases it).
	releaseLife, err := holdLife(cfg.socket, mode)
	if err != nil {
		lis.Close()
		closeAll()
		return err
	}
	defer func() {
		if !errors.Is(result, errAbandoned) {
			releaseLife()
		}
	}()

	var metricsSrv *http.Server
	metricsErr := make(chan error, 1)
	if cfg.metricsAddr != "" {
		ml, err := net.Listen("tcp", cfg.metricsAddr)
		if err != nil {
			lis.Close()
			closeAll()
			return fmt.Errorf("--metrics-addr %s: %w", cfg.metricsAddr, err)
		}
		mux := http.NewServeMux()
		// Uncompressed: a scrape is some 20 KB (134 series with a disk
		// tier and no engine yet), and each gzip writer the handler pools
		// holds about 1.2 MB of compressor state (one per concurrent
		// scrape), more than 10^4 blocks' index; kvbench's memory per block
		// counted it as the blocks'.
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg, DisableCompression: true}))
		if cfg.debugChecks {
			mountDebug(mux, svc, gate)
			log.Warn("--debug-checks: /debug/check, /debug/goroutines, /debug/gc and /debug/heap are served on the metrics address; for tests only")
		}
		// Bounded as the gRPC socket is: at most maxMetricsConns
		// connections at once (more wait in the listen queue), an idle
		// one closed after metricsIdleTimeout, a request's headers read
		// within 5s and its reply written within metricsWriteTimeout
		// (/debug/check may wait up to a minute).
		metricsSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second,
			IdleTimeout: metricsIdleTimeout, WriteTimeout: metricsWriteTimeout}
		go func() { metricsErr <- metricsSrv.Serve(netutil.LimitListener(ml, maxMetricsConns)) }()
	}

	srv := server.New(svc, log, server.Config{
		MaxConnections:          cfg.maxConnections,
		MaxConnectionsPerUID:    cfg.maxConnectionsPerUID,
		MaxInflightRequestBytes: int64(cfg.maxInflightRequestBytes),
		Registerer:              reg,
	})
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(lis) }()
	used, _ := svc.CPU().Usage()
	log.Info("kvoffloadd serving", "version", version, "protocol", server.ProtocolVersion, "socket", cfg.socket, "metrics", cfg.metricsAddr,
		"cpu_bytes", svc.CPU().Capacity(), "cpu_chunk_bytes", svc.CPU().ChunkBytes(), "arena_locked", svc.CPU().Locked(),
		"cpu_used_bytes", used, "copy_engine", copier.Name(), "io_workers", cfg.ioWorkers, "gomaxprocs", procs,
		"disk_dirs", len(cfg.diskDirs), "disk_bytes_per_dir", cfg.diskBytes, "write_through", cfg.writeThrough,
		"max_request_bytes", srv.MaxRequestBytes(), "events_zmq", cfg.eventsZMQ,
		"remote_seeds", strings.Join(cfg.remote.addrs, ","), "remote_write", cfg.remote.write, "remote_mac", cfg.remote.keyFile != "")

	var runErr error
	timeout := cfg.shutdownTimeout
	select {
	case <-ctx.Done():
		log.Info("shutting down: health NOT_SERVING, refusing new work, draining jobs", "timeout", cfg.shutdownTimeout)
	case <-copierFailed:
		runErr = fmt.Errorf("the %s copy engine failed, restart the daemon: %w", copier.Name(), failer.Err())
		timeout = min(timeout, failedShutdownTimeout)
		log.Error("the copy engine failed: health NOT_SERVING, refusing new work, failing jobs in flight, then exiting; a supervisor should restart the daemon",
			"copy_engine", copier.Name(), "err", failer.Err())
	case err := <-serveErr:
		runErr = fmt.Errorf("grpc server: %w", err)
	case err := <-metricsErr:
		runErr = fmt.Errorf("metrics server: %w", err)
	}
	return errors.Join(runErr, shutdown(log, timeout, cfg.resultsWait, srv, svc, func() error {
		if metricsSrv != nil {
			metricsSrv.Close()
		}
		return closeAll()
	}))
}

// setProcs gives the Go runtime at least workers+1 processors, unless the
// operator set GOMAXPROCS. A copy worker holds its processor for the whole
// of a memmove; with as many processors as workers, a burst of copies
// holds them all, and then nothing polls the network but the runtime's
// monitor, every 10 ms: an engine's Lookup would wait for it. One more
// processor than workers keeps one free for the API. The OS threads beyond
// the cores cost little: the copy threads run at a lower priority
// (--copy-nice), so the kernel runs the API's thread first.
func setProcs(workers int) int {
	if os.Getenv("GOMAXPROCS") == "" && runtime.GOMAXPROCS(0) < workers+1 {
		runtime.GOMAXPROCS(workers + 1)
	}
	return runtime.GOMAXPROCS(0)
}

// errAbandoned: the shutdown timeout passed with work still running.
var errAbandoned = errors.New("shutdown timeout passed: exited with work still running")

// shutdown stops the daemon within timeout, a promise a supervisor can
// count on (systemd kills at TimeoutStopSec): health goes NOT_SERVING, new
// work is refused, accepted jobs drain and calls finish until a share of
// the timeout is left. Then the listener closes (a successor may take the
// socket's path) and, for up to resultsWait (never past that share), the
// connections stay open answering Completions until every finished
// result has been sent: a client learns the outcome of each job the drain
// finished instead of taking it as failed. Then every connection is
// closed and the service torn down in the rest. If work is still running
// at the end, it returns errAbandoned without waiting: a copy cut short is
// never reported done, so the engine recomputes its blocks, and a disk
// write cut short leaves a slot the next start's checksums refuse, exactly
// as after kill -9. The teardown goroutine is then left to the process's
// exit.
func shutdown(log *slog.Logger, timeout, resultsWait time.Duration, srv *server.Server, svc *offload.Service, closeAll func() error) error {
	start := time.Now()
	end := start.Add(timeout)
	// Unmapping regions and the arena and closing the disk tier take
	// milliseconds once the jobs have drained: keep them a quarter of the
	// timeout, at most a second.
	drainBy := end.Add(-min(timeout/4, time.Second))
	srv.SetNotServing()
	svc.BeginShutdown()
	dctx, cancel := context.WithDeadline(context.Background(), drainBy)
	if err := svc.Drain(dctx); err != nil {
		log.Warn("shutdown: jobs still running at the drain deadline; closing connections", "err", err)
	}
	cancel()
	// The connections are still open: gRPC's graceful stop would refuse
	// the next Completions call on them (GOAWAY) and only let calls in
	// flight finish. The listener alone goes now, and with it the socket.
	srv.StopAccepting()
	if n := svc.Undelivered(); n > 0 {
		waitBy := time.Now().Add(resultsWait)
		if waitBy.After(drainBy) {
			waitBy = drainBy
		}
		log.Info("shutdown: socket removed; waiting for clients to read the results of the jobs drained", "registrations", n,
			"wait", time.Until(waitBy).Round(time.Millisecond))
		rctx, cancel := context.WithDeadline(context.Background(), waitBy)
		if left := svc.WaitDelivered(rctx); left > 0 {
			log.Warn("shutdown: clients did not read the results of jobs the daemon finished; they will count them failed", "registrations", left)
		} else {
			log.Info("shutdown: every result was sent")
		}
		cancel()
	}
	done := make(chan error, 1)
	go func() {
		srv.Stop(drainBy)
		done <- closeAll()
	}()
	t := time.NewTimer(time.Until(end))
	defer t.Stop()
	select {
	case err := <-done:
		log.Info("stopped", "err", err, "took", time.Since(start).Round(time.Millisecond))
		return err
	case <-t.C:
		log.Error("shutdown timeout passed with work still running: exiting without waiting for it; jobs cut short are never reported done, so the engine recomputes their blocks", "timeout", timeout)
		return errAbandoned
	}
}

// listenUnix creates the socket with mode in a directory the daemon owns.
// Closing the listener removes the socket, if the path still names it.
func listenUnix(path string, mode os.FileMode) (net.Listener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("--socket: create %s: %w", dir, err)
	}
	st, err := os.Lstat(dir)
	if err != nil {
		return nil, fmt.Errorf("--socket: %w", err)
	}
	sys, _ := st.Sys().(*syscall.Stat_t)
	if !st.IsDir() || sys == nil || int(sys.Uid) != os.Getuid() {
		return nil, fmt.Errorf("--socket: directory %s must be a directory owned by uid %d (not a symlink)", dir, os.Getuid())
	}
	if st.Mode().Perm()&0o022 != 0 {
		return nil, fmt.Errorf("--socket: directory %s is writable by others (mode %#o); use a private directory", dir, st.Mode().Perm())
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("--socket: %s exists and is not a socket; refusing to remove it", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("--socket: another process is serving on %s", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("--socket: remove stale socket: %w", err)
		}
	}
	// Create the socket with no access, then open it up to mode: no
	// window in which someone else could connect.
	old := syscall.Umask(0o777)
	lis, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("--socket: %w", err)
	}
	ul := lis.(*net.UnixListener)
	ul.SetUnlinkOnClose(false)
	own, err := os.Lstat(path)
	if err != nil {
		lis.Close()
		return nil, fmt.Errorf("--socket: %w", err)
	}
	if err := os.Chmod(path, mode); err != nil {
		lis.Close()
		os.Remove(path)
		return nil, fmt.Errorf("--socket: chmod: %w", err)
	}
	return &ownedSocket{UnixListener: ul, path: path, own: own}, nil
}

// ownedSocket is the daemon's listener. Its Close removes the socket file
// only while the path still names this listener's socket, and before the
// listener closes: while it is open nobody takes the path (a successor
// dials it, finds this daemon and refuses to start) and its inode cannot
// be reused, so os.SameFile tells it apart. Once closed, a successor may
// bind the path, and its socket may get this one's inode number.
// (net.UnixListener's own unlink-on-close removes the path after closing,
// whatever it names then.)
type ownedSocket struct {
	*net.UnixListener
	path string
	own  os.FileInfo
	once sync.Once
	err  error
}

func (s *ownedSocket) Close() error {
	s.once.Do(func() {
		if st, err := os.Lstat(s.path); err == nil && os.SameFile(st, s.own) {
			os.Remove(s.path)
		}
		s.err = s.UnixListener.Close()
	})
	return s.err
}

// registerReplayMetrics exports what --events-zmq-replay did.
func registerReplayMetrics(reg prometheus.Registerer, pub *events.Publisher) {
	gauge := func(name, help string, f func(events.ReplayStats) float64) {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 { return f(pub.ReplayStats()) }))
	}
	counter := func(name, help string, labels prometheus.Labels, f func(events.ReplayStats) uint64) {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels}, func() float64 { return float64(f(pub.ReplayStats())) }))
	}
	gauge("kvoffload_events_replay_buffered_batches", "Batches --events-zmq-replay holds.", func(s events.ReplayStats) float64 { return float64(s.Batches) })
	gauge("kvoffload_events_replay_buffered_bytes", "Bytes of the batches --events-zmq-replay holds.", func(s events.ReplayStats) float64 { return float64(s.Bytes) })
	gauge("kvoffload_events_replay_connections", "Connections open to --events-zmq-replay.", func(s events.ReplayStats) float64 { return float64(s.Conns) })
	const reqHelp = "Replay requests on --events-zmq-replay: answered, or malformed (not [\"\", start_seq]) and ignored."
	counter("kvoffload_events_replay_requests_total", reqHelp, prometheus.Labels{"result": "answered"}, func(s events.ReplayStats) uint64 { return s.Requests })
	counter("kvoffload_events_replay_requests_total", reqHelp, prometheus.Labels{"result": "malformed"}, func(s events.ReplayStats) uint64 { return s.Malformed })
	counter("kvoffload_events_replay_sent_batches_total", "Batches sent in replay replies.", nil, func(s events.ReplayStats) uint64 { return s.Sent })
	counter("kvoffload_events_replay_truncated_total", "Replay replies that stopped at a batch the buffer dropped while they were sent.", nil, func(s events.ReplayStats) uint64 { return s.Truncated })
	const closedHelp = "Replay connections closed by the daemon: refused (past the bound) or dropped (a bad handshake or frame, a peer not reading, idle)."
	counter("kvoffload_events_replay_closed_connections_total", closedHelp, prometheus.Labels{"reason": "refused"}, func(s events.ReplayStats) uint64 { return s.Refused })
	counter("kvoffload_events_replay_closed_connections_total", closedHelp, prometheus.Labels{"reason": "dropped"}, func(s events.ReplayStats) uint64 { return s.Dropped })
}
