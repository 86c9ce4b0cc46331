# vLLM's image with the kvoffload connector's wheel in its Python
# environment, for vllm-kvoffloadd.yaml and gpu/. Build from the repository
# root, after `make wheel` (dist/kvoffload-$(cat VERSION)-py3-none-any.whl):
#
#   make wheel
#   docker build -f deploy/kubernetes/vllm.Dockerfile -t registry.example.com/vllm-kvoffload .
#
# Pin the vLLM release you run; docs/vllm.md says which vLLM interface the
# connector was written against. The wheel's version must be the daemon
# image's (docs/vllm.md, Versions): the daemon refuses a connector of another
# API protocol. Not built here (no container engine on the test machine).
ARG VLLM_IMAGE=vllm/vllm-openai:latest
FROM ${VLLM_IMAGE}
COPY dist/kvoffload-*-py3-none-any.whl /tmp/
RUN python3 -m pip install --no-cache-dir /tmp/kvoffload-*-py3-none-any.whl && rm -f /tmp/kvoffload-*.whl
