//go:build cuda

package main

// What the check needs from the driver beyond gorgonia.org/cu: exporting
// memory and an event by IPC handle (the engine's side of the protocol),
// pinning host buffers, and a host function that stalls a stream.

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

func (e *ipcEvent) record(s cu.Stream) error {
	return check("cuEventRecord", C.cuEventRecord(e.ev, cStream(s)))
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
