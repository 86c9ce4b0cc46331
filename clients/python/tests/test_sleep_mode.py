"""vLLM's sleep mode: KV cache memory freed and re-mapped while the engine runs.

What vLLM tells a connector (read at 7cfb97e and in #44890's
``release_kv_cache_memory``): ``sleep(level >= 1)`` and
``release_kv_cache_memory()`` pause the scheduler, call the scheduler's
``reset_cache`` (``_reset_caches``) and then discard the ``kv_cache``
allocations (``Executor.sleep``/``discard``); ``wake_up`` maps new memory at
the same addresses (``post_kv_cache_wake_up`` is the model runner's). The
workers' connector is told nothing and ``register_kv_caches`` is not called
again: memory registered with the daemon would be freed under it. So an
engine in sleep mode gets no offloading, with one error line naming why, and
the daemon never maps its KV memory.
"""

from __future__ import annotations

import functools
import logging

from standin_engine import Config, Engine
import standin_run
from standin_run import connector_module, settle, toks

# These tests let each request generate 2 tokens.
serve = functools.partial(standin_run.serve, max_tokens=2)


def sleep_and_wake(eng: Engine) -> None:
    """vLLM's EngineCore.sleep(1) then wake_up(): the scheduler's caches reset
    (reset_cache reaches the connector), the KV memory discarded and mapped
    anew (here: every byte of it overwritten, as memory reused by another
    allocation would be)."""
    assert eng.idle()
    eng.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    for mem in eng.memory:
        mem.shm.buf[:] = b"\xa5" * len(mem.shm.buf)


def test_an_engine_in_sleep_mode_never_registers_its_kv_memory(daemon, shm, caplog):
    cfg = Config(model="sleep-mode", tp=2, sleep_mode=True, prefix_caching=False)
    with daemon.client() as c:
        before = c.stats()
    with connector_module() as mod:
        with caplog.at_level(logging.ERROR, logger="kvoffload"):
            eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            assert any("sleep mode" in m and "--enable-sleep-mode" in m for m in caplog.messages), caplog.messages
            a = toks(30, 600)
            serve(eng, a, prefix="a")
            sleep_and_wake(eng)
            serve(eng, a[:24] + [1, 2, 3], prefix="b")
            eng.drain()
            assert eng.counters["hit_tokens"] == 0
            with daemon.client() as c:
                after = c.stats()
                # No worker of this engine holds a registration: the daemon
                # maps none of its memory, so no copy can touch it.
                keys = [eng.sched_conn.settings.registration_key(r) for r in eng.sched_conn.settings.ranks()]
                assert c.find_registrations(keys) == [[], []]
            assert after.blocks_stored == before.blocks_stored and after.blocks_loaded == before.blocks_loaded
        finally:
            eng.close()
