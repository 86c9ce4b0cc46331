package main

// The daemon binary against what a supervisor, a dying terminal and a
// hostile client do to a process: signals, a connection that never
// finishes its handshake, a closed stderr, a storm of large requests.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/offload"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/rpc/server"
)

// daemonProc is the binary running under a test.
type daemonProc struct {
	proc   *exec.Cmd
	sock   string
	logs   *syncBuffer
	exited chan struct{}
	err    error // Wait's, once exited is closed
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// runDaemon starts bin on a fresh socket with args; stderr goes to the
// returned log unless stderr is given.
func runDaemon(t *testing.T, bin string, stderr io.Writer, args ...string) *daemonProc {
	t.Helper()
	d := &daemonProc{sock: filepath.Join(t.TempDir(), "kv.sock"), logs: &syncBuffer{}, exited: make(chan struct{})}
	d.proc = exec.Command(bin, append([]string{"--socket", d.sock, "--metrics-addr", "", "--cpu-bytes", "8MiB"}, args...)...)
	d.proc.Stderr = d.logs
	if stderr != nil {
		d.proc.Stderr = stderr
	}
	if err := d.proc.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.err = d.proc.Wait(); close(d.exited) }()
	t.Cleanup(func() {
		d.proc.Process.Kill()
		<-d.exited
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.logs.String())
		}
	})
	c := d.client(t)
	waitHealthy(t, c, d.proc, d.exited, d.logs)
	return d
}

func (d *daemonProc) client(t *testing.T, opts ...grpc.DialOption) *client.Client {
	t.Helper()
	c, err := client.Dial(d.sock, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// waitExit waits for the daemon to exit, at most limit.
func (d *daemonProc) waitExit(t *testing.T, limit time.Duration, what string) {
	t.Helper()
	select {
	case <-d.exited:
	case <-time.After(limit):
		t.Fatalf("the daemon did not exit within %s of %s", limit, what)
	}
}

// TestStuckHandshakeDoesNotHoldShutdown: a client that connects and never
// sends the HTTP/2 preface used to keep the daemon alive for grpc's 120 s
// handshake timeout after SIGTERM. Now the shutdown closes it: the daemon
// exits within --shutdown-timeout (well before even the 10 s handshake
// timeout), cleanly, its socket removed.
func TestStuckHandshakeDoesNotHoldShutdown(t *testing.T) {
	d := runDaemon(t, buildDaemon(t), nil, "--shutdown-timeout", "1s")
	stuck, err := net.Dial("unix", d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer stuck.Close()
	if err := d.proc.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	d.waitExit(t, server.HandshakeTimeout-2*time.Second, "SIGTERM with a handshake outstanding")
	if d.err != nil {
		t.Fatalf("exit: %v", d.err)
	}
	if _, err := os.Stat(d.sock); !os.IsNotExist(err) {
		t.Fatalf("socket left behind: %v", err)
	}
}

// TestSIGHUPDrainsAndExits: SIGHUP (a terminal hanging up, a supervisor's
// stop) is a clean stop like SIGTERM: the drain runs, exit status 0, the
// socket removed. It used to kill the daemon on the spot.
func TestSIGHUPDrainsAndExits(t *testing.T) {
	d := runDaemon(t, buildDaemon(t), nil)
	c := d.client(t)
	m := testenv.Model{Layers: 2, SegBytes: 16 << 10, Blocks: 8}
	r := testenv.NewRegion(t, m.RegionBytes())
	reg, err := c.Register(context.Background(), []byte("hup"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	m.Fill(r, 0, m.Hash(1, 0))
	if res, err := c.Store(context.Background(), reg.RegistrationId, []*pb.Job{testenv.Job(1, [][]byte{m.Hash(1, 0)}, []uint32{0})}, true); err != nil || !res[0].Ok {
		t.Fatalf("store: %v %v", res, err)
	}
	if err := d.proc.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	d.waitExit(t, 60*time.Second, "SIGHUP")
	if d.err != nil {
		t.Fatalf("exit after SIGHUP: %v", d.err)
	}
	if _, err := os.Stat(d.sock); !os.IsNotExist(err) {
		t.Fatalf("socket left behind: %v", err)
	}
	if logs := d.logs.String(); !strings.Contains(logs, "shutting down") || !strings.Contains(logs, "stopped") {
		t.Fatalf("no drain logged:\n%s", logs)
	}
}

// TestClosedStderrDoesNotKillTheDaemon: when whatever reads the daemon's
// stderr goes away (journald restarted, the terminal closed), the next log
// line used to kill it with SIGPIPE. It serves on.
func TestClosedStderrDoesNotKillTheDaemon(t *testing.T) {
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pw.Close()
	// Read until the daemon serves, then close the reading end.
	serving := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			if strings.Contains(sc.Text(), "kvoffloadd serving") {
				break
			}
		}
		pr.Close()
		close(serving)
	}()
	d := runDaemon(t, buildDaemon(t), pw)
	pw.Close()
	<-serving
	c := d.client(t)
	m := testenv.Model{Layers: 1, SegBytes: 4096, Blocks: 4}
	for i := 0; i < 3; i++ { // each Register logs a line
		r := testenv.NewRegion(t, m.RegionBytes())
		if _, err := c.Register(context.Background(), []byte(fmt.Sprint("pipe-", i)), m.Layout(), m.Regions(r), "test"); err != nil {
			t.Fatalf("register %d after stderr closed: %v", i, err)
		}
	}
	if ok, err := c.Healthy(context.Background()); !ok || err != nil {
		t.Fatalf("health after stderr closed: %v %v", ok, err)
	}
	select {
	case <-d.exited:
		t.Fatalf("the daemon died: %v", d.err)
	default:
	}
}

// peakRSS reads a process's peak resident set (VmHWM).
func peakRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "VmHWM:" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmHWM")
	return 0
}

// TestLargeRequestsDoNotGrowTheDaemon: 8 Lookups of 16 MB at once used to
// be read and decoded whole before being refused, and raised the daemon's
// memory by 340 MB. Now a request over the computed limit is refused from
// its header, and requests under it are received a budget's worth at a
// time: 8 oversized and 32 near-limit requests, concurrent over several
// connections, leave the daemon's peak memory within a few requests' size.
func TestLargeRequestsDoNotGrowTheDaemon(t *testing.T) {
	limit := server.MaxRequestBytes(offload.DefaultLimits)
	bin := buildDaemon(t)
	// A budget of one request: the strictest the daemon allows. (An
	// older binary under KVOFFLOADD_TEST_BIN has no such flag.)
	var args []string
	if help, _ := exec.Command(bin, "--help").CombinedOutput(); bytes.Contains(help, []byte("-max-inflight-request-bytes")) {
		args = []string{"--max-inflight-request-bytes", strconv.Itoa(limit)}
	}
	d := runDaemon(t, bin, nil, args...)
	conns := make([]*client.Client, 6)
	for i := range conns {
		conns[i] = d.client(t, grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20)))
		if ok, err := conns[i].Healthy(context.Background()); !ok || err != nil {
			t.Fatal(ok, err)
		}
	}
	before := peakRSS(t, d.proc.Process.Pid)
	calls := func(n, size int) map[codes.Code]int {
		var mu sync.Mutex
		got := map[codes.Code]int{}
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func(c *client.Client) {
				defer wg.Done()
				_, err := c.Lookup(context.Background(), []uint32{1}, &pb.KeyList{Hashes: make([]byte, size)}, 0)
				mu.Lock()
				got[status.Code(err)]++
				mu.Unlock()
			}(conns[i%len(conns)])
		}
		wg.Wait()
		return got
	}
	if got := calls(8, 16_000_000); got[codes.ResourceExhausted] != 8 {
		t.Errorf("8 Lookups of 16 MB: %v, want all RESOURCE_EXHAUSTED", got)
	}
	if grew := peakRSS(t, d.proc.Process.Pid) - before; grew > 96<<20 {
		t.Fatalf("peak RSS grew by %d MiB refusing 8 Lookups of 16 MB, want under 96 MiB", grew>>20)
	}
	// Just under the limit: read, decoded, then refused (no namespace 1).
	if got := calls(32, limit-1024); got[codes.InvalidArgument] != 32 {
		t.Fatalf("32 Lookups of %d bytes: %v, want all read and refused as INVALID_ARGUMENT", limit-1024, got)
	}
	grew := peakRSS(t, d.proc.Process.Pid) - before
	t.Logf("peak RSS grew by %d MiB (request limit %d bytes)", grew>>20, limit)
	if grew > 96<<20 {
		t.Fatalf("peak RSS grew by %d MiB receiving refused requests, want under 96 MiB", grew>>20)
	}
	if ok, err := conns[0].Healthy(context.Background()); !ok || err != nil {
		t.Fatalf("health after the storm: %v %v", ok, err)
	}
}

// TestShutdownTimeoutIsAPromise: with a copy that never drains, shutdown
// still returns by its timeout (errAbandoned) instead of waiting for it,
// and with nothing running it returns cleanly.
func TestShutdownTimeoutIsAPromise(t *testing.T) {
	gate := testenv.NewGate()
	d := testenv.Start(t, testenv.Options{Wrap: gate.Wrap, Quiet: true})
	c := d.Client(t)
	m := testenv.Model{Layers: 1, SegBytes: 4096, Blocks: 4}
	r := testenv.NewRegion(t, m.RegionBytes())
	reg, err := c.Register(context.Background(), []byte("stuck"), m.Layout(), m.Regions(r), "test")
	if err != nil {
		t.Fatal(err)
	}
	gate.Hold()
	if _, err := c.Store(context.Background(), reg.RegistrationId, []*pb.Job{testenv.Job(1, [][]byte{m.Hash(1, 0)}, []uint32{0})}, false); err != nil {
		t.Fatal(err)
	}
	gate.Arrived(1)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	err = shutdown(log, 300*time.Millisecond, 2*time.Second, d.Srv, d.Svc, func() error { return d.Svc.Close() })
	// Returned while the copy is still held: it did not wait for it.
	if !errors.Is(err, errAbandoned) {
		t.Fatalf("shutdown with a copy held: %v, want errAbandoned", err)
	}
	gate.Release()

	d2 := testenv.Start(t, testenv.Options{Quiet: true})
	if err := shutdown(log, 5*time.Second, 2*time.Second, d2.Srv, d2.Svc, func() error { return nil }); err != nil {
		t.Fatalf("shutdown with nothing running: %v", err)
	}
}

// TestUnprivilegedDaemonMapsOnlyItsOwnUsersFiles: a daemon without
// CAP_SETUID/CAP_SETGID cannot open a file as its client, so it maps
// regions only for clients of its own uid; another user of the socket's
// group is refused, even for a file that user may open.
func TestUnprivilegedDaemonMapsOnlyItsOwnUsersFiles(t *testing.T) {
	testenv.NeedRoot(t)
	bin := buildDaemon(t)
	// The binary, where the daemon's user may run it.
	if err := os.Chmod(filepath.Dir(bin), 0o755); err != nil {
		t.Fatal(err)
	}
	daemonUser := testenv.Cred{UID: 65534, GID: testenv.SocketGroup}
	other := testenv.Cred{UID: 65533, GID: 65533, Groups: []uint32{testenv.SocketGroup}}
	dir, err := os.MkdirTemp("", "kvo-unpriv")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chown(dir, int(daemonUser.UID), testenv.SocketGroup); err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o750)
	sock := filepath.Join(dir, "kv.sock")
	proc := exec.Command(bin, "--socket", sock, "--socket-mode", "0660", "--metrics-addr", "", "--cpu-bytes", "8MiB")
	proc.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: daemonUser.UID, Gid: daemonUser.GID}}
	c := runWatched(t, proc).dial(t, sock)
	defer c.Close()

	m := testenv.Model{Layers: 1, SegBytes: 4096, Blocks: 4}
	for _, tc := range []struct {
		who  testenv.Cred
		want codes.Code
	}{{daemonUser, codes.OK}, {other, codes.InvalidArgument}} {
		path := fmt.Sprintf("/dev/shm/kvo-unpriv-%d-%d", os.Getpid(), tc.who.UID)
		h := testenv.StartAs(t, sock, tc.who)
		h.Do(testenv.Cmd{Op: "mkfile", Path: path, Size: int64(m.RegionBytes()), Mode: 0o666})
		t.Cleanup(func() { os.Remove(path) })
		rep := h.Do(testenv.Cmd{Op: "register", Path: path, Model: m, Fingerprint: fmt.Sprint("unpriv-", tc.who.UID)})
		if rep.Code != tc.want || (tc.want != codes.OK && !strings.Contains(rep.Msg, "without CAP_SETUID")) {
			t.Errorf("uid %d registering its own file: %v %q, want %v", tc.who.UID, rep.Code, rep.Msg, tc.want)
		}
	}
}
