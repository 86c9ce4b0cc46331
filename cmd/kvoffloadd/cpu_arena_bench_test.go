package main

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/zeebo/xxh3"
	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/internal/testenv"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
)

// BenchmarkCPUArenaRestart fills a persistent CPU arena of KVO_ARENA_BYTES
// (default 1GiB) with 2 MiB blocks through the real binary, kills the
// daemon with SIGKILL, restarts it on the same --cpu-arena-dir and reports
// the time from exec to SERVING and to the end of the CPU tier's
// recovery (from the daemon's log), beside the time one core takes to
// hash the same payloads straight from the file (the limit of a verifying
// recovery); then checks that every block is offered from the CPU tier
// and a sample loads byte-exact.
//
//	KVO_ARENA_BYTES=4GiB go test -run '^$' -bench CPUArenaRestart -benchtime 1x ./cmd/kvoffloadd
func BenchmarkCPUArenaRestart(b *testing.B) {
	size := uint64(1 << 30)
	if v := os.Getenv("KVO_ARENA_BYTES"); v != "" {
		n, err := parseBytes(v)
		if err != nil {
			b.Fatal(err)
		}
		size = n
	}
	bin := filepath.Join(b.TempDir(), "kvoffloadd")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		b.Fatalf("go build: %v\n%s", err, out)
	}
	dir, err := os.MkdirTemp("/dev/shm", "kvo-arena-bench-")
	if err != nil {
		b.Skip(err)
	}
	defer os.RemoveAll(dir)
	m := testenv.Model{Layers: 2, SegBytes: 1 << 20, Blocks: 32}
	r := testenv.NewRegion(b, m.RegionBytes())
	sock := filepath.Join(b.TempDir(), "kv.sock")
	args := []string{"--socket", sock, "--metrics-addr", "", "--cpu-bytes", strconv.FormatUint(size, 10), "--cpu-arena-dir", dir, "--log-format", "json"}
	ctx := context.Background()
	for range b.N {
		os.RemoveAll(filepath.Join(dir, cpu.ArenaFileName))
		d, c, logPath := benchDaemon(b, bin, args)
		reg, err := c.Register(ctx, []byte("arena-bench"), m.Layout(), m.Regions(r), "bench")
		if err != nil {
			b.Fatal(err)
		}
		n := int(size/(2<<20)) * 9 / 10
		hs := m.Hashes(28, n)
		for i := 0; i < n; i += m.Blocks {
			part := hs[i:min(i+m.Blocks, n)]
			blocks := make([]uint32, len(part))
			for j, h := range part {
				blocks[j] = uint32(j)
				m.Fill(r, j, h)
			}
			if res, err := c.Store(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(uint64(i), part, blocks)}, true); err != nil || !res[0].Ok {
				b.Fatalf("store: %v %v", res, err)
			}
		}
		c.Close()
		d.Process.Signal(syscall.SIGKILL)
		d.Wait()
		os.Remove(sock)

		hashed := hashArenaFile(b, filepath.Join(dir, cpu.ArenaFileName), n)
		t0 := time.Now()
		d, c, logPath = benchDaemon(b, bin, args)
		var serving, recovered time.Time
		for recovered.IsZero() {
			serving, recovered = logTimes(b, logPath)
			time.Sleep(10 * time.Millisecond)
		}
		attached := logTime(b, logPath, "cpu tier: arena in a file that outlives the daemon")
		reg, err = c.Register(ctx, []byte("arena-bench"), m.Layout(), m.Regions(r), "bench")
		if err != nil {
			b.Fatal(err)
		}
		back := 0
		for i := 0; i < n; i += 256 {
			lr, err := c.Lookup(ctx, []uint32{reg.NamespaceId}, testenv.Keys(hs[i:min(i+256, n)]...), 0)
			if err != nil {
				b.Fatal(err)
			}
			back += int(lr.Ready)
		}
		if back != n {
			b.Fatalf("%d of %d blocks back after the restart", back, n)
		}
		for i := 0; i < n; i += n / 8 {
			clear(m.Segment(r, 0, 0))
			if res, err := c.Load(ctx, reg.RegistrationId, []*pb.Job{testenv.Job(uint64(1<<30+i), [][]byte{hs[i]}, []uint32{0})}, true); err != nil || !res[0].Ok {
				b.Fatalf("load: %v %v", res, err)
			}
			if err := m.Check(r, 0, hs[i]); err != nil {
				b.Fatal(err)
			}
		}
		c.Close()
		d.Process.Signal(syscall.SIGTERM)
		d.Wait()
		b.ReportMetric(float64(attached.Sub(t0).Milliseconds()), "ms-to-attached")
		b.ReportMetric(float64(serving.Sub(t0).Milliseconds()), "ms-to-serving")
		b.ReportMetric(float64(recovered.Sub(t0).Milliseconds()), "ms-to-recovered")
		b.ReportMetric(float64(hashed.Milliseconds()), "ms-raw-hash")
		b.ReportMetric(float64(n), "blocks")
	}
}

// benchDaemon starts the binary with its log in a file and waits for SERVING.
func benchDaemon(b *testing.B, bin string, args []string) (*exec.Cmd, *client.Client, string) {
	logPath := filepath.Join(b.TempDir(), "daemon.log")
	lf, err := os.Create(logPath)
	if err != nil {
		b.Fatal(err)
	}
	d := exec.Command(bin, args...)
	d.Stderr = lf
	if err := d.Start(); err != nil {
		b.Fatal(err)
	}
	lf.Close()
	b.Cleanup(func() { d.Process.Kill() })
	c, err := client.Dial(args[1])
	if err != nil {
		b.Fatal(err)
	}
	for {
		if s, _ := logTimes(b, logPath); !s.IsZero() {
			break
		}
		if d.ProcessState != nil {
			b.Fatal("daemon exited")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return d, c, logPath
}

// logTimes reads the times of the daemon's SERVING line and of the end of
// its CPU recovery (zero where not logged yet).
func logTimes(b *testing.B, path string) (serving, recovered time.Time) {
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var line struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &line) != nil {
			continue
		}
		switch line.Msg {
		case "kvoffloadd serving":
			serving = line.Time
		case "cpu tier: blocks recovered from the arena":
			recovered = line.Time
		}
	}
	return serving, recovered
}

// logTime is the time of the daemon's first log line with message msg.
func logTime(b *testing.B, path, msg string) time.Time {
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var line struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == msg {
			return line.Time
		}
	}
	return time.Time{}
}

// hashArenaFile hashes n 2 MiB payloads straight from the arena file on
// one core: what verifying them costs at least.
func hashArenaFile(b *testing.B, path string, n int) time.Duration {
	f, err := os.Open(path)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	mem, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Munmap(mem)
	arenaOff := int(le64(mem[48:]))
	t0 := time.Now()
	var sink uint64
	for i := range n {
		sink ^= xxh3.Hash(mem[arenaOff+i*(2<<20) : arenaOff+(i+1)*(2<<20)])
	}
	_ = sink
	return time.Since(t0)
}

func le64(b []byte) uint64 {
	return uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24 | uint64(b[4])<<32 | uint64(b[5])<<40 | uint64(b[6])<<48 | uint64(b[7])<<56
}
