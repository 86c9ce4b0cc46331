// Package host is the copy engine of a daemon without a GPU: regions are
// files under /dev/shm that the engine's process and the daemon both map
// shared, and copies are memmoves run by a fixed pool of workers.
package host

import (
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// Config configures the engine.
type Config struct {
	// ShmDir is the only directory regions may come from (default /dev/shm).
	ShmDir string
	// Workers is the number of copy workers (default 4).
	Workers int
	// Nice is the nice value (0..19) of the workers' threads; 0 leaves
	// them at the process's. Idle puts them in SCHED_IDLE instead. Either
	// way the kernel runs the daemon's other threads (gRPC handlers, the
	// policy) first whenever both want a CPU: a memmove can wait a few
	// microseconds, an engine's Lookup waiting behind it costs its step.
	// See docs/architecture.md, The copy engine.
	Nice int
	Idle bool
	// MaxMappedBytes bounds the bytes of region files mapped at once
	// (default DefaultMaxMappedBytes). A region file is mapped whole, and
	// a sparse file can be huge: without a bound, clients could take the
	// daemon's address space until the Go runtime cannot grow its heap.
	MaxMappedBytes uint64
	Logger         *slog.Logger
}

// DefaultMaxMappedBytes leaves most of a 47-bit user address space (128
// TiB) to the runtime and the arena.
const DefaultMaxMappedBytes = 32 << 40

// Engine is the host copy engine.
type Engine struct {
	cfg   Config
	arena []byte
	tasks taskQueue
	wg    sync.WaitGroup
	depth atomic.Int64
	// prioOnce logs the first failure to lower a worker thread's
	// priority; the copies run anyway.
	prioOnce sync.Once
	// split is splitBytes (benchmarks try others); onTask, when set (by
	// benchmarks only), is told how long each piece took to copy.
	split  uint64
	onTask func(d time.Duration)

	mu struct {
		sync.Mutex
		closed bool
		maps   map[fileID]*mapping
		mapped uint64 // bytes of every live mapping, stale ones included
	}
}

var _ dma.Engine = (*Engine)(nil)

type fileID struct{ dev, ino uint64 }

type mapping struct {
	id   fileID
	mem  []byte
	refs int
}

type region struct {
	e   *Engine
	m   *mapping
	mem []byte
}

func (r *region) Size() uint64 { return uint64(len(r.mem)) }

func (r *region) Close() error {
	e := r.e
	e.mu.Lock()
	defer e.mu.Unlock()
	if r.m == nil {
		return nil
	}
	m := r.m
	r.m = nil
	m.refs--
	if m.refs > 0 {
		return nil
	}
	if e.mu.maps[m.id] == m {
		delete(e.mu.maps, m.id)
	}
	e.mu.mapped -= mappedBytes(len(m.mem))
	return unix.Munmap(m.mem)
}

// batchState counts a batch's unfinished tasks.
type batchState struct {
	b       *dma.Batch
	left    atomic.Int32
	errOnce sync.Once
	err     error
}

type task struct {
	st     *batchState
	copies []dma.Copy
}

// New starts the workers.
func New(cfg Config) *Engine {
	if cfg.ShmDir == "" {
		cfg.ShmDir = "/dev/shm"
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 4
	}
	if cfg.MaxMappedBytes == 0 {
		cfg.MaxMappedBytes = DefaultMaxMappedBytes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	e := &Engine{cfg: cfg, split: splitBytes}
	e.tasks.init()
	e.mu.maps = map[fileID]*mapping{}
	for i := 0; i < cfg.Workers; i++ {
		e.wg.Add(1)
		go e.worker()
	}
	return e
}

// Name implements dma.Engine.
func (e *Engine) Name() string { return "host" }

// SetArena implements dma.Engine.
func (e *Engine) SetArena(arena []byte) error {
	e.arena = arena
	return nil
}

// Open implements dma.Engine: it maps a regular file under ShmDir that peer
// could itself open read-write by that path (see openAsPeer).
func (e *Engine) Open(spec dma.RegionSpec, peer dma.Peer) (dma.Region, error) {
	if spec.CUDA != nil {
		return nil, dma.ErrNoCUDA
	}
	rel, err := e.relPath(spec.ShmPath)
	if err != nil {
		return nil, err
	}
	fd, err := openAsPeer(e.cfg.ShmDir, rel, peer)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("%w: stat %s: %v", dma.ErrBadRegion, spec.ShmPath, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("%w: %s is not a regular file", dma.ErrBadRegion, spec.ShmPath)
	}
	if st.Size <= 0 {
		return nil, fmt.Errorf("%w: %s is empty", dma.ErrBadRegion, spec.ShmPath)
	}
	if uint64(st.Size) > uint64(math.MaxInt) {
		return nil, fmt.Errorf("%w: %s is %d bytes, too large to map", dma.ErrBadRegion, spec.ShmPath, st.Size)
	}
	id := fileID{dev: st.Dev, ino: st.Ino}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mu.closed {
		return nil, fmt.Errorf("%w: copy engine is closed", dma.ErrBadRegion)
	}
	m, ok := e.mu.maps[id]
	if !ok || int64(len(m.mem)) != st.Size {
		cost := mappedBytes(int(st.Size))
		if e.mu.mapped+cost > e.cfg.MaxMappedBytes {
			return nil, fmt.Errorf("%w: mapping %s (%d bytes) would map %d bytes of region files, at most %d (--max-mapped-bytes)", dma.ErrLimit, spec.ShmPath, st.Size, e.mu.mapped+cost, e.cfg.MaxMappedBytes)
		}
		mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			return nil, fmt.Errorf("%w: mmap %s: %v", dma.ErrBadRegion, spec.ShmPath, err)
		}
		if ok {
			// The file changed size since it was mapped: map it anew for
			// this region; the old mapping lives on with its regions.
			delete(e.mu.maps, id)
		}
		m = &mapping{id: id, mem: mem}
		e.mu.maps[id] = m
		e.mu.mapped += cost
	}
	m.refs++
	return &region{e: e, m: m, mem: m.mem}, nil
}

// mappedBytes is what a mapping of n bytes takes of the address space.
func mappedBytes(n int) uint64 {
	page := uint64(os.Getpagesize())
	return (uint64(n) + page - 1) / page * page
}

// MappedBytes reports the bytes of region files mapped now.
func (e *Engine) MappedBytes() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.mu.mapped
}

// relPath returns p relative to ShmDir, refusing anything not plainly beneath it.
func (e *Engine) relPath(p string) (string, error) {
	if p == "" {
		return "", fmt.Errorf("%w: shm_path is empty", dma.ErrBadRegion)
	}
	if !filepath.IsAbs(p) || filepath.Clean(p) != p {
		return "", fmt.Errorf("%w: shm_path %q must be an absolute, clean path under %s", dma.ErrBadRegion, p, e.cfg.ShmDir)
	}
	rel, err := filepath.Rel(e.cfg.ShmDir, p)
	if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return "", fmt.Errorf("%w: shm_path %q is not under %s", dma.ErrBadRegion, p, e.cfg.ShmDir)
	}
	return rel, nil
}

// splitBytes is the most one worker copies of a batch before the rest goes
// to another worker: large batches use every worker, small ones stay whole,
// and at the end of a step's copies no worker waits long for the last
// piece of another (1 MiB is about 100 µs of memmove).
const splitBytes = 1 << 20

// Submit implements dma.Engine.
func (e *Engine) Submit(b *dma.Batch) {
	st := &batchState{b: b}
	e.depth.Add(1)
	// Cut the batch into pieces of about splitBytes, at copy boundaries.
	var pieces [][]dma.Copy
	start, acc := 0, uint64(0)
	for i, c := range b.Copies {
		acc += c.Len
		if acc >= e.split {
			pieces = append(pieces, b.Copies[start:i+1])
			start, acc = i+1, 0
		}
	}
	if start < len(b.Copies) || len(pieces) == 0 {
		pieces = append(pieces, b.Copies[start:])
	}
	st.left.Store(int32(len(pieces)))
	ts := make([]task, len(pieces))
	for i, p := range pieces {
		ts[i] = task{st: st, copies: p}
	}
	e.tasks.push(ts)
}

// QueueDepth implements dma.Engine.
func (e *Engine) QueueDepth() int { return int(e.depth.Load()) }

func (e *Engine) worker() {
	defer e.wg.Done()
	// The worker owns its thread for good: its priority is lowered below,
	// and a locked goroutine that returns takes its thread with it, so no
	// other goroutine ever runs on a thread left at that priority.
	runtime.LockOSThread()
	if err := lowerPriority(e.cfg.Nice, e.cfg.Idle); err != nil {
		e.prioOnce.Do(func() {
			e.cfg.Logger.Warn("copy workers keep the daemon's scheduling priority", "nice", e.cfg.Nice, "sched_idle", e.cfg.Idle, "err", err)
		})
	}
	// A client that shrinks its file under us turns our memmove into
	// SIGBUS; make that a recoverable panic that fails the batch.
	debug.SetPanicOnFault(true)
	for {
		t, ok := e.tasks.pop()
		if !ok {
			return
		}
		var t0 time.Time
		if e.onTask != nil {
			t0 = time.Now()
		}
		if err := e.run(t.copies, t.st.b.ToArena); err != nil {
			t.st.errOnce.Do(func() { t.st.err = err })
		}
		if e.onTask != nil {
			e.onTask(time.Since(t0))
		}
		if t.st.left.Add(-1) == 0 {
			e.depth.Add(-1)
			t.st.b.Done(t.st.err)
		}
	}
}

func (e *Engine) run(copies []dma.Copy, toArena bool) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: memory fault: %v", dma.ErrCopy, r)
		}
	}()
	for _, c := range copies {
		reg := c.Region.(*region).mem
		if c.Len > uint64(len(reg)) || c.RegionOff > uint64(len(reg))-c.Len ||
			c.Len > uint64(len(e.arena)) || c.ArenaOff > uint64(len(e.arena))-c.Len {
			return fmt.Errorf("%w: copy out of bounds", dma.ErrCopy)
		}
		r := reg[c.RegionOff : c.RegionOff+c.Len]
		a := e.arena[c.ArenaOff : c.ArenaOff+c.Len]
		if toArena {
			copy(a, r)
		} else {
			copy(r, a)
		}
	}
	return nil
}

// Close implements dma.Engine: queued batches drain, then the workers stop.
// The caller must not Submit after Close.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.mu.closed {
		e.mu.Unlock()
		return nil
	}
	e.mu.closed = true
	e.mu.Unlock()
	e.tasks.close()
	e.wg.Wait()
	return nil
}

// lowerPriority puts the calling thread at nice (when above its own) or,
// with idle, in SCHED_IDLE. Lowering a thread's priority needs no
// privilege.
func lowerPriority(nice int, idle bool) error {
	if idle {
		return unix.SchedSetAttr(0, &unix.SchedAttr{Policy: unix.SCHED_IDLE}, 0)
	}
	if nice <= 0 {
		return nil
	}
	tid := unix.Gettid()
	// The raw syscall answers 20 - nice.
	cur, err := unix.Getpriority(unix.PRIO_PROCESS, tid)
	if err != nil {
		return err
	}
	if 20-cur >= nice {
		return nil // already as low: raising it back would need a privilege
	}
	return unix.Setpriority(unix.PRIO_PROCESS, tid, nice)
}

// taskQueue is the workers' FIFO of copy pieces. Submit never waits on it:
// what is queued is bounded by the jobs the service admits (Limits), and a
// Load or Store call returns as soon as its copies are queued.
type taskQueue struct {
	mu     sync.Mutex
	cond   sync.Cond
	q      []task
	head   int
	closed bool
}

func (q *taskQueue) init() { q.cond.L = &q.mu }

func (q *taskQueue) push(ts []task) {
	q.mu.Lock()
	if q.head > 64 && q.head > len(q.q)/2 {
		n := copy(q.q, q.q[q.head:])
		clear(q.q[n:])
		q.q, q.head = q.q[:n], 0
	}
	q.q = append(q.q, ts...)
	q.mu.Unlock()
	if len(ts) == 1 {
		q.cond.Signal()
	} else {
		q.cond.Broadcast()
	}
}

// pop waits for a task; false once the queue is closed and drained.
func (q *taskQueue) pop() (task, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for q.head == len(q.q) && !q.closed {
		q.cond.Wait()
	}
	if q.head == len(q.q) {
		return task{}, false
	}
	t := q.q[q.head]
	q.q[q.head] = task{}
	q.head++
	if q.head == len(q.q) {
		q.q, q.head = q.q[:0], 0
	}
	return t, true
}

func (q *taskQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.cond.Broadcast()
}
