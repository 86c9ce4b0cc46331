"""What a daemon restart costs a worker that was idle across it.

    KVOFFLOADD_BIN=bin/kvoffloadd python3 clients/python/tests/measure_rejoin.py [--restarts 5] [--after 2]

One worker (test_connector.Harness) against a real daemon with a disk tier.
Per restart: a prompt is stored and written to disk, the daemon restarts
(SIGTERM, a new process on the socket) while the worker sends nothing, and
as soon as the new daemon serves, the engine steps every 20 ms for
``--after`` seconds, each step computing and storing a new prompt (5
blocks); the first step the scheduler offers the stored prefix (recovered
from disk) also loads it. Prints per restart the load blocks that failed,
the store blocks not acknowledged stored (dropped unsent or failed), and
the seconds from the new daemon serving to the first acknowledged store.
``KVOFFLOAD_PKG=/path/to/clients/python`` measures another version.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import conftest  # noqa: E402  (puts the package on sys.path, finds the daemon)
from helpers import KVCacheBlocks, NewRequestData, Request, SchedulerOutput, wait_for  # noqa: E402
from test_connector import Harness, prefill  # noqa: E402

from kvoffload import ShmRegion  # noqa: E402

DISK = ["--disk-dir", "{dir}/disk", "--write-through", "--disk-direct", "fallback"]


def lost_stores(st: dict) -> int:
    return st.get("stores_skipped_total", 0) + sum(n for k, n in st.get("failed_blocks", {}).items()
                                                   if k.startswith("store:"))


def failed_loads(st: dict) -> int:
    return sum(n for k, n in st.get("failed_blocks", {}).items() if k.startswith("load:"))


def one_restart(h: Harness, d, c, i: int, after: float) -> dict:
    w = h.workers[0]
    assert wait_for(lambda: w.registered(), timeout=30)
    base = 100_000 * (i + 1)
    a = Request(f"a{i}", list(range(base, base + 21)))
    prefill(h, a, [1, 2, 3, 4, 5, 6])
    assert h.run_until(h.idle)
    (ns,) = c.resolve([h.fps[0]])
    assert wait_for(lambda: c.lookup([ns], a.block_hashes[:5]).ready == 5 and all(
        t.name in ("DISK", "CPU_AND_DISK") for t in c.lookup([ns], a.block_hashes[:5]).tiers))
    h.sched.request_finished(a)
    h.step(SchedulerOutput(finished_req_ids={a.request_id}))
    w.stats.take()
    d.restart()
    t0 = time.monotonic()
    c = d.client()
    first_ok = None
    loaded = False
    k = 0
    sets = [[7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 24], [25, 26, 27, 28, 29, 30]]
    while time.monotonic() - t0 < after:
        blocks = sets[k % len(sets)]
        n = Request(f"n{i}.{k}", list(range(base + 1000 + 30 * k, base + 1021 + 30 * k)))
        hit = None
        if not loaded:
            r = Request(f"b{i}.{k}", a.prompt_token_ids[:20] + [9] * 5)
            got = h.sched.get_num_new_matched_tokens(r, 0)
            if got == (20, True):
                hit = r
                h.sched.update_state_after_alloc(hit, KVCacheBlocks([31, 32, 33, 34, 35, 36, 37]), 20)
                loaded = True
            elif got[0] is not None:
                h.sched.request_finished(r)
        assert h.ask(n) == (0, False)
        h.sched.update_state_after_alloc(n, KVCacheBlocks(blocks), 0)
        out = SchedulerOutput(scheduled_new_reqs=[NewRequestData(n.request_id, (list(blocks),))],
                              num_scheduled_tokens={n.request_id: n.num_tokens})
        h.step(out, lambda e, n=n, blocks=blocks: [e.write(0, b, n.block_hashes[j]) for j, b in enumerate(blocks[:5])])
        n.num_computed_tokens = n.num_tokens
        h.sched.request_finished(n)
        if hit is not None:
            assert h.run_until(lambda: hit.request_id in h.recv[0])
            h.sched.request_finished(hit)
        h.step(SchedulerOutput(finished_req_ids={n.request_id} | ({hit.request_id} if hit else set())))
        if first_ok is None:
            (ns,) = c.resolve([h.fps[0]])
            if ns and c.lookup([ns], n.block_hashes[:5]).ready == 5:
                first_ok = time.monotonic() - t0
        k += 1
        time.sleep(0.02)
    assert h.run_until(h.idle)
    st = w.stats.take() or {}
    return {"steps": k, "load_offered": loaded, "failed_load_blocks": failed_loads(st),
            "lost_store_blocks": lost_stores(st), "stored_blocks": st.get("blocks_stored_total", 0),
            "first_store_s": round(first_ok, 3) if first_ok is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--after", type=float, default=2.0)
    args = ap.parse_args()
    d = conftest.Daemon(DISK, log_level="warn")
    made: list[ShmRegion] = []

    def shm(size):
        r = ShmRegion(size)
        made.append(r)
        return r

    h = Harness(d, shm, f"measure-rejoin:{time.time_ns()}".encode())
    try:
        c = d.client()
        for i in range(args.restarts):
            print(json.dumps(one_restart(h, d, c, i, args.after)), flush=True)
            c = d.client()
    finally:
        h.close()
        d.stop()
        d.cleanup()
        for r in made:
            r.close()


if __name__ == "__main__":
    main()
