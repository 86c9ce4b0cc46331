# vLLM's image with the kvoffload connector package (clients/python) in its
# Python environment, for vllm-kvoffloadd.yaml. Build from the repository root:
#
#   docker build -f deploy/kubernetes/vllm.Dockerfile -t registry.example.com/vllm-kvoffload .
#
# Pin the vLLM release you run; docs/vllm.md says which vLLM interface the
# connector was written against.
ARG VLLM_IMAGE=vllm/vllm-openai:latest
FROM ${VLLM_IMAGE}
COPY clients/python /tmp/kvoffload
RUN python3 -m pip install --no-cache-dir /tmp/kvoffload && rm -rf /tmp/kvoffload
