"""What the scheduler half decides for one step, shipped to every worker.

vLLM pickles the connector metadata into every worker, so a plan holds only
plain values: per request, which keys move to or from which engine blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = ["GroupJob", "StepPlan", "iter_scheduled", "as_groups"]


@dataclass
class GroupJob:
    """One request's blocks of one group: ``hashes[i]`` <-> engine block
    ``block_ids[i]``. ``lease_id`` is the Lookup lease that holds the blocks
    of a load until the daemon pins them for the copy."""

    group: int
    hashes: list[bytes]
    block_ids: list[int]
    lease_id: int = 0


@dataclass
class StepPlan:
    """One step's plan.

    - ``seq``: the scheduler's step number (stores are acknowledged by it).
    - ``loads``: per request, the blocks to load now (an empty list still
      means "report this request finished receiving").
    - ``stores``: per request, the full blocks computed by this step.
    - ``preempted``: requests whose blocks vLLM is about to reuse: their
      stores must drain or be dropped first.
    - ``delay_free``: requests for which ``request_finished`` returned True:
      workers report them finished sending once their stores drained.
    - ``identity``: (generation, token) of the engine's identity: a worker
      that sees a newer generation moves to the fingerprints derived from
      the token before it loads or stores anything of this plan.
    """

    seq: int = 0
    loads: dict[str, list[GroupJob]] = field(default_factory=dict)
    stores: dict[str, list[GroupJob]] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    delay_free: set[str] = field(default_factory=set)
    identity: tuple[int, bytes] = (0, b"")

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.preempted or self.delay_free)


def iter_scheduled(scheduler_output: Any) -> Iterator[tuple[str, Any, bool]]:
    """(request id, new block ids per group or None, resumed) for every request
    scheduled in a step, new ones first (vLLM's own ``yield_req_data``). For a
    new or resumed request the block ids replace the old ones instead of
    extending them. Reads ``resumed_req_ids`` (current vLLM) or
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


def as_groups(block_ids: Any, num_groups: int) -> list[list[int | None]]:
    """Block ids per group from vLLM's tuple-of-lists (or a flat list for one
    group); a group vLLM left out (None) has no new blocks."""
    if block_ids is None:
        return [[] for _ in range(num_groups)]
    if num_groups == 1 and block_ids and not isinstance(block_ids[0], (list, tuple)) and block_ids[0] is not None:
        return [list(block_ids)]
    groups = [list(g) if g is not None else [] for g in block_ids]
    if len(groups) != num_groups:
        raise ValueError(f"got block ids for {len(groups)} groups, the model has {num_groups}")
    return groups
