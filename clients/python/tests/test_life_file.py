"""The daemon's life file (``<socket>.life``): how a connector that cannot
see the daemon's pid (another pid namespace) still never hands blocks back
while the daemon may write them, and still lets go of a registration once
that daemon is gone. Real daemon, real socket; the worker is told the pid is
not visible, as SO_PEERCRED tells it across pid namespaces."""

from __future__ import annotations

import functools
import os
import time

import test_connector
from helpers import KVCacheBlocks, Request, wait_for
from test_connector import Harness, prefill

from kvoffload.connector import WorkerSide
from kvoffload.daemon_process import DaemonProcess, open_life


def hidden_pid_harness(monkeypatch, d, shm, fingerprint, grace_s):
    monkeypatch.setattr(test_connector, "WorkerSide",
                        functools.partial(WorkerSide, pid_probe=lambda path: None, unknown_daemon_grace_s=grace_s))
    return Harness(d, shm, fingerprint)


def loading(h, name, toks):
    """A request whose load of 5 looked-up blocks is planned for the next step."""
    r = Request(name, toks)
    assert h.ask(r, 0) == (20, True)
    h.sched.update_state_after_alloc(r, KVCacheBlocks([11, 12, 13, 14, 15, 16]), 20)
    return r


def test_a_stopped_daemon_keeps_its_jobs_without_a_visible_pid(fresh_daemon, shm, fingerprint, monkeypatch):
    d = fresh_daemon()
    h = hidden_pid_harness(monkeypatch, d, shm, fingerprint, grace_s=0.2)
    try:
        toks = list(range(60, 81))
        prefill(h, Request("a0", toks), [1, 2, 3, 4, 5, 6])
        assert h.run_until(h.idle)
        reg = h.workers[0]._regs[h.workers[0].registration_id]
        assert reg.daemon.pid is None and reg.daemon.known, reg.daemon
        loading(h, "a1", toks)
        d.pause()
        # Stopped for many times the grace period: the load was sent (or is
        # being sent) and the daemon may resume and copy into the blocks, so
        # nothing may be handed back.
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            h.step()
            assert "a1" not in h.recv[0] and not h.failed[0], "a stopped daemon's load was given back"
        d.resume()
        assert h.run_until(lambda: "a1" in h.recv[0])
        assert not h.failed[0]
        for i, b in enumerate([11, 12, 13, 14, 15]):
            assert h.engines[0].read(0, b) == h.engines[0].read(0, [1, 2, 3, 4, 5][i])
    finally:
        d.resume()
        h.close()


def test_a_killed_daemon_is_let_go_of_at_once_without_a_visible_pid(fresh_daemon, shm, fingerprint, monkeypatch):
    # With no life file, a daemon restarted before the grace period ended
    # answers NOT_FOUND, and the worker waits for an exit it cannot see: for
    # good with this grace period.
    d = fresh_daemon()
    h = hidden_pid_harness(monkeypatch, d, shm, fingerprint, grace_s=3600)
    try:
        toks = list(range(90, 111))
        prefill(h, Request("b0", toks), [1, 2, 3, 4, 5, 6])
        assert h.run_until(h.idle)
        loading(h, "b1", toks)
        d.pause()
        h.step()
        d.proc.kill()
        d.proc.wait()
        d._start()
        assert h.run_until(lambda: "b1" in h.recv[0], timeout=60)
        assert h.failed[0] == {11, 12, 13, 14, 15}
        # And it offloads again, registered with the new daemon.
        assert h.run_until(lambda: h.workers[0].registration_id is not None and h.workers[0].registered())
    finally:
        h.close()


def test_life_file_tells_exit_not_stop(fresh_daemon):
    d = fresh_daemon()
    fd = open_life(d.socket)
    assert fd is not None, "the daemon made no life file beside its socket"
    assert oct(os.fstat(fd).st_mode & 0o777) == oct(0o600)
    p = DaemonProcess(None, fd)
    assert p.known and not p.exited() and p.serves(d.socket)
    d.pause()
    assert not p.exited()
    d.resume()
    old = d.proc
    d.restart()
    assert wait_for(lambda: old.poll() is not None)
    assert p.exited()
    q = DaemonProcess(None, open_life(d.socket))
    assert not q.exited() and q.serves(d.socket)
    q.close()
    d.stop()
    assert not os.path.exists(d.socket + ".life"), "a clean stop leaves its life file"
