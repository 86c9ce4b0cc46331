"""The connector as a user installs it, and the versions it and the daemon
compare (docs/vllm.md, Install and Versions).

`make wheel` builds the wheel and the sdist offline; the wheel installs with
no index into a fresh virtual environment that sees the system's grpcio and
protobuf (--system-site-packages), and the installed copy, not this tree,
talks to the real daemon. The daemon refuses a client of another API
protocol, naming both versions, and the connector says so and turns
offloading off.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest
from conftest import REPO_ROOT
from fake_daemon import FakeDaemon

import kvoffload as kv
import kvoffload.client
from kvoffload.regions import KVRegistration
from kvoffload.worker_side import WorkerSide

VERSION = (REPO_ROOT / "VERSION").read_text().strip()
SEG = 4096
NBLK = 8

# Run by the installed package, from a directory outside the tree: the
# package's place, its version, and the daemon's answers to it.
_SCRIPT = r"""
import json, sys
import kvoffload as kv
sock = sys.argv[1]
r = kv.ShmRegion(4096 * 4)
try:
    with kv.Client(sock) as c:
        st = c.stats()
        reg = c.register(sys.argv[2].encode(), kv.Layout(32, [kv.Segment(0, 4096)]),
                         [kv.Region.shm(r.path, offset=0, block_stride=4096, num_blocks=4)], "wheel test")
        print(json.dumps({"file": kv.__file__, "version": kv.__version__, "protocol": kv.PROTOCOL_VERSION,
                          "daemon": st.version, "daemon_protocol": st.protocol_version,
                          "registered": reg.registration_id, "reg_daemon": reg.daemon_version}))
finally:
    r.close()
"""


def _run(args, **kw):
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)
    assert r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def test_the_wheel_builds_offline_installs_into_a_fresh_venv_and_talks_to_the_daemon(daemon, tmp_path, fingerprint):
    dist = tmp_path / "dist"
    _run(["make", "-s", "wheel", f"WHEEL_DIR={dist}", f"PYTHON={sys.executable}"], cwd=REPO_ROOT)
    whl = dist / f"kvoffload-{VERSION}-py3-none-any.whl"
    sdist = dist / f"kvoffload-{VERSION}.tar.gz"
    assert sorted(p.name for p in dist.iterdir()) == sorted([whl.name, sdist.name])
    license_text = (REPO_ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in license_text and b"Version 2.0" in license_text
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        assert z.read(f"kvoffload-{VERSION}.dist-info/LICENSE") == license_text
        meta = z.read(f"kvoffload-{VERSION}.dist-info/METADATA").decode()
    assert f"Version: {VERSION}\n" in meta and "License: Apache-2.0" in meta
    assert "kvoffload/_proto/kvoffload/v1/kvoffload_pb2.py" in names and "kvoffload/vllm.py" in names
    assert not [n for n in names if n.startswith("tests/")], names
    with tarfile.open(sdist) as t:
        assert t.extractfile(f"kvoffload-{VERSION}/LICENSE").read() == license_text

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    py = str(venv / "bin" / "python")
    # No index: the dependencies (grpcio, protobuf) must be met by the
    # system's packages, or pip fails.
    _run([py, "-m", "pip", "install", "--no-index", "--disable-pip-version-check", "-q", str(whl)])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = _run([py, "-c", _SCRIPT, daemon.socket, fingerprint.decode()], cwd=tmp_path, env=env).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["file"].startswith(str(venv)), got  # the installed copy, not this tree
    assert got["version"] == VERSION and got["protocol"] == kv.PROTOCOL_VERSION
    assert got["daemon"] == VERSION and got["reg_daemon"] == VERSION, "bin/kvoffloadd not built by make build?"
    assert got["daemon_protocol"] == kv.PROTOCOL_VERSION and got["registered"] > 0


def test_versions_and_protocol_in_stats_and_register(client, shm, fingerprint):
    assert kv.__version__ == VERSION
    st = client.stats()
    assert st.version == VERSION
    assert st.min_protocol_version <= kv.PROTOCOL_VERSION <= st.protocol_version
    r = shm(NBLK * SEG)
    reg = client.register(fingerprint, kv.Layout(32, [kv.Segment(0, SEG)]),
                          [kv.Region.shm(r.path, offset=0, block_stride=SEG, num_blocks=NBLK)])
    assert reg.daemon_version == VERSION and reg.protocol_version == kv.PROTOCOL_VERSION
    out = subprocess.run([str(REPO_ROOT / "bin" / "kvoffloadd"), "--version"], capture_output=True, text=True,
                         timeout=30).stdout
    assert out == f"kvoffloadd {VERSION} (API protocol {kv.PROTOCOL_VERSION})\n"


def test_the_daemon_refuses_another_protocol_naming_both_versions(daemon, client, shm, fingerprint, monkeypatch):
    monkeypatch.setattr(kvoffload.client, "PROTOCOL_VERSION", kv.PROTOCOL_VERSION + 1)
    r = shm(NBLK * SEG)
    with pytest.raises(kv.FailedPrecondition) as e:
        client.register(fingerprint, kv.Layout(32, [kv.Segment(0, SEG)]),
                        [kv.Region.shm(r.path, offset=0, block_stride=SEG, num_blocks=NBLK)])
    msg = str(e.value)
    assert e.value.from_daemon, msg
    assert f"kvoffloadd {VERSION} speaks API protocol {kv.PROTOCOL_VERSION}," in msg, msg
    assert f"(kvoffload {VERSION}) speaks protocol {kv.PROTOCOL_VERSION + 1}" in msg, msg
    # Nothing was registered.
    assert client.stats().namespace_for(fingerprint) is None


def _worker_registration(shm) -> KVRegistration:
    r = shm(NBLK * SEG)
    return KVRegistration(kv.Layout(32, [kv.Segment(0, SEG)]),
                          [kv.Region.shm(r.path, offset=0, block_stride=SEG, num_blocks=NBLK)], ["l0"], NBLK, "cpu")


def test_the_connector_logs_both_versions_and_turns_off_on_a_mismatch(daemon, shm, fingerprint, monkeypatch,
                                                                       caplog):
    w = WorkerSide(daemon.socket, fingerprint, 1)
    try:
        with caplog.at_level(logging.INFO, logger="kvoffload"):
            assert w.register(_worker_registration(shm))
        assert any(f"kvoffloadd {VERSION}, kvoffload {VERSION}, API protocol {kv.PROTOCOL_VERSION}" in m
                   for m in caplog.messages), caplog.messages
    finally:
        w.shutdown()

    caplog.clear()
    monkeypatch.setattr(kvoffload.client, "PROTOCOL_VERSION", kv.PROTOCOL_VERSION + 1)
    w = WorkerSide(daemon.socket, fingerprint + b"-2", 1)
    try:
        with caplog.at_level(logging.ERROR, logger="kvoffload"):
            assert not w.register(_worker_registration(shm))
        assert w.refused and "version mismatch" in w.refused
        assert any("offloading is off" in m and f"kvoffloadd {VERSION}" in m for m in caplog.messages), \
            caplog.messages
    finally:
        w.shutdown()


def test_a_daemon_older_than_the_protocol_number_is_refused_by_the_client(monkeypatch):
    """A daemon from before the numbers ignores the client's protocol and
    answers 0 (protocol 1): a client of protocol 2 must refuse it itself."""
    fake = FakeDaemon()
    try:
        with kv.Client(fake.socket) as c:
            reg = c.register(b"fp", kv.Layout(32, [kv.Segment(0, 64)]), [])
            assert reg.protocol_version == 1 and reg.daemon_version == ""
            monkeypatch.setattr(kvoffload.client, "PROTOCOL_VERSION", 2)
            with pytest.raises(kv.FailedPrecondition) as e:
                c.register(b"fp", kv.Layout(32, [kv.Segment(0, 64)]), [])
            assert "(unknown version) answered in API protocol 1" in str(e.value)
            assert f"(kvoffload {VERSION}) speaks protocol 2" in str(e.value)
    finally:
        fake.stop()
