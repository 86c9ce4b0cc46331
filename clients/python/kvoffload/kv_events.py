"""What the daemon's tiers hold, as vLLM's KV cache events (docs/events.md).

The scheduler half of the connector follows the daemon's ``WatchEvents``
stream on a thread of its own (:class:`EventFeed`) and, each time vLLM's
scheduler calls ``take_events``, turns what arrived into vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, which vLLM's own
publisher then sends with the GPU prefix cache's events. Written against
vLLM main's ``vllm/distributed/kv_events.py`` at commit 7cfb97e33791
(2026-08-20: the classes, their field order, the media ``GPU``/``CPU``/
``STORAGE`` and ``locality``) and ``KVConnectorBase_V1.take_events`` at
003df2961dd8830c317a61f9745ccd557da9fa06; vLLM's offloading connector
(``offloading/events.py`` at 7cfb97e33791) describes an offloaded block the
same way: its hashes at the group's block size, the parent hash, the block's
token ids, ``medium`` and ``locality`` the tier, the group's cache-spec kind
and sliding window.

- ``medium``/``locality`` is the tier: the CPU tier ``"CPU"``/``"LOCAL"``,
  the disk tier ``"STORAGE"``/``"LOCAL"``, the shared remote tier
  ``"STORAGE"``/``"REMOTE"`` (:data:`MEDIUM`);
- ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` are the
  group's (:func:`event_group_specs`, vLLM's ``get_kv_cache_spec_kind``);
- ``extra_keys``: per block, what vLLM's block hash took beyond the tokens
  (the LoRA name, multimodal hashes, ``cache_salt`` on the first block), from
  vLLM's ``generate_block_hash_extra_keys`` when the scheduler planned the
  block (:func:`remember`);
- ``block_hashes`` are vLLM's block hashes as vLLM publishes them: the key
  the connector stored (the hash that ends the block, vLLM's
  ``resolve_block_hashes`` view) through vLLM's ``maybe_convert_block_hash``;
- ``token_ids``, ``parent_block_hash``, ``lora_id`` / ``lora_name`` come from
  :class:`BlockInfo`, kept when the scheduler planned the block's store or
  load (a bounded map, oldest forgotten first). A block the map does not know
  (stored by another engine sharing the namespace, forgotten, or recovered
  from disk after this engine restarted) is reported with no token ids and no
  parent, as vLLM's offloading connector reports a block it has no payload for;
- the stream's reset (at its start, after a daemon restart, after the daemon
  dropped events for this subscriber, or after this connector's own queue
  overflowed) is ``AllBlocksCleared``, then a snapshot as ``BlockStored``.

The classes and the hash conversion are passed in (:class:`VLLMEventTypes`),
and only the fields a class declares are given to it, so a vLLM whose classes
lack ``group_idx``, ``lora_name`` or ``locality`` still works; vLLM's
``get_kv_cache_spec_kind`` and ``generate_block_hash_extra_keys`` are imported
when there (with stand-ins of their logic otherwise).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from .errors import KVOffloadError
from .types import EventKind, KVEvent, Tier

__all__ = ["BlockInfo", "BlockInfoMap", "EventFeed", "VLLMEventTypes", "translate", "MEDIUM", "default_convert",
           "event_group_specs", "remember"]

log = logging.getLogger("kvoffload.kv_events")

# A tier as vLLM's (medium, locality): vllm/distributed/kv_events.py's
# MEDIUM_CPU / MEDIUM_STORAGE, vllm/v1/kv_offload/base.py's Locality.
MEDIUM = {Tier.CPU: ("CPU", "LOCAL"), Tier.DISK: ("STORAGE", "LOCAL"), Tier.REMOTE: ("STORAGE", "REMOTE")}


def default_convert(h: bytes) -> Any:
    """vLLM's ``maybe_convert_block_hash`` (vllm/v1/core/kv_cache_utils.py) for a
    vLLM that does not export it: the low 64 bits of the hash as an int unless
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (vLLM's default is 1)."""
    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") in ("0", "false", "False", ""):
        return bytes(h)
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


class BlockInfo(NamedTuple):
    """What vLLM's ``BlockStored`` says of one block beyond its hash."""

    token_ids: tuple[int, ...]
    parent: bytes | None  # the previous block's key in the same group; None for the first block
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # vLLM's extra keys of the block's hash


def _extra_keys(request: Any, start: int, end: int, mm_idx: int) -> tuple[tuple[Any, ...] | None, int]:
    """The extra keys of the block of tokens [start, end) of ``request``:
    vLLM's ``generate_block_hash_extra_keys`` (kv_cache_utils.py), or, on a
    vLLM without it, the same keys in its order: the LoRA name, the
    identifiers of the multimodal inputs the block overlaps, ``cache_salt``
    on the first block (prompt-embedding hashes need vLLM's)."""
    try:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
    except ImportError:
        generate_block_hash_extra_keys = None
    if generate_block_hash_extra_keys is not None:
        return generate_block_hash_extra_keys(request, start, end, mm_idx)
    keys: list[Any] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None and getattr(lora, "name", None):
        keys.append(lora.name)
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        if pos is not None and pos.offset < end and pos.offset + pos.length > start:
            keys.append(f.identifier)
    salt = getattr(request, "cache_salt", None)
    if start == 0 and salt:
        keys.append(salt)
    return (tuple(keys) if keys else None), mm_idx


def remember(infos: "BlockInfoMap", request: Any, hashes: Sequence[bytes], group: int, blocks: Iterable[int],
             factor: int, block_size: int) -> None:
    """Keeps what vLLM's BlockStored says of ``group``'s blocks ``blocks``
    (indices in the group's blocks of ``block_size`` tokens, each ``factor``
    hash blocks) beyond their keys: the tokens of each, the key of the block
    before it, the LoRA adapter and the extra keys of its hash (vLLM's
    offloading connector takes the same from the request when it plans a
    store). Blocks past the request's tokens are skipped."""
    tokens = getattr(request, "all_token_ids", None)
    if tokens is None:
        return
    lora = getattr(request, "lora_request", None)
    lora_id = getattr(lora, "adapter_id", None) if lora is not None else None
    lora_name = getattr(lora, "name", None) if lora is not None else None
    mm_idx = 0
    for i in sorted(blocks):
        if (i + 1) * block_size > len(tokens):
            continue
        extra, mm_idx = _extra_keys(request, i * block_size, (i + 1) * block_size, mm_idx)
        parent = bytes(hashes[i * factor - 1]) if i > 0 else None
        infos.put(group, bytes(hashes[(i + 1) * factor - 1]),
                  BlockInfo(tuple(tokens[i * block_size:(i + 1) * block_size]), parent, lora_id, lora_name, extra))


# vLLM's KVCacheSpecKind values by spec class, most specific first, as
# get_kv_cache_spec_kind (vllm/v1/kv_cache_interface.py at 7cfb97e33791)
# tests them; for a vLLM without that function.
_SPEC_KINDS = (("SlidingWindowMLASpec", "sliding_window_mla"), ("MLAAttentionSpec", "mla_attention"),
               ("SinkFullAttentionSpec", "sink_full_attention"), ("FullAttentionSpec", "full_attention"),
               ("ChunkedLocalAttentionSpec", "chunked_local_attention"), ("SlidingWindowSpec", "sliding_window"),
               ("MambaSpec", "mamba"), ("EncoderOnlyAttentionSpec", "encoder_only_attention"),
               ("CrossAttentionSpec", "cross_attention"))


def _spec_kind(spec: Any) -> tuple[str | None, int | None]:
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:
        get_kv_cache_spec_kind = get_kv_cache_spec_sliding_window = None
    if get_kv_cache_spec_kind is not None and get_kv_cache_spec_sliding_window is not None:
        kind = get_kv_cache_spec_kind(spec)
        return getattr(kind, "value", kind), get_kv_cache_spec_sliding_window(spec)
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if isinstance(inner, dict) and inner:
        kinds = {_spec_kind(s) for s in inner.values()}
        return next(iter(kinds)) if len(kinds) == 1 else ("unknown", None)
    names = {c.__name__ for c in type(spec).__mro__}
    window = getattr(spec, "sliding_window", None) if "SlidingWindowSpec" in names else None
    for cls, kind in _SPEC_KINDS:
        if cls in names:
            return kind, window
    return "unknown", None


def event_group_specs(kv_cache_config: Any) -> tuple[tuple[str | None, int | None], ...]:
    """Each KV cache group's ``(kv_cache_spec_kind, kv_cache_spec_sliding_window)``
    for its BlockStored events, as vLLM's offloading connector reports them
    (``get_offloading_event_group_spec``); empty without a config."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return tuple(_spec_kind(g.kv_cache_spec) for g in groups)


class BlockInfoMap:
    """(group, key) -> :class:`BlockInfo`, at most ``max_blocks`` of them; the
    least recently recorded is forgotten first. Used by the scheduler thread only."""

    def __init__(self, max_blocks: int = 65536):
        self.max_blocks = max(1, int(max_blocks))
        self._m: collections.OrderedDict[tuple[int, bytes], BlockInfo] = collections.OrderedDict()

    def put(self, group: int, key: bytes, info: BlockInfo) -> None:
        k = (group, bytes(key))
        self._m[k] = info
        self._m.move_to_end(k)
        while len(self._m) > self.max_blocks:
            self._m.popitem(last=False)

    def get(self, group: int, key: bytes) -> BlockInfo | None:
        return self._m.get((group, key))

    def __len__(self) -> int:
        return len(self._m)


def _fields(cls: Any) -> tuple[str, ...]:
    """The fields a vLLM event class declares: msgspec's ``__struct_fields__``
    (vLLM's), else a dataclass's."""
    f = getattr(cls, "__struct_fields__", None)
    if f is not None:
        return tuple(f)
    if dataclasses.is_dataclass(cls):
        return tuple(x.name for x in dataclasses.fields(cls))
    raise TypeError(f"{cls!r} is neither a msgspec Struct nor a dataclass")


@dataclass
class VLLMEventTypes:
    """vLLM's event classes and hash conversion, as the shell imported them."""

    BlockStored: Any
    BlockRemoved: Any
    AllBlocksCleared: Any
    convert: Callable[[bytes], Any] = default_convert
    # Per KV cache group: (kv_cache_spec_kind, kv_cache_spec_sliding_window)
    # (event_group_specs); a group past it has neither.
    group_specs: Sequence[tuple[str | None, int | None]] = ()

    def __post_init__(self):
        self.stored_fields = set(_fields(self.BlockStored))
        self.removed_fields = set(_fields(self.BlockRemoved))

    def stored(self, **kw: Any) -> Any:
        return self.BlockStored(**{k: v for k, v in kw.items() if k in self.stored_fields})

    def removed(self, **kw: Any) -> Any:
        return self.BlockRemoved(**{k: v for k, v in kw.items() if k in self.removed_fields})


def translate(events: Iterable[KVEvent], infos: BlockInfoMap, block_sizes: Sequence[int],
              types: VLLMEventTypes) -> list[Any]:
    """The daemon's events, in order, as vLLM's. A run of ``BLOCK_STORED`` of
    one tier and group where each block's parent is the block before it (a
    prefix stored in one go) is one ``BlockStored`` with their hashes and
    tokens, as vLLM's block pool reports a run; a run of ``BLOCK_REMOVED`` of
    one tier and group is one ``BlockRemoved``. Markers other than
    ``ALL_BLOCKS_CLEARED`` carry no change (``EVENTS_LOST`` is always
    followed by the daemon's reset and snapshot)."""
    out: list[Any] = []
    run: dict | None = None  # the event being built: kind, medium, group, fields

    def flush() -> None:
        nonlocal run
        if run is None:
            return
        medium, locality = run["medium"]
        if run["kind"] == EventKind.BLOCK_STORED:
            kind, window = specs[run["group"]] if run["group"] < len(specs) else (None, None)
            extra = run["extra"] if any(x is not None for x in run["extra"]) else None
            out.append(types.stored(block_hashes=run["hashes"], parent_block_hash=run["parent"],
                                    token_ids=run["tokens"], block_size=run["block_size"], lora_id=run["lora_id"],
                                    medium=medium, lora_name=run["lora_name"], extra_keys=extra,
                                    group_idx=run["group"], kv_cache_spec_kind=kind,
                                    kv_cache_spec_sliding_window=window, locality=locality))
        else:
            out.append(types.removed(block_hashes=run["hashes"], medium=medium, group_idx=run["group"],
                                     locality=locality))
        run = None

    conv = types.convert
    specs = types.group_specs
    for e in events:
        if e.kind == EventKind.ALL_BLOCKS_CLEARED:
            flush()
            out.append(types.AllBlocksCleared())
            continue
        if e.kind not in (EventKind.BLOCK_STORED, EventKind.BLOCK_REMOVED):
            continue
        medium = MEDIUM.get(Tier(e.tier))
        if medium is None:
            continue
        if e.kind == EventKind.BLOCK_REMOVED:
            if run is not None and (run["kind"], run["medium"], run["group"]) == (e.kind, medium, e.group):
                run["hashes"].append(conv(e.hash))
                continue
            flush()
            run = {"kind": e.kind, "medium": medium, "group": e.group, "hashes": [conv(e.hash)]}
            continue
        info = infos.get(e.group, e.hash)
        bs = block_sizes[e.group] if e.group < len(block_sizes) else 0
        if info is None:
            info = BlockInfo((), None)
            known = False
        else:
            known = True
        if (run is not None and run["kind"] == e.kind and known and run["known"] and run["medium"] == medium
                and run["group"] == e.group and info.parent == run["last"]
                and (info.lora_id, info.lora_name) == (run["lora_id"], run["lora_name"])):
            run["hashes"].append(conv(e.hash))
            run["tokens"].extend(info.token_ids)
            run["extra"].append(info.extra_keys)
            run["last"] = e.hash
            continue
        flush()
        run = {"kind": e.kind, "medium": medium, "group": e.group, "hashes": [conv(e.hash)], "known": known,
               "parent": conv(info.parent) if info.parent is not None else None, "tokens": list(info.token_ids),
               "block_size": bs, "lora_id": info.lora_id, "lora_name": info.lora_name, "last": e.hash,
               "extra": [info.extra_keys]}
    flush()
    return out


class EventFeed:
    """Follows one namespace's ``WatchEvents`` stream on a thread it owns.

    ``fingerprint()`` names the namespace (resolved again each time the
    stream starts over, so a restarted daemon's namespace is found again). A
    stream that ends (the daemon stopped or restarted) is started over after
    ``retry_s``; a new stream begins with ``ALL_BLOCKS_CLEARED`` and a
    snapshot, so whoever replays the events sees a reset, then what the
    daemon holds.

    Events wait for :meth:`take` in a queue of at most ``max_queued`` (or
    one reply of the stream, if that is longer). When
    it is full the thread stops reading (vLLM takes events only while it
    steps; an idle engine does not): the stream backs up to the daemon,
    whose bounded ring then marks this subscriber behind, and once taking
    resumes the stream says ``EVENTS_LOST``, ``ALL_BLOCKS_CLEARED`` and a
    fresh snapshot (docs/events.md, Loss). Nothing is dropped here.
    :meth:`close` stops the thread and waits for it."""

    def __init__(self, client: Any, fingerprint: Callable[[], bytes | None], *, max_queued: int = 65536,
                 retry_s: float = 0.5, rpc_timeout_s: float = 1.0, max_events: int = 1024):
        self._client = client
        self._fingerprint = fingerprint
        self._max_events = max(1, min(int(max_events), 1024))
        self.max_queued = max(int(max_queued), self._max_events)
        self._retry = retry_s
        self._timeout = rpc_timeout_s
        self._cond = threading.Condition()
        self._q: collections.deque[KVEvent] = collections.deque()
        self._stream: Any = None
        self._stop = threading.Event()
        self.streams = 0  # streams started
        self.lost = 0  # EVENTS_LOST markers from the daemon
        self.caught_up_seq = -1  # seq of the last CAUGHT_UP queued
        self.namespace_id = 0
        self._thread = threading.Thread(target=self._run, name="kvoffload-events", daemon=True)
        self._thread.start()

    def take(self) -> list[KVEvent]:
        with self._cond:
            out = list(self._q)
            self._q.clear()
            self._cond.notify_all()
        return out

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            s = self._stream
            self._cond.notify_all()
        if s is not None:
            s.cancel()
        self._thread.join(timeout)
        if self._thread.is_alive():  # pragma: no cover - a stuck gRPC call
            log.error("kvoffload: the events thread did not stop within %.0f s", timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except KVOffloadError as e:
                log.debug("kvoffload: events stream ended: %s", e)
            except Exception:  # pragma: no cover - never let the thread die silently
                log.exception("kvoffload: events stream failed")
            self._stop.wait(self._retry)

    def _follow(self) -> None:
        fp = self._fingerprint()
        if not fp:
            return
        ns = self._client.resolve([fp], timeout=self._timeout)[0]
        if not ns:
            return
        stream = self._client.watch_events([ns], max_events=self._max_events)
        with self._cond:
            if self._stop.is_set():
                stream.cancel()
                return
            self._stream = stream
            self.streams += 1
            self.namespace_id = ns
        try:
            for evs in stream:
                with self._cond:
                    # An empty queue takes a whole reply (the daemon may send
                    # a marker past max_events): at most max_queued + one reply.
                    while self._q and len(self._q) + len(evs) > self.max_queued and not self._stop.is_set():
                        self._cond.wait()
                    if self._stop.is_set():
                        return
                    self._q.extend(evs)
                    self._cond.notify_all()
                    for e in evs:
                        if e.kind == EventKind.EVENTS_LOST:
                            self.lost += 1
                        elif e.kind == EventKind.CAUGHT_UP:
                            self.caught_up_seq = e.seq
        finally:
            stream.cancel()
            with self._cond:
                self._stream = None
