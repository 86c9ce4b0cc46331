"""The CPU tier across a kill -9 of the daemon (--cpu-arena-dir): the
connector re-registers with the new process, joins the namespace the arena
brought back (same fingerprint), and its lookups hit the recovered blocks,
which load byte-exact (docs/operations.md, "Keeping the CPU tier across
restarts")."""

from __future__ import annotations

import shutil
import tempfile

from helpers import KVCacheBlocks, Request, wait_for
from test_client import fill, keys, kv_region
from test_connector import Harness, prefill
from test_events import K, Reader, view_equals_lookup

import kvoffload as kv


def test_recovered_cpu_blocks_are_hit_after_a_kill(fresh_daemon, shm, fingerprint):
    arena = tempfile.mkdtemp(dir="/dev/shm", prefix="kvo-arena-py-")
    try:
        d = fresh_daemon("--cpu-arena-dir", arena)
        h = Harness(d, shm, fingerprint)
        try:
            tokens = list(range(500, 522))
            r1 = Request("r1", tokens)  # 5 full blocks of 4 tokens
            prefill(h, r1, [1, 2, 3, 4, 5, 6])
            assert h.run_until(h.idle)

            d.proc.kill()  # SIGKILL: nothing is flushed or handed over
            d.proc.wait()
            d.restarts += 1
            d._start()

            # The worker meets the new process at its next store and
            # registers again, joining the namespace of the same fingerprint.
            prefill(h, Request("y", list(range(900, 921))), [7, 8, 9, 10, 11, 12])
            assert h.run_until(lambda: h.workers[0].registered() and h.workers[0].registration_id is not None
                               and h.workers[0]._regs[h.workers[0].registration_id].daemon.pid == d.proc.pid)
            r2 = Request("r2", tokens[:20] + [99] * 9)
            # Offered once the arena's recovery has verified them.
            assert wait_for(lambda: h.ask(r2, 0) == (20, True) or None, timeout=30)
            h.sched.update_state_after_alloc(r2, KVCacheBlocks([20, 21, 22, 23, 24, 25, 26, 27]), 20)
            h.step()
            assert h.run_until(lambda: "r2" in h.recv[0])
            assert h.failed[0] == set()
            e = h.engines[0]
            for src, dst in zip([1, 2, 3, 4, 5], [20, 21, 22, 23, 24]):
                assert e.read(0, dst) == e.read(0, src)
        finally:
            h.close()
    finally:
        shutil.rmtree(arena, ignore_errors=True)


def test_a_kill_is_a_reset_then_the_recovered_cpu_blocks(fresh_daemon, shm, fingerprint):
    """A KV-aware router watching the events learns, after a kill -9 and a
    restart on the same arena, a reset and then every recovered block, in
    the CPU tier, as Lookup offers them (docs/events.md)."""
    arena = tempfile.mkdtemp(dir="/dev/shm", prefix="kvo-arena-py-")
    try:
        d = fresh_daemon("--cpu-arena-dir", arena)
        c = d.client()
        r, layout, regions = kv_region(shm)
        reg = c.register(fingerprint, layout, regions, client_name="pytest")
        hs = keys(6, fingerprint)
        for b in range(6):
            fill(r, b, b)
        assert c.store(reg.registration_id, [kv.Job(1, hs, list(range(6)))], wait=True)[0].ok
        c.close()
        d.proc.kill()
        d.proc.wait()
        d.restarts += 1
        d._start()

        c2 = d.client()
        (ns,) = c2.resolve([fingerprint])
        assert ns
        rd = Reader(c2.watch_events([ns]))
        try:
            assert rd.next().kind == K.ALL_BLOCKS_CLEARED
            rd.until(lambda e, _: len(rd.held) == 6)
            assert set(rd.held.values()) == {kv.Tier.CPU}
            view_equals_lookup(c2, rd, ns, hs)
        finally:
            rd.close()
    finally:
        shutil.rmtree(arena, ignore_errors=True)
