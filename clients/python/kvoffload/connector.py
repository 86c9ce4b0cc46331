"""The vLLM connector's logic, free of vLLM and torch: one import for it all.

:mod:`kvoffload.vllm` is a thin shell that reads vLLM's config and forwards
vLLM's calls to the two halves, one per vLLM process:

- :class:`~kvoffload.scheduler_side.SchedulerSide` (the scheduler process):
  lookups, load and store planning, ``request_finished``;
- :class:`~kvoffload.worker_side.WorkerSide` (each worker process): the
  registration, one Load and one Store per step, completions.

Keys (:mod:`kvoffload.keys`), step plans (:mod:`kvoffload.plan`) and the
fingerprint (:mod:`kvoffload.settings`) are shared by both. Tests drive the
halves with stand-ins that carry vLLM's field names.
"""

from .keys import BlockSizes, GroupShape, KeyMapper, check_hash_granularity, resolve_block_sizes
from .plan import GroupJob, StepPlan, as_groups, iter_scheduled
from .scheduler_side import SchedulerSide
from .settings import FINGERPRINT_PREFIX, namespace_fingerprint
from .worker_side import WorkerSide

__all__ = [
    "BlockSizes",
    "GroupShape",
    "KeyMapper",
    "check_hash_granularity",
    "resolve_block_sizes",
    "GroupJob",
    "StepPlan",
    "as_groups",
    "iter_scheduled",
    "SchedulerSide",
    "WorkerSide",
    "FINGERPRINT_PREFIX",
    "namespace_fingerprint",
]
