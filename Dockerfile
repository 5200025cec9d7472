# syntax=docker/dockerfile:1
# One image for epd-encode-worker, epd-prefill and epd-handshake (k8s/, docs/deploy.md).
#   docker build -t ghcr.io/<org>/epd-encode-worker:0.1.0 .
# CUDA 12 throughout: the mooncake-cuda12 extra's wheel links libcudart.so.12 (from this base
# image), and PyPI's torch 2.13.0 is a CUDA 13 build, so torch comes from PyTorch's CUDA 12.8 index.
# A CUDA 13 image: a CUDA 13 base, TORCH_INDEX_URL=.../cu130 and MOONCAKE=mooncake-cuda13.
FROM nvidia/cuda:12.8.1-base-ubuntu24.04

ARG TORCH_VERSION=2.13.0
# transformers' video processors (video items) run on torchvision's transforms
ARG TORCHVISION_VERSION=0.28.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG MOONCAKE=mooncake-cuda12

# Mooncake's engine links libibverbs, libnuma and libcurl; ibverbs-providers holds the HCA
# drivers (mlx5 ...), librdmacm the RDMA connection manager, ibverbs-utils ibv_devinfo.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils libnuma1 libcurl4t64 \
 && rm -rf /var/lib/apt/lists/*

ENV PATH=/opt/epd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    OMP_WAIT_POLICY=PASSIVE \
    HOME=/tmp
RUN python3 -m venv /opt/epd \
 && pip install --no-cache-dir -U pip \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
      --index-url "${TORCH_INDEX_URL}"

COPY . /src
RUN pip install --no-cache-dir "/src[encoder,${MOONCAKE}]" && pip check

# The uid the manifests run as (runAsUser: 10001).
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp epd
USER 10001:10001
CMD ["epd-encode-worker", "--help"]
