"""The scheduler half of the vLLM connector, free of vLLM.

It answers ``get_num_new_matched_tokens`` from an in-process mirror of what
the daemon holds (:mod:`kvoffload.mirror`, fed by its event stream) in the
step it is asked, while that mirror is live; otherwise from Lookups made on
a background thread (:mod:`kvoffload.background`), never on vLLM's
scheduling loop: the first ask for a request queues one lookup and waits a
few milliseconds for it; if the daemon has not answered by then the request
is deferred (vLLM asks again next step, ``None``), and a daemon that is down
or slow is a miss. Whatever vLLM passes, a request has its answer
``lookup_deadline_s`` after its first ask. A hit holds what it promised:
the Lookup takes a lease on the blocks, and the load names it. It turns the
scheduler's allocation into load jobs and each step's newly computed full
blocks into store jobs, and says in ``request_finished`` whether vLLM must
keep a request's blocks for stores still in flight.

The namespaces it looks in are the ones every worker actually registered:
each worker reports its fingerprint (which covers its tensors' byte order)
through vLLM's handshake metadata, and nothing is offered until all have,
nor ever when a worker could not register.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict, abc
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .background import _DOWN_CODES, Background
from .client import Client
from .errors import KVOffloadError
from .keys import KeyMapper, check_hash_granularity
from .kv_events import BlockInfoMap, EventFeed, VLLMEventTypes, remember, translate
from .mirror import LookupMirror
from .plan import GroupJob, StepPlan, as_groups, iter_scheduled, iter_written
from .settings import derive_fingerprint
from .stats import StatsRecorder
from .types import Tier

__all__ = ["SchedulerSide", "RequestControls", "request_controls"]

log = logging.getLogger("kvoffload.scheduler")

# Requests whose undrained stores one engine block keeps apart in the fence
# table (SchedulerSide._note_reads).
_MAX_READERS = 8
# Probe Lookups per request in a lookup round (window_probes), and per
# batch: a batch of many requests whose states are gone (a daemon that lost
# its tier) probes for the first of them, the rest step down as without.
_PROBE_CALLS = 24
_PROBE_BATCH_CALLS = 256
# Lookup batches queued or running on the background thread at once: past
# this, new lookups wait in the next batch (a slow daemon does not grow the
# queue; each request is answered by its deadline all the same).
_MAX_LOOKUP_TASKS = 4
# Lease ids waiting to be released (ReleaseLeases takes at most 4096).
_MAX_SPARE_LEASES = 4096
# Blocks this engine planned to store lately, kept so that the mirror's miss
# of one (its event not there yet) goes to the daemon instead: how many, and
# for how long after the plan.
_RECENT_STORES = 65536
_RECENT_STORE_S = 1.0


@dataclass(frozen=True)
class RequestControls:
    """Per-request choices from ``kv_transfer_params`` (docs/vllm.md)."""

    load: bool = True
    store: str = "all"  # "all", "prompt" (prompt tokens only) or "none"


_DEFAULT_CONTROLS = RequestControls()
# Every choice, made once (a frozen dataclass is slow to make, on vLLM's loop).
_CONTROLS = {(load, store): RequestControls(load, store)
             for load in (True, False) for store in ("all", "prompt", "none")}


def request_controls(request: Any) -> RequestControls:
    params = getattr(request, "kv_transfer_params", None)
    if not params:  # most requests: no typing check on vLLM's loop
        return _DEFAULT_CONTROLS
    if type(params) is not dict and not isinstance(params, abc.Mapping):  # an ABC check is ~25 us cold
        return _DEFAULT_CONTROLS
    store = params.get("kvoffload_store", "all")
    if store not in ("all", "prompt", "none"):
        store = "all"
    return _CONTROLS[params.get("kvoffload_load", True) is not False, store]


@dataclass(eq=False, slots=True)
class _Lookup:
    """One request's lookup: batched, sent, then answered. Compared by
    identity (a batch may hold two alike)."""

    key: tuple  # (start unit, end unit, namespace ids)
    hashes: list
    peek: bool
    created: float
    submitted: float = 0.0  # 0: waits for this step's batch
    done: bool = False  # set last, by the background thread
    error: BaseException | None = None
    hit_units: int = 0
    ready_before: int = 0  # units of the local prefix the daemon already holds
    prefix_tiers: list = field(default_factory=list)  # the tier group's tiers of the local prefix's peek
    leases: dict[int, int] = field(default_factory=dict)
    tiers: list = field(default_factory=list)
    took: float = 0.0
    answered_at: float = 0.0
    task: Any = None  # the background call that answers it, once sent
    keys_asked: int = 0  # keys looked up for the hit (not the local prefix's peek)
    keys_outside: int = 0  # of those, windowed groups' keys outside the hit's windows
    spare: list = field(default_factory=list)  # lease ids its rounds took and did not keep (the thread's)


@dataclass
class _ReqState:
    request: Any
    block_ids: list[list[int | None]]
    next_store_unit: int = 0
    store_seq: int = 0  # last step whose plan stored blocks of this request
    # (plan step, first unit) of each store planned and not yet known drained
    # by every rank: where the cursor goes back to if vLLM preempts the
    # request and the workers drop those stores still queued.
    store_starts: list[tuple[int, int]] = field(default_factory=list)
    controls: RequestControls = field(default_factory=RequestControls)
    gen: int = 0  # the identity (reset generation) its KV was computed under; stores only while current


class SchedulerSide:
    """The scheduler half. Not thread-safe: vLLM calls it from one thread.

    Args:
        socket: the daemon's unix socket.
        num_ranks: how many workers register (every rank's namespace must hold
            a block for it to count).
        hash_block_size: tokens per vLLM block hash (see kvoffload.keys).
        group_block_sizes: tokens per scheduler block of each KV cache group.
        hash_bytes: length of vLLM's block hashes (32 for sha256, 16 xxhash).
        offer_hits: False to never offer external hits (stores still go).
        null_block_id: vLLM's null block (block 0 of the pool), never moved.
        lookup_wait_s: how long the scheduling loop may wait, in total per
            step, for lookups it sends at once (0: never; each new request
            is deferred a step and its lookup batched with the step's).
        lookup_deadline_s: after this long unanswered, a lookup is a miss.
        lease_ms: how long a Lookup's lease holds the blocks it offered
            (0: no lease). Off by default: the daemon honours a lease only
            over the connection that took it, and vLLM's workers load over
            their own (docs/vllm.md, Limits).
        kv_events: follow what the daemon holds and report it as vLLM's KV
            cache events (:meth:`take_kv_events`, kvoffload.kv_events).
        kv_events_max_blocks: how many blocks' token ids and parent hashes
            are kept for those events.
        kv_events_max_queued: how many daemon events may wait for
            ``take_kv_events`` before the stream starts over.
        eagle_groups: per KV cache group, whether it holds EAGLE/MTP draft
            layers (vLLM's ``is_eagle_group``).
        group_windows: per KV cache group, its window in blocks, None for
            full attention (kvoffload.settings.group_window): lookups, loads
            and stores of a windowed group cover only what a hit needs.
        window_rounds: how many lookups a batch makes, at most, to find where
            every windowed group's window is present (each one round trip).
        window_probes: for a model whose windows all fit in one unit (Mamba
            in align mode: one state block), how many candidates below the
            next one each round after the first also asks about, as peeks
            without a lease: a run of missing states costs one round per
            ``window_probes`` + 1 units instead of one per unit. Each probe
            is one Lookup per windowed group, at most 24 per request a round
            (fewer probes for a model with more than 3 windowed groups) and
            256 per batch a round (requests past that get none that round).
        lookup_mirror: answer lookups from an in-process mirror of what the
            daemon holds for the engine's namespaces (kvoffload.mirror), in
            the step they are asked, while it is live and no lease is asked
            for; the daemon is asked otherwise.
        mirror_max_blocks: entries the mirror keeps at most (then it stops).
    """

    def __init__(
        self,
        socket: str,
        num_ranks: int,
        hash_block_size: int,
        group_block_sizes: Sequence[int],
        hash_bytes: int,
        *,
        offer_hits: bool = True,
        null_block_id: int | None = 0,
        client: Client | None = None,
        rpc_timeout_s: float = 1.0,
        lookup_wait_s: float = 0.0,
        lookup_deadline_s: float = 0.2,
        lease_ms: int = 0,
        miss_ttl_s: float = 0.5,
        namespace_refresh_s: float = 30.0,
        namespace_retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        stats: StatsRecorder | None = None,
        kv_events: bool = False,
        kv_events_max_blocks: int = 65536,
        kv_events_max_queued: int = 65536,
        eagle_groups: Sequence[bool] = (),
        group_windows: Sequence[int | None] = (),
        scratch_groups: Sequence[bool] = (),
        window_rounds: int = 4,
        window_probes: int = 8,
        lookup_mirror: bool = True,
        mirror_max_blocks: int = 2_000_000,
    ):
        self.keys = KeyMapper(hash_block_size, group_block_sizes, tuple(group_windows) or None,
                              tuple(scratch_groups) or None)
        self._window_rounds = max(1, int(window_rounds))
        self._window_probes = max(0, int(window_probes))
        # The group whose blocks say where a hit's tokens come from: the
        # first full-attention group (its blocks cover the whole hit), else
        # the first windowed one (a scratch group has no blocks to say it).
        self._tier_group = (self.keys.full_groups or self.keys.windowed_groups)[0]
        # EAGLE/MTP draft groups: while a request decodes, the KV of its last
        # block is the draft's and is computed again (vLLM's offloading
        # connector leaves it out too): the last unit is not stored yet.
        self._eagle = any(eagle_groups)
        self._hit_tiers: dict[str, list] = {}  # request -> tier of each offered block of the tier group
        self.num_ranks = int(num_ranks)
        self.hash_bytes = hash_bytes
        self.offer_hits = offer_hits
        self.null_block_id = null_block_id
        self._client = client or Client(socket, timeout=rpc_timeout_s)
        self._rpc_timeout = rpc_timeout_s
        self._clock = clock
        self._io = Background(self._client, "kvoffload-scheduler", slow_after_s=lookup_deadline_s, clock=clock)
        # The mirror follows the daemon's events on a connection of its own
        # (only with a daemon of our own making: not with an injected client).
        self._mirror: LookupMirror | None = None
        if lookup_mirror and client is None and not lease_ms:
            self._mirror = LookupMirror(Client(socket, timeout=rpc_timeout_s), max_blocks=mirror_max_blocks)
        self._shadow: list[tuple[_Lookup, _Lookup]] = []  # (mirror's answer, the daemon's lookup of the same)
        self._mirror_asked: list[_Lookup] = []  # mirror's answers whose daemon lookup the next flush makes
        self._unrecorded: list[_Lookup] = []  # mirror's answers whose stats the next flush records
        self.mirror_answers = 0  # requests answered from the mirror
        self.mirror_behind = 0  # asks the mirror left to the daemon: a block stored lately not mirrored yet
        self._recent: OrderedDict[tuple[int, bytes], float] = OrderedDict()  # (group, key) -> when planned
        self._wait = lookup_wait_s
        self._step_wait_left = lookup_wait_s
        self._deadline = lookup_deadline_s
        self._lease_ms = int(lease_ms)
        self._miss_ttl = miss_ttl_s
        self._ns_refresh = namespace_refresh_s
        self._ns_retry = namespace_retry_s
        self.stats = stats or StatsRecorder()
        self.disabled: str | None = None
        self.stores_off = False  # no worker can store: plan none
        self._fingerprints: dict[tuple, bytes] | None = None  # of the current identity
        self._rank_keys: dict[tuple, bytes] = {}  # rank -> registration key (discover_workers)
        self._discovery_misses = 0
        self._base_fps: dict[tuple, bytes] | None = None  # as the workers registered them at start
        # The engine's identity: generation 0 is the workers' own
        # fingerprints; each reset_cache makes a new one (a fresh token every
        # fingerprint is derived from), sent to the workers in every plan.
        self._gen = 0
        self._token = b""
        self._resetting = False  # namespaces of a new identity not resolved yet
        # (group, key) of every block planned to store since the reset, while
        # resetting; None: too many (or no reset)
        self._since_reset: set[tuple[int, bytes]] | None = None
        self._ns_ids: tuple[int, ...] | None = None
        self._ns_task: Any = None
        self._ns_next = 0.0
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._matched: dict[str, _Lookup] = {}
        self._looked_up: set[str] = set()
        self._loads: dict[str, list[GroupJob]] = {}
        self._batch: list[_Lookup] = []
        self._asked: dict[str, float] = {}  # request -> its first ask not yet answered
        self._lookup_tasks: list[Any] = []  # lookup batches queued or running (_MAX_LOOKUP_TASKS)
        self._orphans: list[_Lookup] = []  # dropped lookups still running: their leases go once done
        self._spare: list[int] = []  # lease ids no load will name, to release
        self._release_task: Any = None
        self._released = 0  # leases the daemon confirmed released (scheduler thread)
        self._thread_released = 0  # (the background thread, by lookup batches)
        self._load_blocks: dict[str, set[int]] = {}  # request -> engine blocks of its load in flight
        self._load_units: dict[str, tuple[int, dict[int, int]]] = {}  # request -> (first unit, block -> unit)
        self._no_hits: set[str] = set()  # requests whose load failed: computed, not loaded again
        self._unregistered: set = set()  # ranks whose worker reports no registration
        self._delay_free: set[str] = set()
        self._settled: dict[str, dict[tuple, int]] = {}  # request -> rank -> last store seq drained
        # Fences (vLLM's offloading connector's _block_id_to_pending_jobs):
        # per engine block, the requests whose planned stores read it, with
        # the last plan step of each, until every rank acknowledged them
        # drained or a step that writes the block fenced them. Every group,
        # running and finished requests alike: a block vLLM can give to
        # another request while a store of it may still run (behind a
        # sliding window, a local chunk, R-SWA's decode gap, a preempted
        # request's) is fenced when it is allocated again. Keyed by block
        # id: bounded by the engine's block count (_note_reads).
        self._store_reads: dict[int, dict[str | None, int]] = {}
        self._reads_by_req: dict[str, set[int]] = {}
        self._read_acks: dict[str, dict[tuple, int]] = {}  # request -> rank -> last store seq drained
        self._alloc_written: set[int] = set()  # load destinations allocated since the last plan
        self.fences = 0  # blocks named in a plan's fence so far
        self._seq = 0
        self._asked_blind = 0
        self._warned: set[str] = set()
        # KV events: the blocks' payloads, kept from the plans; the stream of
        # the first rank's namespace, followed once the workers registered.
        self._infos = BlockInfoMap(kv_events_max_blocks) if kv_events else None
        self._events_max_queued = kv_events_max_queued
        self._events_fp: bytes | None = None
        self.events: EventFeed | None = None

    # -- helpers ----------------------------------------------------------

    def close(self) -> None:
        if self._mirror is not None:
            self._mirror.close()
            self._mirror._client.close()
        if self.events is not None:
            self.events.close()
        self._io.close()
        self._client.close()

    def disable(self, reason: str) -> None:
        """Stops offering hits for good (stores go on): a configuration this
        connector cannot serve safely, found at run time."""
        if self.disabled is None:
            self.disabled = reason
            log.error("kvoffload: external hits disabled: %s", reason)

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def set_worker_fingerprints(self, by_rank: Mapping[tuple, bytes | None]) -> None:
        """The fingerprint each worker registered under, by rank, from vLLM's
        handshake metadata. A rank that reports None could not register:
        nothing is offered then."""
        if len(by_rank) != self.num_ranks:
            self.disable(f"{len(by_rank)} workers reported a registration, the engine has {self.num_ranks} ranks")
            self.stores_off = True
            return
        failed = [r for r, fp in by_rank.items() if not fp]
        if failed:
            self.disable(f"workers {sorted(failed, key=str)} could not register their KV caches with the daemon")
            self.stores_off = True
            return
        self._adopt(by_rank)
        self._ns_task = None  # a discovery in flight is not needed any more
        self.namespace_ids()  # resolve now, before the first request asks

    def discover_workers(self, keys: Mapping[tuple, bytes]) -> None:
        """Finds the workers' fingerprints in the daemon, by the registration
        key each rank registered with (one per rank): the path that does not
        depend on vLLM's handshake, which a MultiConnector hands only its
        first child's. Asked once now (vLLM builds the scheduler after the
        workers registered), then on the background thread every
        ``namespace_retry_s`` until every rank has exactly one live
        registration; what set_worker_fingerprints brings first wins."""
        if len(keys) != self.num_ranks:
            self.disable(f"{len(keys)} registration keys for an engine of {self.num_ranks} ranks")
            return
        self._rank_keys = dict(keys)
        try:
            found = self._find_workers(self._client)
        except KVOffloadError as e:
            log.info("kvoffload: finding the workers' registrations: %s", e)
            found = None
        self._take_found(found, self._clock())

    def _find_workers(self, c: Client) -> tuple[dict, list[int], list]:
        """(fingerprint by rank, their namespace ids, ranks without exactly
        one live registration)."""
        keys = self._rank_keys
        ranks = sorted(keys, key=str)
        found = c.find_registrations([keys[r] for r in ranks], timeout=self._rpc_timeout)
        by_rank = {r: fps[0] for r, fps in zip(ranks, found) if len(fps) == 1}
        missing = [r for r in ranks if r not in by_rank]
        if missing:
            return by_rank, [], missing
        return by_rank, c.resolve([by_rank[r] for r in sorted(by_rank)], timeout=self._rpc_timeout), []

    def _take_found(self, found: tuple | None, now: float) -> list[int] | None:
        if found is not None and self._fingerprints is None:
            by_rank, ids, missing = found
            if not missing and ids and all(ids):
                self._adopt(by_rank)
                if self._gen:  # a cache reset came first: its fingerprints are resolved anew
                    return self.namespace_ids()
                self._ns_ids, self._ns_next = tuple(ids), now + self._ns_refresh
                if self._mirror is not None:
                    self._mirror.follow(self._ns_ids)  # now, not at the first lookup (namespace_ids)
                return self._ns_ids
            self._discovery_misses += 1
            if self._discovery_misses in (1, 30):
                log.warning("kvoffload: the daemon holds no single live registration of workers %s of this engine "
                            "yet; no external hits until it does (asking again every %.1fs)",
                            sorted(missing, key=str), self._ns_retry)
        if self._fingerprints is None:
            self._ns_next = now + self._ns_retry
        return None

    def _discover(self) -> list[int] | None:
        """namespace_ids before the fingerprints are known: one background
        task finds them (FindRegistrations) and resolves their namespaces."""
        now = self._clock()
        t = self._ns_task
        if t is not None and t.done.is_set():
            self._ns_task = None
            if t.error is not None:
                log.info("kvoffload: finding the workers' registrations: %s", t.error)
            ids = self._take_found(t.result if t.error is None else None, t.finished_at or now)
            if ids is not None:
                return ids
        if self._ns_task is None and now >= self._ns_next and self._io.healthy():
            self._ns_task = self._io.submit(self._find_workers)
        return None

    def _adopt(self, by_rank: Mapping[tuple, bytes]) -> None:
        """The workers' fingerprints are known: look blocks up under them."""
        self._base_fps = {r: bytes(fp) for r, fp in by_rank.items()}
        self._fingerprints = self._derive(self._base_fps)
        self._ns_ids, self._ns_next = None, 0.0
        if self._infos is not None:
            # One report per engine, from here: the first rank's namespace
            # stands for every rank's (docs/events.md, tensor parallelism).
            self._events_fp = self._fingerprints[min(self._fingerprints, key=str)]
            if self.events is None:
                self.events = EventFeed(self._client, lambda: self._events_fp, max_queued=self._events_max_queued,
                                        rpc_timeout_s=self._rpc_timeout)
        log.info("kvoffload: %d workers registered; looking up blocks in their namespaces", len(by_rank))

    def namespace_ids(self, now: float | None = None) -> tuple[int, ...] | None:
        """Every rank's namespace id, resolved on the background thread and
        refreshed every ``namespace_refresh_s``; None until all resolve.
        ``now``: the clock's time, where the caller has read it."""
        if self._fingerprints is None and self._rank_keys and self.disabled is None:
            return self._discover()
        if self._fingerprints is None:
            self._asked_blind += 1
            if self._asked_blind == 1000:
                self._warn_once("handshake", "kvoffload: no worker has reported its registration through vLLM's "
                                "handshake metadata after 1000 lookups (this vLLM may not deliver it): no external "
                                "hits are offered, blocks are still stored")
            return None
        now = self._clock() if now is None else now
        if self._mirror is not None and self._ns_ids and self._ns_task is None and self._mirror.wants_ids():
            # The mirror's stream ended (a daemon restart?): the ids may
            # have changed with the daemon; resolve them now.
            self._ns_next = min(self._ns_next, now)
        t = self._ns_task
        if t is not None and t.done.is_set():
            self._ns_task = None
            ids = t.result if t.error is None else None
            if ids and all(ids):
                self._ns_ids, self._ns_next = tuple(ids), now + self._ns_refresh
                self._resetting = False
                self._since_reset = None
                if self._mirror is not None:
                    self._mirror.follow(self._ns_ids)
            else:
                # After a reset the workers register the new identity within
                # a step or two: look again soon.
                # (Counted from the answer: one that came while nobody asked
                # is not waited on again.)
                self._ns_ids = None
                self._ns_next = (t.finished_at or now) + (min(0.02, self._ns_retry) if self._resetting
                                                          else self._ns_retry)
        if self._ns_task is None and now >= self._ns_next and self._io.healthy():
            fps = [self._fingerprints[r] for r in sorted(self._fingerprints)]
            timeout = self._rpc_timeout
            self._ns_task = self._io.submit(lambda c: c.resolve(fps, timeout=timeout))
        return self._ns_ids

    def _derive(self, base: Mapping[tuple, bytes]) -> dict[tuple, bytes]:
        """Every rank's fingerprint under the current identity."""
        return {r: derive_fingerprint(fp, self._token) for r, fp in base.items()}

    def reset(self) -> bool:
        """vLLM's ``reset_cache`` (a weight update, ``reset_prefix_cache``):
        from now on this engine neither loads nor stores anything under its
        old identity. A new identity (a fresh token that every rank's
        fingerprint is derived from; no other engine can derive the same)
        goes to the workers in the next plan, before they load or store
        anything under it; lookups and loads not yet made are dropped, the
        loads the workers have in flight are reported failed (vLLM
        recomputes them), and the requests the engine holds never store
        again unless vLLM recomputes them from scratch (a preemption).
        The old identity's blocks are invalidated in the daemon, so they do
        not hold its capacity (an engine still running the old weights under
        it loses them too). True when the daemon confirmed that
        invalidation; False when it could not be reached (the new identity
        holds all the same)."""
        old_fps = list(self._fingerprints.values()) if self._fingerprints else []
        self._gen += 1
        self._token = secrets.token_bytes(16)
        if self._base_fps is not None:
            self._fingerprints = self._derive(self._base_fps)
            if self._infos is not None:
                self._events_fp = self._fingerprints[min(self._fingerprints, key=str)]
        self._ns_ids, self._ns_task, self._ns_next = None, None, 0.0
        self._resetting = True
        self._since_reset = set()
        for rec in list(self._lookups.values()) + list(self._matched.values()):
            self._drop(rec)
        self._lookups.clear()
        self._matched.clear()
        self._batch = []
        self._shadow = []
        self._mirror_asked = []
        for rid, jobs in self._loads.items():
            # Planned under the old identity and not yet sent: fail them.
            self._loads[rid] = [GroupJob(j.group, [], j.block_ids) for j in jobs]
        for st in self._reqs.values():
            # Their KV so far was computed with the old weights.
            st.next_store_unit = 0
        log.warning("kvoffload: cache reset: this engine's identity is now generation %d; nothing stored before "
                    "is loaded again", self._gen)
        try:
            ids = [i for i in (self._client.resolve(old_fps, timeout=self._rpc_timeout) if old_fps else []) if i]
            if ids:
                removed = self._client.invalidate(ids)
                log.info("kvoffload: cache reset: %d blocks of the old identity invalidated in %d namespaces",
                         removed, len(ids))
            elif not self._client.healthy(timeout=self._rpc_timeout):
                raise KVOffloadError(None, "the daemon is not serving", from_daemon=False)
        except KVOffloadError as e:
            log.warning("kvoffload: cache reset: the daemon could not invalidate the old identity's blocks (%s); "
                        "reporting the reset failed (the new identity holds: nothing old is loaded)", e)
            return False
        return True

    def _hashes(self, request: Any, publishable: bool = False) -> list[bytes] | None:
        hashes = getattr(request, "block_hashes", None)
        if not hashes:
            return []
        if publishable:
            n = getattr(request, "num_publishable_block_hashes", None)
            if n is not None:
                hashes = hashes[: max(0, int(n))]
                if not hashes:
                    return []
        h0 = hashes[0]
        if not isinstance(h0, (bytes, bytearray)) or len(h0) != self.hash_bytes:
            self.disable(
                f"block hashes are {type(h0).__name__} of {len(h0) if isinstance(h0, (bytes, bytearray)) else '?'} "
                f"bytes, the namespace uses {self.hash_bytes}-byte hashes"
            )
            return None
        return hashes

    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _ReqState(request, [[] for _ in range(self.keys.num_groups)], controls=request_controls(request),
                           gen=self._gen)
            self._reqs[request.request_id] = st
        else:
            st.request = request
        return st

    def _jobs(self, hashes: Sequence[bytes], groups: Sequence[Sequence[int | None]], start: int, end: int,
              leases: Mapping[int, int] | None = None, request: Any = None,
              load: bool = False) -> list[GroupJob]:
        """The jobs that move units [start, end) of a request. A windowed
        group moves less: a load only the window ending at ``end`` (what the
        hit was looked up for), a store only the blocks some hit's window
        can contain (KeyMapper.stores_block). vLLM's null blocks never move."""
        jobs = []
        for g in range(self.keys.num_groups):
            blocks = self._moved_blocks(g, start, end, load)
            ids = groups[g]
            keys = self.keys.keys(hashes, g, blocks)
            pairs = [(k, ids[i]) for k, i in zip(keys, blocks) if ids[i] is not None and ids[i] != self.null_block_id]
            if pairs and self._infos is not None and request is not None:
                self._remember(request, hashes, g, [i for i in blocks if ids[i] is not None and ids[i] != self.null_block_id])
            if pairs:
                jobs.append(GroupJob(g, [k for k, _ in pairs], [int(b) for _, b in pairs],
                                     (leases or {}).get(g, 0)))
        return jobs

    def _moved_blocks(self, g: int, start: int, end: int, load: bool) -> Sequence[int]:
        if g in self.keys.scratch_groups:  # never stored or loaded: vLLM rebuilds it
            return ()
        rng = self.keys.block_range(g, start, end)
        if self.keys.windows[g] is None:
            return rng
        if load:
            w = self.keys.window_blocks(g, end)
            return range(max(rng.start, w.start), rng.stop)
        return [i for i in rng if self.keys.stores_block(g, i)]

    def _outside_window(self, groups: Sequence[Sequence[int | None]], start: int, end: int) -> list[int]:
        """Windowed groups whose allocation for a load of units [start, end)
        has a real block outside the window ending at ``end``: a block vLLM
        counts as computed that the load would not fill."""
        bad = []
        for g in self.keys.windowed_groups:
            w = self.keys.window_blocks(g, end)
            ids = groups[g]
            if any(ids[i] is not None and ids[i] != self.null_block_id
                   for i in self.keys.block_range(g, start, end) if i < w.start):
                bad.append(g)
        return bad

    def _remember(self, request: Any, hashes: Sequence[bytes], g: int, blocks: Sequence[int]) -> None:
        """Keeps what vLLM's BlockStored says of group ``g``'s blocks beyond
        their keys (kvoffload.kv_events.remember)."""
        remember(self._infos, request, hashes, g, blocks, self.keys.factors[g], self.keys.block_sizes[g])

    def take_kv_events(self, types: VLLMEventTypes) -> list[Any]:
        """What the daemon's tiers gained and lost since the last call, as
        vLLM's KV cache events, in order (kvoffload.kv_events)."""
        if self.events is None or self._infos is None:
            return []
        raw = self.events.take()
        return translate(raw, self._infos, self.keys.block_sizes, types) if raw else []

    # -- lookups ------------------------------------------------------------

    def _flush(self) -> None:
        """Sends the lookups vLLM asked for since the last flush, all at
        once, unless ``_MAX_LOOKUP_TASKS`` batches are still queued or
        running (they go with a later flush), and the leases no load will
        name."""
        self._release_spare()
        for rec in self._unrecorded:
            self._record(rec, rec.keys_asked)
        self._unrecorded = []
        for rec in self._mirror_asked:
            shadow = _Lookup(rec.key, rec.hashes, False, rec.created)
            self._batch.append(shadow)
            self._shadow.append((rec, shadow))
        self._mirror_asked = []
        if self._shadow:
            self._compare_shadows()
        self._lookup_tasks = [t for t in self._lookup_tasks if not t.done.is_set()]
        if not self._batch or len(self._lookup_tasks) >= _MAX_LOOKUP_TASKS:
            return
        batch, self._batch = self._batch, []
        now = self._clock()
        task = self._io.submit(self._batch_fn(batch))
        self._lookup_tasks.append(task)
        for rec in batch:
            rec.submitted = now
            rec.task = task

    def _drop(self, rec: _Lookup | None) -> None:
        """A lookup no load will use: its leases are released (now, or once
        the thread is done with it), and one not yet sent is not sent."""
        if rec is None:
            return
        if rec.task is None and rec in self._batch:
            self._batch.remove(rec)
        if not self._lease_ms:
            return
        if rec.done:
            self._spare.extend(rec.leases.values())
            rec.leases = {}
        elif rec.task is not None:
            self._orphans.append(rec)

    def _release_spare(self) -> None:
        """Sends ReleaseLeases for the leases no load will name (one call
        at a time, on the background thread)."""
        if not self._lease_ms:
            return
        keep = []
        for rec in self._orphans:
            if rec.done:
                self._spare.extend(rec.leases.values())
                rec.leases = {}
            else:
                keep.append(rec)
        self._orphans = keep
        t = self._release_task
        if t is not None and t.done.is_set():
            self._release_task = None
            if t.error is None:
                self._released += int(t.result or 0)
        if not self._io.healthy() or len(self._spare) > 4 * _MAX_SPARE_LEASES:
            # Not sent to a daemon that may have restarted since (its lease
            # ids start again and could name this connection's new leases):
            # they expire after lease_ms.
            self._spare = []
        if not self._spare or self._release_task is not None:
            return
        ids = self._spare[:_MAX_SPARE_LEASES]
        del self._spare[:_MAX_SPARE_LEASES]
        timeout = self._rpc_timeout
        self._release_task = self._io.submit(lambda c: c.release_leases(ids, timeout=timeout))

    def _batch_fn(self, batch: list[_Lookup]):
        """What the background thread runs: every lookup of the batch, in a
        few round trips (docs/vllm.md, hybrid models). First, per request,
        each full-attention group's keys in [start, end) with a lease, and,
        when the engine already holds a local prefix, whether the daemon
        holds it too (a peek of the blocks stores keep). The full-attention
        groups' ready prefix is the candidate hit F (a model without them
        starts from ``end``); then each windowed group's window ending at F,
        its keys last first, so that the daemon's ready count is the
        window's trailing run: a run short of the window moves F to the last
        unit boundary at or before the block missing, and the windows ending
        there are looked up next, at most ``window_rounds`` times. Where
        every window fits in one unit (the windows of two candidates never
        overlap), each round after the first also peeks at the windows of
        the ``window_probes`` units below the candidate; the next candidate
        is the longest one no block known missing rules out, settled at
        once when a probe found it whole and no lease is asked for."""
        keys, lease_ms, timeout = self.keys, self._lease_ms, self._rpc_timeout
        full, windowed = keys.full_groups, keys.windowed_groups
        bpu = keys.blocks_per_unit
        rounds = self._window_rounds
        tier_group = self._tier_group
        probes = self._probes()

        def lookup(client: Client, calls: list) -> list:
            try:
                return client.lookup_many(calls, timeout=timeout)
            except BaseException as e:
                for rec in batch:
                    if not rec.done:
                        rec.error, rec.done = e, True
                raise

        def window_of(rec: _Lookup, g: int, f: int) -> range:
            w = keys.window_blocks(g, f)
            return range(max(w.start, rec.key[0] * bpu[g]), w.stop)

        def ruled_out(rec: _Lookup, c: int, missing: list[set[int]]) -> bool:
            return any(not missing[j].isdisjoint(window_of(rec, g, c)) for j, g in enumerate(windowed))

        def run(client: Client) -> None:
            t0 = time.monotonic()
            calls, spans = [], []
            for rec in batch:
                start, end, ns = rec.key
                first = len(calls)
                for g in full:
                    calls.append((ns, keys.keys(rec.hashes, g, keys.block_range(g, start, end)), g, lease_ms, rec.peek))
                for g in range(keys.num_groups if start > 0 else 0):
                    calls.append((ns, keys.keys(rec.hashes, g, keys.stored_blocks(g, 0, start)), g, 0, True))
                spans.append((first, len(calls)))
            results = lookup(client, calls)
            down = None
            cand: dict[int, int] = {}  # batch index -> candidate end unit, windows not yet checked
            asked: dict[int, list[list[int]]] = {}  # batch index -> per windowed group, the blocks asked
            missing: dict[int, list[set[int]]] = {}  # batch index -> per windowed group, blocks known missing
            for n, (rec, (a, b)) in enumerate(zip(batch, spans)):
                rs = results[a:b]
                errs = [r for r in rs if isinstance(r, KVOffloadError)]
                if errs:
                    rec.error = errs[0]
                    rec.spare += [r.lease_id for r in rs if not isinstance(r, KVOffloadError) and r.lease_id]
                    down = down or next((e for e in errs if e.code in _DOWN_CODES), None)
                    continue
                start, end, _ = rec.key
                nf = len(full)
                if start > 0 and full:
                    rec.prefix_tiers = list(rs[nf + tier_group].tiers)
                f = start + min([end - start] + [rs[i].ready // bpu[g] for i, g in enumerate(full)])
                rec.keys_asked = sum(len(keys.block_range(g, start, end)) for g in full)
                rec.leases = {g: rs[i].lease_id for i, g in enumerate(full) if rs[i].lease_id}
                if full:
                    rec.tiers = list(rs[full.index(tier_group)].tiers)
                # (A scratch group stores nothing: it holds no prefix back.)
                rec.ready_before = min([start] + [r.ready // keys.stored_per_unit(g) for g, r in enumerate(rs[nf:])
                                                  if g not in keys.scratch_groups])
                rec.hit_units = f - start
                if windowed and f > start:
                    cand[n] = f
                    asked[n] = [[] for _ in windowed]
                    missing[n] = [set() for _ in windowed]
            nw = len(windowed)
            for round_no in range(rounds):
                if not cand or down is not None:
                    break
                calls, order = [], []
                budget = _PROBE_BATCH_CALLS
                for n, f in cand.items():
                    rec = batch[n]
                    # The candidate (with the lease), then the probes below
                    # it (peeks): from the second round, when the first
                    # candidate already missed.
                    cs = [f]
                    if probes and round_no > 0:
                        cs += [c for c in range(f - 1, max(rec.key[0], f - 1 - probes), -1)
                               if not ruled_out(rec, c, missing[n])][:budget // len(windowed)]
                        budget -= (len(cs) - 1) * len(windowed)
                    for i, c in enumerate(cs):
                        for j, g in enumerate(windowed):
                            blocks = window_of(rec, g, c)
                            asked[n][j].extend(blocks)
                            rec.keys_asked += len(blocks)
                            calls.append((rec.key[2], keys.keys(rec.hashes, g, blocks[::-1]), g,
                                          lease_ms if i == 0 else 0, rec.peek or i > 0))
                    order.append((n, cs))
                results = lookup(client, calls)
                nxt: dict[int, int] = {}
                at = 0
                for n, cs in order:
                    rec = batch[n]
                    rs = results[at:at + nw * len(cs)]
                    at += nw * len(cs)
                    errs = [r for r in rs if isinstance(r, KVOffloadError)]
                    # The candidate's leases: kept only where it settles.
                    cand_leases = [r.lease_id for r in rs[:nw] if not isinstance(r, KVOffloadError) and r.lease_id]
                    if errs:
                        rec.error = errs[0]
                        rec.spare += cand_leases
                        down = down or next((e for e in errs if e.code in _DOWN_CODES), None)
                        continue
                    whole = {}  # candidate -> its windows' answers, where every window is there
                    for i, c in enumerate(cs):
                        crs = rs[i * nw:(i + 1) * nw]
                        for j, g in enumerate(windowed):
                            blocks = window_of(rec, g, c)
                            if crs[j].ready < len(blocks):
                                missing[n][j].add(blocks.stop - 1 - crs[j].ready)
                        if all(crs[j].ready >= len(window_of(rec, g, c)) for j, g in enumerate(windowed)):
                            whole[c] = crs
                    # The longest candidate no block known missing rules out
                    # (every one above the last candidate was ruled out).
                    f = cs[0]
                    nf = next((c for c in range(f, rec.key[0], -1) if not ruled_out(rec, c, missing[n])), rec.key[0])
                    if not (nf == f and nf in whole):
                        rec.spare += cand_leases  # a candidate this round rejected
                    if nf in whole and (nf == f or not lease_ms):
                        # Every window ending at nf is there: the hit stands,
                        # held by this round's leases (a probe's hit asks
                        # for none: none was asked for).
                        crs = whole[nf]
                        rec.hit_units = nf - rec.key[0]
                        rec.leases.update({g: crs[j].lease_id for j, g in enumerate(windowed) if crs[j].lease_id})
                        if not full:
                            rec.tiers = self._window_tiers(crs[windowed.index(tier_group)].tiers, nf * bpu[tier_group])
                        inside = [set(window_of(rec, g, nf)) for g in windowed]
                        rec.keys_outside = sum(1 for j in range(nw) for i in asked[n][j] if i not in inside[j])
                    elif nf <= rec.key[0]:
                        rec.hit_units = 0
                    else:
                        nxt[n] = nf
                cand = nxt
            for n in cand:
                batch[n].hit_units = 0  # not settled within the rounds: a miss
            took = time.monotonic() - t0
            spare = []
            for rec in batch:
                if rec.error is not None or rec.hit_units <= 0:
                    rec.spare += rec.leases.values()
                    rec.leases = {}
                spare += rec.spare
                rec.spare = []
                rec.took = took
                rec.done = True
            if spare and down is None:
                # Leases no load will name (candidates rejected, misses):
                # released now rather than held until lease_ms.
                try:
                    self._thread_released += client.release_leases(spare[:_MAX_SPARE_LEASES], timeout=timeout)
                except KVOffloadError as e:
                    log.info("kvoffload: ReleaseLeases failed (%s); those leases expire after lease_ms", e)
            if down is not None:
                raise down

        return run

    def _probes(self) -> int:
        """Probes a lookup round after the first makes below its candidate
        (``window_probes``): none unless every window fits in one unit."""
        keys, windowed = self.keys, self.keys.windowed_groups
        if windowed and all(keys.windows[g] <= keys.blocks_per_unit[g] for g in windowed):
            # Each probe is a Lookup per windowed group: at most
            # _PROBE_CALLS of them per request a round.
            return min(self._window_probes, max(1, _PROBE_CALLS // len(windowed)))
        return 0

    @staticmethod
    def _window_tiers(tiers: Sequence[Any], blocks: int) -> list:
        """Where a hit's blocks are, from a windowed group's reversed window
        (a model without full attention): the window's tiers in order, the
        blocks before it taken as where the window's first block is."""
        fwd = list(tiers)[::-1]
        return ([fwd[0]] * max(0, blocks - len(fwd)) + fwd) if fwd else []

    def _cover(self, rec: _Lookup, key: tuple) -> _Lookup | None:
        """The answer a finished lookup gives for ``key`` (same namespaces):
        itself for its own range, a lookup of the same findings for another
        start (vLLM's local hit moved since it was asked: a prefill of the
        same prefix went on, or blocks of it were evicted), or None when
        what it found says nothing about that start.

        It found a run the daemon holds from the request's start (its local
        prefix's peek, ``ready_before`` units) and one from its own start
        (the hit); a unit right past either run is missing. An ask from
        inside a run is that run's hit from there; from a missing unit, a
        miss. A windowed group's windows were looked up ending at the hit's
        end only: from a start within the hit, the same end."""
        if rec.key == key or rec.error is not None:
            return rec
        s0, e0, _ = rec.key
        s, e, _ = key
        f = s0 + max(0, rec.hit_units)
        bpu = self.keys.blocks_per_unit[self._tier_group]
        if self.keys.windowed_groups:
            if not s0 <= s < f or f > e:
                return None
            hit, tiers = f - s, list(rec.tiers)[(s - s0) * bpu:]
        else:
            held0 = rec.ready_before if s0 > 0 else 0  # the run from 0
            if held0 >= s0:
                held0 = f  # the peek's run and the hit are one
            if s < held0:
                hit = held0 - s
                tiers = list(rec.prefix_tiers)[s * bpu:held0 * bpu]
                if held0 > s0:
                    tiers = (tiers + list(rec.tiers))[:hit * bpu]
            elif s0 <= s < f:
                hit, tiers = f - s, list(rec.tiers)[(s - s0) * bpu:]
            elif (s == held0 < s0) or (s == f < e0):
                hit, tiers = 0, []  # the unit at s was missing
            else:
                return None
            hit = min(hit, e - s)
        held = rec.ready_before if rec.ready_before < s0 else f
        return _Lookup(key, rec.hashes, rec.peek, rec.created, submitted=rec.submitted, done=True, hit_units=hit,
                       ready_before=min(held, s), leases=rec.leases, tiers=tiers, took=rec.took,
                       answered_at=rec.answered_at)

    def _answer(self, rid: str, base: _Lookup, rec: _Lookup) -> tuple[int, bool]:
        """The answer ``rec`` gives (``base`` itself or what it found for
        another start, :meth:`_cover`): vLLM's wait for it ends. (A mirror's
        answer: :meth:`_from_mirror`.)"""
        self._asked.pop(rid, None)
        if base.answered_at == 0.0:
            base.answered_at = rec.answered_at = self._clock()
            if rec.error is not None:
                rec.hit_units = base.hit_units = 0
                e = rec.error
                if not isinstance(e, KVOffloadError):
                    log.error("kvoffload: lookup failed: %r", e)
                else:
                    self._warn_once(f"lookup:{e.code}", "kvoffload: Lookup failed (%s); treating it as a miss", e)
                    self._ns_next = 0.0  # namespaces may have changed: resolve again
            else:
                self._record(rec, base.keys_asked)
        return self._offer(rid, rec, rec.hit_units)

    def _offer(self, rid: str, rec: _Lookup, hit: int) -> tuple[int, bool]:
        """vLLM's answer for ``hit`` units of ``rec``, the load planned from it."""
        if hit <= 0:
            self._matched.pop(rid, None)
            self._hit_tiers.pop(rid, None)
            return 0, False
        self._matched[rid] = rec
        self._hit_tiers[rid] = rec.tiers[: self.keys.blocks_per_unit[self._tier_group] * hit]
        return hit * self.keys.unit_tokens, True

    def _record(self, rec: _Lookup, keys_asked: int) -> None:
        self.stats.lookup(rec.took, rec.hit_units * self.keys.unit_tokens, self._tier_tokens(rec.tiers, rec.hit_units),
                          keys=keys_asked, outside_window=rec.keys_outside if rec.hit_units > 0 else 0)

    def hit_sources(self, rid: str, num_external_tokens: int) -> dict[str, int]:
        """The tokens of a request's external hit by the tier they come
        from (``cpu``, ``disk``, ``remote``), as the lookup that offered them
        said (by the first full-attention group's blocks)."""
        tiers = self._hit_tiers.get(rid)
        if not tiers or num_external_tokens <= 0:
            return {}
        bs = self.keys.block_sizes[self._tier_group]
        out: dict[str, int] = {}
        left = int(num_external_tokens)
        for t in tiers:
            if left <= 0:
                break
            n = min(bs, left)
            name = "cpu" if t in (Tier.CPU, Tier.CPU_AND_DISK) else "remote" if t == Tier.REMOTE else "disk"
            out[name] = out.get(name, 0) + n
            left -= n
        if left > 0:  # more than the lookup offered: not ours to name
            out["remote"] = out.get("remote", 0) + left
        return out

    def _tier_tokens(self, tiers: Sequence[Any], hit_units: int) -> dict[str, int]:
        """Hit tokens by the tier the tier group's blocks came from."""
        n = self.keys.blocks_per_unit[self._tier_group] * hit_units
        if n <= 0:
            return {}
        bs = self.keys.block_sizes[self._tier_group]
        ts = list(tiers[:n])  # counted in C: this runs on vLLM's loop
        cpu = ts.count(Tier.CPU) + ts.count(Tier.CPU_AND_DISK)
        remote = ts.count(Tier.REMOTE)
        out = {name: k * bs for name, k in (("cpu", cpu), ("remote", remote), ("disk", len(ts) - cpu - remote)) if k}
        return out

    def _fresh(self, rec: _Lookup, now: float) -> bool:
        if rec.hit_units > 0:
            # A hit holds while its lease does (half of it), else a while.
            ttl = self._lease_ms / 2000.0 if self._lease_ms else 2 * self._miss_ttl
            return now < rec.answered_at + ttl
        return now < rec.answered_at + self._miss_ttl

    # -- vLLM's scheduler-side calls ---------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose blocks the daemon holds
        in every rank's namespace, as (tokens, True) (they load
        asynchronously), (0, False) for none, or (None, False) when the
        answer is not back yet (vLLM asks again next step). At least the last
        prompt token is always left to compute."""
        if self.disabled is not None or not self.offer_hits:
            return 0, False
        rid = request.request_id
        if getattr(request, "skip_reading_prefix_cache", False) or (
                getattr(request, "kv_transfer_params", None) and not request_controls(request).load):
            return 0, False
        if rid in self._no_hits or self._unregistered:
            return 0, False
        hashes = getattr(request, "block_hashes", None)
        if not hashes:
            return 0, False
        h0 = hashes[0]
        if type(h0) is not bytes or len(h0) != self.hash_bytes:
            hashes = self._hashes(request)  # the whole check (and the connector off on a wrong size)
            if not hashes:
                return 0, False
        keys = self.keys
        n, tokens, hb = len(hashes), int(request.num_tokens), keys.hash_block_size
        if not check_hash_granularity(n, tokens, hb):
            self.disable(
                f"request {rid} has {n} block hashes for {tokens} tokens: vLLM does not hash "
                f"every {hb} tokens as this connector computed (see docs/vllm.md, hash block size)"
            )
            return 0, False
        U = keys.unit_tokens
        if num_computed_tokens % U:
            return 0, False
        start = num_computed_tokens // U
        end = keys.units_in(n, tokens - 1)
        if end <= start:
            return 0, False
        now = self._clock()
        mirror = self._mirror
        ns = self._ns_ids
        # The usual case, checked inline (this runs on vLLM's loop): the
        # namespaces resolved and not due again, the mirror live on them
        # (its stream up), where namespace_ids would only return them.
        live = (ns is not None and self._ns_task is None and now < self._ns_next and mirror is not None
                and mirror.live_ids == ns)
        if not live:
            ns = self.namespace_ids(now)
            live = bool(ns) and mirror is not None and mirror.live(ns)
        if live:
            got = self._from_mirror(rid, (start, end, ns), hashes, now)
            if got is not None:
                return got
        # vLLM's wait for this request's answer runs from its first ask,
        # whatever it passes on later ones (the local hit moves while it
        # waits): by ``lookup_deadline_s`` from there it has one.
        first = self._asked.setdefault(rid, now)
        late = now - first >= self._deadline
        if not ns and self._ns_task is not None and self._wait > 0 and self._step_wait_left > 0 and self._io.healthy():
            t0 = time.monotonic()
            self._ns_task.done.wait(self._step_wait_left)
            self._step_wait_left -= time.monotonic() - t0
            ns = self.namespace_ids()
        if not ns:
            if self._resetting and not self._stored_since_reset(hashes, start, end):
                # Since a cache reset the new identity's namespaces hold only
                # what this engine planned to store since (no other engine
                # derives its fingerprints): a request none of whose blocks
                # is among those is a miss now, not a step's wait for the
                # namespaces to resolve (under vLLM's real Scheduler every
                # waiting request waited 3-11 steps after each reset).
                return self._miss(rid)
            # Being resolved (just started, or after a daemon restart): ask again.
            if self._ns_task is not None and self._io.healthy() and not late:
                return None, False
            return self._miss(rid, timed_out=late)
        key = (start, end, tuple(ns))
        rec = self._lookups.get(rid)
        if rec is not None and (rec.key[2] != key[2] or (rec.done and rec.answered_at and not self._fresh(rec, now))):
            # Another identity's namespaces, or an answer too old to give again.
            self._lookups.pop(rid, None)
            self._drop(rec)
            rec = None
        if rec is not None and rec.task is None and not rec.done:
            rec.key, rec.hashes = key, list(hashes)  # not sent yet: it asks for this range
        if rec is not None and not rec.done:
            # In flight: it answers this ask once back (_cover), whatever
            # start vLLM passes now; it is not sent again meanwhile.
            if not self._await(rec):
                if late or not self._io.healthy():
                    return self._miss(rid, timed_out=True)
                return None, False
        if rec is not None:
            sub = self._cover(rec, key)
            if sub is not None:
                return self._answer(rid, rec, sub)
            # What it found says nothing of this start: look again.
            self._lookups.pop(rid, None)
            self._drop(rec)
        if late:
            return self._miss(rid, timed_out=True)
        if not self._io.healthy():
            return self._miss(rid)
        peek = rid in self._looked_up
        self._looked_up.add(rid)
        rec = _Lookup(key, list(hashes), peek, now)
        self._lookups[rid] = rec
        self._batch.append(rec)
        if self._await(rec):
            return self._answer(rid, rec, rec)
        return None, False

    def _from_mirror(self, rid: str, key: tuple, hashes: Sequence[bytes], now: float) -> tuple[int, bool] | None:
        """The lookup of ``key`` run against the mirror, on vLLM's loop (the
        daemon's rounds, probed in place: :meth:`_mirror_lookup`): the answer
        in this very step. None where the daemon must be asked: a hit short of the asked
        range once the daemon has shown a remote tier (other nodes' blocks
        are not all mirrored). The daemon still sees the lookup (its
        admission policy counts the keys as accessed): the same lookup goes
        with the step's batch, and its answer is compared, not used."""
        # bytes, as the mirror's keys (vLLM's are; a bytearray is no dict key)
        rec = _Lookup(key, list(hashes) if type(hashes[0]) is bytes else [bytes(h) for h in hashes], True, now)
        self._mirror_lookup(rec)
        hit = rec.hit_units
        if hit < key[1] - key[0] and (self._mirror.remote_seen or self._mirror_behind(rec, now)):
            if not self._mirror.remote_seen:
                self.mirror_behind += 1
            return None
        if rid not in self._looked_up and len(self._batch) + len(self._mirror_asked) < _MAX_SPARE_LEASES:
            self._looked_up.add(rid)
            self._mirror_asked.append(rec)  # its lookup goes with the step's batch (_flush), not from here
        old = self._lookups.pop(rid, None)
        if old is not None:
            self._drop(old)
        self._lookups[rid] = rec
        self.mirror_answers += 1
        # _answer's, for a lookup answered now: its stats and the daemon's
        # lookup of the same (above) go with the step's flush
        # (build_connector_meta), not from this call.
        self._asked.pop(rid, None)
        rec.answered_at = now
        if len(self._unrecorded) < _MAX_SPARE_LEASES:
            self._unrecorded.append(rec)
        else:
            self._record(rec, rec.keys_asked)
        return self._offer(rid, rec, hit)

    def _mirror_lookup(self, rec: _Lookup) -> None:
        """What ``_batch_fn([rec])`` finds in the mirror (no lease: the
        mirror runs only without one), probed in place: each full-attention
        group's keys of [start, end), the local prefix's stored blocks when
        there is one, then the windowed groups' rounds
        (:meth:`_mirror_windows`). No key list, request or result object is
        built per group: this runs on vLLM's loop."""
        t0 = time.monotonic()
        keys, held = self.keys, self._mirror.held
        start, end, ns = rec.key
        hashes = rec.hashes  # bytes (_from_mirror)
        if keys.plain:
            # Most models: a unit is one block of the one full-attention
            # group, keyed by its own hash. Probed with the least code: on
            # vLLM's loop the code is as cold as the data, and every line
            # costs (docs/vllm.md, Lookups in the step they are asked).
            g = keys.full_groups[0]
            rec.tiers = tiers = held(ns, g, hashes, 1, start, end)
            rec.hit_units, rec.keys_asked = len(tiers), end - start
            if start > 0:
                rec.prefix_tiers = tiers = held(ns, g, hashes, 1, 0, start)
                rec.ready_before = len(tiers)
            rec.took = time.monotonic() - t0
            rec.done = True
            return
        tail = self._mirror.tail
        bpu, factors = keys.blocks_per_unit, keys.factors
        f = end
        asked = 0
        for g in keys.full_groups:
            k = bpu[g]
            tiers = held(ns, g, hashes, factors[g], start * k, end * k)
            f = min(f, start + len(tiers) // k)
            asked += (end - start) * k
            if g == self._tier_group:
                rec.tiers = tiers
        if start > 0:
            before = start
            for g in keys.full_groups:
                k = bpu[g]
                tiers = held(ns, g, hashes, factors[g], 0, start * k)
                before = min(before, len(tiers) // k)
                if g == self._tier_group:
                    rec.prefix_tiers = tiers
            for g in keys.windowed_groups:
                # The leading units whose stored blocks (the last
                # stored_per_unit of each) are all there.
                k, n, fa = bpu[g], keys.stored_per_unit(g), factors[g]
                for u in range(before):
                    if tail(ns, g, hashes, fa, (u + 1) * k - n, (u + 1) * k) < n:
                        before = u
                        break
            rec.ready_before = before
        rec.keys_asked = asked
        rec.hit_units = f - start
        if keys.windowed_groups and f > start:
            self._mirror_windows(rec, hashes, f)
        rec.took = time.monotonic() - t0
        rec.done = True

    def _mirror_windows(self, rec: _Lookup, hashes: Sequence[bytes], f: int) -> None:
        """The windowed groups' rounds of :meth:`_batch_fn` for one lookup
        without a lease, probed in the mirror: per round the candidate
        ``f``'s windows (and from the second round the probes below it no
        block known missing rules out), each window's trailing run; the
        block below a short run is missing; the next candidate is the
        longest one none rules out, settled when its windows were all
        there. Sets the hit, keys asked and those outside the hit's windows
        exactly as the rounds do."""
        keys, tail = self.keys, self._mirror.tail
        windowed, windows, bpu, factors = keys.windowed_groups, keys.windows, keys.blocks_per_unit, keys.factors
        start, _, ns = rec.key
        no_full = not keys.full_groups
        tj = windowed.index(self._tier_group) if no_full else -1
        # The first round's candidate whole in every windowed group (most
        # hits): settled there, as the rounds settle it (its windows are
        # the keys asked, none outside), without their bookkeeping.
        tiers: list | None = [] if no_full else None
        asked = 0
        for j, g in enumerate(windowed):
            hi = f * bpu[g]
            lo = max(hi - windows[g], start * bpu[g])
            asked += hi - lo
            if tail(ns, g, hashes, factors[g], lo, hi, tiers if j == tj else None) < hi - lo:
                break
        else:
            rec.keys_asked += asked
            rec.hit_units = f - start
            if no_full:
                rec.tiers = self._window_tiers(tiers, f * bpu[self._tier_group])
            rec.keys_outside = 0
            return
        nw = len(windowed)
        probes = self._probes()

        def window(j: int, c: int) -> tuple[int, int]:  # _batch_fn's window_of
            g = windowed[j]
            stop = c * bpu[g]
            return max(stop - windows[g], start * bpu[g]), stop

        def ruled_out(c: int) -> bool:
            for j in range(nw):
                if missing[j]:
                    lo, hi = window(j, c)
                    for b in missing[j]:
                        if lo <= b < hi:
                            return True
            return False

        missing: list[set[int]] = [set() for _ in windowed]
        spans: list[list[tuple[int, int]]] = [[] for _ in windowed]  # the windows asked
        for round_no in range(self._window_rounds):
            cs = [f]
            if probes and round_no > 0:
                cs += [c for c in range(f - 1, max(start, f - 1 - probes), -1)
                       if not ruled_out(c)][:_PROBE_BATCH_CALLS // nw]
            whole: dict[int, list] = {}  # candidate -> the tier group's window tiers (no full groups), all there
            for c in cs:
                ok, tiers = True, ([] if no_full else None)
                for j, g in enumerate(windowed):
                    lo, hi = window(j, c)
                    spans[j].append((lo, hi))
                    rec.keys_asked += hi - lo
                    got = tail(ns, g, hashes, factors[g], lo, hi, tiers if j == tj else None)
                    if got < hi - lo:
                        missing[j].add(hi - 1 - got)
                        ok = False
                if ok:
                    whole[c] = tiers
            nf = next((c for c in range(f, start, -1) if not ruled_out(c)), start)
            if nf in whole:
                rec.hit_units = nf - start
                if no_full:
                    rec.tiers = self._window_tiers(whole[nf], nf * bpu[self._tier_group])
                out = 0
                for j in range(nw):
                    ilo, ihi = window(j, nf)
                    out += sum(hi - lo - max(0, min(hi, ihi) - max(lo, ilo)) for lo, hi in spans[j])
                rec.keys_outside = out
                return
            if nf <= start:
                break
            f = nf
        rec.hit_units = 0  # a miss, or not settled within the rounds

    def _stored_since_reset(self, hashes: Sequence[bytes], start: int, end: int) -> bool:
        """Whether a block of units [start, end) is one this engine planned
        to store since the last reset (True when it kept too many to tell)."""
        since = self._since_reset
        if since is None:
            return True
        if not since:
            return False
        for g in range(self.keys.num_groups):
            for k in self.keys.keys(hashes, g, self.keys.block_range(g, start, end)):
                if (g, bytes(k)) in since:
                    return True
        return False

    def _note_stores(self, jobs: Sequence[GroupJob]) -> None:
        now = self._clock()
        recent = self._recent
        for j in jobs:
            for h in j.hashes:
                k = (j.group, bytes(h))
                recent[k] = now
                recent.move_to_end(k)
        while len(recent) > _RECENT_STORES:
            recent.popitem(last=False)

    def _mirror_behind(self, rec: _Lookup, now: float) -> bool:
        """Whether a block of the first unit past the mirror's hit is one
        this engine planned to store within the last second: its event may
        not be mirrored yet (the daemon is asked instead). A unit no store
        of ours wrote lately is as missing in the daemon as in the mirror
        (unless another engine stored it this very moment)."""
        recent = self._recent
        if not recent:
            return False
        keys, hashes = self.keys, rec.hashes  # bytes (_from_mirror), as _recent's keys
        held, ns = self._mirror.held, rec.key[2]
        u = rec.key[0] + rec.hit_units
        if keys.plain:  # the one block of unit u
            g = keys.full_groups[0]
            t = recent.get((g, hashes[u]))
            return t is not None and now - t < _RECENT_STORE_S and not held(ns, g, hashes, 1, u, u + 1)
        # A windowed group's missing block may lie anywhere up to the end
        # (the windows of every candidate were asked): all of them there.
        for g in keys.full_and_windowed:
            stop = u + 1 if keys.windows[g] is None else rec.key[1]
            f, k = keys.factors[g], keys.blocks_per_unit[g]
            for i in range(u * k, stop * k):
                t = recent.get((g, hashes[(i + 1) * f - 1]))
                # One whose event came (every rank's) is no reason: a
                # windowed group's recent blocks around a missing one
                # (Mamba state stored at a prompt's end, not at the hit's
                # edge) sent every such repeat to the daemon, a step's wait.
                if t is not None and now - t < _RECENT_STORE_S and not held(ns, g, hashes, f, i, i + 1):
                    return True
        return False

    def _compare_shadows(self) -> None:
        """Whether the daemon's lookups of the requests the mirror answered
        found remote blocks: then other nodes' blocks are not all mirrored,
        and a mirror's answer short of the asked range goes to the daemon."""
        keep = []
        for mine, theirs in self._shadow:
            if not theirs.done:
                keep.append((mine, theirs))
            elif theirs.error is None and any(t == Tier.REMOTE for t in theirs.tiers):
                self._mirror.remote_seen = True
        self._shadow = keep[-_MAX_SPARE_LEASES:]

    def _miss(self, rid: str, timed_out: bool = False) -> tuple[int, bool]:
        """Answers a miss (the lookup in flight, if any, stays: it is not
        sent again, and a later ask may use what it finds)."""
        if timed_out:
            self.stats.lookup_timeout()
        self._asked.pop(rid, None)
        self._matched.pop(rid, None)
        self._hit_tiers.pop(rid, None)
        return 0, False

    def _await(self, rec: _Lookup) -> bool:
        """Sends the lookup now and waits for its answer while this step's
        ``lookup_wait_s`` lasts (a daemon that answers within it costs the
        request no step); False when it is not back (vLLM asks again next
        step: None), the lookup going out with the step's batch."""
        if self._wait > 0 and self._step_wait_left > 0 and self._io.healthy():
            self._flush()
            t0 = time.monotonic()
            if rec.task is not None:
                rec.task.done.wait(self._step_wait_left)
            self._step_wait_left -= time.monotonic() - t0
        return rec.done

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plans the load of ``num_external_tokens`` tokens into the blocks
        vLLM just allocated (``blocks`` holds every block of the request)."""
        rid = request.request_id
        st = self._state(request)
        rec = self._matched.pop(rid, None)
        base = self._lookups.pop(rid, None)
        self._asked.pop(rid, None)
        if rec is None or num_external_tokens <= 0:
            # Its leases (if any) are named by no load.
            self._drop(base)
            if rec is not None and rec is not base:
                self._drop(rec)
        # Blocks the daemon already holds (the local prefix it has, what this
        # load brings) are not stored again; a local prefix it lacks is.
        holds_prefix = rec is not None and rec.ready_before >= rec.key[0]
        if rec is not None:
            st.next_store_unit = max(st.next_store_unit, rec.key[0] if holds_prefix else rec.ready_before)
        if num_external_tokens <= 0:
            return
        U = self.keys.unit_tokens
        start = rec.key[0] if rec is not None else int(getattr(request, "num_computed_tokens", 0)) // U
        end = start + num_external_tokens // U
        groups = self._alloc_block_ids(blocks)
        hashes = self._hashes(request) or []
        fits = (rec is not None and num_external_tokens % U == 0 and end <= start + rec.hit_units
                and self.keys.units_in(len(hashes)) >= end
                and all(len(groups[g]) >= self.keys.block_range(g, 0, end).stop for g in range(self.keys.num_groups)
                        if g not in self.keys.scratch_groups)
                # A windowed group's window was looked up ending at the hit's
                # end only: a shorter load would need another window.
                and (not self.keys.windowed_groups or end == start + rec.hit_units))
        outside = self._outside_window(groups, start, end) if fits else []
        if outside:
            # vLLM gave a windowed group real blocks the hit's window does not
            # cover: they would hold nothing while vLLM takes them as computed.
            # This vLLM keeps more of a window than settings.group_window says:
            # this load fails (vLLM recomputes) and no hit is offered again.
            self.disable(f"request {rid}: vLLM allocated blocks of KV cache groups {outside} outside the window "
                         f"this connector computed for them (see docs/vllm.md, hybrid models)")
            fits = False
        if fits:
            jobs = self._jobs(hashes, groups, start, end, rec.leases, request=request, load=True)
        else:
            # vLLM now waits for this request's load. Nothing can be loaded,
            # so every block it allocated for those tokens is reported failed
            # (no keys: the worker fails them without asking the daemon).
            log.error("kvoffload: request %s: cannot map %d external tokens onto its blocks; reporting them failed",
                      rid, num_external_tokens)
            end = start + -(-num_external_tokens // U)
            jobs = []
            for g in range(self.keys.num_groups):
                if g in self.keys.scratch_groups:
                    continue
                rng = self.keys.block_range(g, start, end)
                ids = [b for b in groups[g][rng.start:rng.stop] if b is not None and b != self.null_block_id]
                jobs.append(GroupJob(g, [], ids))
        self._loads[rid] = jobs
        self._load_blocks[rid] = {b for j in jobs for b in j.block_ids}
        self._alloc_written |= self._load_blocks[rid]  # the load writes them: fenced in the next plan
        units: dict[int, int] = {}
        for g in range(self.keys.num_groups):
            bpu = self.keys.blocks_per_unit[g]
            for i in self.keys.block_range(g, start, end):
                if i < len(groups[g]) and groups[g][i] is not None and groups[g][i] != self.null_block_id:
                    units.setdefault(int(groups[g][i]), i // bpu)
        self._load_units[rid] = (start, units)
        if holds_prefix:
            st.next_store_unit = max(st.next_store_unit, end)

    def _alloc_block_ids(self, blocks: Any) -> list[list[int | None]]:
        per_group = getattr(blocks, "blocks", None)
        if per_group is not None:
            out = []
            for grp in per_group:
                out.append([None if getattr(b, "is_null", False) else int(b.block_id) for b in grp])
            return as_groups(out, self.keys.num_groups)
        return as_groups(blocks.get_block_ids(), self.keys.num_groups)

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        """This step's plan: the loads planned since the last step, a store of
        every full unit the step completes, the preempted requests, and the
        fence: the blocks the step writes that an earlier store may still
        read (the workers wait for those stores before the step's forward)."""
        self._flush()
        self._step_wait_left = self._wait
        self._seq += 1
        plan = StepPlan(seq=self._seq, loads=self._loads,
                        preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()),
                        identity=(self._gen, self._token))
        self._loads = {}
        for rid in plan.preempted:
            st = self._reqs.get(rid)
            if st is not None:
                # vLLM frees its blocks (their stores are fenced when vLLM
                # gives them to a request again); the resumed request brings
                # new block ids.
                st.block_ids = [[] for _ in range(self.keys.num_groups)]
                # vLLM recomputes it from token 0 (num_computed_tokens = 0)
                # and the workers drop its stores still queued: store again,
                # as vLLM recomputes them, every unit from the first store
                # not known drained on every rank (a store of a block the
                # daemon already holds is a no-op).
                done = self._drained_seq(rid)
                undrained = [u for seq, u in st.store_starts if seq > done]
                if undrained:
                    st.next_store_unit = min(st.next_store_unit, min(undrained))
                st.store_starts = []
                if st.gen != self._gen:
                    # Recomputed from scratch after a reset: its KV is the
                    # new weights' from here.
                    st.gen, st.next_store_unit = self._gen, 0
        # Every block the step writes, in every group: a store still reading
        # one is fenced, and no store of this step takes it for a block of
        # the request that held it before (vLLM freed it behind a window and
        # gave it out again in this very step: its bytes are no longer that
        # block's).
        written = self._alloc_written
        self._alloc_written = set()
        written.update(iter_written(scheduler_output, self.keys.num_groups, list(self.keys.block_sizes)))
        written.discard(self.null_block_id)
        plan.fence = self._fence(written)
        num_sched = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        scheduled: list[tuple[str, _ReqState]] = []
        before: dict[str, list[int]] = {}  # request -> per group, its block count before this step's
        for rid, new_ids, replace in iter_scheduled(scheduler_output):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_groups = as_groups(new_ids, self.keys.num_groups)
            if replace:
                st.block_ids = new_groups
                before[rid] = [0] * self.keys.num_groups
            else:
                before[rid] = [len(ids) for ids in st.block_ids]
                for g, ids in enumerate(new_groups):
                    st.block_ids[g].extend(ids)
            scheduled.append((rid, st))
        if written:
            self._drop_reused(written, before)
        for rid, st in scheduled:
            if st.controls.store == "none" or self.stores_off or st.gen != self._gen:
                continue
            req = st.request
            done_tokens = min(int(req.num_computed_tokens) + int(num_sched.get(rid, 0)), int(req.num_tokens))
            if st.controls.store == "prompt":
                done_tokens = min(done_tokens, int(getattr(req, "num_prompt_tokens", done_tokens)))
            hashes = self._hashes(req, publishable=True)
            if not hashes:
                continue
            end = self.keys.units_in(len(hashes), done_tokens)
            if self._eagle and done_tokens > int(getattr(req, "num_prompt_tokens", done_tokens)):
                end -= 1
            for g in range(self.keys.num_groups):
                end = min(end, len(st.block_ids[g]) // self.keys.blocks_per_unit[g])
            if end <= st.next_store_unit:
                continue
            jobs = self._jobs(hashes, st.block_ids, st.next_store_unit, end, request=req)
            first = st.next_store_unit
            st.next_store_unit = end
            if jobs:
                plan.stores[rid] = jobs
                if self._mirror is not None:
                    self._note_stores(jobs)
                if self._resetting and self._since_reset is not None:
                    self._since_reset.update((j.group, bytes(h)) for j in jobs for h in j.hashes)
                    if len(self._since_reset) > _RECENT_STORES:
                        self._since_reset = None  # too many to tell: lookups wait for the namespaces
                st.store_seq = self._seq
                st.store_starts.append((self._seq, first))
                self._note_reads(rid, jobs)
        plan.delay_free, self._delay_free = self._delay_free, set()
        return plan

    def _fence(self, written: set[int]) -> list[int]:
        """The blocks of ``written`` a store not known drained reads: the
        plan's fence. Once fenced, every rank waits for those stores before
        this step runs, so the blocks are forgotten here."""
        if not self._store_reads:
            return []
        fence = sorted(b for b in written if b in self._store_reads)
        for b in fence:
            for rid in self._store_reads.pop(b):
                blocks = self._reads_by_req.get(rid)
                if blocks is not None:
                    blocks.discard(b)
                    if not blocks:
                        self._forget_reads(rid)
        self.fences += len(fence)
        return fence

    def _drop_reused(self, written: set[int], before: Mapping[str, list[int]]) -> None:
        """A block of a request's not-yet-stored positions that this step
        allocates again (to another request, or to the same one further on)
        no longer holds that position's KV: vLLM has freed it (behind a
        sliding window, a local chunk) and put its null block there. The
        position is not stored (vLLM's own _update_req_states does the
        same). Positions this step added are the request's own new blocks."""
        for rid, st in self._reqs.items():
            if st.controls.store == "none" or st.gen != self._gen:
                continue
            ends = before.get(rid)
            prompt = int(getattr(st.request, "num_prompt_tokens", 0) or 0) if st.controls.store == "prompt" else 0
            for g in range(self.keys.num_groups):
                ids = st.block_ids[g]
                end = ends[g] if ends is not None else len(ids)
                if prompt:
                    end = min(end, -(-prompt // self.keys.block_sizes[g]))
                for i in range(st.next_store_unit * self.keys.blocks_per_unit[g], end):
                    if ids[i] is not None and ids[i] in written:
                        ids[i] = None

    def _note_reads(self, rid: str, jobs: Sequence[GroupJob]) -> None:
        """This step's stores of ``rid`` read these blocks until drained. A
        block read by more than ``_MAX_READERS`` requests' stores not known
        drained (a prefix block vLLM keeps cached, stored again while the
        daemon could not be asked) keeps one anonymous entry instead, which
        only a fence clears: the table stays bounded by the block count."""
        for j in jobs:
            for b in j.block_ids:
                readers = self._store_reads.setdefault(b, {})
                readers[rid] = self._seq
                if len(readers) > _MAX_READERS:
                    seq = max(readers.values())
                    for r in [r for r in readers if r is not None]:
                        blocks = self._reads_by_req.get(r)
                        if blocks is not None:
                            blocks.discard(b)
                            if not blocks:
                                self._forget_reads(r)
                    readers.clear()
                    readers[None] = seq
                else:
                    self._reads_by_req.setdefault(rid, set()).add(b)

    def _forget_reads(self, rid: str) -> None:
        self._reads_by_req.pop(rid, None)
        self._read_acks.pop(rid, None)

    def _reads_drained(self, drained: Mapping[str, Mapping[tuple, int]]) -> None:
        """Store acknowledgements: blocks whose stores every rank drained
        need no fence any more."""
        for rid, by_rank in drained.items():
            blocks = self._reads_by_req.get(rid)
            if not blocks:
                continue
            acks = self._read_acks.setdefault(rid, {})
            for rank, seq in by_rank.items():
                acks[rank] = max(acks.get(rank, 0), seq)
            if len(acks) < self.num_ranks:
                continue
            done = min(acks.values())
            for b in [b for b in blocks if self._store_reads.get(b, {}).get(rid, 0) <= done]:
                blocks.discard(b)
                readers = self._store_reads.get(b)
                if readers is not None:
                    readers.pop(rid, None)
                    if not readers:
                        del self._store_reads[b]
            if not blocks:
                self._forget_reads(rid)

    def update_connector_output(self, connector_output: Any) -> None:
        """Reads the workers' reports: failed loads (their requests are not
        offered hits again: a block that failed may fail again), and, where
        vLLM carries worker metadata, which ranks are registered and the
        acknowledgements of drained stores."""
        # A set of request ids, or (newer vLLM) a dict of them to typed failures.
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        bad_blocks = set(getattr(connector_output, "invalid_block_ids", None) or ())
        # vLLM recomputes a failed load: from its first failed block
        # (block-level), or the whole loaded prefix (request-level). Those
        # blocks are stored again as vLLM computes them.
        first_bad: dict[str, int] = {}
        for rid in failed:
            if rid in self._load_units:
                first_bad[rid] = self._load_units[rid][0]
        if bad_blocks:
            for rid, blocks in self._load_blocks.items():
                hit = blocks & bad_blocks
                if hit:
                    failed.add(rid)
                    start, units = self._load_units.get(rid, (0, {}))
                    u = min((units[b] for b in hit if b in units), default=start)
                    first_bad[rid] = min(first_bad.get(rid, u), u)
        for rid in failed:
            st = self._reqs.get(rid)
            if st is not None:
                self._no_hits.add(rid)
                st.next_store_unit = min(st.next_store_unit, first_bad.get(rid, 0))
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._load_blocks.pop(rid, None)
            self._load_units.pop(rid, None)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        for rank, ok in (getattr(meta, "registered", None) or {}).items():
            if ok:
                self._unregistered.discard(rank)
            else:
                self._unregistered.add(rank)
        drained = getattr(meta, "drained", None)
        if not drained:
            return
        self._reads_drained(drained)
        for rid, by_rank in drained.items():
            if rid not in self._reqs:
                continue
            cur = self._settled.setdefault(rid, {})
            for rank, seq in by_rank.items():
                cur[rank] = max(cur.get(rank, 0), seq)
            st = self._reqs[rid]
            done = self._drained_seq(rid)
            st.store_starts = [(seq, u) for seq, u in st.store_starts if seq > done]

    def _drained_seq(self, rid: str) -> int:
        """The last plan step up to which every rank reported the request's
        stores drained (0: not known)."""
        by_rank = self._settled.get(rid, {})
        return min(by_rank.values()) if len(by_rank) >= self.num_ranks else 0

    def stores_settled(self, rid: str) -> bool:
        """Whether every rank reported the request's stores drained up to
        the last step that planned one."""
        st = self._reqs.get(rid)
        if st is None or st.store_seq == 0:
            return True
        by_rank = self._settled.get(rid, {})
        return len(by_rank) >= self.num_ranks and min(by_rank.values()) >= st.store_seq

    def request_finished(self, request: Any) -> tuple[bool, None]:
        """True when stores of this request may still be in flight: vLLM then
        keeps its blocks until every worker reports it finished sending.

        vLLM's own offloading connector answers False and fences the reuse;
        here that would make a stopped daemon stall every step that reuses
        a finished request's block (test_a_hung_daemon_does_not_stall_serving):
        held, they are not handed out while free ones remain. Blocks vLLM
        frees while the request runs (behind a sliding window, a preemption)
        are fenced (build_connector_meta)."""
        rid = request.request_id
        # A request finished while its load is in flight: vLLM keeps its
        # blocks until the workers report it finished receiving, and frees
        # them then; True as well would free them twice (scheduler.py
        # _update_from_kv_xfer_finished asserts the request is still there).
        # The workers hold that report back until its stores drained too.
        settled = self.stores_settled(rid) or rid in self._load_blocks
        self._reqs.pop(rid, None)
        self._settled.pop(rid, None)
        self._drop(self._matched.pop(rid, None))
        self._drop(self._lookups.pop(rid, None))
        self._asked.pop(rid, None)
        self._looked_up.discard(rid)
        self._no_hits.discard(rid)
        self._load_blocks.pop(rid, None)
        self._load_units.pop(rid, None)
        self._hit_tiers.pop(rid, None)
        # A load still planned or in flight is not ours to wait for: vLLM
        # keeps the blocks of a request finished while waiting for remote KV
        # until a worker reports it finished receiving (which it will).
        if settled:
            return False, None
        self._delay_free.add(rid)
        return True, None

    @property
    def leases_released(self) -> int:
        """Leases the daemon confirmed released, no load naming them."""
        return self._released + self._thread_released

    def pending_lookups(self) -> int:
        return sum(1 for r in self._lookups.values() if not r.done)

    def healthy(self) -> bool:
        return self._io.healthy()
