package cuda

import (
	"fmt"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// IPCHandleBytes is the size of a CUDA IPC memory or event handle
// (CU_IPC_HANDLE_SIZE, the same for cudaIpcMemHandle_t and cudaIpcEventHandle_t).
const IPCHandleBytes = 64

// ipcKey names one exported allocation as opened on one device. The engine
// maps each key once and counts the regions that use it: PyTorch's caching
// allocator hands out many tensors (layers) from one allocation, and the
// driver lets a process open a handle only once per device context.
type ipcKey struct {
	device int
	handle [IPCHandleBytes]byte
}

// parseRegion checks a region spec before any driver call is made for it:
// a CUDA IPC region with a well-formed handle, on a device this process sees,
// whose blocks all lie inside the exported allocation. Every error wraps
// dma.ErrBadRegion.
func parseRegion(spec dma.RegionSpec, numDevices int) (ipcKey, error) {
	var k ipcKey
	m := spec.CUDA
	switch {
	case m == nil && spec.ShmPath != "":
		return k, fmt.Errorf("%w: shm_path regions are served by the host copy engine, this daemon's is the CUDA one", dma.ErrBadRegion)
	case m == nil:
		return k, fmt.Errorf("%w: the region names no memory (no CUDA IPC handle)", dma.ErrBadRegion)
	case spec.ShmPath != "":
		return k, fmt.Errorf("%w: the region sets both shm_path and a CUDA IPC handle", dma.ErrBadRegion)
	}
	if err := checkHandle(m.Handle); err != nil {
		return k, fmt.Errorf("%w: memory %w", dma.ErrBadRegion, err)
	}
	if m.Device < 0 || m.Device >= numDevices {
		return k, fmt.Errorf("%w: device %d: this process sees %d CUDA devices (0..%d)", dma.ErrBadRegion, m.Device, numDevices, numDevices-1)
	}
	if m.AllocSize == 0 {
		return k, fmt.Errorf("%w: alloc_size is 0", dma.ErrBadRegion)
	}
	span, err := spec.Span()
	if err != nil {
		return k, fmt.Errorf("%w: %v", dma.ErrBadRegion, err)
	}
	// Span cannot be trusted alone: with an offset near 2^64 its sum wraps
	// (dma.RegionSpec.Span checks the product, not offset+segment).
	if spec.Offset >= m.AllocSize || spec.SegmentBytes > m.AllocSize-spec.Offset {
		return k, fmt.Errorf("%w: block 0 (offset %d, %d bytes) does not fit in the allocation of %d bytes",
			dma.ErrBadRegion, spec.Offset, spec.SegmentBytes, m.AllocSize)
	}
	if span > m.AllocSize {
		return k, fmt.Errorf("%w: blocks reach byte %d of the allocation (offset %d, %d blocks every %d bytes, %d bytes each) but it is %d bytes",
			dma.ErrBadRegion, span, spec.Offset, spec.NumBlocks, spec.BlockStride, spec.SegmentBytes, m.AllocSize)
	}
	k.device = m.Device
	copy(k.handle[:], m.Handle)
	return k, nil
}

// ValidateEventHandle checks the shape of a batch's ready event (an IPC event
// handle): empty (no event) or exactly IPCHandleBytes long and not all zero.
// The daemon can call it when a request arrives, so that a malformed handle
// is the client's INVALID_ARGUMENT rather than a failed copy later.
func ValidateEventHandle(h []byte) error {
	if len(h) == 0 {
		return nil
	}
	if err := checkHandle(h); err != nil {
		return fmt.Errorf("ready event %w", err)
	}
	return nil
}

func checkHandle(h []byte) error {
	if len(h) != IPCHandleBytes {
		return fmt.Errorf("handle is %d bytes, want %d", len(h), IPCHandleBytes)
	}
	for _, b := range h {
		if b != 0 {
			return nil
		}
	}
	return fmt.Errorf("handle is all zeros")
}

// checkCopy reports a copy that would touch bytes outside its region or the
// arena. The sums are written so that they cannot overflow.
func checkCopy(c dma.Copy, regionSize, arenaSize uint64) error {
	if c.Len > regionSize || c.RegionOff > regionSize-c.Len {
		return fmt.Errorf("copy of %d bytes at region offset %d overruns the region (%d bytes)", c.Len, c.RegionOff, regionSize)
	}
	if c.Len > arenaSize || c.ArenaOff > arenaSize-c.Len {
		return fmt.Errorf("copy of %d bytes at arena offset %d overruns the arena (%d bytes)", c.Len, c.ArenaOff, arenaSize)
	}
	return nil
}
