# One image for the operator, the router and both workers: `pdserve <subcommand>`.
#
#   CPU:  docker build -t pdserve:0.1.0 .
#   CUDA: docker build -t pdserve:0.1.0-cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# torch goes in first, from the chosen index: a bare `torch` requirement (or nixl first)
# would pull a multi-GB default build. The CUDA wheels bundle their CUDA runtime, so the
# same slim base serves both; the GPU driver comes from the node (NVIDIA device plugin).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/pdserve
ENV PATH=/opt/pdserve/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
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
RUN pip install . && pdserve --help >/dev/null

FROM python:${PYTHON_VERSION}-slim
# libnuma: UCX (NIXL's backend) loads it at run time; tini reaps children and forwards signals.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 tini ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 pdserve \
    && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin pdserve
COPY --from=build /opt/pdserve /opt/pdserve
ENV PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf
# Kubernetes pods run with a read-only root filesystem; everything writable is a volume.
USER 1000:1000
WORKDIR /tmp
EXPOSE 8080 8081 8082
ENTRYPOINT ["/usr/bin/tini", "--", "pdserve"]
CMD ["--help"]
