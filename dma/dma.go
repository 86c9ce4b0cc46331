// Package dma owns the copy engine: the seam between engine KV memory
// (regions a client registers) and the daemon's host arena. The host backend
// (dma/host) maps /dev/shm files; a CUDA backend (dma/cuda, build tag cuda)
// opens CUDA IPC handles. Callers see only this interface: they describe
// copies, submit them in batches, and learn when a batch has drained.
package dma

import (
	"errors"
	"fmt"
)

// Peer is the identity of the connecting client, as the kernel recorded it
// when the client connected: SO_PEERCRED (pid, uid, gid) and SO_PEERGROUPS
// (supplementary groups). A backend uses it to refuse memory the peer could
// not itself read and write.
type Peer struct {
	PID    int32 // 0 when the peer's pid is not visible in the daemon's pid namespace
	UID    uint32
	GID    uint32
	Groups []uint32
}

// IPCMemory is a CUDA IPC memory handle as PyTorch exports it.
type IPCMemory struct {
	// Handle is the 64-byte cudaIpcMemHandle_t, or PyTorch's shareable
	// form of it as UntypedStorage._share_cuda_() returns it: a version
	// byte, a type byte ('c' for cudaMalloc memory) and the 64 bytes.
	Handle []byte
	// Device is the device ordinal as the client's process numbers it.
	// Under per-process CUDA_VISIBLE_DEVICES it need not be the daemon's
	// ordinal: DeviceUUID, when set, is what names the device.
	Device int
	// DeviceUUID is the device's 16-byte UUID (cuDeviceGetUuid_v2, torch's
	// get_device_properties(d).uuid), or empty.
	DeviceUUID []byte
	AllocSize  uint64
}

// RegionSpec describes one region a client registers. Exactly one of
// ShmPath and CUDA is set.
type RegionSpec struct {
	ShmPath string
	CUDA    *IPCMemory

	Offset       uint64 // byte offset of engine block 0
	BlockStride  uint64 // bytes between consecutive engine blocks
	NumBlocks    uint32
	SegmentBytes uint64 // bytes of one block in this region
}

// Span returns the bytes of the region that blocks 0..NumBlocks-1 reach.
func (s RegionSpec) Span() (uint64, error) {
	if s.NumBlocks == 0 {
		return 0, fmt.Errorf("num_blocks is 0")
	}
	if s.SegmentBytes == 0 {
		return 0, fmt.Errorf("segment is 0 bytes")
	}
	if s.NumBlocks > 1 && s.BlockStride < s.SegmentBytes {
		return 0, fmt.Errorf("block_stride %d is smaller than the segment (%d bytes): blocks would overlap", s.BlockStride, s.SegmentBytes)
	}
	if s.Offset > ^uint64(0)-s.SegmentBytes {
		return 0, fmt.Errorf("offset+segment overflows")
	}
	last := uint64(s.NumBlocks - 1)
	if s.BlockStride != 0 && last > (^uint64(0)-s.Offset-s.SegmentBytes)/s.BlockStride {
		return 0, fmt.Errorf("offset+num_blocks*block_stride overflows")
	}
	return s.Offset + last*s.BlockStride + s.SegmentBytes, nil
}

// Region is engine memory opened by a backend.
type Region interface {
	// Size is the number of addressable bytes.
	Size() uint64
	// Close unmaps the region. No copy may be in flight.
	Close() error
}

// Copy moves Len bytes between a region and the arena. The direction is the
// batch's.
type Copy struct {
	Region    Region
	RegionOff uint64
	ArenaOff  uint64
	Len       uint64
}

// Batch is a set of copies that completes as one: Done is called exactly
// once, after every copy of the batch has drained into its destination (or
// the batch failed), never earlier.
type Batch struct {
	ToArena bool // true: engine -> arena (store); false: arena -> engine (load)
	Copies  []Copy
	// ReadyEvent is an opaque event handle (CUDA: an IPC event handle) the
	// batch's copies must wait for, in either direction: a store must not
	// read blocks the engine's kernels are still writing, and a load must
	// not overwrite blocks its kernels are still reading. The host backend
	// ignores it.
	ReadyEvent []byte
	// Abandoned, when set, is asked once the ready event has completed,
	// before any copy is issued: true (the requester's connection closed
	// while the batch waited) fails the batch instead. An engine process
	// that died mid-forward left its blocks half written, and whether its
	// IPC event then reads as complete is the driver's business: a store
	// of a requester already gone is not worth that risk.
	Abandoned func() bool
	Done      func(error)
}

// Engine is a copy engine.
type Engine interface {
	// Name names the backend for logs ("host", "cuda").
	Name() string
	// SetArena tells the engine the host arena every Copy.ArenaOff refers to.
	// Called once, before any Open or Submit; SetArena(nil) is called once
	// more after the last batch, before the arena is unmapped, so that the
	// engine lets go of it (the CUDA engine unregisters the pinned pages).
	SetArena(arena []byte) error
	// Open maps a region on behalf of peer.
	Open(spec RegionSpec, peer Peer) (Region, error)
	// Submit queues a batch. It may block while the engine's queue is full;
	// it never runs Done on the caller's goroutine.
	Submit(b *Batch)
	// QueueDepth reports batches submitted and not yet done.
	QueueDepth() int
	// Close waits for queued batches to drain and stops the workers.
	Close() error
}

// Failer is implemented by an engine that can fail as a whole, beyond one
// batch: the CUDA engine after a sticky error (an illegal address, an
// uncorrectable ECC error) has lost its context, and every later batch would
// fail. Failed is closed then and Err says why; the daemon stops serving and
// exits, so that a supervisor restarts it with a fresh context.
type Failer interface {
	Failed() <-chan struct{}
	Err() error
}

// ErrNoCUDA is returned by a backend asked for memory kind it was not built for.
var ErrNoCUDA = errors.New("CUDA IPC region refused: this kvoffloadd was built without CUDA (build with `make build-cuda`)")

// ErrBadRegion wraps every reason a region is refused at Open.
var ErrBadRegion = errors.New("bad region")

// ErrLimit wraps a refusal because the backend maps as much as its bounds
// allow (host: Config.MaxMappedBytes).
var ErrLimit = errors.New("mapping limit reached")

// ErrCopy wraps a copy failure (a fault in engine memory, a driver error).
var ErrCopy = errors.New("copy failed")
