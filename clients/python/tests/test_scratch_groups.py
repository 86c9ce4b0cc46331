"""KV cache groups vLLM never prefix-caches (``prefix_cacheable=False``).

Newer vLLM marks per-request state as groups no prefix cache may hold
(DeepSeek-V4.1's bounded replay window and compressor ring): their KV depends
on the request, not only on its tokens, and after an external hit vLLM
rebuilds the groups the connector says it did not load
(``get_loaded_kv_cache_group_ids``, by default
``kv_cache_config.prefix_cacheable_group_ids``). The stand-in's scratch group
holds KV that differs per request; the engine checks every block each step.
"""

from __future__ import annotations

import functools
import logging

import pytest
from standin_engine import Config, Engine, Group
import standin_run
from standin_run import connector_module, settle, toks, stored_blocks

# These tests let each request generate 2 tokens.
serve = functools.partial(standin_run.serve, max_tokens=2)


def scratch_model(model: str, **kw) -> Config:
    return Config(groups=[Group("full", 4, 2), Group("full", 4, 1, scratch=True)], model=model,
                  prefix_caching=False, record_stores=True, extra={"lookup_deadline_ms": 2000}, **kw)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_scratch_group_is_never_stored_looked_up_or_loaded_and_hits_stay_exact(daemon, shm, tp):
    cfg = scratch_model(f"scratch-tp{tp}", tp=tp)
    with connector_module() as mod:
        eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            a = toks(30, 300)
            serve(eng, a, prefix="a")
            serve(eng, a[:24] + [1, 2, 3], prefix="b")
            # The hit is offered from the cacheable group; the engine rebuilt
            # the scratch group's KV of the loaded tokens for request b, and
            # every block of both groups held exactly its KV at every step.
            assert eng.counters["hit_tokens"] == 24
            assert eng.sched_conn.get_loaded_kv_cache_group_ids(None) == (0,)
            assert eng.planned_keys and {g for g, _ in eng.planned_keys} == {0}, "a scratch block was planned"
            got = eng.check_stored()
            assert got["checked"] > 0 and got["wrong"] == 0 and got["missing"] == 0, got
        finally:
            eng.close()


def test_a_vllm_that_cannot_rebuild_scratch_groups_gets_no_offloading(daemon, shm, caplog):
    """Scratch groups on a vLLM without get_loaded_kv_cache_group_ids: it
    would take a hit as restoring them; offloading is off, with why."""
    cfg = scratch_model("scratch-old-vllm")
    with connector_module(loaded_groups=False) as mod:
        before = stored_blocks(daemon)
        with caplog.at_level(logging.ERROR, logger="kvoffload"):
            eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            assert any("never prefix-cached" in m and "get_loaded_kv_cache_group_ids" in m for m in caplog.messages), \
                caplog.messages
            a = toks(30, 400)
            serve(eng, a, prefix="a")
            serve(eng, a[:24] + [1, 2, 3], prefix="b")
            eng.drain()
            assert eng.counters["hit_tokens"] == 0 and stored_blocks(daemon) == before
        finally:
            eng.close()


def test_a_model_of_only_scratch_groups_is_refused(daemon, shm, caplog):
    cfg = Config(groups=[Group("full", 4, 1, scratch=True)], model="scratch-only", prefix_caching=False)
    with connector_module() as mod:
        with caplog.at_level(logging.ERROR, logger="kvoffload"):
            eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            assert any("no KV cache group of this model is prefix-cacheable" in m for m in caplog.messages), \
                caplog.messages
            serve(eng, toks(20, 500), prefix="a")
            assert eng.counters["hit_tokens"] == 0
        finally:
            eng.close()
