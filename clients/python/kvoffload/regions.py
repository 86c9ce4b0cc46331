"""Regions and layout read off an engine's KV cache tensors.

vLLM hands a connector its KV caches as ``{layer_name: tensor}`` (or a tuple
of tensors per layer for state-space layers). Every attention backend puts
the engine block index on one dimension of size ``num_blocks``; the rest of
the shape differs: FlashAttention uses ``(2, num_blocks, block_size, heads,
head_size)`` (K and V apart), FlashInfer ``(num_blocks, 2, ...)`` (K and V
together), MLA ``(num_blocks, block_size, dim)``, and a backend may permute
the physical order (HND) through the strides. So nothing here knows a
backend: from each tensor's shape and strides it finds

- the block dimension (the only one of size ``num_blocks``) and its stride,
  which is the region's ``block_stride``;
- the *inner* dimensions (stride below the block stride), which must tile
  one dense run of bytes: the segment;
- the *outer* dimensions (stride at or above the block stride, like K/V in
  FlashAttention), each index of which is a separate region.

A tensor is described by a small protocol that torch tensors satisfy:
``shape``, ``stride()``, ``element_size()``, ``data_ptr()`` and ``device``
(with ``.type`` "cpu" or "cuda" and ``.index``). CPU tensors must live in a
/dev/shm file mapped shared (found through /proc/self/maps), CUDA tensors are
exported as CUDA IPC handles.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from .cuda_ipc import TorchCudaExporter
from .shm import shm_location
from .types import Layout, Region, Segment

__all__ = [
    "LayoutError",
    "SegmentGeometry",
    "split_block_tensor",
    "KVRegistration",
    "regions_from_kv_caches",
    "torch_cuda_exporter",
]


class LayoutError(ValueError):
    """The KV tensors cannot be described as kvoffload regions."""


@dataclass(frozen=True)
class SegmentGeometry:
    """One region cut out of a tensor: block ``b`` is at
    ``data_ptr + offset + b*block_stride``, ``nbytes`` long."""

    offset: int
    nbytes: int
    block_stride: int


def _geometry(t: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    shape = tuple(int(s) for s in t.shape)
    strides = tuple(int(s) for s in t.stride())
    if len(shape) != len(strides):
        raise LayoutError(f"tensor has shape {shape} but strides {strides}")
    return shape, strides, int(t.element_size())


def split_block_tensor(
    shape: Sequence[int],
    strides: Sequence[int],
    element_size: int,
    num_blocks: int,
    *,
    name: str = "tensor",
    block_size: int | None = None,
) -> list[SegmentGeometry]:
    """Cuts a KV tensor into regions, one per index of its outer dimensions.

    ``strides`` are in elements, as torch reports them. The block dimension
    has ``num_blocks`` entries, or ``num_blocks * r`` when the attention
    backend's kernel block is ``r`` times smaller than vLLM's block (vLLM
    then allocates ``r`` kernel blocks per block, engine block ``b`` being
    kernel blocks ``b*r .. b*r+r-1``); ``block_size`` (tokens per engine
    block) lets the split check that ``r`` divides it. Raises LayoutError
    when no dimension fits, when two do, or when the bytes of one kernel
    block are not one dense run.
    """
    shape, strides = tuple(int(x) for x in shape), tuple(int(x) for x in strides)
    exact = [d for d, s in enumerate(shape) if s == num_blocks]
    if len(exact) > 1:
        # Only in toy configurations does another dimension (K/V, heads)
        # have exactly num_blocks entries; refuse rather than guess.
        raise LayoutError(
            f"{name}: shape {shape} has {len(exact)} dimensions of size num_blocks={num_blocks} "
            f"(dims {exact}); cannot tell which one indexes blocks"
        )
    if exact:
        bd, ratio = exact[0], 1
    else:
        split = [d for d, s in enumerate(shape) if num_blocks > 0 and s > num_blocks and s % num_blocks == 0]
        if block_size:
            split = [d for d in split if block_size % (shape[d] // num_blocks) == 0]
        if not split:
            raise LayoutError(
                f"{name}: shape {shape} has no dimension of size num_blocks={num_blocks} "
                f"or a multiple of it that splits {block_size or '?'}-token blocks into kernel blocks"
            )
        if len(split) > 1:
            raise LayoutError(
                f"{name}: shape {shape} has {len(split)} dimensions that are multiples of num_blocks={num_blocks} "
                f"(dims {split}); cannot tell which one indexes kernel blocks"
            )
        bd = split[0]
        ratio = shape[bd] // num_blocks
    kernel_blocks = num_blocks * ratio
    kstride_el = strides[bd]
    if kstride_el <= 0 and kernel_blocks > 1:
        raise LayoutError(f"{name}: block dimension {bd} has stride {kstride_el}")
    inner, outer = [], []
    for d, (n, st) in enumerate(zip(shape, strides)):
        if d == bd or n == 1:
            continue
        if st <= 0:
            raise LayoutError(f"{name}: dimension {d} has stride {st}")
        (inner if st < kstride_el else outer).append((n, st, d))
    expected = 1
    for n, st, d in sorted(inner, key=lambda x: x[1]):
        if st != expected:
            raise LayoutError(
                f"{name}: the bytes of one block are not contiguous (shape {shape}, strides {strides}: "
                f"dimension {d} has stride {st}, want {expected})"
            )
        expected *= n
    kbytes = expected * element_size
    kstride = kstride_el * element_size
    if kernel_blocks > 1 and kbytes > kstride:
        raise LayoutError(f"{name}: a block is {kbytes} bytes but blocks are {kstride} apart")
    # One engine block: r consecutive kernel blocks. Dense kernel blocks make
    # one run of r*kbytes; padded ones are r runs, one region each.
    if ratio == 1 or kbytes == kstride:
        pieces = [(0, kbytes * ratio)]
    else:
        pieces = [(i * kstride, kbytes) for i in range(ratio)]
    bstride = kstride * ratio
    out = []
    ranges = [range(n) for n, _, _ in outer]
    for idx in itertools.product(*ranges):
        off = sum(i * st for i, (_, st, _) in zip(idx, outer)) * element_size
        for poff, plen in pieces:
            out.append(SegmentGeometry(offset=off + poff, nbytes=plen, block_stride=bstride))
    # Two regions of one tensor must not share a byte of any block.
    for a, b in itertools.combinations(out, 2):
        if _blocks_overlap(abs(a.offset - b.offset), max(a.nbytes, b.nbytes), bstride, num_blocks):
            raise LayoutError(f"{name}: shape {shape} with strides {strides} makes blocks of two regions overlap")
    return out


def block_order(shape: Sequence[int], strides: Sequence[int], num_blocks: int, *,
                block_size: int | None = None) -> tuple:
    """What orders the bytes inside one block of a tensor, and nothing that
    depends on how many blocks there are: the block dimension's position and
    how many kernel blocks make an engine block, the kernel block stride,
    and for every other dimension its size, with its stride when that is
    inside a block (outer dimensions, like K/V planes, are ``None``: their
    stride is a multiple of the block count). Call after split_block_tensor
    accepted the tensor."""
    shape, strides = tuple(int(x) for x in shape), tuple(int(x) for x in strides)
    bd, ratio = _block_dim(shape, num_blocks, block_size)
    dims = []
    for d, (n, st) in enumerate(zip(shape, strides)):
        if d == bd:
            dims.append(("blocks", ratio))
        else:
            dims.append((n, st if n > 1 and st < strides[bd] else None))
    return (bd, strides[bd], tuple(dims))


def _block_dim(shape: tuple[int, ...], num_blocks: int, block_size: int | None) -> tuple[int, int]:
    exact = [d for d, s in enumerate(shape) if s == num_blocks]
    if exact:
        return exact[0], 1
    split = [d for d, s in enumerate(shape) if num_blocks > 0 and s > num_blocks and s % num_blocks == 0]
    if block_size:
        split = [d for d in split if block_size % (shape[d] // num_blocks) == 0]
    return split[0], shape[split[0]] // num_blocks


def _blocks_overlap(d: int, nbytes: int, bstride: int, num_blocks: int) -> bool:
    """Whether block i of a region at offset 0 and block j of one at offset d
    overlap for some i, j < num_blocks: |d + (j-i)*bstride| < nbytes."""
    if bstride == 0 or num_blocks == 1:
        return d < nbytes
    lim = num_blocks - 1
    m0 = max(-lim, min(lim, -round(d / bstride)))
    return any(abs(d + m * bstride) < nbytes for m in (m0 - 1, m0, m0 + 1) if -lim <= m <= lim)


# A CUDA exporter turns a CUDA tensor into (ipc handle, device, offset of the
# tensor's first byte within the exported allocation, allocation size), and
# optionally the device's 16-byte UUID as a fifth item.
CudaExporter = Callable[[Any], tuple]


def torch_cuda_exporter(t: Any) -> tuple[bytes, int, int, int, bytes]:
    """Exports one torch CUDA tensor (see :class:`kvoffload.cuda_ipc.TorchCudaExporter`,
    which regions_from_kv_caches uses, once per storage)."""
    return TorchCudaExporter()(t)


@dataclass
class KVRegistration:
    """What Register needs, read off the KV tensors, plus for each region the
    layer it came from (for logs)."""

    layout: Layout
    regions: list[Region]
    region_layers: list[str]
    num_blocks: int
    device: str  # "cpu" or "cuda"
    # How the bytes of a block are ordered, as the tensors say: per tensor its
    # group, dtype, element size and block_order (which dimension indexes
    # blocks, kernel blocks per engine block, every other dimension's size
    # and, within a block, its stride; the kernel block stride). Two engines
    # whose tensors differ here (another attention backend, NHD vs HND,
    # another kernel block size) hold different bytes for the same tokens,
    # so this goes into the namespace fingerprint. How many blocks there are
    # (and so the strides between K and V planes) is left out: it moves
    # between restarts with memory profiling.
    geometry: tuple = ()


def _tensors_of(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_tensors_of(v))
        return out
    return [value]


def regions_from_kv_caches(
    kv_caches: Mapping[str, Any],
    layer_groups: Mapping[str, int] | Sequence[Iterable[str]],
    num_blocks: int,
    hash_bytes: int,
    *,
    cuda_exporter: CudaExporter | None = None,
    shm_locator: Callable[[int], Any] = shm_location,
    group_block_sizes: Sequence[int] | None = None,
) -> KVRegistration:
    """Builds the layout and regions of one worker's KV caches.

    ``layer_groups`` maps each layer name to its KV cache group (or lists the
    layer names of each group, in group order, as vLLM's
    ``kv_cache_config.kv_cache_groups[g].layer_names`` does). Segments are
    ordered by group, then by layer name order within the group, then by
    outer index, so every worker of the same model gets the same layout.
    Layers whose tensors alias memory already registered for the same group
    (shared KV) are registered once. ``group_block_sizes`` (tokens per
    engine block of each group, on this rank) lets a tensor with kernel
    blocks smaller than vLLM's blocks be mapped (see split_block_tensor).
    """
    if not isinstance(layer_groups, Mapping):
        mapping: dict[str, int] = {}
        for g, names in enumerate(layer_groups):
            for n in names:
                mapping.setdefault(n, g)
        layer_groups = mapping
    order = {name: i for i, name in enumerate(layer_groups)}
    names = [n for n in kv_caches if n in layer_groups]
    unknown = [n for n in kv_caches if n not in layer_groups]
    if unknown:
        raise LayoutError(f"layers {unknown[:4]} are in kv_caches but in no KV cache group")
    if not names:
        raise LayoutError("no KV cache tensors to register")
    names.sort(key=lambda n: (layer_groups[n], order[n]))

    segments: list[Segment] = []
    regions: list[Region] = []
    region_layers: list[str] = []
    seen: set[tuple] = set()
    device_kind = None
    exporter = cuda_exporter or TorchCudaExporter()
    exported: dict[int, tuple] = {}
    geometry: list[tuple] = []
    for name in names:
        g = int(layer_groups[name])
        for ti, t in enumerate(_tensors_of(kv_caches[name])):
            label = name if ti == 0 else f"{name}[{ti}]"
            shape, strides, esize = _geometry(t)
            kind = getattr(getattr(t, "device", None), "type", "cpu")
            if device_kind is None:
                device_kind = kind
            elif kind != device_kind:
                raise LayoutError(f"{label} is on {kind}, earlier layers on {device_kind}: all KV tensors must share a device kind")
            base = int(t.data_ptr())
            bs = None if group_block_sizes is None or g >= len(group_block_sizes) else int(group_block_sizes[g])
            geometry.append((g, str(getattr(t, "dtype", "")), esize,
                             block_order(shape, strides, num_blocks, block_size=bs)))
            for geo in split_block_tensor(shape, strides, esize, num_blocks, name=label, block_size=bs):
                addr = base + geo.offset
                key = (g, kind, addr, geo.nbytes, geo.block_stride)
                if key in seen:
                    continue
                seen.add(key)
                if kind == "cuda":
                    if id(t) not in exported:
                        exported[id(t)] = tuple(exporter(t))
                    handle, device, t_off, alloc = exported[id(t)][:4]
                    uuid = exported[id(t)][4] if len(exported[id(t)]) > 4 else b""
                    off = t_off + geo.offset
                    span = off + (num_blocks - 1) * geo.block_stride + geo.nbytes
                    if span > alloc:
                        raise LayoutError(f"{label}: blocks reach byte {span} of an exported allocation of {alloc}")
                    region = Region.cuda(
                        handle, device=device, alloc_size=alloc, offset=off,
                        block_stride=geo.block_stride, num_blocks=num_blocks, device_uuid=uuid,
                    )
                elif kind == "cpu":
                    loc = shm_locator(addr)
                    if loc is None:
                        raise LayoutError(
                            f"{label}: CPU KV cache memory at {addr:#x} is not a /dev/shm file mapped shared; "
                            "the daemon can only map /dev/shm files (allocate the CPU KV cache over "
                            "kvoffload.ShmRegion or another /dev/shm mapping)"
                        )
                    need = (num_blocks - 1) * geo.block_stride + geo.nbytes
                    if loc.file_bytes_after < need:
                        raise LayoutError(
                            f"{label}: the /dev/shm mapping of {loc.path} ends {loc.file_bytes_after} bytes "
                            f"after the first block, the blocks need {need}"
                        )
                    region = Region.shm(loc.path, offset=loc.offset, block_stride=geo.block_stride, num_blocks=num_blocks)
                else:
                    raise LayoutError(f"{label}: KV tensors on device {kind!r} are not supported")
                segments.append(Segment(group=g, bytes=geo.nbytes))
                regions.append(region)
                region_layers.append(label)
    groups = sorted({s.group for s in segments})
    if groups != list(range(len(groups))):
        raise LayoutError(f"KV cache groups {groups} are not numbered 0..n-1")
    return KVRegistration(Layout(hash_bytes, segments), regions, region_layers, num_blocks, device_kind or "cpu",
                          tuple(geometry))
