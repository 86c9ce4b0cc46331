"""What the daemon's tiers hold, as vLLM's KV cache events (docs/events.md).

The scheduler half of the connector follows the daemon's ``WatchEvents``
stream on a thread of its own (:class:`EventFeed`) and, each time vLLM's
scheduler calls ``take_events``, turns what arrived into vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, which vLLM's own
publisher then sends with the GPU prefix cache's events. Written against
vLLM main's ``vllm/distributed/kv_events.py`` at commit
0181ea3173e53eea8cf04a86891488e3dc89bb34 (the classes and their field order)
and ``KVConnectorBase_V1.take_events`` at 003df2961dd8830c317a61f9745ccd557da9fa06;
vLLM's offloading connector (``offloading/events.py``, read at 030ea52effcb)
describes an offloaded block the same way: its hashes at the group's block
size, the parent hash, the block's token ids, ``medium`` the tier.

- ``medium`` is the tier, ``"CPU"`` or ``"DISK"``;
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

Nothing here imports vLLM: the classes and the hash conversion are passed in
(:class:`VLLMEventTypes`), and only the fields a class declares are given to
it, so a vLLM whose classes lack ``group_idx`` or ``lora_name`` still works.
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

__all__ = ["BlockInfo", "BlockInfoMap", "EventFeed", "VLLMEventTypes", "translate", "MEDIUM", "default_convert"]

log = logging.getLogger("kvoffload.kv_events")

MEDIUM = {Tier.CPU: "CPU", Tier.DISK: "DISK"}


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
        if run["kind"] == EventKind.BLOCK_STORED:
            out.append(types.stored(block_hashes=run["hashes"], parent_block_hash=run["parent"],
                                    token_ids=run["tokens"], block_size=run["block_size"], lora_id=run["lora_id"],
                                    medium=run["medium"], lora_name=run["lora_name"], group_idx=run["group"]))
        else:
            out.append(types.removed(block_hashes=run["hashes"], medium=run["medium"], group_idx=run["group"]))
        run = None

    conv = types.convert
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
            run["last"] = e.hash
            continue
        flush()
        run = {"kind": e.kind, "medium": medium, "group": e.group, "hashes": [conv(e.hash)], "known": known,
               "parent": conv(info.parent) if info.parent is not None else None, "tokens": list(info.token_ids),
               "block_size": bs, "lora_id": info.lora_id, "lora_name": info.lora_name, "last": e.hash}
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
