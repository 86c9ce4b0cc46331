"""Jobs the daemon may still run are never handed back to vLLM early.

A registration's jobs settle only when the daemon reports them, says the
registration is gone after draining it (NOT_FOUND from the same process), or
that process has exited. An unreachable or hung daemon, or another daemon
answering on the socket, settles nothing: the old one may still copy."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

import kvoffload as kv
from kvoffload.daemon_process import DaemonProcess
from kvoffload.plan import GroupJob
from kvoffload.types import Completions, JobResult, Op
from kvoffload.worker_side import WorkerSide, _Reg


class StubClient:
    """Answers Completions from a script: an exception to raise, or results."""

    def __init__(self, script):
        self.script = list(script)

    def completions(self, registration_id, wait_ms=0, max_jobs=0):
        step = self.script.pop(0) if self.script else kv.Unavailable(grpc.StatusCode.UNAVAILABLE, "down")
        if isinstance(step, Exception):
            raise step
        return Completions(results=step, pending=0)

    def close(self):
        pass


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture
def live_process():
    """A process standing in for the daemon: alive until killed."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield p
    p.kill()
    p.wait()


def worker(script, clock, pid, answering_pid=None):
    probe = answering_pid if answering_pid is not None else pid
    w = WorkerSide("/nonexistent.sock", b"fp", 1, client=StubClient(script), clock=clock,
                   unknown_daemon_grace_s=5.0, pid_probe=lambda path: probe)
    reg = _Reg(7, 1, DaemonProcess(pid))
    w._regs[7] = reg
    w.registration_id = 7
    with w._cv:
        jid = w._new_job("req", Op.LOAD, GroupJob(0, [b"\x01" * 32, b"\x02" * 32], [10, 11]))
        w._jobs[jid].reg = 7
        reg.jobs.add(jid)
    return w, reg, jid


def unavailable():
    return kv.Unavailable(grpc.StatusCode.UNAVAILABLE, "connection reset")


def test_results_after_a_reconnect_settle_the_job(live_process):
    clock = Clock()
    w, reg, jid = worker([unavailable(), unavailable()], clock, live_process.pid)
    w._poll_one(reg, 0)
    clock.t = 100.0
    w._poll_one(reg, 0)
    assert jid in w._jobs, "a job was failed while the daemon may still copy into its blocks"
    ok = JobResult(job_id=jid, request_id="req", op=Op.LOAD, ok=True, failures=(), blocks=2, bytes=0)
    w._client.script = [[ok]]
    w._poll_one(reg, 0)
    assert jid not in w._jobs and not w._failed_blocks and w._recv_done == {"req"}


def test_a_hung_daemon_settles_nothing(live_process):
    # SIGSTOP: calls time out for as long as it is stopped; it may resume
    # and copy. No grace period gives its jobs back.
    clock = Clock()
    hung = [kv.DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")] * 50
    w, reg, jid = worker(hung, clock, live_process.pid)
    for i in range(50):
        clock.t = i * 10.0
        w._poll_one(reg, 0)
    assert jid in w._jobs and w.suspect()


def test_not_found_from_the_same_daemon_means_drained(live_process):
    clock = Clock()
    w, reg, jid = worker([unavailable(), kv.NotFound(grpc.StatusCode.NOT_FOUND, "unregistered")], clock,
                         live_process.pid)
    w._poll_one(reg, 0)
    assert jid in w._jobs
    w._poll_one(reg, 0)
    assert jid not in w._jobs and w._failed_blocks == {10, 11}
    assert w.registration_id is None


def test_not_found_from_another_daemon_waits_for_the_old_one_to_exit(live_process):
    clock = Clock()
    nf = kv.NotFound(grpc.StatusCode.NOT_FOUND, "unknown registration")
    w, reg, jid = worker([nf, nf], clock, live_process.pid, answering_pid=live_process.pid + 100000)
    w._poll_one(reg, 0)
    assert jid in w._jobs, "another daemon's NOT_FOUND says nothing of the old one's copies"
    live_process.kill()
    live_process.wait()
    w._poll_one(reg, 0)
    assert jid not in w._jobs and w._failed_blocks == {10, 11}


def test_a_daemon_that_exited_settles_its_jobs(live_process):
    clock = Clock()
    w, reg, jid = worker([unavailable()] * 3, clock, live_process.pid)
    w._poll_one(reg, 0)
    assert jid in w._jobs
    live_process.kill()
    live_process.wait()
    w._poll_one(reg, 0)
    assert jid not in w._jobs and w._failed_blocks == {10, 11}


def test_a_daemon_whose_pid_is_unknown_gets_a_grace_period():
    clock = Clock()
    w, reg, jid = worker([unavailable()] * 3, clock, None)
    assert not reg.daemon.known
    w._poll_one(reg, 0)
    clock.t = 4.9
    w._poll_one(reg, 0)
    assert jid in w._jobs
    clock.t = 5.0
    w._poll_one(reg, 0)
    assert jid not in w._jobs and w._failed_blocks == {10, 11}


def test_jobs_a_running_daemon_holds_nothing_for_are_failed(live_process):
    """A call that failed without reaching the daemon (its connection was
    still coming back after a restart) leaves jobs the daemon never saw.
    Once the registration's daemon, running and answering, reports twice
    that nothing is pending and no result is left, they are reported failed;
    while anything is pending they are not."""

    class Idle(StubClient):
        def __init__(self):
            super().__init__([])
            self.pending = 0

        def completions(self, registration_id, wait_ms=0, max_jobs=0):
            return Completions(results=(), pending=self.pending)

    clock = Clock()
    w, reg, jid = worker([], clock, live_process.pid)
    w._client = Idle()
    w._jobs[jid].sent_at = 1.0  # the call that carried it returned at t=1
    clock.t = 1.5
    w._client.pending = 3  # the daemon still runs jobs: they may be these
    for _ in range(3):
        w._poll_one(reg, 0)
    assert jid in w._jobs
    w._client.pending = 0
    w._poll_one(reg, 0)
    assert jid in w._jobs  # once is not enough
    w._poll_one(reg, 0)
    assert jid in w._jobs  # and not within a second of the call
    clock.t = 2.5
    w._poll_one(reg, 0)
    assert jid not in w._jobs and w._failed_blocks == {10, 11}


def test_not_found_on_a_call_after_the_old_daemon_exited_registers_again(live_process):
    """The daemon restarted while nothing was in flight, so no poll notices:
    the next Store meets NOT_FOUND from the new process. The old process is
    gone, so is the registration: the worker registers again instead of
    sending every later step into NOT_FOUND."""
    from kvoffload.worker_side import _Batch

    class Refusing(StubClient):
        def store(self, registration_id, jobs, **kw):
            raise kv.NotFound(grpc.StatusCode.NOT_FOUND, "unknown registration")

    clock = Clock()
    w, reg, jid = worker([], clock, live_process.pid, answering_pid=live_process.pid + 100000)
    w._client = Refusing([])
    live_process.kill()
    live_process.wait()
    with w._cv:
        sid = w._new_job("req", Op.STORE, GroupJob(0, [b"\x03" * 32], [12]))
        w._jobs[sid].reg = 7
        reg.jobs.add(sid)
    w._send(_Batch(Op.STORE, [sid]), reg, [(sid, w._jobs[sid])], False)
    assert sid not in w._jobs
    assert w.registration_id is None, "the worker keeps a registration its daemon took with it"
