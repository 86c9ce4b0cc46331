//go:build cuda

package cuda

// The driver calls gorgonia.org/cu does not wrap: IPC open/close of memory
// and events, host memory registration, and error names. Everything else goes
// through cu.

/*
#include <cuda.h>
#include <string.h>

static CUresult kvIpcOpenMem(CUdeviceptr *dptr, const void *handle) {
	CUipcMemHandle h;
	memcpy(h.reserved, handle, CU_IPC_HANDLE_SIZE);
	// The flag is the only one the driver accepts; it lets a context on
	// another device map the memory through peer access.
	return cuIpcOpenMemHandle(dptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
}

static CUresult kvIpcOpenEvent(CUevent *ev, const void *handle) {
	CUipcEventHandle h;
	memcpy(h.reserved, handle, CU_IPC_HANDLE_SIZE);
	return cuIpcOpenEventHandle(ev, h);
}

static const char *kvErrorName(CUresult r) {
	const char *s = NULL;
	if (cuGetErrorName(r, &s) != CUDA_SUCCESS) {
		return NULL;
	}
	return s;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"reflect"
	"unsafe"

	"gorgonia.org/cu"
)

// The handle sizes must agree with the header this was built against.
var _ = [1]struct{}{}[IPCHandleBytes-C.CU_IPC_HANDLE_SIZE]

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

// streamWaitIPCEvent makes s wait until the work another process recorded
// in the IPC event h (as of this call) has completed.
func streamWaitIPCEvent(dev int, s cu.Stream, h []byte) error {
	if len(h) != IPCHandleBytes {
		return fmt.Errorf("ready event handle is %d bytes, want %d", len(h), IPCHandleBytes)
	}
	var ev C.CUevent
	if err := check("cuIpcOpenEventHandle", dev, C.kvIpcOpenEvent(&ev, unsafe.Pointer(&h[0]))); err != nil {
		return err
	}
	werr := check("cuStreamWaitEvent", dev, C.cuStreamWaitEvent(cStream(s), ev, 0))
	// The wait has taken what it needs from the event: it may go now.
	derr := check("cuEventDestroy", dev, C.cuEventDestroy(ev))
	if werr != nil {
		return werr
	}
	return derr
}

// memHostRegister page-locks host memory for every context (PORTABLE), so
// copies to and from it run at full speed and truly asynchronously.
func memHostRegister(dev int, p unsafe.Pointer, n uint64) error {
	return check("cuMemHostRegister", dev, C.cuMemHostRegister(p, C.size_t(n), C.CU_MEMHOSTREGISTER_PORTABLE))
}

func memHostUnregister(dev int, p unsafe.Pointer) error {
	return check("cuMemHostUnregister", dev, C.cuMemHostUnregister(p))
}
