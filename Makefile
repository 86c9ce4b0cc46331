# kvoffloadd: `make run` starts the daemon on embedded defaults; `make test`
# runs every test. See README.md.
GO      ?= go
PYTHON  ?= /usr/bin/python3
# The project's one version (the VERSION file): the daemon's --version and
# Stats, the image's tag, the wheel's (kvoffload/_version.py must agree:
# `make wheel` refuses otherwise).
VERSION ?= $(shell cat VERSION)
LDFLAGS := -X main.version=$(VERSION)

# The CUDA build (docs/cuda.md): scripts/cuda-sdk.sh fetches cuda.h and the
# libcuda.so stub once into ~/.cache and prints the cgo flags.
CUDA_ENV = eval "$$(./scripts/cuda-sdk.sh)"

.PHONY: all build kvbench kvbench-restart kvbench-scale run test deps test-go test-policy test-python soak-connector vet fmt proto bench clean build-cuda cuda-check gpu-check gpu-bundle image image-cuda wheel soak soak-invalidation

all: build

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o bin/kvoffloadd ./cmd/kvoffloadd
	$(GO) build -o bin/kvoffload-health ./cmd/kvoffload-health
	$(GO) build -o bin/kvbench ./bench/cmd/kvbench

# The engine-shaped benchmark (docs/benchmarks.md); --quick is under a minute.
kvbench: build
	./bin/kvbench --quick

# A restart on a full 4 GiB disk tier: start to SERVING and the background
# recovery against a raw sequential read of the same file (docs/benchmarks.md).
kvbench-restart: build
	./bin/kvbench --scenarios restart --redis-server none

# Issue 34's scale scenario: 4 KiB blocks at each SCALE_BLOCKS count,
# concurrent Stores, Lookups during WatchEvents snapshots, a kill -9 and
# recovery (docs/benchmarks.md). 10^6
# blocks take an 8 GiB CPU tier and a 9 GB disk tier. The bounded checks of
# items 1 and 2 run in `make test` (e2e/scale_test.go).
SCALE_BLOCKS ?= 10000,100000,1000000
kvbench-scale: build
	./bin/kvbench --scenarios scale --scale-blocks $(SCALE_BLOCKS) --baselines=false --redis-server none

run: build
	./bin/kvoffloadd

# Everything: first the Debian packages the tests need (installed when
# missing: scripts/test-deps.sh), then go vet, every Go test under the race
# detector (deploy/ included: the systemd unit, Kubernetes manifests, image,
# dashboard and alert rules), the admission policy's tests without it (the
# race detector drops the policy's pooled access buffers on purpose; see
# e2e/race_test.go), the Python client and connector against the real
# daemon, and the CUDA build's compile check.
test: deps vet test-go test-policy test-python cuda-check

deps:
	./scripts/test-deps.sh

test-go:
	$(GO) test -race -count=1 ./...

# Also the tests too slow under the race detector (65,536 leases on a block).
test-policy:
	$(GO) test -count=1 -run 'HotPrefix|ManyLeases' ./e2e

test-python: build
	KVOFFLOADD_BIN=$(CURDIR)/bin/kvoffloadd $(PYTHON) -m pytest -q clients/python/tests

# The vLLM stand-in with the connector against daemons with failing disks,
# restarted and stopped mid-run, for SOAK_MINUTES (docs/vllm.md).
SOAK_MINUTES ?= 10
soak-connector: build
	KVOFFLOADD_BIN=$(CURDIR)/bin/kvoffloadd $(PYTHON) clients/python/tests/soak_connector.py --minutes $(SOAK_MINUTES)

vet:
	$(GO) vet ./...

fmt:
	gofmt -l -w $$(git ls-files '*.go')

# The model-based randomized test (docs/model-test.md) against one daemon
# for as long as asked: SOAK_DURATION=30m make soak. It prints the counts
# (operations, blocks verified, faults, restarts, wrong bytes, the daemon's
# RSS and goroutines at start and end). SOAK_SHAPE, SOAK_SEED, SOAK_OFF and
# SOAK_TOL choose the run; SOAK_RACE=1 builds the daemon with -race.
SOAK_DURATION ?= 10m
soak:
	$(GO) build $(if $(filter 1,$(SOAK_RACE)),-race) -ldflags "$(LDFLAGS)" -o bin/kvoffloadd-soak ./cmd/kvoffloadd
	KVOFFLOADD_BIN=$(CURDIR)/bin/kvoffloadd-soak SOAK_DURATION=$(SOAK_DURATION) \
		$(GO) test -count=1 -timeout 0 -run '^TestSoak$$' -v ./e2e/model

# Invalidations racing stores, late SETs and reshards on a Redis Cluster of
# its own, two daemons (e2e/remote TestInvalidationSoak; docs/remote.md):
# SOAK_ROUNDS rounds (40000 is about 10 minutes here), SOAK_SEED to replay.
# Fails on the first invalidated block offered or loaded.
SOAK_ROUNDS ?= 40000
soak-invalidation:
	KVOFFLOADD_REQUIRE_REDIS=1 KVO_SOAK_ROUNDS=$(SOAK_ROUNDS) $(if $(SOAK_SEED),KVO_SOAK_SEED=$(SOAK_SEED)) \
		$(GO) test -count=1 -timeout 0 -run '^TestInvalidationSoak$$' -v ./e2e/remote

# Regenerates the committed protobuf code (Go and Python) with pinned
# generator versions.
proto:
	./scripts/protogen.sh

# Benchmarks in benchstat's format: make bench > new.txt; benchstat old.txt new.txt
bench:
	$(GO) test -run '^$$' -bench . -benchmem -count 6 ./index ./e2e

build-cuda:
	$(CUDA_ENV) && $(GO) build -tags cuda -ldflags "$(LDFLAGS)" -o bin/kvoffloadd ./cmd/kvoffloadd

# On a machine without a GPU: the cuda-tagged tree builds and vets, and the
# GPU check's Python scripts compile. (The engine itself is tested over a
# fake driver by test-go, with or without the tag.)
cuda-check:
	$(CUDA_ENV) && $(GO) build -tags cuda ./... && $(GO) vet -tags cuda ./dma/cuda/ ./scripts/gpucheck/ ./cmd/kvoffloadd/
	$(PYTHON) -m py_compile scripts/gpucheck/run.py scripts/gpucheck/torch_check.py

# On a machine with an NVIDIA GPU and Go: builds, then runs the GPU check
# (docs/cuda.md). Without Go there: copy the bundle over and run its script.
gpu-check:
	./scripts/gpu-check.sh

# The GPU check, prebuilt, for a GPU machine without Go or network:
# dist/kvoffloadd-gpu-bundle/ and dist/kvoffloadd-gpu-bundle.tar.gz.
GPU_BUNDLE ?= dist/kvoffloadd-gpu-bundle
gpu-bundle:
	./scripts/gpucheck/bundle.sh $(GPU_BUNDLE)

# An OCI image of the static daemon and its health probe, written without
# pulling a base image (deploy/image): bin/kvoffloadd-image.tar, which
# `docker load`, `podman load` and `skopeo copy oci-archive:` take.
# IMAGE_ARCH cross-builds (amd64, arm64). See docs/operations.md, Deploying.
IMAGE_ARCH ?= $(shell $(GO) env GOARCH)
IMAGE_TAG  ?= kvoffloadd:$(VERSION)
image:
	$(GO) run ./deploy/image --arch $(IMAGE_ARCH) --tag $(IMAGE_TAG) --version $(VERSION) --out bin/kvoffloadd-image.tar

# The CUDA build's image (deploy/image --cuda): bin/kvoffloadd-cuda-image.tar,
# for this machine's architecture, with the C libraries the daemon links
# copied from here but libcuda.so.1, which the NVIDIA container toolkit
# mounts from the node's driver. docs/operations.md, The CUDA image.
CUDA_IMAGE_TAG ?= kvoffloadd-cuda:$(VERSION)
image-cuda:
	$(CUDA_ENV) && $(GO) run ./deploy/image --cuda --tag $(CUDA_IMAGE_TAG) --version $(VERSION) --out bin/kvoffloadd-cuda-image.tar

# The Python client and connector as a wheel and an sdist, built offline
# with the system's setuptools (Debian: python3-build python3-setuptools
# python3-wheel): dist/kvoffload-$(VERSION)-py3-none-any.whl and
# dist/kvoffload-$(VERSION).tar.gz. docs/vllm.md, Install.
WHEEL_DIR ?= dist
wheel:
	@v=$$(sed -n 's/^__version__ = "\(.*\)"$$/\1/p' clients/python/kvoffload/_version.py); \
	  [ "$$v" = "$$(cat VERSION)" ] || { echo "wheel: VERSION says $$(cat VERSION), clients/python/kvoffload/_version.py says $$v" >&2; exit 1; }
	$(PYTHON) -m build --no-isolation --sdist --wheel --outdir $(WHEEL_DIR) clients/python
	rm -rf clients/python/build clients/python/kvoffload.egg-info

clean:
	rm -rf bin dist
