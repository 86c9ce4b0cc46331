"""A tour of kvoffloadd: register a /dev/shm region as an engine would,
store blocks, look them up, load them into other blocks, compare bytes.

    make run                                   # terminal 1
    PYTHONPATH=clients/python /usr/bin/python3 examples/tour.py   # terminal 2
    curl -s 127.0.0.1:9464/metrics | grep ^kvoffload_

The socket defaults to the daemon's default; set KVOFFLOADD_SOCKET to override.
"""
import os
import tempfile

from kvoffload import Client, Job, Layout, Region, Segment, ShmRegion


def default_socket() -> str:
    if os.environ.get("KVOFFLOADD_SOCKET"):
        return os.environ["KVOFFLOADD_SOCKET"]
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        return os.path.join(run, "kvoffloadd", "kvoffloadd.sock")
    return os.path.join(tempfile.gettempdir(), f"kvoffloadd-{os.getuid()}", "kvoffloadd.sock")


LAYERS, SEG, BLOCKS = 4, 64 * 1024, 32          # 4 layers x 64 KiB = 256 KiB per block
layout = Layout(hash_bytes=32, segments=[Segment(group=0, bytes=SEG)] * LAYERS)

with Client(default_socket()) as c, ShmRegion(LAYERS * BLOCKS * SEG) as shm:
    c.wait_ready()
    # One region entry per layer: layer l's blocks are contiguous in the file.
    regions = [Region.shm(shm.path, offset=l * BLOCKS * SEG, block_stride=SEG, num_blocks=BLOCKS)
               for l in range(LAYERS)]
    reg = c.register(b"tour-model/fp16/block16/rank0", layout, regions, client_name="tour")
    print("registered:", reg)

    def seg(layer: int, block: int) -> int:
        return (layer * BLOCKS + block) * SEG

    hashes = [bytes([i]) * 32 for i in range(1, 5)]            # 4 chained block hashes
    for b, h in enumerate(hashes):                             # the "engine" writes KV
        for l in range(LAYERS):
            shm.write(seg(l, b), h[:1] * SEG)
    [res] = c.store(reg.registration_id, [Job(1, hashes, [0, 1, 2, 3], request_id="r1")], wait=True)
    print("store:", res.ok, res.bytes, "bytes")

    look = c.lookup([reg.namespace_id], hashes + [b"\xee" * 32])
    print("lookup: ready", look.ready, "of 5, tiers", [t.name for t in look.tiers])

    [res] = c.load(reg.registration_id, [Job(2, hashes, [10, 11, 12, 13], request_id="r2")], wait=True)
    same = all(shm.read(seg(l, 10 + i), SEG) == h[:1] * SEG for i, h in enumerate(hashes) for l in range(LAYERS))
    print("load:", res.ok, "bytes identical:", same)

    c.invalidate([reg.namespace_id], hashes[2:3])
    [res] = c.load(reg.registration_id, [Job(3, hashes, [20, 21, 22, 23])], wait=True)
    print("after invalidating block 2, failed engine blocks:", res.failed_block_ids)
    assert same and res.failed_block_ids == [22]
