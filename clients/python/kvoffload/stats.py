"""What the connector counts between two of vLLM's stats collections.

Both halves record into a :class:`StatsRecorder`; vLLM takes an interval's
data with ``get_kv_connector_stats`` (a plain dict, so it crosses processes),
sums the workers' with :func:`aggregate`, logs :func:`reduce` and feeds the
same dict to the Prometheus metrics of :mod:`kvoffload.vllm`.

The dict holds counters (``*_total`` ints, ``hit_tokens`` and
``failed_blocks`` by tier and status) and latency samples in seconds
(``lookup_seconds``, ``load_seconds``, ``store_seconds``), at most
``MAX_SAMPLES`` of each per interval.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

__all__ = ["StatsRecorder", "aggregate", "reduce", "MAX_SAMPLES", "SAMPLE_KEYS", "COUNTER_KEYS"]

MAX_SAMPLES = 2048
SAMPLE_KEYS = ("lookup_seconds", "load_seconds", "store_seconds")
COUNTER_KEYS = (
    "lookups_total", "lookup_timeouts_total", "load_jobs_total", "store_jobs_total", "blocks_loaded_total",
    "blocks_stored_total", "bytes_loaded_total", "bytes_stored_total", "stores_skipped_total",
    "lookup_keys_total", "hit_lookup_keys_total", "hit_keys_outside_window_total",
)


class StatsRecorder:
    """Thread-safe: the workers' transfer threads record into it too."""

    def __init__(self):
        self._lock = threading.Lock()
        self._data = self._empty()

    @staticmethod
    def _empty() -> dict[str, Any]:
        d: dict[str, Any] = {k: 0 for k in COUNTER_KEYS}
        d.update({k: [] for k in SAMPLE_KEYS})
        d["hit_tokens"] = {}
        d["failed_blocks"] = {}
        return d

    def _sample(self, key: str, v: float) -> None:
        s = self._data[key]
        if len(s) < MAX_SAMPLES:
            s.append(float(v))

    def lookup(self, seconds: float, hit_tokens: int, by_tier: Mapping[str, int], keys: int | None = None,
               outside_window: int = 0) -> None:
        """One lookup answered; with ``keys``, also :meth:`lookup_keys` (a
        hit when ``hit_tokens`` > 0), under the same lock."""
        with self._lock:
            d = self._data
            d["lookups_total"] += 1
            s = d["lookup_seconds"]
            if len(s) < MAX_SAMPLES:
                s.append(float(seconds))
            if by_tier:
                h = d["hit_tokens"]
                for tier, n in by_tier.items():
                    h[tier] = h.get(tier, 0) + int(n)
            if keys is not None:
                d["lookup_keys_total"] += int(keys)
                if hit_tokens > 0:
                    d["hit_lookup_keys_total"] += int(keys)
                    d["hit_keys_outside_window_total"] += int(outside_window)

    def lookup_keys(self, keys: int, outside_window: int, hit: bool) -> None:
        """Keys one request's lookup asked for (the local prefix's peek not
        counted); for a hit, also under ``hit_lookup_keys_total``, and how
        many of a windowed group's keys lay outside the hit's windows."""
        with self._lock:
            self._data["lookup_keys_total"] += int(keys)
            if hit:
                self._data["hit_lookup_keys_total"] += int(keys)
                self._data["hit_keys_outside_window_total"] += int(outside_window)

    def lookup_timeout(self) -> None:
        with self._lock:
            self._data["lookup_timeouts_total"] += 1

    def transfer(self, load: bool, seconds: float, blocks_ok: int, nbytes: int, failures: Mapping[str, int]) -> None:
        with self._lock:
            d = self._data
            if load:
                d["load_jobs_total"] += 1
                d["blocks_loaded_total"] += blocks_ok
                d["bytes_loaded_total"] += nbytes
                self._sample("load_seconds", seconds)
            else:
                d["store_jobs_total"] += 1
                d["blocks_stored_total"] += blocks_ok
                d["bytes_stored_total"] += nbytes
                self._sample("store_seconds", seconds)
            for status, n in failures.items():
                key = f"{'load' if load else 'store'}:{status}"
                d["failed_blocks"][key] = d["failed_blocks"].get(key, 0) + int(n)

    def stores_skipped(self, n: int) -> None:
        with self._lock:
            self._data["stores_skipped_total"] += n

    def take(self) -> dict[str, Any] | None:
        """The interval's data, or None when nothing happened; starts a new interval."""
        with self._lock:
            d, self._data = self._data, self._empty()
        return None if is_empty(d) else d


def is_empty(d: Mapping[str, Any] | None) -> bool:
    if not d:
        return True
    return not (any(d.get(k) for k in COUNTER_KEYS) or any(d.get(k) for k in SAMPLE_KEYS)
                or d.get("hit_tokens") or d.get("failed_blocks"))


def aggregate(a: dict[str, Any] | None, b: Mapping[str, Any] | None) -> dict[str, Any]:
    """``a`` plus ``b`` (``a`` is updated and returned)."""
    out = a if a is not None else StatsRecorder._empty()
    if not b:
        return out
    for k in COUNTER_KEYS:
        out[k] = out.get(k, 0) + int(b.get(k, 0))
    for k in SAMPLE_KEYS:
        room = MAX_SAMPLES - len(out.setdefault(k, []))
        out[k].extend(list(b.get(k, ()))[: max(0, room)])
    for k in ("hit_tokens", "failed_blocks"):
        tgt = out.setdefault(k, {})
        for name, n in (b.get(k) or {}).items():
            tgt[name] = tgt.get(name, 0) + int(n)
    return out


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def reduce(d: Mapping[str, Any]) -> dict[str, int | float]:
    """One line's worth: the counters and the p50/p99 of each latency, in ms."""
    out: dict[str, int | float] = {k: int(d.get(k, 0)) for k in COUNTER_KEYS if d.get(k)}
    for tier, n in sorted((d.get("hit_tokens") or {}).items()):
        out[f"hit_tokens_{tier}"] = n
    for name, n in sorted((d.get("failed_blocks") or {}).items()):
        out[f"failed_blocks_{name.replace(':', '_')}"] = n
    for k in SAMPLE_KEYS:
        xs = list(d.get(k) or ())
        if xs:
            base = k.removesuffix("_seconds")
            out[f"{base}_p50_ms"] = round(_quantile(xs, 0.5) * 1000, 3)
            out[f"{base}_p99_ms"] = round(_quantile(xs, 0.99) * 1000, 3)
    return out
