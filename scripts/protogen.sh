#!/usr/bin/env bash
# Regenerates the committed protobuf and gRPC code with pinned generators.
# protoc itself comes from Debian (protobuf-compiler); the Go plugins are
# installed at the versions below into ./bin so nothing global changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PROTOC_GEN_GO=v1.36.12
PROTOC_GEN_GO_GRPC=v1.5.1
command -v protoc >/dev/null || { echo "protoc missing: apt-get install -y protobuf-compiler" >&2; exit 1; }
mkdir -p bin
GOBIN="$PWD/bin" go install "google.golang.org/protobuf/cmd/protoc-gen-go@${PROTOC_GEN_GO}"
GOBIN="$PWD/bin" go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@${PROTOC_GEN_GO_GRPC}"
PATH="$PWD/bin:$PATH" protoc -I rpc \
  --go_out=rpc --go_opt=paths=source_relative \
  --go-grpc_out=rpc --go-grpc_opt=paths=source_relative \
  rpc/kvoffload/v1/kvoffload.proto
if [ -x scripts/protogen-python.sh ]; then scripts/protogen-python.sh; fi
