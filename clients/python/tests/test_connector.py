"""The connector's logic (kvoffload.connector) against the real daemon,
driven step by step the way vLLM drives it, with stand-ins that carry vLLM's
field names (helpers.py)."""

from __future__ import annotations

import pickle
import threading
from types import SimpleNamespace

import pytest
from helpers import (
    CachedRequestData,
    Engine,
    KVCacheBlocks,
    NewRequestData,
    Request,
    SchedulerOutput,
    wait_for,
)

from kvoffload.connector import GroupJob, KeyMapper, SchedulerSide, StepPlan, WorkerSide, namespace_fingerprint
from kvoffload.regions import regions_from_kv_caches

NB = 40


class Harness:
    """A scheduler side and ``tp`` worker sides, each worker with its own
    engine memory, its own connection and its own namespace. Lookups wait
    for their answer (``lookup_wait_s``) so each ask is answered at once;
    they go to the daemon (``mirror``: from its events, test_lookup_steps.py),
    so an Invalidate a test makes counts from the moment it returns."""

    def __init__(self, daemon, shm, fp: bytes, *, block_sizes=(4,), layers=None, tp=1, request_level=False,
                 hash_block_size=4, lease_ms=0, mirror=False):
        layers = layers or {0: ["layers.0.attn", "layers.1.attn"]}
        self.fps = [fp + b"/tp%d" % r for r in range(tp)]
        self.daemon = daemon
        self.sched = SchedulerSide(daemon.socket, tp, hash_block_size, block_sizes, 32, lookup_wait_s=5.0,
                                   namespace_retry_s=0, lease_ms=lease_ms, lookup_mirror=mirror)
        self.sched.set_worker_fingerprints({(r,): f for r, f in enumerate(self.fps)})
        self.engines = [Engine(shm, layers, block_sizes, NB) for _ in range(tp)]
        self.workers = [WorkerSide(daemon.socket, f, len(block_sizes), rank=(r,), request_level_failures=request_level)
                        for r, f in enumerate(self.fps)]
        for w, e in zip(self.workers, self.engines):
            w.register(regions_from_kv_caches(e.kv_caches, e.layer_groups(), NB, 32))
        self.sent: list[set[str]] = [set() for _ in range(tp)]
        self.recv: list[set[str]] = [set() for _ in range(tp)]
        self.failed: list[set[int]] = [set() for _ in range(tp)]
        self.failed_reqs: list[set[str]] = [set() for _ in range(tp)]

    def ask(self, req, num_computed=0):
        """get_num_new_matched_tokens until it answers (vLLM asks every step)."""
        return wait_for(lambda: (lambda r: r if r[0] is not None else None)(
            self.sched.get_num_new_matched_tokens(req, num_computed)))

    def step(self, out: SchedulerOutput | None = None, forward=None) -> StepPlan:
        """One engine step: build the plan in the scheduler, ship it (pickled,
        as vLLM does) to every worker, run the worker calls in vLLM's order."""
        out = out or SchedulerOutput()
        plan = self.sched.build_connector_meta(out)
        shipped = pickle.loads(pickle.dumps(plan))
        drained: dict = {}
        for i, (w, e) in enumerate(zip(self.workers, self.engines)):
            w.handle_preemptions(shipped.preempted)
            w.start_load_kv(shipped)
            if forward:
                forward(e)
            w.wait_for_save(shipped)
            s, r = w.get_finished(out.finished_req_ids)
            self.sent[i] |= s or set()
            self.recv[i] |= r or set()
            self.failed[i] |= w.get_block_ids_with_load_errors()
            self.failed_reqs[i] |= w.take_failed_requests()
            for rid, by_rank in w.drained_stores().items():  # vLLM's worker metadata
                drained.setdefault(rid, {}).update(by_rank)
        self.sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=SimpleNamespace(drained=drained)))
        return plan

    def run_until(self, pred, timeout=60.0):
        return wait_for(lambda: (self.step(), pred())[1], timeout=timeout)

    def idle(self):
        return all(w.pending() == 0 for w in self.workers)

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.sched.close()


@pytest.fixture
def harness(daemon, shm, fingerprint):
    made = []

    def make(**kw):
        h = Harness(daemon, shm, fingerprint, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def prefill(h: Harness, req: Request, blocks: list[int], tag=b""):
    """Schedules a new request with no external tokens for its whole prompt
    and runs the step: the forward pass writes every block it computes."""
    assert h.ask(req) == (0, False)
    h.sched.update_state_after_alloc(req, KVCacheBlocks(blocks), 0)
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData(req.request_id, (list(blocks),))],
                          num_scheduled_tokens={req.request_id: req.num_tokens})

    def forward(e):
        for i, b in enumerate(blocks[: len(req.block_hashes)]):
            e.write(0, b, req.block_hashes[i] + tag)

    plan = h.step(out, forward)
    req.num_computed_tokens = req.num_tokens  # vLLM's _update_after_schedule
    return plan


def leased(loads):
    """The loads with their lease ids zeroed, to compare with expected jobs
    (test_loads_name_the_lease_their_lookup_took checks the leases)."""
    return {rid: [GroupJob(j.group, j.hashes, j.block_ids) for j in jobs] for rid, jobs in loads.items()}


def test_key_mapper_units_and_group_keys():
    m = KeyMapper(4, (4, 8))
    assert m.unit_tokens == 8 and m.blocks_per_unit == (2, 1) and m.factors == (1, 2)
    hs = [bytes([i]) * 32 for i in range(6)]
    assert m.units_in(6) == 3 and m.units_in(6, num_tokens=19) == 2
    assert m.keys(hs, 0, m.block_range(0, 1, 3)) == hs[2:6]
    assert m.keys(hs, 1, m.block_range(1, 1, 3)) == [hs[3], hs[5]]  # the hash that ends each 8-token block
    with pytest.raises(ValueError):
        KeyMapper(4, (6,))


def test_fingerprint_covers_every_identity_field():
    base = {"model": "m", "dtype": "float16", "hash_algo": "sha256", "hash_seed": "0", "tp_rank": 0}
    fp = namespace_fingerprint(base)
    assert fp == namespace_fingerprint(dict(reversed(list(base.items()))))
    assert 1 <= len(fp) <= 256 and fp.startswith(b"kvoffload.vllm/2:")
    for k, v in [("model", "n"), ("dtype", "bfloat16"), ("hash_algo", "xxhash"), ("hash_seed", "1"), ("tp_rank", 1)]:
        assert namespace_fingerprint({**base, k: v}) != fp


def test_store_then_hit_then_load_back_bytes(harness):
    h = harness()
    tokens = list(range(22))
    r1 = Request("r1", tokens)  # 5 full blocks of 4 tokens
    plan = prefill(h, r1, [1, 2, 3, 4, 5, 6])
    assert plan.stores == {"r1": [GroupJob(0, r1.block_hashes[:5], [1, 2, 3, 4, 5])]}
    assert leased(plan.loads) == {}
    assert h.run_until(h.idle)
    h.step()  # the workers' acknowledgements reach the scheduler

    # r1 ends with every store drained and acknowledged: vLLM frees its
    # blocks at once (nothing in flight reads them).
    assert h.sched.request_finished(r1) == (False, None)
    plan = h.step(SchedulerOutput(finished_req_ids={"r1"}))
    assert plan.delay_free == set()

    # r2 shares r1's first 20 tokens: 5 blocks are offered, loaded async.
    r2 = Request("r2", tokens[:20] + [99] * 9)
    assert r2.block_hashes[:5] == r1.block_hashes[:5]
    assert h.ask(r2, 0) == (20, True)
    assert h.ask(r2, 0) == (20, True)  # side-effect free
    h.sched.update_state_after_alloc(r2, KVCacheBlocks([10, 11, 12, 13, 14, 15, 16, 17]), 20)
    plan = h.step()  # r2 waits for its KV: not scheduled this step
    assert leased(plan.loads) == {"r2": [GroupJob(0, r2.block_hashes[:5], [10, 11, 12, 13, 14])]}
    assert h.run_until(lambda: "r2" in h.recv[0])
    assert h.failed[0] == set()
    e = h.engines[0]
    for src, dst in zip([1, 2, 3, 4, 5], [10, 11, 12, 13, 14]):
        assert e.read(0, dst) == e.read(0, src)

    # Once loaded, r2 runs; its stores start after the loaded prefix.
    r2.num_computed_tokens = 20
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("r2", ([10, 11, 12, 13, 14, 15, 16, 17],), 20)],
                          num_scheduled_tokens={"r2": 9})
    plan = h.step(out, lambda e: [e.write(0, b, b"x") for b in (15, 16)])
    assert plan.stores == {"r2": [GroupJob(0, r2.block_hashes[5:7], [15, 16])]}


def test_loads_name_the_lease_their_lookup_took():
    """With ``lease_ms`` the lookup takes a lease and each load of the
    request names it, so a daemon that honours it keeps what it offered (the
    daemon on main honours a lease only over the connection that took it:
    docs/vllm.md, Limits)."""
    from fake_daemon import FakeDaemon

    from kvoffload.regions import KVRegistration
    from kvoffload.types import Layout, Segment

    fake = FakeDaemon()
    fake.hit = True
    sched = SchedulerSide(fake.socket, 1, 4, (4,), 32, lookup_wait_s=5.0, lease_ms=10_000)
    sched.set_worker_fingerprints({(0,): b"fp"})
    w = WorkerSide(fake.socket, b"fp", 1)
    try:
        assert wait_for(lambda: sched.namespace_ids())
        r = Request("l1", list(range(50, 63)))
        assert wait_for(lambda: (lambda x: x if x[0] is not None else None)(sched.get_num_new_matched_tokens(r, 0))) \
            == (12, True)
        sched.update_state_after_alloc(r, KVCacheBlocks([5, 6, 7, 8]), 12)
        plan = sched.build_connector_meta(SchedulerOutput())
        assert [j.lease_id for j in plan.loads["l1"]] == [1001]
        w.register(KVRegistration(Layout(32, [Segment(0, 64)]), [], [], NB, "cpu"))
        w.start_load_kv(plan)
        assert wait_for(lambda: fake.calls)
        (_, req), = fake.calls
        assert [j.lease_id for j in req.jobs] == [1001]
        # Without lease_ms (the default), nothing is leased.
        sched2 = SchedulerSide(fake.socket, 1, 4, (4,), 32, lookup_wait_s=5.0)
        sched2.set_worker_fingerprints({(0,): b"fp"})
        assert wait_for(lambda: sched2.namespace_ids())
        r2 = Request("l2", list(range(50, 63)))
        before = fake.leases
        assert wait_for(lambda: (lambda x: x if x[0] is not None else None)(sched2.get_num_new_matched_tokens(r2, 0))) \
            == (12, True)
        assert fake.leases == before
        sched2.close()
    finally:
        w.shutdown()
        sched.close()
        fake.stop()


def test_failed_load_reports_exactly_the_failed_engine_blocks(harness, client):
    h = harness()
    r1 = Request("a", list(range(100, 126)))  # 6 full blocks
    prefill(h, r1, [1, 2, 3, 4, 5, 6, 7])
    assert h.run_until(h.idle)

    r2 = Request("b", list(range(100, 126)) + [7])
    assert h.ask(r2, 0) == (24, True)
    # Between the lookup and the load, two blocks of the prefix are evicted.
    ns = h.workers[0].namespace_id
    assert client.invalidate([ns], [r1.block_hashes[1], r1.block_hashes[4]]) == 2
    dst = [21, 22, 23, 24, 25, 26, 27]
    h.sched.update_state_after_alloc(r2, KVCacheBlocks(dst), 24)
    h.step()
    assert h.run_until(lambda: "b" in h.recv[0])
    assert h.failed[0] == {22, 25}  # exactly the engine blocks of the evicted keys
    e = h.engines[0]
    for i in (0, 2, 3, 5):
        assert e.read(0, dst[i]) == e.read(0, i + 1)
    # Request-level reporting is off for one KV cache group.
    assert h.failed_reqs[0] == set()


def test_full_prompt_hit_leaves_the_last_token_and_local_prefix_is_skipped(harness):
    h = harness()
    toks = list(range(300, 320))  # exactly 5 blocks
    prefill(h, Request("p", toks), [1, 2, 3, 4, 5])
    assert h.run_until(h.idle)
    # All 20 tokens are cached, but vLLM must compute at least one: 16 offered.
    assert h.ask(Request("q", toks), 0) == (16, True)
    # 8 tokens already in vLLM's own prefix cache: only blocks 2..3 come from us.
    q = Request("q2", toks + [1, 2, 3])
    assert h.ask(q, 8) == (12, True)
    h.sched.update_state_after_alloc(q, KVCacheBlocks([31, 32, 33, 34, 35, 36]), 12)
    plan = h.step()
    assert leased(plan.loads) == {"q2": [GroupJob(0, q.block_hashes[2:5], [33, 34, 35])]}
    assert h.run_until(lambda: "q2" in h.recv[0])
    assert h.failed[0] == set()
    # An unaligned local prefix, and a miss, offer nothing.
    assert h.ask(q, 6) == (0, False)
    assert h.ask(Request("z", list(range(40))), 0) == (0, False)


def test_chunked_prefill_decode_and_preemption(harness):
    h = harness()
    toks = list(range(500, 530))
    r = Request("c", toks[:30])
    h.ask(r, 0)
    h.sched.update_state_after_alloc(r, KVCacheBlocks([1, 2, 3]), 0)
    # Chunk 1: 10 tokens -> 2 full blocks.
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("c", ([1, 2, 3],))], num_scheduled_tokens={"c": 10})
    plan = h.step(out, lambda e: [e.write(0, b, b"c") for b in (1, 2)])
    assert plan.stores == {"c": [GroupJob(0, r.block_hashes[:2], [1, 2])]}
    r.num_computed_tokens = 10
    # Chunk 2: 12 more tokens in two new blocks -> blocks 2..4 are full.
    out = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["c"], set(), [([4, 5],)], [10]),
                          num_scheduled_tokens={"c": 12})
    plan = h.step(out, lambda e: [e.write(0, b, b"c") for b in (3, 4, 5)])
    assert plan.stores == {"c": [GroupJob(0, r.block_hashes[2:5], [3, 4, 5])]}
    r.num_computed_tokens = 22
    # Preempted: its stores drain before vLLM reuses its blocks.
    plan = h.step(SchedulerOutput(preempted_req_ids={"c"}))
    assert plan.preempted == {"c"} and h.workers[0]._pending_stores.get("c") is None
    # Resumed with new blocks: they replace the old ones; stores go on to
    # block 7, from the first block whose store was not reported drained
    # before the preemption (the worker may have dropped it; storing a block
    # the daemon holds is a no-op), at the latest from block 5 (the first 5
    # are cached: their KV is in the new blocks).
    r.num_computed_tokens = 20
    new_ids = [9, 8, 7, 6, 11, 12, 13, 14]
    out = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["c"], {"c"}, [(new_ids,)], [20]),
                          num_scheduled_tokens={"c": 10})
    plan = h.step(out)
    (job,) = plan.stores["c"]
    first = 7 - len(job.block_ids)
    assert first <= 5 and job == GroupJob(0, r.block_hashes[first:7], new_ids[first:7])


def test_every_rank_must_hold_a_block(harness):
    h = harness(tp=2)
    toks = list(range(700, 713))
    r = Request("t", toks)
    assert h.ask(r, 0) == (0, False)
    h.sched.update_state_after_alloc(r, KVCacheBlocks([1, 2, 3, 4]), 0)
    # Only rank 0 stores (rank 1's store is skipped): nothing is offered.
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("t", ([1, 2, 3, 4],))], num_scheduled_tokens={"t": 13})
    plan = h.sched.build_connector_meta(out)
    h.workers[0].wait_for_save(plan)
    assert wait_for(lambda: (h.workers[0].get_finished(set()), h.workers[0].pending() == 0)[1])
    assert h.ask(Request("u", toks), 0) == (0, False)
    # Rank 1 stores too: now the prefix counts.
    h.workers[1].wait_for_save(plan)
    assert wait_for(lambda: (h.workers[1].get_finished(set()), h.workers[1].pending() == 0)[1])
    assert h.ask(Request("u2", toks), 0) == (12, True)


def test_hybrid_groups_carry_the_group_in_every_key(harness, client):
    # Group 0: 4-token blocks; group 1: 8-token blocks (a unit is 8 tokens).
    h = harness(block_sizes=(4, 8), layers={0: ["full.0", "full.1"], 1: ["swa.0"]}, request_level=True)
    toks = list(range(900, 926))  # 6 hashes -> 3 units of 8 tokens
    r = Request("h", toks)
    assert h.ask(r, 0) == (0, False)
    g0, g1 = [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14]
    h.sched.update_state_after_alloc(r, KVCacheBlocks(g0, g1), 0)
    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("h", (g0, g1))], num_scheduled_tokens={"h": 26})

    def forward(e):
        for i in range(6):
            e.write(0, g0[i], b"g0" + r.block_hashes[i])
        for i in range(3):
            e.write(1, g1[i], b"g1" + r.block_hashes[2 * i + 1])

    plan = h.step(out, forward)
    hs = r.block_hashes
    assert plan.stores == {"h": [GroupJob(0, hs[:6], g0[:6]), GroupJob(1, [hs[1], hs[3], hs[5]], g1[:3])]}
    assert h.run_until(h.idle)
    ns = h.workers[0].namespace_id
    # The same hash is a different key in each group.
    assert client.lookup([ns], [hs[1]], group=0).ready == 1
    assert client.lookup([ns], [hs[0]], group=1).ready == 0

    r2 = Request("h2", toks + [5])
    assert h.ask(r2, 0) == (24, True)
    d0, d1 = [21, 22, 23, 24, 25, 26, 27], [31, 32, 33, 34]
    h.sched.update_state_after_alloc(r2, KVCacheBlocks(d0, d1), 24)
    h.step()
    assert h.run_until(lambda: "h2" in h.recv[0])
    e = h.engines[0]
    assert [e.read(0, b) for b in d0[:6]] == [e.read(0, b) for b in g0[:6]]
    assert [e.read(1, b) for b in d1[:3]] == [e.read(1, b) for b in g1[:3]]
    assert h.failed_reqs[0] == set()

    # A failure in group 1 fails the request as a whole (newer vLLM wants
    # request-level failures when there are several groups).
    client.invalidate([ns], [hs[3]], group=1)
    r3 = Request("h3", toks + [6])
    assert h.ask(r3, 0) == (8, True)  # only the first unit is whole
    client.invalidate([ns], [hs[0]], group=0)
    h.sched.update_state_after_alloc(r3, KVCacheBlocks(d0, d1), 8)
    h.step()
    assert h.run_until(lambda: "h3" in h.recv[0])
    assert h.failed_reqs[0] == {"h3"} and h.failed[0] == set()


def test_null_blocks_are_skipped(harness):
    h = harness()
    toks = list(range(40, 60))
    prefill(h, Request("n0", toks), [1, 2, 3, 4, 5])
    assert h.run_until(h.idle)
    r = Request("n1", toks + [1])
    assert h.ask(r, 0) == (20, True)
    # Block 0 is vLLM's null block (e.g. out of a sliding window): not loaded.
    h.sched.update_state_after_alloc(r, KVCacheBlocks([0, 0, 8, 9, 10, 11]), 20)
    plan = h.step()
    assert leased(plan.loads) == {"n1": [GroupJob(0, r.block_hashes[2:5], [8, 9, 10])]}


def test_daemon_gone(fresh_daemon, shm, fingerprint):
    d = fresh_daemon()
    h = Harness(d, shm, fingerprint)
    toks = list(range(60, 81))
    prefill(h, Request("g0", toks), [1, 2, 3, 4, 5, 6])
    assert h.run_until(h.idle)
    r = Request("g1", toks)
    assert h.ask(r, 0) == (20, True)
    h.sched.update_state_after_alloc(r, KVCacheBlocks([11, 12, 13, 14, 15, 16]), 20)
    # The daemon stops before the load goes out: once its process is gone
    # the load is reported failed, never before.
    d.proc.terminate()
    assert d.proc.wait(timeout=20) == 0
    assert h.run_until(lambda: "g1" in h.recv[0])
    assert h.failed[0] == {11, 12, 13, 14, 15}
    # The scheduler answers "nothing" instead of raising.
    assert h.ask(Request("g2", toks), 0) == (0, False)
    h.close()


def test_request_finished_while_its_load_runs(harness):
    h = harness()
    toks = list(range(80, 101))
    prefill(h, Request("w0", toks), [1, 2, 3, 4, 5, 6])
    assert h.run_until(h.idle)
    r0 = Request("w0", toks)
    h.sched._state(r0).store_seq = h.sched._seq + 1  # a store planned that no worker acknowledged yet
    assert h.sched.request_finished(r0) == (True, None)
    r = Request("w1", toks)
    assert h.ask(r, 0) == (20, True)
    h.sched.update_state_after_alloc(r, KVCacheBlocks([11, 12, 13, 14, 15, 16]), 20)
    # Aborted while waiting for its KV: vLLM itself keeps the blocks until the
    # receive is reported, so the connector does not ask to delay them, and
    # the load still goes out and is reported.
    assert h.sched.request_finished(r) == (False, None)
    plan = h.step(SchedulerOutput(finished_req_ids={"w0", "w1"}))
    assert "w1" in plan.loads and plan.delay_free == {"w0"}
    assert h.run_until(lambda: "w1" in h.recv[0] and "w0" in h.sent[0])
    assert "w1" not in h.sent[0]


def test_iter_scheduled_reads_old_and_new_field_names():
    from types import SimpleNamespace as ns

    from kvoffload.connector import iter_scheduled

    new = SchedulerOutput(scheduled_new_reqs=[NewRequestData("a", ([1],))],
                          scheduled_cached_reqs=CachedRequestData(["b", "c"], {"c"}, [([2],), None], [0, 0]))
    assert list(iter_scheduled(new)) == [("a", ([1],), True), ("b", ([2],), False), ("c", None, True)]
    old = ns(scheduled_new_reqs=[], scheduled_cached_reqs=ns(req_ids=["b"], new_block_ids=[([3],)],
                                                            resumed_from_preemption=[True]))
    assert list(iter_scheduled(old)) == [("b", ([3],), True)]


def test_long_request_ids_are_cut_for_the_wire(harness):
    # vLLM request ids are the client's; the daemon bounds the echo it keeps.
    h = harness()
    rid = "x" * 3000
    toks = list(range(1200, 1213))
    prefill(h, Request(rid, toks), [1, 2, 3, 4])
    assert h.run_until(h.idle)
    r = Request(rid + "b", toks)
    assert h.ask(r, 0) == (12, True)
    h.sched.update_state_after_alloc(r, KVCacheBlocks([5, 6, 7, 8]), 12)
    h.step()
    assert h.run_until(lambda: r.request_id in h.recv[0])
    assert h.failed[0] == set()


def test_wire_request_ids_are_bounded_distinct_and_utf8():
    from kvoffload.worker_side import MAX_REQUEST_ID_BYTES, _wire_request_id

    assert _wire_request_id("short") == "short"
    a, b = "é" * 400 + "a", "é" * 400 + "b"  # 801 bytes each, a shared head, a 2-byte character at the cut
    wa, wb = _wire_request_id(a), _wire_request_id(b)
    assert wa != wb
    for w in (wa, wb):
        assert len(w.encode()) <= MAX_REQUEST_ID_BYTES
        assert w.encode().decode() == w


def test_a_daemon_restarted_while_nothing_ran_is_registered_with_again(fresh_daemon, shm, fingerprint):
    """The daemon restarts while the worker has nothing in flight: the first
    call after it is NOT_FOUND from another process. The worker registers
    with the new daemon (once the old process is gone) and offloads again."""
    d = fresh_daemon()
    h = Harness(d, shm, fingerprint)
    try:
        toks = list(range(300, 321))
        prefill(h, Request("x0", toks), [1, 2, 3, 4, 5, 6])
        assert h.run_until(h.idle)
        old = h.workers[0].registration_id
        d.restart()
        # The worker's connection is up again, to the new process: the first
        # stores after the restart meet NOT_FOUND, not a broken connection.
        assert wait_for(lambda: h.workers[0]._client.healthy(timeout=1.0))
        for i in range(3):
            prefill(h, Request(f"y{i}", list(range(400 + 30 * i, 421 + 30 * i))), [7, 8, 9, 10, 11, 12])
        assert h.run_until(lambda: h.workers[0].registered() and h.workers[0].registration_id is not None
                           and h.workers[0]._regs[h.workers[0].registration_id].daemon.pid == d.proc.pid)
        assert old is not None
        prefill(h, Request("z", list(range(700, 721))), [13, 14, 15, 16, 17, 18])
        assert h.run_until(h.idle)
        assert h.ask(Request("z2", list(range(700, 721))), 0) == (20, True)
    finally:
        h.close()


def test_a_store_planned_in_the_step_its_block_is_given_out_again_leaves_it_out(harness, client):
    # Group 1 stands for a sliding window: vLLM frees its blocks behind the
    # window while the request runs. Request "a" computed its first 8 tokens
    # without a store (its hashes were not publishable yet); in the step its
    # stores are planned, vLLM has freed a's group-1 block 5 and gives it to
    # request "c", whose forward writes it in that very step. The store of
    # that position must leave it out (vLLM's _update_req_states), and
    # nothing needs a fence: no store of block 5 was in flight.
    h = harness(block_sizes=(4, 4), layers={0: ["full.0"], 1: ["swa.0"]}, request_level=True)
    a = Request("a", list(range(1200, 1216)))
    a.num_publishable_block_hashes = 0
    assert h.ask(a, 0) == (0, False)
    g0, g1 = [1, 2, 3, 4], [5, 6, 7, 8]
    h.sched.update_state_after_alloc(a, KVCacheBlocks(g0, g1), 0)

    def forward_a(upto):
        def fw(e):
            for i in range(upto):
                e.write(0, g0[i], b"a0" + a.block_hashes[i])
                e.write(1, g1[i], b"a1" + a.block_hashes[i])
        return fw

    plan = h.step(SchedulerOutput(scheduled_new_reqs=[NewRequestData("a", (g0, g1))], num_scheduled_tokens={"a": 8}),
                  forward_a(2))
    assert plan.stores == {} and getattr(plan, "fence", []) == []
    a.num_computed_tokens = 8
    a.num_publishable_block_hashes = 3
    c = Request("c", list(range(1300, 1304)) + [1])
    assert h.ask(c, 0) == (0, False)
    h.sched.update_state_after_alloc(c, KVCacheBlocks([9], [5]), 0)

    def forward(e):
        forward_a(3)(e)
        e.write(0, 9, b"c0" + c.block_hashes[0])
        e.write(1, 5, b"c1" + c.block_hashes[0])  # block 5 is c's now

    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData("c", ([9], [5]))],
                          scheduled_cached_reqs=CachedRequestData(["a"], set(), [([], [])], [8]),
                          num_scheduled_tokens={"c": 5, "a": 4})
    plan = h.step(out, forward)
    hs = a.block_hashes
    assert plan.stores["a"] == [GroupJob(0, hs[:3], [1, 2, 3]), GroupJob(1, hs[1:3], [6, 7])]
    assert plan.fence == []
    assert h.run_until(h.idle)
    ns = h.workers[0].namespace_id
    assert client.lookup([ns], hs[:1], group=1).ready == 0  # never stored with c's bytes under a's key
    assert client.lookup([ns], hs[1:3], group=1).ready == 2


def _prefill_with_the_daemon_stopped(h, d, toks: list[int]) -> None:
    """Stops the daemon, then prefills request f0 (engine blocks 1-5):
    returns once each rank's Store of it is with the stopped daemon."""
    d.pause()
    prefill(h, Request("f0", toks), [1, 2, 3, 4, 5])
    assert wait_for(lambda: all(not w._queue for w in h.workers))


def test_a_fence_waits_for_each_ranks_own_stores_and_nothing_else(fresh_daemon, shm, fingerprint):
    # Two ranks, each with its own jobs. The daemon is stopped while both
    # ranks' stores of request f0 run; vLLM preempts f0 (and frees its
    # blocks). That step writes only fresh blocks and runs on; the step that
    # gives f0's block 3 to f2 names it in its fence, and each rank waits
    # for its own store of it until the daemon runs again.
    d = fresh_daemon()
    h = Harness(d, shm, fingerprint, tp=2)
    try:
        toks = list(range(1400, 1417))
        _prefill_with_the_daemon_stopped(h, d, toks)

        def step_in_thread(out):
            res = {}
            t = threading.Thread(target=lambda: res.setdefault("plan", h.step(out)))
            t.start()
            return t, res

        r = Request("f1", list(range(1500, 1505)))
        h.sched._state(r)
        t, res = step_in_thread(SchedulerOutput(scheduled_new_reqs=[NewRequestData("f1", ([10, 11],))],
                                                num_scheduled_tokens={"f1": 5}, preempted_req_ids={"f0"}))
        t.join(30)
        assert not t.is_alive(), "a step that reuses no block waited on the stopped daemon"
        assert res["plan"].fence == [] and all(w.fence_waits == 0 for w in h.workers)
        f2 = Request("f2", list(range(1600, 1605)))
        h.sched._state(f2)
        t, res = step_in_thread(SchedulerOutput(scheduled_new_reqs=[NewRequestData("f2", ([3, 12],))],
                                                num_scheduled_tokens={"f2": 5}))
        assert wait_for(lambda: h.workers[0]._waiters > 0)  # rank 0 waits for its store of block 3
        assert t.is_alive()
        d.resume()
        t.join(30)
        assert not t.is_alive()
        assert res["plan"].fence == [3]
        # Rank 0 waited; rank 1 (run after it, as the harness runs ranks in
        # turn) found its own store of block 3 drained by then, or waited.
        assert h.workers[0].fence_waits == 1 and h.workers[1].fence_waits <= 1
        assert all(w._fenced_seq == res["plan"].seq for w in h.workers)
    finally:
        d.resume()
        h.close()


def _hybrid_prefill(h, rid, toks, g0, g1):
    r = Request(rid, toks)
    assert h.ask(r, 0) == (0, False)
    h.sched.update_state_after_alloc(r, KVCacheBlocks(g0, g1), 0)

    def forward(e):
        for i in range(len(r.block_hashes)):
            e.write(0, g0[i], b"g0" + r.block_hashes[i])
        for i in range(len(r.block_hashes) // 2):
            e.write(1, g1[i], b"g1" + r.block_hashes[2 * i + 1])

    out = SchedulerOutput(scheduled_new_reqs=[NewRequestData(rid, (g0, g1))], num_scheduled_tokens={rid: r.num_tokens})
    h.step(out, forward)
    assert h.run_until(h.idle)
    return r


def test_a_failed_block_of_any_group_fails_its_request_and_is_never_offered_to_it_again(harness, client):
    # Group 0: 4-token blocks; group 1 (a sliding window, say): 8-token
    # blocks. A block of group 1 is lost between the lookup and the load:
    # the request fails as a whole (request-level, as vLLM with
    # KVConnectorTransferResults wants; no engine block ids, which vLLM could
    # not map to a group), the load was asynchronous, and when vLLM preempts
    # and re-admits the request it is asked again and offered nothing.
    h = harness(block_sizes=(4, 8), layers={0: ["full.0", "full.1"], 1: ["swa.0"]}, request_level=True)
    toks = list(range(1700, 1726))  # 6 hashes -> 3 units of 8 tokens
    a = _hybrid_prefill(h, "a", toks, [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14])
    ns = h.workers[0].namespace_id
    hs = a.block_hashes
    r = Request("r", toks + [9])
    assert h.ask(r, 0) == (24, True)  # asynchronous
    client.invalidate([ns], [hs[3]], group=1)  # the window's block of unit 1, lost before the load
    h.sched.update_state_after_alloc(r, KVCacheBlocks([21, 22, 23, 24, 25, 26, 27], [31, 32, 33, 34]), 24)
    h.step()
    assert h.run_until(lambda: "r" in h.recv[0])
    assert h.failed_reqs[0] == {"r"} and h.failed[0] == set()
    # vLLM reads failed_recving and recomputes r from its local prefix.
    h.sched.update_connector_output(SimpleNamespace(failed_recving={"r"}, invalid_block_ids=set()))
    # Preempted, re-admitted: asked again, never offered a hit again.
    h.step(SchedulerOutput(preempted_req_ids={"r"}))
    assert h.sched.get_num_new_matched_tokens(r, 0) == (0, False)
    # Another request with the same prompt is offered what is intact: unit 0.
    assert h.ask(Request("s", toks + [9]), 0) == (8, True)


def test_a_preempted_request_is_asked_again_and_offered_only_what_is_still_intact(harness, client):
    # A request offered 24 tokens whose load succeeded runs, is preempted
    # (vLLM recomputes it from token 0), and a block of group 1 is lost
    # meanwhile: re-admitted, it is looked up again (not answered from its
    # first lookup) and offered only the prefix still whole in every group.
    h = harness(block_sizes=(4, 8), layers={0: ["full.0", "full.1"], 1: ["swa.0"]}, request_level=True)
    toks = list(range(1800, 1826))
    a = _hybrid_prefill(h, "a", toks, [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14])
    ns = h.workers[0].namespace_id
    hs = a.block_hashes
    r = Request("r", toks + [9])
    assert h.ask(r, 0) == (24, True)
    h.sched.update_state_after_alloc(r, KVCacheBlocks([21, 22, 23, 24, 25, 26, 27], [31, 32, 33, 34]), 24)
    h.step()
    assert h.run_until(lambda: "r" in h.recv[0])
    assert h.failed_reqs[0] == set()
    e = h.engines[0]
    assert [e.read(1, b) for b in [31, 32, 33]] == [e.read(1, b) for b in [11, 12, 13]]
    r.num_computed_tokens = 24
    h.step(SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["r"], set(), [([], [])], [24]),
                           num_scheduled_tokens={"r": 3}))
    client.invalidate([ns], [hs[5]], group=1)  # unit 2's block of group 1
    r.num_computed_tokens = 0
    h.step(SchedulerOutput(preempted_req_ids={"r"}))
    assert h.ask(r, 0) == (16, True)
    h.recv[0].discard("r")
    h.sched.update_state_after_alloc(r, KVCacheBlocks([8, 9, 10, 15, 16, 17, 18], [35, 36, 37, 38]), 16)
    plan = h.step()
    assert [(j.group, j.block_ids) for j in plan.loads["r"]] == [(0, [8, 9, 10, 15]), (1, [35, 36])]
    assert h.run_until(lambda: "r" in h.recv[0])
    assert h.failed_reqs[0] == set()
    assert [e.read(1, b) for b in [35, 36]] == [e.read(1, b) for b in [11, 12]]
    assert [e.read(0, b) for b in [8, 9, 10, 15]] == [e.read(0, b) for b in [1, 2, 3, 4]]


def _step_in_thread(h, out):
    res = {}
    t = threading.Thread(target=lambda: res.setdefault("plan", h.step(out)))
    t.start()
    return t, res


def test_a_fence_outlives_a_cache_reset(fresh_daemon, shm, fingerprint):
    # reset_cache moves the engine to a new identity; stores in flight still
    # read their blocks (they land in the old namespace): a block of theirs
    # that vLLM gives out after the reset is still fenced.
    d = fresh_daemon()
    h = Harness(d, shm, fingerprint)
    try:
        _prefill_with_the_daemon_stopped(h, d, list(range(1900, 1917)))
        h.sched.reset()  # False: the stopped daemon cannot confirm; the new identity holds
        h.workers[0].switch_identity(b"new identity")
        f1 = Request("f1", list(range(2000, 2005)))
        h.sched._state(f1)
        t, res = _step_in_thread(h, SchedulerOutput(scheduled_new_reqs=[NewRequestData("f1", ([3, 12],))],
                                                    num_scheduled_tokens={"f1": 5}, preempted_req_ids={"f0"}))
        assert wait_for(lambda: h.workers[0]._waiters > 0)
        assert t.is_alive()
        d.resume()
        t.join(30)
        assert not t.is_alive() and res["plan"].fence == [3] and h.workers[0].fence_waits == 1
    finally:
        d.resume()
        h.close()


def test_a_fence_never_waits_for_stores_of_a_registration_that_is_gone(fresh_daemon, shm, fingerprint):
    # The daemon dies with the stores accepted (stopped, then killed): once
    # its process is gone nothing can copy out of the blocks, the jobs are
    # settled, and the step that reuses a block of them runs on.
    d = fresh_daemon()
    h = Harness(d, shm, fingerprint)
    try:
        _prefill_with_the_daemon_stopped(h, d, list(range(2100, 2117)))
        d.proc.kill()
        d.proc.wait(timeout=20)
        assert wait_for(lambda: h.workers[0].pending() == 0)
        f1 = Request("f1", list(range(2200, 2205)))
        h.sched._state(f1)
        t, res = _step_in_thread(h, SchedulerOutput(scheduled_new_reqs=[NewRequestData("f1", ([3, 12],))],
                                                    num_scheduled_tokens={"f1": 5}, preempted_req_ids={"f0"}))
        t.join(30)
        assert not t.is_alive()
        assert res["plan"].fence == [3] and h.workers[0].fence_waits == 0
    finally:
        h.close()
        d.restart()  # a daemon that stops cleanly at teardown


def test_the_fence_table_stays_bounded_by_the_block_count(harness):
    # Without acknowledgements (a vLLM without worker metadata) a cached
    # prefix block stored by request after request keeps one bounded entry,
    # and the step that reallocates it still fences it.
    h = harness()
    sc = h.sched
    for i in range(50):
        sc._seq += 1
        sc._note_reads(f"q{i}", [GroupJob(0, [b"k" * 32], [7])])
    assert len(sc._store_reads[7]) <= 9 and sum(len(b) for b in sc._reads_by_req.values()) <= 9
    assert sc._fence({7, 8}) == [7]
    assert not sc._store_reads and not sc._reads_by_req


def _never_waits(h: Harness, clock: list, deadline_s: float = 0.2, lease_ms: int = 0) -> SchedulerSide:
    """Replaces the harness's scheduler side with one whose loop never waits
    for a lookup (``lookup_wait_ms: 0``: each is sent with the step's plan)
    and whose clock is ``clock[0]``: the deadline runs on it."""
    h.sched.close()
    h.sched = SchedulerSide(h.daemon.socket, 1, 4, (4,), 32, lookup_wait_s=0, lookup_deadline_s=deadline_s,
                            namespace_retry_s=0, clock=lambda: clock[0], lease_ms=lease_ms, lookup_mirror=False)
    h.sched.set_worker_fingerprints({(0,): h.fps[0]})
    assert wait_for(lambda: h.sched.namespace_ids())
    return h.sched


def test_a_lookup_answers_the_ask_whatever_start_vllm_passes(harness):
    """vLLM's local hit of a waiting request moves between asks (a request
    of the same prefix prefills chunk by chunk, blocks of it are evicted).
    The lookup in flight answers whatever start vLLM passes when it is back
    (the start within what it found): it is not dropped and started again
    (issue 30.6: with lookup_wait_ms 0 such a request was never answered)."""
    h = harness()
    r1 = Request("a", list(range(100, 126)))  # 6 full blocks
    prefill(h, r1, [1, 2, 3, 4, 5, 6, 7])
    assert h.run_until(h.idle)
    clock = [0.0]
    sched = _never_waits(h, clock)
    r2 = Request("b", list(range(100, 126)) + [7])
    answers = []
    for step in range(20):
        # The daemon answers the lookups sent so far; the loop never waits.
        assert wait_for(lambda: sched.pending_lookups() == 0)
        local = 4 * (step % 3 + 1)  # vLLM's local hit: 4, 8, 12, 4, ...
        got = sched.get_num_new_matched_tokens(r2, local)
        h.step()
        clock[0] += 0.005
        if got[0] is not None:
            answers.append((local, got))
            break
    assert answers == [(8, (16, True))], answers  # the second ask, from its own start
    # The hit loads: what it found from unit 0 is loaded from unit 2.
    sched.update_state_after_alloc(r2, KVCacheBlocks([20, 21, 22, 23, 24, 25, 26]), 16)
    plan = h.step()
    assert leased(plan.loads) == {"b": [GroupJob(0, r2.block_hashes[2:6], [22, 23, 24, 25])]}
    assert h.run_until(lambda: "b" in h.recv[0])
    assert h.failed[0] == set()
    for src, dst in zip([3, 4, 5, 6], [22, 23, 24, 25]):
        assert h.engines[0].read(0, dst) == h.engines[0].read(0, src)
    # A local hit that shrank below the lookup's start: the peek found the
    # daemon holds the local prefix too, so the hit runs from there.
    r3 = Request("c", list(range(100, 126)) + [8])
    for _ in range(10):
        got = sched.get_num_new_matched_tokens(r3, 16)
        if got[0] is not None:
            break
        h.step()  # sends it
        assert wait_for(lambda: sched.pending_lookups() == 0)
    assert got == (8, True)
    assert sched.get_num_new_matched_tokens(r3, 4) == (20, True)
    assert (sched.stats.take() or {}).get("lookup_timeouts_total", 0) == 0


def test_every_ask_is_answered_by_the_deadline_of_the_first(harness):
    """A request whose lookups never cover vLLM's next ask (nothing of it is
    in the daemon, and its local hit grows every step) is answered, a miss,
    once ``lookup_deadline_ms`` has passed since its first ask: the clock
    does not start again with each lookup (issue 30.6)."""
    h = harness()
    clock = [0.0]
    sched = _never_waits(h, clock, deadline_s=0.2)
    r = Request("d", list(range(5000, 5101)))  # 25 units, none in the daemon
    answered = None
    for step in range(24):
        assert wait_for(lambda: sched.pending_lookups() == 0)
        got = sched.get_num_new_matched_tokens(r, 4 * step)
        h.step()
        if got[0] is not None:
            answered = (step, clock[0], got)
            break
        clock[0] += 0.01
    assert answered is not None, "never answered"
    step, at, got = answered
    assert got == (0, False) and at <= 0.2 + 1e-9, answered


def test_a_retired_registration_is_not_unregistered_in_the_next_daemon(fresh_daemon, shm, fingerprint):
    """A cache reset retires the worker's registration; when its Unregister
    fails (the daemon is down) it is retried, but only with the daemon that
    held it. A daemon started since holds none of it and numbers its
    registrations from 1 again: the worker's new one there must stay
    (issue 30.7). The worker's clock is the test's: the new registration
    comes before the retry."""
    import signal

    d = fresh_daemon()
    e = Engine(shm, {0: ["layers.0.attn"]}, (4,), NB)
    clock = [0.0]
    w = WorkerSide(d.socket, fingerprint, 1, clock=lambda: clock[0], reregister_after_s=0.1)
    try:
        assert w.register(regions_from_kv_caches(e.kv_caches, e.layer_groups(), NB, 32))
        old = w.registration_id
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(timeout=30)
        w.switch_identity(fingerprint + b"/reset")
        # The poller took up the retired one (its Unregister cannot go) and
        # failed to register the new identity.
        assert wait_for(lambda: old not in w._regs and w._next_rereg > 0)
        d.restarts += 1
        d._start()
        clock[0] = 0.5  # the new registration is due, a retry of the Unregister is not
        assert wait_for(lambda: w.registration_id is not None, timeout=60)
        assert w.registration_id == old  # the new daemon's ids start again
        clock[0] = 5.0  # now it is
        assert wait_for(lambda: not w._retired, timeout=60)
        c = d.client()
        regs = {n.fingerprint: n.registrations for n in c.stats().namespaces}
        assert regs.get(fingerprint + b"/reset") == 1, regs
    finally:
        w.shutdown()


def test_lookups_queued_for_a_slow_daemon_are_bounded(fresh_daemon, shm, fingerprint):
    """A daemon that answers no lookup for a while (stopped here; on the
    scheduler's clock it is not yet too slow) does not grow the queue of
    lookup batches: a few go out, the rest wait for them, and every
    request is answered (a miss) by its deadline all the same. Before, each
    step queued a batch of its own (issue 30.7: 800-1200 seen)."""
    d = fresh_daemon()
    clock = [0.0]
    sched = SchedulerSide(d.socket, 1, 4, (4,), 32, lookup_wait_s=0, lookup_deadline_s=0.2, namespace_retry_s=0,
                          rpc_timeout_s=60, clock=lambda: clock[0], lookup_mirror=False)
    try:
        sched.set_worker_fingerprints({(0,): fingerprint})
        # Nothing registered it: resolve answers 0s; register it through a worker.
        e = Engine(shm, {0: ["layers.0.attn"]}, (4,), NB)
        w = WorkerSide(d.socket, fingerprint, 1)
        assert w.register(regions_from_kv_caches(e.kv_caches, e.layer_groups(), NB, 32))
        assert wait_for(lambda: sched.namespace_ids())
        d.pause()
        answered, waiting = {}, {}
        for step in range(60):
            for i in range(3):  # 3 new requests a step
                rid = f"s{step}-{i}"
                waiting[rid] = Request(rid, list(range(1000 * step + 10 * i, 1000 * step + 10 * i + 13)))
            for rid, r in list(waiting.items()):
                got = sched.get_num_new_matched_tokens(r, 0)
                if got[0] is not None:
                    answered[rid] = got
                    del waiting[rid]
            sched.build_connector_meta(SchedulerOutput())
            assert len(sched._io._queue) <= 4, (step, len(sched._io._queue))
            clock[0] += 0.01
        # Every request asked more than 0.2 s ago has its answer, a miss.
        assert all(got == (0, False) for got in answered.values())
        assert len(answered) >= 3 * 60 - 3 * 21, len(answered)
        d.resume()
        w.shutdown()
    finally:
        d.resume()
        sched.close()
