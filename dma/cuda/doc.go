// Package cuda is the copy engine for engine KV caches in GPU memory: it
// opens the CUDA IPC memory handles a client registers, registers the host
// arena as pinned memory, and moves blocks between the two with async copies
// on a few streams per device, reporting a batch done only once a CUDA event
// recorded after its last copy has completed.
//
// Only the code that calls the driver needs CUDA and is built with the build
// tag cuda: New and the driver binding (cudriver.go, on gorgonia.org/cu) and
// the few calls cu lacks (driver.go, cgo). See docs/cuda.md for building it
// without a CUDA install. The rest builds and is tested everywhere: the
// engine (engine.go: validation, stream rotation, the submitter and poller
// goroutines, error handling, Close), which reaches the driver through the
// small driver/gpu interface and is tested over a fake driver; IPC handle
// validation and region bounds (handle.go); the coalescing of per-block
// copies into strided runs (coalesce.go); the driver error type (errors.go).
//
// Caveats:
//   - Importing gorgonia.org/cu runs cuInit when the process starts and exits
//     the process if it fails: a binary built with the tag needs the NVIDIA
//     driver (libcuda.so.1) and at least one visible GPU.
//   - Device ordinals are the daemon's: it must see the GPUs in the same order
//     as the engine's processes (same CUDA_VISIBLE_DEVICES), or the client must
//     translate them.
//   - A CUDA IPC handle is a capability: whoever holds it may map the memory.
//     The driver does not say which process exported it, so the peer's
//     credentials cannot be checked against it the way the host backend checks
//     a file's owner; the 0600 socket is the access control.
package cuda
