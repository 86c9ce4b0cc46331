"""Each way of not reaching the daemon gets its own message, at once
(issue 33, 6): a missing socket, a socket nobody listens on, a socket this
process may not open; a daemon that accepts but never answers takes the
deadline and says so. The waits here are far longer than the answers should
take: a client that waited instead of diagnosing fails on the error's class,
not on a timing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import kvoffload
from conftest import PKG_ROOT

LONG = 60.0  # what a client that waits instead of diagnosing would take


def test_missing_socket(tmp_path):
    path = str(tmp_path / "nobody-here.sock")
    c = kvoffload.Client(path, timeout=LONG)
    try:
        for call in (c.stats, c.healthy, lambda: c.wait_ready(timeout=LONG)):
            with pytest.raises(kvoffload.Unavailable) as e:
                call()
            assert f"no socket at {path}: kvoffloadd is not running there" in str(e.value)
            assert not e.value.from_daemon
    finally:
        c.close()


def test_nobody_listening(tmp_path):
    """A socket left by a daemon that exited (kill -9 leaves it)."""
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    c = kvoffload.Client(path, timeout=LONG)
    try:
        for call in (c.stats, lambda: c.resolve([b"fingerprint"]),
                     lambda: c.wait_ready(timeout=LONG)):
            with pytest.raises(kvoffload.Unavailable) as e:
                call()
            assert f"nobody listens on {path} (connection refused)" in str(e.value)
    finally:
        c.close()


def test_starting_waits_out_a_missing_socket(fresh_daemon, tmp_path):
    """wait_ready(starting=True) is for a daemon just launched: the socket
    comes, and the wait ends SERVING."""
    d = fresh_daemon()
    c = kvoffload.Client(d.socket)
    try:
        c.wait_ready(timeout=LONG, starting=True)
    finally:
        c.close()
    path = str(tmp_path / "never.sock")
    c = kvoffload.Client(path)
    try:
        with pytest.raises(kvoffload.DeadlineExceeded) as e:
            c.wait_ready(timeout=0.5, starting=True)
        assert f"no socket at {path}" in str(e.value)
    finally:
        c.close()


_AS_NOBODY = """
import sys
sys.path.insert(0, sys.argv[2])
import kvoffload
c = kvoffload.Client(sys.argv[1], timeout=60)
for call in (c.stats, lambda: c.wait_ready(timeout=60)):
    try:
        call()
        print("ANSWERED")
    except kvoffload.KVOffloadError as e:
        print(type(e).__name__, e)
"""


def _as_nobody(sock: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _AS_NOBODY, sock, str(PKG_ROOT)], user=65534, group=65534,
                       capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user (nobody)")
def test_permission_denied(fresh_daemon):
    d = fresh_daemon()
    # The daemon's socket directory is 0700: nobody may not even reach it.
    lines = _as_nobody(d.socket)
    assert len(lines) == 2, lines
    for line in lines:
        assert line.startswith("Unavailable"), lines
        assert f"permission denied connecting to {d.socket} as uid 65534" in line, lines
        assert "is closed to this user" in line, lines
    # The directories open, the socket itself 0600: its mode and owner are named.
    os.chmod(d.dir, 0o755)
    os.chmod(os.path.dirname(d.socket), 0o755)
    lines = _as_nobody(d.socket)
    for line in lines:
        assert line.startswith("Unavailable"), lines
        assert f"the socket is mode 0600, uid {os.getuid()}" in line, lines
        assert "--socket-mode 0660" in line, lines


def test_stopped_daemon_says_so(fresh_daemon):
    """A daemon stopped with SIGSTOP accepts connections (the kernel does)
    but never answers: the call takes its deadline and says why."""
    d = fresh_daemon()
    d.client()  # up
    d.pause()
    try:
        c = kvoffload.Client(d.socket, timeout=1.0)
        try:
            with pytest.raises(kvoffload.DeadlineExceeded) as e:
                c.stats()
            assert "no answer from kvoffloadd" in str(e.value) and "stopped (SIGSTOP), hung or overloaded" in str(e.value)
            with pytest.raises(kvoffload.DeadlineExceeded) as e:
                c.wait_ready(timeout=1.0)
            assert "accepts connections but does not answer" in str(e.value)
            assert "stopped (SIGSTOP), hung or overloaded" in str(e.value)
        finally:
            c.close()
    finally:
        d.resume()
