package cuda

import (
	"bytes"
	"fmt"

	"github.com/kvoffloadd/kvoffloadd/dma"
)

// IPCHandleBytes is the size of a CUDA IPC memory or event handle
// (CU_IPC_HANDLE_SIZE, the same for cudaIpcMemHandle_t and cudaIpcEventHandle_t).
const IPCHandleBytes = 64

// UUIDBytes is the size of a device UUID (CUuuid).
const UUIDBytes = 16

// PyTorch's shareable handle (c10/cuda/CUDACachingAllocator.cpp,
// shareIpcHandle, which UntypedStorage._share_cuda_() returns since PyTorch
// 2.2): one version byte, one type byte, then the handle of that type. For
// memory from cudaMalloc the type is 'c' and the handle is the 64-byte
// cudaIpcMemHandle_t of the allocation's base; 'e' is an expandable segment,
// whose handle is a list of POSIX file descriptors or fabric handles that
// only torch's own receiving code can import.
const (
	torchHandleCudaMalloc  = 'c'
	torchHandleExpandable  = 'e'
	torchHandleMaxVersion  = 2 // versions seen so far: 1 and 2
	torchCudaMallocHandleN = 2 + IPCHandleBytes
)

// ipcKey names one exported allocation as opened on one device. The engine
// maps each key once and counts the regions that use it: PyTorch's caching
// allocator hands out many tensors (layers) from one allocation, and the
// driver lets a process open a handle only once per device context.
type ipcKey struct {
	device int
	handle [IPCHandleBytes]byte
}

// memHandle returns the cudaIpcMemHandle_t in h: h itself (64 bytes) or
// PyTorch's shareable form of it. Memory that is not plain cudaMalloc memory
// (PyTorch's expandable segments) is refused with a message saying how to
// avoid it.
func memHandle(h []byte) ([IPCHandleBytes]byte, error) {
	var out [IPCHandleBytes]byte
	switch {
	case len(h) == IPCHandleBytes:
		copy(out[:], h)
	case len(h) >= 2 && h[1] == torchHandleExpandable && h[0] >= 1 && h[0] <= torchHandleMaxVersion:
		return out, fmt.Errorf("handle is PyTorch's expandable-segment form (version %d): memory from "+
			"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cannot be opened with cuIpcOpenMemHandle; "+
			"allocate the KV cache with expandable_segments:False", h[0])
	case len(h) == torchCudaMallocHandleN && h[1] == torchHandleCudaMalloc:
		if h[0] < 1 || h[0] > torchHandleMaxVersion {
			return out, fmt.Errorf("handle is PyTorch's shareable form with version %d, this daemon knows versions 1..%d", h[0], torchHandleMaxVersion)
		}
		copy(out[:], h[2:])
	case len(h) >= 2 && h[0] >= 1 && h[0] <= torchHandleMaxVersion && h[1] >= 'a' && h[1] <= 'z':
		return out, fmt.Errorf("handle is PyTorch's shareable form of type %q (%d bytes), this daemon opens type 'c' (%d bytes)", h[1], len(h), torchCudaMallocHandleN)
	default:
		return out, fmt.Errorf("handle is %d bytes, want %d (cudaIpcMemHandle_t) or %d (PyTorch's shareable form)", len(h), IPCHandleBytes, torchCudaMallocHandleN)
	}
	if out == ([IPCHandleBytes]byte{}) {
		return out, fmt.Errorf("handle is all zeros")
	}
	return out, nil
}

// deviceOf resolves the device a region names to this process's ordinal:
// by UUID when the client sent one (ordinals differ between processes with
// different CUDA_VISIBLE_DEVICES), else by ordinal.
func deviceOf(m *dma.IPCMemory, uuids [][UUIDBytes]byte) (int, error) {
	if len(m.DeviceUUID) != 0 {
		if len(m.DeviceUUID) != UUIDBytes {
			return 0, fmt.Errorf("device_uuid is %d bytes, want %d", len(m.DeviceUUID), UUIDBytes)
		}
		for ord, u := range uuids {
			if bytes.Equal(u[:], m.DeviceUUID) {
				return ord, nil
			}
		}
		return 0, fmt.Errorf("device %s is not visible to this daemon (it sees %s): run it with the engine's GPUs visible",
			FormatUUID(m.DeviceUUID), formatUUIDs(uuids))
	}
	if m.Device < 0 || m.Device >= len(uuids) {
		return 0, fmt.Errorf("device %d: this process sees %d CUDA devices (0..%d)", m.Device, len(uuids), len(uuids)-1)
	}
	return m.Device, nil
}

// FormatUUID writes a device UUID the way nvidia-smi -L does.
func FormatUUID(u []byte) string {
	if len(u) != UUIDBytes {
		return fmt.Sprintf("%x", u)
	}
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

func formatUUIDs(uuids [][UUIDBytes]byte) string {
	if len(uuids) == 0 {
		return "no devices"
	}
	var b bytes.Buffer
	for i, u := range uuids {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%d=%s", i, FormatUUID(u[:]))
	}
	return b.String()
}

// parseRegion checks a region spec before any driver call is made for it:
// a CUDA IPC region with a well-formed handle, on a device this process sees
// (uuids lists them by ordinal), whose blocks all lie inside the exported
// allocation. Every error wraps dma.ErrBadRegion.
func parseRegion(spec dma.RegionSpec, uuids [][UUIDBytes]byte) (ipcKey, error) {
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
	h, err := memHandle(m.Handle)
	if err != nil {
		return k, fmt.Errorf("%w: memory %w", dma.ErrBadRegion, err)
	}
	dev, err := deviceOf(m, uuids)
	if err != nil {
		return k, fmt.Errorf("%w: %w", dma.ErrBadRegion, err)
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
	k.device = dev
	k.handle = h
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
	if len(h) != IPCHandleBytes {
		return fmt.Errorf("ready event handle is %d bytes, want %d", len(h), IPCHandleBytes)
	}
	if [IPCHandleBytes]byte(h) == ([IPCHandleBytes]byte{}) {
		return fmt.Errorf("ready event handle is all zeros")
	}
	return nil
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
