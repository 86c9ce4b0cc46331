"""The logic of the vLLM connector, free of vLLM and torch.

:mod:`kvoffload.vllm` is a thin shell that reads vLLM's config and forwards
vLLM's calls here. Everything that decides something lives in this module,
so tests drive it with small stand-ins that carry vLLM's field names:

- a *request*: ``request_id``, ``block_hashes`` (chained hashes, bytes, one
  per ``hash_block_size`` tokens), ``num_tokens``, ``num_computed_tokens``
  and, in newer vLLM, ``num_publishable_block_hashes``;
- the *blocks* given to ``update_state_after_alloc`` (KVCacheBlocks):
  ``get_block_ids()`` -> one list of engine block ids per KV cache group,
  and ``blocks`` -> per group, objects with ``block_id`` and ``is_null``;
- a *scheduler output*: ``scheduled_new_reqs`` (``req_id``, ``block_ids``),
  ``scheduled_cached_reqs`` (``req_ids``, ``new_block_ids``,
  ``resumed_req_ids``), ``num_scheduled_tokens``, ``finished_req_ids`` and
  ``preempted_req_ids``.

Two halves, one per vLLM process:

:class:`SchedulerSide` runs in the scheduler. It answers
``get_num_new_matched_tokens`` with one ``Lookup`` per KV cache group (one
in total for ordinary models) over the namespaces of every rank, turns the
scheduler's allocation into load jobs, and each step's newly computed full
blocks into store jobs. What it decides for a step is a :class:`StepPlan`,
which vLLM ships to every worker as the connector metadata.

:class:`WorkerSide` runs in each worker. It registers the worker's KV
memory, sends each step's loads as one ``Load`` and its stores as one
``Store``, reads one ``Completions`` per step, and reports finished loads,
finished stores and the engine block ids whose load failed.

Keys. A block key is (namespace, group, hash). Group ``g`` has engine blocks
of ``block_size[g]`` tokens, a multiple of vLLM's hash block size; the key
of its engine block ``i`` is the request's block hash that ends that block,
``block_hashes[(i+1)*f - 1]`` with ``f = block_size[g] // hash_block_size``
(hashes are chained, so it names the whole prefix). Loads and stores move
whole *units* of ``lcm(block sizes)`` tokens so that every group ends on a
block boundary.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from .client import Client
from .errors import FailedPrecondition, KVOffloadError, NotFound, Unavailable
from .regions import KVRegistration
from .types import Job, JobResult, Op

__all__ = [
    "FINGERPRINT_PREFIX",
    "namespace_fingerprint",
    "KeyMapper",
    "GroupJob",
    "StepPlan",
    "SchedulerSide",
    "WorkerSide",
    "iter_scheduled",
]

log = logging.getLogger("kvoffload.connector")

# Version of how this connector lays keys and blocks out. Part of every
# fingerprint: a change here must not hit blocks stored by the old code.
CONNECTOR_LAYOUT_VERSION = 1
FINGERPRINT_PREFIX = b"kvoffload.vllm/1:"


def namespace_fingerprint(fields: Mapping[str, Any]) -> bytes:
    """The namespace fingerprint of one rank: a fixed prefix and the SHA-256
    of the canonical JSON of ``fields`` (model, revision, dtype, block sizes,
    hash algorithm and seed, parallel sizes and this rank, ...). The daemon
    never interprets it; equal fingerprints share blocks."""
    canon = json.dumps(
        {"connector_layout": CONNECTOR_LAYOUT_VERSION, **fields}, sort_keys=True, separators=(",", ":"), default=str
    )
    return FINGERPRINT_PREFIX + hashlib.sha256(canon.encode()).digest()


class KeyMapper:
    """Maps a request's block hashes to the keys of each group's engine blocks."""

    def __init__(self, hash_block_size: int, group_block_sizes: Sequence[int]):
        if hash_block_size <= 0 or not group_block_sizes:
            raise ValueError("need a positive hash block size and at least one group")
        for g, bs in enumerate(group_block_sizes):
            if bs <= 0 or bs % hash_block_size:
                raise ValueError(f"group {g} block size {bs} is not a multiple of the hash block size {hash_block_size}")
        self.hash_block_size = hash_block_size
        self.block_sizes = tuple(int(b) for b in group_block_sizes)
        self.factors = tuple(b // hash_block_size for b in self.block_sizes)
        self.unit_tokens = math.lcm(*self.block_sizes)
        self.blocks_per_unit = tuple(self.unit_tokens // b for b in self.block_sizes)

    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    def units_in(self, num_hashes: int, num_tokens: int | None = None) -> int:
        """Whole units covered by ``num_hashes`` hashes (and ``num_tokens``)."""
        tokens = num_hashes * self.hash_block_size
        if num_tokens is not None:
            tokens = min(tokens, num_tokens)
        return tokens // self.unit_tokens

    def block_range(self, group: int, start_unit: int, end_unit: int) -> range:
        """The engine block indexes of ``group`` in units [start, end)."""
        k = self.blocks_per_unit[group]
        return range(start_unit * k, end_unit * k)

    def keys(self, hashes: Sequence[bytes], group: int, blocks: range) -> list[bytes]:
        f = self.factors[group]
        return [hashes[(i + 1) * f - 1] for i in blocks]


@dataclass
class GroupJob:
    """One request's blocks of one group: ``hashes[i]`` <-> engine block ``block_ids[i]``."""

    group: int
    hashes: list[bytes]
    block_ids: list[int]


@dataclass
class StepPlan:
    """What the scheduler decided for one step; vLLM sends it to every worker.

    - ``loads``: per request, the blocks to load now (an empty list still
      means "report this request finished receiving").
    - ``stores``: per request, the full blocks computed by this step.
    - ``preempted``: requests whose blocks vLLM is about to reuse: their
      stores must drain first.
    - ``delay_free``: requests for which ``request_finished`` returned True:
      workers report them as finished sending once their stores drained.
    """

    loads: dict[str, list[GroupJob]] = field(default_factory=dict)
    stores: dict[str, list[GroupJob]] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    delay_free: set[str] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.preempted or self.delay_free)


def iter_scheduled(scheduler_output: Any) -> Iterator[tuple[str, Any, bool]]:
    """(request id, new block ids per group or None, resumed) for every request
    scheduled in a step, new ones first (vLLM's own ``yield_req_data``). For a
    resumed request the block ids replace the old ones instead of extending
    them. Reads ``resumed_req_ids`` (current vLLM) or
    ``resumed_from_preemption`` (older)."""
    for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        yield r.req_id, r.block_ids, True
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is None:
        return
    ids = list(getattr(cached, "req_ids", None) or ())
    new_ids = list(getattr(cached, "new_block_ids", None) or [None] * len(ids))
    resumed_set = getattr(cached, "resumed_req_ids", None)
    if resumed_set is not None:
        resumed = [rid in resumed_set for rid in ids]
    else:
        resumed = list(getattr(cached, "resumed_from_preemption", None) or [False] * len(ids))
    yield from zip(ids, new_ids, resumed)


def _as_groups(block_ids: Any, num_groups: int) -> list[list[int]]:
    """Block ids per group from vLLM's tuple-of-lists (or a flat list for one group)."""
    if block_ids is None:
        return [[] for _ in range(num_groups)]
    if num_groups == 1 and block_ids and not isinstance(block_ids[0], (list, tuple)):
        return [list(block_ids)]
    groups = [list(g) for g in block_ids]
    if len(groups) != num_groups:
        raise ValueError(f"got block ids for {len(groups)} groups, the model has {num_groups}")
    return groups


@dataclass
class _ReqState:
    request: Any
    block_ids: list[list[int]]
    next_store_unit: int = 0
    stores_pending: bool = False  # store jobs sent since the last preemption


class SchedulerSide:
    """The scheduler half. Not thread-safe: vLLM calls it from one thread.

    Args:
        socket: the daemon's unix socket.
        fingerprints: the namespace fingerprint of every rank (tensor and
            pipeline parallel); a block counts only when every rank has it.
        hash_block_size: tokens per vLLM block hash (cache_config.block_size).
        group_block_sizes: tokens per engine block of each KV cache group.
        hash_bytes: length of vLLM's block hashes (32 for sha256, 16 xxhash).
        null_block_id: vLLM's null block (block 0 of the pool), never moved.
        client: a ready Client (tests); made from ``socket`` otherwise.
    """

    def __init__(
        self,
        socket: str,
        fingerprints: Sequence[bytes],
        hash_block_size: int,
        group_block_sizes: Sequence[int],
        hash_bytes: int,
        *,
        null_block_id: int | None = 0,
        client: Client | None = None,
        timeout_s: float = 5.0,
        namespace_retry_s: float = 1.0,
        namespace_refresh_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.keys = KeyMapper(hash_block_size, group_block_sizes)
        self.fingerprints = tuple(bytes(f) for f in fingerprints)
        self.hash_bytes = hash_bytes
        self.null_block_id = null_block_id
        self._client = client or Client(socket, timeout=timeout_s)
        self._clock = clock
        self._ns_ids: list[int] | None = None
        self._ns_next = 0.0
        self._ns_retry = namespace_retry_s
        self._ns_refresh = namespace_refresh_s
        self._reqs: dict[str, _ReqState] = {}
        self._matched: dict[str, int] = {}  # request -> num_computed_tokens of its last match
        # Requests already looked up once: vLLM asks again every step while a
        # request waits, and those repeats must not count as more accesses
        # for the daemon's admission policy (Lookup.peek).
        self._looked_up: set[str] = set()
        self._loads: dict[str, list[GroupJob]] = {}
        self._delay_free: set[str] = set()
        self._warned: set[str] = set()

    # -- helpers ----------------------------------------------------------

    def close(self) -> None:
        self._client.close()

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def namespace_ids(self) -> list[int] | None:
        """The namespace id of every rank's fingerprint, resolved with one
        Resolve call and cached; None until every rank has registered."""
        now = self._clock()
        if self._ns_ids is not None and now < self._ns_next:
            return self._ns_ids
        if self._ns_ids is None and now < self._ns_next:
            return None
        try:
            ids = self._client.resolve(self.fingerprints)
        except KVOffloadError as e:
            self._warn_once("resolve", "kvoffload: cannot reach the daemon (%s); no offloaded prefixes until it answers", e)
            self._ns_ids, self._ns_next = None, now + self._ns_retry
            return None
        if any(i == 0 for i in ids):
            self._ns_ids, self._ns_next = None, now + self._ns_retry
            return None
        self._ns_ids, self._ns_next = [int(i) for i in ids], now + self._ns_refresh
        return self._ns_ids

    def _hashes(self, request: Any, publishable: bool = False) -> list[bytes] | None:
        hashes = getattr(request, "block_hashes", None)
        if not hashes:
            return []
        if publishable:
            n = getattr(request, "num_publishable_block_hashes", None)
            if n is not None:
                hashes = hashes[: max(0, int(n))]
        h0 = hashes[0]
        if not isinstance(h0, (bytes, bytearray)) or len(h0) != self.hash_bytes:
            self._warn_once(
                "hashlen",
                "kvoffload: block hashes are %r of %s bytes, the namespace uses %d-byte hashes; offloading disabled",
                type(h0).__name__, len(h0) if isinstance(h0, (bytes, bytearray)) else "?", self.hash_bytes,
            )
            return None
        return hashes

    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _ReqState(request, [[] for _ in range(self.keys.num_groups)])
            self._reqs[request.request_id] = st
        else:
            st.request = request
        return st

    def _jobs(self, hashes: Sequence[bytes], groups: Sequence[Sequence[int]], start: int, end: int) -> list[GroupJob]:
        jobs = []
        for g in range(self.keys.num_groups):
            blocks = self.keys.block_range(g, start, end)
            ids = groups[g]
            keys = self.keys.keys(hashes, g, blocks)
            pairs = [(k, ids[i]) for k, i in zip(keys, blocks) if ids[i] is not None and ids[i] != self.null_block_id]
            if pairs:
                jobs.append(GroupJob(g, [k for k, _ in pairs], [b for _, b in pairs]))
        return jobs

    # -- vLLM's scheduler-side calls ---------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` whose blocks are ready now in
        every rank's namespace, and True (they load asynchronously) when
        there are any. Side-effect free for vLLM: no lease, nothing pinned.
        At least the last prompt token is always left to compute."""
        U = self.keys.unit_tokens
        if num_computed_tokens % U:
            return 0, False
        hashes = self._hashes(request)
        if not hashes:
            return 0, False
        start = num_computed_tokens // U
        end = self.keys.units_in(len(hashes), int(request.num_tokens) - 1)
        if end <= start:
            return 0, False
        ns = self.namespace_ids()
        if not ns:
            return 0, False
        hit = end - start
        peek = request.request_id in self._looked_up
        self._looked_up.add(request.request_id)
        for g in range(self.keys.num_groups):
            blocks = self.keys.block_range(g, start, start + hit)
            try:
                r = self._client.lookup(ns, self.keys.keys(hashes, g, blocks), group=g, peek=peek)
            except KVOffloadError as e:
                self._warn_once(f"lookup:{e.code}", "kvoffload: Lookup failed (%s); treating as a miss", e)
                self._ns_next = 0.0  # re-resolve namespaces next time
                return 0, False
            hit = min(hit, r.ready // self.keys.blocks_per_unit[g])
            if hit == 0:
                return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return hit * U, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plans the load of ``num_external_tokens`` tokens into the blocks
        vLLM just allocated (``blocks`` holds every block of the request)."""
        st = self._state(request)
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0:
            return
        U = self.keys.unit_tokens
        local = matched if matched is not None else int(getattr(request, "num_computed_tokens", 0))
        start, end = local // U, (local + num_external_tokens) // U
        groups = self._alloc_block_ids(blocks)
        hashes = self._hashes(request) or []
        fits = end > start and self.keys.units_in(len(hashes)) >= end and all(
            len(groups[g]) >= self.keys.block_range(g, 0, end).stop for g in range(self.keys.num_groups)
        )
        if fits:
            jobs = self._jobs(hashes, groups, start, end)
        else:
            # vLLM now waits for this request's load. Nothing can be loaded,
            # so every block it allocated for those tokens is reported failed
            # (no keys: the worker fails them without asking the daemon).
            log.warning("kvoffload: request %s: cannot map %d external tokens onto its blocks",
                        request.request_id, num_external_tokens)
            jobs = []
            for g in range(self.keys.num_groups):
                rng = self.keys.block_range(g, start, end)
                ids = [b for b in groups[g][rng.start:rng.stop] if b is not None and b != self.null_block_id]
                jobs.append(GroupJob(g, [], ids))
        self._loads[request.request_id] = jobs
        st.next_store_unit = max(st.next_store_unit, end)

    def _alloc_block_ids(self, blocks: Any) -> list[list[int]]:
        per_group = getattr(blocks, "blocks", None)
        if per_group is not None:
            out = []
            for grp in per_group:
                out.append([None if getattr(b, "is_null", False) else int(b.block_id) for b in grp])
            return _as_groups(out, self.keys.num_groups)
        return _as_groups(blocks.get_block_ids(), self.keys.num_groups)

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        """This step's plan: the loads planned since the last step, a store of
        every full unit the step completes, the preempted requests, and the
        requests whose blocks vLLM keeps until their stores drain."""
        plan = StepPlan(loads=self._loads, preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        self._loads = {}
        for rid in plan.preempted:
            st = self._reqs.get(rid)
            if st is not None:
                # Workers drain this request's stores before vLLM reuses its
                # blocks; the resumed request brings its new block ids.
                st.stores_pending = False
                st.block_ids = [[] for _ in range(self.keys.num_groups)]
        num_sched = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        for rid, new_ids, replace in iter_scheduled(scheduler_output):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_groups = _as_groups(new_ids, self.keys.num_groups)
            if replace:
                st.block_ids = new_groups
            else:
                for g, ids in enumerate(new_groups):
                    st.block_ids[g].extend(ids)
            req = st.request
            done_tokens = min(int(req.num_computed_tokens) + int(num_sched.get(rid, 0)), int(req.num_tokens))
            hashes = self._hashes(req, publishable=True)
            if not hashes:
                continue
            end = self.keys.units_in(len(hashes), done_tokens)
            for g in range(self.keys.num_groups):
                end = min(end, len(st.block_ids[g]) // self.keys.blocks_per_unit[g])
            if end <= st.next_store_unit:
                continue
            jobs = self._jobs(hashes, st.block_ids, st.next_store_unit, end)
            st.next_store_unit = end
            if jobs:
                plan.stores[rid] = jobs
                st.stores_pending = True
        plan.delay_free, self._delay_free = self._delay_free, set()
        return plan

    def update_connector_output(self, finished_recving: Iterable[str] | None) -> None:
        """Nothing to do: the scheduler side keeps no per-transfer state that
        the workers' reports would settle."""

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """True when stores of this request may still be in flight: vLLM then
        keeps its blocks until a worker reports it finished sending."""
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self._matched.pop(rid, None)
        self._looked_up.discard(rid)
        # A load still planned or in flight is not ours to wait for: vLLM
        # keeps the blocks of a request finished while waiting for remote KV
        # until a worker reports it finished receiving (which it will).
        if st is None or not st.stores_pending:
            return False, None
        self._delay_free.add(rid)
        return True, None


@dataclass
class _JobInfo:
    request_id: str
    op: Op
    group: int
    block_ids: list[int]


class WorkerSide:
    """The worker half: one registration, one Load, Store and Completions per step.

    Args:
        socket: the daemon's unix socket.
        fingerprint: this rank's namespace fingerprint.
        num_groups: KV cache groups of the model.
        request_level_failures: report a failed load as a failed request
            (``take_failed_requests``) instead of engine block ids; what
            vLLM wants for models with several KV cache groups.
        sync_stores: ``wait_for_save`` waits for the step's stores to drain
            (needed when vLLM may reuse a running request's blocks, as with
            sliding-window groups).
    """

    def __init__(
        self,
        socket: str,
        fingerprint: bytes,
        num_groups: int,
        *,
        client_name: str = "vllm worker",
        request_level_failures: bool = False,
        sync_stores: bool = False,
        client: Client | None = None,
        timeout_s: float = 10.0,
        drain_timeout_s: float = 30.0,
        reregister_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        unavailable_grace_s: float = 5.0,
    ):
        self.fingerprint = bytes(fingerprint)
        self.num_groups = num_groups
        self.client_name = client_name
        self.request_level_failures = request_level_failures
        self.sync_stores = sync_stores
        self._socket = socket
        self._client = client or Client(socket, timeout=timeout_s)
        self._drain_timeout = drain_timeout_s
        self._rereg_after = reregister_after_s
        self._clock = clock
        # A connection that breaks with jobs in flight: the daemon drains
        # them and keeps answering Completions for the old registration
        # until they have landed, so the connector keeps asking (gRPC
        # reconnects) for this long before it gives the jobs up.
        self._unavailable_grace = unavailable_grace_s
        self._unavailable_since: float | None = None
        self._lock = threading.Lock()
        self._kv: KVRegistration | None = None
        self.registration_id: int | None = None
        self.namespace_id: int | None = None
        self._next_rereg = 0.0
        self._next_job = 1
        self._jobs: dict[int, _JobInfo] = {}
        self._pending_loads: dict[str, int] = {}
        self._pending_stores: dict[str, int] = {}
        self._recv_done: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()  # a load block failed, receive not finished yet
        self._failed_done: set[str] = set()  # ... and finished: ready for take_failed_requests
        self._await_send: set[str] = set()
        self._finished_seen: dict[str, int] = {}
        self._calls = 0
        self.counters = {"loads": 0, "stores": 0, "blocks_loaded": 0, "blocks_stored": 0, "load_failures": 0,
                         "store_failures": 0}

    # -- registration -----------------------------------------------------

    def register(self, kv: KVRegistration) -> None:
        """Registers the worker's KV memory. A refusal is logged, not raised:
        the engine runs on without offloading, and every load planned for
        this worker fails (so vLLM recomputes)."""
        self._kv = kv
        self._register()

    def _register(self) -> bool:
        kv = self._kv
        if kv is None:
            return False
        try:
            reg = self._client.register(self.fingerprint, kv.layout, kv.regions, self.client_name)
        except KVOffloadError as e:
            level = logging.ERROR if isinstance(e, FailedPrecondition) or not isinstance(e, Unavailable) else logging.WARNING
            log.log(level, "kvoffload: Register failed (%s); loads will fail and stores are skipped until it succeeds", e)
            self.registration_id = None
            self._next_rereg = self._clock() + self._rereg_after
            return False
        self.registration_id, self.namespace_id = reg.registration_id, reg.namespace_id
        log.info("kvoffload: registered %d regions (%s) as registration %d in namespace %d%s",
                 len(kv.regions), kv.device, reg.registration_id, reg.namespace_id,
                 " (joined existing)" if reg.joined_existing else "")
        return True

    def _ensure_registered(self) -> bool:
        if self.registration_id is not None:
            return True
        if self._kv is None or self._clock() < self._next_rereg:
            return False
        return self._register()

    def _lost_registration(self, e: KVOffloadError) -> None:
        """The daemon went away or forgot us: every job in flight is lost (the
        daemon drains a registration's jobs before it lets go of its memory,
        so nothing writes the engine's blocks later)."""
        log.warning("kvoffload: lost the registration (%s); failing %d jobs in flight", e, len(self._jobs))
        self.registration_id = None
        self._next_rereg = self._clock() + self._rereg_after
        for jid in list(self._jobs):
            self._finish_job(jid, failed_all=True)

    # -- bookkeeping --------------------------------------------------------

    def _new_job(self, rid: str, op: Op, gj: GroupJob) -> Job:
        jid = self._next_job
        self._next_job += 1
        self._jobs[jid] = _JobInfo(rid, op, gj.group, list(gj.block_ids))
        pend = self._pending_loads if op == Op.LOAD else self._pending_stores
        pend[rid] = pend.get(rid, 0) + 1
        return Job(job_id=jid, hashes=gj.hashes, block_ids=gj.block_ids, group=gj.group, request_id=rid)

    def _finish_job(self, jid: int, result: JobResult | None = None, failed_all: bool = False) -> None:
        info = self._jobs.pop(jid, None)
        if info is None:
            return
        if info.op == Op.LOAD:
            failed = info.block_ids if failed_all or result is None else result.failed_block_ids
            if failed:
                self.counters["load_failures"] += len(failed)
                self._failed_reqs.add(info.request_id)
                self._failed_blocks.update(failed)
                log.info("kvoffload: request %s: %d blocks failed to load%s", info.request_id, len(failed),
                         "" if result is None else f" ({sorted({f.status.name for f in result.failures})})")
            self.counters["blocks_loaded"] += len(info.block_ids) - len(failed)
            left = self._pending_loads.get(info.request_id, 1) - 1
            if left <= 0:
                self._pending_loads.pop(info.request_id, None)
                self._recv_done.add(info.request_id)
            else:
                self._pending_loads[info.request_id] = left
        else:
            nfail = len(info.block_ids) if failed_all or result is None else len(result.failures)
            self.counters["store_failures"] += nfail
            self.counters["blocks_stored"] += len(info.block_ids) - nfail
            left = self._pending_stores.get(info.request_id, 1) - 1
            if left <= 0:
                self._pending_stores.pop(info.request_id, None)
            else:
                self._pending_stores[info.request_id] = left

    def _apply(self, results: Iterable[JobResult]) -> None:
        for r in results:
            self._finish_job(r.job_id, r)

    def _poll(self, wait_ms: int = 0) -> None:
        """One Completions call; its results settle the jobs they name."""
        if self.registration_id is None or not self._jobs:
            return
        try:
            c = self._client.completions(self.registration_id, wait_ms=wait_ms)
        except NotFound as e:
            # Unknown, or unregistered and every job of it drained: nothing
            # of ours writes the engine's blocks any more.
            self._unavailable_since = None
            self._lost_registration(e)
            return
        except Unavailable as e:
            now = self._clock()
            if self._unavailable_since is None:
                self._unavailable_since = now
            if now - self._unavailable_since >= self._unavailable_grace:
                self._unavailable_since = None
                self._lost_registration(e)
            return
        except KVOffloadError as e:
            log.warning("kvoffload: Completions failed (%s)", e)
            return
        self._unavailable_since = None
        self._apply(c.results)

    def _wait_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        end = self._clock() + timeout_s
        while not done():
            left = end - self._clock()
            if left <= 0 or self.registration_id is None:
                return done()
            self._poll(wait_ms=int(min(left, 1.0) * 1000))
            if self._unavailable_since is not None:
                time.sleep(0.01)  # the daemon is unreachable: do not spin
        return True

    # -- vLLM's worker-side calls -------------------------------------------

    def handle_preemptions(self, plan: StepPlan) -> None:
        """Waits for the stores of preempted requests: vLLM is about to give
        their blocks to other requests."""
        with self._lock:
            victims = [r for r in plan.preempted if self._pending_stores.get(r)]
            if victims and not self._wait_until(lambda: not any(self._pending_stores.get(r) for r in victims),
                                                self._drain_timeout):
                log.error("kvoffload: stores of preempted requests %s still running after %.0fs",
                          victims, self._drain_timeout)

    def start_load_kv(self, plan: StepPlan) -> None:
        """Sends every load of the step as one Load."""
        with self._lock:
            self._await_send |= plan.delay_free
            if not plan.loads:
                return
            jobs: list[Job] = []
            for rid, gjobs in plan.loads.items():
                real = [gj for gj in gjobs if gj.hashes]
                for gj in gjobs:
                    if not gj.hashes and gj.block_ids:
                        # Planned without keys: fail those blocks.
                        self._failed_blocks.update(gj.block_ids)
                        self._failed_reqs.add(rid)
                if not real:
                    self._recv_done.add(rid)
                    continue
                jobs.extend(self._new_job(rid, Op.LOAD, gj) for gj in real)
            if not jobs:
                return
            self.counters["loads"] += 1
            if not self._ensure_registered():
                for j in jobs:
                    self._finish_job(j.job_id, failed_all=True)
                return
            try:
                self._client.load(self.registration_id, jobs)
            except (NotFound, Unavailable) as e:
                for j in jobs:
                    self._finish_job(j.job_id, failed_all=True)
                self._lost_registration(e)
            except KVOffloadError as e:
                log.error("kvoffload: Load of %d jobs refused (%s); their blocks are reported failed", len(jobs), e)
                for j in jobs:
                    self._finish_job(j.job_id, failed_all=True)

    def wait_for_save(self, plan: StepPlan, ready_event: bytes = b"") -> list[int]:
        """Sends every store of the step as one Store (after the forward pass
        wrote the blocks; on CUDA ``ready_event`` orders the copies after it).
        Returns the job ids sent (see :meth:`jobs_done`)."""
        with self._lock:
            if not plan.stores:
                return []
            if not self._ensure_registered():
                return []
            jobs = [self._new_job(rid, Op.STORE, gj) for rid, gjobs in plan.stores.items() for gj in gjobs]
            self.counters["stores"] += 1
            try:
                self._client.store(self.registration_id, jobs, ready_event=ready_event)
            except (NotFound, Unavailable) as e:
                for j in jobs:
                    self._finish_job(j.job_id, failed_all=True)
                self._lost_registration(e)
                return []
            except KVOffloadError as e:
                log.error("kvoffload: Store of %d jobs refused (%s)", len(jobs), e)
                for j in jobs:
                    self._finish_job(j.job_id, failed_all=True)
                return []
            ids = [j.job_id for j in jobs]
            if self.sync_stores:
                if not self._wait_until(lambda: not (set(ids) & self._jobs.keys()), self._drain_timeout):
                    log.error("kvoffload: stores still running after %.0fs", self._drain_timeout)
            return ids

    def jobs_done(self, job_ids: Iterable[int]) -> bool:
        """True when none of ``job_ids`` is still in flight."""
        with self._lock:
            return not any(j in self._jobs for j in job_ids)

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        """One Completions call. Returns (finished sending, finished receiving):
        requests vLLM kept for their stores whose stores have all drained,
        and requests whose loads all finished (failed ones included; their
        failed blocks are in ``get_block_ids_with_load_errors``)."""
        with self._lock:
            self._calls += 1
            for rid in finished_req_ids or ():
                self._finished_seen[rid] = self._calls
            self._poll(wait_ms=0)
            recving, self._recv_done = self._recv_done, set()
            self._failed_done |= self._failed_reqs & recving
            self._failed_reqs -= recving
            sending = {r for r in self._await_send if r in self._finished_seen and not self._pending_stores.get(r)}
            self._await_send -= sending
            for r in sending:
                self._finished_seen.pop(r, None)
            # Forget finished requests nobody waits for, after a while.
            stale = [r for r, n in self._finished_seen.items() if r not in self._await_send and self._calls - n > 64]
            for r in stale:
                del self._finished_seen[r]
            return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine block ids whose load failed since the last call (empty in
        request-level mode, where ``take_failed_requests`` reports them)."""
        with self._lock:
            blocks, self._failed_blocks = self._failed_blocks, set()
            return set() if self.request_level_failures else blocks

    def take_failed_requests(self) -> set[str]:
        """Requests reported finished receiving (by :meth:`get_finished`) with
        at least one block that failed to load, since the last call (always
        empty unless ``request_level_failures``)."""
        with self._lock:
            reqs, self._failed_done = self._failed_done, set()
            return reqs if self.request_level_failures else set()

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Waits a little for jobs in flight, then unregisters and closes."""
        with self._lock:
            self._wait_until(lambda: not self._jobs, timeout_s)
            if self.registration_id is not None:
                try:
                    self._client.unregister(self.registration_id)
                except KVOffloadError as e:
                    log.info("kvoffload: Unregister: %s", e)
                self.registration_id = None
            self._client.close()
