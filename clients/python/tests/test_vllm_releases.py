"""The connector against every vLLM release recorded in vllm_releases.py.

For each release: the stand-in vLLM installed with that release's modules
(what it can import), every hook vLLM calls bound with the parameters vLLM
passes, the connector's feature detection checked against what the release
has, and a workload run in that release's model-runner call order through
the real daemon (every block checked every step). A hook vLLM renames or
re-signs shows here once its release is recorded.
"""

from __future__ import annotations

import inspect
import types

import pytest
import standin_multi as sm
from standin_engine import Config, Group
from standin_run import connector_module, run
from vllm_releases import MUST_IMPLEMENT, RELEASES

ALL_HOOKS = {name for rec in RELEASES.values() for name in rec["hooks"]}


def _binds(impl, params: tuple) -> None:
    sig = inspect.signature(impl)
    args = [None for p in params if p != "**"]
    kwargs = {"vllm_extra_kwarg": 1} if "**" in params else {}
    sig.bind(*args, **kwargs)


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_every_hook_of_the_release_binds_and_detection_matches(release):
    rec = RELEASES[release]
    sw = rec["install"]
    with connector_module(**sw) as mod:
        C = mod.KVOffloadConnector
        probe = C.__new__(C)  # bound methods without running __init__
        own = {n for klass in C.__mro__ if klass.__module__ == mod.__name__ for n in vars(klass)}
        for name, params in rec["hooks"].items():
            impl = getattr(probe, name, None)
            assert impl is not None, f"vLLM {release} calls {name}: the connector has no such method"
            if name in MUST_IMPLEMENT:
                assert name in own, f"vLLM {release} calls {name}: the connector leaves it to vLLM's default"
            try:
                _binds(impl, params)
            except TypeError as e:
                raise AssertionError(f"vLLM {release} calls {name}{params}: {e}") from None
        # Every hook-like method of the connector is one some release calls.
        public = {n for klass in C.__mro__ if klass.__module__ == mod.__name__
                  for n, v in vars(klass).items() if not n.startswith("_") and callable(v)}
        extra = public - ALL_HOOKS - {"get_transfer_results"}
        assert not extra, f"connector methods no recorded vLLM release calls (a renamed hook?): {sorted(extra)}"
        # What the connector detects.
        assert (mod.KVConnectorTransferResults is not None) == sw["transfer_results"]
        assert hasattr(C, "get_transfer_results") == sw["transfer_results"]
        assert hasattr(C, "get_external_cache_hit_sources") == sw["hit_sources"]
        ns = types.SimpleNamespace
        want = "LBHNC" if sw["kv_layouts"] else "HND"
        assert C.get_required_kvcache_layout(ns(model_config=ns(use_mla=False))) == want
        assert sm.factory().get_connector_class_by_name("KVOffloadConnector") is C


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_a_workload_in_the_release_call_order_holds_exact_kv(daemon, shm, release):
    rec = RELEASES[release]
    cfg = Config(groups=[Group("full", 4, 2), Group("swa", 4, 1, window=8)], tp=2, runner=rec["runner"],
                 model=f"release-{release}", num_blocks=96, extra={"lookup_deadline_ms": 2000})
    rep = run(cfg, daemon, shm, seed=5, steps=60, switches=rec["install"])
    c = rep.counters
    assert c["finished"] > 0 and c["positions_checked"] > 0, rep.summary()
    if rec["install"]["transfer_results"]:
        # A hybrid model gets hits only where failures are per request.
        assert c["hit_tokens"] > 0, rep.summary()
    else:
        assert c["hit_tokens"] == 0, rep.summary()
