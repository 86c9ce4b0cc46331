"""Temporary directories of the tests' daemons, removed on every path.

A test daemon's directory holds its socket, its log and often a disk tier:
left behind, such directories fill the disk. Each one made here is named
``kvo-py-<owner pid>-…`` and removed, with every daemon process started in
it killed first:

- by its owner (``remove``), normally from a fixture's finalizer;
- at interpreter exit (atexit), whatever the tests did, also on SIGTERM,
  SIGHUP or SIGINT, which this module turns into an orderly exit;
- and, for an owner that could not run either (SIGKILL, a crash), by the
  next test session: ``sweep`` removes the directories whose owner process
  is gone, after killing the daemons recorded in them.

Processes are told apart from a later process with the same pid by their
start time (/proc/<pid>/stat), so a sweep never kills a stranger.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

PREFIX = "kvo-py-"
_lock = threading.Lock()
_dirs: dict[str, list[subprocess.Popen]] = {}


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22 (starttime), counted after the ")" that ends the command name.
    fields = stat[stat.rindex(b")") + 2:].split()
    return fields[19].decode()


def _alive(pid: int, start: str) -> bool:
    return _start_time(pid) == start


def make(kind: str = "") -> str:
    """A fresh directory, removed at the latest when this process exits."""
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{kind}")
    with open(os.path.join(path, ".owner"), "w") as f:
        f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
    with _lock:
        _dirs[path] = []
    return path


def adopt(path: str, proc: subprocess.Popen) -> None:
    """``proc`` runs in ``path``: it is killed before the directory goes."""
    start = _start_time(proc.pid)
    with open(os.path.join(path, ".procs"), "a") as f:
        f.write(f"{proc.pid} {start}\n")
    with _lock:
        _dirs.setdefault(path, []).append(proc)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGCONT)  # a stopped process dies on SIGKILL too, but waits to be reaped
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def remove(path: str) -> None:
    """Kills what still runs in ``path`` and removes it."""
    with _lock:
        procs = _dirs.pop(path, [])
    for p in procs:
        _kill(p)
    shutil.rmtree(path, ignore_errors=True)


def remove_all() -> None:
    with _lock:
        paths = list(_dirs)
    for p in paths:
        remove(p)


def sweep() -> int:
    """Removes the directories of owners that are gone (killed before they
    could clean up), killing the daemons they recorded. Returns how many."""
    n = 0
    for path in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        try:
            with open(os.path.join(path, ".owner")) as f:
                pid, start = f.read().split()
            if _alive(int(pid), start):
                continue
            try:
                with open(os.path.join(path, ".procs")) as f:
                    procs = [line.split() for line in f if line.strip()]
            except FileNotFoundError:
                procs = []
            for p, s in procs:
                if _alive(int(p), s):
                    os.kill(int(p), signal.SIGCONT)
                    os.kill(int(p), signal.SIGKILL)
        except (OSError, ValueError):
            # No owner file yet (being made this instant) or not ours: leave it.
            continue
        shutil.rmtree(path, ignore_errors=True)
        n += 1
    return n


def _exit_on(signum, frame):  # noqa: ARG001
    sys.exit(128 + signum)  # runs the atexit handler


atexit.register(remove_all)
if threading.current_thread() is threading.main_thread():
    for _sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(_sig) is signal.SIG_DFL:
            signal.signal(_sig, _exit_on)
