package cuda

import (
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// driver is the engine's view of the CUDA driver. The real one (cudriver.go,
// build tag cuda) uses gorgonia.org/cu and the cgo calls of driver.go; the
// tests use a fake that copies with memmove and completes events when told,
// so that the engine's ordering, failure handling and shutdown are tested on
// machines without a GPU.
type driver interface {
	numDevices() (int, error)
	// deviceUUID returns device ord's UUID (cuDeviceGetUuid_v2; MIG
	// instances have their own). It makes no context.
	deviceUUID(ord int) ([UUIDBytes]byte, error)
	// pciBusID returns device ord's PCI address, "0000:3b:00.0".
	pciBusID(ord int) (string, error)
	// openDevice retains device ord's primary context and makes its copy
	// streams, streamsPerDirection for each direction.
	openDevice(ord, streamsPerDirection int) (gpu, error)
}

// gpu is one device as a driver set it up. Its streams are numbered 0..n-1
// for loads (arena to device) and n..2n-1 for stores (device to arena).
//
// bind and the calls listed after it run on the engine's own goroutines,
// each locked to its OS thread: bind makes the device's context current on
// that thread for the calls that follow. The calls before bind may come from
// any goroutine and make their context current themselves.
type gpu interface {
	maxPitch() uint64
	// batchCopies reports whether the driver has cuMemcpyBatchAsync
	// (CUDA 12.8 and later), so that copyBatch may be called.
	batchCopies() bool
	// ipcOpen maps the allocation behind an IPC memory handle.
	ipcOpen(h *[IPCHandleBytes]byte) (ipcMapping, error)
	ipcClose(addr uint64) error
	// hostRegister page-locks mem for every context (portable).
	hostRegister(mem []byte) error
	hostUnregister(mem []byte) error
	// release destroys the streams and releases the primary context.
	release() error

	bind() error
	// openEvent opens an IPC event handle another process exported.
	openEvent(h []byte) (event, error)
	// query reports whether ev has completed (cuEventQuery); it never
	// blocks.
	query(ev event) (bool, error)
	destroy(ev event) error
	// copy queues run r between device address addr (its first row) and
	// host, the arena bytes from its first row to the end of its last.
	copy(stream int, r Run, addr uint64, host []byte, toArena bool) error
	// copyBatch queues plain copies between device addresses and arena
	// bytes as one driver call (cuMemcpyBatchAsync).
	copyBatch(stream int, spans []span, toArena bool) error
	// record queues a completion event after the stream's work so far; a
	// wait on it sleeps in the kernel rather than spinning.
	record(stream int) (event, error)
	// wait blocks the calling thread until ev has completed. An error
	// means the device stopped running the stream's work.
	wait(ev event) error
	// sync waits for the stream's work so far.
	sync(stream int) error
	// injectFault queues a kernel that traps on the stream: the context is
	// lost, as after a real illegal address. Testing only.
	injectFault(stream int) error
}

// event is a driver's event: a completion event or an opened IPC event.
type event any

// ipcMapping is an IPC allocation mapped into the daemon: its address, its
// size as the driver knows it, and the device its memory is on.
type ipcMapping struct {
	addr, size uint64
	device     int
}

// span is one plain copy between device memory and arena bytes.
type span struct {
	dev  uint64
	host []byte
}

// Config configures the engine. The zero value is usable.
type Config struct {
	// StreamsPerDirection is the number of copy streams per device and
	// direction (default 2). Batches take them in turn, so one batch's
	// copies are queued while another's run.
	StreamsPerDirection int
	// QueueDepth is the number of batches Submit queues before it blocks
	// (default 64).
	QueueDepth int
	// ArenaDevice names the device whose context registers the arena as
	// pinned memory, at SetArena: an ordinal ("1") or a UUID ("GPU-…").
	// Empty: device 0 when it is the only device visible, else the first
	// device a client registers memory on, so that no context is made on a
	// GPU nobody uses. The registration is portable: every device sees the
	// arena pinned.
	ArenaDevice string
	// NoNUMA keeps the arena's pages where they are. By default they are
	// moved, before the arena is pinned, to the NUMA node of the device
	// that pins it (read from sysfs), where its copies are fastest.
	NoNUMA bool
	// ReadyTimeout bounds the wait for a batch's ready event (default 30s).
	// An engine that died or faulted never completes its event; its batch
	// fails after this long instead of holding anything up.
	ReadyTimeout time.Duration
	// ReadyPollMin and ReadyPollMax bound the pause between two checks of
	// the ready events of waiting batches (defaults 2µs and 50µs).
	ReadyPollMin, ReadyPollMax time.Duration
	// NoBatchCopies issues scattered copies one driver call each even where
	// the driver has cuMemcpyBatchAsync.
	NoBatchCopies bool
	// FaultAfterBatches, when positive, makes the device fault (a kernel
	// that traps) before the copies of batch FaultAfterBatches+1: a sticky
	// error on purpose, to prove the daemon's handling of one. Testing only.
	FaultAfterBatches int
	Logger            *slog.Logger
	// OnError, when set, is called once for each batch the driver failed,
	// with the driver call and its error name (for example
	// "cuMemcpy2DAsync", "CUDA_ERROR_ILLEGAL_ADDRESS"), on one of the
	// engine's goroutines, before the batch's Done. Meant for a labelled
	// counter.
	OnError func(op, name string)
}

// Stats are the engine's counters since it started.
type Stats struct {
	Batches       uint64 // batches done, failed ones included
	FailedBatches uint64 // batches done with an error
	DriverErrors  uint64 // batches the CUDA driver failed (part of FailedBatches)
	Copies        uint64 // copies of issued batches
	DriverCopies  uint64 // driver copy calls those became (a batched call counts once)
	BatchedCopies uint64 // copies that went through cuMemcpyBatchAsync
	BytesToArena  uint64 // bytes of successful store batches
	BytesToDevice uint64 // bytes of successful load batches
	ReadyWaits    uint64 // batches whose ready event had not completed when they arrived
	ReadyTimeouts uint64 // batches failed because their ready event never completed
	// ReadyAbandoned: batches failed because their requester's connection
	// closed before their ready event completed (dma.Batch.Abandoned).
	ReadyAbandoned uint64
}

// Engine is the CUDA copy engine. See the package documentation.
type Engine struct {
	cfg   Config
	drv   driver
	log   *slog.Logger
	uuids [][UUIDBytes]byte // by ordinal

	arena atomic.Pointer[arena] // the registered arena; nil until it is

	queue chan *dma.Batch // Submit -> issuer
	wg    sync.WaitGroup  // issuer, finisher, stream waiters
	depth atomic.Int64
	fin   *finisher

	fatal struct {
		once sync.Once
		ch   chan struct{}
		err  error // set before ch is closed
	}

	stats struct {
		batches, failed, driverErrs, copies, driverCopies, batched, toArena, toDevice, readyWaits, readyTimeouts, readyAbandoned atomic.Uint64
	}

	// qmu orders Submit's sends on queue before Close closes it. It is kept
	// apart from mu so that a Submit blocked on a full queue holds up
	// neither Open nor the engine's goroutines.
	qmu struct {
		sync.RWMutex
		closed bool
	}

	mu struct {
		sync.Mutex
		closed  bool
		devices map[int]*device
		maps    map[ipcKey]*mapping
		mem     []byte // the arena as SetArena gave it; pinned once arena is set
	}

	// preferNode and sysfs are numa.go's, replaced by tests.
	preferNode func(mem []byte, node int) error
	sysfs      string
}

var (
	_ dma.Engine = (*Engine)(nil)
	_ dma.Failer = (*Engine)(nil)
)

type arena struct {
	mem []byte
	dev *device // whose context registered it
}

// device is a gpu, the engine's round-robin over its streams, and one
// waiter per stream.
type device struct {
	gpu
	ord      int
	nstreams int
	next     [2]int // only the issuer touches it
	waiters  []*waiter
}

func (d *device) stream(toArena bool) int {
	i := 0
	if toArena {
		i = 1
	}
	s := i*d.nstreams + d.next[i]
	d.next[i] = (d.next[i] + 1) % d.nstreams
	return s
}

// mapping is one IPC allocation opened on one device, shared by the regions
// carved from it. refs and closed are guarded by Engine.mu.
type mapping struct {
	key    ipcKey
	dev    *device
	addr   uint64
	size   uint64 // as the driver knows it
	refs   int
	closed bool
}

type region struct {
	e      *Engine
	m      *mapping
	size   uint64 // the client's alloc_size, at most m.size
	closed atomic.Bool
}

func (r *region) Size() uint64 { return r.size }

// Close releases the region; the allocation is unmapped with its last
// region. No copy of it may be in flight.
func (r *region) Close() error {
	if r.closed.Swap(true) {
		return nil
	}
	e := r.e
	e.mu.Lock()
	defer e.mu.Unlock()
	m := r.m
	m.refs--
	if m.refs > 0 || m.closed {
		return nil
	}
	m.closed = true
	delete(e.mu.maps, m.key)
	return m.dev.ipcClose(m.addr)
}

func newEngine(drv driver, cfg Config) (*Engine, error) {
	if cfg.StreamsPerDirection <= 0 {
		cfg.StreamsPerDirection = 2
	}
	if cfg.QueueDepth <= 0 {
		cfg.QueueDepth = 64
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = 30 * time.Second
	}
	if cfg.ReadyPollMin <= 0 {
		cfg.ReadyPollMin = 2 * time.Microsecond
	}
	if cfg.ReadyPollMax < cfg.ReadyPollMin {
		cfg.ReadyPollMax = max(cfg.ReadyPollMin, 50*time.Microsecond)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	n, err := drv.numDevices()
	if err != nil {
		return nil, fmt.Errorf("cuda: count devices: %w", err)
	}
	if n == 0 {
		return nil, errors.New("cuda: no CUDA device is visible to this process")
	}
	e := &Engine{
		cfg:        cfg,
		drv:        drv,
		log:        cfg.Logger.With("dma", "cuda"),
		queue:      make(chan *dma.Batch, cfg.QueueDepth),
		preferNode: preferNode,
		sysfs:      "/sys",
	}
	for ord := range n {
		u, err := drv.deviceUUID(ord)
		if err != nil {
			return nil, fmt.Errorf("cuda: UUID of device %d: %w", ord, err)
		}
		e.uuids = append(e.uuids, u)
	}
	if cfg.ArenaDevice != "" {
		if _, err := e.arenaDevice(); err != nil {
			return nil, err
		}
	}
	e.fatal.ch = make(chan struct{})
	e.mu.devices = map[int]*device{}
	e.mu.maps = map[ipcKey]*mapping{}
	e.fin = newFinisher(e)
	if cfg.FaultAfterBatches > 0 {
		e.log.Warn("FAULT INJECTION: the device will fault on purpose (a trapping kernel) before batch "+
			strconv.Itoa(cfg.FaultAfterBatches+1)+"; the daemon will lose its CUDA context and exit", "fault_after_batches", cfg.FaultAfterBatches)
	}
	e.wg.Add(2)
	go e.issuer()
	go e.fin.run()
	return e, nil
}

// Name implements dma.Engine.
func (e *Engine) Name() string { return "cuda" }

// Devices returns the UUIDs of the devices this process sees, by ordinal.
func (e *Engine) Devices() [][UUIDBytes]byte { return e.uuids }

// Stats returns the engine's counters.
func (e *Engine) Stats() Stats {
	s := &e.stats
	return Stats{
		Batches: s.batches.Load(), FailedBatches: s.failed.Load(), DriverErrors: s.driverErrs.Load(),
		Copies: s.copies.Load(), DriverCopies: s.driverCopies.Load(), BatchedCopies: s.batched.Load(),
		BytesToArena: s.toArena.Load(), BytesToDevice: s.toDevice.Load(),
		ReadyWaits: s.readyWaits.Load(), ReadyTimeouts: s.readyTimeouts.Load(), ReadyAbandoned: s.readyAbandoned.Load(),
	}
}

// Failed implements dma.Failer: it is closed once the engine has lost a
// device's context to a sticky error.
func (e *Engine) Failed() <-chan struct{} { return e.fatal.ch }

// Err implements dma.Failer: the sticky error, once Failed is closed.
func (e *Engine) Err() error {
	select {
	case <-e.fatal.ch:
		return e.fatal.err
	default:
		return nil
	}
}

// fail puts the engine in its failed state, once: every batch from now on
// fails without a driver call, and Failed is closed for the daemon.
func (e *Engine) fail(err error) {
	e.fatal.once.Do(func() {
		e.fatal.err = err
		close(e.fatal.ch)
		e.log.Error("CUDA context lost: every copy fails from now on; the daemon must restart", "err", err)
	})
}

// checkSticky fails the engine when err is a sticky driver error, and
// returns err.
func (e *Engine) checkSticky(err error) error {
	var de *DriverError
	if errors.As(err, &de) && de.Sticky() {
		e.fail(err)
	}
	return err
}

// arenaDevice resolves Config.ArenaDevice to an ordinal: -1 when it is
// empty and more than one device is visible (the arena is then pinned by
// the first device a region is opened on).
func (e *Engine) arenaDevice() (int, error) {
	s := e.cfg.ArenaDevice
	switch {
	case s == "" && len(e.uuids) == 1:
		return 0, nil
	case s == "":
		return -1, nil
	case strings.HasPrefix(s, "GPU-") || strings.HasPrefix(s, "MIG-"):
		for ord, u := range e.uuids {
			if FormatUUID(u[:])[4:] == s[4:] {
				return ord, nil
			}
		}
		return 0, fmt.Errorf("cuda: arena device %s is not visible (this process sees %s)", s, formatUUIDs(e.uuids))
	}
	ord, err := strconv.Atoi(s)
	if err != nil || ord < 0 || ord >= len(e.uuids) {
		return 0, fmt.Errorf("cuda: arena device %q: want an ordinal 0..%d or a UUID (GPU-…)", s, len(e.uuids)-1)
	}
	return ord, nil
}

// deviceLocked returns device ord, setting it up on first use.
func (e *Engine) deviceLocked(ord int) (*device, error) {
	if d := e.mu.devices[ord]; d != nil {
		return d, nil
	}
	g, err := e.drv.openDevice(ord, e.cfg.StreamsPerDirection)
	if err != nil {
		return nil, e.checkSticky(err)
	}
	d := &device{gpu: g, ord: ord, nstreams: e.cfg.StreamsPerDirection}
	for s := range 2 * d.nstreams {
		w := newWaiter(e, d, s)
		d.waiters = append(d.waiters, w)
		e.wg.Add(1)
		go w.run()
	}
	e.mu.devices[ord] = d
	e.log.Info("cuda device ready", "device", ord, "uuid", FormatUUID(e.uuids[ord][:]), "streams_per_direction", d.nstreams,
		"max_pitch", d.maxPitch(), "batch_copies", d.batchCopies() && !e.cfg.NoBatchCopies)
	return d, nil
}

// SetArena implements dma.Engine: it registers the arena as pinned, portable
// host memory, now or (with several devices visible and no ArenaDevice) when
// the first region is opened. The arena must not be Go heap memory (the
// daemon maps it with mmap): the driver keeps its address. SetArena(nil)
// unregisters it; the daemon calls it before it unmaps the arena.
func (e *Engine) SetArena(mem []byte) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if old := e.arena.Swap(nil); old != nil {
		if err := old.dev.hostUnregister(old.mem); err != nil {
			return fmt.Errorf("cuda: unregister the arena: %w", e.checkSticky(err))
		}
		e.log.Info("arena unregistered", "bytes", len(old.mem))
	}
	e.mu.mem = mem
	if mem == nil {
		return nil
	}
	if e.mu.closed {
		return errors.New("cuda: copy engine is closed")
	}
	ord, err := e.arenaDevice()
	if err != nil || ord < 0 {
		if ord < 0 {
			e.log.Info("the arena is pinned when the first region is opened, by that region's device", "devices", len(e.uuids))
		}
		return err
	}
	d, err := e.deviceLocked(ord)
	if err != nil {
		return fmt.Errorf("cuda: set up device %d for the arena: %w", ord, err)
	}
	return e.pinArenaLocked(d)
}

// pinArenaLocked registers the arena in d's context, after moving its pages
// to d's NUMA node.
func (e *Engine) pinArenaLocked(d *device) error {
	mem := e.mu.mem
	if !e.cfg.NoNUMA {
		e.followDevice(mem, d)
	}
	start := time.Now()
	if err := d.hostRegister(mem); err != nil {
		return fmt.Errorf("cuda: register the %d-byte arena as pinned memory on device %d: %w", len(mem), d.ord, e.checkSticky(err))
	}
	e.arena.Store(&arena{mem: mem, dev: d})
	e.log.Info("arena registered as pinned memory", "bytes", len(mem), "device", d.ord, "took", time.Since(start))
	return nil
}

// Open implements dma.Engine: it maps the allocation behind spec's IPC
// handle, once per device and handle however many regions are carved from
// it, and checks that the allocation as the driver knows it covers the
// client's alloc_size and is on the device the region names. The driver
// cannot say which process exported a handle, so peer is only logged (see
// the package documentation).
func (e *Engine) Open(spec dma.RegionSpec, peer dma.Peer) (dma.Region, error) {
	key, err := parseRegion(spec, e.uuids)
	if err != nil {
		return nil, err
	}
	if err := e.Err(); err != nil {
		return nil, fmt.Errorf("cuda: the copy engine has failed: %w", err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mu.closed {
		return nil, fmt.Errorf("%w: copy engine is closed", dma.ErrBadRegion)
	}
	d, err := e.deviceLocked(key.device)
	if err != nil {
		return nil, fmt.Errorf("cuda: set up device %d: %w", key.device, err)
	}
	if e.mu.mem != nil && e.arena.Load() == nil {
		if err := e.pinArenaLocked(d); err != nil {
			return nil, err
		}
	}
	m := e.mu.maps[key]
	if m == nil {
		im, err := d.ipcOpen(&key.handle)
		if err != nil {
			return nil, fmt.Errorf("%w: open the CUDA IPC memory handle of pid %d on device %d: %w", dma.ErrBadRegion, peer.PID, d.ord, e.checkSticky(err))
		}
		if im.device != d.ord {
			cerr := d.ipcClose(im.addr)
			return nil, errors.Join(fmt.Errorf("%w: the memory behind the handle is on device %d (%s), the region names device %d (%s): "+
				"send the device's UUID (device_uuid), not an ordinal of another process",
				dma.ErrBadRegion, im.device, e.uuidOf(im.device), d.ord, FormatUUID(e.uuids[d.ord][:])), cerr)
		}
		m = &mapping{key: key, dev: d, addr: im.addr, size: im.size}
		e.mu.maps[key] = m
		e.log.Debug("CUDA IPC memory opened", "device", d.ord, "bytes", im.size, "pid", peer.PID)
	}
	if spec.CUDA.AllocSize > m.size {
		if m.refs == 0 {
			m.closed = true
			delete(e.mu.maps, key)
			if err := d.ipcClose(m.addr); err != nil {
				e.log.Warn("closing a refused CUDA IPC mapping failed", "device", d.ord, "err", err)
			}
		}
		return nil, fmt.Errorf("%w: alloc_size is %d bytes but the exported allocation is %d", dma.ErrBadRegion, spec.CUDA.AllocSize, m.size)
	}
	m.refs++
	return &region{e: e, m: m, size: spec.CUDA.AllocSize}, nil
}

func (e *Engine) uuidOf(ord int) string {
	if ord < 0 || ord >= len(e.uuids) {
		return "not visible to this process"
	}
	return FormatUUID(e.uuids[ord][:])
}

// Submit implements dma.Engine. The batch is checked and issued on the
// engine's goroutine, and Done runs on another of the engine's goroutines,
// once the event recorded after the batch's last copy has completed. Done
// may call Submit; it should return quickly, as it holds up the completion
// of the batches behind it on its stream.
func (e *Engine) Submit(b *dma.Batch) {
	e.depth.Add(1)
	e.qmu.RLock()
	if e.qmu.closed {
		e.qmu.RUnlock()
		e.depth.Add(-1)
		// Submit after Close is a bug of the caller; still, Done must not
		// run on its goroutine.
		go b.Done(fmt.Errorf("%w: copy engine is closed", dma.ErrCopy))
		return
	}
	e.queue <- b
	e.qmu.RUnlock()
}

// QueueDepth implements dma.Engine.
func (e *Engine) QueueDepth() int { return int(e.depth.Load()) }

// finish counts a batch and runs its Done, on an engine goroutine other than
// the issuer (which Done's Submit may be waiting for).
func (e *Engine) finish(f *inflight) {
	e.stats.batches.Add(1)
	switch {
	case f.err != nil:
		e.stats.failed.Add(1)
		attrs := []any{"store", f.b.ToArena, "copies", len(f.b.Copies), "bytes", f.bytes, "err", f.err}
		var de *DriverError
		if errors.As(f.err, &de) {
			e.stats.driverErrs.Add(1)
			attrs = append(attrs, "cuda_error", de.Name, "call", de.Op, "device", de.Device)
			if e.cfg.OnError != nil {
				e.cfg.OnError(de.Op, de.Name)
			}
		}
		e.log.Error("cuda copy batch failed", attrs...)
	case f.b.ToArena:
		e.stats.toArena.Add(f.bytes)
	default:
		e.stats.toDevice.Add(f.bytes)
	}
	e.depth.Add(-1)
	f.b.Done(f.err)
}

// Close implements dma.Engine: queued batches are issued and drain (a batch
// waiting for its ready event waits at most ReadyTimeout), the engine's
// goroutines stop, then regions still open are unmapped, the arena is
// unregistered if SetArena(nil) has not done it, and the devices' streams
// and contexts are released. A second Close does nothing.
func (e *Engine) Close() error {
	e.mu.Lock()
	e.mu.closed = true // no new device, so no new waiter goroutine
	e.mu.Unlock()
	e.qmu.Lock()
	if e.qmu.closed {
		e.qmu.Unlock()
		return nil
	}
	e.qmu.closed = true
	close(e.queue)
	e.qmu.Unlock()
	e.wg.Wait()

	e.mu.Lock()
	defer e.mu.Unlock()
	var errs []error
	for k, m := range e.mu.maps {
		e.log.Warn("CUDA IPC memory still mapped at Close", "device", m.dev.ord, "regions", m.refs)
		m.closed = true
		errs = append(errs, m.dev.ipcClose(m.addr))
		delete(e.mu.maps, k)
	}
	if a := e.arena.Swap(nil); a != nil {
		errs = append(errs, a.dev.hostUnregister(a.mem))
	}
	for ord, d := range e.mu.devices {
		errs = append(errs, d.release())
		delete(e.mu.devices, ord)
	}
	e.log.Info("cuda copy engine stopped", "batches", e.stats.batches.Load(), "failed", e.stats.failed.Load())
	if err := e.Err(); err != nil {
		// The context is gone: the driver refuses every release. Say so
		// once rather than as a pile of secondary errors.
		return fmt.Errorf("cuda: the copy engine had failed: %w", err)
	}
	return errors.Join(errs...)
}
