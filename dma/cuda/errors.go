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
