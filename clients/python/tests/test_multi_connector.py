"""The connector inside vLLM's MultiConnector, beside a NixlConnector-like sibling.

P/D deployments (llm-d, Dynamo) combine a transfer connector with an offload
tier: ``"kv_connector": "MultiConnector"`` with ``connectors = [NixlConnector,
KVOffloadConnector]`` or the other way round. standin_multi.py plays
MultiConnector's rules (the first child's handshake only, handed to every
child; stats rebuilt by class name through the factory) and NIXL's (its
scheduler raises on a payload not its own). Both orders must hit, store and
hold exact KV (the stand-in engine checks every block each step), and leave
NIXL its own handshake.
"""

from __future__ import annotations

import functools
import pytest
import standin_multi as sm
from standin_engine import Config, Engine, Group, vllm_config
import standin_run
from standin_run import connector_module, settle, toks, stored_blocks

# These tests let each request generate 2 tokens.
serve = functools.partial(standin_run.serve, max_tokens=2)

ORDERS = [("nixl", "ours"), ("ours", "nixl")]


@pytest.mark.parametrize("order", ORDERS, ids=["nixl-first", "ours-first"])
def test_beside_nixl_in_either_order_hits_stores_and_leaves_nixl_its_handshake(daemon, shm, order):
    cfg = Config(model=f"multi-{'-'.join(order)}", tp=2, multi=order, prefix_caching=False,
                 extra={"lookup_deadline_ms": 2000})
    sm.NixlConnector.schedulers.clear()
    with connector_module() as mod:
        before = stored_blocks(daemon)
        eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            assert isinstance(eng.sched_conn, sm.MultiConnector)
            a = toks(30, 100 * len(order[0]))
            serve(eng, a, prefix="a")
            eng.drain()
            assert stored_blocks(daemon) > before, "nothing was stored"
            serve(eng, a[:24] + [1, 2, 3], prefix="b")
            assert eng.counters["hit_tokens"] == 24
            # NIXL got its own workers' handshakes, one per TP rank.
            nixl = sm.NixlConnector.schedulers[-1]
            assert nixl.handshakes is not None and sorted(nixl.handshakes) == [0, 1]
            assert all(isinstance(m, sm.NixlHandshakePayload) for m in nixl.handshakes.values())
            # The API server rebuilt both children's stats by class name.
            eng.stats_logging.log()
            logged = eng.stats_logging.logged
            assert logged and all(set(x) <= {"KVOffloadConnector", "NixlConnector"} for x in logged), logged
            assert any("KVOffloadConnector" in x for x in logged), logged
        finally:
            eng.close()
        # A second engine over the same daemon: hits from its first request.
        eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            serve(eng, a[:24] + [4, 5, 6], prefix="c")
            assert eng.counters["hit_tokens"] == 24
        finally:
            eng.close()


def test_alone_the_connector_sends_no_handshake_and_still_hits(daemon, shm):
    """vLLM names the engine (engine_id, instance_id): the workers'
    fingerprints come from the daemon, never through vLLM's handshake."""
    cfg = Config(model="multi-alone", tp=2, prefix_caching=False, extra={"lookup_deadline_ms": 2000})
    with connector_module() as mod:
        eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            assert all(w.get_handshake_metadata() is None for w in eng.workers)
            a = toks(30, 700)
            serve(eng, a, prefix="a")
            serve(eng, a[:24] + [1, 2, 3], prefix="b")
            assert eng.counters["hit_tokens"] == 24
        finally:
            eng.close()


def test_the_connector_is_registered_by_name_when_its_module_is_imported():
    with connector_module() as mod:
        f = sm.factory()
        assert f.get_connector_class_by_name("KVOffloadConnector") is mod.KVOffloadConnector
        mod._register_with_factory()  # a second import (another process path) is no error
        assert f.get_connector_class_by_name("KVOffloadConnector") is mod.KVOffloadConnector
        # MultiConnector's stats round trip by name, as in the API server.
        stats = mod.KVOffloadConnector.build_kv_connector_stats({"lookups_total": 3})
        ser = sm.serialize_stats(sm.MultiKVConnectorStats(data={"KVOffloadConnector": stats}))
        assert sm.MultiConnector.build_kv_connector_stats(ser).reduce()["KVOffloadConnector"]["lookups_total"] == 3
        # Newer vLLM passes the serialized child whole: {"data": {...}}.
        assert mod.KVOffloadConnector.build_kv_connector_stats({"data": {"lookups_total": 3}}).data == {
            "lookups_total": 3}


@pytest.mark.parametrize("renamed", [False, True], ids=["HND", "LBHNC"])
@pytest.mark.parametrize("order", ORDERS, ids=["nixl-first", "ours-first"])
def test_the_required_layout_agrees_with_nixl_before_and_after_the_rename(renamed, order):
    """MultiConnector compares its children's layout strings verbatim; after
    vLLM's #51718 NixlConnector says "LBHNC" for HND."""
    cfg = Config(model="multi-layout", multi=order)
    sm.NixlConnector.layout = "LBHNC" if renamed else "HND"
    try:
        with connector_module(kv_layouts=renamed) as mod:
            sm.register_builtins()
            v = vllm_config(cfg, "/nonexistent")
            assert sm.MultiConnector.get_required_kvcache_layout(v) == ("LBHNC" if renamed else "HND")
            # One layout, two spellings: the same namespace either way.
            s = mod.settings_from_vllm(vllm_config(Config(model="multi-layout"), "/x"), None, env={},
                                       kv_layout=mod.KVOffloadConnector.get_required_kvcache_layout(v))
            assert s.identity["kv_layout"] == "HND"
    finally:
        sm.NixlConnector.layout = "HND"


def test_mla_models_require_no_layout():
    cfg = Config(model="multi-mla", groups=[Group("mla", 4, 2)], multi=("nixl", "ours"))
    with connector_module(kv_layouts=True) as mod:
        sm.register_builtins()
        v = vllm_config(cfg, "/nonexistent")
        assert mod.KVOffloadConnector.get_required_kvcache_layout(v) is None
        assert sm.MultiConnector.get_required_kvcache_layout(v) is None


def test_a_vllm_that_names_no_engine_still_uses_the_handshake(daemon, shm, monkeypatch):
    """Without engine_id and instance_id there is no registration key: the
    workers' fingerprints come through vLLM's handshake, as before."""
    import standin_engine

    real = standin_engine.vllm_config

    def unnamed(cfg, socket):
        v = real(cfg, socket)
        del v.instance_id
        v.kv_transfer_config.engine_id = None
        return v

    monkeypatch.setattr(standin_engine, "vllm_config", unnamed)
    cfg = Config(model="multi-unnamed", tp=2, prefix_caching=False, extra={"lookup_deadline_ms": 2000})
    with connector_module() as mod:
        eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            assert all(isinstance(w.get_handshake_metadata(), mod.KVOffloadHandshake) for w in eng.workers)
            a = toks(30, 800)
            serve(eng, a, prefix="a")
            serve(eng, a[:24] + [1, 2, 3], prefix="b")
            assert eng.counters["hit_tokens"] == 24
        finally:
            eng.close()
