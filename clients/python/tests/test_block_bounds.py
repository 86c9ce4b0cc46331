"""Engine block ids past num_blocks, against the real daemon.

A FlashAttention layer is one tensor (2, num_blocks, block_size, heads,
head_size): K of every block, then V of every block. If it were registered
as one region of 2*num_blocks blocks, or if the daemon checked a job's block
ids against the largest region of a group instead of every one, block
num_blocks + i would name V of block i (or bytes past a region's end). These
tests register such layers through the real daemon and check that every id
at or past the smallest region's block count is refused with
INVALID_ARGUMENT, on Store and on Load, and that a refused Load writes not a
byte of engine memory.
"""

from __future__ import annotations

import os

import grpc
import pytest
from helpers import FakeTensor

import kvoffload as kv
from kvoffload.regions import regions_from_kv_caches

NB, BS, H, D, E = 40, 16, 2, 8, 2  # blocks, tokens per block, kv heads, head size, bytes per element
SEG = BS * H * D * E  # one of K or V of one block
LAYER = 2 * NB * SEG


def keys(n: int, salt: bytes) -> list[bytes]:
    import hashlib

    return [hashlib.sha256(salt + i.to_bytes(4, "little")).digest() for i in range(n)]


def refused(call, job, want_blocks: int) -> kv.InvalidArgument:
    with pytest.raises(kv.InvalidArgument) as ei:
        call(job)
    e = ei.value
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and e.from_daemon, e
    assert "out of range" in e.message and f"hold {want_blocks} blocks" in e.message, e.message
    return e


def test_flash_attention_layer_registers_num_blocks_and_refuses_ids_past_it(client, shm, fingerprint):
    r = shm(2 * LAYER)
    kv_caches = {f"model.layers.{i}.attn": FakeTensor(r.address + i * LAYER, (2, NB, BS, H, D), element_size=E)
                 for i in range(2)}
    reg = regions_from_kv_caches(kv_caches, [list(kv_caches)], NB, 32)
    # Each of K and V of each layer is its own region of NB blocks, not one
    # region of 2*NB over both halves.
    assert [(x.offset, x.block_stride, x.num_blocks) for x in reg.regions] == [
        (0, SEG, NB), (NB * SEG, SEG, NB), (LAYER, SEG, NB), (LAYER + NB * SEG, SEG, NB)]
    out = client.register(fingerprint, reg.layout, reg.regions)
    rid = out.registration_id

    r.write(0, os.urandom(2 * LAYER))
    hs = keys(3, fingerprint)
    # The last block is in range: it stores and loads.
    assert client.store(rid, [kv.Job(1, hs[:2], [0, NB - 1])], wait=True)[0].ok
    snapshot = r.read(0, 2 * LAYER)

    def store(job):
        return client.store(rid, [job])

    def load(job):
        return client.load(rid, [job])

    for bad in (NB, NB + 11, 2 * NB - 1, 2 * NB, 2**32 - 1):
        refused(store, kv.Job(10, [hs[2], hs[0]], [1, bad]), NB)
        # hs[0] and hs[1] are cached: a Load past the K half would write
        # V (or the next layer's K) of another block.
        refused(load, kv.Job(11, hs[:2], [2, bad]), NB)
    assert r.read(0, 2 * LAYER) == snapshot, "a refused job changed engine memory"
    # Nothing of the refused requests is left pending, and the job ids are free.
    assert client.completions(rid).pending == 0
    client.load(rid, [kv.Job(11, hs[:2], [5, 6])])
    assert client.wait_jobs(rid, [11])[11].ok
    for i in range(2):
        for half in range(2):
            base = i * LAYER + half * NB * SEG
            assert r.read(base + 5 * SEG, SEG) == snapshot[base:base + SEG]
            assert r.read(base + 6 * SEG, SEG) == snapshot[base + (NB - 1) * SEG:base + NB * SEG]


def test_ids_are_checked_against_every_region_of_the_group(client, shm, fingerprint):
    """A client that describes the K half of a layer as 2*NB blocks (over V
    too) beside a V region of NB: the daemon goes by the smaller, and per
    group, so group 1's fewer blocks bound its jobs even where group 0 has
    more."""
    r = shm(2 * LAYER)
    layout = kv.Layout(32, [kv.Segment(0, SEG), kv.Segment(0, SEG), kv.Segment(1, SEG), kv.Segment(1, SEG)])
    regions = [
        kv.Region.shm(r.path, offset=0, block_stride=SEG, num_blocks=2 * NB),  # K, claiming V's blocks too
        kv.Region.shm(r.path, offset=NB * SEG, block_stride=SEG, num_blocks=NB),  # V
        kv.Region.shm(r.path, offset=LAYER, block_stride=SEG, num_blocks=NB),
        kv.Region.shm(r.path, offset=LAYER + NB * SEG, block_stride=SEG, num_blocks=NB // 2),
    ]
    rid = client.register(fingerprint, layout, regions).registration_id
    r.write(0, os.urandom(2 * LAYER))
    hs = keys(2, fingerprint)
    assert client.store(rid, [kv.Job(1, hs[:1], [NB - 1])], wait=True)[0].ok
    assert client.store(rid, [kv.Job(2, keys(1, fingerprint + b"g1"), [NB // 2 - 1], group=1)], wait=True)[0].ok
    snapshot = r.read(0, 2 * LAYER)

    refused(lambda j: client.store(rid, [j]), kv.Job(3, hs[1:], [NB + 11]), NB)
    refused(lambda j: client.load(rid, [j]), kv.Job(4, hs[:1], [NB + 11]), NB)
    refused(lambda j: client.store(rid, [j]), kv.Job(5, hs[1:], [NB // 2], group=1), NB // 2)
    refused(lambda j: client.load(rid, [j]), kv.Job(6, keys(1, fingerprint + b"g1"), [NB - 1], group=1), NB // 2)
    assert r.read(0, 2 * LAYER) == snapshot, "a refused job changed engine memory"
    assert client.completions(rid).pending == 0
