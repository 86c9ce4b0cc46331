"""The vLLM stand-in with the connector against real daemons, for as long as asked.

    make soak-connector SOAK_MINUTES=10
    python3 clients/python/tests/soak_connector.py --minutes 10 --seed 1

Cycles through every configuration of test_vllm_connector.CONFIGS and
test_mamba.SHAPES (Mamba state in align mode) and three
daemons whose disks fail 1%, 5% and 10% of reads (``read-eio`` at that rate,
plus ``bitflip`` at half of it: the checksum catches those), each run with a
daemon restart mid-run (blocks come back from disk after it) and the daemon
stopped (SIGSTOP) for a second later on, an engine restart with one block more
or fewer (the checkpoint's weights: the new engine finds the old one's
blocks) and two weight updates (every cache reset, every token's KV
different afterwards). Any block whose KV differs from a
run without offloading, any exception in the stand-in's scheduler or workers
and any request that never finishes stops the soak with the seed that
failed. Prints one JSON line per run and a summary with the connector's
added latency per step (p50/p99) with a live and with a stopped daemon.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import conftest  # noqa: E402  (puts the package on sys.path, finds the daemon)
import test_mamba as M  # noqa: E402
import test_vllm_connector as T  # noqa: E402
from standin_engine import quantile  # noqa: E402
from standin_run import run  # noqa: E402

from kvoffload import ShmRegion  # noqa: E402

RATES = (0.01, 0.05, 0.10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=400, help="steps of one run before it drains")
    ap.add_argument("--hang-s", type=float, default=1.0, help="how long each run's daemon is stopped")
    ap.add_argument("--configs", help="comma-separated names from test_vllm_connector.CONFIGS and test_mamba.SHAPES "
                    "(default: all)")
    ap.add_argument("--json", help="write the summary here too")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    daemons = {}
    for r in RATES:
        spec = f"read-eio={r},bitflip={r / 2},seed={args.seed}"
        daemons[r] = conftest.Daemon(["--disk-dir", "{dir}/disk", "--disk-bytes", "64MiB", "--write-through", "--fault-spec", spec],
                                     log_level="warn")
    shms: list[ShmRegion] = []

    def shm(n: int) -> ShmRegion:
        s = ShmRegion(n)
        shms.append(s)
        return s

    totals = {"runs": 0, "steps": 0, "requests": 0, "finished": 0, "errored": 0, "aborted": 0, "preempted": 0,
              "hit_tokens": 0, "loads_finished": 0, "load_failures": 0, "positions_checked": 0, "restarts": 0,
              "hangs": 0, "wrong_kv": 0, "exceptions": 0, "weight_updates": 0, "engine_restarts": 0}
    live, hung = [], []
    end = time.monotonic() + args.minutes * 60
    seed = args.seed
    failed = None
    try:
        while time.monotonic() < end and failed is None:
            for name, cfg0, sw in [c for c in T.CONFIGS + M.SHAPES if not args.configs or c[0] in args.configs.split(",")]:
                if time.monotonic() >= end:
                    break
                rate = RATES[seed % len(RATES)]
                d = daemons[rate]
                cfg = copy.deepcopy(cfg0)
                cfg.model = f"soak-{name}-{seed}"
                try:
                    rep = run(cfg, d, shm, seed=seed, steps=args.steps, switches=sw,
                              events={args.steps * 2 // 5: lambda eng, d=d: d.restart()},
                              hang=(args.steps * 3 // 4, args.hang_s),
                              weight_updates=(args.steps // 2, args.steps * 17 // 20),
                              engine_restarts={args.steps // 5: 1 if seed % 2 else -1})
                except Exception as e:
                    kind = "wrong_kv" if type(e).__name__ == "WrongKV" else "exceptions"
                    totals[kind] += 1
                    failed = {"config": name, "seed": seed, "fault_rate": rate, "error": repr(e)[:2000],
                              "traceback": traceback.format_exc()[-4000:]}
                    break
                finally:
                    for s in shms:
                        s.close()
                    shms.clear()
                s = rep.summary()
                print(json.dumps({"config": name, "seed": seed, "fault_rate": rate, **s}), flush=True)
                totals["runs"] += 1
                totals["restarts"] += 1
                totals["hangs"] += 1
                for k in ("steps", "requests", "finished", "errored", "aborted", "preempted", "hit_tokens",
                          "loads_finished", "load_failures", "positions_checked", "weight_updates",
                          "engine_restarts"):
                    totals[k] += s.get(k, 0)
                live.extend(rep.step_ms)
                hung.extend(rep.hang_step_ms)
                seed += 1
    finally:
        rcs = {r: d.stop() for r, d in daemons.items()}
        for d in daemons.values():
            d.cleanup()
    summary = {
        **totals,
        "minutes": args.minutes,
        "step_live_p50_ms": round(quantile(live, 0.5), 3), "step_live_p99_ms": round(quantile(live, 0.99), 3),
        "step_live_n": len(live),
        "step_hung_p50_ms": round(quantile(hung, 0.5), 3), "step_hung_p99_ms": round(quantile(hung, 0.99), 3),
        "step_hung_n": len(hung),
        "daemon_exit_codes": rcs,
        "failed": failed,
    }
    print(json.dumps({"summary": summary}, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if failed or totals["errored"] or any(rcs.values()) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
