"""What the daemon holds for the engine's namespaces, mirrored in-process.

A lookup over gRPC is a round trip (0.25-0.45 ms on an idle machine, several
ms on a busy one): longer than vLLM's scheduler can wait for it, so a new
request used to wait a step for its answer (issue 32). The daemon's
``WatchEvents`` stream says every change of what its CPU and disk tiers hold
(a reset and a snapshot first), and replaying it gives exactly what a
``Lookup`` of every key says once ``CAUGHT_UP`` has come (docs/events.md).
:class:`LookupMirror` follows that stream for the engine's namespaces (every
rank's) on a thread it owns and answers ``lookup_many`` from memory, in
microseconds, on vLLM's loop: the scheduler side runs its usual lookup
(windows and all) against it instead of the daemon.

It answers only while it is *live*: caught up on exactly the namespaces
asked about, following a stream that has not ended. Before the first
``CAUGHT_UP``, after the stream ended (a daemon restart), while a new
snapshot comes (after ``EVENTS_LOST`` or a whole-namespace invalidation)
and for namespaces it does not follow (a reset moved the engine to new
ones), :meth:`live` is False and the scheduler side asks the daemon as
before. Past ``max_blocks`` entries it stops for good (the memory is the
bound: about 120 bytes an entry, one per block and rank) and says so in the log.

Its answers are as fresh as the stream: a block stored a moment ago may not
be offered yet (a miss), and a block evicted a moment ago may still be (its
load fails, vLLM recomputes it: counted as a failed load, as with any block
evicted between a lookup and its load).

The thread shares the GIL with vLLM's loop: it reads the daemon's messages
without making a Python object per event, and lets the GIL go between
bounded slices of events (``slice_events`` while it answers).

:meth:`close` stops the thread and waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

import grpc

from .errors import KVOffloadError, from_rpc_error
from .types import EventKind, LookupResult, Tier

__all__ = ["LookupMirror"]

log = logging.getLogger("kvoffload.mirror")

_BIT = {Tier.CPU: 1, Tier.DISK: 2, Tier.REMOTE: 4}
# A namespace's tier of a block from its bits, and each tier's rank (the
# slowest across namespaces is the block's tier, as the daemon's Lookup).
_TIER = {1: Tier.CPU, 2: Tier.DISK, 3: Tier.CPU_AND_DISK, 4: Tier.REMOTE, 5: Tier.CPU_AND_DISK, 6: Tier.DISK,
         7: Tier.CPU_AND_DISK}
_RANK = {Tier.CPU: 0, Tier.CPU_AND_DISK: 0, Tier.DISK: 1, Tier.REMOTE: 2}
_STORED, _REMOVED, _CLEARED, _LOST, _CAUGHT_UP = (int(k) for k in (
    EventKind.BLOCK_STORED, EventKind.BLOCK_REMOVED, EventKind.ALL_BLOCKS_CLEARED, EventKind.EVENTS_LOST,
    EventKind.CAUGHT_UP))
# While it answers, the thread applies at most SLICE_EVENTS events (about
# 100 us of Python) and then sleeps _PAUSE_S with the GIL let go, so that
# vLLM's scheduler thread never waits for it longer than a slice. While it
# catches up (a snapshot: lookups go to the daemon meanwhile), slices of
# CATCH_UP_SLICE_EVENTS (about 2 ms, under the 5 ms switch interval) keep
# the pauses from slowing it down where a sleep lasts far longer than asked
# (a loaded machine).
SLICE_EVENTS = 64
CATCH_UP_SLICE_EVENTS = 1024
_PAUSE_S = 0.0001


def _responses(stream: Any):
    """The event lists of a ``watch_events`` stream, as the daemon's
    messages: read from the gRPC call itself, each event's fields are read
    once, where they are applied (a KVEvent object and two enum lookups per
    event cost the thread, and vLLM's loop waiting on the GIL, several times
    what applying it does)."""
    call = getattr(stream, "_call", None)
    if call is None:  # another client's stream: its KVEvents
        yield from stream
        return
    while True:
        try:
            r = next(call)
        except StopIteration:
            return
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:
                return  # cancelled: follow() or close()
            raise from_rpc_error(e, "WatchEvents") from None
        yield r.events


class LookupMirror:
    """Follows ``WatchEvents`` for the namespaces given to :meth:`follow`.

    Args:
        client: a kvoffload Client of its own (the stream holds a thread).
        max_blocks: entries (block, namespace) kept at most; past it the
            mirror stops for good.
        retry_s: wait before following again after a stream ended.
    """

    def __init__(self, client: Any, *, max_blocks: int = 2_000_000, retry_s: float = 0.2, max_events: int = 128,
                 slice_events: int = SLICE_EVENTS, catch_up_slice_events: int = CATCH_UP_SLICE_EVENTS):
        self._client = client
        self.max_blocks = int(max_blocks)
        self._retry = retry_s
        self._max_events = max_events
        self._cv = threading.Condition()
        self._want: tuple[int, ...] = ()  # the namespaces to follow
        # The namespaces it answers for (None: none); read without the lock
        # by the scheduler on every lookup (live()).
        self.live_ids: tuple[int, ...] | None = None
        # namespace -> group -> block hash -> tier bits. Replaced, never
        # cleared in place: a reader holding the old maps sees them whole.
        self._maps: dict[int, dict[int, dict[bytes, int]]] = {}
        self._n = 0
        self._stream: Any = None
        self._stop = False
        self.overflow = False
        self.remote_seen = False  # a REMOTE event came: other nodes' blocks are not all here
        self.streams = 0
        self.resets = 0
        self._fails = 0
        self._caught = False  # the current stream has caught up once
        self._slice = max(1, int(slice_events))
        self._catch_up_slice = max(1, int(catch_up_slice_events))
        self.events = 0  # events applied
        self.pauses = 0  # times the thread let the GIL go after a slice
        self.max_run = 0  # most events applied between two pauses (at most the slice of the time)
        self._thread = threading.Thread(target=self._run, name="kvoffload-mirror", daemon=True)
        self._thread.start()

    # -- the loop's side ---------------------------------------------------

    def follow(self, namespace_ids: Sequence[int]) -> None:
        """Follows these namespaces from now on (a change starts a new stream)."""
        ids = tuple(int(i) for i in namespace_ids)
        with self._cv:
            if ids == self._want:
                return
            self._want = ids
            self.live_ids = None
            s = self._stream
            self._cv.notify_all()
        if s is not None:
            s.cancel()

    def wants_ids(self) -> bool:
        """True when it follows nothing (its stream ended): resolve the
        namespaces again and :meth:`follow` them."""
        return not self._want and not self.overflow

    def live(self, namespace_ids: Sequence[int]) -> bool:
        """Whether answers for exactly these namespaces are the stream's."""
        return self.live_ids is not None and self.live_ids == tuple(namespace_ids)

    def blocks(self) -> int:
        return self._n

    def _group_maps(self, namespace_ids: Sequence[int], group: int) -> list | None:
        """Each namespace's map of ``group``, or None if one has none."""
        maps = self._maps
        ms = []
        for n in namespace_ids:
            byg = maps.get(n)
            m = byg.get(group) if byg is not None else None
            if m is None:
                return None
            ms.append(m)
        return ms

    def held(self, namespace_ids: Sequence[int], group: int, hashes: Sequence[bytes], factor: int, first: int,
             stop: int) -> list[Tier]:
        """The tier of each leading block of ``group`` in [first, stop) that
        every namespace holds, block ``i`` keyed by ``hashes[(i + 1) *
        factor - 1]`` (KeyMapper.keys) without building the keys: the
        scheduler's lookup of the full-attention groups, on vLLM's loop (a
        few dict probes a block, nothing else allocated but the answer)."""
        if len(namespace_ids) == 1:  # one rank: no map list, no worst tier
            byg = self._maps.get(namespace_ids[0])
            m = byg.get(group) if byg is not None else None
            if m is None:
                return []
            get, tier, tiers = m.get, _TIER, []
            if factor == 1:
                for h in hashes[first:stop]:
                    b = get(h)
                    if not b:
                        break
                    tiers.append(tier[b])
                return tiers
            for i in range(first, stop):
                b = get(hashes[(i + 1) * factor - 1])
                if not b:
                    break
                tiers.append(tier[b])
            return tiers
        ms = self._group_maps(namespace_ids, group)
        if ms is None:
            return []
        tiers = []
        for i in range(first, stop):
            h = hashes[(i + 1) * factor - 1]
            worst = None
            for m in ms:
                b = m.get(h)
                if not b:
                    return tiers
                t = _TIER[b]
                if worst is None or _RANK[t] > _RANK[worst]:
                    worst = t
            tiers.append(worst)
        return tiers

    def tail(self, namespace_ids: Sequence[int], group: int, hashes: Sequence[bytes], factor: int, first: int,
             stop: int, tiers: list | None = None) -> int:
        """How many of the last blocks of ``group`` in [first, stop) every
        namespace holds, counted from ``stop - 1`` down (a windowed group's
        window, whose keys the daemon's rounds ask last first: its ``ready``),
        block ``i`` keyed as in :meth:`held`. With ``tiers``, the slowest
        tier of each of those blocks is appended to it, in that order."""
        ms = self._group_maps(namespace_ids, group)
        if ms is None:
            return 0
        got = 0
        for i in range(stop - 1, first - 1, -1):
            h = hashes[(i + 1) * factor - 1]
            worst = None
            for m in ms:
                b = m.get(h)
                if not b:
                    return got
                if tiers is not None:
                    t = _TIER[b]
                    if worst is None or _RANK[t] > _RANK[worst]:
                        worst = t
            if tiers is not None:
                tiers.append(worst)
            got += 1
        return got

    def lookup_many(self, calls: Sequence[tuple], timeout: float | None = None) -> list[LookupResult]:
        """As Client.lookup_many, from memory: per ``(namespace_ids, hashes,
        group, lease_ms, peek)`` the leading hashes every namespace holds
        (CPU, disk or remote) and the slowest tier of each. No lease."""
        maps = self._maps
        out = []
        for ns, hashes, g, _lease, _peek in calls:
            ms = []
            for n in ns:
                m = maps.get(n)
                m = m.get(g) if m is not None else None
                if m is None:
                    ms = None
                    break
                ms.append(m)
            tiers: list[Tier] = []
            if ms and len(ms) == 1:
                m = ms[0]
                for h in hashes:
                    b = m.get(h)
                    if not b:
                        break
                    tiers.append(_TIER[b])
            elif ms:
                for h in hashes:
                    worst = None
                    for m in ms:
                        b = m.get(h)
                        if not b:
                            worst = None
                            break
                        t = _TIER[b]
                        if worst is None or _RANK[t] > _RANK[worst]:
                            worst = t
                    if worst is None:
                        break
                    tiers.append(worst)
            out.append(LookupResult(ready=len(tiers), tiers=tuple(tiers), lease_id=0))
        return out

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            s = self._stream
            self._cv.notify_all()
        if s is not None:
            s.cancel()
        self._thread.join(timeout)

    # -- the thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._want or self.overflow):
                    self._cv.wait()
                if self._stop:
                    return
                want = self._want
            try:
                self._follow(want)
            except KVOffloadError as e:
                log.debug("kvoffload: mirror stream ended: %s", e)
                if e.code == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("kvoffload: the daemon has no WatchEvents; lookups go to it (%s)", e)
                    with self._cv:
                        self.overflow = True
            except Exception:  # pragma: no cover - never let the thread die silently
                log.exception("kvoffload: mirror stream failed")
            with self._cv:
                self.live_ids = None
                self._stream = None
                if self._stop:
                    return
                if want == self._want:
                    # The stream ended: the daemon may have restarted, and
                    # a new one numbers its namespaces anew. Follow again
                    # only ids the scheduler resolves from here on.
                    self._want = ()
                # Streams that end before catching up (the daemon's 64
                # streams taken, a daemon starting) back off to 5 s.
                self._fails = 0 if self._caught else self._fails + 1
                end = time.monotonic() + min(5.0, self._retry * (1 << min(self._fails, 5)))
                while not self._stop and time.monotonic() < end:
                    self._cv.wait(end - time.monotonic())

    def _apply(self, evs: Sequence[Any], want: tuple[int, ...]) -> None:
        """Applies events in order (the daemon's KVEvent messages, or
        kvoffload KVEvents: the same fields)."""
        maps = self._maps
        last, m = None, None  # (namespace, group) of the previous event, and its map
        for e in evs:
            k = e.kind
            if k == _STORED or k == _REMOVED:
                bit = _BIT.get(e.tier, 0)
                if bit == 4:
                    self.remote_seen = True
                at = (e.namespace_id, e.group)
                if at != last:
                    byg = maps.get(at[0])
                    if byg is None:
                        byg = maps[at[0]] = {}
                    m = byg.get(at[1])
                    if m is None:
                        m = byg[at[1]] = {}
                    last = at
                h = e.hash
                old = m.get(h, 0)
                if k == _STORED:
                    if not old:
                        self._n += 1
                    m[h] = old | bit
                elif old:
                    new = old & ~bit
                    if new:
                        m[h] = new
                    else:
                        del m[h]
                        self._n -= 1
            elif k == _CAUGHT_UP:
                if self.live_ids is None:
                    with self._cv:
                        if want == self._want:
                            self.live_ids = want
                            self._caught = True
            elif k == _CLEARED or k == _LOST:
                self._clear()
                maps, last = self._maps, None
        self.events += len(evs)

    def _pause(self) -> int:
        """Lets vLLM's loop have the GIL: a thread that holds it waits up to
        the switch interval (5 ms) for it otherwise. A sleep of zero hands
        nothing over (this thread takes the GIL back before a waiting one
        wakes): it sleeps long enough for one to."""
        self.pauses += 1
        time.sleep(_PAUSE_S)
        return 0

    def _clear(self) -> None:
        self.live_ids = None
        self._maps = {}
        self._n = 0
        self.resets += 1

    def _follow(self, want: tuple[int, ...]) -> None:
        stream = self._client.watch_events(list(want), max_events=self._max_events)
        with self._cv:
            if self._stop or want != self._want:
                stream.cancel()
                return
            self._stream = stream
            self.streams += 1
            self._caught = False
        self._clear()
        run = 0  # events applied since the thread last let the GIL go
        try:
            for evs in _responses(stream):
                i, n = 0, len(evs)
                while i < n:
                    per = self._slice if self.live_ids is not None else self._catch_up_slice
                    if run >= per:  # the slice shrank (the mirror went live)
                        run = self._pause()
                    k = min(n, i + per - run)
                    self._apply(evs[i:k] if i or k < n else evs, want)
                    run += k - i
                    i = k
                    if run > self.max_run:
                        self.max_run = run
                    if run >= per:
                        run = self._pause()
                    if self._n > self.max_blocks:
                        log.warning("kvoffload: the lookup mirror passed %d blocks; lookups go to the daemon from "
                                    "now on (kv_connector_extra_config lookup_mirror_max_blocks)", self.max_blocks)
                        with self._cv:
                            self.overflow = True
                        self._clear()
                        return
                    if self._stop or want != self._want:
                        return
        finally:
            stream.cancel()
