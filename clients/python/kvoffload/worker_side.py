"""The worker half of the vLLM connector, free of vLLM.

vLLM's model runner calls it from its step loop; it never calls the daemon
from there. Each step's loads and stores become one batch queued for the
*sender* thread (one Load, one Store RPC per step). Each of those calls
also reads the jobs finished so far (the daemon returns them on the reply,
docs/api.md "Results on a Store or Load"), so a step that sends anything
needs no Completions call for its earlier jobs. The *poller* thread reads
Completions only when the sender will not bring results soon enough: a
load is in flight (a request waits for it), a caller blocks on a job
(``sync_stores``, a preemption, shutdown), a reply said more are queued,
no call has read results for ``poll_wait_ms`` (the engine sends nothing),
a job has gone a second without a result, or the daemon does not return
results on Store and Load. The step calls only take a lock and read or
queue.

A job's engine blocks go back to vLLM (a finished load, a drained store, a
failed block) only when nothing of the daemon can touch them any more:

- the daemon reported the job (Completions, or a Store or Load reply), or
- it refused the call that carried it (the whole call: nothing ran; but a
  daemon that refused it because it is stopping, and said so, gets the
  jobs sent to the next daemon instead, below), or
- the job was never sent (dropped from the queue), or
- the daemon said the registration is gone (NOT_FOUND) after draining it,
  and it was the same daemon process, or
- that daemon process has exited (a pidfd on it, see daemon_process.py).

A call that timed out or lost its connection may have been accepted, so
its jobs stay in flight until one of the above. A daemon that hangs
therefore holds the blocks of the jobs it had accepted: a step that
writes a block such a store reads (the plan's fence: vLLM gave it to a
request again, behind a sliding window or after a preemption) waits for
it before its loads and forward; a finished request with such stores
keeps its blocks (``request_finished``) — never is a block
reused while a copy from or into it may still run, and no step waits on a
store unless it reuses a block of it. Everything queued but
not sent when the daemon stops answering is dropped (stores) or failed
(loads, so vLLM recomputes), and nothing new is queued until it answers.

A daemon restart (its process exits, a new one serves the socket, with
registration ids from 1 again) is seen from the process itself: the poller
watches the registration's daemon (a pidfd, or its life file) every
``restart_watch_s`` even when nothing is in flight, and the sender looks
before each call. Once it exited, nothing is sent on its registration
again: the step's jobs wait in the queue while the worker registers its
regions again, as at start, with the next daemon to listen on the socket
(dropped, as for a daemon that is down, while none listens), and then go
to the new registration. A call the new daemon refused with NOT_FOUND (it
raced the exit) ran nothing: its jobs wait too. So do those of a call the
old daemon refused because it is stopping (UNAVAILABLE with its trailer
``kvoffload-refusal: daemon-stopping``, docs/api.md; never an UNAVAILABLE
without it, which may have been accepted): nothing is sent to that daemon
again, and once it exited they wait for the next one to listen, up to
``NEXT_DAEMON_WAIT_S`` (or the register timeout if shorter), before they
are dropped as above. The registration is made
only once no call on the old one is in progress: the old id may be the new
one's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ._version import __version__
from .client import Client, _socket_problem
from .daemon_process import DaemonProcess, daemon_pid, open_life, same_life as _same_life
from .errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVOffloadError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from .plan import GroupJob, StepPlan
from .regions import KVRegistration
from .stats import StatsRecorder
from .types import Job, JobResult, Op

__all__ = ["WorkerSide"]

log = logging.getLogger("kvoffload.worker")

# Seconds the jobs a stopping daemon refused wait, after it exited, for the
# next daemon to listen before they fail (at most the register timeout).
NEXT_DAEMON_WAIT_S = 2.0

# A whole call refused with these ran nothing.
_REFUSED = (InvalidArgument, FailedPrecondition, ResourceExhausted, PermissionDenied, NotFound)


@dataclass
class _Job:
    rid: str
    op: Op
    group: int
    block_ids: list[int]
    hashes: list[bytes]
    lease_id: int = 0
    seq: int = 0  # plan step of a store
    reg: int = 0  # the registration it was sent on (0: not sent)
    queued_at: float = 0.0
    sent_at: float = 0.0  # when the call that carried it returned (answered or not)
    stale: bool = False  # a load of an identity a cache reset retired: reported failed whatever it brings
    # Refused whole by a stopping daemon (nothing ran): it waits in the
    # queue for the next daemon, until ``hold_until`` once the old one exited.
    next_daemon: bool = False
    hold_until: float | None = None


@dataclass
class _Batch:
    op: Op
    jids: list[int]
    ready_event: bytes = b""


@dataclass
class _Reg:
    """A registration the daemon may still run jobs of."""

    id: int
    namespace_id: int
    daemon: DaemonProcess
    unreachable_since: float | None = None
    jobs: set[int] = field(default_factory=set)
    quiet: int = 0  # Completions answers in a row with nothing pending and nothing more
    loads: int = 0  # load jobs among ``jobs``
    more: bool = False  # the last reply that read results left some queued
    read_at: float = 0.0  # when a reply last read this registration's results
    retired: bool = False  # of an identity a cache reset left: unregistered once its jobs are done
    stopping: bool = False  # its daemon refused a call because it is stopping: nothing is sent on it again


class WorkerSide:
    """The worker half: one registration, one Load and one Store per step.

    Args:
        socket: the daemon's unix socket.
        fingerprint: this rank's namespace fingerprint.
        num_groups: KV cache groups of the model.
        rank: this worker's rank tuple, reported in store acknowledgements.
        request_level_failures: report a failed load as a failed request
            (``take_failed_requests``) instead of engine block ids.
        sync_stores: ``wait_for_save`` also waits until the step's stores
            are drained or dropped (never needed for safety: reused blocks
            are fenced; kept for compatibility).
        rpc_timeout_s: deadline of a Load or Store call on the sender thread
            (None: none; the call ends when the daemon answers or the
            connection breaks, so its outcome is never in doubt while the
            daemon runs).
        unknown_daemon_grace_s: when neither the daemon's pid (another pid
            namespace) nor its life file (``<socket>.life``, a daemon older
            than it) is visible, how long it must be unreachable before its
            jobs are taken as dead.
        poll_wait_ms: how long a Completions call waits for a result, and
            how long the poller leaves results to the sender's calls before
            reading Completions itself.
        piggyback: read finished results from the replies of the Store and
            Load calls (False: from Completions only, as before the daemon
            returned them there).
        restart_watch_s: how often the poller looks whether the
            registration's daemon process exited (a pidfd poll, no call),
            and, once it did, whether another listens on the socket yet.
    """

    def __init__(
        self,
        socket: str,
        fingerprint: bytes,
        num_groups: int,
        *,
        rank: tuple = (0,),
        client_name: str = "vllm worker",
        request_level_failures: bool = False,
        sync_stores: bool = False,
        client: Client | None = None,
        rpc_timeout_s: float | None = None,
        register_timeout_s: float = 10.0,
        poll_wait_ms: int = 50,
        suspect_after_s: float = 1.0,
        sync_queue_wait_s: float = 0.05,
        reregister_after_s: float = 1.0,
        unknown_daemon_grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        stats: StatsRecorder | None = None,
        pid_probe: Callable[[str], int | None] = daemon_pid,
        piggyback: bool = True,
        registration_key: bytes = b"",
        restart_watch_s: float = 0.02,
    ):
        self.fingerprint = bytes(fingerprint)
        # Registrations under the first fingerprint carry this key, so that
        # the scheduler can find the fingerprint in the daemon
        # (SchedulerSide.discover_workers); those of a later identity (a
        # cache reset) do not: the scheduler derives theirs.
        self.registration_key = bytes(registration_key)
        self._keyed_fingerprint = self.fingerprint
        self.num_groups = num_groups
        self.rank = tuple(rank)
        self.client_name = client_name
        self.request_level_failures = request_level_failures
        self.sync_stores = sync_stores
        self._socket = socket
        self._client = client or Client(socket, timeout=None)
        self._rpc_timeout = rpc_timeout_s
        self._register_timeout = register_timeout_s
        # How long jobs a stopping daemon refused wait, once it exited, for
        # the next one to listen: a restart's gap is usually well under it,
        # and waiting longer would cost the request more than recomputing.
        self._next_daemon_wait = min(register_timeout_s, NEXT_DAEMON_WAIT_S)
        self._poll_wait_ms = poll_wait_ms
        self._suspect_after = suspect_after_s
        self._sync_queue_wait = sync_queue_wait_s
        self._rereg_after = reregister_after_s
        self._watch = restart_watch_s
        self._unknown_grace = unknown_daemon_grace_s
        self._clock = clock
        self._pid_probe = pid_probe
        self.stats = stats or StatsRecorder()
        self._cv = threading.Condition()
        self._kv: KVRegistration | None = None
        self.refused: str | None = None  # registration refused for good
        self.registration_id: int | None = None
        self.namespace_id: int | None = None
        self._regs: dict[int, _Reg] = {}
        self._next_rereg = 0.0
        self._next_job = 1
        self._jobs: dict[int, _Job] = {}
        self._queue: deque[_Batch] = deque()
        self._send_started: float | None = None
        self._poll_started: float | None = None
        self._down_since: float | None = None  # a call failed: the daemon is not answering
        self._use_leases = True
        self._piggyback = piggyback
        self._piggy_seen = False  # a Store or Load reply has carried results or pending jobs
        self._waiters = 0  # callers blocked until jobs settle: the poller reads at once
        self._stale_after = 1.0  # a job this long without a result is polled for
        self._pending_loads: Counter[str] = Counter()
        self._pending_stores: Counter[str] = Counter()
        self._store_out: dict[str, Counter[int]] = {}
        self._store_seen: dict[str, int] = {}
        self._drain_dirty: set[str] = set()
        self._recv_done: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._report_blocks: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._failed_done: set[str] = set()
        self._await_send: set[str] = set()
        self._finished_seen: dict[str, int] = {}
        self._fenced_seq = -1  # the last plan whose fence was applied
        self.fence_waits = 0  # fences that found a store of a fenced block not yet done (and waited for it)
        self.fence_wait_s: list[float] = []  # how long each of those waited (the last 1024)
        self.fence_trimmed = 0  # blocks left out of stores not yet sent, for a fence
        # Registrations to Unregister (their jobs are done), each with the
        # daemon process that holds it: a daemon that restarted since holds
        # none of them, and its ids start again at 1 (they may name this
        # worker's new registration).
        self._retired: list[tuple[int, DaemonProcess]] = []
        self._retire_after = 0.0
        self._switching = False  # registering under a new identity: jobs wait in the queue, unsent
        # The registration's daemon exited (a restart): the next one on the
        # socket is registered with before anything is sent; jobs wait in
        # the queue meanwhile, or are dropped while no daemon listens.
        self._rejoin = False
        # The sender's call in progress: its registration and job ids.
        self._sending: tuple[_Reg, set[int]] | None = None
        self._calls = 0
        self._stop = False
        self._threads: list[threading.Thread] = []
        # Store acknowledgements are kept only for a vLLM that carries them
        # (worker metadata); the shell turns this off otherwise.
        self.track_drains = True

    # -- registration -----------------------------------------------------

    def register(self, kv: KVRegistration) -> bool:
        """Registers the worker's KV memory and starts the transfer threads.
        A refusal is logged, not raised: the engine runs on without
        offloading. The daemon being down is retried in the background."""
        self._kv = kv
        ok = self._register()
        if not self._threads and self.refused is None:
            for name, fn in (("kvoffload-sender", self._send_loop), ("kvoffload-poller", self._poll_loop)):
                t = threading.Thread(target=fn, name=name, daemon=True)
                t.start()
                self._threads.append(t)
        return ok

    def switch_identity(self, fingerprint: bytes) -> None:
        """A cache reset: from now on everything goes under ``fingerprint``.
        What is queued and not sent is dropped (stores) or failed (loads);
        loads in flight are reported failed when they settle, whatever they
        bring (their blocks are the old identity's); stores in flight land
        in the old namespace. The current registration is retired
        (unregistered once its jobs are done) and a new one is made under
        the new fingerprint on the poller thread: never on vLLM's loop.
        Until it is, the step's jobs wait in the queue, unsent (the
        scheduler offers no hits until every rank registered it)."""
        with self._cv:
            fp = bytes(fingerprint)
            if fp == self.fingerprint:
                return
            self.fingerprint = fp
            n = self._drop_queued(lambda j: True)
            stale = 0
            for j in self._jobs.values():
                if j.op == Op.LOAD and not j.stale:
                    j.stale = True
                    stale += 1
            old = self.registration_id
            if old is not None and old in self._regs:
                self._regs[old].retired = True
            self.registration_id = None
            self._switching = self._kv is not None and self.refused is None
            self._next_rereg = self._clock()
            self._cv.notify_all()
        log.info("kvoffload: cache reset: registering under the new identity (%d queued jobs dropped, %d loads in "
                 "flight will be reported failed)", n, stale)

    def _holding(self) -> bool:
        """Jobs wait in the queue for a registration being made."""
        return self._switching or self._rejoin

    def _end_switch_locked(self, registered: bool) -> None:
        """The registration under a new identity, or with a restarted
        daemon, is made (the queued jobs go), or failed (they are dropped,
        as with a daemon that is down)."""
        if not self._holding():
            return
        self._switching = False
        self._rejoin = False
        if not registered:
            self._drop_unsent_locked()
        self._cv.notify_all()

    def _unregister_retired(self) -> None:
        """Unregisters the retired registrations whose jobs are all done
        (the poller thread; a failure is retried on its next pass, and the
        connection closing at exit ends them anyway)."""
        with self._cv:
            for r in [r for r in self._regs.values() if r.retired and not r.jobs]:
                del self._regs[r.id]
                self._retired.append((r.id, r.daemon))
            todo, self._retired = self._retired, []
        keep = []
        for rid, proc in todo:
            if not self._still_serves(proc):
                # The daemon that held it is gone, and the registration with
                # it: the id is not sent to the one answering now.
                log.info("kvoffload: retired registration %d went with its daemon", rid)
                proc.close()
                continue
            try:
                self._client.unregister(rid, timeout=self._register_timeout)
            except NotFound:
                pass
            except KVOffloadError as e:
                log.info("kvoffload: Unregister of retired registration %d: %s", rid, e)
                keep.append((rid, proc))
                continue
            proc.close()
        if keep:
            with self._cv:
                self._retired.extend(keep)

    def _still_serves(self, proc: DaemonProcess) -> bool:
        """Whether the daemon answering on the socket may be ``proc`` (True
        when that cannot be told: neither pid nor life file known)."""
        if proc.exited():
            return False
        if proc.pid is not None:
            pid = self._pid_probe(self._socket)
            return pid is None or pid == proc.pid  # None: nobody answers (the call fails, kept)
        return proc.serves(self._socket) or not proc.known

    def _register(self, wait: bool = False) -> bool:
        """Registers the worker's regions under the current identity.
        ``wait``: a call made while the connection is down waits for it (a
        daemon that just started listening), up to the register timeout."""
        kv = self._kv
        if kv is None or self.refused is not None:
            return False
        with self._cv:
            fingerprint = self.fingerprint
        life = None
        for attempt in range(3):
            if life is not None:
                os.close(life)
            pid = self._pid_probe(self._socket)
            life = open_life(self._socket)
            try:
                key = self.registration_key if fingerprint == self._keyed_fingerprint else b""
                kw: dict[str, Any] = {"wait_for_ready": True} if wait else {}
                reg = self._client.register(fingerprint, kv.layout, kv.regions, self.client_name,
                                            timeout=self._register_timeout, registration_key=key, **kw)
            except (InvalidArgument, FailedPrecondition, PermissionDenied) as e:
                if life is not None:
                    os.close(life)
                self.refused = str(e)
                log.error("kvoffload: the daemon refused this worker's KV caches (%s); offloading is off for this "
                          "engine", e)
                with self._cv:
                    self._end_switch_locked(False)
                return False
            except KVOffloadError as e:
                if life is not None:
                    os.close(life)
                log.warning("kvoffload: Register failed (%s); retrying in the background", e)
                with self._cv:
                    self._next_rereg = self._clock() + self._rereg_after
                    self._end_switch_locked(False)
                return False
            if self._pid_probe(self._socket) == pid and _same_life(life, self._socket):
                break
            # The daemon restarted between the probe and the call (or the
            # life file was the last daemon's: a new one listens before it
            # replaces the file): the registration may belong to either.
            # Let go of it (a new daemon's is this connection's only one
            # there; the old one's went with it: NOT_FOUND) and make
            # another.
            if attempt == 2:
                break  # (kept: the third time running, a daemon restarting that often)
            log.info("kvoffload: the daemon restarted during Register; registering again")
            try:
                self._client.unregister(reg.registration_id, timeout=self._register_timeout)
            except KVOffloadError:
                pass  # the old daemon's, gone with it
        with self._cv:
            if fingerprint != self.fingerprint:
                # A cache reset moved the identity on during the call: this
                # registration is of the old one.
                self._retired.append((reg.registration_id, DaemonProcess(pid, life)))
                self._cv.notify_all()
                return False
            self.registration_id, self.namespace_id = reg.registration_id, reg.namespace_id
            self._regs[reg.registration_id] = _Reg(reg.registration_id, reg.namespace_id, DaemonProcess(pid, life))
            life = None
            self._down_since = None
            self._end_switch_locked(True)
            self._cv.notify_all()
        log.info("kvoffload: registered %d regions (%s) as registration %d in namespace %d%s (daemon pid %s; "
                 "kvoffloadd %s, kvoffload %s, API protocol %d)",
                 len(kv.regions), kv.device, reg.registration_id, reg.namespace_id,
                 " (joined existing)" if reg.joined_existing else "", pid,
                 reg.daemon_version or "(unknown version)", __version__, reg.protocol_version)
        return True

    # -- bookkeeping (callers hold self._cv) -----------------------------------

    def _new_job(self, rid: str, op: Op, gj: GroupJob, seq: int = 0) -> int:
        jid = self._next_job
        self._next_job += 1
        self._jobs[jid] = _Job(rid, op, gj.group, list(gj.block_ids), list(gj.hashes), gj.lease_id, seq,
                               queued_at=self._clock())
        if op == Op.LOAD:
            self._pending_loads[rid] += 1
        else:
            self._pending_stores[rid] += 1
            self._store_out.setdefault(rid, Counter())[seq] += 1
        return jid

    def _settle(self, jid: int, result: JobResult | None = None, *, failed_all: bool = False,
                dropped: bool = False) -> None:
        """The job's blocks are vLLM's again: it finished, failed whole, or was never sent."""
        j = self._jobs.pop(jid, None)
        if j is None:
            return
        if j.reg and j.reg in self._regs:
            r = self._regs[j.reg]
            if jid in r.jobs:
                r.jobs.discard(jid)
                if j.op == Op.LOAD:
                    r.loads -= 1
        took = self._clock() - j.queued_at
        if j.op == Op.LOAD:
            failed = (list(j.block_ids) if failed_all or dropped or result is None or j.stale
                      else result.failed_block_ids)
            if failed:
                self._failed_reqs.add(j.rid)
                self._failed_blocks.update(failed)
                why = "not sent" if dropped else ("whole job" if result is None else
                                                  sorted({f.status.name for f in result.failures}))
                log.info("kvoffload: request %s: %d blocks failed to load (%s)", j.rid, len(failed), why)
            self.stats.transfer(True, took, len(j.block_ids) - len(failed), result.bytes if result else 0,
                                _failure_counts(result, len(failed), dropped))
            self._pending_loads[j.rid] -= 1
            if self._pending_loads[j.rid] <= 0:
                del self._pending_loads[j.rid]
                self._recv_done.add(j.rid)
        else:
            nfail = len(j.block_ids) if failed_all or dropped or result is None else len(result.failures)
            if dropped:
                self.stats.stores_skipped(len(j.block_ids))
            else:
                self.stats.transfer(False, took, len(j.block_ids) - nfail, result.bytes if result else 0,
                                    _failure_counts(result, nfail, False))
            self._pending_stores[j.rid] -= 1
            if self._pending_stores[j.rid] <= 0:
                del self._pending_stores[j.rid]
            out = self._store_out.get(j.rid)
            if out is not None:
                out[j.seq] -= 1
                if out[j.seq] <= 0:
                    del out[j.seq]
                if not out:
                    del self._store_out[j.rid]
            if self.track_drains:
                self._drain_dirty.add(j.rid)
        self._cv.notify_all()

    def _lose_registration(self, reg: _Reg, why: str, superseded: bool = False) -> None:
        """Nothing of this registration runs any more: settle its jobs (but
        those of the sender's call in progress: the sender settles them
        when it returns). When it was the current registration and its
        daemon exited (a restart), or another one refused it with nothing of
        it left in flight (``superseded``), the worker registers with the
        next one before it sends anything (``_rejoin``)."""
        sending = self._sending[1] if self._sending is not None and self._sending[0] is reg else set()
        jobs = sorted(reg.jobs - sending)
        if jobs:
            log.warning("kvoffload: registration %d is gone (%s); %d jobs in flight reported failed", reg.id, why,
                        len(jobs))
        for jid in jobs:
            self._settle(jid, failed_all=True)
        exited = reg.daemon.exited()
        reg.daemon.close()
        current = self.registration_id is not None and self._regs.get(self.registration_id) is reg
        if self._regs.get(reg.id) is reg:
            del self._regs[reg.id]
        if current:
            self.registration_id = None
            if (exited or superseded) and self._kv is not None and self.refused is None and not self._stop:
                log.info("kvoffload: the daemon that held registration %d (pid %s) %s: registering with the next "
                         "one on the socket before sending it anything", reg.id, reg.daemon.pid,
                         "exited" if exited else "no longer serves the socket")
                self._rejoin = True
                self._down_since = None  # that process is gone; whether another answers is probed anew
                # The jobs that daemon refused as it stopped wait for the
                # next one on the socket, for as long as a Register waits.
                for b in self._queue:
                    for jid in b.jids:
                        j = self._jobs.get(jid)
                        if j is not None and j.next_daemon and j.hold_until is None:
                            j.hold_until = self._clock() + self._next_daemon_wait
                self._next_rereg = self._clock()
            else:
                self._next_rereg = self._clock() + self._rereg_after
        self._cv.notify_all()

    def _watch_exits_locked(self) -> None:
        """Loses the registrations whose daemon process exited (a pidfd
        poll or a lock try each, no call)."""
        for r in list(self._regs.values()):
            if self._regs.get(r.id) is r and r.daemon.exited():
                self._lose_registration(r, "the daemon process exited")

    def _suspect(self) -> bool:
        """The daemon is not answering: a call failed, or has run too long."""
        now = self._clock()
        if self._down_since is not None:
            return True
        if self._send_started is not None and now - self._send_started > self._suspect_after:
            return True
        return (self._poll_started is not None
                and now - self._poll_started > self._suspect_after + self._poll_wait_ms / 1000.0)

    def _drop_queued(self, pred: Callable[[_Job], bool]) -> int:
        """Takes the jobs ``pred`` picks out of the unsent batches: they never ran."""
        n = 0
        for b in self._queue:
            keep = []
            for jid in b.jids:
                j = self._jobs.get(jid)
                if j is not None and pred(j):
                    self._settle(jid, dropped=True)
                    n += 1
                elif j is not None:
                    keep.append(jid)
            b.jids = keep
        self._queue = deque(b for b in self._queue if b.jids)
        return n

    # -- the sender thread -------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._queue or self._holding()):
                    self._cv.wait()
                if self._stop:
                    return
                batch = self._queue.popleft()
                reg = self._regs.get(self.registration_id) if self.registration_id is not None else None
                if reg is not None and reg.daemon.exited():
                    # A restart: never a call on the old registration (its
                    # id may name another in the new daemon). The batch
                    # waits for the registration with the next one.
                    self._queue.appendleft(batch)
                    self._lose_registration(reg, "the daemon process exited")
                    continue
                if reg is not None and reg.stopping:
                    # Its daemon stops and refuses new work: the batch
                    # waits for it to exit (the poller watches), and then
                    # for the registration with the next one.
                    self._queue.appendleft(batch)
                    self._cv.wait(self._watch)
                    continue
                jobs = [(jid, self._jobs[jid]) for jid in batch.jids if jid in self._jobs]
                if reg is None or self._down_since is not None:
                    for jid, _ in jobs:
                        self._settle(jid, dropped=True)
                    continue
                for jid, j in jobs:
                    j.reg = reg.id
                    reg.jobs.add(jid)
                    if j.op == Op.LOAD:
                        reg.loads += 1
                self._send_started = self._clock()
                self._sending = (reg, {jid for jid, _ in jobs})
                # Its reply reads the results: the poller leaves them to it
                # unless the call takes longer than poll_wait_ms.
                reg.read_at = self._send_started
                use_leases = self._use_leases
            if jobs:
                self._send(batch, reg, jobs, use_leases)
            with self._cv:
                self._send_started = None
                self._sending = None
                self._cv.notify_all()

    def _send(self, batch: _Batch, reg: _Reg, jobs: list[tuple[int, _Job]], use_leases: bool) -> None:
        def wire(leases: bool) -> list[Job]:
            return [Job(job_id=jid, hashes=j.hashes, block_ids=j.block_ids, group=j.group,
                        request_id=_wire_request_id(j.rid), lease_id=j.lease_id if leases else 0) for jid, j in jobs]

        call = self._client.load if batch.op == Op.LOAD else self._client.store
        # No deadline, and wait for the connection rather than fail unsent:
        # the call ends when the daemon answered or the connection broke.
        kw: dict[str, Any] = {"timeout": self._rpc_timeout, "wait_for_ready": True}
        if batch.ready_event:
            kw["ready_event"] = batch.ready_event
        with self._cv:
            kw["completions"] = self._piggyback
        try:
            try:
                reply = call(reg.id, wire(use_leases), **kw)
            except (PermissionDenied, FailedPrecondition, InvalidArgument) as e:
                if not use_leases or not any(j.lease_id for _, j in jobs) or "lease" not in e.message.lower():
                    raise
                # Leases are refused here (another connection took them):
                # the blocks are loaded without, as before leases existed.
                log.warning("kvoffload: the daemon refuses the scheduler's leases (%s); loading without them", e)
                with self._cv:
                    self._use_leases = False
                reply = call(reg.id, wire(False), **kw)
            if reply is not None:
                with self._cv:
                    self._take_reply(reg, len(jobs), reply)
        except NotFound as e:
            same = self._same_daemon(reg)  # a socket probe: not under the lock
            with self._cv:
                others = reg.jobs - {jid for jid, _ in jobs}
                if not same and (reg.daemon.exited() or not others):
                    # A restart raced the call, or overlaps it (the old
                    # process still tears down, its connections closed, and
                    # holds nothing of this registration in flight): the
                    # daemon that answers refused the call whole (nothing
                    # ran) and the registration is gone with the old one.
                    # The jobs wait for the registration with the new one.
                    if self._regs.get(reg.id) is reg:
                        self._lose_registration(reg, str(e), superseded=True)
                    if self._rejoin:
                        self._requeue_locked(batch, reg, jobs)
                    else:
                        for jid, _ in jobs:
                            self._settle(jid, failed_all=True)
                else:
                    for jid, _ in jobs:
                        self._settle(jid, failed_all=True)
                    # The same process drained it.
                    if self._regs.get(reg.id) is reg and same:
                        self._lose_registration(reg, str(e))
        except _REFUSED as e:
            log.error("kvoffload: %s of %d jobs refused (%s); their blocks are reported failed",
                      batch.op.name.title(), len(jobs), e)
            with self._cv:
                for jid, _ in jobs:
                    self._settle(jid, failed_all=True)
        except Unavailable as e:
            if not e.daemon_stopping:
                self._unanswered(batch, reg, jobs, e)
                return
            # The daemon is stopping and refused the call whole (its
            # trailer says so; a transport failure never does): nothing
            # ran. The jobs wait for the next daemon, as after a restart.
            log.info("kvoffload: %s of %d jobs refused by the stopping daemon (pid %s); they wait for the next one",
                     batch.op.name.title(), len(jobs), reg.daemon.pid)
            with self._cv:
                reg.stopping = True
                gone = self._regs.get(reg.id) is not reg  # it exited meanwhile: the next one is joined now
                for jid, j in jobs:
                    if self._jobs.get(jid) is j:
                        j.next_daemon = True
                        if gone:
                            j.hold_until = self._clock() + self._next_daemon_wait
                self._requeue_locked(batch, reg, jobs)
        except (DeadlineExceeded, Cancelled, KVOffloadError) as e:
            self._unanswered(batch, reg, jobs, e)
        finally:
            with self._cv:
                now = self._clock()
                for jid, j in jobs:
                    j.sent_at = now
                reg.quiet = 0
                if self._regs.get(reg.id) is reg and reg.daemon.exited():
                    self._lose_registration(reg, "the daemon process exited")
                if self._regs.get(reg.id) is not reg:
                    # Lost while the call ran (its daemon exited, or drained
                    # it): nothing runs this call's jobs any more.
                    for jid, j in jobs:
                        if self._jobs.get(jid) is j and j.reg == reg.id:
                            self._settle(jid, failed_all=True)

    def _unanswered(self, batch: _Batch, reg: _Reg, jobs: list[tuple[int, _Job]], e: KVOffloadError) -> None:
        """The daemon may have accepted the call: the jobs stay in flight
        until the daemon reports them, forgets the registration, or exits."""
        if not self._stop:
            log.warning("kvoffload: %s of %d jobs: no answer (%s); waiting for the daemon to settle them",
                        batch.op.name.title(), len(jobs), e)
        with self._cv:
            if self._regs.get(reg.id) is reg and not reg.daemon.exited():
                if self._down_since is None:
                    self._down_since = self._clock()
                self._drop_unsent_locked()

    def _requeue_locked(self, batch: _Batch, reg: _Reg, jobs: list[tuple[int, _Job]]) -> None:
        """Puts a call's jobs back at the head of the queue: the daemon
        refused the call whole, so none of them ran."""
        jids = []
        for jid, j in jobs:
            if self._jobs.get(jid) is not j:
                continue
            if jid in reg.jobs:
                reg.jobs.discard(jid)
                if j.op == Op.LOAD:
                    reg.loads -= 1
            j.reg = 0
            jids.append(jid)
        if jids:
            self._queue.appendleft(_Batch(batch.op, jids, batch.ready_event))
            self._cv.notify_all()

    def _take_reply(self, reg: _Reg, sent: int, c: Any) -> None:
        """Settles the finished jobs a Store or Load reply carried (the
        daemon's results after the cursor, as Completions would return
        them; a result read twice settles once)."""
        if not c.results and not c.pending and not c.more and sent and not self._piggy_seen:
            # This call's jobs are neither pending nor finished on the
            # reply, and no reply ever carried anything: the daemon does
            # not return results on Store and Load (an older one).
            # Completions brings them, as before. (A daemon that does can
            # answer so only if a Completions read and acknowledged the
            # call's results while it ran: never on every reply.)
            log.info("kvoffload: the daemon returns no results on Store and Load; reading them from Completions")
            self._piggyback = False
            self._cv.notify_all()
            return
        self._piggy_seen = self._piggy_seen or bool(c.results or c.pending or c.more)
        reg.more = c.more
        reg.read_at = self._clock()
        for r in c.results:
            self._settle(r.job_id, r)
        self._cv.notify_all()

    def _due_locked(self, now: float) -> tuple[list[_Reg], float | None]:
        """The registrations whose results the poller must read now from
        Completions, and, when none, how long until one may be due."""
        due: list[_Reg] = []
        wake: float | None = None
        idle = self._poll_wait_ms / 1000.0
        for r in self._regs.values():
            if not r.jobs:
                continue
            if (not self._piggyback or r.id != self.registration_id or r.more or r.loads or self._waiters
                    or self._down_since is not None or now - r.read_at >= idle):
                due.append(r)
                continue
            oldest = min((self._jobs[j].sent_at for j in r.jobs if j in self._jobs and self._jobs[j].sent_at > 0),
                         default=None)
            if oldest is not None and now - oldest >= self._stale_after:
                due.append(r)
                continue
            left = r.read_at + idle - now
            if oldest is not None:
                left = min(left, oldest + self._stale_after - now)
            wake = left if wake is None else min(wake, left)
        return due, wake

    def _drop_unsent_locked(self) -> None:
        """The daemon stopped answering: what is queued is dropped (stores)
        or failed (loads: vLLM recomputes), never sent late. Jobs a stopping
        daemon refused wait for the next daemon: while the old one runs,
        and for ``NEXT_DAEMON_WAIT_S`` after it exited."""
        now = self._clock()
        n = self._drop_queued(lambda j: not j.next_daemon or (j.hold_until is not None and now >= j.hold_until))
        if n:
            log.warning("kvoffload: the daemon is not answering; %d queued jobs dropped", n)

    def _same_daemon(self, reg: _Reg) -> bool:
        """Whether the daemon answering on the socket is the process that
        holds the registration (its NOT_FOUND then means drained)."""
        if reg.daemon.pid is not None:
            return self._pid_probe(self._socket) == reg.daemon.pid
        return reg.daemon.serves(self._socket)

    # -- the poller thread ---------------------------------------------------------

    def _poll_loop(self) -> None:
        while True:
            with self._cv:
                if self._stop:
                    return
                self._watch_exits_locked()
                for r in [r for r in self._regs.values()
                          if not r.jobs and r.id != self.registration_id and not r.retired]:
                    r.daemon.close()  # an old registration with nothing left in flight
                    del self._regs[r.id]
                retire = self._clock() >= self._retire_after and (
                    bool(self._retired) or any(r.retired and not r.jobs for r in self._regs.values()))
            if retire:
                self._unregister_retired()
                with self._cv:
                    if self._retired:
                        self._retire_after = self._clock() + 1.0
                continue
            with self._cv:
                if self._stop:
                    return
                regs, wake = self._due_locked(self._clock())
                need_reg = (self.registration_id is None and self._kv is not None and self.refused is None
                            and self._clock() >= self._next_rereg)
                probe = not regs and not need_reg and self._down_since is not None
                if not regs and not need_reg and not probe:
                    timeout = None
                    if self.registration_id is None and self._kv is not None and self.refused is None:
                        timeout = max(0.01, self._next_rereg - self._clock())
                    if wake is not None:
                        # Results are left to the sender's next call for
                        # a while; then Completions reads them.
                        timeout = max(0.001, wake) if timeout is None else min(timeout, max(0.001, wake))
                    if self._regs:
                        # Watch for a daemon that exits (a restart) while
                        # nothing is in flight.
                        timeout = self._watch if timeout is None else min(timeout, self._watch)
                    self._cv.wait(timeout if timeout is not None else 1.0)
                    continue
            if need_reg and self._rejoin:
                self._rejoin_step()
                continue
            if need_reg:
                if not self._register():
                    with self._cv:
                        # (A registration a cache reset overtook is made
                        # again at once: _next_rereg has not moved.)
                        left = self._next_rereg - self._clock()
                        if left > 0:
                            self._cv.wait(left)
                continue
            if probe:
                # Nothing in flight to poll: ask the daemon's health until it answers.
                try:
                    ok = self._client.healthy(timeout=1.0)
                except KVOffloadError:
                    ok = False
                with self._cv:
                    if ok:
                        self._down_since = None
                    else:
                        self._cv.wait(0.2)
                continue
            for reg in regs:
                self._poll_one(reg, self._poll_wait_ms if len(regs) == 1 and not reg.more else 0)

    def _rejoin_step(self) -> None:
        """Registers with the daemon that serves the socket after a restart,
        once one listens (the poller thread). While none does, the jobs
        queued meanwhile are dropped, as for a daemon that is down."""
        listening = _socket_problem(self._socket) is None
        with self._cv:
            if self._stop or not self._rejoin:
                return
            if not listening:
                self._drop_unsent_locked()
                self._cv.wait(self._watch)
                return
            if self._sending is not None:
                # A call on the old registration is in progress (the
                # daemon that answers it refuses it NOT_FOUND): its id may
                # be the new registration's. It ends first.
                self._cv.wait(self._watch)
                return
        self._register(wait=True)

    def _poll_one(self, reg: _Reg, wait_ms: int) -> None:
        with self._cv:
            self._poll_started = self._clock()
        try:
            c = self._client.completions(reg.id, wait_ms=wait_ms)
        except NotFound as e:
            same = self._same_daemon(reg)  # a socket probe: not under the lock
            with self._cv:
                self._poll_started = None
                if reg.id not in self._regs:
                    return
                if reg.daemon.exited() or same:
                    self._lose_registration(reg, f"{e.message}; drained")
                else:
                    # Another daemon answers: the registration's may still be
                    # draining. Wait for it to exit.
                    self._cv.wait(0.05)
            return
        except KVOffloadError as e:
            with self._cv:
                self._poll_started = None
                if self._down_since is None and not self._stop:
                    self._down_since = self._clock()
                    self._drop_unsent_locked()
                now = self._clock()
                if reg.unreachable_since is None:
                    reg.unreachable_since = now
                if reg.daemon.exited():
                    self._lose_registration(reg, "the daemon process exited")
                elif not reg.daemon.known and now - reg.unreachable_since >= self._unknown_grace:
                    self._lose_registration(reg, f"the daemon (pid unknown) unreachable for {self._unknown_grace:.0f}s")
                elif not self._stop:
                    if not isinstance(e, (Unavailable, DeadlineExceeded, Cancelled)):
                        log.warning("kvoffload: Completions failed (%s)", e)
                    self._cv.wait(0.02)
            return
        with self._cv:
            self._poll_started = None
            self._down_since = None
            reg.unreachable_since = None
            reg.more = c.more
            reg.read_at = self._clock()
            for r in c.results:
                self._settle(r.job_id, r)
            self._settle_orphans(reg, c)

    def _settle_orphans(self, reg: _Reg, c: Any) -> None:
        """The registration's daemon, running and answering, has nothing
        pending and no result left for it: every job whose call returned (a
        while ago, and the daemon answered twice since) and that it never
        reported ran already or never arrived (a call that failed unsent, a
        result an older daemon lost). Nothing copies into or out of its
        blocks: it is reported failed."""
        if c.pending or getattr(c, "more", False):
            reg.quiet = 0
            return
        reg.quiet += 1
        if reg.quiet < 2:
            return
        now = self._clock()
        stale = [jid for jid in reg.jobs if jid in self._jobs and 0 < self._jobs[jid].sent_at <= now - 1.0]
        if stale:
            log.warning("kvoffload: registration %d: the daemon holds nothing for %d jobs it never reported; "
                        "reported failed", reg.id, len(stale))
        for jid in stale:
            self._settle(jid, failed_all=True)

    # -- vLLM's worker-side calls -------------------------------------------

    def handle_preemptions(self, preempted: Iterable[str]) -> None:
        """vLLM is about to free these requests' blocks: their stores not
        yet sent are dropped (the scheduler plans them again as vLLM
        recomputes them). Those sent are left to run: a step that gives one
        of their blocks to a request again names it in its fence."""
        victims = set(preempted or ())
        if not victims:
            return
        with self._cv:
            self._drop_queued(lambda j: j.rid in victims and j.op == Op.STORE)

    def apply_fence(self, plan: StepPlan) -> None:
        """Before the step's loads and forward write the plan's fenced
        blocks, this worker's stores of them must be done: one the daemon
        accepted is waited for; one still queued is given the sender's
        usual moment to go out (``sync_queue_wait_s``, while the daemon
        answers) and then waited for too, or, if it is still queued, leaves
        those blocks out (their bytes are about to change). The only place
        a step waits on a store (besides ``sync_stores``). Once per plan."""
        fence = getattr(plan, "fence", None)
        with self._cv:
            if plan.seq and plan.seq == self._fenced_seq:
                return
            self._fenced_seq = plan.seq
            if not fence or not self._jobs:
                return
            blocks = set(fence)
            mine = {jid for jid, j in self._jobs.items() if j.op == Op.STORE and not blocks.isdisjoint(j.block_ids)}
            if not mine:
                return
            t0 = self._clock()
            self.fence_waits += 1

            def queued() -> set[int]:
                return mine & {jid for b in self._queue if b.op == Op.STORE for jid in b.jids}

            if queued() and not self._suspect():
                self._cv.wait_for(lambda: not queued(), self._sync_queue_wait)
            for jid in queued():
                mine.discard(jid)
                j = self._jobs.get(jid)
                if j is None:
                    continue
                keep = [(h, bid) for h, bid in zip(j.hashes, j.block_ids) if bid not in blocks]
                self.fence_trimmed += len(j.block_ids) - len(keep)
                self.stats.stores_skipped(len(j.block_ids) - len(keep))
                if keep:
                    j.hashes, j.block_ids = [h for h, _ in keep], [bid for _, bid in keep]
                else:
                    self._drop_queued(lambda x, j=j: x is j)
            self._wait_locked(lambda: mine.isdisjoint(self._jobs.keys()),
                              f"{len(mine)} stores of blocks this step reuses")
            self.fence_wait_s.append(self._clock() - t0)
            del self.fence_wait_s[:-1024]

    def _wait_locked(self, done: Callable[[], bool], what: str) -> None:
        """Waits, with no deadline, for copies that may still read or write
        blocks vLLM is about to reuse. Only a daemon that stopped answering
        with those jobs accepted makes this wait long; it is logged."""
        t0 = self._clock()
        warned = t0
        self._waiters += 1
        self._cv.notify_all()  # the poller reads Completions while a caller blocks
        try:
            while not done():
                self._cv.wait(0.5)
                now = self._clock()
                if now - warned >= 5.0:
                    warned = now
                    log.warning("kvoffload: waiting %.0fs for %s: the daemon accepted them and has not finished",
                                now - t0, what)
        finally:
            self._waiters -= 1

    def start_load_kv(self, plan: StepPlan, ready_event: bytes = b"") -> list[int]:
        """Queues every load of the step as one Load. ``ready_event`` (CUDA)
        is recorded on the engine's stream now: the copies wait for it.
        Returns the job ids queued."""
        self.apply_fence(plan)
        with self._cv:
            self._await_send |= plan.delay_free
            if not plan.loads:
                return []
            jids: list[int] = []
            for rid, gjobs in plan.loads.items():
                real = [gj for gj in gjobs if gj.hashes]
                for gj in gjobs:
                    if not gj.hashes and gj.block_ids:
                        # Planned without keys: fail those blocks.
                        self._failed_blocks.update(gj.block_ids)
                        self._failed_reqs.add(rid)
                if not real:
                    self._recv_done.add(rid)
                    continue
                jids.extend(self._new_job(rid, Op.LOAD, gj) for gj in real)
            if not jids:
                return []
            if (self.registration_id is None and not self._holding()) or self._suspect():
                for jid in jids:
                    self._settle(jid, dropped=True)
                return []
            self._queue.append(_Batch(Op.LOAD, jids, ready_event))
            self._cv.notify_all()
            return jids

    def wait_for_save(self, plan: StepPlan, ready_event: bytes = b"") -> list[int]:
        """Queues every store of the step as one Store (after the forward pass
        wrote the blocks; on CUDA ``ready_event`` orders the copies after it).
        Returns the job ids (see :meth:`jobs_done`)."""
        with self._cv:
            if not plan.stores:
                return []
            jids = [self._new_job(rid, Op.STORE, gj, plan.seq) for rid, gjobs in plan.stores.items() for gj in gjobs]
            for rid in plan.stores:
                self._store_seen[rid] = max(self._store_seen.get(rid, 0), plan.seq)
            if (self.registration_id is None and not self._holding()) or self._suspect():
                for jid in jids:
                    self._settle(jid, dropped=True)
                return []
            batch = _Batch(Op.STORE, jids, ready_event)
            self._queue.append(batch)
            self._cv.notify_all()
            if self.sync_stores:
                ids = set(jids)

                def queued() -> bool:
                    return any(b is batch for b in self._queue)

                self._cv.wait_for(lambda: not queued() or not (ids & self._jobs.keys()), self._sync_queue_wait)
                if queued():
                    # Not sent yet (the sender is stuck on the daemon): never
                    # send it, vLLM may reuse these blocks from the next step.
                    self._drop_queued(lambda j: j.seq == plan.seq and j.op == Op.STORE)
                self._wait_locked(lambda: not (ids & self._jobs.keys()), "the step's stores (sync_stores)")
            return jids

    def jobs_done(self, job_ids: Iterable[int]) -> bool:
        """True when none of ``job_ids`` is still in flight."""
        with self._cv:
            return not any(j in self._jobs for j in job_ids)

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        """No RPC. Returns (finished sending, finished receiving): requests
        vLLM kept for their stores whose stores are all drained or dropped,
        and requests whose loads all finished (failed ones included; their
        failed blocks are in ``get_block_ids_with_load_errors``)."""
        with self._cv:
            self._calls += 1
            for rid in finished_req_ids or ():
                self._finished_seen[rid] = self._calls
            recving, self._recv_done = self._recv_done, set()
            # A finished request's blocks go back to vLLM with its finished
            # receive: not while a store of it may still read them.
            held = {r for r in recving if r in self._finished_seen and self._pending_stores.get(r)}
            if held:
                recving -= held
                self._recv_done |= held
            self._failed_done |= self._failed_reqs & recving
            self._failed_reqs -= recving
            # Failed blocks go out no later than their request's finished
            # receive: in this very pass (vLLM reads them right after).
            self._report_blocks |= self._failed_blocks
            self._failed_blocks = set()
            sending = {r for r in self._await_send if r in self._finished_seen and not self._pending_stores.get(r)}
            self._await_send -= sending
            for r in sending:
                self._finished_seen.pop(r, None)
            stale = [r for r, n in self._finished_seen.items()
                     if r not in self._await_send and not self._pending_stores.get(r) and self._calls - n > 64]
            for r in stale:
                del self._finished_seen[r]
                self._store_seen.pop(r, None)
            return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine block ids whose load failed, as of the last get_finished
        (empty in request-level mode, where ``take_failed_requests`` reports
        them)."""
        with self._cv:
            blocks, self._report_blocks = self._report_blocks, set()
            return set() if self.request_level_failures else blocks

    def take_failed_requests(self) -> set[str]:
        """Requests reported finished receiving (by :meth:`get_finished`) with
        at least one block that failed to load, since the last call (always
        empty unless ``request_level_failures``)."""
        with self._cv:
            reqs, self._failed_done = self._failed_done, set()
            return reqs if self.request_level_failures else set()

    def drained_stores(self) -> dict[str, dict[tuple, int]]:
        """Per request whose stores changed since the last call, the last plan
        step up to which all its stores have drained (or were dropped):
        vLLM's worker metadata carries it to the scheduler."""
        with self._cv:
            out = {}
            for rid in self._drain_dirty:
                seen = self._store_seen.get(rid, 0)
                outstanding = self._store_out.get(rid)
                out[rid] = {self.rank: (min(outstanding) - 1) if outstanding else seen}
            self._drain_dirty = set()
            return out

    def registered(self) -> bool:
        with self._cv:
            return self.registration_id is not None

    def pending(self) -> int:
        with self._cv:
            return len(self._jobs)

    def suspect(self) -> bool:
        with self._cv:
            return self._suspect()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Waits a little for jobs in flight, unregisters and stops the threads."""
        with self._cv:
            self._drop_queued(lambda j: True)
            self._waiters += 1
            self._cv.notify_all()
            try:
                self._cv.wait_for(lambda: not self._jobs, timeout_s)
            finally:
                self._waiters -= 1
            reg = self.registration_id
        if reg is not None:
            try:
                self._client.unregister(reg, timeout=timeout_s)
            except KVOffloadError as e:
                log.info("kvoffload: Unregister: %s", e)
        with self._cv:
            self._stop = True
            self.registration_id = None
            self._cv.notify_all()
        self._client.close()  # cancels a call a thread is blocked in
        for t in self._threads:
            t.join(timeout_s)
        with self._cv:
            for r in list(self._regs.values()):
                r.daemon.close()
            self._regs.clear()
            for _, proc in self._retired:
                proc.close()
            self._retired = []


# The daemon bounds request_id (it only echoes it; jobs are matched by id).
MAX_REQUEST_ID_BYTES = 512


def _wire_request_id(rid: str) -> str:
    """``rid``, or for a longer one its head and a hash of the whole: within
    the bound, and two long ids that share a head still read apart in the
    daemon's logs and results."""
    raw = rid.encode()
    if len(raw) <= MAX_REQUEST_ID_BYTES:
        return rid
    tag = "#" + hashlib.sha256(raw).hexdigest()[:16]
    return raw[:MAX_REQUEST_ID_BYTES - len(tag)].decode(errors="ignore") + tag


def _failure_counts(result: JobResult | None, nfail: int, dropped: bool) -> dict[str, int]:
    if dropped:
        return {"NOT_SENT": nfail} if nfail else {}
    if result is None:
        return {"CALL_FAILED": nfail} if nfail else {}
    c: Counter[str] = Counter(f.status.name if hasattr(f.status, "name") else str(f.status) for f in result.failures)
    return dict(c)
