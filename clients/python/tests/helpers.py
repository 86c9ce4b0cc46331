"""Helpers and stand-ins for vLLM objects, shared by the tests.

The stand-ins carry the field names of vLLM's own classes (read from vLLM
main, see docs/vllm.md): Request, KVCacheBlocks/KVCacheBlock, NewRequestData,
CachedRequestData, SchedulerOutput, and a tensor with torch's accessors.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from types import SimpleNamespace


def wait_for(pred, timeout: float = 60.0, interval: float = 0.01):
    """Polls pred until it is true and returns its value, or its last value
    after timeout seconds. The default is a hang guard, not a deadline that
    a loaded machine's scheduling could miss: a test that asserts something
    does not happen passes its own short timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return pred()


def chained_hashes(tokens: list[int], block_size: int, seed: bytes = b"seed", hash_bytes: int = 32) -> list[bytes]:
    """vLLM-like chained block hashes: one per full block, each covering its prefix."""
    out, prev = [], seed
    for i in range(len(tokens) // block_size):
        blk = tokens[i * block_size:(i + 1) * block_size]
        prev = hashlib.sha256(prev + repr(blk).encode()).digest()[:hash_bytes]
        out.append(prev)
    return out


@dataclass
class Request:
    """vllm.v1.request.Request, the fields the connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    block_size: int = 4
    num_computed_tokens: int = 0
    hash_bytes: int = 32
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self):
        if not self.block_hashes:
            self.block_hashes = chained_hashes(self.prompt_token_ids, self.block_size, hash_bytes=self.hash_bytes)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class KVCacheBlock:
    block_id: int
    is_null: bool = False
    block_hash: bytes | None = None


class KVCacheBlocks:
    """vllm.v1.core.kv_cache_manager.KVCacheBlocks: ``blocks[g]`` per group."""

    def __init__(self, *groups: list[int]):
        self.blocks = tuple([KVCacheBlock(b, is_null=(b == 0)) for b in g] for g in groups)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in g] for g in self.blocks)


@dataclass
class NewRequestData:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None


class Device:
    def __init__(self, type: str = "cpu", index: int | None = None):
        self.type, self.index = type, index


class FakeTensor:
    """A tensor over an address range, with torch's accessors (shape,
    stride(), element_size(), data_ptr(), device)."""

    def __init__(self, address: int, shape, strides=None, element_size: int = 2, device: str = "cpu"):
        self.shape = tuple(shape)
        if strides is None:
            strides, acc = [], 1
            for n in reversed(self.shape):
                strides.append(acc)
                acc *= n
            strides = tuple(reversed(strides))
        self._strides = tuple(strides)
        self._esize = element_size
        self._addr = address
        self.device = Device(device)

    def stride(self):
        return self._strides

    def element_size(self):
        return self._esize

    def data_ptr(self):
        return self._addr

    def nbytes_span(self) -> int:
        return (sum((n - 1) * s for n, s in zip(self.shape, self._strides)) + 1) * self._esize


def ns(**kw):
    return SimpleNamespace(**kw)


class Engine:
    """One worker's KV memory: FlashAttention-shaped CPU tensors
    (2, num_blocks, block_size, heads, head_size) over one /dev/shm file,
    one tensor per layer, and a "forward pass" that writes blocks."""

    HEADS, HEAD_SIZE, ESIZE = 2, 8, 2

    def __init__(self, shm_factory, group_layers: dict[int, list[str]], group_block_sizes, num_blocks: int):
        import kvoffload

        self.num_blocks = num_blocks
        self.group_layers = group_layers
        self.block_sizes = list(group_block_sizes)
        self.seg = {g: bs * self.HEADS * self.HEAD_SIZE * self.ESIZE for g, bs in enumerate(self.block_sizes)}
        self.layer_off: dict[str, tuple[int, int]] = {}
        off = 0
        for g, names in group_layers.items():
            for n in names:
                self.layer_off[n] = (g, off)
                off += 2 * num_blocks * self.seg[g]
        self.shm: kvoffload.ShmRegion = shm_factory(off)
        self.kv_caches = {
            n: FakeTensor(self.shm.address + o,
                          (2, num_blocks, self.block_sizes[g], self.HEADS, self.HEAD_SIZE), element_size=self.ESIZE)
            for n, (g, o) in self.layer_off.items()
        }

    def layer_groups(self) -> list[list[str]]:
        return [self.group_layers[g] for g in sorted(self.group_layers)]

    def _segments(self, group: int, block: int):
        seg = self.seg[group]
        for n in self.group_layers[group]:
            _, o = self.layer_off[n]
            yield o + block * seg, seg  # K
            yield o + self.num_blocks * seg + block * seg, seg  # V

    def write(self, group: int, block: int, content: bytes) -> None:
        """Fills every layer's K and V of engine block ``block`` of ``group``."""
        for i, (off, n) in enumerate(self._segments(group, block)):
            data = hashlib.sha256(content + bytes([i])).digest() * (n // 32 + 1)
            self.shm.write(off, data[:n])

    def read(self, group: int, block: int) -> bytes:
        return b"".join(self.shm.read(off, n) for off, n in self._segments(group, block))

    def clear(self, group: int, block: int) -> None:
        for off, n in self._segments(group, block):
            self.shm.write(off, bytes(n))
