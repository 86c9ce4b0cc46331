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
)

// config is every flag of the daemon, validated before anything starts.
type config struct {
	socket          string
	socketMode      string
	cpuBytes        uint64
	cpuChunkBytes   uint64
	ioWorkers       int
	shmDir          string
	metricsAddr     string
	logLevel        slog.Level
	logFormat       string
	shutdownTimeout time.Duration
	showVersion     bool
}

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
memory, so prefixes evicted from the GPU can be loaded back instead of
recomputed. The engine's connector talks to it over gRPC on a unix socket;
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
		ioWorkers:       min(4, runtime.NumCPU()),
		shmDir:          "/dev/shm",
		metricsAddr:     "127.0.0.1:9464",
		logFormat:       "text",
		shutdownTimeout: 30 * time.Second,
	}
	fs := flag.NewFlagSet("kvoffloadd", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.socket, "socket", defaultSocket(), "unix socket to serve the API on. Its directory is created with mode 0700 and must be owned by the daemon's user; a stale socket is removed only after a dial finds nobody listening.")
	fs.StringVar(&c.socketMode, "socket-mode", c.socketMode, "permission bits of the socket: 0600 (only this user) or 0660 (also this user's group).")
	fs.Var(byteSize{&c.cpuBytes}, "cpu-bytes", "size of the CPU tier: one host arena, mapped once and locked in memory where RLIMIT_MEMLOCK allows.")
	fs.Var(byteSize{&c.cpuChunkBytes}, "cpu-chunk-bytes", "arena chunk size; each chunk serves one block size and bounds the largest block (0: arena/16, clamped to 4MiB..256MiB).")
	fs.IntVar(&c.ioWorkers, "io-workers", c.ioWorkers, "copy workers moving blocks between engine memory and the arena.")
	fs.StringVar(&c.shmDir, "shm-dir", c.shmDir, "the only directory clients may register region files from.")
	fs.StringVar(&c.metricsAddr, "metrics-addr", c.metricsAddr, "loopback host:port serving Prometheus metrics on /metrics; empty disables.")
	level := fs.String("log-level", "info", "log level: debug, info, warn or error.")
	fs.StringVar(&c.logFormat, "log-format", c.logFormat, "log format on stderr: text or json.")
	fs.DurationVar(&c.shutdownTimeout, "shutdown-timeout", c.shutdownTimeout, "on SIGTERM/SIGINT, how long to let in-flight jobs and calls finish before closing connections.")
	fs.BoolVar(&c.showVersion, "version", false, "print the version and exit.")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usageHead)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
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
	if c.cpuChunkBytes != 0 && (c.cpuChunkBytes%4096 != 0 || c.cpuChunkBytes > c.cpuBytes) {
		bad("--cpu-chunk-bytes %s: want a multiple of 4096 no larger than --cpu-bytes", formatBytes(c.cpuChunkBytes))
	}
	if c.ioWorkers < 1 || c.ioWorkers > 256 {
		bad("--io-workers %d: want 1..256", c.ioWorkers)
	}
	if st, err := os.Stat(c.shmDir); err != nil || !st.IsDir() {
		bad("--shm-dir %q: not a directory", c.shmDir)
	}
	if c.metricsAddr != "" {
		host, _, err := net.SplitHostPort(c.metricsAddr)
		ip := net.ParseIP(host)
		if err != nil || (host != "localhost" && (ip == nil || !ip.IsLoopback())) {
			bad("--metrics-addr %q: want a loopback host:port such as 127.0.0.1:9464 (metrics are not served beyond this host)", c.metricsAddr)
		}
	}
	if c.logFormat != "text" && c.logFormat != "json" {
		bad("--log-format %q: want text or json", c.logFormat)
	}
	if c.shutdownTimeout <= 0 {
		bad("--shutdown-timeout %s: want a positive duration", c.shutdownTimeout)
	}
	return errors.Join(errs...)
}
