"""What the connector reads from vLLM's configuration, without importing vLLM.

:func:`settings_from_vllm` only reads attributes, so tests pass stand-ins
with vLLM's field names. It gathers the connector's options (from
``kv_transfer_config.kv_connector_extra_config``) and the identity of the
namespace: the fields that make two engines' KV blocks interchangeable,
which vLLM's own offloading file mapper also hashes into its storage path
(model, dtype, block sizes, hash algorithm and seed, parallel sizes and
rank), plus the model revision and the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .connector import namespace_fingerprint

__all__ = ["ConnectorSettings", "settings_from_vllm", "default_socket", "hash_bytes_for"]

# kv_connector_extra_config keys this connector understands.
EXTRA_KEYS = ("socket", "timeout_s", "drain_timeout_s", "sync_stores", "hash_bytes", "request_level_failures")


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


def _full_attention(spec: Any) -> bool:
    name = type(spec).__name__
    if "Mamba" in name:
        return False
    if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
        return False
    return name in ("FullAttentionSpec", "MLAAttentionSpec", "CrossAttentionSpec") or not any(
        w in name for w in ("Sliding", "Chunked", "Local", "Mamba")
    )


@dataclass
class ConnectorSettings:
    socket: str
    hash_block_size: int
    group_block_sizes: tuple[int, ...]
    group_layers: tuple[tuple[str, ...], ...]
    hash_bytes: int
    num_blocks: int | None
    identity: dict  # fingerprint fields shared by every rank
    tp_size: int = 1
    pp_size: int = 1
    sync_stores: bool = False
    timeout_s: float = 5.0
    drain_timeout_s: float = 30.0
    request_level_failures: bool | None = None  # None: decided by the vLLM API in use
    failure_policy: str = "recompute"
    extra: dict = field(default_factory=dict)

    def fingerprint(self, tp_rank: int, pp_rank: int) -> bytes:
        return namespace_fingerprint({**self.identity, "tp_rank": tp_rank, "pp_rank": pp_rank})

    def all_fingerprints(self) -> list[bytes]:
        """Every rank's fingerprint: a block counts only when all have it."""
        return [self.fingerprint(t, p) for p in range(self.pp_size) for t in range(self.tp_size)]


def settings_from_vllm(vllm_config: Any, kv_cache_config: Any | None, env: Mapping[str, str] | None = None) -> ConnectorSettings:
    env = os.environ if env is None else env
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    par = getattr(vllm_config, "parallel_config", None)
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"kvoffload: unknown kv_connector_extra_config keys {unknown}; known: {list(EXTRA_KEYS)}")

    hash_block_size = int(getattr(cache, "block_size", 16) or 16)
    algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256") or "sha256")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if groups:
        block_sizes = tuple(int(g.kv_cache_spec.block_size) for g in groups)
        layers = tuple(tuple(g.layer_names) for g in groups)
        spec_names = [type(g.kv_cache_spec).__name__ for g in groups]
        for g, name in zip(groups, spec_names):
            if "Mamba" in name:
                raise ValueError(
                    f"kvoffload: KV cache group of {name} (layers {list(g.layer_names)[:2]}...) holds per-request state, "
                    "not per-block KV; models with state-space layers are not supported by this connector"
                )
        sync = not all(_full_attention(g.kv_cache_spec) for g in groups)
    else:
        block_sizes, layers, spec_names, sync = (hash_block_size,), ((),), ["FullAttentionSpec"], False

    cache_dtype = str(getattr(cache, "cache_dtype", "auto"))
    identity = {
        "engine": "vllm",
        "model": str(getattr(model, "model", "")),
        "revision": str(getattr(model, "revision", None)),
        "dtype": str(getattr(model, "dtype", "")),
        "kv_cache_dtype": cache_dtype,
        "hash_block_size": hash_block_size,
        "groups": [{"block_size": b, "spec": s} for b, s in zip(block_sizes, spec_names)],
        "hash_algo": algo,
        # vLLM seeds its chained hashes from PYTHONHASHSEED; unset, the seed is
        # random per engine and no other engine can hit its blocks anyway.
        "hash_seed": env.get("PYTHONHASHSEED", "<random>"),
        "tp_size": int(getattr(par, "tensor_parallel_size", 1) or 1),
        "pp_size": int(getattr(par, "pipeline_parallel_size", 1) or 1),
        "dcp_size": int(getattr(par, "decode_context_parallel_size", 1) or 1),
        "pcp_size": int(getattr(par, "prefill_context_parallel_size", 1) or 1),
    }
    hb = int(extra.get("hash_bytes", hash_bytes_for(algo)))
    rlf = extra.get("request_level_failures")
    return ConnectorSettings(
        socket=str(extra.get("socket") or env.get("KVOFFLOADD_SOCKET") or default_socket()),
        hash_block_size=hash_block_size,
        group_block_sizes=block_sizes,
        group_layers=layers,
        hash_bytes=hb,
        num_blocks=getattr(kv_cache_config, "num_blocks", None),
        identity=identity,
        tp_size=identity["tp_size"],
        pp_size=identity["pp_size"],
        sync_stores=bool(extra.get("sync_stores", sync)),
        timeout_s=float(extra.get("timeout_s", 5.0)),
        drain_timeout_s=float(extra.get("drain_timeout_s", 30.0)),
        request_level_failures=None if rlf is None else bool(rlf),
        failure_policy=str(getattr(ktc, "kv_load_failure_policy", "recompute")),
        extra=extra,
    )
