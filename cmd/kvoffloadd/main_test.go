package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
)

func TestHelpExplainsEveryFlag(t *testing.T) {
	var out bytes.Buffer
	err := run(context.Background(), []string{"--help"}, io.Discard, &out)
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	for _, f := range []string{"-socket", "-socket-mode", "-cpu-bytes", "-cpu-chunk-bytes", "-cpu-policy", "-cpu-arena-dir", "-io-workers", "-shm-dir", "-metrics-addr", "-metrics-expose", "-log-level", "-log-format", "-shutdown-timeout", "-shutdown-results-wait", "-version",
		"-disk-dir", "-disk-bytes", "-disk-chunk-bytes", "-disk-queue-depth", "-disk-direct", "-disk-reset", "-write-through", "-fault-spec",
		"-max-registrations", "-max-registrations-per-uid", "-max-regions", "-max-regions-per-uid", "-max-mapped-bytes",
		"-max-connections", "-max-connections-per-uid", "-max-inflight-request-bytes", "-namespace-linger", "-debug-checks",
		"-events-zmq", "-events-zmq-expose", "-events-zmq-topic", "-events-zmq-format", "-events-zmq-hashes", "-events-zmq-block-size",
		"-events-zmq-replay", "-events-zmq-replay-buffer", "-events-zmq-replay-bytes"} {
		if !strings.Contains(out.String(), f+" ") && !strings.Contains(out.String(), f+"\n") {
			t.Errorf("--help does not mention %s", f)
		}
	}
}

func TestBadFlagsRefuseToStart(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"--cpu-bytes", "12potatoes"}, "not a size"},
		{[]string{"--cpu-bytes", "1MiB"}, "--cpu-bytes 1MiB: want at least 4MiB"},
		{[]string{"--cpu-chunk-bytes", "5000"}, "--cpu-chunk-bytes"},
		{[]string{"--cpu-policy", "lru"}, "--cpu-policy: policy \"lru\": want slru or tinylfu"},
		{[]string{"--socket", "relative.sock"}, "--socket \"relative.sock\": want an absolute path"},
		{[]string{"--socket-mode", "0666"}, "--socket-mode"},
		{[]string{"--io-workers", "0"}, "--io-workers 0"},
		{[]string{"--shutdown-results-wait", "-1s"}, "--shutdown-results-wait -1s: want a duration of 0 or more"},
		{[]string{"--shm-dir", "/nonexistent"}, "--shm-dir"},
		{[]string{"--metrics-addr", "0.0.0.0:9464"}, "loopback"},
		{[]string{"--metrics-addr", ":9464"}, "--metrics-expose"},
		{[]string{"--metrics-addr", "9464", "--metrics-expose"}, "want host:port"},
		{[]string{"--events-zmq", "tcp://0.0.0.0:5557"}, "--events-zmq-expose"},
		{[]string{"--events-zmq", "tcp://*:5557"}, "--events-zmq-expose"},
		{[]string{"--events-zmq", "udp://127.0.0.1:5557"}, "want tcp://HOST:PORT or ipc://PATH"},
		{[]string{"--events-zmq", "ipc://relative"}, "absolute path"},
		{[]string{"--events-zmq-format", "json"}, "--events-zmq-format"},
		{[]string{"--events-zmq-hashes", "hex"}, "--events-zmq-hashes"},
		{[]string{"--events-zmq-block-size", "0"}, "--events-zmq-block-size"},
		{[]string{"--events-zmq-replay", "tcp://127.0.0.1:5558"}, "--events-zmq-replay needs --events-zmq"},
		{[]string{"--events-zmq", "tcp://127.0.0.1:5557", "--events-zmq-replay", "tcp://127.0.0.1:5557"}, "the same endpoint"},
		{[]string{"--events-zmq", "tcp://127.0.0.1:5557", "--events-zmq-replay", "tcp://0.0.0.0:5558"}, "--events-zmq-replay \"tcp://0.0.0.0:5558\": want a loopback address"},
		{[]string{"--events-zmq-replay-buffer", "0"}, "--events-zmq-replay-buffer 0"},
		{[]string{"--events-zmq-replay-bytes", "4KiB"}, "--events-zmq-replay-bytes 4KiB"},
		{[]string{"--log-level", "chatty"}, "--log-level"},
		{[]string{"--log-format", "xml"}, "--log-format"},
		{[]string{"--shutdown-timeout", "-1s"}, "--shutdown-timeout"},
		{[]string{"stray"}, "unexpected argument"},
		{[]string{"--disk-dir", "relative/dir"}, "--disk-dir \"relative/dir\": want an absolute path"},
		{[]string{"--disk-dir", "/nonexistent/kv"}, "not a directory"},
		{[]string{"--disk-dir", "/tmp", "--disk-dir", "/tmp"}, "given twice"},
		{[]string{"--disk-dir", "/tmp", "--disk-bytes", "1MiB"}, "--disk-bytes 1MiB"},
		{[]string{"--disk-dir", "/tmp", "--disk-direct", "maybe"}, "--disk-direct"},
		{[]string{"--disk-dir", "/tmp", "--disk-queue-depth", "0"}, "--disk-queue-depth 0"},
		{[]string{"--disk-dir", "/tmp", "--fault-spec", "read-eio=2"}, "--fault-spec"},
		{[]string{"--disk-dir", "/tmp", "--fault-spec", "gremlins=0.1"}, "gremlins"},
		{[]string{"--write-through"}, "need a disk tier"},
		{[]string{"--fault-spec", "read-eio=0.1"}, "need a disk tier"},
		{[]string{"--debug-checks"}, "--debug-checks needs --metrics-addr"},
		{[]string{"--namespace-linger", "0s"}, "--namespace-linger 0s"},
		{[]string{"--max-registrations", "0"}, "--max-registrations 0"},
		{[]string{"--max-regions-per-uid", "-1"}, "--max-regions-per-uid -1"},
		{[]string{"--max-connections", "0"}, "--max-connections 0"},
		{[]string{"--max-mapped-bytes", "4096"}, "--max-mapped-bytes 4KiB"},
		{[]string{"--max-inflight-request-bytes", "1MiB"}, "want at least the largest request"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			args := append([]string{"--socket", sock, "--metrics-addr", ""}, tc.args...)
			err := run(context.Background(), args, io.Discard, io.Discard)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestBadFlagIsOneLine: the real binary answers a flag it does not know,
// or a value it cannot parse, with the error and a hint on one line, not
// the whole --help after it (issue 33, 6).
func TestBadFlagIsOneLine(t *testing.T) {
	bin := buildDaemon(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--no-such-flag"}, "kvoffloadd: flag provided but not defined: -no-such-flag (see kvoffloadd --help)\n"},
		{[]string{"--cpu-bytes", "12potatoes"}, `kvoffloadd: invalid value "12potatoes" for flag -cpu-bytes: "12potatoes" is not a size (use e.g. 4096, 512MiB, 8GiB) (see kvoffloadd --help)` + "\n"},
		{[]string{"--io-workers", "many"}, `kvoffloadd: invalid value "many" for flag -io-workers: parse error (see kvoffloadd --help)` + "\n"},
	} {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(bin, tc.args...)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 1 {
			t.Errorf("%v: %v, want exit status 1", tc.args, err)
		}
		if stderr.String() != tc.want || stdout.Len() != 0 {
			t.Errorf("%v: stderr %q, stdout %q; want stderr %q", tc.args, stderr.String(), stdout.String(), tc.want)
		}
	}
	// --help still prints the whole help, and exits 0.
	out, err := exec.Command(bin, "--help").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Usage: kvoffloadd [flags]") || !strings.Contains(string(out), "-write-through") {
		t.Fatalf("--help: %v\n%s", err, out)
	}
}

// TestMetricsExpose: a non-loopback --metrics-addr is taken only with
// --metrics-expose (deploy/deploy_test.go scrapes a daemon started so).
func TestMetricsExpose(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	for _, addr := range []string{":9464", "0.0.0.0:9464", "[::]:9464", "10.1.2.3:9464", "127.0.0.1:9464"} {
		c, err := parseFlags([]string{"--socket", sock, "--metrics-addr", addr, "--metrics-expose"}, io.Discard)
		if err != nil || !c.metricsExpose || c.metricsAddr != addr {
			t.Errorf("--metrics-addr %s --metrics-expose: %v", addr, err)
		}
	}
}

func TestParseBytes(t *testing.T) {
	for in, want := range map[string]uint64{"4096": 4096, "64MiB": 64 << 20, "2G": 2 << 30, "1TiB": 1 << 40, " 8 KiB": 8 << 10} {
		if got, err := parseBytes(in); err != nil || got != want {
			t.Errorf("parseBytes(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "MiB", "-1", "1.5GiB", "99999999999TiB"} {
		if _, err := parseBytes(in); err == nil {
			t.Errorf("parseBytes(%q) accepted", in)
		}
	}
}

// TestSocketSafety: the socket is private, a stale one is replaced, a live
// one is never stolen, and a file that is not a socket is never removed.
func TestSocketSafety(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "kv.sock")
	lis, err := listenUnix(sock, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(sock)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode: %v %v", st.Mode(), err)
	}
	if _, err := listenUnix(sock, 0o600); err == nil || !strings.Contains(err.Error(), "another process is serving") {
		t.Fatalf("second listener: %v", err)
	}
	lis.Close()
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Fatalf("closing the listener left its socket: %v", err)
	}
	// A stale socket, as a killed daemon leaves.
	raw, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	raw.(*net.UnixListener).SetUnlinkOnClose(false)
	raw.Close()
	lis2, err := listenUnix(sock, 0o600)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	lis2.Close()
	regular := filepath.Join(dir, "file")
	os.WriteFile(regular, []byte("keep me"), 0o600)
	if _, err := listenUnix(regular, 0o600); err == nil {
		t.Fatal("listened over a regular file")
	}
	if b, _ := os.ReadFile(regular); string(b) != "keep me" {
		t.Fatal("regular file was touched")
	}
	open := filepath.Join(t.TempDir(), "open")
	os.Mkdir(open, 0o777)
	os.Chmod(open, 0o777)
	if _, err := listenUnix(filepath.Join(open, "s"), 0o600); err == nil || !strings.Contains(err.Error(), "writable by others") {
		t.Fatalf("socket in a world-writable directory: %v", err)
	}
}

// TestSuccessorKeepsSocket: a daemon still tearing down after its listener
// closed never removes the socket of the daemon that took its path
// meanwhile (issue 30, 5). The old daemon's teardown waits on a disk write
// that an injected latency holds for hours, until its shutdown timeout; it
// is stopped (SIGSTOP) as soon as its socket stops answering, the new
// daemon starts on the path, and then the old one goes on and exits.
func TestSuccessorKeepsSocket(t *testing.T) {
	bin := buildDaemon(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	old, c, oldExited := startDaemon(t, bin, "--socket", sock, "--metrics-addr", "", "--cpu-bytes", "8MiB", "--cpu-chunk-bytes", "4MiB",
		"--disk-dir", t.TempDir(), "--disk-bytes", "16MiB", "--disk-chunk-bytes", "4MiB", "--write-through",
		"--fault-spec", "latency=1000h@1,seed=1", "--shutdown-timeout", "10s")
	waitRecovered(t, c) // the fault plan starts after recovery
	storeOne(t, c, testenv.Model{Layers: 1, SegBytes: 64 << 10, Blocks: 2}, "successor", 1)
	c.Close()
	if err := old.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		conn, err := net.DialTimeout("unix", sock, time.Second)
		if err != nil {
			break // its listener is closed; its disk write still runs
		}
		conn.Close()
		if time.Now().After(deadline) {
			t.Fatal("the old daemon still listens 30s after SIGTERM")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := old.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	select {
	case <-oldExited:
		t.Fatal("the old daemon exited before its shutdown timeout: the test did not overlap the two daemons")
	default:
	}
	startDaemon(t, bin, "--socket", sock, "--metrics-addr", "", "--cpu-bytes", "8MiB")
	old.Process.Signal(syscall.SIGCONT)
	select {
	case <-oldExited:
	case <-time.After(60 * time.Second):
		t.Fatal("the old daemon did not exit after its shutdown timeout")
	}
	c2, err := client.Dial(sock) // a new connection, as an engine starting now makes
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	hctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if ok, err := c2.Healthy(hctx); !ok {
		t.Fatalf("the new daemon cannot be reached after the old one exited: %v", err)
	}
}

func freePort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// built is the daemon binary, built once for the package's tests.
var built struct {
	once sync.Once
	dir  string
	bin  string
	out  []byte
	err  error
}

func TestMain(m *testing.M) {
	testenv.RunHelperIfAsked() // clients running as another user
	code := m.Run()
	testenv.RemoveHelperBinary()
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// buildDaemon builds the daemon once; KVOFFLOADD_TEST_BIN names another
// binary to test instead (an older build, to see a test fail against it).
func buildDaemon(t *testing.T) string {
	t.Helper()
	if bin := os.Getenv("KVOFFLOADD_TEST_BIN"); bin != "" {
		return bin
	}
	built.once.Do(func() {
		if built.dir, built.err = os.MkdirTemp("", "kvoffloadd-bin"); built.err != nil {
			return
		}
		built.bin = filepath.Join(built.dir, "kvoffloadd")
		built.out, built.err = exec.Command("go", "build", "-o", built.bin, ".").CombinedOutput()
	})
	if built.err != nil {
		t.Fatalf("go build: %v\n%s", built.err, built.out)
	}
	return built.bin
}

// waitHealthy waits until the daemon answers healthy; a daemon that exits
// first fails the test with its exit status and its log.
func waitHealthy(t *testing.T, c *client.Client, proc *exec.Cmd, exited <-chan struct{}, logs fmt.Stringer) {
	t.Helper()
	if err := daemonHealthy(c, proc, exited, logs); err != nil {
		t.Fatal(err)
	}
}

// daemonHealthy waits up to 30s for the daemon to answer healthy. exited
// is closed once proc.Wait has returned: only then are proc.ProcessState
// and the log (written by Wait's copier) read, so that a daemon that
// cannot start is reported by its own words, not by a data race.
func daemonHealthy(c *client.Client, proc *exec.Cmd, exited <-chan struct{}, logs fmt.Stringer) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		ok, _ := c.Healthy(ctx)
		cancel()
		if ok {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("daemon exited before it was healthy (%v); its log:\n%s", proc.ProcessState, logs)
		default:
		}
		if time.Now().After(deadline) {
			return errors.New("daemon did not become healthy in 30s (its log follows when the test ends)")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestStartFailureReportsCause: a daemon that cannot start is reported by
// its exit status and its own error message (issue 30, 8).
func TestStartFailureReportsCause(t *testing.T) {
	bin := buildDaemon(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	logs := &syncBuffer{}
	proc := exec.Command(bin, "--socket", sock, "--metrics-addr", "", "--disk-dir", t.TempDir(), "--disk-bytes", "1MiB")
	proc.Stderr = logs
	if err := proc.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { proc.Wait(); close(exited) }()
	t.Cleanup(func() { proc.Process.Kill(); <-exited })
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	err = daemonHealthy(c, proc, exited, logs)
	if err == nil || !strings.Contains(err.Error(), "exit status 1") || !strings.Contains(err.Error(), "--disk-bytes 1MiB: want at least 16MiB") {
		t.Fatalf("a daemon that cannot start: %v; want its exit status and its error", err)
	}
}

// TestSIGTERMDuringLoad runs the real binary, stores blocks, starts a large
// load and sends SIGTERM while it runs: the load either completes with every
// byte right, or is refused whole; the daemon exits 0 and removes its socket.
func TestSIGTERMDuringLoad(t *testing.T) {
	bin := buildDaemon(t)
	sock := filepath.Join(t.TempDir(), "kv.sock")
	metrics := freePort(t)
	proc := exec.Command(bin, "--socket", sock, "--cpu-bytes", "256MiB", "--metrics-addr", metrics)
	d := runWatched(t, proc)
	logs, exited := d.logs, d.exited
	c := d.dial(t, sock)
	defer c.Close()

	m := testenv.Model{Layers: 32, SegBytes: 64 << 10, Blocks: 96} // 2 MiB blocks
	r := testenv.NewRegion(t, m.RegionBytes())
	ctx := context.Background()
	reg, err := c.Register(ctx, []byte("sigterm"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	const n = 48
	hs := make([][]byte, n)
	blocks := make([]uint32, n)
	for i := range hs {
		hs[i] = m.Hash(1, i)
		blocks[i] = uint32(i)
		m.Fill(r, i, hs[i])
	}
	res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(1, hs, blocks)}, true)
	if err != nil || !res[0].Ok {
		t.Fatalf("store: %v %v", res, err)
	}
	body := scrape(t, metrics)
	for _, want := range []string{`kvoffload_blocks_total{op="store",status="ok"} 48`, `kvoffload_tier_blocks{tier="cpu"} 48`, "kvoffload_job_duration_seconds_bucket"} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	// The arena is backed in the background; the gauge ends at the tier's
	// capacity (what kvbench waits for before its steps).
	capacity := regexp.MustCompile(`(?m)^kvoffload_tier_capacity_bytes\{tier="cpu"\} (\S+)$`).FindStringSubmatch(body)
	if capacity == nil {
		t.Fatalf("no CPU tier capacity in the metrics")
	}
	backed := regexp.MustCompile(`(?m)^kvoffload_cpu_arena_backed_bytes (\S+)$`)
	for deadline := time.Now().Add(60 * time.Second); ; {
		got := backed.FindStringSubmatch(scrape(t, metrics))
		if got == nil {
			t.Fatal("metrics lack kvoffload_cpu_arena_backed_bytes")
		}
		if got[1] == capacity[1] {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("arena backed bytes %s after 60s, capacity %s", got[1], capacity[1])
		}
		time.Sleep(20 * time.Millisecond)
	}

	into := make([]uint32, n)
	for i := range into {
		into[i] = uint32(n + i)
	}
	type outcome struct {
		res []*pb.JobResult
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		r, err := c.Load(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(2, hs, into)}, true)
		done <- outcome{r, err}
	}()
	time.Sleep(time.Millisecond) // let the load start; either order must be safe
	if err := proc.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	o := <-done
	switch {
	case o.err == nil:
		if !o.res[0].Ok {
			t.Fatalf("load during shutdown: %+v", o.res[0])
		}
		for i, b := range into {
			if err := m.Check(r, int(b), hs[i]); err != nil {
				t.Fatalf("load reported OK during shutdown: %v", err)
			}
		}
	case status.Code(o.err) == codes.Unavailable:
		t.Logf("load refused whole during shutdown: %v", o.err)
	default:
		t.Fatalf("load during shutdown: %v", o.err)
	}
	select {
	case <-exited:
		if d.err != nil {
			t.Fatalf("daemon exit: %v", d.err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("daemon did not exit after SIGTERM")
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Fatalf("socket left behind: %v", err)
	}
	if !strings.Contains(logs.String(), "shutting down") || !strings.Contains(logs.String(), "stopped") {
		t.Fatalf("shutdown not logged:\n%s", logs.String())
	}
}

func scrape(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get(fmt.Sprintf("http://%s/metrics", addr))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// storeOne registers m over a new region as fingerprint and stores one
// block (hash m.Hash(seed, 0), from engine block 0), waiting for it.
func storeOne(t *testing.T, c *client.Client, m testenv.Model, fingerprint string, seed uint64) (*pb.RegisterResponse, *testenv.Region, []byte) {
	t.Helper()
	ctx := context.Background()
	r := testenv.NewRegion(t, m.RegionBytes())
	reg, err := c.Register(ctx, []byte(fingerprint), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	h := m.Hash(seed, 0)
	m.Fill(r, 0, h)
	if res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(1, [][]byte{h}, []uint32{0})}, true); err != nil || !res[0].Ok {
		t.Fatalf("store: %v %v", res, err)
	}
	return reg, r, h
}

// startDaemon runs the binary until the test ends (or it is killed).
func startDaemon(t *testing.T, bin string, args ...string) (*exec.Cmd, *client.Client, chan struct{}) {
	t.Helper()
	proc := exec.Command(bin, args...)
	d := runWatched(t, proc)
	c := d.dial(t, args[1])
	t.Cleanup(func() { c.Close() })
	return proc, c, d.exited
}

// watched is a daemon process a test runs: its log, and exited, closed
// once Wait has returned (err is Wait's error from then on).
type watched struct {
	proc   *exec.Cmd
	logs   *syncBuffer
	exited chan struct{}
	err    error
}

// runWatched starts proc with its stderr in a log, and kills it when the
// test ends (printing the log if the test failed).
func runWatched(t *testing.T, proc *exec.Cmd) *watched {
	t.Helper()
	d := &watched{proc: proc, logs: &syncBuffer{}, exited: make(chan struct{})}
	proc.Stderr = d.logs
	if err := proc.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.err = proc.Wait(); close(d.exited) }()
	t.Cleanup(func() {
		proc.Process.Kill()
		<-d.exited
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.logs.String())
		}
	})
	return d
}

// dial connects to the daemon's socket and waits for it to be healthy;
// the caller closes the client.
func (d *watched) dial(t *testing.T, sock string) *client.Client {
	t.Helper()
	c, err := client.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	waitHealthy(t, c, d.proc, d.exited, d.logs)
	return c
}

// TestKill9DuringWrites kills the daemon with SIGKILL in the middle of a
// write-heavy run, restarts it on the same disk, and loads every block it
// offers: each must be byte-exact (no torn or stale slot is ever served).
func TestKill9DuringWrites(t *testing.T) {
	bin := buildDaemon(t)
	dir := t.TempDir()
	sock := filepath.Join(t.TempDir(), "kv.sock")
	args := []string{"--socket", sock, "--metrics-addr", "", "--cpu-bytes", "8MiB", "--cpu-chunk-bytes", "4MiB",
		"--disk-dir", dir, "--disk-bytes", "64MiB", "--disk-chunk-bytes", "4MiB", "--write-through"}
	proc, c, exited := startDaemon(t, bin, args...)

	m := testenv.Model{Layers: 4, SegBytes: 64 << 10, Blocks: 64}
	r := testenv.NewRegion(t, m.RegionBytes())
	ctx := context.Background()
	reg, err := c.Register(ctx, []byte("kill9"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	const steps = 400
	var hs [][]byte
	for i := 0; i < steps*4; i++ {
		hs = append(hs, m.Hash(9, i))
	}
	killed := make(chan struct{})
	go func() {
		// Kill once a good part of the run is on disk, however long a
		// loaded machine takes to get there: a kill after a fixed number
		// of polls could come before any block landed (issue 26). The
		// deadline is a hang guard; the checks below then fail.
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); {
			st, err := c.Stats(ctx)
			if err == nil && len(st.Tiers) == 2 && st.Tiers[1].Blocks >= 60 {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		proc.Process.Signal(syscall.SIGKILL)
		close(killed)
	}()
	for step := 0; step < steps; step++ {
		part := hs[step*4 : step*4+4]
		blocks := []uint32{0, 1, 2, 3}
		for i, h := range part {
			m.Fill(r, int(blocks[i]), h)
		}
		// Waiting keeps the engine blocks unchanged until the store has
		// copied them, as an engine must; the disk writes run behind.
		if _, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(uint64(step), part, blocks)}, true); err != nil {
			break // the daemon is gone
		}
	}
	<-killed
	<-exited

	os.Remove(sock) // a stale socket, as a killed daemon leaves
	_, c2, _ := startDaemon(t, bin, args...)
	waitRecovered(t, c2) // it serves at once; the disk's blocks come online behind
	reg2, err := c2.Register(ctx, []byte("kill9"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	recovered, loaded := 0, 0
	for i, h := range hs {
		lr, err := c2.Lookup(ctx, []uint32{reg2.NamespaceId}, testenv.Keys(h), 0)
		if err != nil {
			t.Fatal(err)
		}
		if lr.Ready == 0 {
			continue
		}
		recovered++
		clear(m.Segment(r, 0, 10))
		res, err := c2.Load(ctx, reg2.RegistrationId, []*pb.Job{testenv.Job(uint64(10000+i), [][]byte{h}, []uint32{10})}, true)
		if err != nil {
			t.Fatal(err)
		}
		if !res[0].Ok {
			t.Fatalf("block %d offered after the restart failed to load: %+v", i, res[0].Failures)
		}
		if err := m.Check(r, 10, h); err != nil {
			t.Fatalf("block %d after kill -9: %v", i, err)
		}
		loaded++
	}
	if recovered == 0 {
		t.Fatal("nothing came back after kill -9 (the run never reached the disk?)")
	}
	t.Logf("%d blocks recovered and loaded byte-exact after kill -9", loaded)
}

// The daemon keeps a Go processor free of copy workers, unless the
// operator chose GOMAXPROCS.
func TestSetProcs(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	t.Setenv("GOMAXPROCS", "")
	runtime.GOMAXPROCS(1)
	if got := setProcs(2); got != 3 {
		t.Errorf("1 processor, 2 workers: GOMAXPROCS %d, want 3", got)
	}
	runtime.GOMAXPROCS(8)
	if got := setProcs(2); got != 8 {
		t.Errorf("8 processors, 2 workers: GOMAXPROCS %d, want 8 kept", got)
	}
	t.Setenv("GOMAXPROCS", "1")
	runtime.GOMAXPROCS(1)
	if got := setProcs(4); got != 1 {
		t.Errorf("GOMAXPROCS=1 in the environment: %d, want 1 kept", got)
	}
}
