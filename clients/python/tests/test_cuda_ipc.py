"""CUDA IPC export (kvoffload.cuda_ipc) against fakes built from PyTorch's
documented formats: UntypedStorage._share_cuda_()'s 8-tuple and its 66-byte
shareable handle (c10/cuda/CUDACachingAllocator.cpp, shareIpcHandle)."""

from __future__ import annotations

import pytest
from helpers import FakeTensor

from kvoffload import client as kvclient
from kvoffload.cuda_ipc import CudaExportError, IpcEventPool, TorchCudaExporter, torch_handle_kind
from kvoffload.regions import regions_from_kv_caches

NB, BS, H, D, E = 10, 16, 4, 8, 2
SEG = BS * H * D * E
RAW = bytes(range(1, 65))
UUID0 = bytes(range(0xA0, 0xB0))


def torch_form(raw: bytes, version: int = 2, kind: bytes = b"c") -> bytes:
    return bytes([version]) + kind + raw


class FakeStorage:
    """A CUDA storage: ``_share_cuda_`` returns torch's tuple and counts calls
    (each real call creates an IPC event and a ref-counter slot)."""

    def __init__(self, base: int, nbytes: int, handle: bytes, offset_in_alloc: int, device: int = 0):
        self.base, self.nbytes, self.handle, self.offset, self.device = base, nbytes, handle, offset_in_alloc, device
        self.calls = 0

    def data_ptr(self) -> int:
        return self.base

    def _share_cuda_(self):
        self.calls += 1
        return (self.device, self.handle, self.nbytes, self.offset, b"/torch_ref", 3, b"\x01" * 64, True)


class CudaTensor(FakeTensor):
    def __init__(self, storage: FakeStorage, offset: int, shape, **kw):
        super().__init__(storage.base + offset, shape, device="cuda", **kw)
        self.device.index = storage.device
        self._storage = storage

    def untyped_storage(self):
        return self._storage


def test_handle_kinds():
    assert torch_handle_kind(RAW) == "raw"
    assert torch_handle_kind(torch_form(RAW)) == "cuda_malloc"
    assert torch_handle_kind(torch_form(RAW, 1)) == "cuda_malloc"
    assert torch_handle_kind(bytes([2]) + b"e" + b"\0" * 30) == "expandable_segment"
    with pytest.raises(CudaExportError):
        torch_handle_kind(b"\0" * 10)


def test_one_share_per_storage_and_torch_handle_passed_through():
    """vLLM views one storage as many layers (and K/V): _share_cuda_ runs once
    per storage, and the 66-byte handle reaches the regions unchanged."""
    shape = (2, NB, BS, H, D)
    layer_bytes = 2 * NB * SEG
    st = FakeStorage(0x7F0000000000, 3 * layer_bytes, torch_form(RAW), offset_in_alloc=4096)
    layers = {f"l{i}": CudaTensor(st, i * layer_bytes, shape, element_size=E) for i in range(3)}
    exp = TorchCudaExporter(uuid_of=lambda d: UUID0)
    reg = regions_from_kv_caches(layers, [list(layers)], NB, 32, cuda_exporter=exp)
    assert st.calls == 1 and exp.share_calls == 1
    assert len(reg.regions) == 6  # 3 layers x K/V
    for i, r in enumerate(reg.regions):
        layer, kv = divmod(i, 2)
        assert r.cuda_handle == torch_form(RAW)
        assert r.cuda_device_uuid == UUID0
        assert r.offset == 4096 + layer * layer_bytes + kv * NB * SEG
        assert r.cuda_alloc_size == 4096 + 3 * layer_bytes
        assert r.block_stride == SEG and r.num_blocks == NB


def test_regions_default_to_the_torch_exporter(monkeypatch):
    """Without an exporter regions_from_kv_caches shares each storage once."""
    shape = (2, NB, BS, H, D)
    st = FakeStorage(0x10000, 2 * 2 * NB * SEG, RAW, offset_in_alloc=0)
    t0 = CudaTensor(st, 0, shape, element_size=E)
    t1 = CudaTensor(st, 2 * NB * SEG, shape, element_size=E)
    monkeypatch.setattr("kvoffload.cuda_ipc._torch_uuid", lambda d: UUID0)
    reg = regions_from_kv_caches({"a": t0, "b": t1}, [["a", "b"]], NB, 32)
    assert st.calls == 1
    assert [r.cuda_device_uuid for r in reg.regions] == [UUID0] * 4


def test_storages_on_two_devices_are_shared_apart():
    shape = (NB, 2, BS, H, D)
    a = FakeStorage(0x1000, 2 * NB * SEG, torch_form(RAW), 0, device=0)
    b = FakeStorage(0x1000, 2 * NB * SEG, torch_form(bytes(64 * [7])), 0, device=1)  # same address, other GPU
    exp = TorchCudaExporter(uuid_of=lambda d: bytes([d]) * 16)
    ea, eb = exp.export(CudaTensor(a, 0, shape, element_size=E)), exp.export(CudaTensor(b, 0, shape, element_size=E))
    assert (a.calls, b.calls) == (1, 1)
    assert ea.device_uuid == b"\0" * 16 and eb.device_uuid == b"\1" * 16 and ea.handle != eb.handle


def test_expandable_segments_are_refused_with_the_fix():
    st = FakeStorage(0x1000, NB * SEG, bytes([2]) + b"e" + b"\3" * 40, 0)
    with pytest.raises(CudaExportError, match="expandable_segments:False"):
        TorchCudaExporter(uuid_of=lambda d: UUID0).export(CudaTensor(st, 0, (NB, BS, H, D), element_size=E))


def test_device_uuid_reaches_the_wire():
    reg = regions_from_kv_caches(
        {"a": CudaTensor(FakeStorage(0x1000, NB * SEG, torch_form(RAW), 0), 0, (NB, BS, H, D), element_size=E)},
        [["a"]], NB, 32, cuda_exporter=TorchCudaExporter(uuid_of=lambda d: UUID0),
    )
    m = kvclient._region_pb(reg.regions[0])
    assert m.cuda.handle == torch_form(RAW) and m.cuda.device_uuid == UUID0 and m.cuda.alloc_size == NB * SEG


def test_old_exporters_without_uuid_still_work():
    t = FakeTensor(0x1000, (NB, BS, H, D), element_size=E, device="cuda")
    reg = regions_from_kv_caches({"a": t}, [["a"]], NB, 32, cuda_exporter=lambda t: (RAW, 0, 0, NB * SEG))
    assert reg.regions[0].cuda_device_uuid == b""


class FakeEvent:
    made = 0

    def __init__(self):
        FakeEvent.made += 1
        self.id = FakeEvent.made
        self.records = []
        self.exports = 0

    def record(self, stream=None):
        self.records.append(stream)

    def ipc_handle(self):
        self.exports += 1
        return bytes([self.id]) * 64


def test_event_pool_reuses_only_released_events():
    pool = IpcEventPool(make_event=FakeEvent)
    h1, t1 = pool.record("s1")
    h2, t2 = pool.record("s2")
    assert h1 != h2 and pool.created == 2 and pool.busy() == 2
    pool.release(t1)
    h3, t3 = pool.record("s3")
    assert h3 == h1 and pool.created == 2  # the released event, recorded again
    pool.release(t2)
    pool.release(t3)
    pool.release(t3)  # twice: harmless
    assert pool.busy() == 0
    h4, _ = pool.record()
    assert h4 in (h1, h2) and pool.created == 2


def test_event_pool_exports_each_handle_once():
    made = []

    def make():
        e = FakeEvent()
        made.append(e)
        return e

    pool = IpcEventPool(make_event=make)
    for _ in range(5):
        _, t = pool.record()
        pool.release(t)
    assert len(made) == 1 and made[0].exports == 1 and len(made[0].records) == 5


def test_event_pool_checks_the_handle_size():
    class Short(FakeEvent):
        def ipc_handle(self):
            return b"\1" * 10

    with pytest.raises(CudaExportError):
        IpcEventPool(make_event=Short).record()


def test_load_and_store_send_the_ready_event(monkeypatch):
    """Loads carry the ready event as stores do (the copies wait for the
    kernels still reading the destination blocks)."""
    import kvoffload as kv

    sent = []
    c = kv.Client("/nonexistent/kvoffloadd.sock")
    monkeypatch.setattr(c, "_call", lambda method, req, **kw: sent.append((method, req)) or kvclient.pb.TransferResponse())
    job = kv.Job(job_id=1, hashes=[b"\1" * 16], block_ids=[3])
    c.load(7, [job], ready_event=b"\2" * 64)
    c.store(7, [job], ready_event=b"\3" * 64)
    c.close()
    assert [(m, r.ready_event) for m, r in sent] == [("Load", b"\2" * 64), ("Store", b"\3" * 64)]
