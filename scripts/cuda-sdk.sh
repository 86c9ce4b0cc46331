#!/usr/bin/env bash
# Fetches what `go build -tags cuda` needs from the CUDA toolkit, and nothing
# more: the driver API header (cuda.h) and the link-time stub of the driver
# (stubs/libcuda.so), both from Debian's nvidia-cuda-dev (non-free, CUDA 11.8
# on bookworm). The package is downloaded once with `apt-get download` into a
# cache outside the repository, the two files are extracted from it, and the
# 774 MB .deb is deleted. Every later run only prints the flags.
#
#   eval "$(scripts/cuda-sdk.sh)"          # export CGO_CFLAGS/CGO_LDFLAGS here
#   scripts/cuda-sdk.sh --env-file FILE    # also write them to FILE (sourceable)
#
# $CACHE/env.sh always holds the same exports.
#
# The script neither installs packages nor edits /etc/apt: it gives apt a
# private sources file (bookworm non-free only) and private list and cache
# directories under $CACHE, so it needs no root, leaves the machine's apt
# configuration alone, and its `apt-get update` fetches one small index, only
# when that index is missing or stale. Proxies and other settings in the
# machine's apt.conf still apply. See docs/cuda.md.
#
# Environment:
#   KVOFFLOADD_CUDA_SDK_DIR  cache (default ${XDG_CACHE_HOME:-$HOME/.cache}/kvoffloadd/cuda-sdk)
#   KVOFFLOADD_CUDA_SUITE    Debian suite to take nvidia-cuda-dev from (default bookworm)
#   KVOFFLOADD_DEBIAN_MIRROR Debian mirror (default: the one this machine's apt uses, else deb.debian.org)
#   KVOFFLOADD_DEBIAN_KEYRING keyring that signs that suite (default Debian's archive keyring)
set -euo pipefail

PKG=nvidia-cuda-dev
SUITE=${KVOFFLOADD_CUDA_SUITE:-bookworm}
CACHE=${KVOFFLOADD_CUDA_SDK_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvoffloadd/cuda-sdk}
KEYRING=${KVOFFLOADD_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}

env_file=
while [ $# -gt 0 ]; do
  case "$1" in
    --env-file) env_file=${2:?--env-file needs a path}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "cuda-sdk.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done

log() { echo "cuda-sdk.sh: $*" >&2; }
die() { log "$*"; exit 1; }

case "$CACHE" in
  *[[:space:]]*) die "cache path '$CACHE' contains whitespace, which CGO_CFLAGS cannot carry; set KVOFFLOADD_CUDA_SDK_DIR" ;;
esac

# cgo's default CGO_CFLAGS is "-O2 -g"; setting the variable replaces it, so
# keep those and append.
emit() {
  local out
  out=$(printf "export CGO_CFLAGS='-O2 -g -I%s/include'\nexport CGO_LDFLAGS='-L%s/lib'\n" "$CACHE" "$CACHE")
  printf '%s\n' "$out" >"$CACHE/env.sh"
  if [ -n "$env_file" ]; then printf '%s\n' "$out" >"$env_file"; fi
  printf '%s\n' "$out"
}

ready() { [ -f "$CACHE/include/cuda.h" ] && [ -f "$CACHE/lib/libcuda.so" ] && [ -f "$CACHE/VERSION" ]; }

mkdir -p "$CACHE"
if ready; then emit; exit 0; fi

# Two builds started together (make -j) must not download twice.
exec 9>"$CACHE/.lock"
command -v flock >/dev/null && flock 9
if ready; then emit; exit 0; fi

for tool in apt-get apt-cache dpkg-deb tar; do
  command -v "$tool" >/dev/null || die "$tool not found: this script needs a Debian-like system with apt"
done
[ -r "$KEYRING" ] || die "no Debian archive keyring at $KEYRING (apt-get install debian-archive-keyring, or set KVOFFLOADD_DEBIAN_KEYRING)"

mirror=${KVOFFLOADD_DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
  # The mirror this machine already uses for Debian's main archive (a CI
  # runner may only reach its own mirror), whatever the format of its
  # sources (deb822 .sources or one-line sources.list). The $(...) is
  # apt's format syntax, not the shell's.
  # shellcheck disable=SC2016
  mirror=$(apt-get indextargets --format '$(REPO_URI)' 'Identifier: Packages' 'Component: main' 2>/dev/null |
    grep -v -e security -e '^cdrom:' | head -n1 || true)
  mirror=${mirror:-http://deb.debian.org/debian/}
fi

apt_dir="$CACHE/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/download" "$apt_dir/empty.d"
sources="$apt_dir/$SUITE-non-free.sources"
cat >"$sources.new" <<EOF
Types: deb
URIs: $mirror
Suites: $SUITE
Components: non-free
Signed-By: $KEYRING
EOF
if ! cmp -s "$sources.new" "$sources"; then
  # A changed mirror or suite makes the old index meaningless.
  mv "$sources.new" "$sources"
  rm -f "$apt_dir"/lists/*_Packages* "$apt_dir"/lists/*Release*
else
  rm -f "$sources.new"
fi

apt_opts=(
  -o "Dir::Etc::SourceList=$sources"
  -o "Dir::Etc::SourceParts=$apt_dir/empty.d"
  -o Dir::Etc::Preferences=/dev/null
  -o "Dir::Etc::PreferencesParts=$apt_dir/empty.d"
  -o "Dir::State::Lists=$apt_dir/lists"
  -o "Dir::Cache=$apt_dir/cache"
  -o Dir::State::status=/dev/null
  # As root apt downloads as _apt, which cannot write into the cache of
  # another user; the file comes from a signed index and is checked anyway.
  -o APT::Sandbox::User=root
)

known() { apt-cache "${apt_opts[@]}" show --no-all-versions "$PKG" 2>/dev/null | grep '^Version:' >/dev/null; }
refresh() {
  log "fetching the $SUITE non-free index from $mirror"
  apt-get "${apt_opts[@]}" -qq update >&2 || die "apt-get update of $SUITE non-free from $mirror failed"
}

if ! known; then refresh; fi
known || die "$PKG is not in $SUITE non-free at $mirror"

rm -f "$apt_dir"/download/*.deb
fetch() { (cd "$apt_dir/download" && apt-get "${apt_opts[@]}" -q download "$PKG" >&2); }
if ! fetch; then
  # The index can be stale (a point release replaced the file): refresh once.
  refresh
  fetch || die "apt-get download $PKG failed"
fi
deb=$(ls "$apt_dir"/download/"$PKG"_*.deb)
version=$(dpkg-deb -f "$deb" Version)

# Only the header and the stub (the package unpacks to 2.8 GB), in one pass
# over the archive: decompressing it is most of this script's time.
tmp="$CACHE/extract.tmp"
rm -rf "$tmp" && mkdir -p "$tmp"
log "extracting cuda.h and stubs/libcuda.so from $(basename "$deb")"
dpkg-deb --fsys-tarfile "$deb" |
  tar -x -C "$tmp" --no-same-owner --wildcards ./usr/include/cuda.h './usr/lib/*/stubs/libcuda.so'
stub_path=$(cd "$tmp" && find ./usr/lib -path '*/stubs/libcuda.so' -type f | head -n1)
[ -n "$stub_path" ] || die "no stubs/libcuda.so in $deb"

# cuda.h must need nothing but the C library; fail here, not in cgo.
if grep -E '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]' "$tmp/usr/include/cuda.h" |
  grep -v -E '[<"](stdlib|stdint|stddef)\.h[>"]' >&2; then
  die "cuda.h of $version includes headers this script does not extract (listed above)"
fi

mkdir -p "$CACHE/include" "$CACHE/lib"
mv "$tmp/usr/include/cuda.h" "$CACHE/include/cuda.h"
mv "$tmp/$stub_path" "$CACHE/lib/libcuda.so"
rm -rf "$tmp" "$deb"
printf '%s %s\n' "$PKG" "$version" >"$CACHE/VERSION"
log "$PKG $version: cuda.h and libcuda.so (stub) in $CACHE"
emit
