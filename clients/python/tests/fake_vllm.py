"""A minimal stand-in for the parts of vLLM that kvoffload.vllm imports.

vLLM cannot be installed here (no PyPI access), so tests put these modules in
sys.modules for the duration of a test. They follow the names and signatures
of vLLM's KVConnectorBase_V1 interface (vllm/distributed/kv_transfer/
kv_connector/v1/base.py, read at commit 003df2961dd8830c317a61f9745ccd557da9fa06)
and of the newer KVConnectorTransferResults; they implement only what a
connector relies on: metadata binding and the abstract methods.
"""

from __future__ import annotations

import enum
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

MODULES = [
    "vllm",
    "vllm.distributed",
    "vllm.distributed.parallel_state",
    "vllm.distributed.kv_transfer",
    "vllm.distributed.kv_transfer.kv_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
]


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024
    pass


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
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role

    @property
    def role(self):
        return self._role

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def _get_connector_metadata(self):
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self):
        return self._connector_metadata is not None

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


class _Rank:
    tp = 0
    pp = 0


def install(tp_rank: int = 0, with_transfer_results: bool = True) -> types.SimpleNamespace:
    saved = {m: sys.modules.get(m) for m in MODULES + ["kvoffload.vllm"]}
    for m in MODULES:
        mod = types.ModuleType(m)
        mod.__path__ = []  # a package
        sys.modules[m] = mod
    base = sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    base.KVConnectorBase_V1 = KVConnectorBase_V1
    base.KVConnectorMetadata = KVConnectorMetadata
    base.KVConnectorRole = KVConnectorRole
    base.SupportsHMA = SupportsHMA
    if with_transfer_results:
        base.KVConnectorTransferResults = KVConnectorTransferResults
    ps = sys.modules["vllm.distributed.parallel_state"]
    _Rank.tp = tp_rank
    ps.get_tensor_model_parallel_rank = lambda: _Rank.tp
    ps.get_pp_group = lambda: types.SimpleNamespace(rank_in_group=_Rank.pp)
    sys.modules.pop("kvoffload.vllm", None)
    return types.SimpleNamespace(saved=saved, rank=_Rank, Role=KVConnectorRole,
                                 TransferResults=KVConnectorTransferResults)


def uninstall(handle) -> None:
    for m, mod in handle.saved.items():
        if mod is None:
            sys.modules.pop(m, None)
        else:
            sys.modules[m] = mod
    import kvoffload

    if hasattr(kvoffload, "vllm"):
        delattr(kvoffload, "vllm")
