//go:build cuda

package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"gorgonia.org/cu"
)

// New starts a copy engine over the GPUs this process sees. A device is set
// up (primary context retained, streams made) when a region or the arena
// first needs it.
func New(cfg Config) (*Engine, error) {
	e, err := newEngine(cuDriver{}, cfg)
	if err != nil {
		return nil, err
	}
	batch, berr := haveMemcpyBatch()
	e.log.Info("cuda copy engine started", "devices", len(e.uuids), "driver_version", cu.Version(),
		"memcpy_batch", batch, "memcpy_batch_err", berr)
	return e, nil
}

// cuDriver is the real driver: gorgonia.org/cu for contexts, streams and
// copies, driver.go for what cu lacks.
type cuDriver struct{}

func (cuDriver) numDevices() (int, error) {
	n, err := cu.NumDevices()
	return n, fromCU("cuDeviceGetCount", -1, err)
}

func (cuDriver) deviceUUID(ord int) ([UUIDBytes]byte, error) { return deviceUUID(ord) }

func (cuDriver) pciBusID(ord int) (string, error) { return pciBusID(ord) }

func (cuDriver) openDevice(ord, streamsPerDirection int) (gpu, error) {
	dev, err := cu.GetDevice(ord)
	if err != nil {
		return nil, fromCU("cuDeviceGet", ord, err)
	}
	ctx, err := dev.RetainPrimaryCtx()
	if err != nil {
		return nil, fromCU("cuDevicePrimaryCtxRetain", ord, err)
	}
	g := &cuGPU{ord: ord, dev: dev, ctx: ctx}
	g.batch, _ = haveMemcpyBatch()
	err = g.do(func() error {
		p, err := dev.Attribute(cu.MaxPitch)
		if err != nil {
			return fromCU("cuDeviceGetAttribute", ord, err)
		}
		g.pitch = uint64(p)
		for range 2 * streamsPerDirection {
			// Non-blocking: the copies must not serialize with work other
			// code might put on the legacy default stream.
			s, err := cu.MakeStream(cu.NonBlocking)
			if err != nil {
				return fromCU("cuStreamCreate", ord, err)
			}
			g.streams = append(g.streams, s)
		}
		return nil
	})
	if err != nil {
		return nil, errors.Join(err, g.release())
	}
	return g, nil
}

type cuGPU struct {
	ord     int
	dev     cu.Device
	ctx     cu.CUContext
	pitch   uint64
	batch   bool
	streams []cu.Stream
}

// do runs f with the device's context current on a locked OS thread, and
// leaves the thread's context stack as it found it.
func (g *cuGPU) do(f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cu.PushCurrentCtx(g.ctx); err != nil {
		return fromCU("cuCtxPushCurrent", g.ord, err)
	}
	defer cu.PopCurrentCtx()
	return f()
}

func (g *cuGPU) maxPitch() uint64 { return g.pitch }

func (g *cuGPU) batchCopies() bool { return g.batch }

func (g *cuGPU) ipcOpen(h *[IPCHandleBytes]byte) (m ipcMapping, err error) {
	err = g.do(func() error {
		p, err := ipcOpenMem(g.ord, h)
		if err != nil {
			return err
		}
		n, base, err := p.AddressRange()
		if err != nil {
			err = fromCU("cuMemGetAddressRange", g.ord, err)
		} else if base > p || uint64(n) <= uint64(p-base) {
			err = fmt.Errorf("the driver mapped the handle at %v, outside the allocation it reports (%v, %d bytes)", p, base, n)
		}
		var ord int
		if err == nil {
			ord, err = pointerDevice(g.ord, p)
		}
		if err != nil {
			return errors.Join(err, ipcCloseMem(g.ord, p))
		}
		m = ipcMapping{addr: uint64(p), size: uint64(n) - uint64(p-base), device: ord}
		return nil
	})
	return m, err
}

func (g *cuGPU) ipcClose(addr uint64) error {
	return g.do(func() error { return ipcCloseMem(g.ord, cu.DevicePtr(addr)) })
}

func (g *cuGPU) hostRegister(mem []byte) error {
	return g.do(func() error { return memHostRegister(g.ord, unsafe.Pointer(unsafe.SliceData(mem)), uint64(len(mem))) })
}

func (g *cuGPU) hostUnregister(mem []byte) error {
	return g.do(func() error { return memHostUnregister(g.ord, unsafe.Pointer(unsafe.SliceData(mem))) })
}

func (g *cuGPU) release() error {
	err := g.do(func() error {
		var errs []error
		for i := range g.streams {
			errs = append(errs, fromCU("cuStreamDestroy", g.ord, g.streams[i].Destroy()))
		}
		g.streams = nil
		return errors.Join(errs...)
	})
	return errors.Join(err, fromCU("cuDevicePrimaryCtxRelease", g.ord, g.dev.ReleasePrimaryCtx()))
}

func (g *cuGPU) bind() error {
	return fromCU("cuCtxSetCurrent", g.ord, cu.SetCurrentContext(g.ctx))
}

func (g *cuGPU) openEvent(h []byte) (event, error) { return ipcOpenEvent(g.ord, h) }

func (g *cuGPU) query(ev event) (bool, error) { return ev.(*cEvent).query(g.ord) }

func (g *cuGPU) destroy(ev event) error { return ev.(*cEvent).destroy(g.ord) }

func (g *cuGPU) copy(stream int, r Run, addr uint64, host []byte, toArena bool) error {
	s := g.streams[stream]
	dptr := cu.DevicePtr(addr)
	hptr := unsafe.Pointer(unsafe.SliceData(host))
	if r.Rows == 1 {
		if toArena {
			return fromCU("cuMemcpyDtoHAsync", g.ord, cu.MemcpyDtoHAsync(hptr, dptr, int64(r.Width), s))
		}
		return fromCU("cuMemcpyHtoDAsync", g.ord, cu.MemcpyHtoDAsync(dptr, hptr, int64(r.Width), s))
	}
	p := cu.Memcpy2dParam{WidthInBytes: int64(r.Width), Height: int64(r.Rows)}
	if toArena {
		p.SrcMemoryType, p.SrcDevice, p.SrcPitch = cu.DeviceMemory, dptr, int64(r.RegionPitch)
		p.DstMemoryType, p.DstHost, p.DstPitch = cu.HostMemory, hptr, int64(r.ArenaPitch)
	} else {
		p.SrcMemoryType, p.SrcHost, p.SrcPitch = cu.HostMemory, hptr, int64(r.ArenaPitch)
		p.DstMemoryType, p.DstDevice, p.DstPitch = cu.DeviceMemory, dptr, int64(r.RegionPitch)
	}
	return fromCU("cuMemcpy2DAsync", g.ord, cu.Memcpy2DAsync(p, s))
}

func (g *cuGPU) copyBatch(stream int, spans []span, toArena bool) error {
	return memcpyBatch(g.ord, g.streams[stream], spans, toArena)
}

func (g *cuGPU) record(stream int) (event, error) { return recordEvent(g.ord, g.streams[stream]) }

func (g *cuGPU) wait(ev event) error { return ev.(*cEvent).sync(g.ord) }

func (g *cuGPU) sync(stream int) error {
	return fromCU("cuStreamSynchronize", g.ord, g.streams[stream].Synchronize())
}

func (g *cuGPU) injectFault(stream int) error { return injectTrap(g.ord, g.streams[stream]) }
