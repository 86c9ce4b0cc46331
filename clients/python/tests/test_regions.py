"""Layout and regions read off KV tensors (shapes and strides), and their
registration with the real daemon."""

from __future__ import annotations

import pytest
from helpers import FakeTensor

import kvoffload as kv
from kvoffload.regions import LayoutError, SegmentGeometry, regions_from_kv_caches, split_block_tensor

NB, BS, H, D, E = 10, 16, 4, 8, 2  # blocks, tokens per block, kv heads, head size, bytes per element
SEG = BS * H * D * E


def dense(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))


def test_flash_attention_layout_is_two_regions():
    shape = (2, NB, BS, H, D)  # K and V apart
    got = split_block_tensor(shape, dense(shape), E, NB)
    assert got == [SegmentGeometry(0, SEG, SEG), SegmentGeometry(NB * SEG, SEG, SEG)]


def test_flashinfer_layout_is_one_region():
    shape = (NB, 2, BS, H, D)  # K and V of a block together
    assert split_block_tensor(shape, dense(shape), E, NB) == [SegmentGeometry(0, 2 * SEG, 2 * SEG)]


def test_hnd_stride_order_is_read_off_the_strides():
    # Logical (2, NB, BS, H, D), physical (2, NB, H, BS, D).
    strides = (NB * H * BS * D, H * BS * D, D, BS * D, 1)
    assert split_block_tensor((2, NB, BS, H, D), strides, E, NB) == dense_two()


def dense_two():
    return [SegmentGeometry(0, SEG, SEG), SegmentGeometry(NB * SEG, SEG, SEG)]


def test_mla_and_padded_blocks():
    shape = (NB, BS, 576)
    assert split_block_tensor(shape, dense(shape), E, NB) == [SegmentGeometry(0, BS * 576 * E, BS * 576 * E)]
    # A block padded to a larger page (hybrid allocator): stride > bytes.
    padded = (BS * 600, 576, 1)
    assert split_block_tensor(shape, padded, E, NB) == [SegmentGeometry(0, BS * 576 * E, BS * 600 * E)]


def test_bad_layouts_are_refused():
    with pytest.raises(LayoutError, match="no dimension of size num_blocks"):
        split_block_tensor((2, 7, BS), dense((2, 7, BS)), E, NB)
    with pytest.raises(LayoutError, match="cannot tell which"):
        split_block_tensor((NB, NB, 4), dense((NB, NB, 4)), E, NB)
    # A block whose bytes are scattered (every other element).
    with pytest.raises(LayoutError, match="not contiguous"):
        split_block_tensor((NB, BS, D), (BS * D * 2, D * 2, 2), E, NB)


def test_cpu_tensors_in_dev_shm_register_with_the_daemon(client, shm, fingerprint):
    shape = (2, NB, BS, H, D)
    size = 2 * NB * SEG
    r = shm(2 * size + 4096)
    kv_caches = {
        "model.layers.0.attn": FakeTensor(r.address, shape, element_size=E),
        "model.layers.1.attn": FakeTensor(r.address + size, shape, element_size=E),
        # A layer sharing layer 0's KV cache (cross-layer KV sharing): registered once.
        "model.layers.2.attn": FakeTensor(r.address, shape, element_size=E),
    }
    groups = [["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]]
    reg = regions_from_kv_caches(kv_caches, groups, NB, 32)
    assert reg.device == "cpu"
    assert [s.bytes for s in reg.layout.segments] == [SEG] * 4
    assert [(x.shm_path, x.offset, x.block_stride, x.num_blocks) for x in reg.regions] == [
        (r.path, 0, SEG, NB), (r.path, NB * SEG, SEG, NB), (r.path, size, SEG, NB), (r.path, size + NB * SEG, SEG, NB)]
    out = client.register(fingerprint, reg.layout, reg.regions)
    assert out.registration_id > 0


def test_cpu_tensor_outside_dev_shm_is_refused():
    import ctypes

    buf = ctypes.create_string_buffer(2 * NB * SEG)
    t = FakeTensor(ctypes.addressof(buf), (2, NB, BS, H, D), element_size=E)
    with pytest.raises(LayoutError, match="not a /dev/shm file"):
        regions_from_kv_caches({"l0": t}, [["l0"]], NB, 32)


def test_cuda_tensors_become_ipc_regions():
    handle = bytes(range(64))
    shape = (2, NB, BS, H, D)
    t0 = FakeTensor(0x7F0000001000, shape, element_size=E, device="cuda")
    t1 = FakeTensor(0x7F0000101000, shape, element_size=E, device="cuda")
    exported = {id(t0): (handle, 0, 4096, 1 << 24), id(t1): (handle, 0, 4096 + (1 << 20), 1 << 24)}
    reg = regions_from_kv_caches({"a": t0, "b": t1}, {"a": 0, "b": 1}, NB, 16,
                                 cuda_exporter=lambda t: exported[id(t)])
    assert reg.device == "cuda"
    assert reg.layout.hash_bytes == 16
    assert [s.group for s in reg.layout.segments] == [0, 0, 1, 1]
    assert [(x.cuda_handle, x.cuda_device, x.offset, x.cuda_alloc_size) for x in reg.regions] == [
        (handle, 0, 4096, 1 << 24), (handle, 0, 4096 + NB * SEG, 1 << 24),
        (handle, 0, 4096 + (1 << 20), 1 << 24), (handle, 0, 4096 + (1 << 20) + NB * SEG, 1 << 24)]
    # Blocks beyond the exported allocation are refused.
    with pytest.raises(LayoutError, match="exported allocation"):
        regions_from_kv_caches({"a": t0}, [["a"]], NB, 32, cuda_exporter=lambda t: (handle, 0, 0, 100))


def test_layers_without_a_group_are_refused():
    t = FakeTensor(0x1000, (NB, 2, BS, H, D), element_size=E, device="cuda")
    with pytest.raises(LayoutError, match="in no KV cache group"):
        regions_from_kv_caches({"a": t, "stray": t}, [["a"]], NB, 32, cuda_exporter=lambda t: (b"\0" * 64, 0, 0, 1 << 30))
    assert isinstance(kv.Layout(32, []), kv.Layout)
