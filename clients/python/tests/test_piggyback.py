"""One round trip less per engine step (issue 11 item 4): the worker reads
finished results from the replies of the Store and Load calls it sends
anyway, and calls Completions only when those will not bring them soon
enough. Counted through the real daemon, with the worker's clock held
still so that only what the worker decides, never this machine's timing,
makes the poller call."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter

import pytest
from helpers import Engine, wait_for

import kvoffload as kv
from kvoffload._proto.kvoffload.v1 import kvoffload_pb2 as pb
from kvoffload.plan import GroupJob, StepPlan
from kvoffload.regions import regions_from_kv_caches
from kvoffload.worker_side import WorkerSide

NB = 40


class CountingClient(kv.Client):
    """A client that counts its calls by method."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    def _call(self, method, request, *a, **kw):
        with self._count_lock:
            self.calls[method] += 1
        return super()._call(method, request, *a, **kw)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Rig:
    """A worker side over the real daemon, driven step by step, with a
    second connection that looks at the registration's queue without
    acknowledging anything (ack_seq 0)."""

    def __init__(self, daemon, shm, fingerprint, piggyback):
        self.eng = Engine(shm, {0: ["layers.0.attn", "layers.1.attn"]}, (4,), NB)
        self.clock = Clock()
        self.client = CountingClient(daemon.socket, timeout=None)
        self.w = WorkerSide(daemon.socket, fingerprint, 1, client=self.client, clock=self.clock, piggyback=piggyback)
        assert self.w.register(regions_from_kv_caches(self.eng.kv_caches, self.eng.layer_groups(), NB, 32))
        self.peek = daemon.client()
        self.fp = fingerprint

    def pending(self) -> int:
        req = pb.CompletionsRequest(registration_id=self.w.registration_id, ack_seq=0)
        return self.peek._stub.Completions(req, timeout=10).pending

    def sent(self) -> bool:
        """The sender has sent everything queued and its call returned."""
        with self.w._cv:
            return not self.w._queue and self.w._send_started is None

    def hashes(self, k: int, n: int = 2) -> list[bytes]:
        return [hashlib.sha256(self.fp + b"%d/%d" % (k, i)).digest() for i in range(n)]

    def store_step(self, k: int) -> list[int]:
        """One engine step that stores two blocks: the forward pass writes
        them, wait_for_save queues one Store."""
        hs, blocks = self.hashes(k), [2 * k + 1, 2 * k + 2]
        for b, h in zip(blocks, hs):
            self.eng.write(0, b, h)
        jids = self.w.wait_for_save(StepPlan(seq=k + 1, stores={f"r{k}": [GroupJob(0, hs, blocks)]}))
        assert jids and wait_for(self.sent)
        return jids

    def close(self):
        self.w.shutdown()


@pytest.fixture
def rig(daemon, shm, fingerprint):
    made = []

    def make(piggyback):
        r = Rig(daemon, shm, fingerprint + b"/%d" % len(made), piggyback)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


STEPS = 8


def test_a_step_that_stores_reads_its_results_on_the_store_reply(rig):
    """Steps that each send one Store: every earlier step's results come
    back on that Store's reply, and the worker makes no Completions call
    (before: the poller read Completions while anything was in flight).
    Once the engine sends nothing more, the poller reads the last ones."""
    r = rig(True)
    prev: list[int] = []
    for k in range(STEPS):
        jids = r.store_step(k)
        # The earlier steps' stores had finished before this Store went
        # out (checked below): its reply settled them.
        assert r.w.jobs_done(prev), f"step {k}: earlier stores not settled by the Store reply"
        assert wait_for(lambda: r.pending() == 0)
        prev += jids
    during = dict(r.client.calls)
    assert during.get("Store") == STEPS and not during.get("Load")
    assert not during.get("Completions"), f"Completions called while every step sent a Store: {during}"
    assert not r.w.jobs_done(prev), "the last step's store was settled with no call reading it"
    # The engine stops sending: after poll_wait_ms the poller reads them.
    r.clock.t += 1.0
    with r.w._cv:
        r.w._cv.notify_all()
    assert wait_for(lambda: r.w.pending() == 0)
    assert r.client.calls["Completions"] >= 1
    during = {m: during.get(m, 0) for m in ("Store", "Load", "Completions")}
    print(f"piggyback: {STEPS} steps, {during} during the steps ({sum(during.values()) / STEPS:.2f} RPCs per step)")


def test_without_piggyback_the_poller_reads_every_step(rig):
    """The same steps with results read from Completions only (as before,
    and as against a daemon that returns none on Store and Load): the
    poller calls Completions while jobs are in flight."""
    r = rig(False)
    for k in range(STEPS):
        jids = r.store_step(k)
        assert wait_for(lambda: r.w.jobs_done(jids))
    calls = {m: r.client.calls.get(m, 0) for m in ("Store", "Load", "Completions")}
    assert calls["Store"] == STEPS and calls["Completions"] >= 1
    print(f"no piggyback: {STEPS} steps, {calls} ({sum(calls.values()) / STEPS:.2f} RPCs per step)")


def test_a_load_is_reported_without_waiting_for_the_next_step(rig):
    """Through the real daemon: a load is reported by get_finished with no
    further Store or Load (the worker's clock stands still, so the idle
    rule never fires: the load's own reply or the poller brought it)."""
    r = rig(True)
    jids = r.store_step(0)
    assert wait_for(lambda: r.pending() == 0)
    r.store_step(1)  # its reply settles step 0's store
    assert r.w.jobs_done(jids)
    r.w.start_load_kv(StepPlan(seq=3, loads={"l": [GroupJob(0, r.hashes(0), [30, 31])]}))
    got: set[str] = set()
    assert wait_for(lambda: got.update(r.w.get_finished(set())[1] or ()) or "l" in got)
    assert r.client.calls["Load"] == 1 and r.client.calls["Store"] == 2
    assert not r.w.get_block_ids_with_load_errors()


def test_a_load_in_flight_is_polled_for():
    """A load the daemon has not finished when it answers the Load (a fake
    daemon that holds it): the poller reads Completions while it is in
    flight, with the worker's clock held, so the request that waits for it
    is reported as soon as it finishes, not a step later. A store in
    flight alone is left to the next call."""
    from fake_daemon import FakeDaemon

    from kvoffload.regions import KVRegistration
    from kvoffload.types import Layout, Segment

    fake = FakeDaemon()
    fake.piggyback = True
    clock = Clock()
    client = CountingClient(fake.socket, timeout=None)
    w = WorkerSide(fake.socket, b"fp", 1, clock=clock, client=client)
    try:
        assert w.register(KVRegistration(Layout(32, [Segment(0, 64)]), [], [], NB, "cpu"))
        stores = w.wait_for_save(StepPlan(seq=1, stores={"s": [GroupJob(0, [b"\x01" * 32], [3])]}))
        assert wait_for(lambda: fake.pending() == stores)
        fake.finish(stores)
        # A store alone: nothing polls for it while the clock stands still.
        assert not wait_for(lambda: w.jobs_done(stores), timeout=0.3)
        assert client.calls["Completions"] == 0 and w._piggyback
        loads = w.start_load_kv(StepPlan(seq=2, loads={"l": [GroupJob(0, [b"\x02" * 32], [4])]}))
        assert wait_for(lambda: set(fake.pending()) == set(loads))
        fake.finish(loads)
        got: set[str] = set()
        assert wait_for(lambda: got.update(w.get_finished(set())[1] or ()) or "l" in got)
        assert client.calls["Completions"] >= 1 and client.calls["Load"] == 1 and client.calls["Store"] == 1
        assert w.jobs_done(stores), "the poll that read the load read the finished store too"
    finally:
        w.shutdown()
        fake.stop()


def test_a_daemon_that_returns_no_results_on_the_reply():
    """A daemon that returns nothing on a Store reply (one from before
    results rode on it; here the fake daemon) is found out from the first
    reply: the worker reads Completions from then on, as before."""
    from fake_daemon import FakeDaemon

    from kvoffload.regions import KVRegistration
    from kvoffload.types import Layout, Segment

    fake = FakeDaemon()
    clock = Clock()
    w = WorkerSide(fake.socket, b"fp", 1, clock=clock)
    try:
        assert w.register(KVRegistration(Layout(32, [Segment(0, 64)]), [], [], NB, "cpu"))
        jids = w.wait_for_save(StepPlan(seq=1, stores={"s": [GroupJob(0, [b"\x01" * 32], [3])]}))
        assert wait_for(lambda: fake.pending() == jids)
        assert wait_for(lambda: not w._piggyback)
        # The clock stands still: only the switch to Completions settles it.
        fake.finish()
        assert wait_for(lambda: w.jobs_done(jids))
        (_, req), = fake.calls
        assert req.HasField("ack_seq")
    finally:
        w.shutdown()
        fake.stop()
