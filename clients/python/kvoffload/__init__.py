"""Python client of kvoffloadd, and a vLLM KV connector on top of it.

- :class:`Client` (kvoffload.client): the typed client of the kvoffload.v1
  gRPC API served on the daemon's unix socket.
- :mod:`kvoffload.types`: the plain values it takes and returns.
- :mod:`kvoffload.errors`: the exceptions it raises (gRPC code + message).
- :mod:`kvoffload.shm`: /dev/shm regions the daemon can map.
- :mod:`kvoffload.connector`: the vLLM-free logic of the connector, one import
  for the scheduler half (:mod:`~kvoffload.scheduler_side`), the worker half
  (:mod:`~kvoffload.worker_side`), keys at vLLM's hash granularity
  (:mod:`~kvoffload.keys`) and step plans (:mod:`~kvoffload.plan`).
- :mod:`kvoffload.vllm`: ``KVOffloadConnector``, the vLLM KVConnectorBase_V1
  (imports vLLM; load it with kv_connector_module_path="kvoffload.vllm").
"""

from ._version import PROTOCOL_VERSION, __version__
from .client import Client
from .errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KVOffloadError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from .shm import ShmRegion, shm_location
from .types import (
    BlockFailure,
    BlockStatus,
    Completions,
    DiskRecovery,
    RecoveryState,
    EventKind,
    Job,
    JobResult,
    KVEvent,
    Layout,
    LookupResult,
    Op,
    Region,
    Registration,
    Segment,
    Stats,
    Tier,
)

__all__ = [
    "__version__",
    "PROTOCOL_VERSION",
    "Client",
    "KVOffloadError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "ResourceExhausted",
    "Unavailable",
    "PermissionDenied",
    "DeadlineExceeded",
    "Cancelled",
    "Internal",
    "ShmRegion",
    "shm_location",
    "BlockFailure",
    "BlockStatus",
    "Completions",
    "DiskRecovery",
    "RecoveryState",
    "EventKind",
    "Job",
    "JobResult",
    "KVEvent",
    "Layout",
    "LookupResult",
    "Op",
    "Region",
    "Registration",
    "Segment",
    "Stats",
    "Tier",
]
