"""Mamba / linear-attention state groups in vLLM's ``mamba_cache_mode="align"``.

In align mode vLLM keeps a group's recurrent state per block, the way
attention keeps KV (read at vLLM main 7cfb97e, docs/vllm.md, "Mamba"):

- block ``i`` of a request's Mamba group holds the state after exactly
  ``(i + 1) * block_size`` tokens once a step ended there: the scheduler
  clips prefill chunks to block boundaries (``_mamba_block_aligned_split``),
  a decode step crosses each boundary exactly, and only the last block of a
  chunk is a real block, the others vLLM's null block
  (``MambaManager.allocate_new_blocks``);
- a hit of ``N`` blocks needs only the state block ``N - 1``: vLLM pads the
  blocks before it with null blocks (``add_local_computed_blocks``) and
  allocates that one block for an external hit
  (``allocate_external_computed_blocks``), so a load moves it and the
  attention groups' blocks, nothing else;
- the previous state block is freed two steps after the boundary
  (``remove_skipped_blocks``): vLLM reuses it while the request runs, like
  the blocks behind a sliding window.

In the shared rule of windowed groups (kvoffload.keys) such a group is a
window of ``W = 1`` block (``kvoffload.settings.group_window``). Every unit boundary is a block boundary of the
group (the unit is the lcm of the groups' block sizes), so a unit-aligned hit
is rounded down to a committed state exactly when the state block at its
end is present.

Not served, refused at start with the setting to change:
``mamba_cache_mode`` "none" (one running state per request, no per-block
state) and "all"; speculative decoding in align mode
(``num_speculative_blocks > 0``: the state at a boundary crossed inside a
speculative step is copied into its block after the step by the model
runner's postprocess, a copy this connector cannot order its store after);
a vLLM whose specs do not carry the state shapes and dtypes, or whose model
runner does not hand each layer's per-block state to connectors.
"""

from __future__ import annotations

from math import prod
from typing import Any, Mapping, Sequence

__all__ = ["is_mamba", "refusal", "state_identity", "state_bytes", "check_registration"]

# Element sizes of the dtypes vLLM gives Mamba state (torch names, with or
# without the "torch." prefix).
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8, "int8": 1,
                "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int32": 4, "int64": 8}


def is_mamba(spec: Any, kind: str | None) -> bool:
    """Whether a KV cache spec is vLLM's MambaSpec (any state-space or
    linear-attention layer: Mamba, Mamba2, gated delta net, short conv)."""
    if kind is not None:
        return kind == "MAMBA"
    return any("Mamba" in c.__name__ for c in type(spec).__mro__)


def _dtype_name(d: Any) -> str:
    return str(d).removeprefix("torch.")


def state_bytes(spec: Any) -> int | None:
    """Bytes of one block's state as the spec declares it (the sum over its
    state tensors of their elements times the element size), without vLLM's
    page padding; None when a dtype is unknown."""
    total = 0
    for shape, dtype in zip(getattr(spec, "shapes", ()) or (), getattr(spec, "dtypes", ()) or ()):
        size = _DTYPE_BYTES.get(_dtype_name(dtype))
        if size is None:
            return None
        total += prod(int(x) for x in shape) * size
    return total


def refusal(spec: Any, layer_names: Sequence[str], *, prefix_caching: bool, dcp: int, pcp: int,
            speculative: bool = False) -> str | None:
    """Why a Mamba group cannot be offloaded on this vLLM, in one sentence
    that names the setting or version needed; None when it can."""
    where = f"KV cache group of {type(spec).__name__} (layers {list(layer_names)[:2]}...)"
    mode = getattr(spec, "mamba_cache_mode", None)
    if mode is None:
        return (f"state-space (Mamba) layers: {where} has no mamba_cache_mode: this vLLM keeps one state per "
                "request, not per block; offloading them needs a vLLM with mamba_cache_mode \"align\" "
                "(--mamba-cache-mode align)")
    if mode != "align":
        return (f"state-space (Mamba) layers: {where} runs with mamba_cache_mode {mode!r}; offloading them needs "
                "mamba_cache_mode \"align\" (--mamba-cache-mode align), where each block boundary's state is "
                "committed in its own block")
    nspec = int(getattr(spec, "num_speculative_blocks", 0) or 0)
    if nspec > 0 or speculative:
        return (f"state-space (Mamba) layers: {where} has {nspec} speculative-decoding state blocks; offloading "
                "Mamba state is not supported with speculative decoding (drop --speculative-config): the state "
                "at a boundary crossed inside a speculative step is copied into its block after the step")
    shapes, dtypes = getattr(spec, "shapes", None), getattr(spec, "dtypes", None)
    if not shapes or not dtypes or len(shapes) != len(dtypes):
        return (f"state-space (Mamba) layers: {where} does not declare its state shapes and dtypes "
                "(MambaSpec.shapes/dtypes): this vLLM is too old to offload Mamba state")
    if state_bytes(spec) is None:
        return f"state-space (Mamba) layers: {where} has a state dtype this connector does not know: {list(dtypes)}"
    if not prefix_caching:
        return (f"state-space (Mamba) layers: {where} needs prefix caching for mamba_cache_mode \"align\" "
                "(--enable-prefix-caching)")
    if dcp > 1 or pcp > 1:
        return f"state-space (Mamba) layers: {where} with context parallelism (vLLM does not build it)"
    return None


def state_identity(spec: Any) -> dict:
    """What shapes a Mamba block's bytes beyond the block size: each state
    tensor's shape and dtype, the kind of layer (Mamba1/2, gated delta net,
    ...), the cache mode and the speculative blocks (the block size and the
    page padding are in every group's identity). Two models that differ in
    any of these never share blocks."""
    return {
        "state_shapes": [[int(x) for x in s] for s in (getattr(spec, "shapes", None) or ())],
        "state_dtypes": [_dtype_name(d) for d in (getattr(spec, "dtypes", None) or ())],
        "mamba_type": str(getattr(spec, "mamba_type", None)),
        "mamba_cache_mode": str(getattr(spec, "mamba_cache_mode", None)),
        "num_speculative_blocks": int(getattr(spec, "num_speculative_blocks", 0) or 0),
    }


def check_registration(segments: Sequence[Any], region_layers: Sequence[str], group_layers: Sequence[Sequence[str]],
                       specs: Mapping[int, Any]) -> None:
    """Checks that the tensors vLLM handed to ``register_kv_caches`` hold each
    Mamba layer's whole per-block state: every layer of a Mamba group (in
    ``specs``, by group) has regions, and their bytes per block cover the
    state the spec declares. A vLLM that hands connectors something else (no
    Mamba layers, a per-request state) fails here, at start. Raises
    ValueError naming the layer."""
    per_layer: dict[str, int] = {}
    for seg, label in zip(segments, region_layers):
        per_layer[label.split("[", 1)[0]] = per_layer.get(label.split("[", 1)[0], 0) + int(seg.bytes)
    for g, spec in specs.items():
        need = state_bytes(spec) or 0
        for name in group_layers[g]:
            have = per_layer.get(name)
            if have is None:
                # Layers sharing another layer's KV are registered once
                # (kvoffload.regions); a Mamba layer never shares.
                raise ValueError(
                    f"Mamba layer {name} of KV cache group {g} has no per-block state tensor among the KV caches "
                    "this vLLM handed to register_kv_caches: offloading Mamba state needs a vLLM whose model "
                    "runner registers it (vLLM main 7cfb97e or newer)")
            if have < need:
                raise ValueError(
                    f"Mamba layer {name}: its tensors hold {have} bytes per block, its state is {need} bytes "
                    f"({list(getattr(spec, 'shapes', ()))} of {[_dtype_name(d) for d in spec.dtypes]}): this vLLM "
                    "does not hand connectors the whole per-block state")
