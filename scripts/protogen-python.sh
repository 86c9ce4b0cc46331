#!/usr/bin/env bash
# Regenerates the committed Python protobuf and gRPC stubs of the kvoffload.v1
# API under clients/python/kvoffload/_proto/ with Debian's generators:
#   protoc              (protobuf-compiler, 3.21 on bookworm)
#   grpc_python_plugin  (protobuf-compiler-grpc, 1.51 on bookworm)
# The output matches Debian bookworm's python3-protobuf (3.21) and
# python3-grpcio (1.51). scripts/protogen.sh runs this script when it is
# executable.
#
# protoc writes `from kvoffload.v1 import kvoffload_pb2` into the gRPC stub,
# which only works with _proto/ on sys.path; the import is rewritten to a
# relative one so the stubs work from inside the installed package.
set -euo pipefail
cd "$(dirname "$0")/.."

for tool in protoc grpc_python_plugin; do
  command -v "$tool" >/dev/null || {
    echo "protogen-python.sh: $tool missing: apt-get install -y protobuf-compiler protobuf-compiler-grpc" >&2
    exit 1
  }
done

out=clients/python/kvoffload/_proto
pkg=$out/kvoffload/v1
mkdir -p "$pkg"
rm -f "$pkg"/kvoffload_pb2.py "$pkg"/kvoffload_pb2_grpc.py

protoc -I rpc \
  --python_out="$out" \
  --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$(command -v grpc_python_plugin)" \
  rpc/kvoffload/v1/kvoffload.proto

sed -i 's/^from kvoffload\.v1 import kvoffload_pb2 as /from . import kvoffload_pb2 as /' "$pkg/kvoffload_pb2_grpc.py"
if grep -q '^from kvoffload\.v1' "$pkg/kvoffload_pb2_grpc.py"; then
  echo "protogen-python.sh: an absolute import is left in $pkg/kvoffload_pb2_grpc.py" >&2
  exit 1
fi

for d in "$out" "$out/kvoffload" "$pkg"; do
  [ -f "$d/__init__.py" ] || printf '# Generated package: see scripts/protogen-python.sh.\n' >"$d/__init__.py"
done
echo "protogen-python.sh: wrote $pkg/kvoffload_pb2.py and kvoffload_pb2_grpc.py ($(protoc --version))"
