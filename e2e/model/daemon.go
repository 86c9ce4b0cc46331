package model

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"github.com/kvoffloadd/kvoffloadd/bench/daemon"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
)

// Proc is the real kvoffloadd binary, started and stopped by the runner:
// its socket, its metrics address, and one log file per incarnation.
type Proc struct {
	Binary   string
	Dir      string   // private: the socket and the logs
	DiskDir  string   // holds the disk tier's directories, kept across restarts
	DiskDirs []string // one --disk-dir each
	ArenaDir string   // --cpu-arena-dir, kept across restarts; empty: none

	Socket      string
	MetricsAddr string
	LogPath     string
	Incarnation int
	// Debug: the binary serves /debug/check (--debug-checks).
	Debug bool
	// Linger: it takes --namespace-linger.
	Linger bool
	// HoldCPU: with a persistent arena, each incarnation starts with its
	// recovery held (--debug-hold-cpu-recovery) and the runner lets it go
	// on a chunk or two per operation (LetRecovery), so Invalidates,
	// restarts and kills land while blocks are still unfiled.
	HoldCPU bool

	cmd     *exec.Cmd
	exited  chan struct{}
	waitErr error
	faults  string // the current incarnation's --fault-spec
}

// NewProc prepares a daemon in fresh directories under dir.
func NewProc(binary, dir string, diskDirs int) (*Proc, error) {
	flags, err := daemon.Flags(binary)
	if err != nil {
		return nil, err
	}
	p := &Proc{Binary: binary, Dir: dir, Socket: filepath.Join(dir, "kvoffloadd.sock"), Debug: flags["debug-checks"], Linger: flags["namespace-linger"]}
	p.HoldCPU = p.Debug && flags["debug-hold-cpu-recovery"]
	if len(p.Socket) > 107 {
		return nil, fmt.Errorf("socket path %s is too long for a unix socket", p.Socket)
	}
	if diskDirs > 0 {
		p.DiskDir = filepath.Join(dir, "disk")
		for i := 0; i < diskDirs; i++ {
			d := filepath.Join(p.DiskDir, strconv.Itoa(i))
			if err := os.MkdirAll(d, 0o700); err != nil {
				return nil, err
			}
			p.DiskDirs = append(p.DiskDirs, d)
		}
	}
	return p, nil
}

// Start runs a new incarnation of the daemon and waits until it serves.
func (p *Proc) Start(sh Shape, faults string, reset bool) error {
	var last error
	for try := 0; try < 3; try++ {
		// A port found free can be taken by another test before the
		// daemon binds it: try another.
		if last = p.start(sh, faults, reset); last == nil || !strings.Contains(last.Error(), "address already in use") {
			return last
		}
	}
	return last
}

func (p *Proc) start(sh Shape, faults string, reset bool) error {
	port, err := daemon.FreePort()
	if err != nil {
		return err
	}
	p.Incarnation++
	p.faults = ""
	if sh.Disk() {
		p.faults = faults
	}
	p.MetricsAddr = "127.0.0.1:" + strconv.Itoa(port)
	p.LogPath = filepath.Join(p.Dir, fmt.Sprintf("kvoffloadd-%d.log", p.Incarnation))
	args := []string{
		"--socket", p.Socket,
		"--metrics-addr", p.MetricsAddr,
		"--cpu-bytes", strconv.FormatUint(sh.CPUBytes, 10),
		"--cpu-chunk-bytes", strconv.FormatUint(sh.CPUChunk, 10),
		"--io-workers", strconv.Itoa(sh.IOWorkers),
		"--log-level", logLevel(),
		"--shutdown-timeout", "20s",
	}
	if p.Debug {
		args = append(args, "--debug-checks")
	}
	if p.ArenaDir != "" {
		args = append(args, "--cpu-arena-dir", p.ArenaDir)
		if p.HoldCPU {
			args = append(args, "--debug-hold-cpu-recovery")
		}
	}
	if p.Linger && sh.Linger > 0 {
		args = append(args, "--namespace-linger", sh.Linger.String())
	}
	if sh.HasRemote() {
		args = append(args, "--remote-redis", strings.Join(sh.Remote, ","), "--remote-timeout", "5s")
	}
	if sh.Disk() {
		for _, d := range p.DiskDirs {
			args = append(args, "--disk-dir", d)
		}
		args = append(args, "--disk-bytes", strconv.FormatUint(sh.DiskBytes, 10),
			"--disk-chunk-bytes", strconv.FormatUint(sh.DiskChunk, 10), "--disk-direct", "fallback")
		if sh.WriteThrough {
			args = append(args, "--write-through")
		}
		if faults != "" {
			args = append(args, "--fault-spec", faults)
		}
		if reset {
			args = append(args, "--disk-reset")
		}
	}
	log, err := os.Create(p.LogPath)
	if err != nil {
		return err
	}
	defer log.Close()
	p.cmd = exec.Command(p.Binary, args...)
	p.cmd.Stdout, p.cmd.Stderr = log, log
	// SIGKILL if the test process dies first: nothing outlives the run.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.Binary, err)
	}
	p.exited = make(chan struct{})
	cmd, exited := p.cmd, p.exited
	go func() {
		p.waitErr = cmd.Wait()
		close(exited)
	}()
	// Dial only once the socket exists: a dial that fails first waits
	// out gRPC's reconnect backoff (a second) before it tries again.
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := os.Stat(p.Socket); err == nil {
			break
		}
		select {
		case <-p.exited:
			return fmt.Errorf("kvoffloadd exited at start (%v): %s", p.waitErr, p.LogTail(2000))
		default:
		}
		if time.Now().After(deadline) {
			p.Kill()
			return fmt.Errorf("kvoffloadd made no socket in 60s: %s", p.LogTail(2000))
		}
		time.Sleep(5 * time.Millisecond)
	}
	// A socket left by a killed incarnation refuses the first dials:
	// retry quickly rather than on gRPC's default one-second backoff.
	c, err := client.Dial(p.Socket, grpc.WithConnectParams(grpc.ConnectParams{
		Backoff: backoff.Config{BaseDelay: 10 * time.Millisecond, Multiplier: 1.5, MaxDelay: 200 * time.Millisecond},
	}))
	if err != nil {
		return err
	}
	defer c.Close()
	for {
		select {
		case <-p.exited:
			return fmt.Errorf("kvoffloadd exited at start (%v): %s", p.waitErr, p.LogTail(2000))
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		ok, _ := c.Healthy(ctx)
		cancel()
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			p.Kill()
			return fmt.Errorf("kvoffloadd not serving after 60s: %s", p.LogTail(2000))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Running reports whether the current incarnation is alive.
func (p *Proc) Running() bool {
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// Exited returns the error of an incarnation that exited on its own, nil
// while it runs.
func (p *Proc) Exited() error {
	if p.cmd == nil || p.Running() {
		return nil
	}
	return fmt.Errorf("kvoffloadd exited unexpectedly (%v): %s", p.waitErr, p.LogTail(3000))
}

// PID of the running incarnation.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// Stop sends SIGTERM; the daemon must exit with status 0 well within its
// shutdown timeout.
func (p *Proc) Stop() error {
	if !p.Running() {
		return p.Exited()
	}
	start := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return err
	}
	select {
	case <-p.exited:
	case <-time.After(60 * time.Second):
		p.Kill()
		return fmt.Errorf("kvoffloadd still running 60s after SIGTERM (shutdown timeout 20s): %s", p.LogTail(3000))
	}
	if p.waitErr != nil {
		tail := p.LogTail(3000)
		if p.faults != "" && strings.Contains(tail[strings.LastIndexByte(tail[:max(0, len(tail)-1)], '\n')+1:], "errorfs: injected") {
			// The fault plan failed the last sync of the slot files:
			// an exit status that says so is right.
			return nil
		}
		return fmt.Errorf("kvoffloadd exit after SIGTERM (%s): %v: %s", time.Since(start).Round(time.Millisecond), p.waitErr, tail)
	}
	if _, err := os.Stat(p.Socket); err == nil {
		return fmt.Errorf("kvoffloadd left its socket %s behind after SIGTERM", p.Socket)
	}
	return nil
}

// Kill sends SIGKILL and waits for the process to go.
func (p *Proc) Kill() {
	if !p.Running() {
		return
	}
	p.cmd.Process.Kill()
	<-p.exited
}

// LogTail is the end of the current incarnation's log.
func (p *Proc) LogTail(n int) string {
	b, _ := os.ReadFile(p.LogPath)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.TrimSpace(string(b))
}

// LogProblems returns the lines of every incarnation's log that no run
// should print: data races (a -race build), panics, fatal runtime errors.
func (p *Proc) LogProblems() []string {
	var out []string
	for i := 1; i <= p.Incarnation; i++ {
		f, err := os.Open(filepath.Join(p.Dir, fmt.Sprintf("kvoffloadd-%d.log", i)))
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			l := sc.Text()
			if strings.Contains(l, "DATA RACE") || strings.HasPrefix(l, "panic:") || strings.HasPrefix(l, "fatal error:") {
				out = append(out, fmt.Sprintf("incarnation %d: %s", i, l))
			}
		}
		f.Close()
	}
	return out
}

var httpc = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 90 * time.Second}

func (p *Proc) get(path string) (int, string, error) {
	resp, err := httpc.Get("http://" + p.MetricsAddr + path)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	return resp.StatusCode, string(b), err
}

// LetRecovery lets a held CPU arena recovery (HoldCPU) verify and file
// chunks more chunks ("all": run to its end). Without a held recovery it
// does nothing.
func (p *Proc) LetRecovery(chunks string) error {
	if p.ArenaDir == "" || !p.HoldCPU {
		return nil
	}
	resp, err := httpc.Post("http://"+p.MetricsAddr+"/debug/cpu-recovery?chunks="+chunks, "text/plain", nil)
	if err != nil {
		return fmt.Errorf("/debug/cpu-recovery: %w", err)
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/debug/cpu-recovery?chunks=%s: status %d: %s", chunks, resp.StatusCode, b)
	}
	return nil
}

// Metrics scrapes /metrics.
func (p *Proc) Metrics() (Metrics, error) {
	code, body, err := p.get("/metrics")
	if err != nil {
		return nil, fmt.Errorf("scrape metrics: %w", err)
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("scrape metrics: status %d", code)
	}
	m, err := daemon.ParseMetrics(strings.NewReader(body))
	return Metrics(m), err
}

// DebugCheck asks a quiet daemon to compare its slot and pin accounting
// with its index (--debug-checks). errNoDebug when the binary has none.
func (p *Proc) DebugCheck(wait time.Duration) error {
	if !p.Debug {
		return errNoDebug
	}
	code, body, err := p.get("/debug/check?wait=" + wait.String())
	if err != nil {
		return err
	}
	if code != http.StatusOK {
		return fmt.Errorf("%s", strings.TrimSpace(body))
	}
	return nil
}

var errNoDebug = errors.New("the daemon binary has no --debug-checks")

// Goroutines dumps the daemon's goroutines, grouped by stack.
func (p *Proc) Goroutines() string {
	if !p.Debug {
		return "(no --debug-checks)"
	}
	_, body, err := p.get("/debug/goroutines?debug=1")
	if err != nil {
		return err.Error()
	}
	return body
}

// Mappings returns the lines of /proc/PID/maps that name path prefix.
func (p *Proc) Mappings(prefix string) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", p.PID()))
	if err != nil {
		return nil, err
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, prefix) {
			out = append(out, l)
		}
	}
	return out, nil
}

// RSS is the daemon's resident set in bytes, from /proc.
func (p *Proc) RSS() uint64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.PID()))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseUint(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}

// Metrics are scraped samples: name with labels as printed, to value.
type Metrics map[string]float64

// Sum adds the samples of name whose labels contain every one of labels.
func (m Metrics) Sum(name string, labels ...string) float64 {
	return daemon.Sum(m, name, labels...)
}

// Losses counts every event that may drop a ready block: evictions of any
// tier and reason, demotions that did not land, loads that failed and so
// dropped their blocks. A block stored while this count stood at n must
// still be offered while it stands at n.
func (m Metrics) Losses() float64 {
	l := m.Sum("kvoffload_evictions_total")
	for _, r := range []string{"rejected", "no_space", "failed", "dropped"} {
		l += m.Sum("kvoffload_disk_demotions_total", `result="`+r+`"`)
	}
	for _, st := range []string{"io_error", "corrupt", "dma_error"} {
		l += m.Sum("kvoffload_blocks_total", `op="load"`, `status="`+st+`"`)
	}
	return l
}

// logLevel is the daemons' --log-level: warn, or $KVMODEL_LOG_LEVEL (debug
// to follow a failing sequence in the kept logs).
func logLevel() string {
	if l := os.Getenv("KVMODEL_LOG_LEVEL"); l != "" {
		return l
	}
	return "warn"
}
