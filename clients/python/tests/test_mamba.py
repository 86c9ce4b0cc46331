"""Mamba / linear-attention state groups in vLLM's align mode (kvoffload.mamba), against the real daemon.

The stand-in engine (standin_engine.py) models vLLM's MambaManager in
mamba_cache_mode "align" at 7cfb97e: prefill chunks clipped to block
boundaries, only the last block of a chunk a real block, the state of the
hit's end the only block an external hit allocates, earlier state blocks
freed and reused while the request runs. Its Mamba layers fold every token
into a state read from the block the previous step left it in, and the
sampled token comes from that state: a wrong or stale state anywhere is a
wrong output, and every state block a request holds is checked after every
step.
"""

from __future__ import annotations

import logging
import zlib

import pytest
import standin_vllm as sv
from helpers import FakeTensor
from standin_engine import Config, Engine, Group, RankMemory, kv_cache_config, vllm_config
from standin_run import connector_module, run

from kvoffload import mamba
from kvoffload.settings import settings_from_vllm


def hybrid(**kw) -> Config:
    """Full attention beside Mamba state, both with 4-token blocks."""
    kw.setdefault("groups", [Group("full", 4, 2), Group("mamba", 4, 2)])
    kw.setdefault("num_blocks", 96)
    return Config(**kw)


def serve(eng: Engine, rid: str, prompt: list[int], max_tokens: int = 1, **kw) -> None:
    eng.add_request(rid, prompt, max_tokens, **kw)
    n = 0
    while not eng.idle():
        eng.step()
        n += 1
        assert n < 4000, eng.describe()
    eng.drain()


def test_repeated_prefixes_hit_and_every_state_is_right(daemon, shm):
    """A prompt served once is a hit for the next engine (an empty GPU
    cache): the whole prompt but its last block boundary comes from the
    daemon, attention blocks and the one state block at the hit's end,
    and the output is the output of a run without offloading."""
    cfg = hybrid(model="mamba-repeat", extra={"lookup_deadline_ms": 2000})
    prompt = list(range(100, 127))  # 27 tokens: states committed at 4, ..., 24
    with connector_module() as mod:
        eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            serve(eng, "a", prompt, 6)
        finally:
            eng.close()
        eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            serve(eng, "b", prompt, 6)
            assert eng.counters["hit_tokens"] == 24, eng.counters
            # A longer prompt over the same prefix, its own tail.
            serve(eng, "c", prompt + list(range(900, 910)), 3)
            assert eng.counters["errored"] == 0 and eng.counters.get("wrong_outputs", 0) == 0
            assert eng.counters["positions_checked"] > 0
        finally:
            eng.close()
