"""The tests' daemon directories go on every path (tmpdirs.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import tmpdirs

HERE = Path(__file__).resolve().parent

# The owner turns SIGINT into KeyboardInterrupt itself: Python does so only
# when it starts with SIGINT not ignored, and a test session started in the
# background of a non-interactive shell passes SIG_IGN on (then the SIGINT
# case waited 30 s for an owner that ignored it). It waits for the signal on
# the wakeup fd that Python's C-level handler writes to: a time.sleep(600)
# entered just after that handler ran (the test signals as soon as it reads
# the line) slept on, the Python handler never ran, and the test waited 30 s
# for nothing (1 of 14 runs of the suite under load; issue 26). SIGTERM and
# SIGHUP are set back to their defaults before tmpdirs is imported: tmpdirs
# leaves a signal the session ignores alone (a session under nohup keeps
# running on SIGHUP), and a suite run under nohup passed that on, so the
# SIGHUP case waited 30 s for an owner that ignored it.
OWNER = r"""
import os, select, signal, subprocess, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
sys.path.insert(0, sys.argv[1])
import tmpdirs
d = tmpdirs.make("t-")
open(d + "/disk", "wb").write(b"x" * 4096)
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
tmpdirs.adopt(d, p)
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
print(d, p.pid, flush=True)
while True:
    select.select([r], [], [])
    os.read(r, 512)
"""


def owner():
    p = subprocess.Popen([sys.executable, "-c", OWNER, str(HERE)], stdout=subprocess.PIPE, text=True)
    path, pid = p.stdout.readline().split()
    return p, path, int(pid)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] == "Z"  # a zombie: dead, its parent not reaping
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_an_owner_stopped_by_a_signal_removes_its_dirs_and_kills_their_processes(sig):
    p, path, child = owner()
    try:
        p.send_signal(sig)
        p.wait(timeout=30)
        assert not os.path.exists(path)
        assert gone(child)
    finally:
        p.kill()
        p.wait()
        tmpdirs.remove(path)


def test_a_killed_owners_dirs_are_swept_by_the_next_session():
    p, path, child = owner()
    try:
        p.kill()
        p.wait()
        assert os.path.exists(path) and not gone(child)  # SIGKILL: nothing ran
        tmpdirs.sweep()
        assert not os.path.exists(path)
        assert wait_gone(child)
    finally:
        tmpdirs.remove(path)


def test_a_sweep_leaves_live_owners_alone():
    mine = tmpdirs.make("live-")
    try:
        tmpdirs.sweep()
        assert os.path.isdir(mine)
    finally:
        tmpdirs.remove(mine)
    assert not os.path.exists(mine)


def wait_gone(pid: int) -> bool:
    from helpers import wait_for

    return wait_for(lambda: gone(pid))
