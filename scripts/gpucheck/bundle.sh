#!/usr/bin/env bash
# `make gpu-bundle`: everything the GPU check needs on a GPU machine that has
# the NVIDIA driver, PyTorch, grpcio and protobuf but no Go, no network and
# any CUDA toolkit (or none), in one folder and one tarball:
#
#   DIR/gpu-check.sh            run this there (scripts/gpu-check.sh)
#   DIR/BUNDLE                  marks the prebuilt mode; what was built, how
#   DIR/bin/                    kvoffloadd, gpucheck, cuda-symbols.txt, VERSION
#   DIR/gpucheck/               run.py, torch_check.py
#   DIR/python/kvoffload/       the Python client and connector code
#   DIR.tar.gz
#
#   scripts/gpucheck/bundle.sh DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:?usage: bundle.sh DIR}
log() { echo "bundle.sh: $*" >&2; }
rm -rf "$dir"
mkdir -p "$dir/bin" "$dir/gpucheck" "$dir/python"
scripts/gpucheck/build.sh "$dir/bin"
cp scripts/gpu-check.sh "$dir/gpu-check.sh"
cp scripts/gpucheck/run.py scripts/gpucheck/torch_check.py "$dir/gpucheck/"
# The package as git has it: no caches, nothing untracked.
git ls-files -z clients/python/kvoffload | while IFS= read -r -d '' f; do
  d="$dir/python/${f#clients/python/}"
  mkdir -p "$(dirname "$d")"
  cp "$f" "$d"
done
# A package file not yet committed (a work tree ahead of git) still goes in.
for f in clients/python/kvoffload/*.py; do
  [ -e "$dir/python/${f#clients/python/}" ] || cp "$f" "$dir/python/${f#clients/python/}"
done
sdk=${KVOFFLOADD_CUDA_SDK_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvoffloadd/cuda-sdk}
cat >"$dir/BUNDLE" <<INFO
kvoffloadd GPU check bundle $(cat "$dir/bin/VERSION")
built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m) with $(go version | cut -d' ' -f3-)
CUDA header: $(cat "$sdk/VERSION" 2>/dev/null || echo "CGO_CFLAGS=${CGO_CFLAGS:-}")
Run ./gpu-check.sh on a machine with an NVIDIA GPU, its driver, python3 with
torch (CUDA), grpcio and protobuf. See docs/cuda.md, "The GPU check".
INFO
chmod +x "$dir/gpu-check.sh"
tar -C "$(dirname "$dir")" -czf "$dir.tar.gz" "$(basename "$dir")"
log "bundle: $dir ($(du -sh "$dir" | cut -f1)), $dir.tar.gz ($(du -h "$dir.tar.gz" | cut -f1), $(stat -c %s "$dir.tar.gz") bytes)"
