# One stage per component from a shared base (docs/images.md); each image is `pdserve <subcommand>`.
#
#   everything (operator, router, workers; the chart's default): docker build -t pdserve:0.1.0 .
#   router + endpoint picker, no torch:  docker build --target router -t pdserve-router:0.1.0 .
#   operator, no torch:                  docker build --target operator -t pdserve-operator:0.1.0 .
#   workers:                             docker build --target worker -t pdserve-worker:0.1.0 .
#   CUDA: add --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (worker, all)
#
# Each stage installs its pyproject extra (pdserve[router], [operator], [worker], [all]).
# torch goes in first, from the chosen index: a bare `torch` requirement (or nixl first)
# would pull a multi-GB default build. The CUDA wheels bundle their CUDA runtime, so the
# same slim base serves both; the GPU driver comes from the node (NVIDIA device plugin).
ARG PYTHON_VERSION=3.11

# --- build: a venv per component from the same sources ----------------------------------
FROM python:${PYTHON_VERSION}-slim AS source
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pdserve/ pdserve/
COPY engine/ engine/
COPY transfer/ transfer/
COPY prefill_worker/ prefill_worker/
COPY decode_worker/ decode_worker/
COPY worker/ worker/
COPY router/ router/
COPY operator/ operator/
COPY planner/ planner/
COPY local/ local/
COPY charts/pdserve/crds/ charts/pdserve/crds/
RUN python -m venv /opt/pdserve
ENV PATH=/opt/pdserve/bin:$PATH

FROM source AS build-router
RUN pip install ".[router]" && pdserve router --help >/dev/null

FROM source AS build-operator
RUN pip install ".[operator]" && pdserve render --help >/dev/null

FROM source AS build-worker
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
RUN pip install ".[worker]" && pdserve decode-worker --help >/dev/null

FROM build-worker AS build-all
RUN pip install ".[all]" && pdserve --help >/dev/null

# --- run: one slim base, non-root, tini; each component adds only its venv ---------------
FROM python:${PYTHON_VERSION}-slim AS base
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 pdserve \
    && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin pdserve
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf
# Kubernetes pods run with a read-only root filesystem; everything writable is a volume.
WORKDIR /tmp
ENTRYPOINT ["/usr/bin/tini", "--", "pdserve"]
CMD ["--help"]

FROM base AS router
COPY --from=build-router /opt/pdserve /opt/pdserve
USER 1000:1000
EXPOSE 8080 8083 9002

FROM base AS operator
COPY --from=build-operator /opt/pdserve /opt/pdserve
USER 1000:1000
EXPOSE 8080

# libnuma: UCX (NIXL's backend) loads it at run time; g++ (and libgomp with it): the CPU
# attention kernel and torch.compile's CPU code are built on the node at first start
# (without it workers fall back to the gather path and eager).
FROM base AS worker-base
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 g++ \
    && rm -rf /var/lib/apt/lists/*

FROM worker-base AS worker
COPY --from=build-worker /opt/pdserve /opt/pdserve
USER 1000:1000
EXPOSE 8080 8081 8082

# The default target: every component in one image (what the chart and the operator run
# when an LLMService names no image).
FROM worker-base AS all
COPY --from=build-all /opt/pdserve /opt/pdserve
USER 1000:1000
EXPOSE 8080 8081 8082 8083
