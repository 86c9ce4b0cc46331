"""How long engine steps wait on stores while the daemon is stopped (SIGSTOP).

    KVOFFLOADD_BIN=bin/kvoffloadd python3 clients/python/tests/measure_fence.py [--pause 2]

Runs the stand-in with a full-attention + sliding-window model against a real
daemon: requests decode, then the daemon is stopped for ``--pause`` seconds
while the engine keeps stepping. Two pools: ``roomy`` (vLLM's free queue
order; blocks freed behind the window are not handed out again during the
pause) and ``reuse`` (a freed block is the next one allocated, with more
requests arriving: blocks are reused while their stores are in flight), each
with synchronous and async scheduling. Prints per run the steps done during
the pause, the longest connector time of a step then (every connector call
of the scheduler plus the slowest worker's), the steps over 100 ms, and the
fences (blocks named; worker fences that found a store in flight).
``KVOFFLOAD_PKG=/path/to/clients/python`` measures another version.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import conftest  # noqa: E402  (puts the package on sys.path, finds the daemon)
from standin_engine import Config, Engine, Group  # noqa: E402
from standin_run import connector_module  # noqa: E402

from kvoffload import ShmRegion  # noqa: E402


def one(mod, shm, name: str, reuse: bool, async_scheduling: bool, pause: float) -> dict:
    d = conftest.Daemon(log_level="warn")
    try:
        cfg = Config(groups=[Group("full", 4, 1), Group("swa", 4, 1, window=8)], async_scheduling=async_scheduling,
                     num_blocks=56 if reuse else 1200, max_seqs=6 if reuse else 4, long_prefill=4 if reuse else 0,
                     max_batched_tokens=24 if reuse else 64, reuse_freed_first=reuse, model=f"fence-{name}")
        eng = Engine(cfg, mod, d.socket, shm)
        try:
            n = 6 if reuse else 4
            for i in range(n):
                eng.add_request(f"a{i}", [3000 + 100 * i + k for k in range(32 if reuse else 16)], 8 if reuse else 250)
            for _ in range(3):
                eng.step()
            first = len(eng.step_conn_s)
            d.pause()
            t = threading.Timer(pause, d.resume)
            t0 = time.monotonic()
            t.start()
            k = 0
            while time.monotonic() - t0 < pause:
                if reuse and k % 8 == 7 and len(eng.requests) < 12:
                    eng.add_request(f"b{k}", [5000 + 37 * k + j for j in range(32)], 8)
                eng.step()
                k += 1
            t.join()
            during = eng.step_conn_s[first:]
            sc = eng.sched_conn._scheduler
            ws = [w._worker for w in eng.workers]
            while not eng.idle():
                eng.step()
            return {"run": name, "steps_during_pause": len(during),
                    "max_step_connector_ms": round(max(during) * 1000, 1),
                    "steps_over_100ms": sum(1 for x in during if x > 0.1),
                    "fenced_blocks": getattr(sc, "fences", None),
                    "fences_that_found_a_store": [getattr(w, "fence_waits", None) for w in ws]}
        finally:
            eng.close()
    finally:
        d.resume()
        conftest._stop_checked(d)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pause", type=float, default=2.0)
    args = ap.parse_args()
    shms: list[ShmRegion] = []

    def shm(n: int) -> ShmRegion:
        s = ShmRegion(n)
        shms.append(s)
        return s

    try:
        with connector_module() as mod:
            for reuse in (False, True):
                for asy in (False, True):
                    name = ("reuse" if reuse else "roomy") + ("-async" if asy else "")
                    print(json.dumps(one(mod, shm, name, reuse, asy, args.pause)), flush=True)
    finally:
        for s in shms:
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
