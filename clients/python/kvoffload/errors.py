"""Exceptions of the kvoffload client.

Every failed call raises a :class:`KVOffloadError` carrying the gRPC status
code and the daemon's message. The codes the daemon uses (see
rpc/server/server.go, ``toStatus``) have their own subclasses, so a caller can
catch exactly what it can handle::

    try:
        client.load(reg, jobs)
    except kvoffload.Unavailable as e:
        ...  # the daemon is stopping or gone: treat every block as failed
             # (e.daemon_stopping: it refused the call whole, nothing ran)
    except kvoffload.InvalidArgument as e:
        ...  # a bug in the caller: e.message names the field

Errors detected by the client before anything is sent (for instance hashes of
different lengths in one key list) are raised as the same classes, with
``from_daemon`` False.
"""

from __future__ import annotations

import grpc

__all__ = [
    "KVOffloadError",
    "InvalidArgument",
    "NotFound",
    "FailedPrecondition",
    "ResourceExhausted",
    "Unavailable",
    "PermissionDenied",
    "DeadlineExceeded",
    "Cancelled",
    "Internal",
    "from_rpc_error",
]


class KVOffloadError(Exception):
    """A kvoffloadd call failed.

    Attributes:
        code: the ``grpc.StatusCode``.
        message: the daemon's (or the client's) explanation.
        method: the RPC that failed, e.g. ``"Load"`` (empty when unknown).
        from_daemon: False when the client refused the call before sending it.
        daemon_stopping: True when the daemon refused the call whole because
            it is stopping (UNAVAILABLE with the trailer
            ``kvoffload-refusal: daemon-stopping``, docs/api.md, Errors):
            nothing of it ran, so its jobs may go to the next daemon. An
            UNAVAILABLE of the transport never has it (the call may have
            been accepted).
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    daemon_stopping: bool = False

    def __init__(self, code: grpc.StatusCode | None, message: str, method: str = "", from_daemon: bool = True):
        if code is not None:
            self.code = code
        self.message = message
        self.method = method
        self.from_daemon = from_daemon
        where = f"{method}: " if method else ""
        super().__init__(f"{where}{self.code.name}: {message}")

    @property
    def code_name(self) -> str:
        """The status code's name, e.g. ``"INVALID_ARGUMENT"``."""
        return self.code.name


class InvalidArgument(KVOffloadError, ValueError):
    """A request field is malformed or out of range (the message names it):
    an engine block id beyond the registered regions, a hash of the wrong
    length, an unknown namespace, a region the daemon may not map."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVOffloadError):
    """The registration id is unknown: it was unregistered, or the connection
    that made it closed. Register again."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(KVOffloadError):
    """The fingerprint is already registered with a different layout."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KVOffloadError):
    """Too many unfinished or unread jobs: read Completions before submitting
    more (or a message over the size limit)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KVOffloadError):
    """The daemon is shutting down, or cannot be reached: no socket at the
    path, nobody listening on it, or a socket this process may not open (the
    message says which; ``from_daemon`` is then False)."""

    code = grpc.StatusCode.UNAVAILABLE


class PermissionDenied(KVOffloadError):
    """Register needs a unix-socket connection the daemon can identify."""

    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(KVOffloadError):
    """The call's timeout passed before the daemon answered."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(KVOffloadError):
    """The call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class Internal(KVOffloadError):
    """The daemon failed in a way it did not classify."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[KVOffloadError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        PermissionDenied,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}


def error_for(code: grpc.StatusCode, message: str, method: str = "", from_daemon: bool = True) -> KVOffloadError:
    """The exception of the right class for a status code."""
    cls = _BY_CODE.get(code, KVOffloadError)
    return cls(code, message, method, from_daemon)


# The trailer a stopping daemon sets on a call it refused whole
# (rpc/server's RefusalKey and RefusalStopping).
REFUSAL_KEY = "kvoffload-refusal"
REFUSAL_STOPPING = "daemon-stopping"


def from_rpc_error(err: grpc.RpcError, method: str = "") -> KVOffloadError:
    """Converts a ``grpc.RpcError`` raised by a stub into a KVOffloadError."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    out = error_for(code, details or str(err), method)
    trailer = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    out.daemon_stopping = any(k == REFUSAL_KEY and v == REFUSAL_STOPPING for k, v in (trailer or ()))
    return out
