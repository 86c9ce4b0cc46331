// Package cuda is the copy engine for engine KV caches in GPU memory: it
// opens the CUDA IPC memory handles a client registers, registers the host
// arena as pinned memory, and moves blocks between the two with async copies
// on a few streams per device, reporting a batch done only once a CUDA event
// recorded after its last copy has completed.
//
// A batch goes through three stages, one file each: the issuer checks it and
// holds it until the engine's ready event has completed (issue.go, polling,
// with a deadline), queues its copies (coalesced by coalesce.go; scattered
// ones batched into cuMemcpyBatchAsync where the driver has it) and a
// blocking-sync completion event per device; a waiter per stream sleeps in
// cuEventSynchronize and runs Done (complete.go). A sticky driver error
// fails the engine as a whole (dma.Failer) and the daemon exits.
//
// Only the code that calls the driver needs CUDA and is built with the build
// tag cuda: New and the driver binding (cudriver.go, on gorgonia.org/cu) and
// the calls cu lacks (driver.go, cgo). See docs/cuda.md for building it
// without a CUDA install. The rest builds and is tested everywhere over a
// fake driver (fake_test.go): the engine (engine.go), the stages, IPC handle
// parsing (handle.go: PyTorch's form, device UUIDs), NUMA placement of the
// arena (numa.go), the driver error type and sticky codes (errors.go).
//
// Caveats:
//   - Importing gorgonia.org/cu runs cuInit when the process starts and exits
//     the process if it fails: a binary built with the tag needs the NVIDIA
//     driver (libcuda.so.1) and at least one visible GPU.
//   - Regions name their device by UUID; a client that sends only an ordinal
//     must see the GPUs as the daemon does (and the memory's device is checked).
//   - A CUDA IPC handle is a capability: whoever holds it may map the memory.
//     The driver does not say which process exported it, so the peer's
//     credentials cannot be checked against it the way the host backend checks
//     a file's owner; the 0600 socket is the access control.
package cuda
