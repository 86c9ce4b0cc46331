"""The README's tour (examples/tour.py) runs as written against the daemon."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_tour_runs(daemon):
    env = dict(os.environ, KVOFFLOADD_SOCKET=daemon.socket, PYTHONPATH=str(ROOT / "clients" / "python"))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "tour.py")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "lookup: ready 4 of 5" in out.stdout
    assert "bytes identical: True" in out.stdout
    assert "failed engine blocks: [22]" in out.stdout
