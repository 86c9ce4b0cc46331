package cuda

import "fmt"

// DriverError is a CUDA driver call that failed. A failed batch's error wraps
// dma.ErrCopy and a *DriverError; a region refused by the driver wraps
// dma.ErrBadRegion and a *DriverError. Use errors.As to get at the name, for
// example to label a metric.
type DriverError struct {
	// Op is the driver call, for example "cuMemcpy2DAsync".
	Op string
	// Device is the ordinal of the device whose context made the call.
	Device int
	// Code is the CUresult.
	Code int
	// Name is what cuGetErrorName says of Code, for example
	// "CUDA_ERROR_ILLEGAL_ADDRESS".
	Name string
}

func (e *DriverError) Error() string {
	return fmt.Sprintf("%s on device %d: %s (%d)", e.Op, e.Device, e.Name, e.Code)
}

// Sticky reports whether the error leaves the context unusable: the CUDA
// driver documents these codes as "the process must be terminated and
// relaunched" (a device-side fault, an uncorrectable memory error, a lost
// MPS server). After one, every call in the context fails the same way and
// no work queued in it will run.
func (e *DriverError) Sticky() bool { return stickyCode(e.Code) }

// The codes are those of cuda.h (the 11.8 header this is built against,
// unchanged since): CUDA_ERROR_ECC_UNCORRECTABLE 214,
// CUDA_ERROR_NVLINK_UNCORRECTABLE 220, CUDA_ERROR_ILLEGAL_ADDRESS 700,
// CUDA_ERROR_LAUNCH_TIMEOUT 702, CUDA_ERROR_ASSERT 710,
// CUDA_ERROR_HARDWARE_STACK_ERROR 714, CUDA_ERROR_ILLEGAL_INSTRUCTION 715,
// CUDA_ERROR_MISALIGNED_ADDRESS 716, CUDA_ERROR_INVALID_ADDRESS_SPACE 717,
// CUDA_ERROR_INVALID_PC 718, CUDA_ERROR_LAUNCH_FAILED 719,
// CUDA_ERROR_MPS_CLIENT_TERMINATED 810, CUDA_ERROR_EXTERNAL_DEVICE 911.
// CUDA_ERROR_CONTEXT_IS_DESTROYED (709) and CUDA_ERROR_DEINITIALIZED (4)
// are included too: the context (or the driver) is gone just the same.
func stickyCode(code int) bool {
	switch code {
	case 4, 214, 220, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719, 810, 911:
		return true
	}
	return false
}
