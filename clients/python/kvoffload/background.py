"""One thread that makes a connector half's daemon calls off vLLM's loop.

vLLM's scheduler and model runner are single loops: a call that blocks on
the daemon blocks every request. So the connector never calls the daemon
from them. It hands each call to a :class:`Background` thread and reads the
answer when it is there; the loop waits at most a few milliseconds for it.
The thread also notices a daemon that stops answering: a call that has run
longer than ``slow_after_s``, or failed with UNAVAILABLE or
DEADLINE_EXCEEDED, marks the daemon down until a health check answers
SERVING again, and while it is down queued calls fail at once.

The owner starts the thread in its constructor and stops and joins it in
:meth:`Background.close`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

import grpc

from .errors import KVOffloadError

__all__ = ["Task", "Background", "DaemonDown"]

log = logging.getLogger("kvoffload.background")


class DaemonDown(KVOffloadError):
    """The daemon was not answering, so the call was not made."""

    code = grpc.StatusCode.UNAVAILABLE


class Task:
    """A queued call: ``done`` is set once ``result`` or ``error`` is."""

    __slots__ = ("fn", "done", "result", "error", "queued_at", "finished_at")

    def __init__(self, fn: Callable[[Any], Any], now: float):
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.queued_at = now
        self.finished_at = 0.0


_DOWN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class Background:
    """Runs queued calls in order on one thread.

    Args:
        client: what each task's function is given (a kvoffload Client).
        name: the thread's name.
        slow_after_s: a call running longer than this makes ``healthy()``
            false (the loop stops waiting for the daemon).
        probe_every_s: how often a down daemon is health-checked.
    """

    def __init__(self, client: Any, name: str, *, slow_after_s: float = 0.05, probe_every_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        self.client = client
        self._clock = clock
        self._slow_after = slow_after_s
        self._probe_every = probe_every_s
        self._cv = threading.Condition()
        self._queue: deque[Task] = deque()
        self._busy_since: float | None = None
        self._down = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- the loop's side ---------------------------------------------------

    def submit(self, fn: Callable[[Any], Any]) -> Task:
        t = Task(fn, self._clock())
        with self._cv:
            if self._stop:
                t.error = DaemonDown(None, "connector closed", from_daemon=False)
                t.done.set()
                return t
            self._queue.append(t)
            self._cv.notify_all()
        return t

    def healthy(self) -> bool:
        """False while the daemon is marked down or a call is taking too long."""
        with self._cv:
            if self._down:
                return False
            busy = self._busy_since
        return busy is None or self._clock() - busy < self._slow_after

    def mark_down(self) -> None:
        with self._cv:
            if not self._down:
                log.warning("kvoffload: the daemon is not answering; treating it as down until it does")
            self._down = True
            self._cv.notify_all()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout_s)

    # -- the thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._queue and not self._down:
                    self._cv.wait()
                if self._stop:
                    pending, self._queue = list(self._queue), deque()
                    break
                if self._down:
                    # Fail what waits, then probe until the daemon answers.
                    failed, self._queue = list(self._queue), deque()
                    task = None
                else:
                    task = self._queue.popleft()
                    failed = []
                    self._busy_since = self._clock()
            for t in failed:
                self._finish(t, error=DaemonDown(None, "the daemon is not answering", from_daemon=False))
            if task is None:
                self._probe()
                continue
            try:
                task.result = task.fn(self.client)
            except KVOffloadError as e:
                task.error = e
                if e.code in _DOWN_CODES and not isinstance(e, DaemonDown):
                    self.mark_down()
            except Exception as e:  # a bug: keep the thread alive, report it to the caller
                log.exception("kvoffload: background call failed")
                task.error = e
            finally:
                with self._cv:
                    self._busy_since = None
                self._finish(task)
        for t in pending:
            self._finish(t, error=DaemonDown(None, "connector closed", from_daemon=False))

    def _finish(self, t: Task, error: BaseException | None = None) -> None:
        if error is not None:
            t.error = error
        t.finished_at = self._clock()
        t.done.set()

    def _probe(self) -> None:
        try:
            ok = self.client.healthy(timeout=min(1.0, max(0.1, self._probe_every)))
        except KVOffloadError:
            ok = False
        with self._cv:
            if ok:
                log.warning("kvoffload: the daemon answers again")
                self._down = False
                return
            self._cv.wait(self._probe_every)
