#!/usr/bin/env bash
# Installs the Debian packages that `make test` needs and that this machine
# lacks; `make test` runs it first, so the README's test command works on a
# fresh Debian machine that has only Go. It installs with apt-get when run as
# root or with passwordless sudo; otherwise it names what is missing and the
# command that installs it, and fails.
#
#   scripts/test-deps.sh           install what is missing
#   scripts/test-deps.sh --check   only report; exit 1 when something is missing
#   scripts/test-deps.sh --list    print the package list
#
# Debian's prometheus and redis-server packages ship services. Installing them
# here does not start them (a temporary policy-rc.d refuses the start, where
# the machine has none of its own); Debian still enables them for the next
# boot. No test uses those services or their ports: the tests start their own
# redis-server and read promtool, on free ports and temp dirs.
set -euo pipefail

# The one list: a package a line, with what needs it. Adding one is one line.
PACKAGES=(
  make              # the Makefile
  gcc               # cgo: go test -race and the CUDA compile check
  libc6-dev         #   the C headers cgo compiles against (gcc only recommends it)
  ca-certificates   # go fetching modules over HTTPS
  python3           # the Python client and connector tests
  python3-grpcio    #   their gRPC
  python3-protobuf  #   their messages
  python3-pytest    #   their runner
  python3-msgpack   # KV events: vLLM's event encoding
  python3-zmq       # KV events: the ZMQ publisher
  python3-build     # make wheel: the connector's wheel and sdist, offline
  python3-setuptools #   their build backend
  python3-wheel     #   the wheel format
  python3-venv      #   the test that installs the wheel into a fresh venv
  redis-server      # kvbench's Redis baseline, the remote tier's test cluster
  redis-tools       # redis-cli --cluster create for that cluster
  prometheus        # promtool: check and unit-test deploy/prometheus/alerts.yml
  systemd           # systemd-analyze verify: deploy/systemd/kvoffloadd.service
)

mode=install
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  --list) printf '%s\n' "${PACKAGES[@]}"; exit 0 ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "test-deps.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
esac

log() { echo "test-deps.sh: $*" >&2; }

if ! command -v go >/dev/null; then
  log "no go on PATH: install Go (see go.mod for the version) from https://go.dev/dl/ first"
  exit 1
fi
if ! command -v dpkg-query >/dev/null; then
  log "not a Debian-based machine (no dpkg-query); install the equivalents of: ${PACKAGES[*]}"
  exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

install_cmd="apt-get update && apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$mode" = check ]; then
  log "missing: ${missing[*]}"
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  log "missing Debian packages: ${missing[*]}"
  log "this user is not root and has no passwordless sudo; as root, run:"
  log "  $install_cmd"
  exit 1
fi

log "installing: ${missing[*]}"
# Keep package scripts from starting services (policy-rc.d exit 101 means
# "action forbidden"; invoke-rc.d and deb-systemd-invoke both ask it), unless
# the machine already has a policy of its own, which is left as it is.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  "${sudo[@]}" sh -c "printf '#!/bin/sh\nexit 101\n' > $policy && chmod 755 $policy"
  trap '"${sudo[@]}" rm -f "$policy"' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
