"""How many steps a new request waits for its lookup while vLLM's local hit
moves under it (issue 30.6).

    KVOFFLOADD_BIN=bin/kvoffloadd python3 clients/python/tests/measure_starvation.py SEED '{"lookup_wait_ms": 0}'

The stand-in with a full-attention and a sliding-window group, async
scheduling, blocks handed out again at once, chunked prefills of 8 tokens
and two shared prefixes (so a waiting request's local hit changes as others
prefill), 500 steps of arrivals, against a real daemon. The second argument
is kv_connector_extra_config. Prints the most ``None`` answers one request
got (``max_none``: steps it waited for the connector), the steps from
arrival to admission (which include waiting for blocks and budget), hit
tokens and failed loads. ``KVOFFLOAD_PKG=/path/to/clients/python`` measures
another version.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conftest  # noqa: E402
from standin_engine import Config, Engine, Group, Workload, quantile  # noqa: E402
from standin_run import connector_module  # noqa: E402

from kvoffload import ShmRegion  # noqa: E402


def main() -> int:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    d = conftest.Daemon(log_level="warn")
    shms: list[ShmRegion] = []

    def shm(n: int) -> ShmRegion:
        s = ShmRegion(n)
        shms.append(s)
        return s

    try:
        with connector_module() as mod:
            cfg = Config(groups=[Group("full", 4, 2), Group("swa", 4, 1, window=8)], async_scheduling=True,
                         reuse_freed_first=True, long_prefill=8, max_batched_tokens=32, num_blocks=160,
                         model=f"starve-{seed}", extra=extra)
            eng = Engine(cfg, mod, d.socket, shm)
            try:
                wl = Workload(seed, eng.block_size, prefixes=2, arrival=0.5, max_prompt_units=8)
                for _ in range(500):
                    wl.tick(eng)
                    eng.step()
                n = 0
                while not eng.idle() and n < 3000:
                    wl.tick(eng, stop_arrivals=True)
                    eng.step()
                    n += 1
                steps = [s for _, s, _ in eng.admit_waits]
                ms = [m for _, _, m in eng.admit_waits]
                print(json.dumps({
                    "seed": seed, "requests": len(steps), "idle": eng.idle(), "max_steps": max(steps),
                    "max_none": max(eng.none_answers.values(), default=0), "p99_steps": quantile(steps, 0.99),
                    "max_ms": round(max(ms)), "hit_tokens": eng.counters["hit_tokens"],
                    "deferred": eng.counters["deferred_lookups"], "load_failures": eng.counters["load_failures"]}))
            finally:
                eng.close()
    finally:
        for s in shms:
            s.close()
        d.stop()
        d.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
