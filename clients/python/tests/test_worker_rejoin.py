"""A connector worker and a daemon restart, through the real daemon.

The daemon restarts (SIGTERM: it drains and exits; a new process starts on
the same socket, its registration ids from 1 again). The worker watches the
process its registration lives in and registers again with the new one
before it sends that one any Load or Store: nothing the engine offloads
after the restart fails or is lost because of the restart itself
(docs/vllm.md, Failure handling)."""

from __future__ import annotations

import functools

import pytest
import test_connector
from helpers import KVCacheBlocks, Request, SchedulerOutput, wait_for
from test_connector import Harness, prefill
from test_reconnect import live_process  # noqa: F401 - a fixture

import kvoffload as kv
from kvoffload.connector import WorkerSide
from kvoffload.plan import GroupJob

DISK = ("--disk-dir", "{dir}/disk", "--write-through", "--disk-direct", "fallback")


def on_disk(c: kv.Client, ns: int, hashes) -> bool:
    """Every block of ``hashes`` is ready in ``ns`` and written to the disk
    tier (so a restarted daemon recovers it)."""
    r = c.lookup([ns], hashes)
    return r.ready == len(hashes) and all(t in (kv.Tier.DISK, kv.Tier.CPU_AND_DISK) for t in r.tiers)


def settle(h: Harness) -> None:
    """Steps until no job is in flight, then once more for the workers'
    acknowledgements to reach the scheduler."""
    assert h.run_until(h.idle)
    h.step()


def offered(h: Harness, toks: list[int], rid: str, want: int) -> Request:
    """A new request the scheduler offers ``want`` tokens of: after a restart
    it answers from the new daemon once that one recovered them."""
    n = [0]

    def ask():
        n[0] += 1
        r = Request(f"{rid}.{n[0]}", toks)
        got = h.ask(r, 0)
        if got == (want, True):
            return r
        h.sched.request_finished(r)
        return None

    r = wait_for(ask)
    assert r is not None, f"the scheduler never offered {want} tokens of {rid}"
    return r


def load_and_store(h: Harness, hit: Request, blocks: list[int], new: Request, new_blocks: list[int]):
    """One step that loads ``hit``'s offered prefix into ``blocks`` and
    computes and stores ``new`` (its whole prompt) in ``new_blocks``; the
    load is sent first, as vLLM's worker does. Runs until both settled."""
    from helpers import NewRequestData

    assert h.ask(new) == (0, False)
    h.sched.update_state_after_alloc(hit, KVCacheBlocks(blocks), 20)
    h.sched.update_state_after_alloc(new, KVCacheBlocks(new_blocks), 0)
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData(new.request_id, (list(new_blocks),))],
                          num_scheduled_tokens={new.request_id: new.num_tokens})

    def forward(e):
        for i, b in enumerate(new_blocks[: len(new.block_hashes)]):
            e.write(0, b, new.block_hashes[i])

    plan = h.step(out, forward)
    assert plan.loads and hit.request_id in plan.loads
    assert plan.stores and new.request_id in plan.stores
    new.num_computed_tokens = new.num_tokens
    assert h.run_until(lambda: hit.request_id in h.recv[0])
    settle(h)


def registered_with(w, d) -> bool:
    """The worker holds a registration in the daemon serving now."""
    with w._cv:
        reg = w._regs.get(w.registration_id) if w.registration_id is not None else None
        return reg is not None and reg.daemon.serves(d.socket)


def restart_with_a_gap(h: Harness, d, i: int) -> None:
    """SIGTERM; while no daemon listens the engine runs a request (its
    stores are dropped, as for a daemon that is down: nothing waits); then
    a new daemon starts on the socket."""
    import signal

    d.proc.send_signal(signal.SIGTERM)
    d.proc.wait(timeout=30)
    g = Request(f"g{i}", list(range(90_000 + 100 * i, 90_021 + 100 * i)))
    w = h.workers[0]
    w.stats.take()
    prefill(h, g, [20, 21, 22, 23, 24, 25])
    settle(h)
    st = w.stats.take() or {}
    lost = st.get("stores_skipped_total", 0) + sum(n for k, n in st.get("failed_blocks", {}).items()
                                                  if k.startswith("store:"))
    assert lost == 5 and not st.get("blocks_stored_total"), st
    assert not w.registered()
    h.sched.request_finished(g)
    h.step(SchedulerOutput(finished_req_ids={g.request_id}))
    d.restarts += 1
    d._start()


def restarts(h: Harness, d, c_holder: list, rounds: int, *, in_flight: bool, gap: bool = False):
    """``rounds`` restarts; after each, one step loads a prefix stored before
    it and stores a new prompt. Returns per restart (failed load blocks,
    store blocks not acknowledged stored)."""
    w = h.workers[0]
    fp = h.fps[0]
    out = []
    for i in range(rounds):
        base = 10_000 * (i + 1)
        # (Registered with the daemon now serving, whatever the last round did.)
        assert wait_for(lambda: registered_with(w, d))
        a = Request(f"a{i}", list(range(base, base + 21)))
        prefill(h, a, [1, 2, 3, 4, 5, 6])
        settle(h)
        c = c_holder[0]
        (ns,) = c.resolve([fp])
        assert wait_for(lambda: on_disk(c, ns, a.block_hashes[:5]))
        w.stats.take()
        if in_flight:
            # Loads of the stored prefix go out and the daemon gets SIGTERM
            # while they run: it drains them and reports them before it exits.
            r = Request(f"f{i}", a.prompt_token_ids[:20] + [7] * 5)
            assert h.ask(r, 0) == (20, True)
            h.sched.update_state_after_alloc(r, KVCacheBlocks([20, 21, 22, 23, 24, 25, 26]), 20)
            plan = h.step()
            assert plan.loads
        if gap:
            restart_with_a_gap(h, d, i)
            w.stats.take()
        else:
            d.restart()
        d.wait_recovered()
        c_holder[0] = c = d.client()
        flight = {}
        if in_flight:
            # The loads in flight settle: reported by the old daemon, or
            # failed once it exited (a result it had not returned yet).
            assert h.run_until(lambda: f"f{i}" in h.recv[0])
            flight = (w.stats.take() or {}).get("failed_blocks", {})
        # Idle across the restart (or settled): now the next step loads and stores.
        hit = offered(h, a.prompt_token_ids[:20] + [9] * 5, f"b{i}", 20)
        new = Request(f"n{i}", list(range(base + 500, base + 521)))
        load_and_store(h, hit, [30, 31, 32, 33, 34, 35, 36], new, [14, 15, 16, 17, 18, 19])
        st = w.stats.take() or {}
        failed_loads = sum(n for k, n in st.get("failed_blocks", {}).items() if k.startswith("load:"))
        stored = st.get("blocks_stored_total", 0)
        (ns,) = c.resolve([fp])
        held = c.lookup([ns], new.block_hashes[:5]).ready if ns else 0
        out.append((failed_loads, 5 - min(stored, held), st.get("failed_blocks", {}), st.get("stores_skipped_total", 0),
                    flight))
        for r in [a, new]:
            h.sched.request_finished(r)
        h.step(SchedulerOutput(finished_req_ids={a.request_id, new.request_id}))
    return out


@pytest.mark.parametrize("mode", ["idle", "in-flight", "hidden-pid", "gap", "mirror"])
def test_a_worker_registers_with_a_restarted_daemon_before_it_sends_it_anything(fresh_daemon, shm, fingerprint,
                                                                                mode, monkeypatch):
    """The worker is idle across each restart (``in-flight``: a load runs
    at the SIGTERM; ``hidden-pid``: the daemon's pid is not visible, its
    life file tells the exit; ``gap``: the engine runs while no daemon
    listens; ``mirror``: the scheduler answers from its mirror of the
    daemon's events, which follows the new daemon). The first step after it loads a prefix the new daemon
    recovered from disk and stores a new prompt: no load fails, every store
    is acknowledged and held by the new daemon."""
    if mode == "hidden-pid":
        monkeypatch.setattr(test_connector, "WorkerSide", functools.partial(WorkerSide, pid_probe=lambda path: None))
    d = fresh_daemon(*DISK)
    h = Harness(d, shm, fingerprint, mirror=mode == "mirror")
    try:
        if mode == "hidden-pid":
            w = h.workers[0]
            assert w._regs[w.registration_id].daemon.pid is None
        res = restarts(h, d, [d.client()], 3, in_flight=mode == "in-flight", gap=mode == "gap")
        print("per restart (failed load blocks, store blocks lost, failures, skipped):", res)
        assert [r[0] for r in res] == [0, 0, 0], f"loads failed after a restart: {res}"
        assert [r[1] for r in res] == [0, 0, 0], f"stores lost after a restart: {res}"
    finally:
        h.close()


# -- the two paths a real restart rarely takes, driven directly ----------------

def _stale_worker(live_process):
    """A worker with registration 7 in ``live_process`` (standing in for the
    daemon) and a load of it in flight; the process is then killed and
    another pid answers on the socket."""
    from test_reconnect import Clock, StubClient, worker

    class Recording(StubClient):
        def __init__(self):
            super().__init__([])
            self.calls = []

        def store(self, registration_id, jobs, **kw):
            self.calls.append(registration_id)
            raise kv.NotFound(None, "unknown registration")

    w, reg, jid = worker([], Clock(), live_process.pid, answering_pid=live_process.pid + 100000)
    w._client = Recording()
    w._kv = object()  # registered regions: the worker registers them again
    live_process.kill()
    live_process.wait()
    return w, reg, jid


def test_a_call_the_new_daemon_refused_waits_for_the_new_registration(live_process):
    """A restart raced a Store: the new daemon refused it NOT_FOUND (it ran
    nothing). Its jobs go back to the queue for the registration with the
    new daemon, not reported failed; the old registration's load in flight
    is failed (its daemon exited)."""
    from kvoffload.types import Op
    from kvoffload.worker_side import _Batch

    w, reg, jid = _stale_worker(live_process)
    with w._cv:
        sid = w._new_job("req", Op.STORE, GroupJob(0, [b"\x03" * 32], [12]))
        w._jobs[sid].reg = 7
        reg.jobs.add(sid)
        w._sending = (reg, {sid})
    w._send(_Batch(Op.STORE, [sid]), reg, [(sid, w._jobs[sid])], False)
    assert w._client.calls == [7]
    assert sid in w._jobs and w._jobs[sid].reg == 0
    assert [b.jids for b in w._queue] == [[sid]]
    assert w.registration_id is None and w._rejoin and w._holding()
    assert jid not in w._jobs and w._failed_blocks == {10, 11}


def test_the_sender_never_calls_on_a_registration_whose_daemon_exited(live_process):
    import threading

    from kvoffload.types import Op
    from kvoffload.worker_side import _Batch

    w, reg, jid = _stale_worker(live_process)
    with w._cv:
        sid = w._new_job("req", Op.STORE, GroupJob(0, [b"\x03" * 32], [12]))
        w._queue.append(_Batch(Op.STORE, [sid]))
    t = threading.Thread(target=w._send_loop, daemon=True)
    t.start()
    try:
        assert wait_for(lambda: w._rejoin, timeout=30)
        with w._cv:
            assert [b.jids for b in w._queue] == [[sid]] and sid in w._jobs
    finally:
        with w._cv:
            w._stop = True
            w._cv.notify_all()
        t.join(10)
    assert w._client.calls == []


def test_a_call_refused_by_a_new_daemon_while_the_old_tears_down_waits_too(live_process):
    """An overlapping restart: a new daemon serves the socket while the old
    process still tears down (docs/operations.md, Signals), so no exit is
    seen yet. Its NOT_FOUND ran nothing, and nothing of the registration is
    in flight in the old one: the jobs wait for the new registration."""
    from test_reconnect import Clock, StubClient, worker

    from kvoffload.types import Op
    from kvoffload.worker_side import _Batch

    class Refusing(StubClient):
        def store(self, registration_id, jobs, **kw):
            raise kv.NotFound(None, "unknown registration")

    w, reg, jid = worker([], Clock(), live_process.pid, answering_pid=live_process.pid + 100000)
    w._client = Refusing([])
    w._kv = object()
    with w._cv:
        w._settle(jid, failed_all=True)  # nothing of the old registration left in flight
        sid = w._new_job("req", Op.STORE, GroupJob(0, [b"\x03" * 32], [12]))
        w._jobs[sid].reg = 7
        reg.jobs.add(sid)
        w._sending = (reg, {sid})
    w._send(_Batch(Op.STORE, [sid]), reg, [(sid, w._jobs[sid])], False)
    assert sid in w._jobs and [b.jids for b in w._queue] == [[sid]]
    assert w.registration_id is None and w._rejoin
    assert live_process.poll() is None


def test_a_registration_made_across_a_restart_is_let_go_of_before_another_is_made():
    """The daemon answering the socket changed during Register: the
    registration may be either daemon's. It is unregistered (not left
    mapping the engine's memory until the connection closes) and another
    made."""
    from types import SimpleNamespace

    from kvoffload.types import Registration

    class Registering:
        def __init__(self):
            self.calls = []

        def register(self, *a, **kw):
            self.calls.append(("register", kw.get("wait_for_ready")))
            return Registration(len(self.calls), 3, False, "test", 1)

        def unregister(self, rid, **kw):
            self.calls.append(("unregister", rid))

        def close(self):
            pass

    pids = iter([100, 200, 200, 200])
    c = Registering()
    w = WorkerSide("/nonexistent.sock", b"fp", 1, client=c, pid_probe=lambda path: next(pids))
    w._kv = SimpleNamespace(layout=None, regions=[], device="cpu")
    assert w._register(wait=True)
    assert c.calls == [("register", True), ("unregister", 1), ("register", True)]
    assert w.registration_id == 3 and set(w._regs) == {3}
    for r in w._regs.values():
        r.daemon.close()
