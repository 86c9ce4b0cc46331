"""How vLLM's block hashes map to kvoffload keys, at vLLM's own granularity.

vLLM hashes a request's tokens in chained blocks of ``hash_block_size``
tokens (``Request.block_hashes``): each hash names the whole prefix that ends
at its boundary. The size is not ``cache_config.block_size``; vLLM resolves
it from the KV cache groups (``resolve_kv_cache_block_sizes`` in
``vllm/v1/core/kv_cache_utils.py``):

- one group: ``cache_config.block_size * dcp`` (decode context parallel
  shards each block's tokens across the DCP ranks, so the scheduler's
  blocks are ``dcp`` times larger than a rank's);
- several groups: ``cache_config.prefix_match_unit`` when set, else the gcd
  of the groups' block sizes (attention groups scaled by dcp); the scheduler
  block size is their lcm.

:func:`resolve_block_sizes` is that rule, for a vLLM that does not export it
(the vLLM shell prefers vLLM's own function and checks it agrees).
:class:`KeyMapper` turns the hashes into the key of each group's engine
blocks, and :func:`check_hash_granularity` verifies on every request that
the hashes really are that size, so a vLLM whose rule drifted from this one
disables offloading instead of loading another prompt's KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["GroupShape", "BlockSizes", "resolve_block_sizes", "KeyMapper", "check_hash_granularity"]


@dataclass(frozen=True)
class GroupShape:
    """What the block-size rule needs of one KV cache group's spec."""

    block_size: int  # tokens per block on one rank (kv_cache_spec.block_size)
    attention: bool = True  # an AttentionSpec (scaled by dcp); False for Mamba
    mamba_align: bool = True  # Mamba only: mamba_cache_mode == "align"
    prefix_cacheable: bool = True


@dataclass(frozen=True)
class BlockSizes:
    """The resolved sizes, in tokens, as the scheduler sees them."""

    scheduler: int  # vLLM's scheduler block size: a load or store moves whole units of it
    hash: int  # tokens per entry of Request.block_hashes
    groups: tuple[int, ...]  # tokens per scheduler block of each group (dcp scaled)


def resolve_block_sizes(
    groups: Sequence[GroupShape],
    cache_block_size: int,
    dcp: int = 1,
    prefix_match_unit: int | None = None,
    hashing_active: bool = True,
) -> BlockSizes:
    """vLLM's ``resolve_kv_cache_block_sizes``, read at vLLM commit
    003df2961dd8830c317a61f9745ccd557da9fa06. Raises ValueError where vLLM
    would (a prefix_match_unit that does not divide every group)."""
    dcp = max(1, int(dcp))
    if len(groups) <= 1:
        bs = int(cache_block_size) * dcp
        if groups and groups[0].block_size * (dcp if groups[0].attention else 1) != bs:
            raise ValueError(
                f"the only KV cache group has {groups[0].block_size}-token blocks but cache_config.block_size "
                f"is {cache_block_size}: not a configuration vLLM builds"
            )
        return BlockSizes(bs, bs, (bs,))
    sizes = tuple(g.block_size * dcp if g.attention else g.block_size for g in groups)
    sched = math.lcm(*sizes)
    if not hashing_active or any(not g.attention and not g.mamba_align for g in groups):
        return BlockSizes(sched, sched, sizes)
    cacheable = [s for g, s in zip(groups, sizes) if g.prefix_cacheable] or list(sizes)
    h = int(prefix_match_unit) if prefix_match_unit else math.gcd(*cacheable)
    if h <= 0 or any(s % h for s in cacheable):
        raise ValueError(f"prefix_match_unit={h} does not divide the group block sizes {list(sizes)}")
    return BlockSizes(sched, h, sizes)


class KeyMapper:
    """Maps a request's block hashes to the keys of each group's engine blocks.

    Group ``g`` has engine blocks of ``group_block_sizes[g]`` tokens, a
    multiple ``f`` of the hash size; the key of its block ``i`` is the hash
    that ends it, ``hashes[(i+1)*f - 1]`` (the hash names the whole prefix).
    Loads and stores move whole *units* of ``lcm(group block sizes)`` tokens
    so that every group ends on a block boundary.

    ``windows[g]`` is group ``g``'s window in its blocks, None for full
    attention (docs/vllm.md, hybrid models): a hit ending at unit ``N``
    needs every block ``[0, N*bpu)`` of a full-attention group but only the
    last ``W`` of them, ``[N*bpu - W, N*bpu)``, of a windowed one.

    ``scratch[g]`` marks a group vLLM never prefix-caches
    (``prefix_cacheable=False``: per-request state such as a bounded replay
    window): it has no keys, is never looked up, stored or loaded, and is in
    neither ``full_groups`` nor ``windowed_groups``; vLLM rebuilds it itself
    after a hit (``get_loaded_kv_cache_group_ids``).
    """

    def __init__(self, hash_block_size: int, group_block_sizes: Sequence[int],
                 windows: Sequence[int | None] | None = None, scratch: Sequence[bool] | None = None):
        if hash_block_size <= 0 or not group_block_sizes:
            raise ValueError("need a positive hash block size and at least one group")
        for g, bs in enumerate(group_block_sizes):
            if bs <= 0 or bs % hash_block_size:
                raise ValueError(f"group {g} block size {bs} is not a multiple of the hash block size {hash_block_size}")
        self.hash_block_size = int(hash_block_size)
        self.block_sizes = tuple(int(b) for b in group_block_sizes)
        self.factors = tuple(b // self.hash_block_size for b in self.block_sizes)
        self.unit_tokens = math.lcm(*self.block_sizes)
        self.blocks_per_unit = tuple(self.unit_tokens // b for b in self.block_sizes)
        ws = tuple(windows) if windows else (None,) * len(self.block_sizes)
        if len(ws) != len(self.block_sizes):
            raise ValueError(f"{len(ws)} windows for {len(self.block_sizes)} groups")
        for g, w in enumerate(ws):
            if w is not None and int(w) <= 0:
                raise ValueError(f"group {g} has a window of {w} blocks; a windowed group needs at least one")
        self.windows: tuple[int | None, ...] = tuple(None if w is None else int(w) for w in ws)
        sc = tuple(bool(x) for x in scratch) if scratch else (False,) * len(self.block_sizes)
        if len(sc) != len(self.block_sizes):
            raise ValueError(f"{len(sc)} scratch flags for {len(self.block_sizes)} groups")
        if all(sc):
            raise ValueError("every group is per-request scratch: nothing to look up")
        self.scratch_groups = tuple(g for g, x in enumerate(sc) if x)
        self.full_groups = tuple(g for g, w in enumerate(self.windows) if w is None and not sc[g])
        self.windowed_groups = tuple(g for g, w in enumerate(self.windows) if w is not None and not sc[g])
        self.full_and_windowed = self.full_groups + self.windowed_groups  # every group but the scratch ones
        # One full-attention group whose blocks are the units, a hash each,
        # and no windowed group (most models): a lookup is one probe a unit.
        self.plain = (len(self.full_groups) == 1 and not self.windowed_groups
                      and self.factors[self.full_groups[0]] == 1 and self.blocks_per_unit[self.full_groups[0]] == 1)

    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    def units_in(self, num_hashes: int, num_tokens: int | None = None) -> int:
        """Whole units covered by ``num_hashes`` hashes (and ``num_tokens``)."""
        tokens = num_hashes * self.hash_block_size
        if num_tokens is not None:
            tokens = min(tokens, num_tokens)
        return max(0, tokens) // self.unit_tokens

    def block_range(self, group: int, start_unit: int, end_unit: int) -> range:
        """The engine block indexes of ``group`` in units [start, end)."""
        k = self.blocks_per_unit[group]
        return range(start_unit * k, end_unit * k)

    def window_blocks(self, group: int, end_unit: int) -> range:
        """The blocks of ``group`` a hit ending at unit ``end_unit`` needs:
        every block from 0 for a full-attention group, the last ``W`` for a
        windowed one."""
        k = self.blocks_per_unit[group]
        w = self.windows[group]
        stop = max(0, end_unit) * k
        return range(0 if w is None else max(0, stop - w), stop)

    def stores_block(self, group: int, i: int) -> bool:
        """Whether block ``i`` of ``group`` is ever inside a hit's window
        (hits end on unit boundaries): every block of a full-attention group,
        and of a windowed one those among the last ``W`` of their unit."""
        if group in self.scratch_groups:
            return False
        w = self.windows[group]
        k = self.blocks_per_unit[group]
        return w is None or w >= k or i % k >= k - w

    def stored_blocks(self, group: int, start_unit: int, end_unit: int) -> list[int]:
        """The blocks of ``group`` in units [start, end) that are stored
        (:meth:`stores_block`), in order."""
        return [i for i in self.block_range(group, start_unit, end_unit) if self.stores_block(group, i)]

    def stored_per_unit(self, group: int) -> int:
        """How many of a unit's blocks of ``group`` are stored."""
        if group in self.scratch_groups:
            return 0
        w, k = self.windows[group], self.blocks_per_unit[group]
        return k if w is None else min(w, k)

    def keys(self, hashes: Sequence[bytes], group: int, blocks: Sequence[int]) -> list[bytes]:
        f = self.factors[group]
        return [bytes(hashes[(i + 1) * f - 1]) for i in blocks]


def check_hash_granularity(num_hashes: int, num_tokens: int, hash_block_size: int) -> bool:
    """Whether a request with ``num_tokens`` tokens and ``num_hashes`` block
    hashes was hashed every ``hash_block_size`` tokens. vLLM hashes every full
    block (T // h); with EAGLE-aware hashing the block that ends at the last
    token waits for its successor ((T-1) // h). Anything else means the
    connector's idea of the hash size is wrong."""
    if num_tokens <= 0:
        return num_hashes == 0
    return (num_tokens - 1) // hash_block_size <= num_hashes <= num_tokens // hash_block_size
