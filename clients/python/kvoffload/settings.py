"""What the connector reads from vLLM's configuration, without importing vLLM.

:func:`settings_from_vllm` only reads attributes, so tests pass stand-ins
with vLLM's field names. It gathers the connector's options (from
``kv_transfer_config.kv_connector_extra_config``), vLLM's block sizes (by
vLLM's own rule, :mod:`kvoffload.keys`), and the identity of a namespace:
everything that changes the bytes of a block for the same tokens. A worker
adds its rank and the byte order its KV tensors actually have
(:meth:`ConnectorSettings.fingerprint`); docs/vllm.md lists every field.

A configuration the connector cannot serve safely is not raised: it sets
``unsupported`` to one sentence, and the connector runs with offloading off
and says so in one error line at start.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import mamba as _mamba
from .keys import BlockSizes, GroupShape, resolve_block_sizes

__all__ = [
    "ConnectorSettings",
    "settings_from_vllm",
    "default_socket",
    "hash_bytes_for",
    "namespace_fingerprint",
    "derive_fingerprint",
    "engine_of",
    "registration_key",
    "FINGERPRINT_PREFIX",
    "CONNECTOR_LAYOUT_VERSION",
    "group_window",
]

# kv_connector_extra_config keys this connector understands.
EXTRA_KEYS = ("socket", "timeout_s", "lookup_wait_ms", "lookup_deadline_ms", "lease_ms", "sync_stores",
              "hash_bytes", "request_level_failures", "drain_timeout_s", "kv_events", "kv_events_max_blocks",
              "weights_version", "lookup_mirror", "lookup_mirror_max_blocks")

# Version of how this connector lays keys and blocks out. Part of every
# fingerprint: a change here must not hit blocks stored by the old code.
# 2: fingerprints cover the tensors' byte order, the attention backend,
#    quantization, overrides and the resolved hash block size.
CONNECTOR_LAYOUT_VERSION = 2
FINGERPRINT_PREFIX = b"kvoffload.vllm/2:"


def namespace_fingerprint(fields: Mapping[str, Any]) -> bytes:
    """A fixed prefix and the SHA-256 of the canonical JSON of ``fields``.
    The daemon never interprets it; equal fingerprints share blocks."""
    canon = json.dumps(
        {"connector_layout": CONNECTOR_LAYOUT_VERSION, **fields}, sort_keys=True, separators=(",", ":"), default=str
    )
    return FINGERPRINT_PREFIX + hashlib.sha256(canon.encode()).digest()


REGISTRATION_KEY_PREFIX = b"kvoffload.vllm/engine:"


def engine_of(vllm_config: Any) -> dict | None:
    """What names one engine (its scheduler and its workers) and no other:
    ``kv_transfer_config.engine_id`` (a fresh UUID unless set; vLLM appends
    ``_dp<rank>`` per data parallel engine, and MultiConnector hands its
    children the parent's) and ``vllm_config.instance_id`` (random per
    ``VllmConfig``, which the workers receive pickled). None when neither is
    readable."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    out = {"engine_id": str(getattr(ktc, "engine_id", None) or ""),
           "instance_id": str(getattr(vllm_config, "instance_id", None) or "")}
    return out if any(out.values()) else None


def registration_key(engine: Mapping[str, str], rank: Mapping[str, int]) -> bytes:
    """The key one worker's registration is found by in the daemon: its
    engine and its place in it (pipeline, prefill context and tensor rank;
    decode context parallel ranks are tensor ranks)."""
    fields = {"engine": dict(engine), "rank": {k: int(rank.get(k, 0)) for k in ("pp", "pcp", "tp")}}
    canon = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return REGISTRATION_KEY_PREFIX + hashlib.sha256(canon.encode()).digest()


def derive_fingerprint(base: bytes, token: bytes) -> bytes:
    """The fingerprint of ``base`` under the identity a cache reset made
    (``token``, fresh per reset); ``base`` itself for no token."""
    if not token:
        return bytes(base)
    return FINGERPRINT_PREFIX + hashlib.sha256(b"reset:" + bytes(base) + b":" + bytes(token)).digest()


def default_socket() -> str:
    """The daemon's default socket (see ``kvoffloadd --help``)."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        return os.path.join(run, "kvoffloadd", "kvoffloadd.sock")
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"kvoffloadd-{os.getuid()}", "kvoffloadd.sock")


def hash_bytes_for(algo: str) -> int:
    """Length of vLLM's block hashes for a prefix-caching hash algorithm:
    sha256 variants give 32 bytes, xxhash (xxh3-128) variants 16."""
    return 16 if str(algo).lower().startswith("xxhash") else 32


def _spec_kind(spec: Any) -> str:
    return type(spec).__name__


# Kinds of vLLM's get_kv_cache_spec_kind (vllm/v1/kv_cache_interface.py).
_ATTENTION_KINDS = {"FULL_ATTENTION", "MLA_ATTENTION", "SINK_FULL_ATTENTION", "SLIDING_WINDOW", "SLIDING_WINDOW_MLA",
                    "CHUNKED_LOCAL_ATTENTION"}
_FULL_KINDS = {"FULL_ATTENTION", "MLA_ATTENTION", "SINK_FULL_ATTENTION"}
# Attributes of specs whose groups vLLM frees blocks of while the request
# runs (sliding windows, chunked local attention, R-SWA's decode gap).
_WINDOW_FIELDS = ("sliding_window", "attention_chunk_size", "rswa_window")


def _kind_of(spec: Any, spec_kind: Callable[[Any], Any] | None) -> str | None:
    """vLLM's kind of a spec (``get_kv_cache_spec_kind``) where that vLLM has
    it, else None (then class names decide)."""
    if spec_kind is None:
        return None
    try:
        k = spec_kind(spec)
    except Exception:
        return None
    name = getattr(k, "name", None) or str(k)
    return None if name == "UNKNOWN" else name


def _is_mamba(spec: Any, kind: str | None) -> bool:
    return _mamba.is_mamba(spec, kind)


def _is_attention(spec: Any, kind: str | None = None) -> bool:
    if kind is not None:
        return kind in _ATTENTION_KINDS
    names = [c.__name__ for c in type(spec).__mro__]
    return any("Attention" in n or "SlidingWindow" in n for n in names) and not any("Mamba" in n for n in names)


def _full_attention(spec: Any, kind: str | None = None) -> bool:
    """Whether vLLM keeps every block of the group while the request runs.
    A FullAttentionSpec subclass with a window (RSWASpec) does not."""
    if any(getattr(spec, f, None) for f in _WINDOW_FIELDS):
        return False
    if kind is not None:
        return kind in _FULL_KINDS
    name = _spec_kind(spec)
    if "Mamba" in name:
        return False
    return not any(w in name for w in ("Sliding", "Chunked", "Local", "RSWA"))


def group_window(spec: Any, kind: str | None, block_size: int, eagle: bool = False) -> int | None:
    """A KV cache group's window in its blocks (``block_size`` tokens each,
    the scheduler's), or None for full attention: how many of its blocks
    before a hit's end that hit needs (docs/vllm.md, hybrid models). The one
    place a group's spec becomes its window; ``kind`` is vLLM's
    ``get_kv_cache_spec_kind`` name (None: class names decide).

    - a sliding window of S tokens: ceil((S - 1 + extra) / block_size), the
      blocks vLLM's SlidingWindowManager keeps for a hit
      (``get_num_skipped_tokens``; ``extra_retained_tokens`` for multi-module
      MTP);
    - chunked local attention of C tokens: ceil(C / block_size), the blocks
      of the current chunk at most;
    - EAGLE/MTP draft groups one block more, as vLLM's offloading connector
      (``is_store_reachable_swa_chunk``);
    - Mamba / linear-attention state in ``mamba_cache_mode`` "align": 1, the
      state block at the hit's end (None in any other mode: such a group is
      refused);
    - everything else, R-SWA (a FULL_ATTENTION kind whose decode gap vLLM
      frees, its prompt kept whole) included: full attention.
    """
    bs = int(block_size)
    if kind is None:
        names = [c.__name__ for c in type(spec).__mro__]
        if any("Mamba" in n for n in names):
            kind = "MAMBA"
        elif any("FullAttention" in n for n in names):
            kind = "FULL_ATTENTION"
        elif any("ChunkedLocal" in n for n in names):
            kind = "CHUNKED_LOCAL_ATTENTION"
        elif any("SlidingWindow" in n for n in names):
            kind = "SLIDING_WINDOW"
    if kind == "MAMBA":
        return 1 if getattr(spec, "mamba_cache_mode", "align") == "align" else None
    if kind in ("SLIDING_WINDOW", "SLIDING_WINDOW_MLA"):
        window = _spec_field(spec, "sliding_window")
        if window is None:
            return None  # unreadable: every block from 0, as full attention (safe, more keys)
        tokens = window - 1 + (_spec_field(spec, "extra_retained_tokens") or 0)
    elif kind == "CHUNKED_LOCAL_ATTENTION":
        tokens = _spec_field(spec, "attention_chunk_size")
        if tokens is None:
            return None
    else:
        return None
    return max(1, -(-tokens // bs)) + (1 if eagle else 0)


def _spec_field(spec: Any, name: str) -> int | None:
    """An int field of a spec, or the largest of its members' where vLLM
    merged several layers' specs into one (UniformTypeKVCacheSpecs)."""
    v = getattr(spec, name, None)
    if v is None:
        inner = getattr(spec, "kv_cache_specs", None)
        vals = [getattr(x, name, None) for x in (inner.values() if isinstance(inner, Mapping) else ())]
        vals = [int(x) for x in vals if x is not None]
        return max(vals) if vals else None
    return int(v)


def _spec_identity(spec: Any, kind: str | None = None) -> dict:
    """The fields of a KV cache spec that shape a block's bytes."""
    out = {"kind": _spec_kind(spec)}
    if kind is not None:
        out["spec_kind"] = kind
    for k in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window",
              "attention_chunk_size", "rswa_window", "use_mla", "cache_dtype_str", "page_size_padded", "storage_block_size"):
        v = getattr(spec, k, None)
        if v is not None:
            out[k] = str(v)
    for k in ("sliding_window", "attention_chunk_size"):
        # A group vLLM merged (UniformTypeKVCacheSpecs) has its window on its members.
        if k not in out and _spec_field(spec, k) is not None:
            out[k] = str(_spec_field(spec, k))
    if _is_mamba(spec, kind):
        out.update(_mamba.state_identity(spec))
    return out


def _attention_backend(vllm_config: Any, env: Mapping[str, str]) -> str:
    ac = getattr(vllm_config, "attention_config", None)
    b = getattr(ac, "backend", None) if ac is not None else None
    if b is None:
        b = getattr(getattr(vllm_config, "model_config", None), "attention_backend", None)
    return str(b if b is not None else env.get("VLLM_ATTENTION_BACKEND", "auto"))


@dataclass
class ConnectorSettings:
    socket: str
    block_sizes: BlockSizes
    rank_block_sizes: tuple[int, ...]  # tokens per block of each group on one rank
    group_layers: tuple[tuple[str, ...], ...]
    full_attention: bool
    hash_bytes: int
    num_blocks: int | None
    identity: dict  # fingerprint fields shared by every rank
    engine: dict | None = None  # engine_of(vllm_config): what registration keys are made of
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    sync_stores: bool = False
    timeout_s: float = 1.0
    lookup_wait_s: float = 0.001
    lookup_deadline_s: float = 0.2
    lease_ms: int = 0
    lookup_mirror: bool = True  # answer lookups from the daemon's events, in-process (kvoffload.mirror)
    lookup_mirror_max_blocks: int = 2_000_000
    # Report what the daemon holds as vLLM KV cache events (default: whether
    # vLLM's own KV events are enabled, --kv-events-config).
    kv_events: bool = False
    kv_events_max_blocks: int = 65536
    request_level_failures: bool | None = None  # None: decided by the vLLM API in use
    failure_policy: str = "fail"
    kv_layout: str | None = None
    unsupported: str | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    eagle_groups: tuple[bool, ...] = ()  # groups of EAGLE/MTP draft layers (KVCacheGroupSpec.is_eagle_group)
    mamba_specs: dict = field(default_factory=dict)  # group -> MambaSpec, of the Mamba groups (kvoffload.mamba)
    # Each group's window in its blocks, None for full attention (group_window).
    group_windows: tuple[int | None, ...] = ()
    # Groups vLLM never prefix-caches (per-request scratch): never stored,
    # looked up or loaded (KeyMapper). Empty where every group is cacheable.
    scratch_groups: tuple[bool, ...] = ()

    @property
    def cacheable_group_ids(self) -> tuple[int, ...]:
        return tuple(g for g in range(len(self.group_block_sizes))
                     if not (self.scratch_groups and self.scratch_groups[g]))

    @property
    def hash_block_size(self) -> int:
        return self.block_sizes.hash

    @property
    def group_block_sizes(self) -> tuple[int, ...]:
        return self.block_sizes.groups

    @property
    def num_ranks(self) -> int:
        """Workers of one engine: every pipeline stage, prefill context and
        tensor rank (decode context parallel splits the tensor ranks)."""
        return self.tp_size * self.pp_size * self.pcp_size

    def registration_key(self, rank: Mapping[str, int]) -> bytes | None:
        """One rank's registration key (:func:`registration_key`), None when
        this vLLM names no engine."""
        return None if self.engine is None else registration_key(self.engine, rank)

    def ranks(self) -> list[dict]:
        """Every worker's rank: pipeline, prefill context and tensor."""
        return [{"pp": pp, "pcp": pcp, "tp": tp}
                for pp in range(self.pp_size) for pcp in range(self.pcp_size) for tp in range(self.tp_size)]

    def fingerprint(self, rank: Mapping[str, int], geometry: Any = ()) -> bytes:
        """One rank's namespace fingerprint: the shared identity, the rank, and
        the byte order of its KV tensors (``KVRegistration.geometry``)."""
        return namespace_fingerprint({**self.identity, "rank": dict(rank), "geometry": geometry})


def settings_from_vllm(
    vllm_config: Any,
    kv_cache_config: Any | None,
    env: Mapping[str, str] | None = None,
    *,
    vllm_block_sizes: Callable[[], tuple[int, int]] | None = None,
    kv_layout: str | None = None,
    spec_kind: Callable[[Any], Any] | None = None,
) -> ConnectorSettings:
    """Reads everything the connector needs. ``vllm_block_sizes`` is vLLM's
    own ``resolve_kv_cache_block_sizes`` bound to the configs, where the
    installed vLLM has it; it wins over this module's copy of the rule.
    ``spec_kind`` is vLLM's ``get_kv_cache_spec_kind`` where it has it: it
    names each group's kind (else class names do).
    Raises ValueError only for a malformed ``kv_connector_extra_config``."""
    env = os.environ if env is None else env
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    par = getattr(vllm_config, "parallel_config", None)
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"kvoffload: unknown kv_connector_extra_config keys {unknown}; known: {list(EXTRA_KEYS)}")
    notes: list[str] = []
    if "drain_timeout_s" in extra:
        notes.append("kv_connector_extra_config.drain_timeout_s is ignored: stores are never given up on")
    unsupported: str | None = None

    tp = int(getattr(par, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
    pcp = int(getattr(par, "prefill_context_parallel_size", 1) or 1)
    dcp = int(getattr(par, "decode_context_parallel_size", 1) or 1)
    cache_bs = int(getattr(cache, "block_size", 16) or 16)
    algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256") or "sha256")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    specs = [g.kv_cache_spec for g in groups]
    kinds = [_kind_of(s, spec_kind) for s in specs]
    layers = tuple(tuple(g.layer_names) for g in groups) or ((),)
    eagle = tuple(bool(getattr(g, "is_eagle_group", False)) for g in groups)
    for g, spec, kind in zip(groups, specs, kinds):
        if _is_mamba(spec, kind):
            unsupported = unsupported or _mamba.refusal(
                spec, g.layer_names, prefix_caching=bool(getattr(cache, "enable_prefix_caching", True)),
                dcp=int(getattr(par, "decode_context_parallel_size", 1) or 1),
                pcp=int(getattr(par, "prefill_context_parallel_size", 1) or 1),
                speculative=getattr(vllm_config, "speculative_config", None) is not None)
    shapes = [GroupShape(int(s.block_size), attention=_is_attention(s, k),
                         mamba_align=getattr(s, "mamba_cache_mode", "align") == "align",
                         prefix_cacheable=bool(getattr(s, "prefix_cacheable", True))) for s, k in zip(specs, kinds)]
    rank_sizes = tuple(int(s.block_size) for s in specs) or (cache_bs,)
    hashing = bool(getattr(cache, "enable_prefix_caching", True)) or ktc is not None
    try:
        sizes = resolve_block_sizes(shapes, cache_bs, dcp, getattr(cache, "prefix_match_unit", None), hashing)
    except ValueError as e:
        unsupported = unsupported or f"vLLM's block sizes: {e}"
        sizes = BlockSizes(cache_bs * dcp, cache_bs * dcp, tuple(s * dcp for s in rank_sizes))
    if vllm_block_sizes is not None:
        try:
            sched, hbs = (int(x) for x in vllm_block_sizes())
        except Exception as e:  # vLLM's own function refused the config
            unsupported = unsupported or f"vLLM's resolve_kv_cache_block_sizes failed: {e}"
        else:
            if (sched, hbs) != (sizes.scheduler, sizes.hash):
                notes.append(f"vLLM resolves block sizes to scheduler={sched} hash={hbs}; this connector's copy of "
                             f"the rule gave {sizes.scheduler}/{sizes.hash}: using vLLM's")
                sizes = BlockSizes(sched, hbs, sizes.groups)
    if unsupported is None:
        bad = [s for s in sizes.groups if s % sizes.hash]
        if bad or math.lcm(*sizes.groups) != sizes.scheduler:
            unsupported = (f"group block sizes {list(sizes.groups)} do not tile vLLM's hash size {sizes.hash} and "
                           f"scheduler block size {sizes.scheduler}")
    # Groups vLLM never prefix-caches: kv_cache_config.prefix_cacheable_group_ids
    # where vLLM has it, else each spec's prefix_cacheable.
    cacheable_ids = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    if cacheable_ids is not None:
        scratch = tuple(g not in set(int(i) for i in cacheable_ids) for g in range(len(groups)))
    else:
        scratch = tuple(not bool(getattr(sp, "prefix_cacheable", True)) for sp in specs)
    if scratch and all(scratch):
        unsupported = unsupported or "no KV cache group of this model is prefix-cacheable: nothing to offload"
    if not any(scratch):
        scratch = ()
    if bool(getattr(model, "enable_sleep_mode", False)):
        # vLLM tells a connector's workers nothing when it discards the KV
        # cache memory (sleep level >= 1, POST /release_kv_cache_memory, both
        # sleep mode only) and maps new memory at the same addresses on
        # wake_up: the daemon's mapping of it would outlive the memory.
        unsupported = unsupported or (
            "vLLM's sleep mode (enable_sleep_mode) can free and re-map the KV cache memory registered with the "
            "daemon while the engine runs (sleep, wake_up, POST /release_kv_cache_memory) without telling a "
            "connector's workers, so a copy could read or write freed memory; start vLLM without "
            "--enable-sleep-mode to offload")
    if pcp > 1 and len(groups) > 1:
        unsupported = unsupported or "prefill context parallel with several KV cache groups (vLLM does not build it)"
    if (tp * pp * pcp) > 1 and not hasattr(par, "tensor_parallel_size"):
        unsupported = unsupported or "parallel sizes unreadable"

    # The weights: the checkpoint (model and revision say which), or what
    # the user declares. Dummy weights (load_format "dummy", as RL trainers
    # start engines before sending them weights) are random per engine.
    weights_version = extra.get("weights_version")
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto"))
    if weights_version is not None:
        weights = f"declared:{weights_version}"
    elif load_format == "dummy":
        weights = f"dummy:{secrets.token_hex(8)}"
    else:
        weights = "checkpoint"
    cache_dtype = str(getattr(cache, "cache_dtype", "auto"))
    dynamic_scales = bool(getattr(cache, "calculate_kv_scales", False))
    identity = {
        "engine": "vllm",
        "model": str(getattr(model, "model", "")),
        "revision": str(getattr(model, "revision", None)),
        "weights": weights,
        "dtype": str(getattr(model, "dtype", "")),
        "quantization": str(getattr(model, "quantization", None)),
        "hf_overrides": str(getattr(model, "hf_overrides", None)),
        "rope": [str(getattr(model, k, None)) for k in ("rope_scaling", "rope_theta")],
        "attention_backend": _attention_backend(vllm_config, env),
        "kv_layout": str({"LBHNC": "HND"}.get(str(kv_layout), kv_layout)),  # one layout, two spellings (#51718)
        "kv_cache_dtype": cache_dtype,
        # Scales computed from the first batch differ per engine start: such
        # an engine shares nothing with another (nor with its next start).
        "kv_scales": f"dynamic:{secrets.token_hex(8)}" if dynamic_scales else "checkpoint",
        "hash_block_size": sizes.hash,
        "scheduler_block_size": sizes.scheduler,
        "groups": [_spec_identity(s, k) for s, k in zip(specs, kinds)],
        "hash_algo": algo,
        # vLLM seeds its chained hashes from PYTHONHASHSEED; unset, the seed is
        # random per engine and no other engine can hit its blocks anyway.
        "hash_seed": env.get("PYTHONHASHSEED", "<random>"),
        "parallel": {"tp": tp, "pp": pp, "pcp": pcp, "dcp": dcp},
    }
    hb = int(extra.get("hash_bytes", hash_bytes_for(algo)))
    rlf = extra.get("request_level_failures")
    full = all(_full_attention(s, k) for s, k in zip(specs, kinds))
    windows = tuple(group_window(s, k, bs, e) for s, k, bs, e in zip(specs, kinds, sizes.groups, eagle))
    return ConnectorSettings(
        socket=str(extra.get("socket") or env.get("KVOFFLOADD_SOCKET") or default_socket()),
        block_sizes=sizes,
        rank_block_sizes=rank_sizes,
        group_layers=layers,
        full_attention=full,
        hash_bytes=hb,
        num_blocks=getattr(kv_cache_config, "num_blocks", None),
        identity=identity,
        engine=engine_of(vllm_config),
        tp_size=tp,
        pp_size=pp,
        pcp_size=pcp,
        dcp_size=dcp,
        sync_stores=bool(extra.get("sync_stores", False)),
        timeout_s=float(extra.get("timeout_s", 1.0)),
        lookup_wait_s=float(extra.get("lookup_wait_ms", 1)) / 1000.0,
        lookup_deadline_s=float(extra.get("lookup_deadline_ms", 200)) / 1000.0,
        lease_ms=int(extra.get("lease_ms", 0)),
        lookup_mirror=extra.get("lookup_mirror", True) is not False,
        lookup_mirror_max_blocks=int(extra.get("lookup_mirror_max_blocks", 2_000_000)),
        kv_events=bool(extra.get("kv_events", getattr(getattr(vllm_config, "kv_events_config", None),
                                                      "enable_kv_cache_events", False))),
        kv_events_max_blocks=int(extra.get("kv_events_max_blocks", 65536)),
        request_level_failures=None if rlf is None else bool(rlf),
        failure_policy=str(getattr(ktc, "kv_load_failure_policy", "fail")),
        kv_layout=kv_layout,
        unsupported=unsupported,
        notes=notes,
        extra=extra,
        eagle_groups=eagle,
        mamba_specs={g: s for g, (s, k) in enumerate(zip(specs, kinds)) if _is_mamba(s, k)},
        group_windows=windows,
        scratch_groups=() if scratch and all(scratch) else scratch,
    )
