"""KVOffloadConnector: a vLLM v1 KV connector backed by kvoffloadd.

Load it into vLLM by module path::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": "/run/user/1000/kvoffloadd/kvoffloadd.sock"}}'

This is the only module of the package that imports vLLM (and torch, on the
worker, for CUDA events). It reads vLLM's configuration
(:mod:`kvoffload.settings`) and forwards each of vLLM's calls to the
vLLM-free halves in :mod:`kvoffload.connector`; see docs/vllm.md.

Written against the KVConnectorBase_V1 interface of vLLM main at commit
003df2961dd8830c317a61f9745ccd557da9fa06 (base.py), plus the newer
``get_transfer_results`` / ``KVConnectorTransferResults`` hook where the
installed vLLM has it.
"""

from __future__ import annotations

import logging
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

from .connector import SchedulerSide, StepPlan, WorkerSide
from .regions import regions_from_kv_caches
from .settings import settings_from_vllm

__all__ = ["KVOffloadConnector", "KVOffloadConnectorMetadata"]

log = logging.getLogger("kvoffload.vllm")


class KVOffloadConnectorMetadata(KVConnectorMetadata):
    """One step's plan, sent by the scheduler to every worker."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


def _worker_ranks() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)
    except Exception:  # not initialised (single process tests)
        return 0, 0


_BASES: tuple[type, ...] = (KVConnectorBase_V1,) + ((SupportsHMA,) if SupportsHMA is not None else ())


class KVOffloadConnector(*_BASES):  # type: ignore[misc]
    """Offloads KV blocks to kvoffloadd and loads prefixes back from it.

    Scheduler side: one ``Lookup`` (per KV cache group) answers
    ``get_num_new_matched_tokens``; loads are asynchronous. Worker side:
    one ``Load``, one ``Store`` and one ``Completions`` per step.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any | None = None):
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        except TypeError:  # older vLLM: (vllm_config, role)
            super().__init__(vllm_config, role)
        self.settings = settings_from_vllm(vllm_config, kv_cache_config)
        s = self.settings
        num_groups = len(s.group_block_sizes)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._events: list[tuple[list[int], Any]] = []
        self._cuda = False
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                s.socket, s.all_fingerprints(), s.hash_block_size, s.group_block_sizes, s.hash_bytes,
                timeout_s=s.timeout_s,
            )
            log.info("kvoffload: scheduler side on %s, %d ranks, unit %d tokens, policy %s",
                     s.socket, len(s.all_fingerprints()), self._scheduler.keys.unit_tokens, s.failure_policy)
        else:
            tp_rank, pp_rank = _worker_ranks()
            rlf = s.request_level_failures
            if rlf is None:
                rlf = num_groups > 1 and KVConnectorTransferResults is not None
            self._worker = WorkerSide(
                s.socket, s.fingerprint(tp_rank, pp_rank), num_groups,
                client_name=f"vllm worker tp{tp_rank} pp{pp_rank}",
                request_level_failures=rlf, sync_stores=s.sync_stores,
                timeout_s=max(s.timeout_s, 10.0), drain_timeout_s=s.drain_timeout_s,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a store dropped on preemption is a future miss.
        return False

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        s = self.settings
        num_blocks = s.num_blocks
        if num_blocks is None:
            raise ValueError("kvoffload: kv_cache_config.num_blocks is needed to read the KV layout")
        groups = s.group_layers if any(s.group_layers) else (tuple(kv_caches),)
        kv = regions_from_kv_caches(kv_caches, groups, int(num_blocks), s.hash_bytes)
        self._cuda = kv.device == "cuda"
        self._worker.register(kv)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KVOffloadConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata.plan)

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVOffloadConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and self._worker is not None:
            self._worker.start_load_kv(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous (load_async=True): vLLM schedules a request
        # only after get_finished reported its load done.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # Blocks are stored once per step, in wait_for_save.
        return

    def _ready_event(self) -> tuple[bytes, Any]:
        if not self._cuda:
            return b"", None
        import torch

        try:
            ev = torch.cuda.Event(interprocess=True)
            ev.record()
            return bytes(ev.ipc_handle()), ev
        except Exception as e:  # pragma: no cover - needs a GPU
            log.debug("kvoffload: no IPC event (%s); synchronizing the stream instead", e)
            torch.cuda.current_stream().synchronize()
            return b"", None

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None or self._worker is None or not plan.stores:
            return
        handle, ev = self._ready_event()
        ids = self._worker.wait_for_save(plan, ready_event=handle)
        if ev is not None and ids:
            # The daemon waits on the event; keep it alive until its stores drained.
            self._events.append((ids, ev))
        self._events = [(i, e) for i, e in self._events if not self._worker.jobs_done(i)]

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

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # ------------------------------------------------------------------
    # Scheduler side
    # ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KVOffloadConnectorMetadata(self._scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(getattr(connector_output, "finished_recving", None))

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)
