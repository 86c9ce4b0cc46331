// Package errorfs owns fault injection for the disk tier: FS wraps a
// vfs.FS and injects seeded faults (EIO on read or write, short reads,
// torn writes, bit flips, ENOSPC, latency) into the files it opens, at the
// rates of a Plan, and can fail exactly the n-th operation so a test can
// sweep a fault over every operation of a workload. ParsePlan reads the
// daemon's --fault-spec flag.
//
// # Reproducibility
//
// Each file draws its faults from its own random stream, seeded from
// Plan.Seed mixed with the file's base name (not its directory, so a test
// in a fresh temporary directory repeats, and two disk directories that
// name their files alike see alike faults). The n-th operation on a file
// gets the same faults whatever other files do at the same time. Every
// kind is decided independently per operation, so raising one rate does
// not move the faults of another kind. Concurrent operations on the same
// file take their turns in the stream in the order they arrive.
//
// # Counted operations
//
// OpenFile, ReadAt, WriteAt, Sync, Preallocate (including the one OpenFile
// does for a size), Remove, Rename (matched on its old path) and SyncDir on
// matching paths are counted, in call order across the FS, for FailAtIndex
// and Ops; Remove, Rename and SyncDir fail only there, not by rate. Stat,
// MkdirAll, Lock, Name and Close pass through uncounted and never fail by
// injection.
package errorfs

import (
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvoffloadd/kvoffloadd/tiers/disk/vfs"
)

// Op is a counted filesystem operation.
type Op uint8

// The counted operations: OpenFile, ReadAt, WriteAt, Sync, Preallocate,
// Remove, Rename and SyncDir.
const (
	OpOpen Op = iota
	OpRead
	OpWrite
	OpSync
	OpPreallocate
	OpRemove
	OpRename
	OpSyncDir
)

var opNames = [...]string{"open", "read", "write", "sync", "preallocate", "remove", "rename", "syncdir"}

// String is the operation's name in events and error messages.
func (o Op) String() string {
	if int(o) < len(opNames) {
		return opNames[o]
	}
	return "op?"
}

// Event describes one injected fault, for OnInject.
type Event struct {
	Kind Kind
	Op   Op
	Path string
	Off  int64
}

// Options configure an FS.
type Options struct {
	// Plan sets the rates; the zero Plan injects nothing until
	// FailAtIndex is set.
	Plan Plan
	// Match limits injection to the paths for which it returns true; nil
	// matches every path. Other paths pass straight through, uncounted.
	Match func(path string) bool
	// OnInject, if set, is called for every injected fault, on the
	// goroutine doing the operation, before it returns: keep it cheap
	// (a counter increment, a log line). It must be safe for concurrent
	// use.
	OnInject func(Event)
	// Sleep waits out an injected latency; nil is time.Sleep. Tests set it
	// to record the delays instead of waiting.
	Sleep func(time.Duration)
}

// FS is a vfs.FS that injects faults into another. It is safe for
// concurrent use.
type FS struct {
	inner  vfs.FS
	opts   Options
	ops    atomic.Int64
	failAt atomic.Int64
	paused atomic.Bool
	counts [numKinds]atomic.Uint64

	mu struct {
		sync.Mutex
		streams map[string]*stream
	}
}

var _ vfs.FS = (*FS)(nil)

// stream is the random stream of one path.
type stream struct {
	mu  sync.Mutex
	rng *rand.PCG
}

// New wraps inner. It refuses an invalid plan.
func New(inner vfs.FS, opts Options) (*FS, error) {
	if err := opts.Plan.Validate(); err != nil {
		return nil, err
	}
	if opts.Sleep == nil {
		opts.Sleep = time.Sleep
	}
	fs := &FS{inner: inner, opts: opts}
	fs.failAt.Store(-1)
	fs.mu.streams = make(map[string]*stream)
	return fs, nil
}

// FailAtIndex makes the counted operation of index n (0-based, counted
// since New) fail with EIO, whatever the plan says; a read or write then
// transfers nothing. n < 0 turns it off. A sweep runs a workload once to
// learn Ops, then once for each n below it on a fresh FS.
func (fs *FS) FailAtIndex(n int64) { fs.failAt.Store(n) }

var noFaults Plan

// Pause stops the plan's faults until Resume (FailAtIndex still applies),
// so a test can let a daemon recover its files before the disk starts
// failing.
func (fs *FS) Pause() { fs.paused.Store(true) }

// Resume undoes Pause.
func (fs *FS) Resume() { fs.paused.Store(false) }

func (fs *FS) plan() *Plan {
	if fs.paused.Load() {
		return &noFaults
	}
	return &fs.opts.Plan
}

// Ops returns how many operations have been counted so far.
func (fs *FS) Ops() int64 { return fs.ops.Load() }

// Counts returns how many faults of each kind have been injected; every
// kind is present.
func (fs *FS) Counts() map[Kind]uint64 {
	m := make(map[Kind]uint64, numKinds)
	for k := range numKinds {
		m[k] = fs.counts[k].Load()
	}
	return m
}

func (fs *FS) matches(path string) bool {
	return fs.opts.Match == nil || fs.opts.Match(path)
}

// count counts an operation and fails it if it is the chosen index.
func (fs *FS) count(op Op, path string, off int64) error {
	if fs.ops.Add(1)-1 != fs.failAt.Load() {
		return nil
	}
	return fs.inject(Index, op, path, off, syscall.EIO)
}

// inject records a fault and returns its error (nil for err == nil, the
// faults that return success).
func (fs *FS) inject(k Kind, op Op, path string, off int64, err error) error {
	fs.counts[k].Add(1)
	if fs.opts.OnInject != nil {
		fs.opts.OnInject(Event{Kind: k, Op: op, Path: path, Off: off})
	}
	if err == nil {
		return nil
	}
	return &Error{Kind: k, Op: op, Path: path, Off: off, Err: err}
}

func (fs *FS) stream(path string) *stream {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	s := fs.mu.streams[path]
	if s == nil {
		s = &stream{rng: rand.NewPCG(fs.opts.Plan.Seed, xxh3.HashString(filepath.Base(path)))}
		fs.mu.streams[path] = s
	}
	return s
}

// next draws the decisions of the file's next operation.
func (s *stream) next() draw {
	s.mu.Lock()
	defer s.mu.Unlock()
	return draw(s.rng.Uint64())
}

// draw holds the seed of one operation's decisions. Each kind, and each
// detail of a kind, is a separate function of it, so the decision for one
// kind does not depend on the others.
type draw uint64

func (d draw) uint64(k Kind, detail uint64) uint64 {
	return rand.NewPCG(uint64(d), uint64(k)<<32|detail).Uint64()
}

// unit is uniform in [0,1).
func (d draw) unit(k Kind, detail uint64) float64 {
	return float64(d.uint64(k, detail)>>11) / (1 << 53)
}

func (d draw) hit(k Kind, rate float64) bool { return rate > 0 && d.unit(k, 0) < rate }

// prefix picks how much of an n-byte transfer a short read or torn write
// keeps: a whole number of 4 KiB units, shorter than n. Whole units keep a
// direct transfer aligned, and are what a device tears at.
func (d draw) prefix(k Kind, n int) int {
	units := (n + vfs.Alignment - 1) / vfs.Alignment
	return int(d.uint64(k, 1)%uint64(units)) * vfs.Alignment
}

func (fs *FS) delay(d draw, op Op, path string, off int64) {
	p := fs.plan()
	if p.Latency <= 0 || !d.hit(Latency, p.LatencyRate) {
		return
	}
	mean := float64(p.Latency)
	t := min(-math.Log(1-d.unit(Latency, 1))*mean, 10*mean)
	fs.inject(Latency, op, path, off, nil)
	fs.opts.Sleep(time.Duration(t))
}

// OpenFile opens path on the inner FS, then preallocates it through the
// wrapper so that preallocation faults apply.
func (fs *FS) OpenFile(path string, size int64, direct bool) (vfs.File, error) {
	if !fs.matches(path) {
		return fs.inner.OpenFile(path, size, direct)
	}
	if err := fs.count(OpOpen, path, 0); err != nil {
		return nil, err
	}
	inner, err := fs.inner.OpenFile(path, 0, direct)
	if err != nil {
		return nil, err
	}
	f := &file{fs: fs, inner: inner, path: path, stream: fs.stream(filepath.Clean(path))}
	if size > 0 {
		if err := f.Preallocate(size); err != nil {
			inner.Close()
			return nil, err
		}
	}
	return f, nil
}

// Remove removes path; it is counted and fails at its index.
func (fs *FS) Remove(path string) error {
	if fs.matches(path) {
		if err := fs.count(OpRemove, path, 0); err != nil {
			return err
		}
	}
	return fs.inner.Remove(path)
}

// Rename renames oldpath; it is counted and fails at its index, and
// then renames nothing.
func (fs *FS) Rename(oldpath, newpath string) error {
	if fs.matches(oldpath) {
		if err := fs.count(OpRename, oldpath, 0); err != nil {
			return err
		}
	}
	return fs.inner.Rename(oldpath, newpath)
}

// SyncDir syncs dir; it is counted and fails at its index.
func (fs *FS) SyncDir(dir string) error {
	if fs.matches(dir) {
		if err := fs.count(OpSyncDir, dir, 0); err != nil {
			return err
		}
	}
	return fs.inner.SyncDir(dir)
}

// Stat passes through.
func (fs *FS) Stat(path string) (os.FileInfo, error) { return fs.inner.Stat(path) }

// Space passes through.
func (fs *FS) Space(dir string) (vfs.Space, error) { return fs.inner.Space(dir) }

// Lock passes through.
func (fs *FS) Lock(path string) (io.Closer, error) { return fs.inner.Lock(path) }

// MkdirAll passes through.
func (fs *FS) MkdirAll(dir string, perm os.FileMode) error { return fs.inner.MkdirAll(dir, perm) }

type file struct {
	fs     *FS
	inner  vfs.File
	path   string
	stream *stream
}

func (f *file) ReadAt(p []byte, off int64) (int, error) {
	fs, plan := f.fs, f.fs.plan()
	if err := fs.count(OpRead, f.path, off); err != nil {
		return 0, err
	}
	d := f.stream.next()
	fs.delay(d, OpRead, f.path, off)
	if d.hit(ReadEIO, plan.ReadEIO) {
		return 0, fs.inject(ReadEIO, OpRead, f.path, off, syscall.EIO)
	}
	if len(p) > 0 && d.hit(ShortRead, plan.ShortRead) {
		n := d.prefix(ShortRead, len(p))
		if n > 0 {
			if m, err := f.inner.ReadAt(p[:n], off); err != nil {
				return m, err
			}
		}
		return n, fs.inject(ShortRead, OpRead, f.path, off, io.EOF)
	}
	n, err := f.inner.ReadAt(p, off)
	if n > 0 && d.hit(BitFlip, plan.BitFlip) {
		bit := d.uint64(BitFlip, 1) % uint64(n*8)
		p[bit/8] ^= 1 << (bit % 8)
		fs.inject(BitFlip, OpRead, f.path, off, nil)
	}
	return n, err
}

func (f *file) WriteAt(p []byte, off int64) (int, error) {
	fs, plan := f.fs, f.fs.plan()
	if err := fs.count(OpWrite, f.path, off); err != nil {
		return 0, err
	}
	d := f.stream.next()
	fs.delay(d, OpWrite, f.path, off)
	if d.hit(ENOSPC, plan.ENOSPC) {
		return 0, fs.inject(ENOSPC, OpWrite, f.path, off, syscall.ENOSPC)
	}
	if d.hit(WriteEIO, plan.WriteEIO) {
		return 0, fs.inject(WriteEIO, OpWrite, f.path, off, syscall.EIO)
	}
	if len(p) > 0 && d.hit(TornWrite, plan.TornWrite) {
		n := d.prefix(TornWrite, len(p))
		if n > 0 {
			if m, err := f.inner.WriteAt(p[:n], off); err != nil {
				return m, err
			}
		}
		return n, fs.inject(TornWrite, OpWrite, f.path, off, syscall.EIO)
	}
	return f.inner.WriteAt(p, off)
}

func (f *file) Preallocate(size int64) error {
	if err := f.fs.count(OpPreallocate, f.path, 0); err != nil {
		return err
	}
	d := f.stream.next()
	f.fs.delay(d, OpPreallocate, f.path, 0)
	if d.hit(ENOSPC, f.fs.plan().ENOSPC) {
		return f.fs.inject(ENOSPC, OpPreallocate, f.path, 0, syscall.ENOSPC)
	}
	return f.inner.Preallocate(size)
}

func (f *file) Sync() error {
	if err := f.fs.count(OpSync, f.path, 0); err != nil {
		return err
	}
	d := f.stream.next()
	f.fs.delay(d, OpSync, f.path, 0)
	if d.hit(WriteEIO, f.fs.plan().WriteEIO) {
		return f.fs.inject(WriteEIO, OpSync, f.path, 0, syscall.EIO)
	}
	return f.inner.Sync()
}

func (f *file) Close() error { return f.inner.Close() }
func (f *file) Name() string { return f.inner.Name() }
