"""Which kvoffloadd process a registration lives in, and whether it still runs.

A Load or Store the daemon accepted keeps copying into or out of the
engine's memory until it has drained, whatever happens to the connection
that sent it: the daemon drains a registration's jobs before it lets go of
the memory. So the connector may hand a job's blocks back to vLLM only when
the daemon reported the job, said the registration is gone after draining
it (NOT_FOUND from the same process), or the process has exited. A daemon
that is merely unreachable may be stopped (SIGSTOP) or still draining after
it closed its socket; nothing but its exit proves it will not write again.

:func:`daemon_pid` asks the kernel who listens on the socket
(``SO_PEERCRED``); :class:`DaemonProcess` holds a pidfd on that process, so
a later pid reuse cannot fool it.

From another pid namespace (the pid reads 0) the daemon's *life file* tells
the same: each daemon creates ``<socket>.life`` afresh and holds an
exclusive flock on it until the process is gone. :func:`open_life` opens the
file of the daemon serving now; a shared lock taken on that open file later
proves that daemon exited, while a stopped or draining daemon still holds
it. Both sides hold the inode open, so a restarted daemon's new file is
never mistaken for it.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket as _socket
import struct

__all__ = ["daemon_pid", "open_life", "same_life", "DaemonProcess"]

LIFE_SUFFIX = ".life"


def open_life(path: str) -> int | None:
    """An fd on the life file of the daemon serving on the unix socket
    ``path`` now, or None (no such file: a daemon older than it, or none)."""
    if path.startswith("unix:"):
        path = path[len("unix:"):]
    try:
        return os.open(path + LIFE_SUFFIX, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def same_life(life: int | None, path: str) -> bool:
    """Whether the life file serving on socket ``path`` now is still the one
    ``life`` was opened on (True when neither is there: nothing to tell)."""
    now = open_life(path)
    if now is None or life is None:
        if now is not None:
            os.close(now)
        return now is None and life is None
    try:
        return _same_file(now, life)
    finally:
        os.close(now)


def daemon_pid(path: str, timeout_s: float = 1.0) -> int | None:
    """The pid of the process listening on the unix socket ``path``, or None
    (nobody listens, or its pid is not visible from this pid namespace)."""
    if path.startswith("unix:"):
        path = path[len("unix:"):]
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout_s)
        s.connect(path)
        raw = s.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    finally:
        s.close()
    pid, _, _ = struct.unpack("3i", raw)
    return pid or None


class DaemonProcess:
    """A handle on one daemon process. ``exited()`` is True once it is gone.

    It watches the pid (a pidfd) where the pid is visible, else the life
    file ``life`` (an fd from :func:`open_life`, owned by this handle from
    here on). With neither nothing is known: ``known`` is False and
    ``exited()`` stays False; callers then fall back to a grace period (see
    docs/vllm.md)."""

    def __init__(self, pid: int | None, life: int | None = None):
        self.pid = pid
        self._fd: int | None = None
        self._life = life
        self._gone = False
        if pid:
            try:
                self._fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._gone = True
            except (OSError, AttributeError):
                self._fd = None  # no pidfd support: unknown

    @property
    def known(self) -> bool:
        return self._gone or self._fd is not None or self._life is not None

    def exited(self) -> bool:
        if self._gone:
            return True
        if self._fd is not None:
            p = select.poll()
            p.register(self._fd, select.POLLIN)
            if p.poll(0):
                self._gone = True
        elif self._life is not None:
            try:
                fcntl.flock(self._life, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # the daemon holds it: alive, stopped or draining
            else:
                fcntl.flock(self._life, fcntl.LOCK_UN)
                self._gone = True
        if self._gone:
            self.close()
        return self._gone

    def serves(self, path: str) -> bool:
        """Whether the daemon serving on socket ``path`` now is this one, by
        its life file (False when that cannot be told)."""
        if self._life is None:
            return False
        fd = open_life(path)
        if fd is None:
            return False
        try:
            return _same_file(fd, self._life)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._life is not None:
            os.close(self._life)
            self._life = None

    def __repr__(self) -> str:
        state = "exited" if self._gone else ("running" if self.known else "unknown")
        return f"DaemonProcess(pid={self.pid}, {state})"
