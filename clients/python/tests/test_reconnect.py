"""A broken connection does not fail jobs the daemon may still be copying.

The daemon keeps answering Completions for a registration whose connection
closed until its jobs have drained; WorkerSide must keep polling through
UNAVAILABLE and fail the rest only on NOT_FOUND (drained) or once the daemon
has been unreachable for the grace period (it died)."""

from __future__ import annotations

import grpc

import kvoffload as kv
from kvoffload.connector import GroupJob, WorkerSide
from kvoffload.types import Completions, JobResult, Op


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


def worker(script, clock):
    w = WorkerSide("/nonexistent.sock", b"fp", 1, client=StubClient(script), clock=clock, unavailable_grace_s=5.0)
    w.registration_id = 7
    jid = w._new_job("req", Op.LOAD, GroupJob(0, [b"\x01" * 32, b"\x02" * 32], [10, 11])).job_id
    return w, jid


def unavailable():
    return kv.Unavailable(grpc.StatusCode.UNAVAILABLE, "connection reset")


def test_results_after_a_reconnect_settle_the_job():
    clock = Clock()
    w, jid = worker([unavailable(), unavailable()], clock)
    w._poll()
    clock.t = 1.0
    w._poll()
    assert jid in w._jobs, "a job was failed while the daemon may still copy into its blocks"
    ok = JobResult(job_id=jid, request_id="req", op=Op.LOAD, ok=True, failures=(), blocks=2, bytes=0)
    w._client.script = [[ok]]
    w._poll()
    assert jid not in w._jobs and not w._failed_blocks


def test_not_found_means_drained_and_fails_the_rest():
    clock = Clock()
    w, jid = worker([unavailable(), kv.NotFound(grpc.StatusCode.NOT_FOUND, "unregistered")], clock)
    w._poll()
    assert jid in w._jobs
    w._poll()
    assert jid not in w._jobs and w._failed_blocks == {10, 11}


def test_a_daemon_gone_past_the_grace_period_fails_the_jobs():
    clock = Clock()
    w, jid = worker([], clock)
    w._poll()
    clock.t = 4.9
    w._poll()
    assert jid in w._jobs
    clock.t = 5.0
    w._poll()
    assert jid not in w._jobs and w._failed_blocks == {10, 11}
