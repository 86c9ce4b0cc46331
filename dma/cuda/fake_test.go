package cuda

import (
	"fmt"
	"sync"
)

// fakeDriver stands in for the CUDA driver in tests. Device memory is Go
// memory behind made-up addresses; each stream is a queue of operations
// that run when the engine queries an event (as if the GPU had got on with
// them meanwhile) unless the test holds copies back or a stream waits on an
// IPC event the test has not signalled. Faults are injected by name.
type fakeDriver struct {
	mu      sync.Mutex
	devices int
	allocs  map[[IPCHandleBytes]byte]*fakeAlloc
	ipcEvs  map[[IPCHandleBytes]byte]*fakeIPCEvent
	gpus    map[int]*fakeGPU
	queried chan struct{} // gets a token on every query

	hold       bool   // copies do not run until released
	failCopyAt int    // the n-th copy call (1-based) fails; 0: none
	failRecord bool   // record fails
	faultQuery string // queries report this device fault

	copyCalls  []Run
	opens      int
	closes     int
	registered []byte
	nextAddr   uint64
	destroyed  int
	recorded   int
}

type fakeAlloc struct {
	mem  []byte
	addr uint64 // while opened
}

type fakeIPCEvent struct{ signalled bool }

type fakeEvent struct{ done bool }

type fakeOp struct {
	copy func()
	wait *fakeIPCEvent
	rec  *fakeEvent
}

type fakeGPU struct {
	d        *fakeDriver
	ord      int
	streams  [][]fakeOp
	released bool
}

func newFakeDriver(devices int) *fakeDriver {
	return &fakeDriver{
		devices:  devices,
		allocs:   map[[IPCHandleBytes]byte]*fakeAlloc{},
		ipcEvs:   map[[IPCHandleBytes]byte]*fakeIPCEvent{},
		gpus:     map[int]*fakeGPU{},
		queried:  make(chan struct{}, 1),
		nextAddr: 1 << 40,
	}
}

// export makes n bytes of device memory reachable by the returned handle.
func (d *fakeDriver) export(fill byte, n int) ([]byte, []byte) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var h [IPCHandleBytes]byte
	h[0], h[1] = 0xc0, byte(len(d.allocs)+1)
	a := &fakeAlloc{mem: make([]byte, n)}
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
}

func (d *fakeDriver) setHold(hold bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hold = hold
}

// locked runs f under the driver's lock, for reading its counters.
func (d *fakeDriver) locked(f func()) {
	d.mu.Lock()
	defer d.mu.Unlock()
	f()
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
	for len(s) > 0 {
		op := s[0]
		switch {
		case op.copy != nil:
			if g.d.hold && !force {
				g.streams[stream] = s
				return
			}
			op.copy()
		case op.wait != nil:
			if !op.wait.signalled && !force {
				g.streams[stream] = s
				return
			}
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

func (d *fakeDriver) numDevices() (int, error) { return d.devices, nil }

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

func (g *fakeGPU) ipcOpen(h *[IPCHandleBytes]byte) (uint64, uint64, error) {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	a := d.allocs[*h]
	if a == nil {
		return 0, 0, fakeErr("cuIpcOpenMemHandle", "CUDA_ERROR_INVALID_HANDLE", 400)
	}
	if a.addr != 0 {
		return 0, 0, fmt.Errorf("handle opened twice")
	}
	d.opens++
	a.addr = d.nextAddr
	d.nextAddr += 1 << 36
	return a.addr, uint64(len(a.mem)), nil
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
	g.d.locked(func() { g.d.registered = mem })
	return nil
}

func (g *fakeGPU) hostUnregister(mem []byte) error {
	g.d.locked(func() { g.d.registered = nil })
	return nil
}

func (g *fakeGPU) release() error {
	g.d.locked(func() { g.released = true })
	return nil
}

func (g *fakeGPU) bind() error { return nil }

func (g *fakeGPU) waitIPCEvent(stream int, h []byte) error {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	ev := d.ipcEvs[[IPCHandleBytes]byte(h)]
	if ev == nil {
		return fakeErr("cuIpcOpenEventHandle", "CUDA_ERROR_INVALID_VALUE", 1)
	}
	g.streams[stream] = append(g.streams[stream], fakeOp{wait: ev})
	return nil
}

func (g *fakeGPU) copy(stream int, r Run, addr uint64, host []byte, toArena bool) error {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	d.copyCalls = append(d.copyCalls, r)
	if d.failCopyAt == len(d.copyCalls) {
		return fakeErr("cuMemcpy2DAsync", "CUDA_ERROR_INVALID_VALUE", 1)
	}
	if r.Rows > 1 && (r.RegionPitch < r.Width || r.ArenaPitch < r.Width) {
		return fakeErr("cuMemcpy2DAsync", "CUDA_ERROR_INVALID_VALUE", 1)
	}
	var mem []byte
	for _, a := range d.allocs {
		if a.addr != 0 && addr >= a.addr && addr-a.addr < uint64(len(a.mem)) {
			mem = a.mem[addr-a.addr:]
		}
	}
	if mem == nil || (r.Rows-1)*r.RegionPitch+r.Width > uint64(len(mem)) {
		return fakeErr("cuMemcpy2DAsync", "CUDA_ERROR_INVALID_VALUE", 1)
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

func (g *fakeGPU) record(stream int) (event, error) {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.failRecord {
		return nil, fakeErr("cuEventRecord", "CUDA_ERROR_LAUNCH_FAILED", 719)
	}
	ev := &fakeEvent{}
	d.recorded++
	g.streams[stream] = append(g.streams[stream], fakeOp{rec: ev})
	return ev, nil
}

func (g *fakeGPU) query(ev event) (bool, error) {
	d := g.d
	d.mu.Lock()
	defer d.mu.Unlock()
	select {
	case d.queried <- struct{}{}:
	default:
	}
	if d.faultQuery != "" {
		return false, fakeErr("cuEventQuery", d.faultQuery, 700)
	}
	d.progressLocked()
	return ev.(*fakeEvent).done, nil
}

func (g *fakeGPU) destroy(ev event) error {
	g.d.locked(func() { g.d.destroyed++ })
	return nil
}

func (g *fakeGPU) sync(stream int) error {
	g.d.locked(func() { g.runLocked(stream, true) })
	return nil
}
