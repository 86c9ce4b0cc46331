//go:build cuda

package cuda

// The driver calls gorgonia.org/cu does not wrap, or wraps without access to
// the C handles: IPC open and close of memory and events, pointer and device
// attributes, blocking-sync events, host memory registration, batched
// copies, the trapping kernel of the fault injection, and error names.
// Everything else goes through cu.
//
// The header is CUDA 11.8's (scripts/cuda-sdk.sh) and the driver at run time
// is newer: every call here is in 11.8's libcuda, which newer drivers keep
// exporting. cuMemcpyBatchAsync (CUDA 12.8) is not in the header: it is
// looked up at run time with cuGetProcAddress, asking for the 12.8 ABI
// (12.8's signature has a failIdx argument that 13.0's drops; the driver
// returns the entry point of the version asked for).

/*
#include <cuda.h>
#include <stdint.h>
#include <string.h>

static CUresult kvIpcOpenMem(CUdeviceptr *dptr, const void *handle) {
	CUipcMemHandle h;
	memcpy(h.reserved, handle, CU_IPC_HANDLE_SIZE);
	// The flag is the only one the driver accepts; it lets a context on
	// another device map the memory through peer access (which Open then
	// refuses: the memory must be on the region's device).
	return cuIpcOpenMemHandle(dptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
}

static CUresult kvPointerDevice(int *ord, CUdeviceptr p) {
	return cuPointerGetAttribute(ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p);
}

static CUresult kvIpcOpenEvent(CUevent *ev, const void *handle) {
	CUipcEventHandle h;
	memcpy(h.reserved, handle, CU_IPC_HANDLE_SIZE);
	return cuIpcOpenEventHandle(ev, h);
}

static CUresult kvDeviceUuid(void *out, int ord) {
	CUdevice dev;
	CUresult r = cuDeviceGet(&dev, ord);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	CUuuid u;
	// _v2: a MIG instance has its own UUID, as torch and nvidia-smi show it.
	r = cuDeviceGetUuid_v2(&u, dev);
	memcpy(out, u.bytes, sizeof u.bytes);
	return r;
}

static CUresult kvPCIBusID(char *out, int n, int ord) {
	CUdevice dev;
	CUresult r = cuDeviceGet(&dev, ord);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	return cuDeviceGetPCIBusId(out, n, dev);
}

static CUresult kvEventCreate(CUevent *ev) {
	// Blocking sync: cuEventSynchronize sleeps until the GPU signals the
	// event instead of spinning a CPU core.
	return cuEventCreate(ev, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING);
}

static const char *kvErrorName(CUresult r) {
	const char *s = NULL;
	if (cuGetErrorName(r, &s) != CUDA_SUCCESS) {
		return NULL;
	}
	return s;
}

// CUDA 12.8's CUmemcpyAttributes and cuMemcpyBatchAsync.
typedef struct {
	int srcAccessOrder; // CUmemcpySrcAccessOrder
	CUmemLocation srcLocHint;
	CUmemLocation dstLocHint;
	unsigned int flags;
} kvMemcpyAttributes;

typedef CUresult (*kvMemcpyBatchFn)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
	kvMemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream stream);

static kvMemcpyBatchFn kvBatchFn;

static CUresult kvLoadBatch(void) {
	void *p = NULL;
	CUresult r = cuGetProcAddress("cuMemcpyBatchAsync", &p, 12080, CU_GET_PROC_ADDRESS_DEFAULT);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	if (p == NULL) {
		return CUDA_ERROR_NOT_FOUND;
	}
	kvBatchFn = (kvMemcpyBatchFn)p;
	return CUDA_SUCCESS;
}

static CUresult kvMemcpyBatch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUstream s, size_t *failIdx) {
	kvMemcpyAttributes attr;
	memset(&attr, 0, sizeof attr);
	// CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the sources are read in stream
	// order, after the work queued before; the location hints stay
	// CU_MEM_LOCATION_TYPE_INVALID (none).
	attr.srcAccessOrder = 1;
	size_t idx = 0;
	*failIdx = SIZE_MAX;
	return kvBatchFn(dsts, srcs, sizes, count, &attr, &idx, 1, failIdx, s);
}

// A kernel that executes a trap instruction: the context is lost with
// CUDA_ERROR_LAUNCH_FAILED, as after a real device fault. PTX, compiled by
// the driver for whatever GPU this is.
static const char kvTrapPTX[] =
	".version 7.0\n"
	".target sm_75\n"
	".address_size 64\n"
	".visible .entry kvoffload_trap()\n"
	"{\n"
	"\ttrap;\n"
	"\tret;\n"
	"}\n";

static CUresult kvTrap(CUstream s) {
	CUmodule m;
	CUfunction f;
	CUresult r = cuModuleLoadData(&m, kvTrapPTX);
	if (r != CUDA_SUCCESS) {
		return r;
	}
	r = cuModuleGetFunction(&f, m, "kvoffload_trap");
	if (r != CUDA_SUCCESS) {
		return r;
	}
	// The module stays loaded: the context it lives in is about to go.
	return cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
}
*/
import "C"

import (
	"errors"
	"fmt"
	"reflect"
	"sync"
	"unsafe"

	"gorgonia.org/cu"
)

// The handle sizes must agree with the header this was built against.
var (
	_ = [1]struct{}{}[IPCHandleBytes-C.CU_IPC_HANDLE_SIZE]
	_ = [1]struct{}{}[UUIDBytes-len(C.CUuuid{}.bytes)]
)

func check(op string, dev int, r C.CUresult) error {
	if r == C.CUDA_SUCCESS {
		return nil
	}
	return newDriverError(op, dev, int(r))
}

func newDriverError(op string, dev, code int) *DriverError {
	return &DriverError{Op: op, Device: dev, Code: code, Name: errorName(code)}
}

// errorName is cuGetErrorName's name for a CUresult.
func errorName(code int) string {
	if s := C.kvErrorName(C.CUresult(code)); s != nil {
		return C.GoString(s)
	}
	return fmt.Sprintf("CUresult(%d)", code)
}

// fromCU turns an error from gorgonia.org/cu into a *DriverError named the
// driver's way ("CUDA_ERROR_INVALID_VALUE", not cu's "InvalidValue").
func fromCU(op string, dev int, err error) error {
	if err == nil {
		return nil
	}
	// cu's result type is unexported; it is an int holding the CUresult,
	// sometimes wrapped by github.com/pkg/errors (which unwraps).
	for e := err; e != nil; e = errors.Unwrap(e) {
		if v := reflect.ValueOf(e); v.Kind() == reflect.Int {
			return newDriverError(op, dev, int(v.Int()))
		}
	}
	return fmt.Errorf("%s on device %d: %w", op, dev, err)
}

// cStream is s as this package's C type.
func cStream(s cu.Stream) C.CUstream { return C.CUstream(unsafe.Pointer(s.C())) }

// ipcOpenMem maps the allocation behind an IPC memory handle into the
// current context and returns its base address.
func ipcOpenMem(dev int, h *[IPCHandleBytes]byte) (cu.DevicePtr, error) {
	var p C.CUdeviceptr
	if err := check("cuIpcOpenMemHandle", dev, C.kvIpcOpenMem(&p, unsafe.Pointer(&h[0]))); err != nil {
		return 0, err
	}
	return cu.DevicePtr(p), nil
}

func ipcCloseMem(dev int, p cu.DevicePtr) error {
	return check("cuIpcCloseMemHandle", dev, C.cuIpcCloseMemHandle(C.CUdeviceptr(p)))
}

// pointerDevice is the ordinal of the device p's memory is on.
func pointerDevice(dev int, p cu.DevicePtr) (int, error) {
	var ord C.int
	err := check("cuPointerGetAttribute(DEVICE_ORDINAL)", dev, C.kvPointerDevice(&ord, C.CUdeviceptr(p)))
	return int(ord), err
}

func deviceUUID(ord int) ([UUIDBytes]byte, error) {
	var u [UUIDBytes]byte
	err := check("cuDeviceGetUuid_v2", ord, C.kvDeviceUuid(unsafe.Pointer(&u[0]), C.int(ord)))
	return u, err
}

func pciBusID(ord int) (string, error) {
	var buf [64]C.char
	if err := check("cuDeviceGetPCIBusId", ord, C.kvPCIBusID(&buf[0], C.int(len(buf)), C.int(ord))); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

// cEvent is an event this package made or opened, in its own C type.
type cEvent struct{ ev C.CUevent }

func ipcOpenEvent(dev int, h []byte) (*cEvent, error) {
	if len(h) != IPCHandleBytes {
		return nil, fmt.Errorf("ready event handle is %d bytes, want %d", len(h), IPCHandleBytes)
	}
	e := &cEvent{}
	return e, check("cuIpcOpenEventHandle", dev, C.kvIpcOpenEvent(&e.ev, unsafe.Pointer(&h[0])))
}

func recordEvent(dev int, s cu.Stream) (*cEvent, error) {
	e := &cEvent{}
	if err := check("cuEventCreate", dev, C.kvEventCreate(&e.ev)); err != nil {
		return nil, err
	}
	if err := check("cuEventRecord", dev, C.cuEventRecord(e.ev, cStream(s))); err != nil {
		C.cuEventDestroy(e.ev)
		return nil, err
	}
	return e, nil
}

func (e *cEvent) query(dev int) (bool, error) {
	switch r := C.cuEventQuery(e.ev); r {
	case C.CUDA_SUCCESS:
		return true, nil
	case C.CUDA_ERROR_NOT_READY:
		return false, nil
	default:
		return false, check("cuEventQuery", dev, r)
	}
}

func (e *cEvent) sync(dev int) error {
	return check("cuEventSynchronize", dev, C.cuEventSynchronize(e.ev))
}

func (e *cEvent) destroy(dev int) error {
	return check("cuEventDestroy", dev, C.cuEventDestroy(e.ev))
}

// memHostRegister page-locks host memory for every context (PORTABLE), so
// copies to and from it run at full speed and truly asynchronously.
func memHostRegister(dev int, p unsafe.Pointer, n uint64) error {
	return check("cuMemHostRegister", dev, C.cuMemHostRegister(p, C.size_t(n), C.CU_MEMHOSTREGISTER_PORTABLE))
}

func memHostUnregister(dev int, p unsafe.Pointer) error {
	return check("cuMemHostUnregister", dev, C.cuMemHostUnregister(p))
}

var batchOnce struct {
	sync.Once
	ok  bool
	err error
}

// haveMemcpyBatch reports whether the driver has cuMemcpyBatchAsync (a 12.8
// or later driver), looking it up once.
func haveMemcpyBatch() (bool, error) {
	batchOnce.Do(func() {
		if cu.Version() < 12080 {
			return
		}
		batchOnce.err = check("cuGetProcAddress(cuMemcpyBatchAsync, 12080)", -1, C.kvLoadBatch())
		batchOnce.ok = batchOnce.err == nil
	})
	return batchOnce.ok, batchOnce.err
}

// memcpyBatch queues spans as one cuMemcpyBatchAsync. Every address is a
// unified one: the arena is registered host memory, whose host addresses
// the driver takes as they are.
func memcpyBatch(dev int, s cu.Stream, spans []span, toArena bool) error {
	n := len(spans)
	dsts := make([]C.CUdeviceptr, n)
	srcs := make([]C.CUdeviceptr, n)
	sizes := make([]C.size_t, n)
	for i, sp := range spans {
		h := C.CUdeviceptr(uintptr(unsafe.Pointer(unsafe.SliceData(sp.host))))
		d := C.CUdeviceptr(sp.dev)
		if toArena {
			dsts[i], srcs[i] = h, d
		} else {
			dsts[i], srcs[i] = d, h
		}
		sizes[i] = C.size_t(len(sp.host))
	}
	var failIdx C.size_t
	r := C.kvMemcpyBatch(&dsts[0], &srcs[0], &sizes[0], C.size_t(n), cStream(s), &failIdx)
	if err := check("cuMemcpyBatchAsync", dev, r); err != nil {
		if failIdx != ^C.size_t(0) {
			return fmt.Errorf("copy %d of %d: %w", failIdx, n, err)
		}
		return err
	}
	return nil
}

func injectTrap(dev int, s cu.Stream) error {
	return check("cuLaunchKernel(trap)", dev, C.kvTrap(cStream(s)))
}
