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
"""

from __future__ import annotations

import os
import select
import socket as _socket
import struct

__all__ = ["daemon_pid", "DaemonProcess"]


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

    Without a pid (another pid namespace) nothing is known: ``known`` is
    False and ``exited()`` stays False; callers then fall back to a grace
    period (see docs/vllm.md)."""

    def __init__(self, pid: int | None):
        self.pid = pid
        self._fd: int | None = None
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
        return self._gone or self._fd is not None

    def exited(self) -> bool:
        if self._gone:
            return True
        if self._fd is None:
            return False
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        if p.poll(0):
            self._gone = True
            self.close()
        return self._gone

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __repr__(self) -> str:
        state = "exited" if self._gone else ("running" if self._fd is not None else "unknown")
        return f"DaemonProcess(pid={self.pid}, {state})"
