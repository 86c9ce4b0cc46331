"""KVOffloadConnector (kvoffload.vllm) inside the vLLM stand-in, against the real daemon.

Seeded random workloads run the stand-in engine (standin_engine.py) with the
connector for every configuration it supports — hybrid groups, tensor and
decode context parallel, kernel-block splits, MLA, async scheduling, older
vLLM interfaces — with disk faults, a daemon restart and a hung daemon, and
check after every step that every block holds what a run without
offloading would. ``make soak-connector`` runs the same for as long as asked.
"""

from __future__ import annotations

import copy
import logging
import threading
import zlib

import pytest
import standin_vllm as sv
from standin_engine import Config, Engine, Group, kv_cache_config, vllm_config
from standin_run import connector_module, run

from kvoffload import stats as kstats

# (name, config, stand-in switches): one line per supported shape.
CONFIGS = [
    ("plain", Config(), {}),
    ("async-tp2", Config(tp=2, async_scheduling=True, num_blocks=48), {}),
    ("hybrid-swa", Config(groups=[Group("full", 4, 2), Group("swa", 8, 1, window=16)], num_blocks=80), {}),
    ("hybrid-async-chunked", Config(groups=[Group("full", 4, 1), Group("full", 8, 1)], async_scheduling=True,
                                    long_prefill=12, num_blocks=160), {}),
    ("dcp2-tp2", Config(tp=2, dcp=2, num_blocks=40), {}),
    ("kernel-split-nhd", Config(groups=[Group("full", 8, 2)], kernel_block_size=2, layout="NHD"), {}),
    ("mla", Config(groups=[Group("mla", 4, 2)], kernel_block_size=2), {}),
    ("pcp2", Config(pcp=2), {}),
    ("older-vllm", Config(transfer_results=False, worker_meta=False, old_preemptions=True, async_scheduling=True),
     {"transfer_results": False, "worker_meta": False, "metrics": False, "resolver": False}),
]


@pytest.mark.parametrize("name,cfg,switches", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_random_workload(daemon, shm, name, cfg, switches):
    cfg.model = f"wl-{name}"
    # The stand-in steps every 0.5 ms in one Python process, and its loop
    # starves the connector's lookup thread of the GIL: at the default 200 ms
    # lookup deadline almost every lookup timed out on a busy machine (5
    # answered, 143 timed out in one run: no hit at all). vLLM's own steps
    # wait on the GPU with the GIL released; here the deadline is raised so
    # the run is about hits and KV, not about this machine's scheduling.
    # The deadline itself is covered by the hung-daemon tests.
    cfg.extra = {**cfg.extra, "lookup_deadline_ms": 2000}
    rep = run(cfg, daemon, shm, seed=zlib.crc32(name.encode()) % 1000, steps=120, switches=switches)
    s = rep.summary()
    assert s["errored"] == 0 and s["finished"] > 20, s
    assert s["hit_tokens"] > 0, f"{name}: no external hit in the whole run: {s}"
    assert s["positions_checked"] > 0


@pytest.mark.parametrize("name,cfg,switches", [CONFIGS[0], CONFIGS[1], CONFIGS[7]], ids=["plain", "async-tp2", "pcp2"])
def test_random_workload_across_weight_updates_and_engine_restarts(daemon, shm, name, cfg, switches):
    """An engine restart with one block more (the checkpoint's weights: the
    new engine may hit what the old one stored), then two weight updates
    (the KV of every token changes: a block stored before one and loaded
    after fails the check)."""
    cfg = copy.deepcopy(cfg)
    cfg.model = f"wl-reset-{name}"
    cfg.extra = {**cfg.extra, "lookup_deadline_ms": 2000}
    rep = run(cfg, daemon, shm, seed=zlib.crc32(name.encode()) % 1000 + 7, steps=160, switches=switches,
              weight_updates=(70, 120), engine_restarts={30: 1})
    s = rep.summary()
    assert s["errored"] == 0 and s["weight_updates"] == 2 and s["engine_restarts"] == 1, s
    assert s["hit_tokens"] > 0 and s["positions_checked"] > 0, s


@pytest.mark.parametrize("name,cfg,switches", CONFIGS[1:3], ids=[c[0] for c in CONFIGS[1:3]])
def test_the_standin_alone_holds_the_right_kv(daemon, shm, name, cfg, switches):
    """The stand-in engine with a connector that does nothing: its own block
    pool, prefix cache, preemption, async scheduling and aborts pass its KV
    check, so a failure with the real connector is the connector's."""
    import copy

    from standin_engine import Engine, Workload

    cfg = copy.deepcopy(cfg)
    with connector_module():
        mod = sv.ns(KVOffloadConnector=sv.NullConnector)
        eng = Engine(cfg, mod, daemon.socket, shm)
        wl = Workload(zlib.crc32(name.encode()) % 1000 + 1, eng.block_size)
        try:
            for _ in range(100):
                wl.tick(eng)
                eng.step()
            while not eng.idle():
                wl.tick(eng, stop_arrivals=True)
                eng.step()
            eng.drain()
        finally:
            eng.close()
    assert eng.counters["positions_checked"] > 1000 and eng.counters["finished"] > 20, eng.counters


def test_faults_restart_and_a_hang(fresh_daemon, shm):
    """Disk read faults, a daemon restart (after it, blocks come back from
    disk) and a hung daemon, in one seeded run."""
    d = fresh_daemon("--disk-dir", "{dir}/disk", "--disk-bytes", "64MiB", "--write-through",
                     "--fault-spec", "read-eio=0.1,short-read=0.05,bitflip=0.05,seed=3", log_level="warn")
    cfg = Config(groups=[Group("full", 4, 2)], tp=2, async_scheduling=True, num_blocks=48, model="faults")
    # As in test_random_workload: at the default 200 ms deadline a busy
    # machine's GIL left every lookup of one CI run unanswered (40,466
    # deferrals, no hit). Steps go on during the hang either way.
    cfg.extra = {**cfg.extra, "lookup_deadline_ms": 2000}
    rep = run(cfg, d, shm, seed=7, steps=260, events={120: lambda eng: d.restart()}, hang=(180, 0.5))
    s = rep.summary()
    assert d.restarts == 1
    assert s["errored"] == 0 and s["finished"] > 40, s
    assert s["hit_tokens"] > 0, s


def test_a_hung_daemon_does_not_stall_serving(fresh_daemon, shm):
    """SIGSTOP the daemon: requests keep being served (as misses) while it
    is stopped. A watchdog resumes it after a minute: steps done before that
    are what counts, so a connector that blocks on the daemon fails here."""
    d = fresh_daemon()
    cfg = Config(model="hang")
    done_while_stopped = []
    with connector_module() as mod:
        from standin_engine import Workload

        eng = Engine(cfg, mod, d.socket, shm)
        wl = Workload(11, eng.block_size)
        try:
            for _ in range(40):  # warm: blocks stored, hits happen
                wl.tick(eng)
                eng.step()
            # A store the daemon accepted and had not finished when it stopped
            # rightly holds the step that reuses its block (the fence): on a
            # loaded machine one was often still landing after the 40 steps.
            # Stop the daemon once the stores it took have landed.
            for _ in range(2000):
                if not any(w._worker._pending_stores for w in eng.workers if getattr(w, "_worker", None)):
                    break
                wl.tick(eng, stop_arrivals=True)
                eng.step()
            else:
                raise AssertionError("stores did not land before the pause: " + eng.describe())
            d.pause()
            resumed = threading.Event()
            watchdog = threading.Timer(60.0, lambda: (resumed.set(), d.resume()))
            watchdog.start()
            n0 = eng.counters["finished"]
            for _ in range(200):
                wl.tick(eng)
                eng.step()
                if not resumed.is_set():
                    done_while_stopped.append(eng.counters["finished"] - n0)
            watchdog.cancel()
            d.resume()
            while not eng.idle():
                wl.tick(eng, stop_arrivals=True)
                eng.step()
        finally:
            eng.close()
    assert len(done_while_stopped) == 200, "steps stalled on the stopped daemon"
    assert done_while_stopped[-1] > 0, "no request finished while the daemon was stopped"


def test_skip_reading_prefix_cache_and_store_controls(daemon, shm):
    # Exact hit counts: a deadline the busy loop cannot miss (test_random_workload).
    cfg = Config(model="controls", prefix_caching=False, extra={"lookup_deadline_ms": 2000})
    with connector_module() as mod:
        eng = Engine(cfg, mod, daemon.socket, shm)
        try:
            a = list(range(100, 130))

            def serve(rid, prompt, **kw):
                eng.add_request(rid, prompt, 1, **kw)
                while not eng.idle():
                    eng.step()

            serve("a", a)
            serve("b", a[:24] + [1], skip_reading_prefix_cache=True)  # prompt logprobs: no external hit
            assert eng.counters["hit_tokens"] == 0
            serve("c", a[:24] + [2])
            assert eng.counters["hit_tokens"] == 24
            # A request that asks not to be stored leaves nothing behind.
            serve("d", list(range(400, 430)), kv_transfer_params={"kvoffload_store": "none"})
            serve("e", list(range(400, 430)))
            assert eng.counters["hit_tokens"] == 24
            # Prompt only: the prompt is stored, the generated tokens are not.
            p = list(range(600, 620))
            eng.add_request("f", p, 9, kv_transfer_params={"kvoffload_store": "prompt"})
            while not eng.idle():
                eng.step()
            eng.add_request("g", p, 1)
            while not eng.idle():
                eng.step()
            assert eng.counters["hit_tokens"] == 24 + 16  # the whole prompt but its last token
        finally:
            eng.close()


def test_finished_requests_keep_their_blocks_only_while_stores_run(daemon, shm):
    """A request whose stores have all drained is freed at once: vLLM is not
    told to keep its blocks for a finished_sending that changes nothing."""
    cfg = Config(model="held", prefix_caching=False)
    held = []
    with connector_module() as mod:
        eng = Engine(cfg, mod, daemon.socket, shm)
        real = eng.sched_conn.request_finished_all_groups

        def spy(req, ids):
            r = real(req, ids)
            held.append((req.request_id, r[0]))
            return r

        eng.sched_conn.request_finished_all_groups = spy
        try:
            # 16 prompt tokens stored in the first step it runs, then decode
            # steps that store nothing (the prompt only); once every worker
            # acknowledged the stores, the request ends (an abort, long
            # before its 100 tokens): nothing is in flight.
            sched = eng.sched_conn._scheduler
            for i in range(3):
                rid = f"h{i}"
                eng.add_request(rid, list(range(1000 * i, 1000 * i + 16)), 100,
                                kv_transfer_params={"kvoffload_store": "prompt"})
                eng.step()
                while rid not in sched._reqs or not sched.stores_settled(rid):
                    eng.step()
                assert eng.requests[rid].status == "RUNNING"
                eng.abort(rid)
                while not eng.idle():
                    eng.step()
        finally:
            eng.close()
    assert held == [("h0", False), ("h1", False), ("h2", False)], held


def test_metrics_reach_vllm(daemon, shm):
    """get_kv_connector_stats carries hits by tier, bytes and latencies;
    build_kv_connector_stats aggregates the workers'; the Prometheus metrics
    count them."""
    # Exact hit counts: a deadline the busy loop cannot miss (test_random_workload).
    cfg = Config(model="metrics", prefix_caching=False, tp=2, extra={"lookup_deadline_ms": 2000})
    with connector_module() as mod:
        eng = Engine(cfg, mod, daemon.socket, shm)
        agg = mod.KVOffloadConnector.build_kv_connector_stats()
        real = eng.execute

        def execute(out):
            res = real(out)
            return res

        try:
            seen = []
            orig = eng.workers[0].get_kv_connector_stats

            for w in eng.workers:
                f = w.get_kv_connector_stats

                def wrapped(f=f):
                    st = f()
                    if st is not None:
                        seen.append(st)
                    return st

                w.get_kv_connector_stats = wrapped
            a = list(range(100, 130))
            for rid, p in (("a", a), ("b", a[:24] + [5])):
                eng.add_request(rid, p, 1)
                while not eng.idle():
                    eng.step()
            sched_stats = eng.sched_conn.get_kv_connector_stats()
            assert orig is not None
        finally:
            eng.close()
        for st in seen + [sched_stats]:
            agg = agg.aggregate(st)
        d = agg.data
        assert d["hit_tokens"].get("cpu") == 24
        assert d["blocks_stored_total"] >= 2 * 6 and d["bytes_stored_total"] > 0
        assert d["blocks_loaded_total"] == 2 * 6 and d["bytes_loaded_total"] > 0
        assert d["lookup_seconds"] and d["load_seconds"] and d["store_seconds"]
        red = agg.reduce()
        assert red["hit_tokens_cpu"] == 24 and "load_p99_ms" in red
        prom = mod.KVOffloadConnector.build_prom_metrics(vllm_config(cfg, daemon.socket), sv.metric_types(),
                                                         ["model_name", "engine"], {0: ["m", "0"]})
        prom.observe(d, 0)
        assert sv._Metric.registry["vllm:kvoffload_hit_tokens"].values[("m", "0", "cpu")] == 24
        assert sv._Metric.registry["vllm:kvoffload_transferred_bytes"].values[("m", "0", "load")] > 0
        assert sv._Metric.registry["vllm:kvoffload_load_seconds"].samples[("m", "0")]
        assert kstats.is_empty(None)


def test_settings_warnings_and_refusals(daemon, caplog):
    cfg = Config(policy="fail", extra={"drain_timeout_s": 30})
    with connector_module() as mod:
        v, k = vllm_config(cfg, daemon.socket), kv_cache_config(cfg)
        with caplog.at_level(logging.WARNING, logger="kvoffload"):
            c = mod.KVOffloadConnector(v, sv.KVConnectorRole.SCHEDULER, k)
        c.shutdown()
        assert any('kv_load_failure_policy is "fail"' in m for m in caplog.messages)
        assert any("drain_timeout_s is ignored" in m for m in caplog.messages)
        v.kv_transfer_config.kv_connector_extra_config["sokcet"] = "/x"
        with pytest.raises(ValueError, match="unknown kv_connector_extra_config"):
            mod.KVOffloadConnector(v, sv.KVConnectorRole.SCHEDULER, k)
        assert mod.KVOffloadConnector.get_required_kvcache_layout(v) == "HND"
        v.model_config.use_mla = True
        assert mod.KVOffloadConnector.get_required_kvcache_layout(v) is None
        # A state-space model outside align mode: offloading is off, the engine starts.
        mamba = kv_cache_config(Config())
        mamba.kv_cache_groups.append(sv.ns(layer_names=["m.0"], kv_cache_spec=sv.MambaSpec(4, mamba_cache_mode="none")))
        v.kv_transfer_config.kv_connector_extra_config.pop("sokcet")
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="kvoffload"):
            c = mod.KVOffloadConnector(v, sv.KVConnectorRole.SCHEDULER, mamba)
        c.shutdown()
        assert any("state-space" in m and "--mamba-cache-mode align" in m for m in caplog.messages)


def test_loads_and_stores_carry_the_engines_ready_event(shm):
    """On CUDA a Load carries an IPC event recorded on the compute stream
    (the copies wait for the engine's work before them), as a Store does;
    each event is held until the jobs sent with it are done. Without a GPU:
    a stand-in torch and a daemon that records what it is sent."""
    import sys
    import types

    from fake_daemon import FakeDaemon
    from helpers import wait_for
    from standin_engine import RankMemory

    from kvoffload.plan import GroupJob, StepPlan
    from kvoffload.worker_side import WorkerSide

    recorded, made = [], []

    class Event:
        def __init__(self, interprocess=False, **kw):
            assert interprocess
            self.n = len(made)
            made.append(self)

        def record(self, stream=None):
            recorded.append(self)

        def ipc_handle(self):
            return bytes([self.n]) * 64

    fake_torch = types.ModuleType("torch")
    fake_torch.cuda = types.SimpleNamespace(Event=Event)
    fake = FakeDaemon()
    saved = sys.modules.get("torch")
    sys.modules["torch"] = fake_torch
    try:
        with connector_module() as mod:
            cfg = Config(model="events")
            w = WorkerSide(fake.socket, b"fp", 1)
            mem = RankMemory(shm, cfg, 0)
            from kvoffload.regions import regions_from_kv_caches

            w.register(regions_from_kv_caches(mem.kv_caches, [["g0.l0", "g0.l1"]], cfg.num_blocks, 32))
            events = mod._ReadyEvents()
            plan = StepPlan(seq=1, loads={"a": [GroupJob(0, [b"\1" * 32], [3], 0)]},
                            stores={"b": [GroupJob(0, [b"\2" * 32], [4], 0)]})
            handle, held = events.record()
            events.hold(w.start_load_kv(plan, ready_event=handle), held, w.jobs_done)
            handle2, held2 = events.record()
            events.hold(w.wait_for_save(plan, ready_event=handle2), held2, w.jobs_done)
            assert wait_for(lambda: len(fake.calls) == 2)
            assert [(c, r.ready_event) for c, r in fake.calls] == [("Load", bytes([0]) * 64), ("Store", bytes([1]) * 64)]
            assert len(events._held) == 2  # alive while the daemon has not finished the jobs
            fake.finish()
            assert wait_for(lambda: w.pending() == 0)
            events.hold([], None, w.jobs_done)
            assert events._held == []
            w.shutdown()
    finally:
        fake.stop()
        if saved is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = saved



def test_round_trips_per_step(daemon, shm, monkeypatch):
    """The same seeded workload in the stand-in, with the workers reading
    results from their Store and Load replies and, as before, from
    Completions only: the Store, Load and Completions calls per step of
    each (issue 11 item 4). The stand-in steps back to back (no forward
    pass), so this reports what the connector decided; the exact counts
    are asserted in test_piggyback.py, where the worker's clock is held."""
    from kvoffload import client as kclient

    calls: dict[str, int] = {}
    lock = threading.Lock()
    real = kclient.Client._call

    def counting(self, method, request, *a, **kw):
        with lock:
            calls[method] = calls.get(method, 0) + 1
        return real(self, method, request, *a, **kw)

    monkeypatch.setattr(kclient.Client, "_call", counting)
    per_step = {}
    for piggyback in (True, False):
        calls.clear()
        cfg = Config(async_scheduling=True, model=f"rtt-{piggyback}")
        cfg.extra = {**cfg.extra, "lookup_deadline_ms": 2000}

        def setup(eng, piggyback=piggyback):
            for w in eng.workers:
                w._worker._piggyback = piggyback

        rep = run(cfg, daemon, shm, seed=11, steps=120, events={0: setup})
        s = rep.summary()
        assert s["errored"] == 0 and s["finished"] > 20, s
        with lock:
            got = {m: calls.get(m, 0) for m in ("Store", "Load", "Completions")}
        per_step[piggyback] = {m: round(n / rep.steps, 2) for m, n in got.items()}
        print(f"piggyback={piggyback}: {rep.steps} steps, {got}, per step {per_step[piggyback]}")
    assert per_step[True]["Completions"] < per_step[False]["Completions"], per_step


def test_sync_stores_true_waits_at_the_end_of_every_step_for_every_model(fresh_daemon, shm):
    """Kept for compatibility: ``sync_stores: true`` adds a wait for the
    step's stores in wait_for_save, for a full-attention model too; false
    (the default) is safe for every model (reused blocks are fenced)."""
    from helpers import wait_for

    d = fresh_daemon()
    cfg = Config(model="sync-true", extra={"sync_stores": True})
    with connector_module() as mod:
        eng = Engine(cfg, mod, d.socket, shm)
        ws = eng.workers[0]._worker
        try:
            assert ws.sync_stores
            eng.add_request("a0", list(range(4500, 4516)), 20)
            # Pause only once the request runs and stored its prompt: on a
            # loaded machine its lookup can take several steps, and a paused
            # daemon then keeps it waiting past the 30 steps below with no
            # store to wait on.
            for _ in range(1000):
                if "a0" in ws._store_seen:
                    break
                eng.step()
            assert "a0" in ws._store_seen, "the request never stored its prompt"
            d.pause()
            waited = []
            start = eng.step_seq

            def resume():
                waited.append(bool(wait_for(lambda: ws._waiters > 0 or eng.step_seq >= start + 30, timeout=120)
                                   and ws._waiters > 0))
                d.resume()

            t = threading.Thread(target=resume)
            t.start()
            try:
                while not waited:
                    eng.step()
            finally:
                t.join()
                d.resume()
            while not eng.idle():
                eng.step()
        finally:
            eng.close()
    assert waited == [True], "a step ran on past a store the stopped daemon held"
