"""A typed Python client of kvoffloadd.

It is a thin layer over the generated kvoffload.v1 stubs, like the reference
Go client (rpc/client/client.go), and behaves the same on the same inputs:
it dials the daemon's unix socket, packs keys, and turns protobuf messages
into the plain values of :mod:`kvoffload.types`. Every failure is raised as
a :class:`kvoffload.errors.KVOffloadError` subclass carrying the gRPC status
code and the daemon's message.

A registration belongs to the connection that made it: closing the client
(or the process exiting) unregisters everything registered through it.

    with Client("/run/user/1000/kvoffloadd/kvoffloadd.sock") as c:
        reg = c.register(fingerprint, layout, regions, client_name="worker 0")
        c.store(reg.registration_id, [Job(1, hashes, block_ids)])
        done = c.wait_jobs(reg.registration_id, [1])
"""

from __future__ import annotations

import os
import socket as _socket
import stat as _stat
import threading
import time
from typing import Iterable, Sequence

import grpc

from ._proto.kvoffload.v1 import kvoffload_pb2 as pb
from ._proto.kvoffload.v1 import kvoffload_pb2_grpc as pb_grpc
from ._version import PROTOCOL_VERSION, __version__
from .errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, KVOffloadError, error_for, from_rpc_error
from .types import (
    BlockFailure,
    BlockStatus,
    Completions,
    DiskRecovery,
    RecoveryState,
    EventKind,
    Job,
    JobResult,
    KVEvent,
    Layout,
    LookupResult,
    NamespaceStats,
    Op,
    Region,
    Registration,
    Stats,
    Tier,
    TierStats,
    pack_hashes,
)

__all__ = ["Client", "EventStream", "MAX_MESSAGE_BYTES", "HEALTH_SERVING"]

# The daemon refuses larger messages (rpc/server.MaxMessageBytes).
MAX_MESSAGE_BYTES = 16 << 20

# grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING
HEALTH_SERVING = 1

_HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _health_request(service: str) -> bytes:
    # grpc.health.v1.HealthCheckRequest{service = 1: string}, encoded by hand:
    # Debian's python3-grpcio ships no grpc_health module, and the message is
    # one optional string.
    if not service:
        return b""
    raw = service.encode()
    return b"\x0a" + _varint(len(raw)) + raw


def _health_status(raw: bytes) -> int:
    # HealthCheckResponse{status = 1: enum}; absent means UNKNOWN (0).
    i, status = 0, 0
    while i < len(raw):
        key, i = _read_varint(raw, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _read_varint(raw, i)
            if field == 1:
                status = v
        elif wire == 2:
            n, i = _read_varint(raw, i)
            i += n
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            break
    return status


def _read_varint(raw: bytes, i: int) -> tuple[int, int]:
    shift, v = 0, 0
    while i < len(raw):
        b = raw[i]
        i += 1
        v |= (b & 0x7F) << shift
        if not b & 0x80:
            return v, i
        shift += 7
    return v, i


def _key_list(group: int, hashes: Sequence[bytes] | bytes) -> pb.KeyList:
    packed = bytes(hashes) if isinstance(hashes, (bytes, bytearray, memoryview)) else pack_hashes(hashes)
    return pb.KeyList(group=group, hashes=packed)


def _job_pb(j: Job) -> pb.Job:
    return pb.Job(
        job_id=j.job_id,
        request_id=j.request_id,
        keys=_key_list(j.group, j.hashes),
        block_ids=list(j.block_ids),
        lease_id=j.lease_id,
    )


def _result(r: pb.JobResult) -> JobResult:
    return JobResult(
        job_id=r.job_id,
        request_id=r.request_id,
        op=Op(r.op) if r.op in Op._value2member_map_ else Op.UNSPECIFIED,
        ok=r.ok,
        failures=tuple(
            BlockFailure(
                index=f.index,
                block_id=f.block_id,
                hash=bytes(f.hash),
                status=BlockStatus(f.status) if f.status in BlockStatus._value2member_map_ else f.status,
            )
            for f in r.failures
        ),
        blocks=r.blocks,
        bytes=r.bytes,
        seq=r.seq,
    )


def _region_pb(r: Region) -> pb.Region:
    m = pb.Region(offset=r.offset, block_stride=r.block_stride, num_blocks=r.num_blocks)
    if r.shm_path is not None and r.cuda_handle is not None:
        raise ValueError("a region names either shm_path or a CUDA handle, not both")
    if r.shm_path is not None:
        m.shm_path = r.shm_path
    elif r.cuda_handle is not None:
        m.cuda.CopyFrom(
            pb.CudaIpcMemory(
                handle=r.cuda_handle, device=r.cuda_device, alloc_size=r.cuda_alloc_size, device_uuid=r.cuda_device_uuid
            )
        )
    return m


class EventStream:
    """A ``WatchEvents`` stream (docs/events.md): iterate it for lists of
    :class:`KVEvent`; :meth:`cancel` (or leaving a ``with`` block) ends it, and
    the iteration with it. It also ends, with :class:`KVOffloadError`
    UNAVAILABLE, when the daemon shuts down."""

    def __init__(self, call):
        self._call = call
        self._cancelled = False

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> list[KVEvent]:
        try:
            r = next(self._call)
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise from_rpc_error(e, "WatchEvents") from None
        return [
            KVEvent(e.seq, EventKind(e.kind), Tier(e.tier), e.namespace_id, e.group, bytes(e.hash)) for e in r.events
        ]

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


def _path(socket: str) -> str:
    return socket[len("unix:"):] if socket.startswith("unix:") else socket


def _no_answer(socket: str) -> str:
    return ": the daemon is stopped (SIGSTOP), hung or overloaded"


def _socket_problem(socket: str) -> tuple[str, str] | None:
    """Why the daemon's socket cannot be reached, found by a plain connect,
    as (kind, message): "missing" when the path does not exist, "refused"
    when nobody listens on it (the daemon that made it exited or was
    killed), "denied" when this process may not open it (the socket's mode,
    or its directory's); None when it connects (or fails otherwise). The
    client raises each as :class:`Unavailable` with the message: a
    connector keeps retrying, as the next daemon may fix it."""
    path = _path(socket)
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
    except FileNotFoundError:
        return "missing", (
            f"no socket at {path}: kvoffloadd is not running there (start it, or give the path its --socket names)")
    except ConnectionRefusedError:
        return "refused", (
            f"nobody listens on {path} (connection refused): the kvoffloadd that made it has exited or was killed")
    except PermissionError:
        try:
            st = os.stat(path)
            what = f"the socket is mode {_stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}, gid {st.st_gid}"
        except OSError:
            what = f"its directory {os.path.dirname(path)} is closed to this user"
        return "denied", (
            f"permission denied connecting to {path} as uid {os.getuid()} (gid {os.getgid()}): {what}; run as the "
            "daemon's user, or start the daemon with --socket-mode 0660 and put this user in its group")
    except OSError:
        return None
    finally:
        s.close()
    return None


class Client:
    """A connection to one kvoffloadd. Safe to share between threads.

    Args:
        socket: path of the daemon's unix socket.
        timeout: default deadline of each call in seconds (None: no deadline).
            Calls that wait (``wait=True`` transfers, ``completions`` with
            ``wait_ms``) extend it by what they ask to wait.
    """

    def __init__(self, socket: str, *, timeout: float | None = 30.0, options: Iterable[tuple[str, object]] = ()):
        self.socket = socket
        self.timeout = timeout
        target = socket if socket.startswith("unix:") else "unix:" + socket
        opts = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A registration lives as long as the connection that made it: give
            # every Client a connection of its own (gRPC shares subchannels
            # between channels to the same target by default).
            ("grpc.use_local_subchannel_pool", 1),
            # A local daemon restarts in well under a second: retry the
            # socket quickly instead of gRPC's default 1 s..120 s backoff.
            # gRPC takes min_reconnect_backoff_ms as the least time an attempt
            # has to finish its handshake, floored at 100 ms: at 50 a daemon
            # that took longer to answer a new connection (a loaded machine)
            # failed every call on it UNAVAILABLE at once. 20 s is gRPC's own
            # default; each call's deadline still bounds it.
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 20000),
            ("grpc.max_reconnect_backoff_ms", 1000),
            *options,
        ]
        # Per registration, the seq of the last result completions()
        # returned: the next call acknowledges it (docs/api.md, the cursor).
        self._acked: dict[int, int] = {}
        self._acked_lock = threading.Lock()
        self._channel = grpc.insecure_channel(target, options=opts)
        self._stub = pb_grpc.KVOffloadStub(self._channel)
        self._health = self._channel.unary_unary(_HEALTH_CHECK)
        # Watching the connectivity state keeps gRPC reading the socket while
        # no call is running, so the client answers the daemon's GOAWAY at
        # once: without it a daemon stopping gracefully waits seconds for an
        # idle Python client to let go.
        self.state: grpc.ChannelConnectivity | None = None
        self._channel.subscribe(self._on_state, try_to_connect=False)

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        self.state = state

    # -- plumbing -------------------------------------------------------

    def close(self) -> None:
        """Closes the connection; the daemon then releases every registration
        made over it."""
        try:
            self._channel.unsubscribe(self._on_state)
        except ValueError:
            pass
        # grpcio's watcher thread notices the unsubscribe within 0.2 s; closing
        # the channel under it makes the thread raise (grpcio 1.51), so let it
        # go first.
        st = getattr(self._channel, "_connectivity_state", None)
        end = time.monotonic() + 0.5
        while st is not None and getattr(st, "polling", False) and time.monotonic() < end:
            time.sleep(0.005)
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def channel(self) -> grpc.Channel:
        return self._channel

    def _deadline(self, extra_s: float = 0.0) -> float | None:
        return None if self.timeout is None else self.timeout + extra_s

    def _call(self, method: str, request, extra_s: float = 0.0, timeout: float | None = None,
              wait_for_ready: bool | None = None):
        fn = getattr(self._stub, method)
        t = self._deadline(extra_s) if timeout is None else timeout
        try:
            return fn(request, timeout=t, wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise self._explain(from_rpc_error(e, method), t) from None

    def _explain(self, err: KVOffloadError, timeout: float | None) -> KVOffloadError:
        """Says why a call that never reached the daemon failed: gRPC reports
        a missing socket, a refused connection and a socket this process may
        not open alike (UNAVAILABLE, "failed to connect"), and a daemon that
        accepts connections but never answers (stopped, hung) as a bare
        deadline."""
        if err.code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in err.message:
            problem = _socket_problem(self.socket)
            if problem is not None:
                return error_for(grpc.StatusCode.UNAVAILABLE, problem[1], err.method, from_daemon=False)
        if err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.message == "Deadline Exceeded":
            return error_for(err.code, f"no answer from kvoffloadd on {_path(self.socket)} within {timeout}s"
                             + _no_answer(self.socket), err.method, from_daemon=False)
        return err

    # -- health ---------------------------------------------------------

    def health(self, service: str = "", timeout: float | None = 5.0, wait_for_ready: bool = False) -> int:
        """The grpc.health.v1 status of ``service`` ("" = the whole server):
        1 SERVING, 2 NOT_SERVING (the daemon is shutting down), 0 UNKNOWN.
        With ``wait_for_ready`` the call waits (up to ``timeout``) for the
        socket to accept instead of failing at once."""
        try:
            raw = self._health(_health_request(service), timeout=timeout, wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise self._explain(from_rpc_error(e, "Health.Check"), timeout) from None
        return _health_status(raw)

    def healthy(self, timeout: float | None = 5.0, wait_for_ready: bool = False) -> bool:
        """True when the daemon reports SERVING."""
        return self.health("", timeout=timeout, wait_for_ready=wait_for_ready) == HEALTH_SERVING

    def wait_ready(self, timeout: float = 10.0, poll_s: float = 0.05, *, starting: bool = False) -> None:
        """Waits until the daemon answers SERVING (it says NOT_SERVING while
        it shuts down), at most ``timeout`` seconds.

        A socket that is missing, that nobody listens on (the daemon exited),
        or that this process may not open raises at once, each with its own
        message (:class:`Unavailable`). With
        ``starting`` (a daemon just launched, whose socket may not be there
        yet) a missing or refused socket is waited out instead, and named in
        the :class:`DeadlineExceeded` raised when the time is up. A daemon
        that accepts connections but never answers (stopped with SIGSTOP,
        hung) takes the whole ``timeout``, and the error says so."""
        end = time.monotonic() + timeout
        last: Exception | None = None
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                # With starting, wait_for_ready connects as soon as the socket
                # accepts; a fail-fast call would wait out gRPC's reconnect
                # backoff. Without, a socket nobody can reach fails at once.
                if self.healthy(timeout=max(0.05, min(1.0, left)), wait_for_ready=starting):
                    return
                last = None
            except KVOffloadError as e:
                last = e
                # Waiting does not open a socket this process may not open.
                if e.code == grpc.StatusCode.UNAVAILABLE and not e.from_daemon and (
                        not starting or e.message.startswith("permission denied")):
                    raise
            time.sleep(poll_s)
        problem = _socket_problem(self.socket)
        if problem is not None:
            why = problem[1]
        elif last is not None and last.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            why = "it accepts connections but does not answer" + _no_answer(self.socket)
        else:
            why = f"last error: {last}" if last else "it answers NOT_SERVING (shutting down)"
        raise DeadlineExceeded(None, f"kvoffloadd on {_path(self.socket)} not serving after {timeout}s: {why}",
                               "Health.Check", from_daemon=False)

    # -- the API ----------------------------------------------------------

    def register(
        self, fingerprint: bytes, layout: Layout, regions: Sequence[Region], client_name: str = "", *,
        timeout: float | None = None, registration_key: bytes = b"", wait_for_ready: bool | None = None,
    ) -> Registration:
        """Maps ``regions`` (one per layout segment, same order) and joins or
        creates the namespace named by ``fingerprint`` (1 to 256 bytes).
        ``registration_key`` (at most 256 bytes) lets peers find the
        fingerprint with :meth:`find_registrations`. With ``wait_for_ready``
        a call made while the connection is down (a daemon just restarted)
        waits for it, up to the deadline, instead of failing unsent."""
        req = pb.RegisterRequest(
            fingerprint=bytes(fingerprint),
            layout=pb.Layout(
                hash_bytes=layout.hash_bytes,
                segments=[pb.Segment(group=s.group, bytes=s.bytes) for s in layout.segments],
            ),
            regions=[_region_pb(r) for r in regions],
            client_name=client_name,
            registration_key=bytes(registration_key),
            protocol_version=PROTOCOL_VERSION,
            client_version=__version__,
        )
        r = self._call("Register", req, timeout=timeout, wait_for_ready=wait_for_ready)
        # The daemon refuses a protocol it does not speak; one older than the
        # numbers answers 0 and speaks protocol 1.
        proto = r.protocol_version or 1
        if proto != PROTOCOL_VERSION:
            try:
                self.unregister(r.registration_id, timeout=timeout)
            except KVOffloadError:
                pass  # the connection's close releases it too
            raise FailedPrecondition(
                None, f"version mismatch: kvoffloadd {r.daemon_version or '(unknown version)'} answered in API protocol "
                f"{proto}, this client (kvoffload {__version__}) speaks protocol {PROTOCOL_VERSION}: install the "
                "connector of the daemon's release", "Register", from_daemon=False)
        # A new registration's cursor starts at 0. Its id may be one an
        # earlier daemon process gave out (ids start again at every start):
        # acknowledging that one's seq would drop this one's first results.
        with self._acked_lock:
            self._acked.pop(r.registration_id, None)
        return Registration(r.registration_id, r.namespace_id, r.joined_existing, r.daemon_version, proto)

    def resolve(self, fingerprints: Sequence[bytes], *, timeout: float | None = None) -> list[int]:
        """The namespace id of each fingerprint, 0 where none is registered."""
        r = self._call("Resolve", pb.ResolveRequest(fingerprints=[bytes(f) for f in fingerprints]), timeout=timeout)
        return list(r.namespace_ids)

    def find_registrations(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[list[bytes]]:
        """For each registration key, the distinct fingerprints of the live
        registrations made with it (sorted; empty where none)."""
        r = self._call("FindRegistrations", pb.FindRegistrationsRequest(keys=[bytes(k) for k in keys]),
                       timeout=timeout)
        return [list(f.fingerprints) for f in r.found]

    def unregister(self, registration_id: int, *, timeout: float | None = None) -> None:
        """Waits for the registration's jobs to drain, unmaps its regions and
        drops its unread completions. Cached blocks stay."""
        self._call("Unregister", pb.UnregisterRequest(registration_id=registration_id), timeout=timeout)
        with self._acked_lock:
            self._acked.pop(registration_id, None)

    def lookup(
        self,
        namespace_ids: Sequence[int],
        hashes: Sequence[bytes] | bytes,
        *,
        group: int = 0,
        lease_ms: int = 0,
        peek: bool = False,
        timeout: float | None = None,
    ) -> LookupResult:
        """How many leading ``hashes`` (of ``group``) are ready in every
        namespace. With ``lease_ms`` the ready prefix is pinned that long;
        with ``peek`` the lookup does not count as an access for the
        daemon's admission policy."""
        r = self._call(
            "Lookup",
            pb.LookupRequest(
                namespace_ids=list(namespace_ids), keys=_key_list(group, hashes), lease_ms=lease_ms, peek=peek
            ),
            timeout=timeout,
        )
        tiers = tuple(Tier(t) if t in Tier._value2member_map_ else t for t in r.tiers)
        return LookupResult(ready=r.ready, tiers=tiers, lease_id=r.lease_id)

    def lookup_many(
        self, lookups: Sequence[tuple[Sequence[int], Sequence[bytes] | bytes, int, int, bool]], *,
        timeout: float | None = None,
    ) -> list[LookupResult | KVOffloadError]:
        """Several Lookups in one round trip: each ``(namespace_ids, hashes,
        group, lease_ms, peek)`` goes out at once on the connection and the
        answers (or the error of each) come back in order."""
        fn = self._stub.Lookup
        deadline = self._deadline() if timeout is None else timeout
        futs = [
            fn.future(
                pb.LookupRequest(namespace_ids=list(ns), keys=_key_list(g, h), lease_ms=lease_ms, peek=peek),
                timeout=deadline,
            )
            for ns, h, g, lease_ms, peek in lookups
        ]
        out: list[LookupResult | KVOffloadError] = []
        for f in futs:
            try:
                r = f.result()
            except grpc.RpcError as e:
                out.append(from_rpc_error(e, "Lookup"))
                continue
            tiers = tuple(Tier(t) if t in Tier._value2member_map_ else t for t in r.tiers)
            out.append(LookupResult(ready=r.ready, tiers=tiers, lease_id=r.lease_id))
        return out

    def release_leases(self, lease_ids: Sequence[int], *, timeout: float | None = None) -> int:
        """Ends leases this connection took that no Load will name; returns
        how many it held (others' and unknown ids are ignored)."""
        r = self._call("ReleaseLeases", pb.ReleaseLeasesRequest(lease_ids=list(lease_ids)), timeout=timeout)
        return int(r.released)

    def _transfer(
        self, method: str, registration_id: int, jobs: Sequence[Job], wait: bool, ready_event: bytes,
        timeout: float | None, wait_for_ready: bool | None = None, completions: bool = False,
    ) -> list[JobResult] | Completions | None:
        if wait and completions:
            raise InvalidArgument(None, "wait and completions exclude each other (a reply with wait carries "
                                  "this call's results only)", method, from_daemon=False)
        req = pb.TransferRequest(
            registration_id=registration_id, jobs=[_job_pb(j) for j in jobs], wait=wait, ready_event=ready_event
        )
        if completions:
            with self._acked_lock:
                req.ack_seq = self._acked.get(registration_id, 0)
        r = self._call(method, req, timeout=timeout, wait_for_ready=wait_for_ready)
        if completions:
            self._advance(registration_id, r.results)
            return Completions(results=tuple(_result(x) for x in r.results), pending=r.pending, more=r.more)
        return [_result(x) for x in r.results] if wait else None

    def _advance(self, registration_id: int, results) -> None:
        """Moves the registration's cursor past results just received: the
        next call that reads results acknowledges them."""
        if results:
            with self._acked_lock:
                self._acked[registration_id] = max(self._acked.get(registration_id, 0), results[-1].seq)

    def store(
        self,
        registration_id: int,
        jobs: Sequence[Job],
        *,
        wait: bool = False,
        ready_event: bytes = b"",
        timeout: float | None = None,
        wait_for_ready: bool | None = None,
        completions: bool = False,
    ) -> list[JobResult] | Completions | None:
        """Copies engine blocks into the cache. The daemon accepts every job
        or none. Without ``wait`` the results come through :meth:`completions`;
        with it they are returned here, one per job, in order. With
        ``completions`` (and no ``wait``) the call is also a
        :meth:`completions` call without waiting: it acknowledges what the
        last call returned for the registration, and returns a
        ``Completions`` with every result finished since (any job's, this
        call's own if they finished already), oldest first, ``pending`` and
        ``more`` (docs/api.md, Results on a Store or Load): one round trip
        instead of two for a client that sends a Store or Load anyway. With
        ``wait_for_ready`` a call made while the connection is down waits for
        it (up to the deadline) instead of failing unsent."""
        return self._transfer("Store", registration_id, jobs, wait, ready_event, timeout, wait_for_ready, completions)

    def load(
        self,
        registration_id: int,
        jobs: Sequence[Job],
        *,
        wait: bool = False,
        ready_event: bytes = b"",
        timeout: float | None = None,
        wait_for_ready: bool | None = None,
        completions: bool = False,
    ) -> list[JobResult] | Completions | None:
        """Copies cached blocks into engine blocks; see :meth:`store`. On CUDA,
        ``ready_event`` (an IPC event handle recorded on the compute stream)
        makes the copies wait for the kernels still reading those blocks."""
        return self._transfer("Load", registration_id, jobs, wait, ready_event, timeout, wait_for_ready, completions)

    def completions(self, registration_id: int, *, wait_ms: int = 0, max_jobs: int = 0) -> Completions:
        """Jobs finished since the last call. With ``wait_ms`` the daemon waits
        that long for one when none is ready (it caps the wait at 10 s).

        Each call acknowledges the results the previous one returned for the
        registration (``ack_seq``, docs/api.md): the daemon keeps a result
        until then, so a reply lost with the connection comes again on the
        next call instead of being lost. A reply carries at most a few MB;
        results beyond it come with the next call. Calls that read results
        (this one, and ``store``/``load`` with ``completions``) may run on
        several threads: each reply starts at most one past what the calls
        before it returned, so a result two replies carry is the same one
        (skip a ``seq`` already processed)."""
        with self._acked_lock:
            ack = self._acked.get(registration_id, 0)
        r = self._call(
            "Completions",
            pb.CompletionsRequest(registration_id=registration_id, wait_ms=wait_ms, max_jobs=max_jobs, ack_seq=ack),
            extra_s=wait_ms / 1000.0,
        )
        self._advance(registration_id, r.results)
        return Completions(results=tuple(_result(x) for x in r.results), pending=r.pending, more=r.more)

    def wait_jobs(self, registration_id: int, job_ids: Iterable[int], timeout: float = 30.0) -> dict[int, JobResult]:
        """Reads completions until every job in ``job_ids`` has finished and
        returns their results by job id. Results of other jobs read on the way
        are dropped (like the Go client's WaitJobs); raises DeadlineExceeded."""
        want = set(job_ids)
        got: dict[int, JobResult] = {}
        end = time.monotonic() + timeout
        while len(got) < len(want):
            left = end - time.monotonic()
            if left <= 0:
                missing = sorted(want - set(got))
                raise DeadlineExceeded(None, f"jobs {missing} not finished after {timeout}s", "Completions",
                                       from_daemon=False)
            c = self.completions(registration_id, wait_ms=int(min(left, 1.0) * 1000))
            for r in c.results:
                if r.job_id in want:
                    got[r.job_id] = r
        return got

    def invalidate(
        self, namespace_ids: Sequence[int], hashes: Sequence[bytes] | bytes | None = None, *, group: int = 0
    ) -> int:
        """Drops ``hashes`` of ``group`` (or, with hashes None, every block) of
        the namespaces; returns how many blocks were removed."""
        req = pb.InvalidateRequest(namespace_ids=list(namespace_ids))
        if hashes is not None:
            req.keys.CopyFrom(_key_list(group, hashes))
        return self._call("Invalidate", req).removed

    def watch_events(self, namespace_ids: Sequence[int] = (), *, max_events: int = 0) -> EventStream:
        """Streams what the tiers hold of the namespaces (none: every
        namespace): ALL_BLOCKS_CLEARED and a snapshot, then every change, in
        order (docs/events.md). The stream has no deadline; cancel it when
        done."""
        req = pb.WatchEventsRequest(namespace_ids=list(namespace_ids), max_events=max_events)
        return EventStream(self._stub.WatchEvents(req, timeout=None))

    def stats(self) -> Stats:
        """Tier use, namespaces and counters."""
        r = self._call("Stats", pb.StatsRequest())
        return Stats(
            tiers=tuple(TierStats(t.name, t.capacity_bytes, t.used_bytes, t.blocks) for t in r.tiers),
            namespaces=tuple(
                NamespaceStats(n.namespace_id, bytes(n.fingerprint), n.registrations, n.blocks) for n in r.namespaces
            ),
            lookups=r.lookups,
            lookup_hits=r.lookup_hits,
            blocks_stored=r.blocks_stored,
            blocks_loaded=r.blocks_loaded,
            blocks_failed=r.blocks_failed,
            evictions=r.evictions,
            version=r.version,
            protocol_version=r.protocol_version,
            min_protocol_version=r.min_protocol_version,
            disk_recovery=DiskRecovery(
                RecoveryState(r.disk_recovery.state)
                if r.disk_recovery.state in RecoveryState._value2member_map_
                else r.disk_recovery.state,
                r.disk_recovery.slots_total,
                r.disk_recovery.slots_scanned,
                r.disk_recovery.bytes_total,
                r.disk_recovery.bytes_scanned,
                r.disk_recovery.blocks_recovered,
                r.disk_recovery.bad_slots,
                r.disk_recovery.elapsed_ms,
            ),
        )
