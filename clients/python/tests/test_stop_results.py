"""A daemon that stops (SIGTERM) with a worker's loads and stores in flight,
through the real daemon: the jobs it finishes while it drains are reported
to the engine as done, not failed, though the worker had not read their
results when the daemon stopped taking work; a load sent after the SIGTERM
is refused whole, marked so (the trailer ``kvoffload-refusal:
daemon-stopping``), and waits for the next daemon, which serves it. The
daemon removes its socket
once the jobs have drained and then keeps the connections it has answering
Completions until every finished result was sent (``--shutdown-results-wait``,
docs/operations.md, Shutdown and signals); the worker reads them on its old
connection (docs/vllm.md, Failure handling)."""

from __future__ import annotations

import functools
import os
import signal
import threading

import pytest

import test_connector
from helpers import KVCacheBlocks, NewRequestData, Request, SchedulerOutput, wait_for
from test_connector import Harness, prefill
from test_worker_rejoin import DISK, offered, on_disk, registered_with, settle

import kvoffload as kv
from kvoffload.connector import WorkerSide
from kvoffload.types import Op

# Every disk operation takes 300 ms once the restarted daemon has recovered
# its files: a load of blocks only on disk is still running at the SIGTERM.
SLOW_DISK = (*DISK, "--fault-spec", "latency=300ms@1,seed=1")


@pytest.mark.parametrize("next_daemon", [True, False], ids=["next-daemon", "no-daemon"])
def test_jobs_the_daemon_finished_while_it_stopped_are_reported_done(fresh_daemon, shm, fingerprint, next_daemon,
                                                                     monkeypatch):
    """``no-daemon``: none listens after the old one exited; the late load
    waits the register timeout (2 s here) for one, then fails."""
    if not next_daemon:
        monkeypatch.setattr(test_connector, "WorkerSide", functools.partial(WorkerSide, register_timeout_s=2.0))
    d = fresh_daemon(*SLOW_DISK)
    h = Harness(d, shm, fingerprint)
    w = h.workers[0]
    try:
        # A prompt stored and written to disk; a restart leaves it on disk only.
        a = Request("a", list(range(5000, 5021)))
        prefill(h, a, [1, 2, 3, 4, 5, 6])
        settle(h)
        c = d.client()
        (ns,) = c.resolve([h.fps[0]])
        assert wait_for(lambda: on_disk(c, ns, a.block_hashes[:5]))
        h.sched.request_finished(a)
        h.step(SchedulerOutput(finished_req_ids={a.request_id}))
        d.restart()
        d.wait_recovered()
        assert wait_for(lambda: registered_with(w, d))
        hit = offered(h, a.prompt_token_ids[:20] + [9] * 5, "b", 20)
        late = offered(h, a.prompt_token_ids[:20] + [8] * 5, "late", 20)  # its load goes out after the SIGTERM
        w.stats.take()

        # The worker reads no Completions from here until the daemon has
        # stopped taking work: what it would have read before is not what
        # this test is about (a real worker reads them when it can).
        gate = threading.Event()
        real = w._client.completions

        def completions(*args, **kw):
            assert gate.wait(60), "the test never opened the gate"
            return real(*args, **kw)

        w._client.completions = completions

        # One step loads the prefix from disk and computes and stores a new prompt.
        new = Request("n", list(range(6000, 6021)))
        load_to, store_from = [30, 31, 32, 33, 34, 35, 36], [14, 15, 16, 17, 18, 19]
        assert h.ask(new) == (0, False)
        h.sched.update_state_after_alloc(hit, KVCacheBlocks(load_to), 20)
        h.sched.update_state_after_alloc(new, KVCacheBlocks(store_from), 0)
        out = SchedulerOutput(scheduled_new_reqs=[NewRequestData(new.request_id, (list(store_from),))],
                              num_scheduled_tokens={new.request_id: new.num_tokens})
        plan = h.step(out, lambda e: [e.write(0, b, new.block_hashes[i]) for i, b in enumerate(store_from[:5])])
        assert hit.request_id in plan.loads and new.request_id in plan.stores
        new.num_computed_tokens = new.num_tokens

        def accepted():
            # Both calls went out and the daemon accepted them.
            with w._cv:
                return (not w._queue and w._sending is None and w._jobs
                        and all(j.sent_at > 0 and j.reg for j in w._jobs.values()))

        assert wait_for(accepted), "the step's Load and Store were not sent"
        with w._cv:
            loads = [j for j in w._jobs.values() if j.op == Op.LOAD]
        assert loads, "the load finished before the test could stop the daemon"

        c2 = d.client()  # connected to the daemon about to stop
        c2.stats()
        old = d.proc
        old.send_signal(signal.SIGTERM)
        # The old daemon has drained the jobs and removed its socket: it
        # waits for the worker to read their results (or, before this was
        # done, it has exited without them).
        assert wait_for(lambda: old.poll() is not None or "waiting for clients to read the results" in d.log(),
                        timeout=60), d.log()
        assert not os.path.exists(d.socket) or old.poll() is not None
        # A load sent now is refused whole (nothing runs), and the daemon
        # says so: it waits in the worker's queue for the next daemon.
        # (Only while the old daemon waits: one that exited is not asked.)
        late_to = [9, 10, 11, 12, 13, 14, 26]
        waiting = old.poll() is None
        if waiting:
            h.sched.update_state_after_alloc(late, KVCacheBlocks(late_to), 20)
            assert late.request_id in h.step().loads

            def answered():
                with w._cv:
                    return w._sending is None and all(j.sent_at > 0 for j in w._jobs.values())

            assert wait_for(answered), "the late Load was not sent"
            # The client reads the daemon's mark on a call it refused.
            with pytest.raises(kv.Unavailable) as refused:
                c2.lookup([ns], a.block_hashes[:5])
            assert refused.value.daemon_stopping, refused.value
        gate.set()
        assert old.wait(timeout=60) == 0, d.log()
        log = d.log()
        assert "stopped" in log and "did not read the results" not in log, log

        # Nobody listens: the transport's UNAVAILABLE is never marked.
        with pytest.raises(kv.Unavailable) as down:
            c2.lookup([ns], a.block_hashes[:5])
        assert not down.value.daemon_stopping, down.value

        w._client.completions = real
        if not next_daemon:
            # No daemon comes: the late load fails once the worker stopped
            # waiting for one; what the old daemon finished is done.
            want = {hit.request_id, late.request_id} if waiting else {hit.request_id}
            assert h.run_until(lambda: want <= h.recv[0] and h.idle(), timeout=60)
            st = w.stats.take() or {}
            assert h.failed[0] == (set(late_to[:5]) if waiting else set()), (st, h.failed[0])
            assert sum(n for k, n in st.get("failed_blocks", {}).items() if k.startswith("load:")) == \
                (5 if waiting else 0), st
            assert st.get("blocks_stored_total") == 5 and st.get("blocks_loaded_total") == 5, st

        # A new daemon on the socket: the worker registers with it and sends
        # it the late load.
        d.restarts += 1
        d._start()
        assert wait_for(lambda: registered_with(w, d))
        if not next_daemon:
            return

        # The worker settles everything: the loads and the stores the old
        # daemon finished are done, and the late load the new one served;
        # none failed.
        want = {hit.request_id, late.request_id} if waiting else {hit.request_id}
        assert h.run_until(lambda: want <= h.recv[0] and h.idle(), timeout=60)
        st = w.stats.take() or {}
        failed = st.get("failed_blocks", {})
        assert not h.failed[0] and not failed, f"loads or stores reported failed: {st} {h.failed[0]}"
        assert st.get("blocks_stored_total") == 5, st
        assert st.get("blocks_loaded_total") == (10 if waiting else 5), st
        for i in range(5):
            for b in [load_to[i]] + ([late_to[i]] if waiting else []):
                h.engines[0].clear(0, 39)
                h.engines[0].write(0, 39, a.block_hashes[i])
                assert h.engines[0].read(0, b) == h.engines[0].read(0, 39), f"block {b} not loaded"
    finally:
        h.close()
