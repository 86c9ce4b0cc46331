"""CUDA IPC export of torch tensors and events for kvoffloadd.

The daemon (built with CUDA) maps the engine's KV cache by CUDA IPC memory
handle and orders its copies after the engine's kernels with IPC events.
This module makes both from torch objects, the way torch itself shares them
between processes, and imports torch only when it is called, so that the
package imports without it.

Memory: ``UntypedStorage._share_cuda_()`` returns (device, handle,
storage size, storage offset in the allocation, ref-counter file and offset,
event handle, event-sync flag). Since PyTorch 2.2 the handle is PyTorch's
shareable form, 66 bytes: a version byte, a type byte (``'c'`` for memory
from cudaMalloc) and the 64-byte ``cudaIpcMemHandle_t`` of the allocation's
base; older versions return the 64 bytes alone. The daemon accepts both, so
the handle is passed through as torch returned it. Each call also creates an
IPC event and takes a slot in a ref-counter file, so it is made once per
storage, however many layer views share the storage. Memory from
``expandable_segments:True`` has a type ``'e'`` handle no other process can
open with ``cuIpcOpenMemHandle``; it is refused here with the fix.

Devices are named by UUID as well as ordinal: under per-worker
``CUDA_VISIBLE_DEVICES`` every worker calls its GPU 0, and only the UUID
tells the daemon which GPU that is.

Events: a ready event is recorded on the compute stream *before* a Store or
Load is sent and its 64-byte IPC handle goes in ``ready_event``; the daemon
starts the request's copies once the event has completed. :class:`IpcEventPool`
hands out interprocess events and takes them back once the jobs they guard
are done: an event must not be recorded again while the daemon may still be
waiting for its previous record (it would wait for the later work instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "CudaExportError",
    "CudaExport",
    "TorchCudaExporter",
    "IpcEventPool",
    "torch_handle_kind",
]

IPC_HANDLE_BYTES = 64
TORCH_CUDA_MALLOC = ord("c")
TORCH_EXPANDABLE_SEGMENT = ord("e")


class CudaExportError(ValueError):
    """A CUDA tensor cannot be exported to kvoffloadd."""


def torch_handle_kind(handle: bytes) -> str:
    """Names the form of a memory handle from ``_share_cuda_``: "raw" (the
    64-byte cudaIpcMemHandle_t), "cuda_malloc" (PyTorch's 66-byte form of
    it) or "expandable_segment"; raises CudaExportError for anything else."""
    n = len(handle)
    if n == IPC_HANDLE_BYTES:
        return "raw"
    if n >= 2 and handle[1] == TORCH_EXPANDABLE_SEGMENT:
        return "expandable_segment"
    if n == IPC_HANDLE_BYTES + 2 and handle[1] == TORCH_CUDA_MALLOC:
        return "cuda_malloc"
    raise CudaExportError(f"unknown CUDA memory handle form ({n} bytes, first bytes {bytes(handle[:2])!r})")


@dataclass(frozen=True)
class CudaExport:
    """One tensor's memory as the daemon needs it."""

    handle: bytes  # as torch returned it (64 or 66 bytes)
    device: int  # torch's ordinal, in this process
    device_uuid: bytes  # 16 bytes, or b"" if unknown
    offset: int  # of the tensor's first byte, from the exported allocation's base
    alloc_size: int  # the end of the storage in the allocation: all the daemon may touch

    def as_tuple(self) -> tuple[bytes, int, int, int, bytes]:
        """The exporter protocol of :func:`kvoffload.regions.regions_from_kv_caches`."""
        return self.handle, self.device, self.offset, self.alloc_size, self.device_uuid


def _torch_uuid(device: int) -> bytes:
    import torch

    u = torch.cuda.get_device_properties(device).uuid
    return bytes(getattr(u, "bytes", b"") or b"")


class TorchCudaExporter:
    """Exports torch CUDA tensors, one ``_share_cuda_`` per storage.

    Call it with a tensor; it returns (handle, device, offset, alloc_size,
    device_uuid), see :class:`CudaExport`. ``uuid_of`` maps a device ordinal
    to its 16-byte UUID (default: torch's device properties).
    """

    def __init__(self, uuid_of: Callable[[int], bytes] | None = None):
        self._uuid_of = uuid_of or _torch_uuid
        self._uuids: dict[int, bytes] = {}
        # (device, storage data_ptr) -> (handle, device, offset in the allocation, storage bytes)
        self._storages: dict[tuple[int, int], tuple[bytes, int, int, int]] = {}
        self.share_calls = 0

    def export(self, t: Any) -> CudaExport:
        storage = t.untyped_storage()
        base = int(storage.data_ptr())
        dev = getattr(getattr(t, "device", None), "index", None)
        key = (-1 if dev is None else int(dev), base)
        shared = self._storages.get(key)
        if shared is None:
            s = storage._share_cuda_()
            self.share_calls += 1
            device, handle, size_bytes, offset_bytes = int(s[0]), bytes(s[1]), int(s[2]), int(s[3])
            kind = torch_handle_kind(handle)
            if kind == "expandable_segment":
                raise CudaExportError(
                    "the KV cache is in a PyTorch expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): "
                    "other processes cannot open it with cuIpcOpenMemHandle; allocate the KV cache with "
                    "expandable_segments:False"
                )
            shared = (handle, device, offset_bytes, size_bytes)
            self._storages[key] = shared
        handle, device, offset_bytes, size_bytes = shared
        if device not in self._uuids:
            try:
                self._uuids[device] = self._uuid_of(device)
            except Exception:  # an old torch without uuid: the ordinal will do
                self._uuids[device] = b""
        tensor_off = int(t.data_ptr()) - base
        if tensor_off < 0 or tensor_off > size_bytes:
            raise CudaExportError(f"tensor data_ptr is {tensor_off} bytes from its storage's start (storage {size_bytes} bytes)")
        return CudaExport(
            handle=handle,
            device=device,
            device_uuid=self._uuids[device],
            offset=offset_bytes + tensor_off,
            alloc_size=offset_bytes + size_bytes,
        )

    def __call__(self, t: Any) -> tuple[bytes, int, int, int, bytes]:
        return self.export(t).as_tuple()


def _torch_event() -> Any:
    import torch

    # Interprocess events cannot time; blocking makes a host wait sleep.
    return torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)


class IpcEventPool:
    """Interprocess CUDA events for ``ready_event``.

    :meth:`record` records an idle event (made on first need) on a stream
    and returns its IPC handle and a token; :meth:`release` gives the event
    back once every job sent with it is done. Handles are exported once per
    event. ``make_event`` makes an event with ``record(stream)`` and
    ``ipc_handle()`` (default: ``torch.cuda.Event(interprocess=True)``).
    """

    def __init__(self, make_event: Callable[[], Any] | None = None, max_idle: int = 16):
        self._make = make_event or _torch_event
        self._idle: list[tuple[Any, bytes]] = []
        self._busy: dict[int, tuple[Any, bytes]] = {}
        self._next = 0
        self.max_idle = max_idle
        self.created = 0

    def record(self, stream: Any = None) -> tuple[bytes, int]:
        if self._idle:
            ev, handle = self._idle.pop()
        else:
            ev = self._make()
            self.created += 1
            handle = None
        if stream is None:
            ev.record()
        else:
            ev.record(stream)
        if handle is None:
            # The handle is valid once the event exists; torch exports it
            # only after the event was created, i.e. recorded once.
            handle = bytes(ev.ipc_handle())
            if len(handle) != IPC_HANDLE_BYTES:
                raise CudaExportError(f"IPC event handle is {len(handle)} bytes, want {IPC_HANDLE_BYTES}")
        self._next += 1
        self._busy[self._next] = (ev, handle)
        return handle, self._next

    def release(self, token: int) -> None:
        item = self._busy.pop(token, None)
        if item is not None and len(self._idle) < self.max_idle:
            self._idle.append(item)

    def busy(self) -> int:
        return len(self._busy)
