#!/usr/bin/env bash
# Proves the CUDA path on a machine with an NVIDIA GPU, by hand (CI has no
# GPU): builds kvoffloadd and scripts/gpucheck with -tags cuda, starts the
# daemon on a private socket, runs gpucheck against it (store behind a ready
# event, overwrite, load into other blocks, byte-for-byte compare; then
# daemon throughput against plain pinned cuMemcpy*Async), stops the daemon.
# gpucheck prints one line per figure; the script exits non-zero on any
# mismatch or failure. It takes well under five minutes.
#
#   scripts/gpu-check.sh [gpucheck flags]      e.g. --min-ratio 0.9 --device 1
#
# Headers and link stub, in this order: CGO_CFLAGS/CGO_LDFLAGS if set; a
# toolkit under /usr/local/cuda; else scripts/cuda-sdk.sh (apt and network;
# set KVOFFLOADD_CUDA_SDK_DIR to a cache copied along to an offline machine).
# At run time the binaries load the driver's libcuda.so.1. See docs/cuda.md.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "gpu-check.sh: $*" >&2; }

if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L >&2 || true
else
  log "nvidia-smi not found; trying anyway"
fi

if [ -z "${CGO_CFLAGS:-}" ]; then
  if [ -f /usr/local/cuda/include/cuda.h ] && [ -f /usr/local/cuda/lib64/stubs/libcuda.so ]; then
    export CGO_CFLAGS="-O2 -g -I/usr/local/cuda/include" CGO_LDFLAGS="-L/usr/local/cuda/lib64/stubs"
  else
    eval "$(scripts/cuda-sdk.sh)"
  fi
fi

mkdir -p bin
log "building bin/kvoffloadd and bin/gpucheck with -tags cuda"
go build -tags cuda -o bin/kvoffloadd ./cmd/kvoffloadd
go build -tags cuda -o bin/gpucheck ./scripts/gpucheck

work=$(mktemp -d) # mode 0700: the daemon wants a private socket directory
sock="$work/kvoffloadd.sock"
bin/kvoffloadd --socket "$sock" --cpu-bytes 2GiB --metrics-addr "" >"$work/daemon.log" 2>&1 &
daemon=$!
stop_daemon() {
  if kill -0 "$daemon" 2>/dev/null; then
    kill -TERM "$daemon"
    wait "$daemon" || true
  fi
}
trap 'stop_daemon; rm -rf "$work"' EXIT

# gpucheck waits (up to 30 s) for the daemon's health service itself.
rc=0
timeout 270 bin/gpucheck --socket "$sock" "$@" || rc=$?
stop_daemon
if [ "$rc" -ne 0 ] || grep -q 'level=ERROR' "$work/daemon.log"; then
  log "daemon log (last 40 lines):"
  tail -n 40 "$work/daemon.log" >&2
fi
if ! grep -q 'copy_engine=cuda' "$work/daemon.log"; then
  log "the daemon did not run the cuda copy engine (is it wired in cmd/kvoffloadd for -tags cuda?)"
  [ "$rc" -ne 0 ] || rc=1
fi
if [ "$rc" -eq 0 ]; then log "PASS"; else log "FAIL (exit $rc)"; fi
exit "$rc"
