"""The parts of vLLM that a KV connector imports, as modules in sys.modules.

vLLM cannot be installed here, so tests install these instead. They follow
vLLM main read at commit 003df2961dd8830c317a61f9745ccd557da9fa06
(vllm/distributed/kv_transfer/kv_connector/v1/base.py, .../metrics.py,
vllm/v1/core/kv_cache_utils.py ``resolve_kv_cache_block_sizes``,
vllm/distributed/parallel_state.py group accessors), with switches for the
shapes other vLLM versions have: without ``KVConnectorTransferResults``
(block-level failures only), without worker metadata, and the older
``handle_preemptions(preempted_req_ids)``. They implement what a connector
relies on, nothing of vLLM's engine (that is standin_engine.py).
"""

from __future__ import annotations

import enum
import math
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

MODULES = [
    "vllm",
    "vllm.distributed",
    "vllm.distributed.parallel_state",
    "vllm.distributed.kv_transfer",
    "vllm.distributed.kv_transfer.kv_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
    "vllm.v1",
    "vllm.v1.core",
    "vllm.v1.core.kv_cache_utils",
    "vllm.distributed.kv_events",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.metrics",
    "vllm.v1.metrics.cache_hit_source",
]


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024
    pass


class KVConnectorHandshakeMetadata(ABC):  # noqa: B024
    pass


class KVConnectorWorkerMetadata(ABC):
    @abstractmethod
    def aggregate(self, other): ...


class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids): ...


@dataclass
class KVConnectorTransferResults:
    finished_sending: set = field(default_factory=set)
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)


class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        self._connector_metadata = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self):
        return self._role

    @property
    def requires_kv_delivery(self) -> bool:
        return self._kv_transfer_config.is_kv_producer

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self):
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches):
        return

    def handle_preemptions(self, kv_connector_metadata):
        return

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name): ...

    @abstractmethod
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...

    @abstractmethod
    def wait_for_save(self): ...

    def get_finished(self, finished_req_ids):
        return None, None

    def get_block_ids_with_load_errors(self):
        return set()

    def shutdown(self):
        return None

    def get_kv_connector_stats(self):
        return None

    def get_handshake_metadata(self):
        return None

    def build_connector_worker_meta(self):
        return None

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...

    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens): ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...

    def update_connector_output(self, connector_output):
        return

    def request_finished(self, request, block_ids):
        return False, None

    def take_events(self):
        return ()

    # Hooks with defaults that base.py at e0f559e has and 7cfb97e has not
    # (install(base_at="7cfb97e") removes them).
    def finish_forward(self):
        return

    def bind_kv_cache_manager(self, kv_cache_manager):
        return

    def has_pending_block_frees(self):
        return False

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads):
        return False

    def get_loaded_kv_cache_group_ids(self, request):
        # Newer vLLM's default (base.py at e0f559e): the prefix-cacheable
        # groups, all a hash-addressed store holds. install(loaded_groups=False)
        # removes it (vLLM before #57145).
        return self._kv_cache_config.prefix_cacheable_group_ids

    def reset_cache(self):
        # vLLM's default (base.py at 7cfb97e): not implemented, None, which
        # vLLM's scheduler counts as a successful reset.
        return None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        if cls is KVConnectorBase_V1:
            raise TypeError("get_required_kvcache_layout should not be called on the abstract base class")
        return None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return None

    def set_xfer_handshake_metadata(self, metadata):
        return None

    def set_xfer_handshake_metadata_pp_aware(self, metadata):
        if any(pp != 0 for pp, _ in metadata):
            raise ValueError("received pp_rank > 0 handshake metadata")
        self.set_xfer_handshake_metadata({tp: m for (_, tp), m in metadata.items()})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return None


NEWER_HOOKS = ("finish_forward", "bind_kv_cache_manager", "has_pending_block_frees", "register_finished_partial_tail",
               "get_loaded_kv_cache_group_ids")


class NullConnector(KVConnectorBase_V1):
    """A connector that does nothing: runs the stand-in engine on its own,
    to check the engine's own bookkeeping against its KV check."""

    def start_load_kv(self, forward_context, **kwargs):
        return

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        return

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        return False, None


# -- factory.py ---------------------------------------------------------------


def make_factory() -> type:
    """vLLM's KVConnectorFactory (factory.py at 7cfb97e), a fresh registry per
    install: lazy loaders by name; ``register_connector`` raises for a name
    already registered, ``get_connector_class_by_name`` for one never
    registered; ``get_connector_class`` imports ``kv_connector_module_path``
    first, else looks the name up. vLLM registers its own connectors
    (NixlConnector, MultiConnector) at import; tests register the stand-ins
    they use."""
    import importlib

    class KVConnectorFactory:
        _registry: dict = {}

        @classmethod
        def register_connector(cls, name, module_path, class_name):
            if name in cls._registry:
                raise ValueError(f"Connector '{name}' is already registered.")

            def loader():
                return getattr(importlib.import_module(module_path), class_name)

            cls._registry[name] = loader

        @classmethod
        def get_connector_class_by_name(cls, connector_name):
            if connector_name not in cls._registry:
                raise ValueError(f"Connector '{connector_name}' is not registered.")
            return cls._registry[connector_name]()

        @classmethod
        def get_connector_class(cls, kv_transfer_config):
            name = kv_transfer_config.kv_connector
            path = getattr(kv_transfer_config, "kv_connector_module_path", None)
            if path:
                try:
                    return getattr(importlib.import_module(path), name)
                except AttributeError as e:
                    raise AttributeError(f"Class {name} not found in {path}") from e
            if name in cls._registry:
                return cls._registry[name]()
            raise ValueError(f"Unsupported connector type: {name}")

    KVConnectorFactory._registry = {}
    return KVConnectorFactory


# -- metrics.py -------------------------------------------------------------


@dataclass
class KVConnectorStats:
    data: dict = field(default_factory=dict)

    def reset(self):
        raise NotImplementedError

    def aggregate(self, other):
        raise NotImplementedError

    def reduce(self):
        raise NotImplementedError

    def is_empty(self):
        return not self.data


class _Metric:
    """prometheus_client's shape: labels(*values) -> child with inc/observe."""

    registry: dict[str, "_Metric"] = {}

    def __init__(self, name, documentation, labelnames=(), buckets=None):
        self.name, self.doc, self.labelnames = name, documentation, list(labelnames)
        self.values: dict[tuple, float] = {}
        self.samples: dict[tuple, list[float]] = {}
        _Metric.registry[name] = self

    def labels(self, *values):
        assert len(values) == len(self.labelnames), (self.name, values, self.labelnames)
        metric = self

        class Child:
            def inc(self, n=1):
                metric.values[values] = metric.values.get(values, 0) + n

            def observe(self, v):
                metric.samples.setdefault(values, []).append(v)

        return Child()


class Gauge(_Metric):
    pass


class Counter(_Metric):
    pass


class Histogram(_Metric):
    pass


class KVConnectorPromMetrics:
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._gauge_cls = metric_types[Gauge]
        self._counter_cls = metric_types[Counter]
        self._histogram_cls = metric_types[Histogram]
        self._labelnames = labelnames
        self.per_engine_labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data, engine_idx=0):
        raise NotImplementedError


# -- kv_cache_utils.py: resolve_kv_cache_block_sizes ----------------------------


class AttentionSpec:
    def __init__(self, block_size, num_kv_heads=2, head_size=4, dtype="bfloat16"):
        self.block_size, self.num_kv_heads, self.head_size, self.dtype = block_size, num_kv_heads, head_size, dtype
        self.prefix_cacheable = True


class FullAttentionSpec(AttentionSpec):
    pass


class MLAAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec(AttentionSpec):
    def __init__(self, block_size, sliding_window, **kw):
        super().__init__(block_size, **kw)
        self.sliding_window = sliding_window


class RSWASpec(FullAttentionSpec):
    """vLLM's Reference Sliding Window Attention spec (kv_cache_interface.py
    at 7cfb97e): a FullAttentionSpec subclass whose decode gap blocks are
    freed while the request runs."""

    def __init__(self, block_size, rswa_window, **kw):
        super().__init__(block_size, **kw)
        self.rswa_window = rswa_window


class KVCacheSpecKind(enum.Enum):
    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"
    UNKNOWN = "unknown"


def get_kv_cache_spec_kind(spec):
    """vLLM's (kv_cache_interface.py:875 at 7cfb97e): subclasses first, then
    bases, by isinstance; an RSWASpec is FULL_ATTENTION."""
    if isinstance(spec, MLAAttentionSpec):
        return KVCacheSpecKind.MLA_ATTENTION
    if isinstance(spec, FullAttentionSpec):
        return KVCacheSpecKind.FULL_ATTENTION
    if isinstance(spec, SlidingWindowSpec):
        return KVCacheSpecKind.SLIDING_WINDOW
    if isinstance(spec, MambaSpec):
        return KVCacheSpecKind.MAMBA
    return KVCacheSpecKind.UNKNOWN


class KVCacheLayout(str, enum.Enum):
    """vLLM's layout names after #51718 (stride orders of the logical
    [L, B, H, N, C] shape); NHD and HND are LBNHC and LBHNC."""

    LBNHC = "LBNHC"
    LBHNC = "LBHNC"
    BLNHC = "BLNHC"
    BLHNC = "BLHNC"
    LHBNC = "LHBNC"
    BHLNC = "BHLNC"


class CacheHitSource(str, enum.Enum):
    """vLLM's vllm/v1/metrics/cache_hit_source.py (read through excerpts)."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


class MambaSpec:
    """vLLM's MambaSpec (kv_cache_interface.py:668 at 7cfb97e): the state
    tensors' shapes (without the block dimension) and dtypes, the cache
    mode, speculative-decoding state blocks and page padding."""

    def __init__(self, block_size, mamba_cache_mode="align", shapes=((4, 3), (2, 2, 4)), dtypes=("bfloat16", "float32"),
                 num_speculative_blocks=0, page_size_padded=None, mamba_type="mamba2"):
        self.block_size, self.mamba_cache_mode = block_size, mamba_cache_mode
        self.shapes, self.dtypes = tuple(tuple(s) for s in shapes), tuple(dtypes)
        self.num_speculative_blocks, self.page_size_padded = num_speculative_blocks, page_size_padded
        self.mamba_type = mamba_type
        self.prefix_cacheable = True

    @property
    def page_size_bytes(self):
        size = {"bfloat16": 2, "float16": 2, "float32": 4}
        n = sum(math.prod(s) * size[d] for s, d in zip(self.shapes, self.dtypes))
        return self.page_size_padded if self.page_size_padded is not None else n


def resolve_kv_cache_block_sizes(kv_cache_config, vllm_config):
    """vLLM's rule at 003df29 (kv_cache_utils.py), written from its text."""
    cache_config = vllm_config.cache_config
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    groups = kv_cache_config.kv_cache_groups
    if len(groups) <= 1:
        bs = cache_config.block_size * dcp
        return bs, bs
    sizes = [g.kv_cache_spec.block_size * dcp if isinstance(g.kv_cache_spec, AttentionSpec)
             else g.kv_cache_spec.block_size for g in groups]
    sched = math.lcm(*sizes)
    if not (cache_config.enable_prefix_caching or vllm_config.kv_transfer_config is not None):
        return sched, sched
    if any(isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.block_size != cache_config.block_size
           for g in groups):
        return sched, sched
    requested = cache_config.prefix_match_unit
    h = requested if requested is not None else math.gcd(*sizes)
    if any(bs % h for bs in sizes):
        raise ValueError(f"Invalid prefix_match_unit={h}")
    return sched, h


def maybe_convert_block_hash(hash_bytes: bytes):
    """vLLM's (kv_cache_utils.py), with vLLM's default of int hashes."""
    import os

    if not int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")):
        return hash_bytes
    return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)


# -- kv_events.py: the events a connector hands to vLLM's publisher -------------
# vLLM main at 7cfb97e33791 declares them as msgspec Structs (tagged); these
# are dataclasses with the same fields in the same order, the same defaults,
# and no others, so a connector passing a field vLLM lacks fails here as it
# would there.


@dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: Any
    token_ids: list
    block_size: int
    lora_id: Any
    medium: Any
    lora_name: Any
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: Any
    group_idx: Any = None
    locality: Any = None


@dataclass
class AllBlocksCleared:
    pass


# vLLM before lora_name and group_idx (v0.10): a connector must not pass them.
@dataclass
class OldBlockStored:
    block_hashes: list
    parent_block_hash: Any
    token_ids: list
    block_size: int
    lora_id: Any
    medium: Any


@dataclass
class OldBlockRemoved:
    block_hashes: list
    medium: Any


# -- parallel_state ------------------------------------------------------------


class _Group:
    def __init__(self):
        self.rank_in_group = 0
        self.world_size = 1


class Ranks:
    """The current process's ranks (tests set them before building a worker)."""

    tp = _Group()
    pp = _Group()
    pcp = _Group()
    dcp = _Group()
    broken = False


def _group(g):
    def get():
        if Ranks.broken:
            raise AssertionError("tensor model parallel group is not initialized")
        return g

    return get


def install(*, transfer_results: bool = True, worker_meta: bool = True, metrics: bool = True,
            resolver: bool = True, kv_events: str | None = "main", spec_kinds: bool = True,
            hit_sources: bool = True, factory: bool = True, kv_layouts: bool = False,
            loaded_groups: bool = True, base_at: str = "e0f559e") -> types.SimpleNamespace:
    """Puts the modules in sys.modules (and drops a cached kvoffload.vllm)."""
    saved = {m: sys.modules.get(m) for m in MODULES + ["kvoffload.vllm"]}
    for m in MODULES:
        mod = types.ModuleType(m)
        mod.__path__ = []
        sys.modules[m] = mod
    base = sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    for name in ("KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "SupportsHMA",
                 "KVConnectorHandshakeMetadata"):
        setattr(base, name, globals()[name])
    if transfer_results:
        base.KVConnectorTransferResults = KVConnectorTransferResults
    if worker_meta:
        base.KVConnectorWorkerMetadata = KVConnectorWorkerMetadata
    if metrics:
        met = sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.metrics"]
        met.KVConnectorStats, met.KVConnectorPromMetrics = KVConnectorStats, KVConnectorPromMetrics
    else:
        del sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.metrics"]
    if resolver:
        sys.modules["vllm.v1.core.kv_cache_utils"].resolve_kv_cache_block_sizes = resolve_kv_cache_block_sizes
    if spec_kinds:
        kci = sys.modules["vllm.v1.kv_cache_interface"]
        kci.get_kv_cache_spec_kind, kci.KVCacheSpecKind = get_kv_cache_spec_kind, KVCacheSpecKind
    gone = [] if loaded_groups else ["get_loaded_kv_cache_group_ids"]
    if base_at == "7cfb97e":
        gone = list(NEWER_HOOKS)
    saved["hooks"] = {}
    for name in gone:
        if name in KVConnectorBase_V1.__dict__:
            saved["hooks"][name] = KVConnectorBase_V1.__dict__[name]
            delattr(KVConnectorBase_V1, name)
    if factory:
        sys.modules["vllm.distributed.kv_transfer.kv_connector.factory"].KVConnectorFactory = make_factory()
    else:
        del sys.modules["vllm.distributed.kv_transfer.kv_connector.factory"]
    if kv_layouts:  # vLLM after #51718: the six stride-order names
        sys.modules["vllm.v1.kv_cache_interface"].KVCacheLayout = KVCacheLayout
    if hit_sources:
        sys.modules["vllm.v1.metrics.cache_hit_source"].CacheHitSource = CacheHitSource
    else:
        del sys.modules["vllm.v1.metrics.cache_hit_source"]
    if kv_events is None:
        del sys.modules["vllm.distributed.kv_events"]
    else:
        sys.modules["vllm.v1.core.kv_cache_utils"].maybe_convert_block_hash = maybe_convert_block_hash
        kve = sys.modules["vllm.distributed.kv_events"]
        old = kv_events == "old"
        kve.BlockStored = OldBlockStored if old else BlockStored
        kve.BlockRemoved = OldBlockRemoved if old else BlockRemoved
        kve.AllBlocksCleared = AllBlocksCleared
    ps = sys.modules["vllm.distributed.parallel_state"]
    for name, g in (("get_tp_group", Ranks.tp), ("get_pp_group", Ranks.pp), ("get_pcp_group", Ranks.pcp),
                    ("get_dcp_group", Ranks.dcp)):
        setattr(ps, name, _group(g))
    ps.get_tensor_model_parallel_rank = lambda: _group(Ranks.tp)().rank_in_group
    sys.modules["vllm.distributed"].parallel_state = ps
    sys.modules.pop("kvoffload.vllm", None)
    return types.SimpleNamespace(saved=saved, Role=KVConnectorRole, TransferResults=KVConnectorTransferResults,
                                 factory=getattr(sys.modules.get("vllm.distributed.kv_transfer.kv_connector.factory"),
                                                 "KVConnectorFactory", None))


def uninstall(handle) -> None:
    for name, hook in handle.saved.pop("hooks", {}).items():
        setattr(KVConnectorBase_V1, name, hook)
    for m, mod in handle.saved.items():
        if mod is None:
            sys.modules.pop(m, None)
        else:
            sys.modules[m] = mod
    import kvoffload

    if hasattr(kvoffload, "vllm"):
        delattr(kvoffload, "vllm")
    Ranks.broken = False
    for g in (Ranks.tp, Ranks.pp, Ranks.pcp, Ranks.dcp):
        g.rank_in_group = 0


def set_rank(tp: int = 0, pp: int = 0, pcp: int = 0, dcp: int = 0) -> None:
    Ranks.tp.rank_in_group, Ranks.pp.rank_in_group = tp, pp
    Ranks.pcp.rank_in_group, Ranks.dcp.rank_in_group = pcp, dcp


def metric_types() -> dict:
    return {Gauge: Gauge, Counter: Counter, Histogram: Histogram}


def ns(**kw: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)
