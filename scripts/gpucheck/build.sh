#!/usr/bin/env bash
# Builds the CUDA daemon and the checker for the GPU check into OUTDIR:
#   OUTDIR/kvoffloadd, OUTDIR/gpucheck  (-tags cuda, against the pinned CUDA
#   11.8 header of scripts/cuda-sdk.sh; they load the driver's libcuda.so.1
#   at run time, any newer driver will do)
#   OUTDIR/cuda-symbols.txt             every libcuda symbol they import, so
#   that the check can ask the GPU machine's driver for each before running.
# The header is never taken from /usr/local/cuda: the binaries must be the
# same whatever toolkit the build machine has. Set CGO_CFLAGS/CGO_LDFLAGS to
# override on purpose.
#
#   scripts/gpucheck/build.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: build.sh OUTDIR}
log() { echo "build.sh: $*" >&2; }
command -v go >/dev/null || { log "go not found"; exit 1; }
if [ -z "${CGO_CFLAGS:-}" ]; then
  eval "$(scripts/cuda-sdk.sh)"
fi
version=$(git describe --always --dirty 2>/dev/null || echo dev)
mkdir -p "$out"
log "building kvoffloadd and gpucheck ($version) with -tags cuda against $(cat "${KVOFFLOADD_CUDA_SDK_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvoffloadd/cuda-sdk}/VERSION" 2>/dev/null || echo "CGO_CFLAGS=$CGO_CFLAGS")"
go build -tags cuda -trimpath -ldflags "-s -w -X main.version=$version" -o "$out/kvoffloadd" ./cmd/kvoffloadd
go build -tags cuda -trimpath -ldflags "-s -w" -o "$out/gpucheck" ./scripts/gpucheck
syms() {
  if command -v nm >/dev/null; then
    nm -D --undefined-only "$1" | awk '$2 ~ /^cu/ {print $2}'
  else
    readelf --dyn-syms -W "$1" | awk '$7 == "UND" && $8 ~ /^cu/ {sub(/@.*/, "", $8); print $8}'
  fi
}
{ syms "$out/kvoffloadd"; syms "$out/gpucheck"; } | sort -u >"$out/cuda-symbols.txt"
[ -s "$out/cuda-symbols.txt" ] || { log "found no libcuda symbols in the binaries"; exit 1; }
printf '%s\n' "$version" >"$out/VERSION"
log "$(wc -l <"$out/cuda-symbols.txt") libcuda symbols imported; binaries in $out"
