// Package testenv starts a real kvoffloadd core (service, gRPC server, unix
// socket) inside a test, and makes /dev/shm regions shaped like an engine's
// KV cache whose bytes are a pure function of their key, so every load can be
// checked byte for byte.
package testenv

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/dma"
	"github.com/kvoffloadd/kvoffloadd/dma/host"
	"github.com/kvoffloadd/kvoffloadd/events"
	"github.com/kvoffloadd/kvoffloadd/offload"
	"github.com/kvoffloadd/kvoffloadd/rpc/client"
	pb "github.com/kvoffloadd/kvoffloadd/rpc/kvoffload/v1"
	"github.com/kvoffloadd/kvoffloadd/rpc/server"
	"github.com/kvoffloadd/kvoffloadd/tiers/cpu"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk"
	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// Options shape a test daemon.
type Options struct {
	CPUBytes   uint64 // default 64MiB
	ChunkBytes uint64
	Workers    int
	Limits     offload.Limits
	// NamespaceLinger is passed to offload.Config (negative: drop empty
	// namespaces at the next sweep).
	NamespaceLinger time.Duration
	// Server bounds connections and in-flight requests (default
	// server.DefaultConfig).
	Server server.Config
	// MaxMappedBytes bounds the host copy engine's mappings.
	MaxMappedBytes uint64
	// SharedSocket opens the socket to SocketGroup (mode 0660, as
	// --socket-mode 0660 does), so that clients StartAs Nobody connect.
	SharedSocket bool
	// Wrap, when set, wraps the host copy engine (to gate or fail copies).
	Wrap func(dma.Engine) dma.Engine
	// Quiet drops logs below warnings.
	Quiet bool
	// Events sizes the event hub (offload.Config.Events).
	Events events.Config

	// DiskDirs, when set, adds a disk tier with a slot file per dir.
	DiskDirs       []string
	DiskBytes      uint64 // per dir; default 64MiB
	DiskChunkBytes uint64 // default 4MiB
	DiskFS         vfs.FS // e.g. an errorfs or a GateFS; default the OS
	DiskQueueDepth int    // I/Os in flight per slot file; default the tier's
	WriteThrough   bool
	DiskReset      bool
	// Recovering makes Start return as soon as the daemon serves, while
	// the disk tier may still be recovering its files in the background.
	// By default Start waits until recovery has ended, so a test sees
	// what the disk held.
	Recovering bool

	// Remote, when set, adds the remote tier (the daemon closes its store).
	Remote *offload.RemoteConfig
}

// Daemon is a running core on a real unix socket.
type Daemon struct {
	Socket   string
	Svc      *offload.Service
	Srv      *server.Server
	Host     *host.Engine // the copy engine, under any Wrap
	Registry *prometheus.Registry
	copier   dma.Engine
	serveErr chan error
	stopped  bool
	faulty   bool // a fault-injecting disk: close may fail
}

// Start runs a daemon until the test ends.
func Start(t testing.TB, o Options) *Daemon {
	t.Helper()
	d, err := TryStart(t, o)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TryStart is Start that returns the error of a daemon refusing to start.
func TryStart(t testing.TB, o Options) (*Daemon, error) {
	t.Helper()
	if o.CPUBytes == 0 {
		o.CPUBytes = 64 << 20
	}
	level := slog.LevelInfo
	if o.Quiet {
		level = slog.LevelWarn
	}
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: level}))
	hostEngine := host.New(host.Config{Workers: o.Workers, MaxMappedBytes: o.MaxMappedBytes, Logger: log})
	var copier dma.Engine = hostEngine
	if o.Wrap != nil {
		copier = o.Wrap(copier)
	}
	reg := prometheus.NewRegistry()
	var dc *disk.Config
	if len(o.DiskDirs) > 0 {
		dc = &disk.Config{Dirs: o.DiskDirs, BytesPerDir: o.DiskBytes, ChunkBytes: o.DiskChunkBytes, FS: o.DiskFS, Direct: true, Reset: o.DiskReset, QueueDepth: o.DiskQueueDepth}
		if dc.BytesPerDir == 0 {
			dc.BytesPerDir = 64 << 20
		}
		if dc.ChunkBytes == 0 {
			dc.ChunkBytes = 4 << 20
		}
	}
	svc, err := offload.New(offload.Config{
		CPU:             cpu.Config{Bytes: o.CPUBytes, ChunkBytes: o.ChunkBytes},
		Disk:            dc,
		WriteThrough:    o.WriteThrough,
		Remote:          o.Remote,
		DMA:             copier,
		Limits:          o.Limits,
		NamespaceLinger: o.NamespaceLinger,
		Events:          o.Events,
		Logger:          log,
		Registerer:      reg,
	})
	if err != nil {
		copier.Close()
		return nil, err
	}
	dir, err := os.MkdirTemp("", "kvo")
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "s")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	if o.SharedSocket {
		for path, mode := range map[string]os.FileMode{dir: 0o750, sock: 0o660} {
			if err := os.Chown(path, os.Getuid(), SocketGroup); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(path, mode); err != nil {
				t.Fatal(err)
			}
		}
	}
	sc := o.Server
	sc.Registerer = reg
	d := &Daemon{Socket: sock, Svc: svc, Srv: server.New(svc, log, sc), Host: hostEngine, Registry: reg, copier: copier, serveErr: make(chan error, 1), faulty: o.DiskFS != nil}
	go func() { d.serveErr <- d.Srv.Serve(lis) }()
	t.Cleanup(func() {
		d.Stop(t)
		os.RemoveAll(dir)
	})
	if !o.Recovering {
		<-svc.DiskRecovered()
	}
	return d, nil
}

// Stop shuts the daemon down the way SIGTERM does.
func (d *Daemon) Stop(t testing.TB) {
	if d.stopped {
		return
	}
	d.stopped = true
	d.Srv.SetNotServing()
	d.Svc.BeginShutdown()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.Svc.Drain(ctx); err != nil {
		t.Errorf("drain: %v", err)
	}
	d.Srv.Stop(time.Now().Add(10 * time.Second))
	if err := d.Svc.Close(); err != nil {
		if d.faulty {
			t.Logf("close service on a faulty disk: %v", err)
		} else {
			t.Errorf("close service: %v", err)
		}
	}
	if err := d.copier.Close(); err != nil {
		t.Errorf("close copy engine: %v", err)
	}
	<-d.serveErr
}

// Client dials the daemon; the connection closes when the test ends.
func (d *Daemon) Client(t testing.TB) *client.Client {
	t.Helper()
	c, err := client.Dial(d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p[:len(p)-1]))
	return len(p), nil
}

var regionSeq atomic.Uint64

// Region is a /dev/shm file mapped shared, standing in for engine KV memory.
type Region struct {
	Path string
	Mem  []byte
}

// NewRegion creates a size-byte region file removed when the test ends.
func NewRegion(t testing.TB, size int) *Region {
	t.Helper()
	path := fmt.Sprintf("/dev/shm/kvoffload-test-%d-%d", os.Getpid(), regionSeq.Add(1))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(int64(size)); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	r := &Region{Path: path, Mem: mem}
	t.Cleanup(func() {
		unix.Munmap(mem)
		os.Remove(path)
	})
	return r
}

// Model is a synthetic engine KV cache: Layers segments of SegBytes per
// block, all in one region file, layer-major (each layer's blocks contiguous).
type Model struct {
	Layers    int
	SegBytes  int
	Blocks    int
	HashBytes int // default 32
}

// Layout is the model's layout on the wire.
func (m Model) Layout() *pb.Layout {
	l := &pb.Layout{HashBytes: uint32(m.hashBytes())}
	for i := 0; i < m.Layers; i++ {
		l.Segments = append(l.Segments, &pb.Segment{Group: 0, Bytes: uint64(m.SegBytes)})
	}
	return l
}

func (m Model) hashBytes() int {
	if m.HashBytes == 0 {
		return 32
	}
	return m.HashBytes
}

// RegionBytes is the size of the region file.
func (m Model) RegionBytes() int { return m.Layers * m.Blocks * m.SegBytes }

// Regions describes r to the daemon, one entry per layer.
func (m Model) Regions(r *Region) []*pb.Region {
	out := make([]*pb.Region, m.Layers)
	for i := range out {
		out[i] = &pb.Region{
			Memory:      &pb.Region_ShmPath{ShmPath: r.Path},
			Offset:      uint64(i * m.Blocks * m.SegBytes),
			BlockStride: uint64(m.SegBytes),
			NumBlocks:   uint32(m.Blocks),
		}
	}
	return out
}

// Segment is the bytes of engine block b, layer l, in r.
func (m Model) Segment(r *Region, l, b int) []byte {
	off := (l*m.Blocks + b) * m.SegBytes
	return r.Mem[off : off+m.SegBytes]
}

// Hash is the block hash of the i-th block of a chain named by seed.
func (m Model) Hash(seed uint64, i int) []byte {
	h := make([]byte, m.hashBytes())
	binary.LittleEndian.PutUint64(h, seed)
	binary.LittleEndian.PutUint64(h[8:], uint64(i)+1)
	for j := 16; j < len(h); j++ {
		h[j] = byte(seed>>(j%8)) ^ byte(i*7+j)
	}
	return h
}

// Hashes are the hashes of the first n blocks of the chain named by seed.
func (m Model) Hashes(seed uint64, n int) [][]byte {
	hs := make([][]byte, n)
	for i := range hs {
		hs[i] = m.Hash(seed, i)
	}
	return hs
}

// Seq is n consecutive engine block ids from from.
func Seq(from, n int) []uint32 {
	b := make([]uint32, n)
	for i := range b {
		b[i] = uint32(from + i)
	}
	return b
}

// Fill writes the bytes that belong to hash into engine block b.
func (m Model) Fill(r *Region, b int, hash []byte) {
	for l := 0; l < m.Layers; l++ {
		fillPattern(m.Segment(r, l, b), hash, l)
	}
}

// Check reports whether engine block b holds exactly hash's bytes.
func (m Model) Check(r *Region, b int, hash []byte) error {
	want := make([]byte, m.SegBytes)
	for l := 0; l < m.Layers; l++ {
		fillPattern(want, hash, l)
		got := m.Segment(r, l, b)
		for i := range got {
			if got[i] != want[i] {
				return fmt.Errorf("block %d layer %d differs at byte %d: got %#x want %#x", b, l, i, got[i], want[i])
			}
		}
	}
	return nil
}

// fillPattern is a xorshift stream seeded by the hash and layer.
func fillPattern(dst []byte, hash []byte, layer int) {
	x := binary.LittleEndian.Uint64(hash) ^ binary.LittleEndian.Uint64(hash[8:]) ^ uint64(layer+1)*0x9e3779b97f4a7c15
	if x == 0 {
		x = 1
	}
	i := 0
	for ; i+8 <= len(dst); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(dst[i:], x)
	}
	for ; i < len(dst); i++ {
		dst[i] = byte(x >> (8 * (i % 8)))
	}
}

// Keys packs hashes into a KeyList of group 0.
func Keys(hashes ...[]byte) *pb.KeyList {
	var buf []byte
	for _, h := range hashes {
		buf = append(buf, h...)
	}
	return &pb.KeyList{Hashes: buf}
}

// Job builds a job moving hashes[i] to or from blocks[i].
func Job(id uint64, hashes [][]byte, blocks []uint32) *pb.Job {
	return &pb.Job{JobId: id, RequestId: fmt.Sprintf("req-%d", id), Keys: Keys(hashes...), BlockIds: blocks}
}
