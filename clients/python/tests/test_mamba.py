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
import math
import threading
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


def serve_once(cfg: Config, mod, daemon, shm, prompt: list[int]) -> None:
    """Serves ``prompt`` (6 tokens out) on an engine of its own, then closes
    it: its blocks stay in the daemon for the next engine."""
    eng = Engine(cfg, mod, daemon.socket, shm)
    try:
        serve(eng, "a", prompt, 6)
    finally:
        eng.close()


def test_repeated_prefixes_hit_and_every_state_is_right(daemon, shm):
    """A prompt served once is a hit for the next engine (an empty GPU
    cache): the whole prompt but its last block boundary comes from the
    daemon, attention blocks and the one state block at the hit's end,
    and the output is the output of a run without offloading."""
    cfg = hybrid(model="mamba-repeat", extra={"lookup_deadline_ms": 2000})
    prompt = list(range(100, 127))  # 27 tokens: states committed at 4, ..., 24
    with connector_module() as mod:
        serve_once(cfg, mod, daemon, shm, prompt)
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


def _drop_state_after_alloc(eng: Engine, daemon, group: int) -> list[int]:
    """Between the lookup and the load, drops from the daemon only the state
    block at the end of each external hit (group ``group``'s key there), as
    an eviction of that one block would: the attention blocks load, the
    state block comes back MISSING. Returns the hit sizes it dropped for."""
    sc = eng.sched_conn
    real = sc.update_state_after_alloc
    c = daemon.client()
    dropped = []

    def wrapped(request, blocks, n):
        real(request, blocks, n)
        if n:
            end = request.num_computed_tokens + n if request.num_computed_tokens else n
            key = request.block_hashes[end // eng.hash_block_size - 1]
            ids = list(sc._scheduler.namespace_ids() or ())  # this engine's (one per rank)
            assert ids
            removed = c.invalidate(ids, [key], group=group)
            assert removed >= 1, "the state block at the hit's end was not in the daemon"
            dropped.append(n)

    sc.update_state_after_alloc = wrapped
    return dropped


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_state_block_load_fails_the_request_and_is_not_offered_again(daemon, shm, policy):
    """The attention blocks of a hit load, its state block does not: the
    request's load fails as a whole (request-level, this vLLM has them), it
    is recomputed from scratch (or ends with an error under policy "fail"),
    never offered that hit again, and nothing it holds is wrong."""
    cfg = hybrid(model=f"mamba-fail-{policy}", policy=policy, extra={"lookup_deadline_ms": 2000})
    prompt = list(range(300, 327))
    with connector_module() as mod:
        serve_once(cfg, mod, daemon, shm, prompt)
        eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            sc = eng.sched_conn
            asked: list[tuple[str, int]] = []
            real_ask = sc.get_num_new_matched_tokens

            def ask(request, num_computed):
                r = real_ask(request, num_computed)
                if r[0] is not None:
                    asked.append((request.request_id, r[0]))
                return r

            sc.get_num_new_matched_tokens = ask
            dropped = _drop_state_after_alloc(eng, daemon, group=1)
            serve(eng, "b", prompt, 6)
            assert dropped == [24] and eng.counters["load_failures"] == 1, (dropped, eng.counters)
            if policy == "fail":
                assert eng.counters["errored"] == 1 and asked == [("b", 24)], (asked, eng.counters)
            else:
                # Recomputed from token 0 and asked again: offered nothing.
                assert eng.counters["errored"] == 0 and asked == [("b", 24), ("b", 0)], asked
                assert eng.counters["finished"] == 1
            assert eng.counters.get("wrong_outputs", 0) == 0
        finally:
            eng.close()
        # The attention blocks are intact; the state at 24 is back where b
        # recomputed and stored it ("recompute"), and gone where b failed
        # ("fail": no other committed state within the lookup's rounds).
        eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            serve(eng, "c", prompt[:25] + [7, 7, 7], 2)
            assert eng.counters["hit_tokens"] == (24 if policy == "recompute" else 0), eng.counters
        finally:
            eng.close()


def _settings(cfg: Config, **spec_fields):
    v, k = vllm_config(cfg, "/nonexistent.sock"), kv_cache_config(cfg)
    for g in k.kv_cache_groups:
        for f, val in spec_fields.items():
            if isinstance(g.kv_cache_spec, sv.MambaSpec):
                setattr(g.kv_cache_spec, f, val)
    return settings_from_vllm(v, k, spec_kind=sv.get_kv_cache_spec_kind)


@pytest.mark.parametrize("change,needs", [
    ({"mamba_cache_mode": "none"}, "--mamba-cache-mode align"),
    ({"mamba_cache_mode": "all"}, "--mamba-cache-mode align"),
    ({"num_speculative_blocks": 1}, "--speculative-config"),
    ({"shapes": None}, "too old"),
    ({"dtypes": ("complex32", "float32")}, "dtype"),
])
def test_modes_and_vllms_without_a_committed_per_block_state_are_refused(change, needs):
    s = _settings(hybrid(), **change)
    assert s.unsupported is not None and needs in s.unsupported and "state-space (Mamba)" in s.unsupported, s.unsupported
    assert _settings(hybrid()).unsupported is None


def test_a_mamba_spec_without_mamba_cache_mode_is_an_older_vllm_and_refused():
    cfg = hybrid()
    v, k = vllm_config(cfg, "/x.sock"), kv_cache_config(cfg)
    del k.kv_cache_groups[1].kv_cache_spec.mamba_cache_mode
    s = settings_from_vllm(v, k, spec_kind=sv.get_kv_cache_spec_kind)
    assert "no mamba_cache_mode" in s.unsupported and "--mamba-cache-mode align" in s.unsupported
    v2, k2 = vllm_config(cfg, "/x.sock"), kv_cache_config(cfg)
    v2.cache_config.enable_prefix_caching = False
    assert "--enable-prefix-caching" in settings_from_vllm(v2, k2, spec_kind=sv.get_kv_cache_spec_kind).unsupported


def test_a_refused_mamba_model_runs_with_offloading_off_and_says_why(daemon, caplog):
    cfg = hybrid(mamba_mode="none")
    with connector_module() as mod:
        v, k = vllm_config(cfg, daemon.socket), kv_cache_config(cfg)
        with caplog.at_level(logging.ERROR, logger="kvoffload"):
            c = mod.KVOffloadConnector(v, sv.KVConnectorRole.SCHEDULER, k)
        c.shutdown()
    assert any("offloading disabled" in m and "--mamba-cache-mode align" in m for m in caplog.messages), caplog.messages


@pytest.mark.parametrize("change", [
    {"shapes": ((4, 3), (2, 2, 8))},
    {"dtypes": ("bfloat16", "bfloat16")},
    {"mamba_type": "gdn_attention"},
    {"page_size_padded": 128},
])
def test_the_fingerprint_covers_the_state_shapes_dtypes_and_kind(change):
    base = _settings(hybrid())
    other = _settings(hybrid(), **change)
    assert other.unsupported is None
    assert base.fingerprint({"tp": 0}) != other.fingerprint({"tp": 0})
    assert base.fingerprint({"tp": 0}) == _settings(hybrid()).fingerprint({"tp": 0})
    g = base.identity["groups"][1]
    assert g["mamba_cache_mode"] == "align" and g["state_dtypes"] == ["bfloat16", "float32"]


def test_engines_whose_state_differs_share_no_block(daemon, shm):
    """Same model name, same attention, another SSM state dtype: the second
    engine finds nothing of the first's."""
    prompt = list(range(500, 527))
    with connector_module() as mod:
        for i, dtypes in enumerate([("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")]):
            cfg = hybrid(model="mamba-dtypes", mamba_spec={"dtypes": dtypes}, extra={"lookup_deadline_ms": 2000})
            eng = Engine(cfg, mod, daemon.socket, shm)
            try:
                serve(eng, f"r{i}", prompt, 2)
                assert eng.counters["hit_tokens"] == [0, 0, 24][i], (i, eng.counters)
            finally:
                eng.close()


@pytest.mark.parametrize("form", ["page", "states"])
def test_workers_register_each_layers_per_block_state(shm, form):
    """vLLM 7cfb97e's V1 runner hands a Mamba layer as one int8 page view
    per block; older runners (and the V2 runner's per-state views) as a conv
    and an SSM tensor over one page. Both map to the layer's state bytes."""
    from kvoffload.regions import regions_from_kv_caches

    cfg = hybrid(mamba_tensors=form)
    mem = RankMemory(shm, cfg, 0)
    try:
        s = _settings(cfg)
        kv = regions_from_kv_caches(mem.kv_caches, s.group_layers, cfg.num_blocks, 32,
                                    group_block_sizes=s.rank_block_sizes)
        mamba.check_registration(kv.layout.segments, kv.region_layers, s.group_layers, s.mamba_specs)
        state = [seg.bytes for seg in kv.layout.segments if seg.group == 1]
        assert sum(state) == 2 * 88 and len(state) == (2 if form == "page" else 4), state
        # A runner that hands only the conv state: refused, naming the layer.
        if form == "states":
            short = dict(mem.kv_caches)
            short["g1.l0"] = mem.kv_caches["g1.l0"][:1]
            kv = regions_from_kv_caches(short, s.group_layers, cfg.num_blocks, 32, group_block_sizes=s.rank_block_sizes)
            with pytest.raises(ValueError, match="g1.l0: its tensors hold 24 bytes per block, its state is 88"):
                mamba.check_registration(kv.layout.segments, kv.region_layers, s.group_layers, s.mamba_specs)
    finally:
        mem.shm.close()


def test_a_vllm_that_does_not_hand_the_state_to_connectors_turns_offloading_off(daemon, shm, caplog):
    cfg = hybrid(model="mamba-missing")
    with connector_module() as mod:
        v, k = vllm_config(cfg, daemon.socket), kv_cache_config(cfg)
        w = mod.KVOffloadConnector(v, sv.KVConnectorRole.WORKER, k)
        mem = RankMemory(shm, cfg, 0)
        try:
            caches = {n: t for n, t in mem.kv_caches.items() if not n.startswith("g1.")}
            with caplog.at_level(logging.ERROR, logger="kvoffload"):
                w.register_kv_caches(caches)
            assert any("Mamba layer g1.l0" in m and "register_kv_caches" in m for m in caplog.messages), caplog.messages
            assert w._fingerprint is None and w.get_handshake_metadata() is None
        finally:
            w.shutdown()
            mem.shm.close()


SHAPES = [
    ("mamba", hybrid(), {}),
    ("mamba-async-tp2", hybrid(tp=2, async_scheduling=True, num_blocks=80, mamba_tensors="states"), {}),
    # The unit (8 tokens) spans two state blocks: only the second is ever stored.
    ("mamba-unit2", hybrid(groups=[Group("full", 8, 1), Group("mamba", 4, 1)], long_prefill=12), {}),
    ("mamba-swa", hybrid(groups=[Group("full", 4, 1), Group("swa", 4, 1, window=8), Group("mamba", 4, 1)],
                         num_blocks=128), {}),
]


@pytest.mark.parametrize("name,cfg,switches", SHAPES, ids=[c[0] for c in SHAPES])
def test_random_workload_with_mamba_state(daemon, shm, name, cfg, switches):
    """Seeded shared prefixes, extensions of earlier requests, aborts,
    preemptions; after every step every attention block and every state
    block any request holds is checked, and every sampled token (drawn from
    the state) against a run without offloading."""
    cfg.model = f"wl-{name}"
    cfg.extra = {**cfg.extra, "lookup_deadline_ms": 2000}
    stored: list = []
    rep = run(cfg, daemon, shm, seed=zlib.crc32(name.encode()) % 1000, steps=150, switches=switches,
              events={0: lambda eng: _record_state_stores(eng, stored)})
    s = rep.summary()
    assert s["errored"] == 0 and s["finished"] > 20, s
    assert s["hit_tokens"] > 0, f"{name}: no external hit in the whole run: {s}"
    assert s.get("wrong_outputs", 0) == 0 and s["positions_checked"] > 0
    assert stored, "no state block was stored"
    # Every state block stored ends a unit: the only states a hit can use.
    unit = math.lcm(*[g.block_size for g in cfg.groups])
    bad = [(rid, i) for rid, i, bs in stored if ((i + 1) * bs) % unit]
    assert not bad, bad[:5]


def _record_state_stores(eng: Engine, out: list) -> None:
    """Records (request, block index, block size) of every Mamba block a
    step's plan stores, from the plan and the request's block hashes."""
    sc = eng.sched_conn
    real = sc.build_connector_meta
    groups = [g for g, grp in enumerate(eng.cfg.groups) if grp.kind == "mamba"]

    def spy(so):
        meta = real(so)
        for rid, jobs in meta.plan.stores.items():
            req = eng.requests[rid]
            for j in jobs:
                if j.group in groups:
                    bs = eng.group_sizes[j.group]
                    f = bs // eng.hash_block_size
                    index = {bytes(req.block_hashes[(i + 1) * f - 1]): i for i in range(len(req.block_hashes) // f)}
                    out.extend((rid, index[bytes(h)], bs) for h in j.hashes)
        return meta

    sc.build_connector_meta = spy


def test_disk_faults_and_a_restart_never_serve_a_wrong_state(fresh_daemon, shm):
    d = fresh_daemon("--disk-dir", "{dir}/disk", "--disk-bytes", "64MiB", "--write-through",
                     "--fault-spec", "read-eio=0.1,short-read=0.05,bitflip=0.05,seed=5", log_level="warn")
    cfg = hybrid(model="mamba-faults", async_scheduling=True, extra={"lookup_deadline_ms": 2000})
    rep = run(cfg, d, shm, seed=11, steps=260, events={120: lambda eng: d.restart()})
    s = rep.summary()
    assert d.restarts == 1
    assert s["errored"] == 0 and s["finished"] > 40 and s.get("wrong_outputs", 0) == 0, s
    assert s["hit_tokens"] > 0, s


def test_a_state_block_reused_while_its_store_waits_is_never_stored_with_other_bytes(fresh_daemon, shm):
    """vLLM frees a request's previous state block two steps after its
    boundary and gives it to others while the request runs. With the daemon
    stopped, a store still waiting would copy the new owner's bytes under
    this request's key; every state stored is then loaded back at its hit
    and checked."""
    from helpers import wait_for

    d = fresh_daemon()
    cfg = hybrid(groups=[Group("full", 4, 1), Group("mamba", 4, 1)], num_blocks=56, long_prefill=4,
                 max_batched_tokens=24, max_seqs=6, model="mamba-reuse", extra={"lookup_deadline_ms": 2000})
    prompts = [list(range(3000 + 100 * i, 3032 + 100 * i)) for i in range(6)]
    with connector_module() as mod:
        eng = Engine(cfg, mod, d.socket, shm)
        try:
            for i, p in enumerate(prompts):
                eng.add_request(f"a{i}", p, 8)
            w = eng.workers[0]._worker
            for _ in range(1000):  # until stores run: on a loaded machine lookups can take steps
                if w._store_seen:
                    break
                eng.step()
            assert w._store_seen, "no request stored anything"
            start = eng.step_seq
            d.pause()

            def resume():
                wait_for(lambda: eng.step_seq >= start + 20 or w._waiters > 0)
                d.resume()

            t = threading.Thread(target=resume)
            t.start()
            try:
                while not eng.idle():
                    eng.step()
            finally:
                t.join()
            assert eng.step_seq > start + 1
        finally:
            eng.close()
        eng = Engine(cfg, mod, d.socket, shm)  # an empty GPU cache: every hit is loaded
        try:
            for i, p in enumerate(prompts):
                for e in range(3, 9):
                    serve(eng, f"r{i}-{e}", p[:4 * e] + [9, 9], 1)
            assert eng.counters["hit_tokens"] > 0 and eng.counters.get("wrong_outputs", 0) == 0, eng.counters
        finally:
            eng.close()
