"""The typed client against the real daemon."""

from __future__ import annotations

import os

import grpc
import pytest
from conftest import daemon_help
from helpers import wait_for

import kvoffload as kv
from kvoffload.client import _health_request, _health_status

SEG = 4096  # bytes of one segment (one of K or V of one block)
NBLK = 16


def kv_region(shm):
    """A /dev/shm file holding K then V of NBLK blocks: two regions, one layout
    of two segments of group 0."""
    r = shm(2 * NBLK * SEG)
    layout = kv.Layout(32, [kv.Segment(0, SEG), kv.Segment(0, SEG)])
    regions = [
        kv.Region.shm(r.path, offset=0, block_stride=SEG, num_blocks=NBLK),
        kv.Region.shm(r.path, offset=NBLK * SEG, block_stride=SEG, num_blocks=NBLK),
    ]
    return r, layout, regions


def fill(r, block: int, tag: int) -> None:
    r.write(block * SEG, bytes([tag % 256]) * 8 + os.urandom(SEG - 8))
    r.write(NBLK * SEG + block * SEG, bytes([(tag + 1) % 256]) * 8 + os.urandom(SEG - 8))


def block_bytes(r, block: int) -> bytes:
    return r.read(block * SEG, SEG) + r.read(NBLK * SEG + block * SEG, SEG)


def keys(n: int, salt: bytes = b"") -> list[bytes]:
    import hashlib

    return [hashlib.sha256(salt + i.to_bytes(4, "little")).digest() for i in range(n)]


def test_health_encoding_roundtrip():
    assert _health_request("") == b""
    assert _health_request("kvoffload.v1.KVOffload")[:2] == b"\x0a\x16"
    assert _health_status(b"\x08\x01") == 1
    assert _health_status(b"") == 0
    assert _health_status(b"\x08\x02") == 2


def test_health_and_stats(daemon, client):
    assert client.healthy()
    assert client.health("kvoffload.v1.KVOffload") == kv.client.HEALTH_SERVING
    st = client.stats()
    assert st.version
    assert any(t.name == "cpu" and t.capacity_bytes == 64 << 20 for t in st.tiers)


def test_store_lookup_load_compare_bytes(client, shm, fingerprint):
    r, layout, regions = kv_region(shm)
    reg = client.register(fingerprint, layout, regions, client_name="pytest")
    assert reg.registration_id > 0 and not reg.joined_existing
    hs = keys(4, fingerprint)
    for b in range(4):
        fill(r, b, 10 + b)
    want = [block_bytes(r, b) for b in range(4)]

    res = client.store(reg.registration_id, [kv.Job(1, hs, [0, 1, 2, 3], request_id="req-a")], wait=True)
    assert len(res) == 1 and res[0].ok and res[0].op == kv.Op.STORE and res[0].blocks == 4
    assert res[0].bytes == 4 * 2 * SEG

    look = client.lookup([reg.namespace_id], hs)
    assert look.ready == 4 and look.tiers == (kv.Tier.CPU,) * 4 and look.lease_id == 0
    # Only the leading ready prefix counts.
    assert client.lookup([reg.namespace_id], [hs[0], keys(1, b"x")[0], hs[2]]).ready == 1

    # Load into other blocks, through Completions.
    client.load(reg.registration_id, [kv.Job(2, hs, [8, 9, 10, 11], request_id="req-b")])
    done = client.wait_jobs(reg.registration_id, [2])
    assert done[2].ok and done[2].request_id == "req-b" and done[2].op == kv.Op.LOAD
    assert [block_bytes(r, b) for b in (8, 9, 10, 11)] == want

    # A store of blocks already cached is a no-op that succeeds.
    again = client.store(reg.registration_id, [kv.Job(3, hs[:2], [5, 6])], wait=True)
    assert again[0].ok
    assert client.completions(reg.registration_id).pending == 0


def test_failed_load_reports_exact_engine_block_ids(client, shm, fingerprint):
    r, layout, regions = kv_region(shm)
    reg = client.register(fingerprint, layout, regions)
    hs = keys(6, fingerprint)
    for b in range(6):
        fill(r, b, b)
    assert client.store(reg.registration_id, [kv.Job(1, hs, list(range(6)))], wait=True)[0].ok
    want = {b: block_bytes(r, b) for b in range(6)}

    # Blocks 1 and 4 of the prefix go (evicted, or invalidated: both MISSING).
    assert client.invalidate([reg.namespace_id], [hs[1], hs[4]]) == 2
    assert client.lookup([reg.namespace_id], hs).ready == 1

    dst = [15, 3, 12, 7, 9, 14]  # engine blocks in no particular order
    client.load(reg.registration_id, [kv.Job(7, hs, dst, request_id="r")])
    res = client.wait_jobs(reg.registration_id, [7])[7]
    assert not res.ok
    assert sorted(res.failed_block_ids) == [3, 9]
    assert {(f.index, f.block_id, f.hash, f.status) for f in res.failures} == {
        (1, 3, hs[1], kv.BlockStatus.MISSING),
        (4, 9, hs[4], kv.BlockStatus.MISSING),
    }
    # The blocks that did load carry the right bytes.
    for i in (0, 2, 3, 5):
        assert block_bytes(r, dst[i]) == want[i]


def test_bad_input_raises_invalid_argument(client, shm, fingerprint):
    r, layout, regions = kv_region(shm)
    reg = client.register(fingerprint, layout, regions)
    hs = keys(2, fingerprint)

    with pytest.raises(kv.InvalidArgument) as ei:
        client.store(reg.registration_id, [kv.Job(1, hs, [0, NBLK])])
    e = ei.value
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and e.code_name == "INVALID_ARGUMENT"
    assert e.from_daemon and e.method == "Store"
    assert "out of range" in e.message and "block_ids[1]" in e.message
    assert isinstance(e, kv.KVOffloadError) and isinstance(e, ValueError)

    # Hashes of another length than the namespace's.
    with pytest.raises(kv.InvalidArgument, match="multiple of the namespace's 32-byte hash"):
        client.load(reg.registration_id, [kv.Job(2, [b"x" * 20], [0])])
    # Keys and block ids that do not pair up.
    with pytest.raises(kv.InvalidArgument, match="2 keys and 1 block_ids"):
        client.load(reg.registration_id, [kv.Job(3, hs, [0])])
    # An unknown namespace.
    with pytest.raises(kv.InvalidArgument, match="namespace"):
        client.lookup([999_999], hs)
    # A region outside /dev/shm.
    with pytest.raises(kv.InvalidArgument, match="not under /dev/shm"):
        client.register(fingerprint + b"-2", layout, [kv.Region.shm("/etc/passwd", block_stride=SEG, num_blocks=1)] * 2)
    # A CUDA region on the host build.
    with pytest.raises(kv.InvalidArgument):
        client.register(fingerprint + b"-3", layout,
                        [kv.Region.cuda(b"\0" * 64, device=0, alloc_size=1 << 20, block_stride=SEG, num_blocks=4)] * 2)
    # Refused by the client before sending: hashes of different lengths.
    with pytest.raises(kv.InvalidArgument) as ei:
        client.lookup([reg.namespace_id], [b"a" * 32, b"b" * 16])
    assert not ei.value.from_daemon
    # Nothing was accepted by the failed calls.
    assert client.completions(reg.registration_id).pending == 0


def test_other_status_codes(client, shm, fingerprint):
    r, layout, regions = kv_region(shm)
    with pytest.raises(kv.NotFound) as ei:
        client.store(987_654, [kv.Job(1, keys(1), [0])])
    assert ei.value.code == grpc.StatusCode.NOT_FOUND
    client.register(fingerprint, layout, regions)
    other = kv.Layout(32, [kv.Segment(0, SEG)])
    with pytest.raises(kv.FailedPrecondition):
        client.register(fingerprint, other, regions[:1])


def test_closing_the_channel_unregisters(daemon, shm, fingerprint):
    r, layout, regions = kv_region(shm)
    c1 = daemon.client()
    reg = c1.register(fingerprint, layout, regions)
    c2 = daemon.client()
    assert c2.completions(reg.registration_id).pending == 0
    c1.close()

    def gone():
        try:
            c2.completions(reg.registration_id)
            return False
        except kv.NotFound:
            return True

    assert wait_for(gone)
    # A new registration with the same fingerprint joins the namespace.
    again = c2.register(fingerprint, layout, regions)
    assert again.joined_existing and again.namespace_id == reg.namespace_id


def test_unregister_and_unavailable(fresh_daemon, shm, fingerprint):
    d = fresh_daemon()
    c = d.client()
    r, layout, regions = kv_region(shm)
    reg = c.register(fingerprint, layout, regions)
    c.unregister(reg.registration_id)
    with pytest.raises(kv.NotFound):
        c.unregister(reg.registration_id)
    # Nobody listening: Unavailable.
    gone = kv.Client(os.path.join(d.dir, "nope.sock"), timeout=2)
    with pytest.raises(kv.Unavailable):
        gone.stats()
    gone.close()


def test_disk_read_fault_reports_exact_block_ids(fresh_daemon, shm, fingerprint, scratch_dir):
    """A block on disk whose read fails (an injected EIO) comes back as a
    failed load of exactly its engine block id, IO_ERROR, and is never
    offered again."""
    disk_dir = scratch_dir
    flags = ["--disk-dir", disk_dir, "--disk-bytes", "16MiB", "--write-through"]
    r, layout, regions = kv_region(shm)
    hs = keys(4, fingerprint)
    for b in range(4):
        fill(r, b, 40 + b)
    want = [block_bytes(r, b) for b in range(4)]

    # A healthy run writes the blocks through to disk.
    d = fresh_daemon(*flags)
    c = d.client()
    reg = c.register(fingerprint, layout, regions)
    assert c.store(reg.registration_id, [kv.Job(1, hs, [0, 1, 2, 3])], wait=True)[0].ok
    assert wait_for(lambda: c.lookup([reg.namespace_id], hs, peek=True).tiers == (kv.Tier.CPU_AND_DISK,) * 4)
    assert d.stop() == 0

    # Restarted on the same disk, which now fails every read (the plan
    # starts after recovery): the blocks are offered from disk, and the
    # load reports each engine block it could not fill.
    d = fresh_daemon(*flags, "--fault-spec", "read-eio=1,seed=7")
    c = d.client()
    reg = c.register(fingerprint, layout, regions)
    assert reg.joined_existing
    # Stats says where the background recovery of the slot files is.
    assert wait_for(lambda: c.stats().disk_recovery.state == kv.RecoveryState.DONE)
    rec = c.stats().disk_recovery
    assert rec.blocks_recovered == 4 and rec.bad_slots == 0, rec
    assert 0 < rec.slots_scanned <= rec.slots_total and 0 < rec.bytes_scanned <= rec.bytes_total, rec
    look = c.lookup([reg.namespace_id], hs)
    assert look.ready == 4 and look.tiers == (kv.Tier.DISK,) * 4
    [res] = c.load(reg.registration_id, [kv.Job(2, hs, [8, 9, 10, 11])], wait=True)
    assert not res.ok
    assert sorted(res.failed_block_ids) == [8, 9, 10, 11]
    assert {f.status for f in res.failures} == {kv.BlockStatus.IO_ERROR}
    assert c.lookup([reg.namespace_id], hs).ready == 0
    # The CPU copies from the first run are gone with it; the bytes in the
    # engine's blocks 0..3 are untouched.
    assert [block_bytes(r, b) for b in range(4)] == want


def test_completions_stay_until_the_next_call_acknowledges_them(client, shm, fingerprint):
    """The cursor (docs/api.md): the daemon keeps each result until the
    client's next call acknowledges it, so a reply lost with its connection
    comes again; results of one call are never returned twice."""
    from kvoffload._proto.kvoffload.v1 import kvoffload_pb2 as pb

    r, layout, regions = kv_region(shm)
    reg = client.register(fingerprint, layout, regions)
    hs = keys(3, fingerprint)
    for b in range(3):
        fill(r, b, 30 + b)
    client.store(reg.registration_id, [kv.Job(i + 1, [hs[i]], [i]) for i in range(3)])
    seen: list[int] = []
    last: tuple = ()
    while len(seen) < 3:
        c = client.completions(reg.registration_id, wait_ms=2000)
        assert not set(x.job_id for x in c.results) & set(seen), "a result came twice"
        seen += [x.job_id for x in c.results]
        last = c.results or last
    assert sorted(seen) == [1, 2, 3]

    def raw(ack):
        req = pb.CompletionsRequest(registration_id=reg.registration_id)
        if ack is not None:
            req.ack_seq = ack
        return client._stub.Completions(req, timeout=10)

    # The last reply is not acknowledged yet: had it been lost, asking again
    # from the same point sends it again.
    again = raw(client._acked[reg.registration_id] - len(last))
    assert [x.job_id for x in again.results] == [x.job_id for x in last]
    assert [x.seq for x in again.results] == sorted(x.seq for x in again.results)
    # The client's next call acknowledges it: nothing is left.
    assert client.completions(reg.registration_id).results == ()
    assert list(raw(0).results) == []


def test_a_new_registration_reads_its_results_from_the_start(fresh_daemon, shm, fingerprint):
    """completions() acknowledges the seq it last returned per registration
    id. A restarted daemon gives the same ids out again, from seq 1: a client
    that kept the old cursor would acknowledge, and so drop, the new
    registration's first results unread."""
    r, layout, regions = kv_region(shm)
    hs = keys(4, fingerprint)
    d = fresh_daemon()
    c = d.client()
    reg = c.register(fingerprint, layout, regions)
    c.store(reg.registration_id, [kv.Job(i + 1, [hs[i]], [i]) for i in range(3)])
    got = set()
    assert wait_for(lambda: got.update(x.job_id for x in c.completions(reg.registration_id, wait_ms=100).results)
                    or got == {1, 2, 3})
    d.restart()
    assert wait_for(lambda: c.healthy())
    reg2 = c.register(fingerprint, layout, regions)
    assert reg2.registration_id == reg.registration_id  # the case this test is about
    c.store(reg2.registration_id, [kv.Job(1, [hs[3]], [3])])
    res = wait_for(lambda: c.completions(reg2.registration_id, wait_ms=100).results)
    assert [x.job_id for x in res] == [1], "the new registration's first result was acknowledged before it was read"


def test_store_and_load_return_the_finished_results(client, shm, fingerprint):
    """``completions=True`` on a Store or Load: the call acknowledges the
    cursor and returns what completions() would, so a client that sends a
    Store or Load anyway needs no Completions call (docs/api.md, Results on
    a Store or Load). A reply that never reached the client costs nothing:
    its results come again with the next call."""
    from kvoffload._proto.kvoffload.v1 import kvoffload_pb2 as pb

    r, layout, regions = kv_region(shm)
    reg = client.register(fingerprint, layout, regions)
    rid = reg.registration_id
    hs = keys(4, fingerprint)
    missing = keys(2, fingerprint + b"/never stored")
    for b in range(2):
        fill(r, b, 50 + b)
    # A load of keys never stored finishes inside its call: its own result
    # is on the reply.
    c = client.load(rid, [kv.Job(1, missing, [8, 9])], completions=True)
    assert isinstance(c, kv.Completions) and [x.job_id for x in c.results] == [1] and not c.more
    assert c.results[0].failed_block_ids == [8, 9] and c.results[0].seq == 1
    with pytest.raises(kv.InvalidArgument):
        client.store(rid, [kv.Job(2, hs[:1], [0])], wait=True, completions=True)
    # A store; once it finished, the next call brings it.
    c = client.store(rid, [kv.Job(2, hs[:2], [0, 1])], completions=True)
    assert all(x.job_id == 2 for x in c.results)
    assert wait_for(lambda: client._stub.Completions(
        pb.CompletionsRequest(registration_id=rid, ack_seq=1), timeout=10).pending == 0)
    if not c.results:
        c = client.load(rid, [kv.Job(3, missing, [10, 11])], completions=True)
        assert [x.job_id for x in c.results][:1] == [2]
    # Had the last reply been lost, a call from the same cursor gets its
    # results again; the client's next call acknowledges them.
    last = c.results
    again = client._stub.Completions(pb.CompletionsRequest(registration_id=rid, ack_seq=last[0].seq - 1), timeout=10)
    assert [x.job_id for x in again.results] == [x.job_id for x in last]
    c = client.load(rid, [kv.Job(4, hs[:2], [12, 13])], completions=True)
    assert not {x.job_id for x in c.results} & {x.job_id for x in last}, "a result came twice"
    got = {x.job_id: x for x in c.results}
    while 4 not in got:
        got.update((x.job_id, x) for x in client.completions(rid, wait_ms=1000).results)
    assert got[4].ok and [block_bytes(r, b) for b in (12, 13)] == [block_bytes(r, b) for b in (0, 1)]
    assert client.completions(rid).results == ()


def test_a_slow_handshake_is_waited_for_not_failed(fresh_daemon):
    """A daemon that takes longer than gRPC's 100 ms floor to answer a new
    connection (a loaded machine; here stopped for half a second) costs a
    call that time, within its deadline, not UNAVAILABLE at once: with
    grpc.min_reconnect_backoff_ms at 50 every connection attempt had 100 ms
    to finish its handshake, and the vLLM worker's Register failed so."""
    import threading

    d = fresh_daemon()
    d.pause()
    resume = threading.Timer(0.5, d.resume)
    resume.start()
    c = kv.Client(d.socket, timeout=30)
    try:
        assert c.stats().version
    finally:
        c.close()
        resume.cancel()
        d.resume()


def test_find_registrations_by_key(client, shm, fingerprint):
    """A scheduler finds what its workers registered under by the key they
    registered with: every live fingerprint of the key, none once gone."""
    r, layout, regions = kv_region(shm)
    key = b"engine-key:" + fingerprint
    a = client.register(fingerprint + b"-a", layout, regions, registration_key=key)
    b = client.register(fingerprint + b"-b", layout, regions, registration_key=key)
    c = client.register(fingerprint + b"-a", layout, regions, registration_key=key)
    plain = client.register(fingerprint + b"-c", layout, regions)
    assert client.find_registrations([key, b"other", key]) == [
        sorted([fingerprint + b"-a", fingerprint + b"-b"]), [], sorted([fingerprint + b"-a", fingerprint + b"-b"])]
    client.unregister(b.registration_id)
    client.unregister(a.registration_id)
    assert client.find_registrations([key]) == [[fingerprint + b"-a"]]  # c still holds it
    client.unregister(c.registration_id)
    assert client.find_registrations([key]) == [[]]
    client.unregister(plain.registration_id)
    with pytest.raises(kv.InvalidArgument, match="keys\\[0\\]"):
        client.find_registrations([b""])
    with pytest.raises(kv.InvalidArgument, match="keys has 65 entries, at most 64"):
        client.find_registrations([b"k"] * 65)
    with pytest.raises(kv.InvalidArgument, match="registration_key"):
        client.register(fingerprint + b"-d", layout, regions, registration_key=b"k" * 257)
