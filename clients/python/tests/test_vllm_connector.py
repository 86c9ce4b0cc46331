"""KVOffloadConnector itself (kvoffload.vllm), against the real daemon.

vLLM is replaced by fake_vllm (the base class and the modules the connector
imports); the calls are made in the order vLLM's scheduler and model runner
make them, with stand-ins carrying vLLM's field names.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace as ns

import fake_vllm
import pytest
from helpers import Engine, KVCacheBlocks, NewRequestData, Request, SchedulerOutput, wait_for

from kvoffload.settings import hash_bytes_for, settings_from_vllm

NB = 40


class FullAttentionSpec:
    def __init__(self, block_size):
        self.block_size = block_size


class SlidingWindowSpec:
    def __init__(self, block_size, sliding_window):
        self.block_size, self.sliding_window = block_size, sliding_window


class MambaSpec:
    block_size = 4


def vllm_config(socket, model, *, tp=1, extra=None, algo="sha256", policy="recompute"):
    return ns(
        model_config=ns(model=model, revision="main", dtype="bfloat16"),
        cache_config=ns(block_size=4, cache_dtype="auto", prefix_caching_hash_algo=algo),
        parallel_config=ns(tensor_parallel_size=tp, pipeline_parallel_size=1),
        kv_transfer_config=ns(kv_connector_extra_config={"socket": socket, **(extra or {})},
                              kv_load_failure_policy=policy, is_kv_producer=True),
    )


def kv_cache_config(groups):
    return ns(num_blocks=NB, kv_cache_groups=[ns(layer_names=list(n), kv_cache_spec=s) for n, s in groups])


@pytest.fixture
def vllm_mod():
    handles = []

    def load(**kw):
        h = fake_vllm.install(**kw)
        handles.append(h)
        import kvoffload.vllm as mod

        return mod, h

    yield load
    for h in reversed(handles):
        fake_vllm.uninstall(h)


class Engine1:
    """vLLM with one scheduler and one worker, driving the connector class."""

    def __init__(self, mod, fake, daemon, shm, model, groups, extra=None):
        self.fake = fake
        cfg = vllm_config(daemon.socket, model, extra=extra)
        kcc = kv_cache_config(groups)
        self.sched = mod.KVOffloadConnector(cfg, fake.Role.SCHEDULER, kcc)
        self.worker = mod.KVOffloadConnector(cfg, fake.Role.WORKER, kcc)
        self.engine = Engine(shm, {g: list(n) for g, (n, _) in enumerate(groups)},
                             [s.block_size for _, s in groups], NB)
        self.worker.register_kv_caches(self.engine.kv_caches)
        self.recv, self.sent, self.invalid, self.failed = set(), set(), set(), set()

    def step(self, out=None, forward=None):
        out = out or SchedulerOutput()
        meta = self.sched.build_connector_meta(out)
        meta = pickle.loads(pickle.dumps(meta))  # vLLM ships it to the workers
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for layer in self.engine.kv_caches:
            w.wait_for_layer_load(layer)
        if forward:
            forward(self.engine)
        for layer, t in self.engine.kv_caches.items():
            w.save_kv_layer(layer, t, None)
        w.wait_for_save()
        if hasattr(w, "get_transfer_results"):
            r = w.get_transfer_results(out.finished_req_ids)
            sent, recv, failed = r.finished_sending, r.finished_recving, r.failed_recving
            assert failed <= recv  # a failed receive is also a finished one
        else:
            sent, recv = (set(x or ()) for x in w.get_finished(out.finished_req_ids))
            failed = set()
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self.sched.update_connector_output(ns(finished_recving=recv, finished_sending=sent))
        self.recv |= recv
        self.sent |= sent
        self.invalid |= invalid
        self.failed |= failed
        return meta

    def until(self, pred):
        return wait_for(lambda: (self.step(), pred())[1])

    def close(self):
        self.worker.shutdown()
        self.sched.shutdown()


def test_connector_class_store_hit_load_and_failure(vllm_mod, daemon, shm, fingerprint, client):
    mod, fake = vllm_mod()
    assert issubclass(mod.KVOffloadConnector, fake_vllm.SupportsHMA)
    e = Engine1(mod, fake, daemon, shm, fingerprint.decode(), [(["l.0", "l.1"], FullAttentionSpec(4))])
    assert e.worker.requires_kv_delivery is False
    toks = list(range(1000, 1022))
    r1 = Request("r1", toks)
    assert e.sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    e.sched.update_state_after_alloc(r1, KVCacheBlocks([1, 2, 3, 4, 5, 6]), 0)
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("r1", ([1, 2, 3, 4, 5, 6],))],
                          num_scheduled_tokens={"r1": 22})
    e.step(out, lambda eng: [eng.write(0, b, bytes([b])) for b in range(1, 7)])
    r1.num_computed_tokens = 22
    assert e.sched.request_finished(r1, [1, 2, 3, 4, 5, 6]) == (True, None)
    e.step(SchedulerOutput(finished_req_ids={"r1"}))
    assert e.until(lambda: "r1" in e.sent)

    r2 = Request("r2", toks[:20] + [1, 2])
    assert e.sched.get_num_new_matched_tokens(r2, 0) == (20, True)
    e.sched.update_state_after_alloc(r2, KVCacheBlocks([11, 12, 13, 14, 15, 16]), 20)
    e.step()
    assert e.until(lambda: "r2" in e.recv)
    assert e.invalid == set() and e.failed == set()
    assert [e.engine.read(0, b) for b in (11, 12, 13, 14, 15)] == [e.engine.read(0, b) for b in (1, 2, 3, 4, 5)]

    # Evicted between Lookup and Load: exactly those engine blocks come back.
    r3 = Request("r3", toks[:20] + [3, 4])
    assert e.sched.get_num_new_matched_tokens(r3, 0) == (20, True)
    ns_id = e.worker._worker.namespace_id
    assert client.invalidate([ns_id], [r1.block_hashes[0], r1.block_hashes[3]]) == 2
    e.sched.update_state_after_alloc(r3, KVCacheBlocks([21, 22, 23, 24, 25, 26]), 20)
    e.step()
    assert e.until(lambda: "r3" in e.recv)
    assert e.invalid == {21, 24}
    assert e.failed == set()  # one KV cache group: block-level reporting
    e.close()


def test_connector_class_hybrid_reports_request_level_failures(vllm_mod, daemon, shm, fingerprint, client):
    mod, fake = vllm_mod()
    groups = [(["full.0"], FullAttentionSpec(4)), (["swa.0"], SlidingWindowSpec(8, 64))]
    e = Engine1(mod, fake, daemon, shm, fingerprint.decode(), groups)
    assert e.worker._worker.request_level_failures and e.worker._worker.sync_stores
    toks = list(range(2000, 2026))
    r1 = Request("h1", toks)
    e.sched.get_num_new_matched_tokens(r1, 0)
    g0, g1 = [1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]
    e.sched.update_state_after_alloc(r1, KVCacheBlocks(g0, g1), 0)
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("h1", (g0, g1))], num_scheduled_tokens={"h1": 26})
    meta = e.step(out, lambda eng: ([eng.write(0, b, b"a%d" % b) for b in g0], [eng.write(1, b, b"b%d" % b) for b in g1]))
    assert [j.group for j in meta.plan.stores["h1"]] == [0, 1]
    assert e.worker._worker.pending() == 0  # sliding window: stores drained within the step

    r2 = Request("h2", toks + [9])
    assert e.sched.get_num_new_matched_tokens(r2, 0) == (24, True)
    assert client.invalidate([e.worker._worker.namespace_id], [r1.block_hashes[3]], group=1) == 1
    e.sched.update_state_after_alloc(r2, KVCacheBlocks([21, 22, 23, 24, 25, 26, 27], [31, 32, 33, 34]), 24)
    e.step()
    assert e.until(lambda: "h2" in e.recv)
    assert e.failed == {"h2"} and e.invalid == set()
    e.close()


def test_connector_class_with_older_vllm_api(vllm_mod, daemon, shm, fingerprint, client):
    mod, fake = vllm_mod(with_transfer_results=False)
    assert not hasattr(mod.KVOffloadConnector, "get_transfer_results")
    e = Engine1(mod, fake, daemon, shm, fingerprint.decode(), [(["l.0"], FullAttentionSpec(4))])
    r1 = Request("o1", list(range(3000, 3013)))
    e.sched.get_num_new_matched_tokens(r1, 0)
    e.sched.update_state_after_alloc(r1, KVCacheBlocks([1, 2, 3, 4]), 0)
    e.step(SchedulerOutput(scheduled_new_reqs=[NewRequestData("o1", ([1, 2, 3, 4],))], num_scheduled_tokens={"o1": 13}))
    assert e.until(lambda: e.worker._worker.pending() == 0)
    r2 = Request("o2", list(range(3000, 3013)))
    assert e.sched.get_num_new_matched_tokens(r2, 0) == (12, True)
    client.invalidate([e.worker._worker.namespace_id], [r1.block_hashes[2]])
    e.sched.update_state_after_alloc(r2, KVCacheBlocks([5, 6, 7, 8]), 12)
    e.step()
    assert e.until(lambda: "o2" in e.recv)
    assert e.invalid == {7}
    e.close()


def test_settings_and_fingerprints(daemon):
    cfg = vllm_config("/x.sock", "org/m", tp=2)
    groups = kv_cache_config([(["a"], FullAttentionSpec(16))])
    s = settings_from_vllm(cfg, groups, env={"PYTHONHASHSEED": "0"})
    assert s.socket == "/x.sock" and s.hash_bytes == 32 and s.group_block_sizes == (16,)
    fps = s.all_fingerprints()
    assert len(fps) == 2 and len(set(fps)) == 2 and fps[1] == s.fingerprint(1, 0)
    # Every identity field changes the fingerprint.
    other = settings_from_vllm(cfg, groups, env={"PYTHONHASHSEED": "1"})
    assert other.fingerprint(0, 0) != s.fingerprint(0, 0)
    cfg2 = vllm_config("/x.sock", "org/m", tp=2, algo="xxhash")
    s2 = settings_from_vllm(cfg2, groups, env={"PYTHONHASHSEED": "0"})
    assert s2.hash_bytes == 16 == hash_bytes_for("xxhash_cbor") and s2.fingerprint(0, 0) != s.fingerprint(0, 0)
    assert not s.sync_stores
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config"):
        settings_from_vllm(vllm_config("/x", "m", extra={"sokcet": 1}), groups)
    with pytest.raises(ValueError, match="not supported"):
        settings_from_vllm(cfg, kv_cache_config([(["m"], MambaSpec())]))


def test_worker_fingerprint_matches_the_schedulers_entry_for_its_rank(vllm_mod, daemon, shm, fingerprint):
    mod, fake = vllm_mod(tp_rank=1)
    cfg = vllm_config(daemon.socket, fingerprint.decode(), tp=2)
    kcc = kv_cache_config([(["l.0"], FullAttentionSpec(4))])
    sched = mod.KVOffloadConnector(cfg, fake.Role.SCHEDULER, kcc)
    worker = mod.KVOffloadConnector(cfg, fake.Role.WORKER, kcc)
    assert worker._worker.fingerprint == sched._scheduler.fingerprints[1] != sched._scheduler.fingerprints[0]
    # Only rank 1 registered: nothing is offered until rank 0 registers too.
    eng = Engine(shm, {0: ["l.0"]}, [4], NB)
    worker.register_kv_caches(eng.kv_caches)
    assert sched._scheduler.namespace_ids() is None
    worker.shutdown()
    sched.shutdown()
