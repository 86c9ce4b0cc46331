"""KVOffloadConnector: a vLLM v1 KV connector backed by kvoffloadd.

Load it into vLLM by module path (docs/vllm.md has the full line)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/user/1000/kvoffloadd/kvoffloadd.sock"}}'

This is the only module of the package that imports vLLM (and torch, on a
CUDA worker, lazily). It reads vLLM's configuration (:mod:`kvoffload.settings`)
and forwards each of vLLM's calls to the vLLM-free halves
(:mod:`kvoffload.scheduler_side`, :mod:`kvoffload.worker_side`). Hooks a
vLLM version lacks are detected by import, never assumed: written against
vLLM main's ``KVConnectorBase_V1`` read at commits 003df29 and 13f4ad0
(docs/vllm.md says which parts come from which).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401  (vLLM is required here)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # vLLM with the hybrid memory allocator interface
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM
    SupportsHMA = None  # type: ignore[assignment]

try:  # newer vLLM: request-level load failures
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:
    KVConnectorTransferResults = None  # type: ignore[assignment]

try:  # worker -> scheduler metadata (store acknowledgements)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:
    KVConnectorWorkerMetadata = None  # type: ignore[assignment]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorHandshakeMetadata = object  # type: ignore[assignment,misc]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorStats = KVConnectorPromMetrics = None  # type: ignore[assignment,misc]

try:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
except ImportError:
    resolve_kv_cache_block_sizes = None  # type: ignore[assignment]

try:  # vLLM's KV cache events (what its publisher sends to KV-aware routers)
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
except ImportError:
    BlockStored = BlockRemoved = AllBlocksCleared = None  # type: ignore[assignment,misc]

try:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
except ImportError:
    maybe_convert_block_hash = None  # type: ignore[assignment]

try:  # the kind of a KV cache group (RSWASpec is a FullAttentionSpec subclass: class names mislead)
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
except ImportError:
    get_kv_cache_spec_kind = None  # type: ignore[assignment]

try:  # vLLM's KV cache layout names (#51718: six stride orders; HND is LBHNC there)
    from vllm.v1.kv_cache_interface import KVCacheLayout
except ImportError:
    KVCacheLayout = None  # type: ignore[assignment,misc]

try:  # where an external hit's tokens come from (vLLM's prefix cache metrics by source)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    try:
        from vllm.v1.cache_hit_source import CacheHitSource  # type: ignore[no-redef]
    except ImportError:
        CacheHitSource = None  # type: ignore[assignment,misc]

from . import stats as _stats
from .kv_events import VLLMEventTypes, default_convert, event_group_specs
from .plan import StepPlan
from .mamba import check_registration as check_mamba_registration
from .regions import regions_from_kv_caches
from .scheduler_side import SchedulerSide
from .settings import derive_fingerprint, namespace_fingerprint, settings_from_vllm
from .worker_side import WorkerSide

__all__ = ["KVOffloadConnector", "KVOffloadConnectorMetadata", "KVOffloadHandshake", "CONNECTOR_NAME"]

log = logging.getLogger("kvoffload.vllm")

# The name vLLM's KVConnectorFactory knows this connector by: what
# "kv_connector" says, and what MultiConnector looks its stats up by (the
# class name).
CONNECTOR_NAME = "KVOffloadConnector"


def _required_layout() -> str:
    """HND (heads outermost within a block) in the spelling of the vLLM in
    use: MultiConnector compares its children's answers verbatim, and after
    #51718 NixlConnector, Mooncake and vLLM's offloading connector say
    "LBHNC" for it."""
    if KVCacheLayout is not None and hasattr(KVCacheLayout, "LBHNC"):
        return "LBHNC"
    return "HND"


class KVOffloadConnectorMetadata(KVConnectorMetadata):
    """One step's plan, sent by the scheduler to every worker."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


@dataclass
class KVOffloadHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What a worker tells the scheduler once, after registering: its rank
    and the fingerprint it registered under (None: it could not, and the
    engine must not offer hits)."""

    rank: dict = field(default_factory=dict)
    fingerprint: bytes | None = None
    reason: str = ""
    # What the fingerprint was made of (the engine's identity and the KV
    # tensors' byte order): vLLM keys handshakes by (pp, tp) rank, so of the
    # prefill context parallel ranks of one (pp, tp) only one handshake
    # arrives; the scheduler derives the others' fingerprints from it.
    identity: dict | None = None
    geometry: tuple = ()


if KVConnectorWorkerMetadata is not None:

    @dataclass
    class KVOffloadWorkerMeta(KVConnectorWorkerMetadata):  # type: ignore[misc]
        """Per request, per rank: the plan step up to which its stores drained."""

        drained: dict = field(default_factory=dict)
        registered: dict = field(default_factory=dict)  # rank -> whether its worker holds a registration

        def aggregate(self, other: "KVOffloadWorkerMeta") -> "KVOffloadWorkerMeta":
            self.registered.update(getattr(other, "registered", {}))
            for rid, by_rank in getattr(other, "drained", {}).items():
                cur = self.drained.setdefault(rid, {})
                for rank, seq in by_rank.items():
                    cur[rank] = max(cur.get(rank, 0), seq)
            return self


if KVConnectorStats is not None:

    @dataclass
    class KVOffloadConnectorStats(KVConnectorStats):  # type: ignore[misc]
        """An interval of kvoffload.stats data (a plain dict: it crosses processes)."""

        def reset(self) -> None:
            self.data = {}

        def aggregate(self, other: Any) -> "KVOffloadConnectorStats":
            self.data = _stats.aggregate(dict(self.data or {}) or None, getattr(other, "data", None))
            return self

        def reduce(self) -> dict[str, int | float]:
            return _stats.reduce(self.data or {})

        def is_empty(self) -> bool:
            return _stats.is_empty(self.data)


if KVConnectorPromMetrics is not None:

    class KVOffloadPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
        """kvoffload's series in vLLM's own /metrics, per engine."""

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list, per_engine_labelvalues: dict):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            ln = list(labelnames)
            self._values = per_engine_labelvalues

            def counter(name: str, doc: str, extra: tuple = ()):
                return self._counter_cls(name=name, documentation=doc, labelnames=ln + list(extra))

            def hist(name: str, doc: str):
                return self._histogram_cls(name=name, documentation=doc, labelnames=ln,
                                           buckets=[1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0])

            self.hit_tokens = counter("vllm:kvoffload_hit_tokens", "Prompt tokens offered from kvoffloadd, by tier.",
                                      ("tier",))
            self.lookups = counter("vllm:kvoffload_lookups", "Lookups answered by kvoffloadd.")
            self.lookup_timeouts = counter("vllm:kvoffload_lookup_timeouts",
                                           "Lookups treated as a miss because the daemon was slow.")
            self.bytes = counter("vllm:kvoffload_transferred_bytes", "Bytes copied by kvoffloadd, by direction.",
                                 ("direction",))
            self.blocks = counter("vllm:kvoffload_transferred_blocks", "Blocks copied by kvoffloadd, by direction.",
                                  ("direction",))
            self.failed = counter("vllm:kvoffload_failed_blocks", "Blocks that failed to load or store, by status.",
                                  ("direction", "status"))
            self.lookup_keys = counter("vllm:kvoffload_lookup_keys",
                                       "Keys looked up: all, for hits, and windowed keys outside a hit's window.",
                                       ("kind",))
            self.skipped = counter("vllm:kvoffload_stores_skipped_blocks",
                                   "Blocks not stored because the daemon was down or vLLM reused them first.")
            self.latency = {k: hist(f"vllm:kvoffload_{k}", f"kvoffload {k.split('_')[0]} latency.")
                            for k in _stats.SAMPLE_KEYS}

        def _labels(self, metric: Any, engine_idx: int, *extra: Any) -> Any:
            return metric.labels(*self._values[engine_idx], *extra)

        def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
            d = transfer_stats_data or {}
            for tier, n in (d.get("hit_tokens") or {}).items():
                self._labels(self.hit_tokens, engine_idx, tier).inc(n)
            if d.get("lookups_total"):
                self._labels(self.lookups, engine_idx).inc(d["lookups_total"])
            if d.get("lookup_timeouts_total"):
                self._labels(self.lookup_timeouts, engine_idx).inc(d["lookup_timeouts_total"])
            for direction, bk, nk in (("load", "bytes_loaded_total", "blocks_loaded_total"),
                                      ("store", "bytes_stored_total", "blocks_stored_total")):
                if d.get(bk):
                    self._labels(self.bytes, engine_idx, direction).inc(d[bk])
                if d.get(nk):
                    self._labels(self.blocks, engine_idx, direction).inc(d[nk])
            for key, n in (d.get("failed_blocks") or {}).items():
                direction, _, status = key.partition(":")
                self._labels(self.failed, engine_idx, direction, status).inc(n)
            for kind, k in (("all", "lookup_keys_total"), ("hit", "hit_lookup_keys_total"),
                            ("hit_outside_window", "hit_keys_outside_window_total")):
                if d.get(k):
                    self._labels(self.lookup_keys, engine_idx, kind).inc(d[k])
            if d.get("stores_skipped_total"):
                self._labels(self.skipped, engine_idx).inc(d["stores_skipped_total"])
            for k, h in self.latency.items():
                m = self._labels(h, engine_idx)
                for v in d.get(k) or ():
                    m.observe(v)


def _worker_rank(num_ranks: int, pcp: int, dcp: int) -> dict:
    """This worker's place in the engine. With one rank it is (0, 0, 0); with
    several, a rank vLLM will not tell is an error, never a guess."""
    try:
        from vllm.distributed import parallel_state as ps

        tp_group = getattr(ps, "get_tp_group", None)
        tp = int(tp_group().rank_in_group) if tp_group else int(ps.get_tensor_model_parallel_rank())
        pp = int(ps.get_pp_group().rank_in_group)
        pcp_rank = int(ps.get_pcp_group().rank_in_group) if pcp > 1 else 0
        dcp_rank = int(ps.get_dcp_group().rank_in_group) if dcp > 1 else 0
    except Exception as e:
        if num_ranks > 1:
            raise RuntimeError(f"cannot read this worker's parallel ranks from vLLM ({e!r})") from None
        return {"tp": 0, "pp": 0, "pcp": 0, "dcp": 0}
    return {"tp": tp, "pp": pp, "pcp": pcp_rank, "dcp": dcp_rank}


class _ReadyEvents:
    """IPC events recorded on the engine's current CUDA stream for the
    daemon's copies to wait on (a Store: after the forward pass wrote the
    blocks; a Load: after the work still reading its destination blocks).
    Each is held until every job sent with it is done. Uses
    kvoffload.cuda_ipc's pool where the package has it; torch only on a CUDA
    worker, imported here."""

    def __init__(self):
        self._pool: Any = None
        self._held: list[tuple[list[int], Any]] = []

    def record(self) -> tuple[bytes, Any]:
        try:
            if self._pool is None:
                try:
                    from .cuda_ipc import IpcEventPool  # type: ignore[import-not-found]

                    self._pool = IpcEventPool()
                except ImportError:
                    self._pool = False
            if self._pool:
                handle, token = self._pool.record()
                return bytes(handle), token
            import torch

            ev = torch.cuda.Event(interprocess=True)
            ev.record()
            return bytes(ev.ipc_handle()), ev
        except Exception as e:  # pragma: no cover - needs a GPU
            log.debug("kvoffload: no IPC event (%s); synchronizing the stream instead", e)
            import torch

            torch.cuda.current_stream().synchronize()
            return b"", None

    def hold(self, job_ids: list[int], held: Any, done) -> None:
        if held is not None:
            if job_ids:
                self._held.append((job_ids, held))
            else:
                self._release(held)
        keep = []
        for ids, h in self._held:
            if done(ids):
                self._release(h)
            else:
                keep.append((ids, h))
        self._held = keep

    def _release(self, held: Any) -> None:
        if self._pool and not hasattr(held, "record"):
            self._pool.release(held)


def _hit_source(tier: str) -> Any:
    """vLLM's CacheHitSource member for a daemon tier (the members' names
    differ between vLLM versions)."""
    names = {"cpu": ("HOST", "CPU"), "disk": ("DISK",), "remote": ("EXTERNAL_UNSPECIFIED", "EXTERNAL")}[tier]
    for n in names:
        m = getattr(CacheHitSource, n, None)
        if m is not None:
            return m
    return None


_BASES: tuple[type, ...] = (KVConnectorBase_V1,) + ((SupportsHMA,) if SupportsHMA is not None else ())


class KVOffloadConnector(*_BASES):  # type: ignore[misc]
    """Offloads KV blocks to kvoffloadd and loads prefixes back from it.

    Scheduler side: Lookups on a background thread answer
    ``get_num_new_matched_tokens``; loads are asynchronous. Worker side:
    one Load and one Store per step, sent and settled off the step.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any | None = None):
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # older vLLM: (vllm_config, role)
            super().__init__(vllm_config, role)
        resolver = None
        if resolve_kv_cache_block_sizes is not None and kv_cache_config is not None:
            def resolver():
                return resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        self.settings = s = settings_from_vllm(vllm_config, kv_cache_config, vllm_block_sizes=resolver,
                                               kv_layout=type(self).get_required_kvcache_layout(vllm_config),
                                               spec_kind=get_kv_cache_spec_kind)
        if s.scratch_groups and not hasattr(KVConnectorBase_V1, "get_loaded_kv_cache_group_ids"):
            # That vLLM takes a hit as restoring every group: a group this
            # connector never stores would hold nothing.
            s.unsupported = s.unsupported or (
                f"KV cache groups {[g for g, x in enumerate(s.scratch_groups) if x]} are never prefix-cached "
                "(prefix_cacheable=False: per-request state), and this vLLM has no get_loaded_kv_cache_group_ids "
                "to rebuild them after an external hit")
        for note in s.notes:
            log.warning("kvoffload: %s", note)
        num_groups = len(s.group_block_sizes)
        rlf = s.request_level_failures
        if rlf is None:
            rlf = num_groups > 1 and KVConnectorTransferResults is not None
        elif rlf and KVConnectorTransferResults is None:
            # That vLLM reads failed loads only as block ids: honouring the
            # setting would report none at all.
            log.error("kvoffload: kv_connector_extra_config.request_level_failures is true, but this vLLM has no "
                      "request-level load failures (KVConnectorTransferResults): ignored, failed loads are "
                      "reported per block")
            rlf = False
        self._request_level = rlf
        # sync_stores is never needed for safety: where vLLM gives a block to
        # a request while a store of it may still run (behind a sliding
        # window, a local chunk, R-SWA's decode gap, after a preemption), the
        # step's plan fences it and the workers wait
        # for that store before the step writes it. True only adds a wait
        # at the end of every step.
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._worker_off: str | None = s.unsupported
        self._rank: dict | None = None
        self._fingerprint: bytes | None = None
        self._base_fp: bytes | None = None  # the fingerprint of generation 0 (before any cache reset)
        self._geometry: tuple = ()
        self._gen = 0  # the identity generation the worker runs under
        self._events = _ReadyEvents()
        self._cuda = False
        self._stats = _stats.StatsRecorder()
        self._event_types: VLLMEventTypes | None = None
        if role == KVConnectorRole.SCHEDULER:
            offer = s.unsupported is None
            if s.unsupported is not None:
                log.error("kvoffload: offloading disabled for this engine: %s", s.unsupported)
            elif num_groups > 1 and not rlf:
                offer = False
                log.warning("kvoffload: this vLLM reports failed loads only per block, which it cannot map back to "
                            "requests of a model with %d KV cache groups: no external hits are offered (blocks are "
                            "still stored for engines that can load them)", num_groups)
            if s.failure_policy == "fail":
                log.warning("kvoffload: kv_load_failure_policy is \"fail\": a load that fails (a block evicted or "
                            "corrupt on disk, the daemon restarting) ends its request with an error; set "
                            "\"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config to recompute instead")
            if s.kv_events and BlockStored is None:
                log.warning("kvoffload: this vLLM has no vllm.distributed.kv_events: no KV events are reported")
            elif s.kv_events:
                self._event_types = VLLMEventTypes(BlockStored, BlockRemoved, AllBlocksCleared,
                                                   maybe_convert_block_hash or default_convert,
                                                   event_group_specs(kv_cache_config))
            self._scheduler = SchedulerSide(
                s.socket, s.num_ranks, s.hash_block_size, s.group_block_sizes, s.hash_bytes,
                offer_hits=offer, rpc_timeout_s=s.timeout_s, lookup_wait_s=s.lookup_wait_s,
                lookup_deadline_s=s.lookup_deadline_s, lease_ms=s.lease_ms, stats=self._stats,
                kv_events=self._event_types is not None, kv_events_max_blocks=s.kv_events_max_blocks,
                eagle_groups=s.eagle_groups, group_windows=s.group_windows, scratch_groups=s.scratch_groups,
                lookup_mirror=s.lookup_mirror, mirror_max_blocks=s.lookup_mirror_max_blocks,
            )
            # vLLM's loop calls it for every waiting request: no frame of ours
            # in between (the method below stays for a connector without a
            # scheduler side, and says what it is).
            self.get_num_new_matched_tokens = self._scheduler.get_num_new_matched_tokens
            if offer and s.engine is not None:
                self._scheduler.discover_workers({tuple(sorted(r.items())): s.registration_key(r) for r in s.ranks()})
            log.info("kvoffload: scheduler side on %s: %d ranks, hash block %d tokens, unit %d tokens, policy %s",
                     s.socket, s.num_ranks, s.hash_block_size, s.block_sizes.scheduler, s.failure_policy)
        else:
            try:
                self._rank = _worker_rank(s.num_ranks, s.pcp_size, s.dcp_size)
            except RuntimeError as e:
                self._worker_off = self._worker_off or str(e)
                log.error("kvoffload: offloading disabled for this engine: %s", e)

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a store dropped on preemption is a future miss.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # One byte order for every engine that may share blocks: HND (heads
        # outermost within a block), which vLLM's attention backends support.
        # MLA caches have no head dimension to order.
        mc = getattr(vllm_config, "model_config", None)
        if mc is None or getattr(mc, "use_mla", False):
            return None
        return _required_layout()

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------

    def _null_worker(self) -> WorkerSide:
        """A worker half that never registers: it drops stores, fails loads
        (none are planned: the scheduler offers nothing) and reports finished
        requests, so vLLM never waits on it."""
        return WorkerSide(self.settings.socket, b"", len(self.settings.group_block_sizes),
                          request_level_failures=self._request_level, stats=self._stats)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._worker_off is not None or self._rank is None:
            self._worker = self._null_worker()
            return
        s = self.settings
        try:
            if s.num_blocks is None:
                raise ValueError("kv_cache_config.num_blocks is needed to read the KV layout")
            groups = s.group_layers if any(s.group_layers) else (tuple(kv_caches),)
            kv = regions_from_kv_caches(kv_caches, groups, int(s.num_blocks), s.hash_bytes,
                                        group_block_sizes=s.rank_block_sizes)
            if s.mamba_specs:
                check_mamba_registration(kv.layout.segments, kv.region_layers, groups, s.mamba_specs)
        except Exception as e:
            # A layout this connector cannot map never kills the worker.
            self._worker_off = f"cannot map this worker's KV caches: {e}"
            log.error("kvoffload: offloading disabled for this engine: %s", self._worker_off)
            self._worker = self._null_worker()
            return
        self._cuda = kv.device == "cuda"
        fp = s.fingerprint(self._rank, kv.geometry)
        self._base_fp, self._geometry = fp, kv.geometry
        r = self._rank
        self._worker = WorkerSide(
            s.socket, fp, len(s.group_block_sizes), rank=(r["pp"], r["pcp"], r["tp"]),
            client_name=f"vllm worker tp{r['tp']} pp{r['pp']} pcp{r['pcp']}",
            request_level_failures=self._request_level, sync_stores=s.sync_stores, stats=self._stats,
            registration_key=s.registration_key(r) or b"",
        )
        self._worker.track_drains = KVConnectorWorkerMetadata is not None
        self._worker.register(kv)
        if self._worker.refused is not None:
            self._worker_off = f"the daemon refused the KV caches: {self._worker.refused}"
        else:
            self._fingerprint = fp

    def get_handshake_metadata(self) -> Any:
        """None wherever vLLM names the engine (``engine_id``,
        ``instance_id``): the scheduler finds the workers' fingerprints in
        the daemon by registration key (SchedulerSide.discover_workers). A
        MultiConnector hands its first child's handshake to every child, and
        NixlConnector's scheduler raises on any payload but its own: ours is
        sent only by a vLLM too old to name its engines."""
        if self._scheduler is not None or self.settings.engine is not None:
            return None
        return KVOffloadHandshake(rank=dict(self._rank or {}), fingerprint=self._fingerprint,
                                  reason=self._worker_off or "", identity=dict(self.settings.identity),
                                  geometry=self._geometry)

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVOffloadConnectorMetadata):
            return None
        self._follow_identity(meta.plan)
        return meta.plan

    def _follow_identity(self, plan: StepPlan) -> None:
        """A plan of a newer identity (the scheduler's reset_cache) moves
        this worker to it before anything of the plan is loaded or stored."""
        gen, token = getattr(plan, "identity", (0, b""))
        if gen <= self._gen:
            return
        self._gen = gen
        if self._worker is not None and self._base_fp is not None and self._worker_off is None:
            self._worker.switch_identity(derive_fingerprint(self._base_fp, token))

    def handle_preemptions(self, preempted: Any) -> None:
        """Current vLLM passes the step's metadata; older passes the ids."""
        if self._worker is None:
            return
        plan = None
        if isinstance(preempted, KVOffloadConnectorMetadata):
            self._follow_identity(preempted.plan)
            plan = preempted.plan
            ids = plan.preempted
        elif isinstance(preempted, (set, frozenset, list, tuple)):
            ids = set(preempted)
        else:
            ids = set(getattr(preempted, "preempted_req_ids", None) or ())
        self._worker.handle_preemptions(ids)
        if plan is not None:
            # Before the step's forward (and start_load_kv, which applies it
            # too on a vLLM that passes ids here).
            self._worker.apply_fence(plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None or self._worker is None:
            return
        handle, held = self._events.record() if (self._cuda and plan.loads) else (b"", None)
        self._events.hold(self._worker.start_load_kv(plan, ready_event=handle), held, self._worker.jobs_done)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous (load_async=True): vLLM schedules a request
        # only after get_finished reported its load done.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Blocks are stored once per step, in wait_for_save.
        return

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None or self._worker is None or not plan.stores:
            return
        handle, held = self._events.record() if self._cuda else (b"", None)
        self._events.hold(self._worker.wait_for_save(plan, ready_event=handle), held, self._worker.jobs_done)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    if KVConnectorTransferResults is not None:

        def get_transfer_results(self, finished_req_ids: set[str] | None = None):
            """Newer vLLM: finished transfers plus requests whose load failed
            (reported per request for models with several KV cache groups)."""
            sending, recving = self.get_finished(set(finished_req_ids or ()))
            failed = self._worker.take_failed_requests() if self._worker is not None else set()
            return KVConnectorTransferResults(
                finished_sending=set(sending or ()), finished_recving=set(recving or ()), failed_recving=failed
            )

    if KVConnectorWorkerMetadata is not None:

        def build_connector_worker_meta(self):
            if self._worker is None or self._worker_off is not None:
                return None
            return KVOffloadWorkerMeta(drained=self._worker.drained_stores(),
                                       registered={self._worker.rank: self._worker.registered()})

    if KVConnectorStats is not None:

        def get_kv_connector_stats(self):
            data = self._stats.take()
            return KVOffloadConnectorStats(data=data) if data else None

        @classmethod
        def build_kv_connector_stats(cls, data: dict | None = None):
            # MultiConnector passes a child's serialized stats whole
            # ({"data": {...}}) on newer vLLM, the inner dict at 7cfb97e.
            if isinstance(data, dict) and set(data) == {"data"} and isinstance(data["data"], (dict, type(None))):
                data = data["data"]
            return KVOffloadConnectorStats(data=dict(data or {}))

    if KVConnectorPromMetrics is not None:

        @classmethod
        def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list,
                               per_engine_labelvalues: dict):
            return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # ------------------------------------------------------------------
    # Scheduler side
    # ------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        self._take_handshakes(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict) -> None:
        self._take_handshakes(metadata)

    def _take_handshakes(self, metadata: dict) -> None:
        if self._scheduler is None:
            return
        by_rank: dict = {}
        derived: dict = {}
        pcp = self.settings.pcp_size
        ours = [m for m in (metadata or {}).values() if isinstance(m, KVOffloadHandshake)]
        if not ours:
            # A sibling's handshake (a MultiConnector passes on its first
            # child's) or none: the workers' registrations are found in the
            # daemon instead (discover_workers).
            return
        for m in ours:
            by_rank[tuple(sorted(m.rank.items())) or ("?", id(m))] = m.fingerprint
            if m.fingerprint is None:
                log.error("kvoffload: worker %s: %s", m.rank, m.reason or "not registered")
            elif pcp > 1 and m.identity is not None and m.rank:
                # vLLM keys handshakes by (pp, tp): the prefill context
                # parallel ranks of one (pp, tp) overwrite each other. Their
                # fingerprints differ only by the rank (same model shard,
                # same tensors): derived from the one that arrived, checked
                # by deriving its own. A rank whose tensors differed would
                # have registered another fingerprint: Resolve finds none
                # for the derived one, and nothing is offered (never a
                # wrong load).
                fields = {**m.identity, "rank": dict(m.rank), "geometry": m.geometry}
                if namespace_fingerprint(fields) != m.fingerprint:
                    log.error("kvoffload: worker %s: its fingerprint cannot be derived from what it reported; "
                              "the other prefill context parallel ranks are unknown", m.rank)
                    continue
                for r in range(pcp):
                    rank = {**m.rank, "pcp": r}
                    derived[tuple(sorted(rank.items()))] = namespace_fingerprint({**fields, "rank": rank})
        for k, fp in derived.items():
            by_rank.setdefault(k, fp)
        self._scheduler.set_worker_fingerprints(by_rank)

    def reset_cache(self) -> bool | None:
        """vLLM's cache reset (``reset_prefix_cache(reset_connector=True)``,
        a weight update): after True, nothing stored before is loaded into
        this engine, and what it stores from now on is under an identity of
        its own (kvoffload.scheduler_side.SchedulerSide.reset). False when
        the daemon could not confirm (vLLM reports the reset failed)."""
        if self._scheduler is None:
            return None
        return self._scheduler.reset()

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """The groups a load of ours restores: every group but those vLLM
        never prefix-caches (their per-request state vLLM rebuilds itself)."""
        return self.settings.cacheable_group_ids

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    if CacheHitSource is not None:

        def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
            """The external hit's tokens by the daemon tier they come from:
            the CPU tier is HOST (CPU in some vLLM versions), the disk tier
            DISK, the remote tier EXTERNAL_UNSPECIFIED (EXTERNAL)."""
            if self._scheduler is None:
                return {}
            out: dict = {}
            for tier, n in self._scheduler.hit_sources(request.request_id, num_external_tokens).items():
                src = _hit_source(tier)
                if src is not None and n > 0:
                    out[src] = out.get(src, 0) + n
            return out

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KVOffloadConnectorMetadata(self._scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def take_events(self):
        """What the daemon's tiers gained and lost since the last step, as
        vLLM's KV cache events (medium CPU or STORAGE), for vLLM's publisher to
        send with its own (docs/events.md). Only the scheduler reports: the
        workers' ``get_kv_connector_kv_cache_events`` stays vLLM's default."""
        if self._scheduler is None or self._event_types is None:
            return ()
        return self._scheduler.take_kv_events(self._event_types)


def _register_with_factory() -> None:
    """Makes the connector findable by name in vLLM's KVConnectorFactory,
    once per process: MultiConnector's stats (and vLLM's stats logging)
    rebuild each child's stats through ``get_connector_class_by_name``, which
    raises for a connector loaded only by ``kv_connector_module_path``; vLLM
    imports this module in every process that builds a MultiConnector's
    children or its metrics."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # a vLLM without the factory: nothing looks connectors up by name
        return
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, __name__, "KVOffloadConnector")
    except ValueError:  # registered meanwhile (vLLM raises on a second registration)
        pass


_register_with_factory()
