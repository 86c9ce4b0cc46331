//go:build cuda

package main

// What the check needs from the driver beyond gorgonia.org/cu: exporting and
// opening memory and events by IPC handle (both sides of the protocol),
// pinning host buffers, device UUIDs and pointer attributes, and a host
// function that stalls a stream.

/*
#include <cuda.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

static CUresult gcIpcGetMem(void *out, CUdeviceptr p) {
	CUipcMemHandle h;
	CUresult r = cuIpcGetMemHandle(&h, p);
	memcpy(out, h.reserved, CU_IPC_HANDLE_SIZE);
	return r;
}

static CUresult gcIpcOpenMem(CUdeviceptr *p, const void *in) {
	CUipcMemHandle h;
	memcpy(h.reserved, in, CU_IPC_HANDLE_SIZE);
	return cuIpcOpenMemHandle(p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
}

static CUresult gcIpcEvent(CUevent *ev, void *out) {
	CUresult r = cuEventCreate(ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	CUipcEventHandle h;
	r = cuIpcGetEventHandle(&h, *ev);
	memcpy(out, h.reserved, CU_IPC_HANDLE_SIZE);
	return r;
}

static CUresult gcIpcOpenEvent(CUevent *ev, const void *in) {
	CUipcEventHandle h;
	memcpy(h.reserved, in, CU_IPC_HANDLE_SIZE);
	return cuIpcOpenEventHandle(ev, h);
}

static CUresult gcUuid(void *out, int ord) {
	CUdevice d;
	CUresult r = cuDeviceGet(&d, ord);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	CUuuid u;
	r = cuDeviceGetUuid_v2(&u, d);
	memcpy(out, u.bytes, 16);
	return r;
}

static CUresult gcPointerDevice(int *ord, CUdeviceptr p) {
	return cuPointerGetAttribute(ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
}

static void CUDA_CB gcSleep(void *us) { usleep((useconds_t)(uintptr_t)us); }

// gcStall makes the stream wait us microseconds on the host before its next
// work: a stand-in for the engine's kernels still writing the blocks.
static CUresult gcStall(CUstream s, unsigned int us) {
	return cuLaunchHostFunc(s, gcSleep, (void *)(uintptr_t)us);
}

static const char *gcErrorName(CUresult r) {
	const char *s = NULL;
	if (cuGetErrorName(r, &s) != CUDA_SUCCESS) {
		return NULL;
	}
	return s;
}

static CUresult gcHaveBatch(int *ok) {
	void *p = NULL;
	CUresult r = cuGetProcAddress("cuMemcpyBatchAsync", &p, 12080, CU_GET_PROC_ADDRESS_DEFAULT);
	*ok = (r == CUDA_SUCCESS && p != NULL);
	return r;
}
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"gorgonia.org/cu"
)

func check(op string, r C.CUresult) error {
	if r == C.CUDA_SUCCESS {
		return nil
	}
	name := fmt.Sprintf("CUresult(%d)", int(r))
	if s := C.gcErrorName(r); s != nil {
		name = C.GoString(s)
	}
	return fmt.Errorf("%s: %s", op, name)
}

func cStream(s cu.Stream) C.CUstream { return C.CUstream(unsafe.Pointer(s.C())) }

func ipcMemHandle(p cu.DevicePtr) ([]byte, error) {
	h := make([]byte, C.CU_IPC_HANDLE_SIZE)
	return h, check("cuIpcGetMemHandle", C.gcIpcGetMem(unsafe.Pointer(&h[0]), C.CUdeviceptr(p)))
}

func ipcOpenMem(h []byte) (cu.DevicePtr, error) {
	if len(h) != C.CU_IPC_HANDLE_SIZE {
		return 0, fmt.Errorf("memory handle is %d bytes", len(h))
	}
	var p C.CUdeviceptr
	err := check("cuIpcOpenMemHandle", C.gcIpcOpenMem(&p, unsafe.Pointer(&h[0])))
	return cu.DevicePtr(p), err
}

func ipcCloseMem(p cu.DevicePtr) error {
	return check("cuIpcCloseMemHandle", C.cuIpcCloseMemHandle(C.CUdeviceptr(p)))
}

func deviceUUID(ord int) ([]byte, error) {
	u := make([]byte, 16)
	return u, check("cuDeviceGetUuid_v2", C.gcUuid(unsafe.Pointer(&u[0]), C.int(ord)))
}

func pointerDevice(p cu.DevicePtr) (int, error) {
	var ord C.int
	err := check("cuPointerGetAttribute(DEVICE_ORDINAL)", C.gcPointerDevice(&ord, C.CUdeviceptr(p)))
	return int(ord), err
}

func haveMemcpyBatch() (bool, error) {
	if cu.Version() < 12080 {
		return false, nil
	}
	var ok C.int
	err := check("cuGetProcAddress(cuMemcpyBatchAsync, 12080)", C.gcHaveBatch(&ok))
	return ok != 0, err
}

// ipcEvent is an interprocess event, as the engine would record on its
// compute stream after the kernels that wrote the blocks.
type ipcEvent struct {
	ev     C.CUevent
	handle []byte
}

func newIPCEvent() (*ipcEvent, error) {
	e := &ipcEvent{handle: make([]byte, C.CU_IPC_HANDLE_SIZE)}
	return e, check("cuEventCreate/cuIpcGetEventHandle", C.gcIpcEvent(&e.ev, unsafe.Pointer(&e.handle[0])))
}

func openIPCEvent(h []byte) (*ipcEvent, error) {
	if len(h) != C.CU_IPC_HANDLE_SIZE {
		return nil, fmt.Errorf("event handle is %d bytes", len(h))
	}
	e := &ipcEvent{handle: h}
	return e, check("cuIpcOpenEventHandle", C.gcIpcOpenEvent(&e.ev, unsafe.Pointer(&h[0])))
}

func (e *ipcEvent) record(s cu.Stream) error {
	return check("cuEventRecord", C.cuEventRecord(e.ev, cStream(s)))
}

func (e *ipcEvent) done() (bool, error) {
	switch r := C.cuEventQuery(e.ev); r {
	case C.CUDA_SUCCESS:
		return true, nil
	case C.CUDA_ERROR_NOT_READY:
		return false, nil
	default:
		return false, check("cuEventQuery", r)
	}
}

func (e *ipcEvent) destroy() error { return check("cuEventDestroy", C.cuEventDestroy(e.ev)) }

func stall(s cu.Stream, d time.Duration) error {
	return check("cuLaunchHostFunc", C.gcStall(cStream(s), C.uint(d/time.Microsecond)))
}

// pinned is page-locked host memory outside the Go heap, like the daemon's
// arena, so that the baseline copies run under the same conditions.
type pinned struct{ b []byte }

func newPinned(n int) (*pinned, error) {
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("mmap %d bytes: %w", n, err)
	}
	if err := check("cuMemHostRegister", C.cuMemHostRegister(unsafe.Pointer(&b[0]), C.size_t(n), C.CU_MEMHOSTREGISTER_PORTABLE)); err != nil {
		unix.Munmap(b)
		return nil, err
	}
	return &pinned{b: b}, nil
}

func (p *pinned) ptr(off int) unsafe.Pointer { return unsafe.Pointer(&p.b[off]) }

func (p *pinned) free() error {
	err := check("cuMemHostUnregister", C.cuMemHostUnregister(unsafe.Pointer(&p.b[0])))
	if merr := unix.Munmap(p.b); err == nil {
		err = merr
	}
	return err
}
