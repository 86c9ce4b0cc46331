"""What the scheduler half decides for one step, shipped to every worker.

vLLM pickles the connector metadata into every worker, so a plan holds only
plain values: per request, which keys move to or from which engine blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = ["GroupJob", "StepPlan", "iter_scheduled", "iter_written", "as_groups"]


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
    - ``fence``: engine blocks this step writes (allocated to a request, or
      a load's destination) that a store planned in an earlier step may
      still read: before the step's loads and forward, each worker waits
      for its own stores of them (a store not yet sent leaves them out).
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
    fence: list[int] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.preempted or self.delay_free or self.fence)


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


def iter_written(scheduler_output: Any, num_groups: int, block_sizes: list[int]) -> Iterator[int]:
    """The engine block ids a step allocated that its forward may write: a
    cached request's new blocks, and a new or resumed request's blocks past
    its computed tokens (those before are its local prefix hits, only read).
    vLLM's null block is never written by a step (callers skip it)."""
    for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        yield from _past(r.block_ids, int(getattr(r, "num_computed_tokens", 0) or 0), num_groups, block_sizes)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is None:
        return
    ids = list(getattr(cached, "req_ids", None) or ())
    new_ids = list(getattr(cached, "new_block_ids", None) or [None] * len(ids))
    computed = list(getattr(cached, "num_computed_tokens", None) or [0] * len(ids))
    resumed_set = getattr(cached, "resumed_req_ids", None)
    if resumed_set is not None:
        resumed = [rid in resumed_set for rid in ids]
    else:
        resumed = list(getattr(cached, "resumed_from_preemption", None) or [False] * len(ids))
    for rid, blocks, res, nct in zip(ids, new_ids, resumed, computed):
        yield from _past(blocks, int(nct or 0) if res else 0, num_groups, block_sizes)


def _past(block_ids: Any, computed: int, num_groups: int, block_sizes: list[int]) -> Iterator[int]:
    for g, ids in enumerate(as_groups(block_ids, num_groups)):
        first = computed // block_sizes[g] if computed else 0
        for b in ids[first:]:
            if b is not None:
                yield int(b)


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
