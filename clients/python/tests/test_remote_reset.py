"""vLLM's cache reset through the connector, with the daemon's remote tier
on a real Redis Cluster (three masters started here from redis-server and
redis-cli, skipped when they are not installed).

A reset invalidates the old identity's namespaces in the daemon, and with a
remote tier that means writing their generation records on every master: a
master that is down misses them, and the other nodes of the fleet may load
the old blocks from it until the daemon's retry reaches it. The daemon then
answers the Invalidate UNAVAILABLE (docs/api.md, Invalidate), and the
connector's ``reset_cache`` reports False. It used to answer OK, and the
reset reported True.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
import tmpdirs
from standin_engine import Config, Engine
from standin_run import connector_module

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="redis-server and redis-cli are needed for a real cluster",
)


def _free_port() -> int:
    """A free port whose cluster bus port (port + 10000, redis-cli's
    --cluster create assumes it) is free too: an ephemeral port above 55535
    has no bus port, and redis-server then does not start."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _cli(port: int, *args: str, timeout: float = 10) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=timeout,
                          check=True).stdout


class Cluster:
    """Three masters, no replicas, configured as docs/remote.md says."""

    def __init__(self) -> None:
        self.dir = tmpdirs.make("redis-")
        self.ports = [_free_port() for _ in range(3)]
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for p in self.ports:
                d = os.path.join(self.dir, str(p))
                os.makedirs(d)
                self.procs[p] = subprocess.Popen(
                    ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--dir", d, "--cluster-enabled", "yes",
                     "--cluster-config-file", "nodes.conf", "--cluster-require-full-coverage", "no", "--save", "",
                     "--appendonly", "no", "--maxmemory-policy", "allkeys-lru"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                tmpdirs.adopt(self.dir, self.procs[p])
            for p in self.ports:
                self._wait(lambda p=p: _cli(p, "ping").strip() == "PONG")
            subprocess.run(["redis-cli", "--cluster", "create", *self.addrs, "--cluster-yes"], capture_output=True,
                           timeout=60, check=True)
            for p in self.ports:
                self._wait(lambda p=p: "cluster_state:ok" in _cli(p, "cluster", "info"))
        except BaseException:
            self.close()
            raise

    @property
    def addrs(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    @staticmethod
    def _wait(ok, limit_s: float = 30) -> None:
        end = time.monotonic() + limit_s
        while True:
            try:
                if ok():
                    return
            except (subprocess.SubprocessError, OSError):
                pass
            if time.monotonic() > end:
                raise AssertionError("the Redis cluster did not come up")
            time.sleep(0.05)

    def kill(self, port: int) -> None:
        p = self.procs[port]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        tmpdirs.remove(self.dir)


@pytest.fixture
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def test_a_reset_the_remote_tier_missed_answers_false(cluster, fresh_daemon, shm):
    d = fresh_daemon("--remote-redis", ",".join(cluster.addrs), "--remote-timeout", "300ms")
    with connector_module() as mod:
        eng = Engine(Config(model="m-remote-reset", prefix_caching=False, extra={"lookup_deadline_ms": 2000}), mod,
                     d.socket, shm)
        try:
            prompt = list(range(3000, 3030))
            eng.add_request("a0", prompt, 1)
            for _ in range(3000):
                if eng.idle():
                    break
                eng.step()
            # Every master answers: the old identity's records are
            # written everywhere, and the reset is confirmed.
            assert eng.update_weights() is True
            eng.add_request("b0", prompt, 1)
            for _ in range(3000):
                if eng.idle():
                    break
                eng.step()
            # A master is gone: it misses the records of this reset.
            cluster.kill(cluster.ports[1])
            assert eng.update_weights() is False
        finally:
            eng.close()
