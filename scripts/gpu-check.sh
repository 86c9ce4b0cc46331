#!/usr/bin/env bash
# The GPU check of kvoffloadd: one prepared run, under 5 minutes, that proves
# the CUDA path on a machine with an NVIDIA GPU and writes one JSON and one
# short text summary (results.json, summary.txt in the output folder).
#
# Two ways to run it:
#   - from a bundle (`make gpu-bundle` on any Linux machine with Go, then
#     copy dist/kvoffloadd-gpu-bundle.tar.gz over): ./gpu-check.sh
#     The GPU machine needs the NVIDIA driver and python3 with torch (CUDA),
#     grpcio and protobuf; no Go, no network, no CUDA toolkit (any toolkit
#     it has is ignored).
#   - from the source tree, with Go: scripts/gpu-check.sh (builds the same
#     binaries first, with scripts/gpucheck/build.sh).
#
# What runs (scripts/gpucheck/run.py): preflight (GPUs, the driver's
# libcuda.so.1 and every symbol the binaries import), a two-process CUDA IPC
# probe, the daemon bench (consecutive and scattered blocks, byte-exact,
# throughput beside plain pinned copies; fails below --min-ratio, default
# 0.9), real torch tensors through the connector's exporter with IPC events
# and an engine killed mid-store, a clean SIGTERM, and a device fault on
# purpose in a second daemon. See docs/cuda.md.
#
#   gpu-check.sh [--out DIR] [--device N] [--min-ratio R] [--skip-sticky] [--cpu-bytes 4GiB] [--budget 285]
#
# Environment: PYTHON (default python3), KVOFFLOADD_LIBCUDA (the driver's
# libcuda.so.1, when it cannot be found).
# Exit status: 0 pass, 1 a failure, 2 only a throughput ratio below target.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}

log() { echo "gpu-check.sh: $*" >&2; }
die() { log "$*"; exit 1; }

command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON)"

if [ -f "$here/BUNDLE" ]; then
  # Prebuilt: never builds anything.
  bundle=$here
  bin=$here/bin
  gcdir=$here/gpucheck
  pypath=$here/python
  log "prebuilt bundle: $(head -n1 "$here/BUNDLE")"
else
  root=$(cd "$here/.." && pwd)
  command -v go >/dev/null || die "no Go on this machine: build the bundle elsewhere (make gpu-bundle) and run its gpu-check.sh here"
  bundle=$root
  bin=$root/bin/gpu-check
  gcdir=$root/scripts/gpucheck
  pypath=$root/clients/python
  "$root/scripts/gpucheck/build.sh" "$bin"
fi
for f in "$bin/kvoffloadd" "$bin/gpucheck" "$bin/cuda-symbols.txt" "$gcdir/run.py" "$gcdir/torch_check.py" "$pypath/kvoffload/__init__.py"; do
  [ -e "$f" ] || die "missing $f"
done

# The driver's libcuda.so.1, never a toolkit's link stub or its
# forward-compatibility copy: the loader's cache first, then the places
# drivers and container runtimes put it, then wherever torch loaded it from.
find_libcuda() {
  local p d
  if [ -n "${KVOFFLOADD_LIBCUDA:-}" ]; then echo "$KVOFFLOADD_LIBCUDA"; return; fi
  p=$(ldconfig -p 2>/dev/null | awk '$1 == "libcuda.so.1" && $NF !~ /stubs|compat/ {print $NF; exit}')
  if [ -n "$p" ] && [ -e "$p" ]; then echo "$p"; return; fi
  for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/aarch64-linux-gnu /usr/local/nvidia/lib64 /usr/local/nvidia/lib \
    /run/nvidia/driver/usr/lib/x86_64-linux-gnu /usr/lib/wsl/lib; do
    if [ -e "$d/libcuda.so.1" ]; then echo "$d/libcuda.so.1"; return; fi
  done
  "$PYTHON" - <<'PY' 2>/dev/null || true
import torch
torch.cuda.init()
for line in open("/proc/self/maps"):
    f = line.split()[-1]
    if "libcuda.so" in f and "stubs" not in f:
        print(f)
        break
PY
}
libcuda=$(find_libcuda | head -n1)
[ -n "$libcuda" ] && [ -e "$libcuda" ] || die "cannot find the NVIDIA driver's libcuda.so.1 (set KVOFFLOADD_LIBCUDA)"
case "$libcuda" in */stubs/*) die "$libcuda is the toolkit's link stub, not the driver's library (set KVOFFLOADD_LIBCUDA)" ;; esac
# Make the binaries load exactly that one, whatever LD_LIBRARY_PATH said.
export LD_LIBRARY_PATH="$(dirname "$libcuda")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
log "driver library: $libcuda"
if command -v nvidia-smi >/dev/null; then nvidia-smi -L >&2 || true; fi

exec "$PYTHON" "$gcdir/run.py" --bin "$bin" --bundle "$bundle" --pythonpath "$pypath" --libcuda "$libcuda" --python "$PYTHON" "$@"
