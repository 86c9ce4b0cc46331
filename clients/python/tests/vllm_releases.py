"""What each vLLM release shows a KV connector, recorded from vLLM's files.

Data, not code of vLLM's: for each release, the names the connector imports
that exist there, the base-class hooks vLLM calls with the parameters it
passes, and the model runner's call order. Read through the source index:
``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` whole at 7cfb97e
(main of 2026-08-20, the nearest whole tree to 0.28) and at e0f559e
(September, with request-level failures: the hooks of 0.30 and 0.31);
``vllm/v1/worker/gpu/kv_connector.py`` at 00f4240 (the V2 runner's order);
release facts in /work/shared/VLLM.md ("Read in December 2026"). Where a
release's own tree was not readable the record says which commit stands in.

When a new release is read, add its record: test_vllm_releases.py then runs
the connector's feature detection and every recorded hook against it, so a
renamed or re-signed hook fails a test rather than a user.
"""

from __future__ import annotations

# Hooks vLLM calls on a connector (scheduler and worker), with the
# parameters it passes (positional names after self/cls; "**" for kwargs).
HOOKS_7CFB97E = {
    "register_kv_caches": ("kv_caches",),
    "handle_preemptions": ("kv_connector_metadata",),
    "bind_connector_metadata": ("connector_metadata",),
    "start_load_kv": ("forward_context", "**"),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata", "**"),
    "wait_for_save": (),
    "get_finished": ("finished_req_ids",),
    "get_block_ids_with_load_errors": (),
    "build_connector_worker_meta": (),
    "get_kv_connector_stats": (),
    "get_handshake_metadata": (),
    "shutdown": (),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "update_connector_output": ("connector_output",),
    "request_finished": ("request", "block_ids"),
    "request_finished_all_groups": ("request", "block_ids"),
    "take_events": (),
    "reset_cache": (),
    "set_xfer_handshake_metadata": ("metadata",),
    "set_xfer_handshake_metadata_pp_aware": ("metadata",),
    "get_required_kvcache_layout": ("vllm_config",),  # classmethod
    "build_kv_connector_stats": ("data",),  # classmethod
    "build_prom_metrics": ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"),  # classmethod
}

HOOKS_E0F559E = {
    **HOOKS_7CFB97E,
    "get_transfer_results": ("finished_req_ids",),
    "finish_forward": (),
    "bind_kv_cache_manager": ("kv_cache_manager",),
    "get_loaded_kv_cache_group_ids": ("request",),
    "register_finished_partial_tail": ("request", "block_ids", "partial_tail_offloads"),
    "has_pending_block_frees": (),
    "get_external_cache_hit_sources": ("request", "num_external_tokens"),
}

# The hooks this connector must implement itself wherever vLLM calls them
# (the rest it may leave to vLLM's defaults).
MUST_IMPLEMENT = (
    "register_kv_caches", "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
    "wait_for_save", "get_finished", "get_block_ids_with_load_errors", "get_num_new_matched_tokens",
    "update_state_after_alloc", "build_connector_meta", "update_connector_output", "request_finished",
    "request_finished_all_groups", "reset_cache", "get_required_kvcache_layout", "shutdown",
    "get_transfer_results", "get_loaded_kv_cache_group_ids", "get_external_cache_hit_sources",
    "build_kv_connector_stats", "get_kv_connector_stats", "build_connector_worker_meta",
)

RELEASES = {
    "0.28": dict(
        read="base.py at 7cfb97e (2026-08-20)",
        hooks=HOOKS_7CFB97E,
        # standin_vllm.install switches: what this release's modules hold
        install=dict(transfer_results=False, worker_meta=True, metrics=True, resolver=True, kv_events="main",
                     spec_kinds=True, hit_sources=False, factory=True, kv_layouts=False, base_at="7cfb97e"),
        runner="v1",
    ),
    "0.29": dict(
        read="7cfb97e's hooks; #53333 (deferred start_load_kv) and #51718 (layout names) merged before 2026-09-09",
        hooks=HOOKS_7CFB97E,
        install=dict(transfer_results=False, worker_meta=True, metrics=True, resolver=True, kv_events="main",
                     spec_kinds=True, hit_sources=False, factory=True, kv_layouts=True, base_at="7cfb97e"),
        runner="deferred",
    ),
    "0.30": dict(
        read="base.py at e0f559e; ced6857 = v0.30.0 (request-level failures native, #53781)",
        hooks=HOOKS_E0F559E,
        install=dict(transfer_results=True, worker_meta=True, metrics=True, resolver=True, kv_events="main",
                     spec_kinds=True, hit_sources=True, factory=True, kv_layouts=True, base_at="e0f559e"),
        runner="mrv2",
    ),
    "0.31": dict(
        read="base.py at e0f559e; gpu/kv_connector.py at 00f4240; block-hash inputs #51899, #59335",
        hooks=HOOKS_E0F559E,
        install=dict(transfer_results=True, worker_meta=True, metrics=True, resolver=True, kv_events="main",
                     spec_kinds=True, hit_sources=True, factory=True, kv_layouts=True, base_at="e0f559e"),
        runner="mrv2",
    ),
}
