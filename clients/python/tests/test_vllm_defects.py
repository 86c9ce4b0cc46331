"""The connector against the ways it could load wrong KV, crash, or stall.

Each test drives ``kvoffload.vllm.KVOffloadConnector`` only through vLLM's
interface (the stand-in vLLM of standin_vllm.py and standin_engine.py) and
the real daemon, so it can be pointed at another version of the package:
``KVOFFLOAD_PKG=/path/to/old/clients/python pytest test_vllm_defects.py``
(docs/vllm.md: every test here fails on the connector of 1cdeed3).
"""

from __future__ import annotations

import logging
import threading

import pytest
import standin_vllm as sv
from fake_daemon import FakeDaemon
from helpers import FakeTensor, wait_for
from standin_engine import (
    Config,
    Engine,
    EngineCrash,
    Group,
    NewRequestData,
    Request,
    SchedulerOutput,
    Hasher,
    RankMemory,
    kv_cache_config,
    vllm_config,
)
from standin_run import connector_module, run, settle, serve, toks


@pytest.fixture
def engine(daemon, shm):
    """Builds stand-in engines over the connector; closes them after the test."""
    made = []
    ctx = []

    def make(cfg: Config, socket: str | None = None, **switches) -> Engine:
        # Hits must come from the daemon: vLLM's own prefix cache is off.
        cfg.prefix_caching = False
        # These tests count exact hits: a lookup the stand-in's busy loop
        # kept from its thread past the default 200 ms would be a miss
        # (see test_random_workload). None of them is about the deadline.
        cfg.extra = {"lookup_deadline_ms": 2000, **cfg.extra}
        if not ctx:
            c = connector_module(**switches)
            ctx.append((c, c.__enter__()))
        eng = Engine(cfg, ctx[0][1], socket or daemon.socket, shm)
        made.append(eng)
        return eng

    yield make
    for e in made:
        e.close()
    for c, _ in ctx:
        c.__exit__(None, None, None)


# -- 1. hash granularity --------------------------------------------------------------


@pytest.mark.parametrize("groups,pmu", [
    ([Group("full", 8, 2), Group("full", 8, 1)], 4),  # prefix_match_unit finer than the blocks
    ([Group("full", 8, 1), Group("full", 12, 1)], None),  # hash = gcd(8, 12) = 4, unit 24
])
def test_keys_use_the_hash_size_vllm_resolves(engine, groups, pmu):
    cfg = Config(groups=groups, prefix_match_unit=pmu, num_blocks=96, max_batched_tokens=128, model=f"m1-{pmu}")
    eng = engine(cfg)
    assert eng.hash_block_size == 4
    u = eng.block_size
    a = toks(2 * u + 4, 100)
    serve(eng, a, prefix="a")
    # Shares only the first 4 tokens (one hash) with a: no key may match.
    b = a[:4] + toks(2 * u, 7000)
    # Shares a whole unit: that one may load.
    c = a[:u] + toks(u + 4, 8000)
    serve(eng, b, c, prefix="b")
    assert eng.counters["hit_tokens"] == u


def test_decode_context_parallel_scales_the_block(engine):
    # DCP=2 over TP=2: vLLM hashes and schedules blocks of 2 x 4 tokens.
    cfg = Config(groups=[Group("full", 4, 2)], tp=2, dcp=2, num_blocks=64, model="m1-dcp")
    eng = engine(cfg)
    assert eng.hash_block_size == 8 == eng.block_size
    a = toks(40, 300)
    serve(eng, a, prefix="a")
    serve(eng, a[:32] + toks(5, 9000), prefix="b")
    assert eng.counters["hit_tokens"] == 32  # whole 8-token blocks, on both ranks


# -- 2. kernel blocks smaller than vLLM's blocks --------------------------------------


@pytest.mark.parametrize("kind,layout", [("full", "HND"), ("full", "NHD"), ("mla", "HND")])
def test_kernel_block_splits_are_mapped(engine, kind, layout):
    cfg = Config(groups=[Group(kind, 8, 2)], kernel_block_size=2, layout=layout, num_blocks=48,
                 model=f"m2-{kind}-{layout}")
    eng = engine(cfg)
    a = toks(30, 500)
    serve(eng, a, prefix="a")
    serve(eng, a[:24] + [1, 2, 3], prefix="b")
    assert eng.counters["hit_tokens"] == 24


def test_a_layout_it_cannot_map_turns_offloading_off_without_killing_the_worker(daemon, shm, caplog):
    cfg = Config(model="m2-bad")
    with connector_module() as mod:
        vcfg, kcc = vllm_config(cfg, daemon.socket), kv_cache_config(cfg)
        w = mod.KVOffloadConnector(vcfg, sv.KVConnectorRole.WORKER, kcc)
        s = mod.KVOffloadConnector(vcfg, sv.KVConnectorRole.SCHEDULER, kcc)
        # No dimension of num_blocks (or a multiple) blocks: nothing to map.
        r = shm(4096)
        bad = {f"g0.l{i}": FakeTensor(r.address, (2, 7, 4, 2, 4), element_size=2) for i in range(2)}
        with caplog.at_level(logging.ERROR, logger="kvoffload"):
            w.register_kv_caches(bad)
        errors = [m for m in caplog.messages if "offloading disabled" in m]
        assert len(errors) == 1, caplog.messages
        hs = w.get_handshake_metadata()
        s.set_xfer_handshake_metadata({0: hs})
        h = Hasher(4, 32, "0")
        req = Request("x", toks(20, 1), 1, h, b"s" * 8)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        w.shutdown()
        s.shutdown()


# -- 3. what changes a block's bytes is in its identity --------------------------------


def test_an_engine_with_another_byte_order_never_loads_these_blocks(engine):
    a = toks(30, 600)
    e1 = engine(Config(layout="NHD", model="m3"))
    serve(e1, a, prefix="a")
    e1.close()
    # The same model restarted with a backend that orders a block HND.
    e2 = engine(Config(layout="HND", model="m3"))
    serve(e2, a[:24] + [5, 6, 7], prefix="b")
    assert e2.counters["hit_tokens"] == 0


def test_every_field_that_changes_the_bytes_changes_the_fingerprint():
    from kvoffload.settings import settings_from_vllm

    cfg = Config()
    kcc = kv_cache_config(cfg)

    def fp(mutate=None, env=None, geometry=(("g", 1),), rank=None):
        v = vllm_config(cfg, "/x.sock")
        if mutate:
            mutate(v)
        s = settings_from_vllm(v, kcc, env=env or {"PYTHONHASHSEED": "0"})
        return s.fingerprint(rank or {"tp": 0, "pp": 0, "pcp": 0, "dcp": 0}, geometry)

    base = fp()
    assert base == fp()
    variants = {
        "model": lambda v: setattr(v.model_config, "model", "other"),
        "revision": lambda v: setattr(v.model_config, "revision", "v2"),
        "dtype": lambda v: setattr(v.model_config, "dtype", "float16"),
        "quantization": lambda v: setattr(v.model_config, "quantization", "fp8"),
        "hf_overrides": lambda v: setattr(v.model_config, "hf_overrides", {"rope_theta": 1e6}),
        "rope_scaling": lambda v: setattr(v.model_config, "rope_scaling", {"type": "yarn"}),
        "kv_cache_dtype": lambda v: setattr(v.cache_config, "cache_dtype", "fp8_e4m3"),
        "kv_scales": lambda v: setattr(v.cache_config, "calculate_kv_scales", True),
        "hash_algo": lambda v: setattr(v.cache_config, "prefix_caching_hash_algo", "xxhash"),
        "tp": lambda v: setattr(v.parallel_config, "tensor_parallel_size", 2),
        "pcp": lambda v: setattr(v.parallel_config, "prefill_context_parallel_size", 2),
        "dcp": lambda v: setattr(v.parallel_config, "decode_context_parallel_size", 2),
        "attention_backend": lambda v: setattr(v, "attention_config", sv.ns(backend="FLASHINFER")),
    }
    for name, m in variants.items():
        assert fp(m) != base, name
    assert fp(env={"PYTHONHASHSEED": "1"}) != base
    assert fp(env={"PYTHONHASHSEED": "0", "VLLM_ATTENTION_BACKEND": "FLASHINFER"}) != base
    assert fp(geometry=(("g", 2),)) != base
    for k in ("tp", "pp", "pcp", "dcp"):
        assert fp(rank={"tp": 0, "pp": 0, "pcp": 0, "dcp": 0, k: 1}) != base, k


# -- 4. every rank is its own namespace, and an unknown rank is an error ----------------


def test_prefill_context_parallel_ranks_do_not_share_blocks(engine):
    eng = engine(Config(pcp=2, model="m4-pcp"))
    a = toks(30, 700)
    serve(eng, a, prefix="a")
    serve(eng, a[:24] + [9, 9], prefix="b")
    assert eng.counters["hit_tokens"] == 24


def test_a_worker_that_cannot_tell_its_rank_turns_offloading_off(engine, caplog):
    sv.Ranks.broken = True
    with caplog.at_level(logging.ERROR, logger="kvoffload"):
        eng = engine(Config(tp=2, model="m4-broken"))
    assert any("offloading disabled" in m for m in caplog.messages)
    a = toks(30, 800)
    serve(eng, a, prefix="a")
    serve(eng, a[:24] + [9, 9], prefix="b")
    assert eng.counters["hit_tokens"] == 0


# -- 5. hybrid models on a vLLM that reports failures per block ---------------------------


def _invalidate_after_alloc(eng: Engine, daemon) -> None:
    """Drops every cached block between the lookup and the load, as an
    eviction would: the load then fails."""
    sc = eng.sched_conn
    real = sc.update_state_after_alloc
    c = daemon.client()

    def wrapped(request, blocks, n):
        real(request, blocks, n)
        if n:
            ids = [ns.namespace_id for ns in c.stats().namespaces]
            for i in range(0, len(ids), 64):  # the daemon takes 64 namespaces a call
                c.invalidate(ids[i:i + 64])

    sc.update_state_after_alloc = wrapped


def test_hybrid_model_on_vllm_without_request_level_failures_offers_no_hits(engine, daemon):
    cfg = Config(groups=[Group("full", 4, 2), Group("swa", 8, 1, window=16)], transfer_results=False,
                 num_blocks=96, model="m5")
    eng = engine(cfg, transfer_results=False)
    _invalidate_after_alloc(eng, daemon)
    a = toks(40, 900)
    serve(eng, a, prefix="a")
    serve(eng, a[:32] + [3, 3], prefix="b")  # vLLM would crash on a block-level failure here
    assert eng.counters["hit_tokens"] == 0


def test_hybrid_model_failures_are_per_request_where_vllm_has_them(engine, fresh_daemon):
    # Every disk read fails once the daemon restarted: blocks are then only on disk.
    d = fresh_daemon("--disk-dir", "{dir}/disk", "--disk-bytes", "64MiB", "--write-through", "--fault-spec", "read-eio=1,seed=1")
    cfg = Config(groups=[Group("full", 4, 2), Group("swa", 8, 1, window=16)], num_blocks=96, model="m5b")
    eng = engine(cfg, socket=d.socket)
    a = toks(40, 950)
    serve(eng, a, prefix="a")
    serve(eng, a[:32] + [3, 3], prefix="b")
    assert eng.counters["hit_tokens"] == 32 and eng.counters["load_failures"] == 0
    d.restart()
    d.wait_recovered()  # else the first request misses and is stored in the CPU tier again
    for i in range(20):
        serve(eng, a[:32] + [4, i], prefix=f"c{i}-")
        if eng.counters["load_failures"]:
            break
    assert eng.counters["load_failures"] >= 1  # failed requests recomputed; every block checked


# -- 6. preemption never lets vLLM reuse blocks a store may still read --------------------


def test_a_block_reused_after_a_preemption_waits_for_its_store_and_only_then(shm):
    # vLLM frees a preempted request's blocks and may give them to another
    # request in any later step. The preemption's step does not wait for the
    # request's stores; the step that writes one of their blocks again does,
    # before its forward, for exactly those stores (vLLM's offloading
    # connector's jobs_to_flush).
    fake = FakeDaemon()
    try:
        cfg = Config(model="m6", extra={"drain_timeout_s": 0.3})
        with connector_module() as mod:
            vcfg, kcc = vllm_config(cfg, fake.socket), kv_cache_config(cfg)
            sched = mod.KVOffloadConnector(vcfg, sv.KVConnectorRole.SCHEDULER, kcc)
            worker = mod.KVOffloadConnector(vcfg, sv.KVConnectorRole.WORKER, kcc)
            mem = RankMemory(shm, cfg, 0)
            worker.register_kv_caches(mem.kv_caches)
            hs = worker.get_handshake_metadata()
            if hs is not None:
                sched.set_xfer_handshake_metadata({0: hs})
            req = Request("a", toks(17, 1), 4, Hasher(4, 32, "0"), b"s" * 8)
            sched.update_state_after_alloc(req, sv.ns(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), 0)
            out = SchedulerOutput(seq=1, scheduled_new_reqs=[NewRequestData("a", req.prompt_token_ids, ([1, 2, 3, 4, 5],), 0)],
                                  num_scheduled_tokens={"a": 17})
            meta = sched.build_connector_meta(out)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            worker.wait_for_save()  # the daemon accepts the store and keeps reading
            worker.get_finished(set())
            worker.clear_connector_metadata()
            assert wait_for(lambda: fake.pending())
            req.num_computed_tokens = 17
            ws = worker._worker

            def run_step(meta):
                worker.handle_preemptions(meta)
                worker.bind_connector_metadata(meta)
                worker.start_load_kv(None)
                worker.clear_connector_metadata()

            # The preemption's step: nothing reused, nothing waited for.
            meta = sched.build_connector_meta(SchedulerOutput(seq=2, preempted_req_ids={"a"}))
            assert meta.plan.fence == []
            run_step(meta)
            assert ws.fence_waits == 0 and fake.pending()
            # A step giving blocks 9 and 3 to a new request: 3 is fenced.
            b = Request("b", toks(5, 500), 4, Hasher(4, 32, "0"), b"s" * 8)
            sched.update_state_after_alloc(b, sv.ns(get_block_ids=lambda: ([9, 3],)), 0)
            meta = sched.build_connector_meta(SchedulerOutput(
                seq=3, scheduled_new_reqs=[NewRequestData("b", b.prompt_token_ids, ([9, 3],), 0)], num_scheduled_tokens={"b": 5}))
            assert meta.plan.fence == [3]
            t = threading.Thread(target=run_step, args=(meta,))
            t.start()
            t.join(1.0)
            returned_early = not t.is_alive()
            waited = ws._waiters
            fake.finish()
            t.join(10)
            assert not t.is_alive()
            assert ws.fence_waits == 1
            # Block 4 again, once that store drained: fenced (no acknowledgement
            # reached the scheduler), and nothing to wait for.
            c = Request("c", toks(3, 700), 4, Hasher(4, 32, "0"), b"s" * 8)
            sched.update_state_after_alloc(c, sv.ns(get_block_ids=lambda: ([4],)), 0)
            meta = sched.build_connector_meta(SchedulerOutput(
                seq=4, scheduled_new_reqs=[NewRequestData("c", c.prompt_token_ids, ([4],), 0)], num_scheduled_tokens={"c": 3}))
            assert meta.plan.fence == [4]
            run_step(meta)
            assert ws.fence_waits == 1
            worker.shutdown()
            sched.shutdown()
    finally:
        fake.stop()
    assert not returned_early and waited, "the step ran on while the daemon could still read a block it writes"


# -- 7. issue 21: a weight update, restarts with another block count, repairs ------------


def _blocks_of(daemon, fingerprints) -> int:
    """Blocks the daemon holds in the namespaces of these fingerprints."""
    fps = {bytes(f) for f in fingerprints}
    c = daemon.client()
    return sum(ns.blocks for ns in c.stats().namespaces if bytes(ns.fingerprint) in fps)


def _sched(eng: Engine):
    return eng.sched_conn._scheduler


def test_a_weight_update_never_serves_kv_of_the_old_weights(engine, daemon):
    eng = engine(Config(model="m7-reset"))
    a = toks(30, 1000)
    serve(eng, a, prefix="a")
    old = list(_sched(eng)._fingerprints.values())
    assert _blocks_of(daemon, old) > 0
    # The trainer's update: every cache reset, new weights (every token's KV
    # changes). Nothing stored before may be loaded: the stand-in checks
    # every block against the new weights.
    assert eng.update_weights() is True
    assert _blocks_of(daemon, old) == 0  # the old identity's blocks hold no capacity
    serve(eng, a[:24] + [5, 5], prefix="b")
    assert eng.counters["hit_tokens"] == 0
    # What the engine stores under the new weights is served again.
    serve(eng, a[:24] + [6, 6], prefix="c")
    assert eng.counters["hit_tokens"] == 24


def test_stores_planned_or_in_flight_at_a_reset_stay_in_the_old_identity(engine):
    eng = engine(Config(model="m7-inflight", async_scheduling=True, max_batched_tokens=8))
    a = toks(40, 1100)
    req = eng.add_request("a0", a, 4)
    for _ in range(200):
        if req.num_computed_tokens >= 16:
            break
        eng.step()  # until a's prefill is under way, a step with its stores scheduled and not run
    assert req.num_computed_tokens >= 16 and eng.in_flight
    assert eng.update_weights(drain=False) in (True, False)  # vLLM's own reset fails while blocks are held
    eng.abort("a0")  # nothing of a is computed under the new weights
    settle(eng)
    serve(eng, a[:32] + [5, 5], prefix="b")
    assert eng.counters["hit_tokens"] == 0, "a store planned before the reset landed in the new identity"


def test_a_reset_the_daemon_cannot_confirm_answers_false(engine, daemon):
    eng = engine(Config(model="m7-down", extra={"timeout_s": 0.3}))
    a = toks(30, 1200)
    serve(eng, a, prefix="a")
    daemon.pause()
    try:
        ok = eng.update_weights()
    finally:
        daemon.resume()
    assert ok is False
    serve(eng, a[:24] + [5, 5], prefix="b")  # nothing old loaded all the same (the check would fail)
    assert eng.counters["hit_tokens"] == 0


def test_engines_share_blocks_only_under_one_declared_weights_version(engine):
    a = toks(30, 1300)
    e1 = engine(Config(model="m7-ver", extra={"weights_version": "step-7"}))
    serve(e1, a, prefix="a")
    e1.close()
    e2 = engine(Config(model="m7-ver", extra={"weights_version": "step-8"}))
    for m in e2.memory:
        m.weights = 1  # other weights: a hit would fail the check
    serve(e2, a[:24] + [5, 5], prefix="b")
    assert e2.counters["hit_tokens"] == 0
    e2.close()
    e3 = engine(Config(model="m7-ver", extra={"weights_version": "step-7"}))
    serve(e3, a[:24] + [6, 6], prefix="c")
    assert e3.counters["hit_tokens"] == 24


def test_request_level_failures_on_a_vllm_without_them_still_reports_failed_blocks(engine, daemon, caplog):
    cfg = Config(model="m8-rlf", transfer_results=False, extra={"request_level_failures": True})
    with caplog.at_level(logging.ERROR, logger="kvoffload"):
        eng = engine(cfg, transfer_results=False)
    a = toks(30, 1400)
    serve(eng, a, prefix="a")
    _invalidate_after_alloc(eng, daemon)
    serve(eng, a[:24] + [5, 5], prefix="b")  # the load fails: vLLM must hear of it, or it reads unloaded blocks
    assert eng.counters["load_failures"] >= 1
    assert any("request_level_failures" in m and "ignored" in m for m in caplog.messages)


def test_an_engine_restarted_with_another_block_count_hits_the_cache(engine):
    a = toks(30, 1500)
    e1 = engine(Config(model="m9-blocks", num_blocks=64))
    serve(e1, a, prefix="a")
    e1.close()
    e2 = engine(Config(model="m9-blocks", num_blocks=65))  # memory profiling found room for one more
    serve(e2, a[:24] + [5, 5], prefix="b")
    assert e2.counters["hit_tokens"] == 24
    e2.close()
    e3 = engine(Config(model="m9-blocks", num_blocks=65, kernel_block_size=2))  # another byte order
    serve(e3, a[:24] + [6, 6], prefix="c")
    assert e3.counters["hit_tokens"] == 0


def test_a_failed_load_is_stored_again_and_served_to_repeats(engine, daemon):
    eng = engine(Config(model="m10-repair"))
    a = toks(30, 1600)
    serve(eng, a, prefix="a")
    sc = eng.sched_conn
    real = sc.update_state_after_alloc
    _invalidate_after_alloc(eng, daemon)  # b's load fails: every block MISSING, vLLM recomputes them
    serve(eng, a[:24] + [5, 5], prefix="b")
    assert eng.counters["load_failures"] >= 1
    sc.update_state_after_alloc = real
    hit = eng.counters["hit_tokens"]
    serve(eng, a[:24] + [6, 6], prefix="c")  # b stored what it recomputed
    assert eng.counters["hit_tokens"] - hit == 24


def test_a_new_request_is_answered_in_its_first_step(engine):
    from kvoffload.settings import settings_from_vllm

    # By default the loop waits a little for a lookup sent at once.
    s = settings_from_vllm(vllm_config(Config(), "/x.sock"), kv_cache_config(Config()), env={})
    assert s.lookup_wait_s > 0
    # How long it waits is the machine's; with room to wait, no request
    # (hit or miss) is deferred a step.
    eng = engine(Config(model="m11-first", extra={"lookup_wait_ms": 5000}))
    a = toks(30, 1700)
    serve(eng, a, prefix="a")
    serve(eng, a[:24] + [5, 5], toks(20, 9100), prefix="b")
    hits = [w for w in eng.admit_waits if w[0]]
    misses = [w for w in eng.admit_waits if not w[0]]
    assert hits and misses
    assert all(steps == 0 for _, steps, _ in eng.admit_waits), eng.admit_waits


# -- 8. vLLM's current interfaces ------------------------------------------------------


@pytest.mark.parametrize("as_dict", [False, True], ids=["set", "dict"])
def test_request_level_failures_as_a_set_or_a_dict_are_repaired(engine, daemon, as_dict):
    cfg = Config(groups=[Group("full", 4, 2), Group("full", 8, 1)], num_blocks=96, model=f"m14-{as_dict}",
                 failed_as_dict=as_dict)
    eng = engine(cfg)
    sc = eng.sched_conn
    real = sc.update_state_after_alloc
    a = toks(40, 2000)
    serve(eng, a, prefix="a")
    _invalidate_after_alloc(eng, daemon)
    serve(eng, a[:32] + [5, 5], prefix="b")  # b's load fails: reported per request, recomputed in full
    assert eng.counters["load_failures"] >= 1
    sc.update_state_after_alloc = real
    hit = eng.counters["hit_tokens"]
    serve(eng, a[:32] + [6, 6], prefix="c")  # what b recomputed was stored again
    assert eng.counters["hit_tokens"] - hit == 32


def test_external_hits_are_reported_by_the_tier_they_come_from(engine, fresh_daemon):
    d = fresh_daemon("--disk-dir", "{dir}/disk", "--write-through")
    eng = engine(Config(model="m12-sources"), socket=d.socket)
    a = toks(30, 1800)
    serve(eng, a, prefix="a")
    serve(eng, a[:24] + [5, 5], prefix="b")
    assert eng.counters.get("hit_host") == 24 and eng.counters["hit_tokens"] == 24
    d.restart()
    d.wait_recovered()  # only the disk tier holds them now
    serve(eng, a[:24] + [6, 6], prefix="c")
    assert eng.counters.get("hit_disk") == 24 and eng.counters["hit_tokens"] == 48


def test_group_kinds_come_from_vllm_not_class_names(daemon):
    cfg = Config(model="m12-rswa")
    kcc = kv_cache_config(cfg)
    # R-SWA frees its decode gap blocks while the request runs, as a sliding
    # window does, though its spec is a FullAttentionSpec subclass: the
    # step's stores must drain before vLLM may reuse them.
    kcc.kv_cache_groups[0].kv_cache_spec = sv.RSWASpec(4, 8, num_kv_heads=2, head_size=4)
    with connector_module() as mod:
        c = mod.KVOffloadConnector(vllm_config(cfg, daemon.socket), sv.KVConnectorRole.SCHEDULER, kcc)
        try:
            assert not c.settings.full_attention
            assert c.settings.identity["groups"][0].get("spec_kind") == "FULL_ATTENTION"  # vLLM's kind
        finally:
            c.shutdown()


def test_the_last_block_of_an_eagle_group_is_not_stored_while_decoding(engine, daemon):
    eng = engine(Config(groups=[Group("full", 4, 1), Group("full", 4, 1, eagle=True)], num_blocks=96, model="m13-eagle"))
    serve(eng, toks(16, 1900), max_tokens=9, prefix="a")  # 24 tokens computed: 6 blocks of each group
    fps = _sched(eng)._fingerprints.values()
    assert _blocks_of(daemon, fps) == 2 * 5  # the draft's last block is volatile: left out


def test_a_request_finished_while_loading_with_stores_in_flight_is_freed_once(shm):
    # vLLM keeps a request finished in WAITING_FOR_REMOTE_KVS until it is
    # reported finished receiving, then frees it; if request_finished also
    # said True, finished_sending frees it a second time (scheduler.py
    # _update_from_kv_xfer_finished asserts it is still there). And the
    # blocks must not go back while a store of the request still reads them.
    fake = FakeDaemon()
    try:
        cfg = Config(model="m16")
        with connector_module() as mod:
            vcfg, kcc = vllm_config(cfg, fake.socket), kv_cache_config(cfg)
            sched = mod.KVOffloadConnector(vcfg, sv.KVConnectorRole.SCHEDULER, kcc)
            worker = mod.KVOffloadConnector(vcfg, sv.KVConnectorRole.WORKER, kcc)
            mem = RankMemory(shm, cfg, 0)
            worker.register_kv_caches(mem.kv_caches)
            hs = worker.get_handshake_metadata()
            if hs is not None:
                sched.set_xfer_handshake_metadata({0: hs})
            req = Request("a", toks(17, 1), 4, Hasher(4, 32, "0"), b"s" * 8)
            blocks = sv.ns(get_block_ids=lambda: ([1, 2, 3, 4, 5],))
            sched.update_state_after_alloc(req, blocks, 0)
            out = SchedulerOutput(seq=1, scheduled_new_reqs=[NewRequestData("a", req.prompt_token_ids, ([1, 2, 3, 4, 5],), 0)],
                                  num_scheduled_tokens={"a": 17})
            worker.bind_connector_metadata(sched.build_connector_meta(out))
            worker.start_load_kv(None)
            worker.wait_for_save()  # the daemon accepts the store and keeps reading
            worker.get_finished(set())
            worker.clear_connector_metadata()
            assert wait_for(lambda: fake.pending())
            req.num_computed_tokens = 17
            # Preempted, then waiting for a load of 8 tokens (vLLM holds its
            # blocks until the load is reported), then aborted.
            sched.build_connector_meta(SchedulerOutput(seq=2, preempted_req_ids={"a"}))
            req.num_computed_tokens = 0
            sched.update_state_after_alloc(req, sv.ns(get_block_ids=lambda: ([6, 7, 8, 9, 10],)), 8)
            worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput(seq=3)))
            worker.start_load_kv(None)
            worker.clear_connector_metadata()
            delay, _ = sched.request_finished(req, ([6, 7, 8, 9, 10],))
            assert delay is False, "vLLM already keeps a loading request's blocks until it is finished receiving"
            worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput(seq=4, finished_req_ids={"a"})))
            worker.start_load_kv(None)
            _, recving = worker.get_finished({"a"})
            worker.clear_connector_metadata()
            assert not recving, "finished receiving (its blocks freed) while a store of it may still read them"
            fake.finish()
            assert wait_for(lambda: not worker._worker.pending())
            _, recving = worker.get_finished(set())
            assert recving == {"a"}
            worker.shutdown()
            sched.shutdown()
    finally:
        fake.stop()


# -- 8. issue 24: a store dropped at a preemption is planned again --------------------------


def test_a_store_dropped_at_a_preemption_is_stored_again(engine):
    # vLLM preempts requests mid chunked prefill (num_computed_tokens = 0)
    # and the worker drops their stores still queued: the recomputed blocks
    # must be stored again, or a repeat of the prompt misses them.
    cfg = Config(model="m11-preempt", num_blocks=40, long_prefill=8, max_batched_tokens=48, max_seqs=12,
                 sender_lags=True)
    eng = engine(cfg)
    preempted: list[str] = []
    real = eng._preempt

    def preempt(req):
        if req.num_computed_tokens < req.num_prompt_tokens:
            preempted.append(req.request_id)
        real(req)

    eng._preempt = preempt
    prompts = {f"a{i}": toks(30, 2000 + 100 * i) for i in range(12)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, 1)
    settle(eng)
    assert preempted, "the workload never preempted a request mid prefill"
    for rid in sorted(set(preempted)):
        hit = eng.counters["hit_tokens"]
        serve(eng, prompts[rid][:28] + [7, 7], prefix=f"r{rid}-")
        assert eng.counters["hit_tokens"] - hit == 28, f"the repeat of preempted {rid} was not offered its prefix"


# -- 9. issues 23 and 24: reused blocks are fenced, no step waits on a store otherwise -----


def _stop_until(eng: Engine, d, steps: int) -> dict:
    """Stops the daemon (SIGSTOP) until the engine ran ``steps`` more steps
    or a worker waits for a store (a fence): what ended it."""
    ws = [w._worker for w in eng.workers]
    start = eng.step_seq
    why: dict = {}
    d.pause()

    def resume():
        wait_for(lambda: eng.step_seq >= start + steps or any(w._waiters for w in ws), timeout=120)
        why["steps"] = eng.step_seq - start
        why["waited"] = any(w._waiters for w in ws)
        d.resume()

    t = threading.Thread(target=resume)
    t.start()
    why["thread"] = t
    return why


def _swa_reuse_config(model: str, **kw) -> Config:
    return Config(groups=[Group("full", 4, 1), Group("swa", 4, 1, window=8)], num_blocks=56, long_prefill=4,
                  max_batched_tokens=24, max_seqs=6, model=model, reuse_freed_first=True, record_stores=True, **kw)


@pytest.mark.parametrize("async_scheduling,tp", [(False, 1), (True, 2)], ids=["sync", "async-tp2"])
def test_blocks_reused_while_their_stores_run_are_fenced_never_stored_wrong(engine, fresh_daemon, async_scheduling,
                                                                          tp):
    # vLLM frees sliding-window blocks behind the window while the request
    # runs and gives them to others (here at once: the freed block is the
    # next one allocated). With the daemon stopped, a store of such a block
    # would copy the new request's KV under the old request's keys once it
    # runs again. The step that writes the block waits for that store (a
    # fence) or leaves the block out of a store not yet sent; then every
    # stored block is loaded back at every unit a hit can end on and checked.
    d = fresh_daemon()
    eng = engine(_swa_reuse_config(f"m13-swa-fence-{tp}", async_scheduling=async_scheduling, tp=tp), socket=d.socket)
    prompts = [toks(32, 3000 + 100 * i) for i in range(6)]
    for i, p in enumerate(prompts):
        eng.add_request(f"a{i}", p, 8)
    for _ in range(3):
        eng.step()
    why = _stop_until(eng, d, 20)
    try:
        settle(eng)
    finally:
        why["thread"].join()
    sc, ws = _sched(eng), [w._worker for w in eng.workers]
    assert sc.fences > 0, "no block was reused while its store was in flight: the test tests nothing"
    assert sum(w.fence_waits + w.fence_trimmed for w in ws) > 0
    # Every block the daemon holds, byte for byte against what its request
    # computed (also those no hit would load).
    got = eng.check_stored()
    assert got["wrong"] == 0 and got["checked"] > 0, got
    for i, p in enumerate(prompts):
        for e in range(3, 9):  # a hit ending at every unit loads the window there (verify checks every block)
            serve(eng, p[:4 * e] + [9, 9], prefix=f"r{i}-{e}-")
    assert eng.counters["hit_tokens"] > 0


def test_no_step_waits_on_a_store_while_the_daemon_is_stopped(engine, fresh_daemon):
    # The daemon stopped (SIGSTOP) while a hybrid model decodes and frees
    # sliding-window blocks behind the window, none of them given out again
    # meanwhile (a large pool; freed blocks go to the tail of the free
    # queue, as vLLM's do): no step waits for a store (before fences, every
    # step's wait_for_save waited until the daemon ran again).
    d = fresh_daemon()
    cfg = Config(groups=[Group("full", 4, 1), Group("swa", 4, 1, window=8)], num_blocks=400, max_seqs=4,
                 model="m13-swa-nowait")
    eng = engine(cfg, socket=d.socket)
    for i in range(4):
        eng.add_request(f"a{i}", toks(16, 4000 + 100 * i), 60)
    for _ in range(3):
        eng.step()
    why = _stop_until(eng, d, 30)
    try:
        while "waited" not in why:
            eng.step()
    finally:
        why["thread"].join()
    settle(eng)
    ws = eng.workers[0]._worker
    assert not why["waited"] and why["steps"] >= 30, why
    assert ws.fence_waits == 0


@pytest.mark.parametrize("async_scheduling,tp", [(False, 1), (True, 2)], ids=["sync", "async-tp2"])
def test_a_hybrid_workload_with_blocks_reused_at_once_and_a_stopped_daemon(fresh_daemon, shm, async_scheduling, tp):
    # A seeded workload (preemptions, aborts, controls, hits) on a model with
    # a sliding-window group whose freed blocks are handed out again at once,
    # with the daemon stopped for a while in the middle: every block any
    # request holds is checked after every step (loaded ones included).
    d = fresh_daemon()
    cfg = Config(groups=[Group("full", 4, 2), Group("swa", 8, 1, window=16)], num_blocks=80, tp=tp,
                 async_scheduling=async_scheduling, reuse_freed_first=True, model=f"m13-wl-{tp}",
                 extra={"lookup_deadline_ms": 2000})
    seen = {}

    def look(eng):
        seen["eng"] = eng

    rep = run(cfg, d, shm, seed=23 + tp, steps=200, hang=(40, 2.0), events={199: look})
    s = rep.summary()
    assert s["errored"] == 0 and s["finished"] > 20, s
    assert s["hit_tokens"] > 0 and s["positions_checked"] > 0, s
    assert s["preempted"] > 0, s
    assert seen["eng"].sched_conn._scheduler.fences > 0, "no block was reused while a store of it was in flight"
