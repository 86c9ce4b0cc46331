package cuda

import (
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
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
	// ipcOpen maps the allocation behind an IPC memory handle and returns
	// its device address and the size the driver knows it by.
	ipcOpen(h *[IPCHandleBytes]byte) (addr, size uint64, err error)
	ipcClose(addr uint64) error
	// hostRegister page-locks mem for every context (portable).
	hostRegister(mem []byte) error
	hostUnregister(mem []byte) error
	// release destroys the streams and releases the primary context.
	release() error

	bind() error
	// waitIPCEvent makes the stream wait for the work another process
	// recorded in the IPC event h, as of now.
	waitIPCEvent(stream int, h []byte) error
	// copy queues run r between device address addr (its first row) and
	// host, the arena bytes from its first row to the end of its last.
	copy(stream int, r Run, addr uint64, host []byte, toArena bool) error
	// record queues an event after the stream's work so far.
	record(stream int) (event, error)
	// query reports whether ev has completed. An error means the device
	// stopped running the stream's work: it will never complete.
	query(ev event) (bool, error)
	destroy(ev event) error
	// sync waits for the stream's work so far.
	sync(stream int) error
}

// event is a driver's completion event.
type event any

// Config configures the engine. The zero value is usable.
type Config struct {
	// StreamsPerDirection is the number of copy streams per device and
	// direction (default 2). Batches take them in turn, so one batch's
	// copies are queued while another's run.
	StreamsPerDirection int
	// QueueDepth is the number of batches Submit queues before it blocks
	// (default 64).
	QueueDepth int
	// ArenaDevice is the device whose primary context registers the arena
	// (default 0). The registration is portable: every device sees it pinned.
	ArenaDevice int
	// PollMin and PollMax bound the pause between two checks of the
	// completion events of batches in flight (defaults 5µs and 200µs). The
	// pause doubles while nothing completes and drops back to PollMin when
	// something does, so a completion is noticed within about PollMax.
	PollMin, PollMax time.Duration
	Logger           *slog.Logger
	// OnError, when set, is called once for each batch the driver failed,
	// with the driver call and its error name (for example
	// "cuMemcpy2DAsync", "CUDA_ERROR_ILLEGAL_ADDRESS"), on the engine's
	// goroutine, before the batch's Done. Meant for a labelled counter.
	OnError func(op, name string)
}

// Stats are the engine's counters since it started.
type Stats struct {
	Batches       uint64 // batches done, failed ones included
	FailedBatches uint64 // batches done with an error
	DriverErrors  uint64 // batches the CUDA driver failed (part of FailedBatches)
	Copies        uint64 // copies of issued batches
	DriverCopies  uint64 // driver copy calls those became after coalescing
	BytesToArena  uint64 // bytes of successful store batches
	BytesToDevice uint64 // bytes of successful load batches
}

// Engine is the CUDA copy engine. See the package documentation.
type Engine struct {
	cfg        Config
	drv        driver
	log        *slog.Logger
	numDevices int

	arena atomic.Pointer[arena]

	queue chan *dma.Batch // Submit -> submitter
	wg    sync.WaitGroup  // submitter and poller
	depth atomic.Int64

	// issued hands batches from the submitter to the poller. It is a list,
	// not a channel, so that the submitter never waits for the poller: a
	// Done (run by the poller) may then call Submit without deadlocking.
	issued struct {
		sync.Mutex
		list []*inflight
		done bool // the submitter has stopped
	}
	wake chan struct{} // a token when issued changed

	stats struct {
		batches, failed, driverErrs, copies, driverCopies, toArena, toDevice atomic.Uint64
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
	}
}

var _ dma.Engine = (*Engine)(nil)

type arena struct {
	mem []byte
	dev *device // whose context registered it
}

// device is a gpu and the engine's round-robin over its streams.
type device struct {
	gpu
	ord      int
	nstreams int
	next     [2]int // only the submitter touches it
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

// inflight is a batch whose copies are queued on the GPU.
type inflight struct {
	b      *dma.Batch
	events []deviceEvent // recorded after the batch's last copy, one per device
	bytes  uint64
	err    error
}

type deviceEvent struct {
	d  *device
	ev event
}

func newEngine(drv driver, cfg Config) (*Engine, error) {
	if cfg.StreamsPerDirection <= 0 {
		cfg.StreamsPerDirection = 2
	}
	if cfg.QueueDepth <= 0 {
		cfg.QueueDepth = 64
	}
	if cfg.PollMin <= 0 {
		cfg.PollMin = 5 * time.Microsecond
	}
	if cfg.PollMax < cfg.PollMin {
		cfg.PollMax = max(cfg.PollMin, 200*time.Microsecond)
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
	if cfg.ArenaDevice < 0 || cfg.ArenaDevice >= n {
		return nil, fmt.Errorf("cuda: arena device %d: this process sees %d CUDA devices", cfg.ArenaDevice, n)
	}
	e := &Engine{
		cfg:        cfg,
		drv:        drv,
		log:        cfg.Logger.With("dma", "cuda"),
		numDevices: n,
		queue:      make(chan *dma.Batch, cfg.QueueDepth),
		wake:       make(chan struct{}, 1),
	}
	e.mu.devices = map[int]*device{}
	e.mu.maps = map[ipcKey]*mapping{}
	e.wg.Add(2)
	go e.submitter()
	go e.poller()
	return e, nil
}

// Name implements dma.Engine.
func (e *Engine) Name() string { return "cuda" }

// Stats returns the engine's counters.
func (e *Engine) Stats() Stats {
	s := &e.stats
	return Stats{
		Batches: s.batches.Load(), FailedBatches: s.failed.Load(), DriverErrors: s.driverErrs.Load(),
		Copies: s.copies.Load(), DriverCopies: s.driverCopies.Load(),
		BytesToArena: s.toArena.Load(), BytesToDevice: s.toDevice.Load(),
	}
}

// deviceLocked returns device ord, setting it up on first use.
func (e *Engine) deviceLocked(ord int) (*device, error) {
	if d := e.mu.devices[ord]; d != nil {
		return d, nil
	}
	g, err := e.drv.openDevice(ord, e.cfg.StreamsPerDirection)
	if err != nil {
		return nil, err
	}
	d := &device{gpu: g, ord: ord, nstreams: e.cfg.StreamsPerDirection}
	e.mu.devices[ord] = d
	e.log.Info("cuda device ready", "device", ord, "streams_per_direction", d.nstreams, "max_pitch", d.maxPitch())
	return d, nil
}

// SetArena implements dma.Engine: it registers the arena as pinned, portable
// host memory. The arena must not be Go heap memory (the daemon maps it with
// mmap): the driver keeps its address.
func (e *Engine) SetArena(mem []byte) error {
	if len(mem) == 0 {
		return errors.New("cuda: the arena is empty")
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mu.closed {
		return errors.New("cuda: copy engine is closed")
	}
	d, err := e.deviceLocked(e.cfg.ArenaDevice)
	if err != nil {
		return fmt.Errorf("cuda: set up device %d for the arena: %w", e.cfg.ArenaDevice, err)
	}
	if old := e.arena.Swap(nil); old != nil {
		if err := old.dev.hostUnregister(old.mem); err != nil {
			return fmt.Errorf("cuda: unregister the previous arena: %w", err)
		}
	}
	start := time.Now()
	if err := d.hostRegister(mem); err != nil {
		return fmt.Errorf("cuda: register the %d-byte arena as pinned memory: %w", len(mem), err)
	}
	e.arena.Store(&arena{mem: mem, dev: d})
	e.log.Info("arena registered as pinned memory", "bytes", len(mem), "took", time.Since(start))
	return nil
}

// Open implements dma.Engine: it maps the allocation behind spec's IPC
// handle, once per device and handle however many regions are carved from
// it, and checks that the allocation as the driver knows it covers the
// client's alloc_size. The driver cannot say which process exported a
// handle, so peer is only logged (see the package documentation).
func (e *Engine) Open(spec dma.RegionSpec, peer dma.Peer) (dma.Region, error) {
	key, err := parseRegion(spec, e.numDevices)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mu.closed {
		return nil, fmt.Errorf("%w: copy engine is closed", dma.ErrBadRegion)
	}
	d, err := e.deviceLocked(key.device)
	if err != nil {
		return nil, fmt.Errorf("%w: set up CUDA device %d: %w", dma.ErrBadRegion, key.device, err)
	}
	m := e.mu.maps[key]
	if m == nil {
		addr, size, err := d.ipcOpen(&key.handle)
		if err != nil {
			return nil, fmt.Errorf("%w: open the CUDA IPC memory handle of pid %d on device %d: %w", dma.ErrBadRegion, peer.PID, d.ord, err)
		}
		m = &mapping{key: key, dev: d, addr: addr, size: size}
		e.mu.maps[key] = m
		e.log.Debug("CUDA IPC memory opened", "device", d.ord, "bytes", size, "pid", peer.PID)
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

// Submit implements dma.Engine. The batch is checked and issued on the
// engine's goroutine, and Done runs on another of the engine's goroutines,
// once the event recorded after the batch's last copy has completed. Done
// may call Submit; it should return quickly, as it holds up the completion
// of other batches.
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

// submitter issues queued batches. It keeps one OS thread so that a device's
// context stays current between driver calls.
func (e *Engine) submitter() {
	defer e.wg.Done()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var p planner
	var cur *device
	for b := range e.queue {
		f := e.issue(b, &p, &cur)
		e.issued.Lock()
		e.issued.list = append(e.issued.list, f)
		e.issued.Unlock()
		e.notify()
	}
	e.issued.Lock()
	e.issued.done = true
	e.issued.Unlock()
	e.notify()
}

func (e *Engine) notify() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// bind makes d's context current on the calling engine goroutine's thread,
// where *cur is the device last bound there.
func bind(d *device, cur **device) error {
	if *cur == d {
		return nil
	}
	*cur = nil
	if err := d.bind(); err != nil {
		return err
	}
	*cur = d
	return nil
}

// issue checks a batch and queues its copies, and after them an event, on
// one stream of each device it touches. A batch that fails a check touches
// no memory. One that fails partway still records its event (or waits for
// its stream) so that its Done never comes while one of its copies could
// still be running.
func (e *Engine) issue(b *dma.Batch, p *planner, cur **device) *inflight {
	f := &inflight{b: b}
	if len(b.Copies) == 0 {
		return f
	}
	a := e.arena.Load()
	if a == nil {
		f.err = fmt.Errorf("%w: the arena is not set (SetArena)", dma.ErrCopy)
		return f
	}
	if b.ToArena {
		if err := ValidateEventHandle(b.ReadyEvent); err != nil {
			f.err = fmt.Errorf("%w: %v", dma.ErrCopy, err)
			return f
		}
	}
	maxPitch := ^uint64(0)
	var devs []*device // in order of first use; one in practice
	for i, c := range b.Copies {
		r, ok := c.Region.(*region)
		if !ok || r.e != e {
			f.err = fmt.Errorf("%w: copy %d: the region was not opened by this copy engine", dma.ErrCopy, i)
			return f
		}
		if r.closed.Load() {
			f.err = fmt.Errorf("%w: copy %d: the region is closed", dma.ErrCopy, i)
			return f
		}
		if err := checkCopy(c, r.size, uint64(len(a.mem))); err != nil {
			f.err = fmt.Errorf("%w: copy %d: %v", dma.ErrCopy, i, err)
			return f
		}
		d := r.m.dev
		maxPitch = min(maxPitch, d.maxPitch())
		if !slices.Contains(devs, d) {
			devs = append(devs, d)
		}
		f.bytes += c.Len
	}
	runs := p.plan(b.Copies, maxPitch)
	e.stats.copies.Add(uint64(len(b.Copies)))
	e.stats.driverCopies.Add(uint64(len(runs)))
	for _, d := range devs {
		if err := bind(d, cur); err != nil {
			f.err = err
			break
		}
		s := d.stream(b.ToArena)
		var err error
		if b.ToArena && len(b.ReadyEvent) > 0 {
			err = d.waitIPCEvent(s, b.ReadyEvent)
		}
		for i := 0; err == nil && i < len(runs); i++ {
			r := runs[i]
			m := r.Region.(*region).m
			if m.dev != d {
				continue
			}
			last := r.ArenaOff + (r.Rows-1)*r.ArenaPitch + r.Width
			err = d.copy(s, r, m.addr+r.RegionOff, a.mem[r.ArenaOff:last:last], b.ToArena)
		}
		f.err = err
		// Whether or not every copy went in, mark the end of those that did.
		ev, rerr := d.record(s)
		if rerr == nil {
			f.events = append(f.events, deviceEvent{d: d, ev: ev})
		} else {
			// Without an event, wait here rather than report early.
			f.err = errors.Join(f.err, rerr, d.sync(s))
		}
		if f.err != nil {
			break
		}
	}
	if f.err != nil {
		f.err = fmt.Errorf("%w: %w", dma.ErrCopy, f.err)
	}
	return f
}

// poller watches the completion events of batches in flight and finishes a
// batch once its events have completed. It stops when the submitter has
// stopped and every batch is finished.
func (e *Engine) poller() {
	defer e.wg.Done()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var (
		waiting []*inflight
		cur     *device
		pause   = e.cfg.PollMin
		timer   = time.NewTimer(time.Hour)
	)
	timer.Stop()
	for {
		e.issued.Lock()
		waiting = append(waiting, e.issued.list...)
		clear(e.issued.list)
		e.issued.list = e.issued.list[:0]
		stopped := e.issued.done
		e.issued.Unlock()
		if len(waiting) == 0 {
			if stopped {
				return
			}
			<-e.wake
			continue
		}
		kept := waiting[:0]
		for _, f := range waiting {
			if e.drained(f, &cur) {
				e.finish(f)
			} else {
				kept = append(kept, f)
			}
		}
		progressed := len(kept) < len(waiting)
		clear(waiting[len(kept):])
		waiting = kept
		if progressed || len(waiting) == 0 {
			pause = e.cfg.PollMin
			continue
		}
		timer.Reset(pause)
		select {
		case <-e.wake:
			timer.Stop()
		case <-timer.C:
			pause = min(2*pause, e.cfg.PollMax)
		}
	}
}

// drained reports whether every event of f has completed, or failed (the
// device stopped running f's copies, and will run nothing more).
func (e *Engine) drained(f *inflight, cur **device) bool {
	for len(f.events) > 0 {
		de := f.events[0]
		err := bind(de.d, cur)
		if err == nil {
			var done bool
			done, err = de.d.query(de.ev)
			if !done && err == nil {
				return false
			}
		}
		if err != nil && f.err == nil {
			f.err = fmt.Errorf("%w: %w", dma.ErrCopy, err)
		}
		if derr := de.d.destroy(de.ev); derr != nil {
			e.log.Warn("destroying a completion event failed", "device", de.d.ord, "err", derr)
		}
		f.events = f.events[1:]
	}
	return true
}

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

// Close implements dma.Engine: queued batches are issued and drain, the
// engine's goroutines stop, then the arena is unregistered, regions still
// open are unmapped, and the devices' streams and contexts are released. A
// second Close does nothing.
func (e *Engine) Close() error {
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
	e.mu.closed = true
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
	return errors.Join(errs...)
}
