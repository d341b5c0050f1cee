# syntax=docker/dockerfile:1.7
# One image for every rewardmesh process: `rewardmesh serve reward`, `rewardmesh serve rollout` (hf or vllm
# backend) and the trainer (`rewardmesh demo`), on CUDA, with the project's vllm and otlp extras.
#
#   docker build -t REGISTRY/rewardmesh:0.1.0 .
#   docker run --rm --gpus all REGISTRY/rewardmesh:0.1.0 serve reward --port 50051
#
# vLLM pins the torch build it runs with (a CUDA build from PyPI, which carries its own CUDA libraries), so the
# base image only has to provide a CUDA user space the host driver accepts. Override with --build-arg:
#   CUDA_IMAGE  a CUDA base (Ubuntu 22.04 based, for its python3.11 packages)
#   VLLM_SPEC   the vLLM release (supported: 0.26 to 0.33; 0.32.0 is the one built for torch 2.13.0, the
#               torch the Makefile installs; vLLM pulls the torch it pins)
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04
# The runtime's system packages; k8s/live/build-image.sh installs the same list into its CPU image (Debian 12 has
# these names too). gcc and the Python headers: Triton (under vLLM and torch.compile) builds small C helpers at run
# time. bubblewrap (and g++ for C++ programs): the code reward's sandbox; the pod must allow user namespaces.
ARG RUNTIME_PACKAGES="python3.11 python3.11-dev gcc libc6-dev ca-certificates bubblewrap g++"

# ---------------------------------------------------------------------------------------------- build
FROM ${CUDA_IMAGE} AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev gcc g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src

# The heavy dependencies first, in a layer of their own, so editing the project's code does not reinstall them.
ARG VLLM_SPEC="vllm==0.32.0"
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --upgrade pip setuptools wheel \
    && pip install "${VLLM_SPEC}" "opentelemetry-exporter-otlp>=1.30"

# Only what the package needs: .dockerignore lets in nothing else (the one list both image builds use).
COPY . ./
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install ".[vllm,otlp,demo]" "${VLLM_SPEC}" \
    && python -c "import rewardmesh.server.cli, rewardmesh.client.trainer, rewardmesh.v1.reward_pb2_grpc" \
    && rewardmesh --help > /dev/null

# -------------------------------------------------------------------------------------------- runtime
FROM ${CUDA_IMAGE} AS runtime
ARG DEBIAN_FRONTEND=noninteractive
ARG RUNTIME_PACKAGES
RUN apt-get update \
    && apt-get install -y --no-install-recommends ${RUNTIME_PACKAGES} \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv

# Non-root, uid/gid 1000: the Kubernetes manifests run with runAsUser/runAsGroup/fsGroup 1000.
RUN groupadd --gid 1000 rewardmesh \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/rewardmesh --shell /usr/sbin/nologin rewardmesh
USER 1000:1000
WORKDIR /home/rewardmesh
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/rewardmesh \
    XDG_CACHE_HOME=/home/rewardmesh/.cache \
    HF_HOME=/home/rewardmesh/.cache/huggingface \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# 50051: RewardService, 50061: RolloutService (the servers' default ports); health and reflection on both.
EXPOSE 50051 50061
# No HEALTHCHECK: Kubernetes probes the gRPC health service natively (see k8s/).
ENTRYPOINT ["rewardmesh"]
CMD ["--help"]
