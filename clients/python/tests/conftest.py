"""Fixtures: the real kvoffloadd on a temporary socket.

The daemon binary is $KVOFFLOADD_BIN, else bin/kvoffloadd at the repository
root, built with `go build -o bin/kvoffloadd ./cmd/kvoffloadd` when missing.
Each daemon runs with --metrics-addr "" on a socket in a fresh directory,
is waited for through the gRPC health service, and is stopped with SIGTERM;
the fixture fails the test if it does not exit 0. Its directory (socket,
log, disk tier) is removed on every path, the daemon killed first if it
still runs (tmpdirs.py); a disk tier gets 64 MiB unless the test says.
"""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent.parent
# The package under test: clients/python, or $KVOFFLOAD_PKG (a directory
# holding another version's kvoffload/, to run these tests against it).
PKG_ROOT = Path(os.environ.get("KVOFFLOAD_PKG") or HERE.parent)

if str(PKG_ROOT) not in sys.path:
    sys.path.insert(0, str(PKG_ROOT))

import kvoffload  # noqa: E402

sys.path.insert(0, str(HERE))
import tmpdirs  # noqa: E402

# Directories of earlier sessions that were killed before they could clean up.
tmpdirs.sweep()


def daemon_binary() -> Path:
    env = os.environ.get("KVOFFLOADD_BIN")
    if env:
        return Path(env)
    path = REPO_ROOT / "bin" / "kvoffloadd"
    if not path.exists():
        if shutil.which("go") is None:
            raise RuntimeError(f"{path} is missing and there is no Go toolchain to build it (or set KVOFFLOADD_BIN)")
        subprocess.run(["go", "build", "-o", str(path), "./cmd/kvoffloadd"], cwd=REPO_ROOT, check=True)
    return path


def daemon_help() -> str:
    """`kvoffloadd --help` ("" when the daemon cannot be built: the tests
    that start it report why)."""
    try:
        r = subprocess.run([str(daemon_binary()), "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return ""
    return r.stdout + r.stderr


# wait_ready waits out a missing socket only when told the daemon is
# starting (an older package, run with KVOFFLOAD_PKG, always did).
_STARTING = {"starting": True} if "starting" in inspect.signature(kvoffload.Client.wait_ready).parameters else {}


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Waits until every thread of ``pid`` is stopped (state T or t)."""
    end = time.monotonic() + timeout
    while True:
        states = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/stat") as f:
                    st = f.read()
            except OSError:
                continue  # the thread exited
            states.append(st[st.rindex(")") + 2])
        if states and all(x in "Tt" for x in states):
            return
        if time.monotonic() > end:
            raise AssertionError(f"process {pid} not stopped {timeout}s after SIGSTOP: thread states {states}")
        time.sleep(0.0002)


class Daemon:
    """A running kvoffloadd. ``restart`` starts a new process on the same
    socket and flags (and disk directory, when the flags name one);
    ``pause``/``resume`` stop and continue it (SIGSTOP/SIGCONT): a daemon
    that hangs without dying."""

    def __init__(self, args: list[str] = (), cpu_bytes: str = "64MiB", log_level: str = "debug"):
        self.dir = tmpdirs.make()
        try:
            self.socket = os.path.join(self.dir, "run", "kv.sock")
            self.log_path = os.path.join(self.dir, "daemon.log")
            self._log = open(self.log_path, "wb")
            args = [a.replace("{dir}", self.dir) for a in args]
            if "--disk-dir" in args and "--disk-bytes" not in args:
                args += ["--disk-bytes", "64MiB"]  # not the daemon's default: tests run side by side
            self._cmd = [str(daemon_binary()), "--socket", self.socket, "--cpu-bytes", cpu_bytes, "--metrics-addr", "",
                         "--log-level", log_level, *args]
            for flag, val in zip(self._cmd, self._cmd[1:]):
                if flag == "--disk-dir":
                    os.makedirs(val, exist_ok=True)
            self._clients: list[kvoffload.Client] = []
            self.restarts = 0
            self._start()
        except BaseException:
            self.cleanup()
            raise

    def _start(self) -> None:
        self.proc = subprocess.Popen(self._cmd, stdout=self._log, stderr=subprocess.STDOUT)
        tmpdirs.adopt(self.dir, self.proc)
        probe = kvoffload.Client(self.socket)
        try:
            probe.wait_ready(timeout=15, **_STARTING)
        except kvoffload.KVOffloadError as e:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"kvoffloadd did not come up: {e}\n{self.log()}") from None
        finally:
            probe.close()

    def restart(self, timeout: float = 15.0) -> int:
        """SIGTERM (the daemon drains), wait, start again; returns the old exit code."""
        self.resume()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.restarts += 1
        self._start()
        return rc

    def wait_recovered(self, timeout: float = 30.0) -> None:
        """Wait until the disk tier's background recovery is done: until then
        a block on disk is not offered, and a test that serves it at once sees
        a miss (and stores it again in the CPU tier) instead of the disk read
        it is about."""
        c = self.client()
        end = time.monotonic() + timeout
        while c.stats().disk_recovery.state != kvoffload.RecoveryState.DONE:
            if time.monotonic() > end:
                raise AssertionError(f"disk recovery not done after {timeout}s: {c.stats().disk_recovery}")
            time.sleep(0.02)

    def pause(self) -> None:
        """SIGSTOP, then waits until every thread of the daemon is stopped:
        a stop is not synchronous (on a loaded VM a stopped daemon answered
        calls for up to 18 ms after the signal, and tests of a hung daemon
        then saw it answer)."""
        self.proc.send_signal(signal.SIGSTOP)
        wait_stopped(self.proc.pid)

    def resume(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def client(self, **kw) -> kvoffload.Client:
        """A client whose connection is up: on a loaded machine a first call
        can otherwise fail UNAVAILABLE while the connection is still made."""
        c = kvoffload.Client(self.socket, **kw)
        self._clients.append(c)
        c.wait_ready(timeout=30)
        return c

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def stop(self, timeout: float = 15.0) -> int:
        for c in self._clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - the daemon is stopped whatever a client does
                pass
        self.resume()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._log.close()
        return rc

    def cleanup(self) -> None:
        """Kills the daemon if it still runs and removes its directory."""
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()
        tmpdirs.remove(self.dir)


def _stop_checked(d: Daemon) -> None:
    try:
        rc = d.stop()
        log = d.log()
    finally:
        d.cleanup()
    assert rc == 0, f"kvoffloadd exited {rc} on SIGTERM\n{log}"


@pytest.fixture(scope="session")
def daemon():
    """One daemon shared by the tests that use distinct fingerprints."""
    d = Daemon()
    try:
        yield d
    finally:
        _stop_checked(d)


@pytest.fixture
def fresh_daemon():
    """A daemon of the test's own; call it with extra flags or not at all."""
    started: list[Daemon] = []

    def start(*args: str, cpu_bytes: str = "64MiB", log_level: str = "debug") -> Daemon:
        d = Daemon(list(args), cpu_bytes=cpu_bytes, log_level=log_level)
        started.append(d)
        return d

    try:
        yield start
    finally:
        errors = []
        for d in started:
            try:
                _stop_checked(d)
            except AssertionError as e:
                errors.append(e)
        if errors:
            raise errors[0]


@pytest.fixture
def scratch_dir():
    """A directory removed after the test on every path (tmpdirs.py), for
    what outlives one daemon: a disk tier two daemons share in turn."""
    path = tmpdirs.make("scratch-")
    try:
        yield path
    finally:
        tmpdirs.remove(path)


@pytest.fixture
def client(daemon):
    c = daemon.client()
    yield c
    c.close()


@pytest.fixture
def shm():
    """Factory of /dev/shm regions, unlinked after the test."""
    made: list[kvoffload.ShmRegion] = []

    def make(size: int) -> kvoffload.ShmRegion:
        r = kvoffload.ShmRegion(size)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


_counter = [0]


@pytest.fixture
def fingerprint(request):
    """A fingerprint no other test uses."""
    _counter[0] += 1
    return f"test:{request.node.name}:{_counter[0]}:{time.time_ns()}".encode()[:250]

