"""How long a new request waits for the connector's lookup before vLLM admits it.

    KVOFFLOADD_BIN=bin/kvoffloadd python3 clients/python/tests/measure_admission.py [--steps 400] [--seed 1]

Serves requests one at a time on the stand-in (plain configuration, default
connector settings, vLLM's own prefix cache off so that repeats are the
daemon's hits) against a real daemon: a fresh prompt (a miss), then the same
prompt's first blocks with another tail (a hit), ``--requests`` times. Each
request arrives on an idle engine, so what it waits is the connector's
alone. Prints, for hits and misses apart, the steps between arrival and
admission (0: admitted by the first step that saw it) and the milliseconds
from arrival to admission.
``KVOFFLOAD_PKG=/path/to/clients/python`` measures another version.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import conftest  # noqa: E402  (puts the package on sys.path, finds the daemon)
from standin_engine import Config, Engine, quantile  # noqa: E402
from standin_run import connector_module  # noqa: E402

from kvoffload import ShmRegion  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    d = conftest.Daemon(log_level="warn")
    shms: list[ShmRegion] = []

    def shm(n: int) -> ShmRegion:
        s = ShmRegion(n)
        shms.append(s)
        return s

    try:
        with connector_module() as mod:
            eng = Engine(Config(model=f"admission-{args.seed}", prefix_caching=False), mod, d.socket, shm)
            rng = random.Random(args.seed)
            try:
                for i in range(args.requests):
                    prompt = [rng.randrange(10, 5000) for _ in range(32)]
                    for j, p in enumerate((prompt, prompt[:24] + [rng.randrange(10, 5000) for _ in range(6)])):
                        eng.add_request(f"m{i}-{j}", p, 2)
                        while not eng.idle():
                            eng.step()
                waits = list(eng.admit_waits)
            finally:
                eng.close()
    finally:
        for s in shms:
            s.close()
        d.stop()
        d.cleanup()
    out = {}
    for name, hit in (("hit", True), ("miss", False)):
        w = [x for x in waits if x[0] == hit]
        steps = [x[1] for x in w]
        ms = [x[2] for x in w]
        out[name] = {"requests": len(w), "steps_mean": round(sum(steps) / max(1, len(steps)), 2),
                     "admitted_in_first_step": sum(1 for s in steps if s == 0),
                     "ms_p50": round(quantile(ms, 0.5), 2), "ms_p90": round(quantile(ms, 0.9), 2)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
