// Package daemon owns the kvoffloadd process that kvbench starts: finding
// the binary, learning which flags it has (the disk tier and fault
// injection arrived after the CPU tier), starting it on a private unix
// socket and a loopback metrics port, reading its metrics, and stopping it
// with SIGTERM, which must end in exit status 0.
package daemon

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvoffloadd/kvoffloadd/rpc/client"
)

// Find returns the daemon binary: path if given, else kvoffloadd next to
// the running executable, else bin/kvoffloadd under the working directory.
func Find(path string) (string, error) {
	if path != "" {
		if _, err := os.Stat(path); err != nil {
			return "", fmt.Errorf("--daemon: %w", err)
		}
		return path, nil
	}
	var tried []string
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), "kvoffloadd")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		tried = append(tried, p)
	}
	if _, err := os.Stat("bin/kvoffloadd"); err == nil {
		return filepath.Abs("bin/kvoffloadd")
	}
	tried = append(tried, "bin/kvoffloadd")
	return "", fmt.Errorf("no kvoffloadd binary (tried %s); build it with `make build` or pass --daemon PATH", strings.Join(tried, ", "))
}

// Flags returns the names of the flags the binary's --help lists.
func Flags(binary string) (map[string]bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, binary, "--help").CombinedOutput()
	if err != nil && ctx.Err() != nil {
		return nil, fmt.Errorf("%s --help: %w", binary, err)
	}
	flags := parseHelp(string(out))
	if len(flags) == 0 {
		return nil, fmt.Errorf("%s --help lists no flags: %s", binary, bytes.TrimSpace(out))
	}
	return flags, nil
}

// parseHelp reads flag names from the flag package's usage text, where
// each flag starts a line indented by spaces ("  -name type") and its
// description follows on lines indented with a tab.
func parseHelp(help string) map[string]bool {
	flags := map[string]bool{}
	for _, line := range strings.Split(help, "\n") {
		t := strings.TrimSpace(line)
		if strings.HasPrefix(t, "-") && strings.HasPrefix(line, " ") && !strings.Contains(line[:len(line)-len(t)], "\t") {
			name, _, _ := strings.Cut(strings.TrimLeft(t, "-"), " ")
			flags[name] = true
		}
	}
	return flags
}

// Version returns what the binary's --version prints.
func Version(binary string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, binary, "--version").Output()
	if err != nil {
		return "unknown"
	}
	return strings.TrimSpace(string(out))
}

// Options configure a daemon.
type Options struct {
	Binary    string
	Dir       string // private directory for the socket and the log
	CPUBytes  uint64
	IOWorkers int
	// Disk tier; DiskDir empty runs the CPU tier only.
	DiskDir   string
	DiskBytes uint64
	FaultSpec string
	// Extra flags, appended as given.
	Extra []string
}

// Daemon is a running kvoffloadd.
type Daemon struct {
	Socket      string
	MetricsAddr string
	Args        []string
	LogPath     string
	cmd         *exec.Cmd
	log         *os.File
	exited      chan struct{}
	waitErr     error
	stopOnce    sync.Once
	stopErr     error
}

// Start runs the daemon and waits until its health service says SERVING.
func Start(ctx context.Context, o Options) (*Daemon, error) {
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	d := &Daemon{
		Socket:      filepath.Join(o.Dir, "kvoffloadd.sock"),
		MetricsAddr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
		LogPath:     filepath.Join(o.Dir, "kvoffloadd.log"),
		exited:      make(chan struct{}),
	}
	d.Args = []string{
		"--socket", d.Socket,
		"--metrics-addr", d.MetricsAddr,
		"--cpu-bytes", strconv.FormatUint(o.CPUBytes, 10),
		"--log-level", "warn",
	}
	if o.IOWorkers > 0 {
		d.Args = append(d.Args, "--io-workers", strconv.Itoa(o.IOWorkers))
	}
	if o.DiskDir != "" {
		d.Args = append(d.Args, "--disk-dir", o.DiskDir, "--disk-bytes", strconv.FormatUint(o.DiskBytes, 10))
	}
	if o.FaultSpec != "" {
		d.Args = append(d.Args, "--fault-spec", o.FaultSpec)
	}
	d.Args = append(d.Args, o.Extra...)
	if d.log, err = os.Create(d.LogPath); err != nil {
		return nil, err
	}
	d.cmd = exec.Command(o.Binary, d.Args...)
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	// Its own process group, so a ^C to kvbench does not reach it before
	// kvbench stops it; and SIGTERM if kvbench dies first.
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := d.cmd.Start(); err != nil {
		d.log.Close()
		return nil, fmt.Errorf("start %s: %w", o.Binary, err)
	}
	go func() {
		d.waitErr = d.cmd.Wait()
		close(d.exited)
	}()
	if err := d.waitServing(ctx); err != nil {
		return nil, errors.Join(err, d.Stop())
	}
	return d, nil
}

func (d *Daemon) waitServing(ctx context.Context) error {
	c, err := client.Dial(d.Socket)
	if err != nil {
		return err
	}
	defer c.Close()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-d.exited:
			return fmt.Errorf("kvoffloadd exited at start (%v): %s", d.waitErr, d.LogTail())
		case <-ctx.Done():
			return ctx.Err()
		default:
		}
		if _, err := os.Stat(d.Socket); err == nil {
			cctx, cancel := context.WithTimeout(ctx, time.Second)
			ok, _ := c.Healthy(cctx)
			cancel()
			if ok {
				return nil
			}
		}
		time.Sleep(5 * time.Millisecond) // kvbench times the start to SERVING
	}
	return fmt.Errorf("kvoffloadd not serving on %s after 60s: %s", d.Socket, d.LogTail())
}

// Stop sends SIGTERM and waits for the exit; anything but status 0 (or no
// exit within two minutes, after which it is killed) is an error.
func (d *Daemon) Stop() error {
	d.stopOnce.Do(func() {
		defer d.log.Close()
		select {
		case <-d.exited:
			d.stopErr = fmt.Errorf("kvoffloadd exited before it was stopped (%v): %s", d.waitErr, d.LogTail())
			return
		default:
		}
		if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			d.stopErr = fmt.Errorf("SIGTERM kvoffloadd: %w", err)
		}
		select {
		case <-d.exited:
		case <-time.After(2 * time.Minute):
			d.cmd.Process.Kill()
			<-d.exited
			d.stopErr = fmt.Errorf("kvoffloadd did not exit within 2m of SIGTERM; killed: %s", d.LogTail())
			return
		}
		if d.waitErr != nil {
			d.stopErr = fmt.Errorf("kvoffloadd exit after SIGTERM: %v: %s", d.waitErr, d.LogTail())
		}
	})
	return d.stopErr
}

// Kill sends SIGKILL and waits for the exit: a crash, for the restart
// scenario.
func (d *Daemon) Kill() {
	d.stopOnce.Do(func() {
		defer d.log.Close()
		d.cmd.Process.Kill()
		<-d.exited
	})
}

// Pid is the daemon's process id.
func (d *Daemon) Pid() int { return d.cmd.Process.Pid }

// LogTail is the end of the daemon's log, for error messages.
func (d *Daemon) LogTail() string {
	b, _ := os.ReadFile(d.LogPath)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return strings.TrimSpace(string(b))
}

// GC has a daemon started with --debug-checks run a garbage collection
// (POST /debug/gc): its heap metrics then say what is live.
func (d *Daemon) GC(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+d.MetricsAddr+"/debug/gc", nil)
	if err != nil {
		return err
	}
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := hc.Do(req)
	if err != nil {
		return fmt.Errorf("debug/gc: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("debug/gc: %s (the daemon needs --debug-checks)", resp.Status)
	}
	return nil
}

// Metrics scrapes the daemon's /metrics: sample name with its labels as
// printed ("kvoffload_blocks_total{op=\"load\",status=\"ok\"}") to value.
func (d *Daemon) Metrics(ctx context.Context) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+d.MetricsAddr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	// No keep-alive: nothing of the scrape outlives the call.
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scrape metrics: %s", resp.Status)
	}
	return ParseMetrics(io.LimitReader(resp.Body, 64<<20))
}

// ParseMetrics reads the Prometheus text format's samples.
func ParseMetrics(r io.Reader) (map[string]float64, error) {
	out := map[string]float64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		out[line[:i]] = v
	}
	return out, sc.Err()
}

// Sum adds the samples of metric name whose labels contain every one of
// labels (each like `kind="read-eio"`).
func Sum(m map[string]float64, name string, labels ...string) float64 {
	var s float64
	for k, v := range m {
		n, rest, _ := strings.Cut(k, "{")
		if n != name {
			continue
		}
		ok := true
		for _, l := range labels {
			ok = ok && strings.Contains(rest, l)
		}
		if ok {
			s += v
		}
	}
	return s
}

// FreePort returns a TCP port free on 127.0.0.1 at the time of the call.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
