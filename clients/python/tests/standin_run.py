"""Runs the vLLM stand-in with the real connector against a real daemon.

``run`` drives a seeded workload for a number of steps (optionally a
restart, a hang, faults from the daemon's own flags), then stops arrivals
and lets every request finish; it returns what happened. Any exception in
the scheduler or a worker, a block whose KV differs from a run without
offloading, or a request that never finishes fails the run.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import standin_vllm as sv
from standin_engine import Config, Engine, Workload, quantile


def settle(eng: Engine, max_steps: int = 3000) -> None:
    """Steps until every request has finished and its blocks are back."""
    for _ in range(max_steps):
        if eng.idle():
            return
        eng.step()
    raise AssertionError(f"requests never finished: {list(eng.requests)[:5]}")


def serve(eng: Engine, *prompts: list[int], max_tokens: int = 1, prefix: str = "q", **kw) -> None:
    """Adds one request per prompt and steps until all are done."""
    for i, p in enumerate(prompts):
        eng.add_request(f"{prefix}{i}", p, max_tokens, **kw)
    settle(eng)


def toks(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


def stored_blocks(daemon) -> int:
    with daemon.client() as c:
        return c.stats().blocks_stored


@contextlib.contextmanager
def connector_module(**switches):
    """kvoffload.vllm imported over the stand-in vLLM (with its switches)."""
    h = sv.install(**switches)
    try:
        import kvoffload.vllm as mod

        yield mod
    finally:
        sv.uninstall(h)


@dataclass
class Report:
    steps: int = 0
    requests: int = 0
    counters: dict = field(default_factory=dict)
    step_ms: list[float] = field(default_factory=list)
    hang_step_ms: list[float] = field(default_factory=list)
    hang_steps_done: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        out = dict(self.counters)
        out.update(steps=self.steps, requests=self.requests, wall_s=round(self.wall_s, 1),
                   step_p50_ms=round(quantile(self.step_ms, 0.5), 3), step_p99_ms=round(quantile(self.step_ms, 0.99), 3))
        if self.hang_step_ms:
            out.update(hang_steps=len(self.hang_step_ms), hang_p50_ms=round(quantile(self.hang_step_ms, 0.5), 3),
                       hang_p99_ms=round(quantile(self.hang_step_ms, 0.99), 3))
        return out


def run(cfg: Config, daemon: Any, shm: Callable, *, seed: int, steps: int, workload: dict | None = None,
        events: dict[int, Callable[[Engine], None]] | None = None, hang: tuple[int, int] | None = None,
        drain_steps: int = 4000, switches: dict | None = None, engine_seed: str = "0",
        deadline_s: float | None = None, weight_updates: tuple[int, ...] = (),
        engine_restarts: dict[int, int] | None = None) -> Report:
    """``events`` maps a step number to a callable run before that step;
    ``hang=(step, seconds)`` stops the daemon (SIGSTOP) before that step and
    lets it continue (SIGCONT) that many seconds later, whatever the engine
    does meanwhile: a step may wait for a store the stopped daemon accepted
    (a preempted request's blocks), and only the daemon's return ends that.
    ``weight_updates``: steps before which the engine's weights change
    (``Engine.update_weights``: every cache reset, every token's KV
    different from then on). ``engine_restarts`` maps a step to a change of
    ``num_blocks``: before that step the engine finishes its requests and
    shuts down, and a new one starts with that many more (or fewer) blocks
    over the same daemon, with the checkpoint's weights (what a restarted
    vLLM loads: a weight update before it is gone)."""
    rep = Report()
    t_start = time.monotonic()
    resumed = threading.Event()
    timer: threading.Timer | None = None
    with connector_module(**(switches or {})) as mod:
        eng = Engine(cfg, mod, daemon.socket, shm, seed=engine_seed)
        counters: dict = {}
        try:
            wl = Workload(seed, eng.block_size, **(workload or {}))
            i = 0
            while True:
                if deadline_s is not None:
                    if time.monotonic() - t_start >= deadline_s:
                        break
                elif i >= steps:
                    break
                if events and i in events:
                    events[i](eng)
                if i in weight_updates:
                    eng.update_weights()
                if engine_restarts and i in engine_restarts:
                    _settle(eng, wl, drain_steps)
                    for k, v in eng.counters.items():
                        counters[k] = counters.get(k, 0) + v
                    eng.close()
                    cfg = copy.copy(cfg)
                    cfg.num_blocks += engine_restarts[i]
                    eng = Engine(cfg, mod, daemon.socket, shm, seed=engine_seed)
                    counters["engine_restarts"] = counters.get("engine_restarts", 0) + 1
                if hang and i == hang[0]:
                    daemon.pause()
                    timer = threading.Timer(hang[1], lambda: (daemon.resume(), resumed.set()))
                    timer.start()
                hanging = hang is not None and i >= hang[0] and not resumed.is_set()
                wl.tick(eng)
                eng.step()
                (rep.hang_step_ms if hanging else rep.step_ms).append(eng.step_conn_s[-1] * 1000)
                i += 1
            if timer is not None:
                timer.cancel()
                daemon.resume()
            n = _settle(eng, wl, drain_steps)
            rep.steps = i + n
            rep.hang_steps_done = len(rep.hang_step_ms)
            rep.requests = wl.n
            for k, v in eng.counters.items():
                counters[k] = counters.get(k, 0) + v
            rep.counters = counters
        finally:
            if timer is not None:
                timer.cancel()
                daemon.resume()
            eng.close()
    rep.wall_s = time.monotonic() - t_start
    return rep


def _settle(eng: Engine, wl: Workload, drain_steps: int) -> int:
    """Stops arrivals until every request finished; returns the steps it took."""
    n = 0
    while not eng.idle():
        wl.tick(eng, stop_arrivals=True)
        eng.step()
        n += 1
        if n > drain_steps:
            raise AssertionError(f"requests never finished after {drain_steps} steps: {eng.describe()}")
        if not eng.running and not eng.in_flight:
            time.sleep(0.001)  # only loads or stores in flight: let the daemon work
    eng.drain()
    return n
