"""Client.watch_events against the real daemon (docs/events.md)."""

from __future__ import annotations

import queue
import threading

import pytest
from test_client import fill, keys, kv_region

import kvoffload as kv

K = kv.EventKind


class Reader:
    """Reads a stream on a thread of its own into a queue, so a test waits
    for events with a timeout; close() cancels the stream and joins it."""

    def __init__(self, stream: kv.client.EventStream):
        self.stream = stream
        self.q: queue.Queue = queue.Queue()
        self.held: dict[tuple[int, int, bytes], int] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for evs in self.stream:
                for e in evs:
                    self.q.put(e)
            self.q.put(None)
        except kv.KVOffloadError as e:
            self.q.put(e)

    def next(self, timeout: float = 30.0):
        item = self.q.get(timeout=timeout)
        if isinstance(item, kv.KVOffloadError):
            raise item
        if item is not None:
            name = (item.namespace_id, item.group, item.hash)
            if item.kind == K.BLOCK_STORED:
                self.held[name] = self.held.get(name, 0) | item.tier
            elif item.kind == K.BLOCK_REMOVED:
                left = self.held.get(name, 0) & ~item.tier
                if left:
                    self.held[name] = left
                else:
                    self.held.pop(name, None)
            elif item.kind == K.ALL_BLOCKS_CLEARED:
                self.held = {}
        return item

    def until(self, pred, timeout: float = 30.0) -> list[kv.KVEvent]:
        seen = []
        while True:
            e = self.next(timeout)
            assert e is not None, "the stream ended"
            seen.append(e)
            if pred(e, seen):
                return seen

    def close(self) -> None:
        self.stream.cancel()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


def view_equals_lookup(client, reader, ns, hashes) -> None:
    for h in hashes:
        look = client.lookup([ns], [h])
        want = look.tiers[0] if look.ready == 1 else kv.Tier.NONE
        assert reader.held.get((ns, 0, h), 0) == want, f"block {h[:8].hex()}"
    assert len([n for n in reader.held if n[0] == ns]) == sum(client.lookup([ns], [h]).ready for h in hashes)


def test_watch_store_invalidate(client, shm, fingerprint):
    r, layout, regions = kv_region(shm)
    reg = client.register(fingerprint, layout, regions, client_name="pytest")
    ns = reg.namespace_id
    rd = Reader(client.watch_events([ns]))
    try:
        first = rd.until(lambda e, _: e.kind == K.CAUGHT_UP)
        assert [e.kind for e in first] == [K.ALL_BLOCKS_CLEARED, K.CAUGHT_UP]

        hs = keys(4, fingerprint)
        for b in range(4):
            fill(r, b, b)
        assert client.store(reg.registration_id, [kv.Job(1, hs, [0, 1, 2, 3])], wait=True)[0].ok
        stored = rd.until(lambda e, seen: sum(x.kind == K.BLOCK_STORED for x in seen) == 4)
        assert {e.hash for e in stored if e.kind == K.BLOCK_STORED} == set(hs)
        assert all(e.tier == kv.Tier.CPU and e.namespace_id == ns and e.group == 0 for e in stored if e.kind == K.BLOCK_STORED)
        seqs = [e.seq for e in stored]
        assert seqs == sorted(seqs)

        assert client.invalidate([ns], hs[:2]) == 2
        removed = rd.until(lambda e, seen: sum(x.kind == K.BLOCK_REMOVED for x in seen) == 2)
        assert {e.hash for e in removed if e.kind == K.BLOCK_REMOVED} == set(hs[:2])
        rd.until(lambda e, _: e.kind == K.CAUGHT_UP)
        view_equals_lookup(client, rd, ns, hs)
    finally:
        rd.close()
    assert rd.q.get(timeout=10) is None  # a cancel ends the iteration, no error


def test_unknown_namespace(client):
    rd = Reader(client.watch_events([1 << 31]))
    try:
        with pytest.raises(kv.InvalidArgument):
            rd.next()
    finally:
        rd.close()


def test_restart_is_a_reset_then_the_recovered_blocks(fresh_daemon, shm, fingerprint):
    d = fresh_daemon("--disk-dir", "{dir}/disk", "--write-through", "--disk-direct", "fallback")
    c = d.client()
    r, layout, regions = kv_region(shm)
    reg = c.register(fingerprint, layout, regions, client_name="pytest")
    hs = keys(6, fingerprint)
    for b in range(6):
        fill(r, b, b)
    assert c.store(reg.registration_id, [kv.Job(1, hs, list(range(6)))], wait=True)[0].ok
    rd = Reader(c.watch_events([reg.namespace_id]))
    try:
        # Write-through: each block is on disk too once its write lands.
        rd.until(lambda e, _: sum(1 for t in rd.held.values() if t == kv.Tier.CPU_AND_DISK) == 6)
        d.restart()
        with pytest.raises(kv.Unavailable):
            rd.until(lambda e, _: False)
    finally:
        rd.close()

    c2 = d.client()
    (ns,) = c2.resolve([fingerprint])
    assert ns
    rd = Reader(c2.watch_events([ns]))
    try:
        assert rd.next().kind == K.ALL_BLOCKS_CLEARED
        rd.until(lambda e, _: len(rd.held) == 6)
        assert set(rd.held.values()) == {kv.Tier.DISK}
        view_equals_lookup(c2, rd, ns, hs)
    finally:
        rd.close()
