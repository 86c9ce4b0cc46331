package cuda

import (
	"fmt"
	"sync"
	"unsafe"
)

// fakeDriver stands in for the CUDA driver in tests. Device memory is Go
// memory behind made-up addresses; each stream is a queue of operations
// that run when the engine waits for or queries an event (as if the GPU had
// got on with them meanwhile) unless the test holds copies back. IPC events
// complete when the test signals them. Faults are injected by name.
type fakeDriver struct {
	mu      sync.Mutex
	cond    *sync.Cond // broadcast when the test changes what may run
	devices int
	allocs  map[[IPCHandleBytes]byte]*fakeAlloc
	ipcEvs  map[[IPCHandleBytes]byte]*fakeIPCEvent
	gpus    map[int]*fakeGPU
	queried chan struct{} // gets a token on every query and wait

	hold       bool         // copies do not run until released
	noBatch    bool         // the driver has no cuMemcpyBatchAsync
	failCopyAt int          // the n-th copy call (1-based) fails; 0: none
	failCopyAs *DriverError // ...with this error (default CUDA_ERROR_INVALID_VALUE)
	failRecord bool         // record fails
	faultWait  string       // waits report this error...
	faultCode  int          // ...with this code
	faultSync  string       // and so does sync, when set
	badBusID   bool

	copyCalls  []Run
	batchCalls [][]span
	opens      int
	closes     int
	registered []byte
	registerOn int // device whose context registered the arena
	nextAddr   uint64
	destroyed  int
	recorded   int
	openedEvs  int
	injected   int
	syncs      int
	waits      int // wait calls
	polls      int // queries of completion events (not IPC events)
}

type fakeAlloc struct {
	mem    []byte
	device int    // where the memory is
	addr   uint64 // while opened
}

type fakeIPCEvent struct {
	signalled bool
	failed    string // query reports this error
}

type fakeEvent struct{ done bool }

type fakeOp struct {
	copy  func()
	rec   *fakeEvent
	fault bool
}

type fakeGPU struct {
	d        *fakeDriver
	ord      int
	streams  [][]fakeOp
	released bool
	lost     bool // a kernel trapped: the context is gone
}

func newFakeDriver(devices int) *fakeDriver {
	d := &fakeDriver{
		devices:    devices,
		allocs:     map[[IPCHandleBytes]byte]*fakeAlloc{},
		ipcEvs:     map[[IPCHandleBytes]byte]*fakeIPCEvent{},
		gpus:       map[int]*fakeGPU{},
		queried:    make(chan struct{}, 1),
		nextAddr:   1 << 40,
		registerOn: -1,
	}
	d.cond = sync.NewCond(&d.mu)
	return d
}

func fakeUUID(ord int) [UUIDBytes]byte {
	return [UUIDBytes]byte{0xaa, byte(ord), 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, byte(ord)}
}

// export makes n bytes of memory on device dev reachable by the returned
// handle.
func (d *fakeDriver) export(dev int, fill byte, n int) ([]byte, []byte) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var h [IPCHandleBytes]byte
	h[0], h[1] = 0xc0, byte(len(d.allocs)+1)
	a := &fakeAlloc{mem: make([]byte, n), device: dev}
	for i := range a.mem {
		a.mem[i] = fill
	}
	d.allocs[h] = a
	return h[:], a.mem
}

// exportEvent makes an unsignalled IPC event.
func (d *fakeDriver) exportEvent() []byte {
	d.mu.Lock()
	defer d.mu.Unlock()
	var h [IPCHandleBytes]byte
	h[0], h[1] = 0xe0, byte(len(d.ipcEvs)+1)
	d.ipcEvs[h] = &fakeIPCEvent{}
	return h[:]
}

func (d *fakeDriver) signal(h []byte) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.ipcEvs[[IPCHandleBytes]byte(h)].signalled = true
	d.cond.Broadcast()
}

// releaseAll lets every held copy run and every IPC event complete.
func (d *fakeDriver) releaseAll() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hold = false
	for _, ev := range d.ipcEvs {
		ev.signalled = true
	}
	d.cond.Broadcast()
}

func (d *fakeDriver) setHold(hold bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hold = hold
	d.cond.Broadcast()
}

// locked runs f under the driver's lock, for reading its counters or
// injecting faults.
func (d *fakeDriver) locked(f func()) {
	d.mu.Lock()
	defer d.mu.Unlock()
	f()
	d.cond.Broadcast()
}

// progressLocked runs every stream as far as it can go.
func (d *fakeDriver) progressLocked() {
	for _, g := range d.gpus {
		for i := range g.streams {
			g.runLocked(i, false)
		}
	}
}

func (g *fakeGPU) runLocked(stream int, force bool) {
	s := g.streams[stream]
	for len(s) > 0 && !g.lost {
		op := s[0]
		switch {
		case op.fault:
			g.lost = true // the rest of the stream never runs
			g.streams[stream] = nil
			return
		case op.copy != nil:
			if g.d.hold && !force {
				g.streams[stream] = s
				return
			}
			op.copy()
		case op.rec != nil:
			op.rec.done = true
		}
		s = s[1:]
	}
	g.streams[stream] = s
}

func fakeErr(op, name string, code int) *DriverError {
	return &DriverError{Op: op, Code: code, Name: name}
}

// lostErr is what every call returns once a kernel trapped.
func (g *fakeGPU) lostErr(op string) error {
	return &DriverError{Op: op, Device: g.ord, Code: 719, Name: "CUDA_ERROR_LAUNCH_FAILED"}
}

func (d *fakeDriver) numDevices() (int, error) { return d.devices, nil }

func (d *fakeDriver) deviceUUID(ord int) ([UUIDBytes]byte, error) { return fakeUUID(ord), nil }

func (d *fakeDriver) pciBusID(ord int) (string, error) {
	if d.badBusID {
		return "", fakeErr("cuDeviceGetPCIBusId", "CUDA_ERROR_INVALID_DEVICE", 101)
	}
	return fmt.Sprintf("0000:%02X:00.0", 0x1A+ord), nil
}

func (d *fakeDriver) openDevice(ord, n int) (gpu, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.gpus[ord] != nil {
		return nil, fmt.Errorf("device %d set up twice", ord)
	}
	g := &fakeGPU{d: d, ord: ord, streams: make([][]fakeOp, 2*n)}
	d.gpus[ord] = g
	return g, nil
}

func (g *fakeGPU) maxPitch() uint64 { return 1 << 31 }

func (g *fakeGPU) batchCopies() bool {
	g.d.mu.Lock()
	defer g.d.mu.Unlock()
	return !g.d.noBatch
}

func (g *fakeGPU) ipcOpen(h *[IPCHandleBytes]byte) (ipcMapping, error) {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	a := d.allocs[*h]
	if a == nil {
		return ipcMapping{}, fakeErr("cuIpcOpenMemHandle", "CUDA_ERROR_INVALID_HANDLE", 400)
	}
	if a.addr != 0 {
		return ipcMapping{}, fmt.Errorf("handle opened twice")
	}
	d.opens++
	a.addr = d.nextAddr
	d.nextAddr += 1 << 36
	return ipcMapping{addr: a.addr, size: uint64(len(a.mem)), device: a.device}, nil
}

func (g *fakeGPU) ipcClose(addr uint64) error {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, a := range d.allocs {
		if a.addr == addr {
			a.addr = 0
			d.closes++
			return nil
		}
	}
	return fakeErr("cuIpcCloseMemHandle", "CUDA_ERROR_INVALID_VALUE", 1)
}

func (g *fakeGPU) hostRegister(mem []byte) error {
	g.d.locked(func() { g.d.registered, g.d.registerOn = mem, g.ord })
	return nil
}

func (g *fakeGPU) hostUnregister(mem []byte) error {
	var err error
	g.d.locked(func() {
		if g.d.registered == nil || unsafe.SliceData(g.d.registered) != unsafe.SliceData(mem) {
			err = fakeErr("cuMemHostUnregister", "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", 713)
		}
		g.d.registered = nil
	})
	return err
}

func (g *fakeGPU) release() error {
	g.d.locked(func() { g.released = true })
	return nil
}

func (g *fakeGPU) bind() error { return nil }

func (g *fakeGPU) openEvent(h []byte) (event, error) {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if g.lost {
		return nil, g.lostErr("cuIpcOpenEventHandle")
	}
	ev := d.ipcEvs[[IPCHandleBytes]byte(h)]
	if ev == nil {
		return nil, fakeErr("cuIpcOpenEventHandle", "CUDA_ERROR_INVALID_VALUE", 1)
	}
	d.openedEvs++
	return ev, nil
}

func (g *fakeGPU) tick() {
	select {
	case g.d.queried <- struct{}{}:
	default:
	}
}

func (g *fakeGPU) query(ev event) (bool, error) {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	g.tick()
	if g.lost {
		return false, g.lostErr("cuEventQuery")
	}
	d.progressLocked()
	switch ev := ev.(type) {
	case *fakeIPCEvent:
		if ev.failed != "" {
			return false, fakeErr("cuEventQuery", ev.failed, 400)
		}
		return ev.signalled, nil
	case *fakeEvent:
		d.polls++
		return ev.done, nil
	}
	return false, fmt.Errorf("query of %T", ev)
}

func (g *fakeGPU) destroy(ev event) error {
	g.d.locked(func() { g.d.destroyed++ })
	return nil
}

func (g *fakeGPU) checkCopyLocked(dev uint64, rows, width, pitch uint64) ([]byte, error) {
	for _, a := range g.d.allocs {
		if a.addr != 0 && dev >= a.addr && dev-a.addr < uint64(len(a.mem)) {
			mem := a.mem[dev-a.addr:]
			if (rows-1)*pitch+width > uint64(len(mem)) {
				break
			}
			return mem, nil
		}
	}
	return nil, fakeErr("cuMemcpy", "CUDA_ERROR_INVALID_VALUE", 1)
}

func (g *fakeGPU) copy(stream int, r Run, addr uint64, host []byte, toArena bool) error {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if g.lost {
		return g.lostErr("cuMemcpy2DAsync")
	}
	d.copyCalls = append(d.copyCalls, r)
	if d.failCopyAt == len(d.copyCalls)+len(d.batchCalls) {
		if d.failCopyAs != nil {
			g.lost = d.failCopyAs.Sticky()
			return d.failCopyAs
		}
		return fakeErr("cuMemcpy2DAsync", "CUDA_ERROR_INVALID_VALUE", 1)
	}
	if r.Rows > 1 && (r.RegionPitch < r.Width || r.ArenaPitch < r.Width) {
		return fakeErr("cuMemcpy2DAsync", "CUDA_ERROR_INVALID_VALUE", 1)
	}
	mem, err := g.checkCopyLocked(addr, r.Rows, r.Width, r.RegionPitch)
	if err != nil {
		return err
	}
	if (r.Rows-1)*r.ArenaPitch+r.Width != uint64(len(host)) {
		return fmt.Errorf("host slice is %d bytes, the run spans %d", len(host), (r.Rows-1)*r.ArenaPitch+r.Width)
	}
	g.streams[stream] = append(g.streams[stream], fakeOp{copy: func() {
		for row := uint64(0); row < r.Rows; row++ {
			dev := mem[row*r.RegionPitch:][:r.Width]
			h := host[row*r.ArenaPitch:][:r.Width]
			if toArena {
				copy(h, dev)
			} else {
				copy(dev, h)
			}
		}
	}})
	return nil
}

func (g *fakeGPU) copyBatch(stream int, spans []span, toArena bool) error {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if g.lost {
		return g.lostErr("cuMemcpyBatchAsync")
	}
	if d.noBatch {
		return fmt.Errorf("copyBatch called on a driver without cuMemcpyBatchAsync")
	}
	d.batchCalls = append(d.batchCalls, append([]span(nil), spans...))
	if d.failCopyAt == len(d.copyCalls)+len(d.batchCalls) {
		return fakeErr("cuMemcpyBatchAsync", "CUDA_ERROR_INVALID_VALUE", 1)
	}
	type op struct{ dev, host []byte }
	ops := make([]op, len(spans))
	for i, s := range spans {
		mem, err := g.checkCopyLocked(s.dev, 1, uint64(len(s.host)), 0)
		if err != nil {
			return err
		}
		if r := d.registered; len(r) == 0 || uintptr(unsafe.Pointer(unsafe.SliceData(s.host))) < uintptr(unsafe.Pointer(unsafe.SliceData(r))) ||
			uintptr(unsafe.Pointer(unsafe.SliceData(s.host)))+uintptr(len(s.host)) > uintptr(unsafe.Pointer(unsafe.SliceData(r)))+uintptr(len(r)) {
			return fakeErr("cuMemcpyBatchAsync", "CUDA_ERROR_INVALID_VALUE", 1)
		}
		ops[i] = op{dev: mem[:len(s.host)], host: s.host}
	}
	g.streams[stream] = append(g.streams[stream], fakeOp{copy: func() {
		for _, o := range ops {
			if toArena {
				copy(o.host, o.dev)
			} else {
				copy(o.dev, o.host)
			}
		}
	}})
	return nil
}

func (g *fakeGPU) record(stream int) (event, error) {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if g.lost {
		return nil, g.lostErr("cuEventRecord")
	}
	if d.failRecord {
		return nil, fakeErr("cuEventRecord", "CUDA_ERROR_INVALID_HANDLE", 400)
	}
	ev := &fakeEvent{}
	d.recorded++
	g.streams[stream] = append(g.streams[stream], fakeOp{rec: ev})
	return ev, nil
}

// wait blocks, like cuEventSynchronize on a blocking-sync event, until the
// stream has run up to ev.
func (g *fakeGPU) wait(ev event) error {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	d.waits++
	for {
		g.tick()
		if d.faultWait != "" {
			return fakeErr("cuEventSynchronize", d.faultWait, d.faultCode)
		}
		d.progressLocked()
		if g.lost {
			return g.lostErr("cuEventSynchronize")
		}
		if ev.(*fakeEvent).done {
			return nil
		}
		d.cond.Wait()
	}
}

func (g *fakeGPU) sync(stream int) error {
	var err error
	g.d.locked(func() {
		g.d.syncs++
		if g.d.faultSync != "" {
			err = fakeErr("cuStreamSynchronize", g.d.faultSync, g.d.faultCode)
			return
		}
		g.runLocked(stream, true)
		if g.lost {
			err = g.lostErr("cuStreamSynchronize")
		}
	})
	return err
}

func (g *fakeGPU) injectFault(stream int) error {
	g.d.locked(func() {
		g.d.injected++
		g.streams[stream] = append(g.streams[stream], fakeOp{fault: true})
	})
	return nil
}
