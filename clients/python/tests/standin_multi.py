"""vLLM's MultiConnector and a NixlConnector-like sibling, for the stand-in engine.

``MultiConnector`` plays the rules of vLLM's
``.../kv_connector/v1/multi_connector.py`` (read at 7cfb97e and e0f559e) that
a child connector meets:

- each child gets a copy of the config whose ``kv_transfer_config`` is its
  own entry of ``kv_connector_extra_config["connectors"]``, with the
  parent's ``engine_id`` unless it names one, and its class from the
  factory (``kv_connector_module_path`` first);
- ``get_handshake_metadata``: the first child's non-None answer only;
  ``set_xfer_handshake_metadata[_pp_aware]``: that one dict to every child;
- ``get_num_new_matched_tokens``: None if any child says None, else the
  first child with tokens is chosen for the request's load; the others get
  ``update_state_after_alloc(..., 0)``;
- metadata per child in a tuple, worker metadata per child in a tuple and
  split again for ``update_connector_output``; ``request_finished`` counts
  the children's asynchronous saves and holds ``finished_sending`` back
  until the last one;
- stats grouped by the child's class name, rebuilt in the API server's
  process by name through ``KVConnectorFactory.get_connector_class_by_name``
  (which raises for a name never registered);
- the children's ``get_required_kvcache_layout`` strings must be equal.

``NixlConnector`` plays what NixlConnector shows a sibling: its workers'
handshake is a ``NixlHandshakePayload``, and its scheduler raises on any
other payload (``nixl/base_scheduler.py:298-302`` at 7cfb97e); it binds only
its own metadata; it reports stats every step; it requires the HND layout
(spelled "LBHNC" after #51718). It moves no KV (no P/D request here).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import standin_vllm as sv

FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"


def factory():
    return sys.modules[FACTORY].KVConnectorFactory


def register_builtins() -> None:
    """What vLLM's factory.py registers at import (the two used here)."""
    f = factory()
    for name in ("NixlConnector", "MultiConnector"):
        if name not in f._registry:
            f.register_connector(name, __name__, name)


@dataclass
class KVTransferConfig:
    """vLLM's KVTransferConfig fields a child reads, with vLLM's defaults."""

    kv_connector: str | None = None
    kv_connector_module_path: str | None = None
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_load_failure_policy: str = "fail"
    engine_id: str | None = None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


# -- NixlConnector ------------------------------------------------------------------


@dataclass
class NixlHandshakePayload(sv.KVConnectorHandshakeMetadata):
    compatibility_hash: str
    agent_metadata_bytes: bytes


@dataclass
class NixlConnectorMetadata(sv.KVConnectorMetadata):
    reqs_to_recv: dict = field(default_factory=dict)


@dataclass
class NixlKVConnectorStats(sv.KVConnectorStats):
    def reset(self):
        self.data = {"num_successful_transfers": 0}

    def aggregate(self, other):
        self.data["num_successful_transfers"] = (self.data.get("num_successful_transfers", 0)
                                                 + other.data.get("num_successful_transfers", 0))
        return self

    def reduce(self):
        return {"Num successful transfers": self.data.get("num_successful_transfers", 0)}

    def is_empty(self):
        return not self.data.get("num_successful_transfers")


class NixlConnector(sv.KVConnectorBase_V1, sv.SupportsHMA):
    # Every scheduler built, for tests to check what NIXL was handed.
    schedulers: list["NixlConnector"] = []
    layout = "HND"  # "LBHNC" on vLLM after #51718

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.handshakes: dict | None = None
        self.bound = 0
        if role == sv.KVConnectorRole.SCHEDULER:
            NixlConnector.schedulers.append(self)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        return cls.layout

    # worker
    def get_handshake_metadata(self):
        return NixlHandshakePayload(compatibility_hash=f"nixl:{self.engine_id}", agent_metadata_bytes=b"agent")

    def bind_connector_metadata(self, connector_metadata):
        assert isinstance(connector_metadata, NixlConnectorMetadata), type(connector_metadata)
        self.bound += 1
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs):
        return

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        assert isinstance(self._connector_metadata, NixlConnectorMetadata)

    def get_kv_connector_stats(self):
        return NixlKVConnectorStats(data={"num_successful_transfers": 1})

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return NixlKVConnectorStats(data=dict(data)) if data is not None else NixlKVConnectorStats()

    # scheduler
    def set_xfer_handshake_metadata(self, metadata):
        for tp_rank, md in metadata.items():
            if not isinstance(md, NixlHandshakePayload):
                raise ValueError("NixlConnectorScheduler expects NixlHandshakePayload for "
                                 f"handshake metadata, got {type(md)} for tp_rank {tp_rank}")
        self.handshakes = dict(metadata)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        assert num_external_tokens == 0, "NIXL was given a load it never offered"

    def build_connector_meta(self, scheduler_output):
        return NixlConnectorMetadata()

    def request_finished(self, request, block_ids):
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return False, None


# -- MultiConnector -----------------------------------------------------------------


@dataclass
class MultiKVConnectorMetadata(sv.KVConnectorMetadata):
    metadata: tuple
    extra_async_saves: dict | None = None


@dataclass
class MultiKVConnectorWorkerMetadata:
    metadata: tuple

    def aggregate(self, other):
        assert isinstance(other, MultiKVConnectorWorkerMetadata) and len(self.metadata) == len(other.metadata)
        out = []
        for a, b in zip(self.metadata, other.metadata):
            out.append(b if a is None else a if b is None else a.aggregate(b))
        return MultiKVConnectorWorkerMetadata(tuple(out))


@dataclass
class MultiKVConnectorStats(sv.KVConnectorStats):
    def aggregate(self, other):
        for cid, st in other.data.items():
            self.data[cid] = st if cid not in self.data else self.data[cid].aggregate(st)
        return self

    def reset(self):
        for st in self.data.values():
            st.reset()

    def reduce(self):
        return {cid: st.reduce() for cid, st in self.data.items()}

    def is_empty(self):
        return all(st.is_empty() for st in self.data.values())


class MultiConnector(sv.KVConnectorBase_V1, sv.SupportsHMA):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._connectors = [cls(cfg, role, kv_cache_config) for cls, cfg in self._children(vllm_config)]
        self._requests_to_connector: dict[str, int] = {}
        self._extra_async_saves: dict[str, int] = {}

    @classmethod
    def _children(cls, vllm_config):
        out = []
        parent = vllm_config.kv_transfer_config
        for ktc in parent.kv_connector_extra_config["connectors"]:
            temp = copy.copy(vllm_config)
            temp.kv_transfer_config = KVTransferConfig(**{"engine_id": parent.engine_id, **ktc})
            out.append((factory().get_connector_class(temp.kv_transfer_config), temp))
        return out

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        layouts = {c.get_required_kvcache_layout(cfg) for c, cfg in cls._children(vllm_config)} - {None}
        if len(layouts) > 1:
            raise ValueError(f"KV cache layout mismatch: found {len(layouts)} different layouts "
                             f"({', '.join(sorted(layouts))}).All connectors must use the same layout.")
        return next(iter(layouts), None)

    # worker
    def register_kv_caches(self, kv_caches):
        for c in self._connectors:
            c.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata):
        assert isinstance(connector_metadata, MultiKVConnectorMetadata)
        if connector_metadata.extra_async_saves:
            self._extra_async_saves.update(connector_metadata.extra_async_saves)
        for c, cm in zip(self._connectors, connector_metadata.metadata):
            c.bind_connector_metadata(cm)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self):
        for c in self._connectors:
            c.clear_connector_metadata()
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata):
        assert isinstance(kv_connector_metadata, MultiKVConnectorMetadata)
        for c, cm in zip(self._connectors, kv_connector_metadata.metadata):
            c.handle_preemptions(cm)

    def start_load_kv(self, forward_context, **kwargs):
        for c in self._connectors:
            c.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name):
        for c in self._connectors:
            c.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        for c in self._connectors:
            c.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        for c in self._connectors:
            c.wait_for_save()

    def get_transfer_results(self, finished_req_ids):
        out = sv.KVConnectorTransferResults()
        for c in self._connectors:
            if hasattr(c, "get_transfer_results"):
                r = c.get_transfer_results(finished_req_ids)
            else:  # vLLM's base class builds it from get_finished
                s_, r_ = c.get_finished(finished_req_ids)
                r = sv.KVConnectorTransferResults(set(s_ or ()), set(r_ or ()), set())
            out.finished_recving.update(r.finished_recving)
            out.failed_recving.update(r.failed_recving)
            for rid in r.finished_sending:
                extra = self._extra_async_saves.get(rid)
                if extra is None:
                    out.finished_sending.add(rid)
                elif extra == 1:
                    del self._extra_async_saves[rid]
                else:
                    self._extra_async_saves[rid] = extra - 1
        return out

    def get_finished(self, finished_req_ids):
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self):
        out: set[int] = set()
        for c in self._connectors:
            out |= c.get_block_ids_with_load_errors()
        return out

    def build_connector_worker_meta(self):
        metas = None
        for i, c in enumerate(self._connectors):
            m = c.build_connector_worker_meta()
            if metas is None and m is not None:
                metas = [None] * i
            if metas is not None:
                metas.append(m)
        return None if metas is None else MultiKVConnectorWorkerMetadata(tuple(metas))

    def get_kv_connector_stats(self):
        out = None
        for c in self._connectors:
            st = c.get_kv_connector_stats()
            if st is None:
                continue
            out = out or MultiKVConnectorStats()
            cid = c.__class__.__name__
            out.data[cid] = st if cid not in out.data else out.data[cid].aggregate(st)
        return out

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        if data is None:
            return MultiKVConnectorStats()
        rebuilt = {}
        for name, value in data.items():
            if isinstance(value, sv.KVConnectorStats):
                rebuilt[name] = value
                continue
            klass = factory().get_connector_class_by_name(name)
            assert isinstance(value, dict) and "data" in value, value
            st = klass.build_kv_connector_stats(data=value["data"])
            if st:
                rebuilt[name] = st
        return MultiKVConnectorStats(data=rebuilt)

    def shutdown(self):
        for c in self._connectors:
            c.shutdown()

    # scheduler
    def get_handshake_metadata(self):
        for c in self._connectors:
            md = c.get_handshake_metadata()
            if md is not None:
                return md
        return None

    def set_xfer_handshake_metadata(self, metadata):
        for c in self._connectors:
            c.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata):
        for c in self._connectors:
            c.set_xfer_handshake_metadata_pp_aware(metadata)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        ret = (0, False)
        for i, c in enumerate(self._connectors):
            toks, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if toks is None:
                return None, False
            if ret[0] == 0 and toks > 0:
                self._requests_to_connector[request.request_id] = i
                ret = (toks, load_async)
        return ret

    def get_external_cache_hit_sources(self, request, num_external_tokens):
        i = self._requests_to_connector.get(request.request_id)
        c = None if i is None else self._connectors[i]
        if c is None or not hasattr(c, "get_external_cache_hit_sources"):
            return {}
        return c.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        chosen = self._requests_to_connector.get(request.request_id, -1)
        for i, c in enumerate(self._connectors):
            c.update_state_after_alloc(request, blocks, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output):
        md = MultiKVConnectorMetadata(tuple(c.build_connector_meta(scheduler_output) for c in self._connectors))
        if self._extra_async_saves:
            md.extra_async_saves, self._extra_async_saves = self._extra_async_saves, {}
        return md

    def update_connector_output(self, connector_output):
        multi = connector_output.kv_connector_worker_meta
        assert multi is None or isinstance(multi, MultiKVConnectorWorkerMetadata)
        try:
            for i, c in enumerate(self._connectors):
                if multi is not None:
                    connector_output.kv_connector_worker_meta = multi.metadata[i]
                c.update_connector_output(connector_output)
        finally:
            connector_output.kv_connector_worker_meta = multi

    def _finished(self, request, fn):
        saves, params = 0, None
        for c in self._connectors:
            s_, p = fn(c)
            saves += bool(s_)
            if p is not None:
                params = {**(params or {}), **p}
        if saves > 1:
            self._extra_async_saves[request.request_id] = saves - 1
        self._requests_to_connector.pop(request.request_id, None)
        return saves > 0, params

    def request_finished(self, request, block_ids):
        return self._finished(request, lambda c: c.request_finished(request, block_ids))

    def request_finished_all_groups(self, request, block_ids):
        return self._finished(request, lambda c: c.request_finished_all_groups(request, block_ids))

    def take_events(self):
        for c in self._connectors:
            yield from c.take_events()

    def reset_cache(self):
        return all([c.reset_cache() is not False for c in self._connectors])


class KVConnectorLogging:
    """vLLM's stats logging in the API server (metrics.py at 7cfb97e): the
    connector class by the configured name, each interval's serialized stats
    rebuilt with its ``build_kv_connector_stats`` and reduced for the log."""

    def __init__(self, kv_transfer_config):
        self.connector_cls = factory().get_connector_class(kv_transfer_config)
        self.acc = None
        self.logged: list[dict] = []

    def observe(self, transfer_stats_data):
        st = self.connector_cls.build_kv_connector_stats(transfer_stats_data)
        if st is not None:
            self.acc = st if self.acc is None else self.acc.aggregate(st)

    def log(self):
        if self.acc is not None and not self.acc.is_empty():
            self.logged.append(self.acc.reduce())
        self.acc = None


def serialize_stats(stats) -> dict:
    """What crosses from the engine core to the API server: the stats'
    ``data``, with any stats object inside encoded as its fields (msgspec)."""
    return {k: ({"data": dict(v.data)} if isinstance(v, sv.KVConnectorStats) else v) for k, v in stats.data.items()}


def multi_transfer_config(ours: dict, order: tuple[str, ...], engine_id: str) -> SimpleNamespace:
    """The ``--kv-transfer-config`` of docs/vllm.md's MultiConnector recipe:
    ``order`` names the children ("nixl", "ours") in MultiConnector's order;
    ``ours`` is this connector's own entry."""
    children = [{"kv_connector": "NixlConnector", "kv_role": "kv_both"} if name == "nixl" else dict(ours)
                for name in order]
    return SimpleNamespace(kv_connector="MultiConnector", kv_connector_module_path=None, kv_role="kv_both",
                           kv_connector_extra_config={"connectors": children},
                           kv_load_failure_policy=ours.get("kv_load_failure_policy", "fail"),
                           is_kv_producer=True, is_kv_consumer=True, engine_id=engine_id)
