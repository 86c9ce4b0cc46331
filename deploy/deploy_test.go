package deploy

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// bins holds the daemon and the health probe, built once for every test.
var bins struct {
	dir    string
	daemon string
	health string
}

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "kvo-deploy-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bins.dir = dir
	bins.daemon = filepath.Join(dir, "kvoffloadd")
	bins.health = filepath.Join(dir, "kvoffload-health")
	for bin, pkg := range map[string]string{bins.daemon: "./cmd/kvoffloadd", bins.health: "./cmd/kvoffload-health"} {
		cmd := exec.Command("go", "build", "-o", bin, pkg)
		cmd.Dir = ".."
		if out, err := cmd.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "go build %s: %v\n%s", pkg, err, out)
			os.RemoveAll(dir)
			os.Exit(1)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// pathFlags are the daemon's flags that name a file or directory of the
// host the daemon runs on.
var pathFlags = map[string]bool{"socket": true, "disk-dir": true, "shm-dir": true}

// flagValue returns the last value of --name in args (the one the daemon
// keeps), and whether it was there.
func flagValue(args []string, name string) (string, bool) {
	val, found := "", false
	for i := 0; i < len(args); i++ {
		n, v, hasValue := splitFlag(args[i])
		if n != name {
			continue
		}
		if !hasValue && i+1 < len(args) {
			v = args[i+1]
			i++
		}
		val, found = v, true
	}
	return val, found
}

// splitFlag splits "--name=value" or "-name" into its parts.
func splitFlag(arg string) (name, value string, hasValue bool) {
	if !strings.HasPrefix(arg, "-") {
		return "", "", false
	}
	name = strings.TrimLeft(arg, "-")
	name, value, hasValue = strings.Cut(name, "=")
	return name, value, hasValue
}

// hostArgs returns the daemon's args as they would run here: each path
// flag's value moved under root (its directory made there), the flags in set
// given those values instead (added when absent), every flag as --name=value.
func hostArgs(t *testing.T, what string, args []string, root string, set map[string]string) []string {
	t.Helper()
	boolFlags := daemonBoolFlags(t)
	var out []string
	seen := map[string]bool{}
	for i := 0; i < len(args); i++ {
		name, value, hasValue := splitFlag(args[i])
		if name == "" {
			t.Fatalf("%s: %q is not a flag (the daemon takes flags only)", what, args[i])
		}
		if boolFlags[name] {
			out = append(out, args[i])
			continue
		}
		if !hasValue {
			if i+1 >= len(args) {
				t.Fatalf("%s: --%s has no value", what, name)
			}
			i++
			value = args[i]
		}
		if v, ok := set[name]; ok {
			value, seen[name] = v, true
		} else if name == "cpu-arena-dir" {
			// On tmpfs, as the daemon requires of it.
			value = filepath.Join(shmArenaDir(t), value)
		} else if pathFlags[name] {
			if !filepath.IsAbs(value) {
				t.Fatalf("%s: --%s %q is not an absolute path", what, name, value)
			}
			p := filepath.Join(root, value)
			dir := p
			if name == "socket" {
				dir = filepath.Dir(filepath.Dir(p)) // the daemon makes the socket's own directory
			}
			if err := os.MkdirAll(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			value = p
		}
		out = append(out, "--"+name+"="+value)
	}
	for name, v := range set {
		if !seen[name] {
			out = append(out, "--"+name+"="+v)
		}
	}
	return out
}

// checkDaemonArgs runs the real daemon's flag validation over args, as
// deployed (paths moved under a temp root): --version makes the daemon stop
// once every flag is validated. A flag the daemon does not know, or a value
// it refuses, fails the test.
func checkDaemonArgs(t *testing.T, what string, args []string) {
	t.Helper()
	moved := hostArgs(t, what, args, t.TempDir(), nil)
	var out bytes.Buffer
	cmd := exec.Command(bins.daemon, append(moved, "--version")...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil || !strings.HasPrefix(out.String(), "kvoffloadd ") {
		t.Fatalf("%s: the daemon refuses its flags %q: %v\n%s", what, args, err, out.String())
	}
}

// daemon is a kvoffloadd process run by a test.
type daemon struct {
	cmd    *exec.Cmd
	logs   *syncBuffer
	exited chan struct{}
	err    error // of Wait, once exited is closed
}

// startDaemon runs the daemon with args until the test ends.
func startDaemon(t *testing.T, args []string) *daemon {
	t.Helper()
	d := &daemon{cmd: exec.Command(bins.daemon, args...), logs: &syncBuffer{}, exited: make(chan struct{})}
	d.cmd.Stdout, d.cmd.Stderr = d.logs, d.logs
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.err = d.cmd.Wait(); close(d.exited) }()
	t.Cleanup(func() {
		d.cmd.Process.Kill()
		<-d.exited
		if t.Failed() {
			t.Logf("daemon %q log:\n%s", args, d.logs.String())
		}
	})
	return d
}

// stop sends SIGTERM, waits for the daemon to exit and returns its exit
// error.
func (d *daemon) stop(t *testing.T) error {
	t.Helper()
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-d.exited:
	case <-time.After(2 * time.Minute):
		t.Fatal("daemon did not exit within 2 minutes of SIGTERM")
	}
	return d.err
}

// health runs kvoffload-health with args and returns its exit status.
func health(t *testing.T, args ...string) (int, string) {
	t.Helper()
	out, err := exec.Command(bins.health, args...).CombinedOutput()
	var ee *exec.ExitError
	switch {
	case err == nil:
		return 0, string(out)
	case errors.As(err, &ee):
		return ee.ExitCode(), string(out)
	}
	t.Fatalf("kvoffload-health: %v", err)
	return 0, ""
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// freePort returns a TCP port nobody listened on a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// daemonBoolFlags are the daemon's flags that take no value: in --help, the
// flag package prints them without a type name.
func daemonBoolFlags(t *testing.T) map[string]bool {
	t.Helper()
	out, err := exec.Command(bins.daemon, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("kvoffloadd --help: %v\n%s", err, out)
	}
	flags := map[string]bool{}
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 1 && strings.HasPrefix(line, "  -") {
			flags[strings.TrimPrefix(f[0], "-")] = true
		}
	}
	if !flags["version"] {
		t.Fatalf("no boolean flags found in kvoffloadd --help:\n%s", out)
	}
	return flags
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func runtimeArch() string { return runtime.GOARCH }
