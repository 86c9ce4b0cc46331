"""The generated stubs against the protobuf runtimes the package claims.

pyproject.toml claims protobuf>=4.21,<7 (the stubs are protoc 3.21 gencode).
This machine has one runtime, Debian's python3-protobuf (protobuf 4.21.12),
with two implementations (the C++ extension and pure Python): every RPC's
request and response, every field set, round-trips through both, each in a
process of its own. A runtime outside the claim fails the import with the
fix (a stand-in ``google.protobuf`` of that version shadows the real one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import PKG_ROOT

ROUND_TRIP = textwrap.dedent('''
    import sys
    from google.protobuf.descriptor import FieldDescriptor as F
    from google.protobuf.internal import api_implementation
    from kvoffload._proto.kvoffload.v1 import kvoffload_pb2 as pb, kvoffload_pb2_grpc as pb_grpc

    def fill(msg, depth=0):
        """Every field of msg set (each oneof to its last member), nested
        messages filled, repeated fields with two elements."""
        for f in msg.DESCRIPTOR.fields:
            def value(i):
                if f.type == F.TYPE_MESSAGE:
                    return None
                if f.type == F.TYPE_ENUM:
                    vals = f.enum_type.values
                    return vals[min(1 + i, len(vals) - 1)].number
                if f.type == F.TYPE_BOOL:
                    return True
                if f.type == F.TYPE_STRING:
                    return f"{f.name}-{i}"
                if f.type == F.TYPE_BYTES:
                    return bytes([i + 1]) * 3
                if f.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
                    return 1.5 + i
                return 7 + i
            if f.label == F.LABEL_REPEATED:
                if f.type == F.TYPE_MESSAGE:
                    if f.message_type.GetOptions().map_entry:
                        continue
                    if depth < 3:
                        for _ in range(2):
                            fill(getattr(msg, f.name).add(), depth + 1)
                else:
                    getattr(msg, f.name).extend([value(0), value(1)])
            elif f.type == F.TYPE_MESSAGE:
                if depth < 3:
                    fill(getattr(msg, f.name), depth + 1)
            else:
                setattr(msg, f.name, value(0))
        return msg

    service = pb.DESCRIPTOR.services_by_name["KVOffload"]
    stub = pb_grpc.KVOffloadStub
    n = 0
    for m in service.methods:
        for desc in (m.input_type, m.output_type):
            cls = getattr(pb, desc.name)
            msg = fill(cls())
            wire = msg.SerializeToString()
            back = cls.FromString(wire)
            assert back == msg and back.SerializeToString() == wire, (m.name, desc.name)
            assert len(wire) > 0 or not desc.fields, (m.name, desc.name)
            n += 1
        assert hasattr(pb_grpc.KVOffloadServicer, m.name), m.name
    print(api_implementation.Type(), len(service.methods), n)
''')


def run(code: str, env: dict | None = None, path: list[str] | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    e["PYTHONPATH"] = os.pathsep.join((path or []) + [str(PKG_ROOT)])
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("impl", ["cpp", "upb", "python"])
def test_every_rpc_round_trips_on_this_runtime(impl):
    import google.protobuf
    from google.protobuf.internal import api_implementation

    if impl != "python" and api_implementation.Type() != impl:
        pytest.skip(f"this protobuf {google.protobuf.__version__} is built with {api_implementation.Type()}")
    r = run(ROUND_TRIP, {"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": impl})
    assert r.returncode == 0, r.stderr
    got_impl, methods, messages = r.stdout.split()
    assert got_impl == impl and int(methods) >= 11 and int(messages) == 2 * int(methods), r.stdout


@pytest.mark.parametrize("version", ["3.20.3", "3.19.6", "7.0.0", "8.30.1"])
def test_an_unsupported_runtime_fails_the_import_with_the_fix(tmp_path, version):
    pkg = tmp_path / "google" / "protobuf"
    pkg.mkdir(parents=True)
    (tmp_path / "google" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    r = run("import kvoffload", path=[str(tmp_path)])
    assert r.returncode != 0
    assert f"has protobuf {version}" in r.stderr and "pip install 'protobuf>=4.21,<7'" in r.stderr, r.stderr


def test_the_claim_in_pyproject_is_the_one_checked():
    from kvoffload._proto import PROTOBUF_REQUIREMENT

    text = (PKG_ROOT / "pyproject.toml").read_text()
    assert f'"{PROTOBUF_REQUIREMENT}"' in text
