# syntax=docker/dockerfile:1
# ExpertCache images: one build, one target per service (helm/expertcache runs them).
#
#   docker build --target compute   -t expertcache-compute .     CUDA runtime base
#   docker build --target daemon    -t expertcache-daemon .      CUDA runtime base
#   docker build --target predictor -t expertcache-predictor .   slim Python base
#   docker build --target convert   -t expertcache-convert .     slim Python base (the store's init job)
#
# The builder stage builds the project's wheel (`pip wheel .`: the native core with its CUDA path,
# compiled by nvcc with the CUDA runtime linked statically, and the generated gRPC code); every
# image installs that wheel and its requirements into /opt/venv, and no image holds the source
# tree. Every image runs as uid/gid 10001: compute and the daemon share the pod's /run/expertcache
# volume (arena, slot table, unix socket), whose files are owner-only. Nothing writes to the root
# filesystem at run time (bytecode is compiled here; HOME and caches go to /tmp, an emptyDir in the
# chart), so the chart runs them with readOnlyRootFilesystem.
#
# Build arguments:
#   CUDA_VERSION         the CUDA images' tag (devel for the builder, runtime for compute/daemon)
#   PYTHON_IMAGE         base of the predictor and convert images (same Python minor as Ubuntu's)
#   PIP_EXTRA_INDEX_URL  an extra package index for the slim images, e.g. one serving a CPU-only
#                        torch build (torch is a requirement of the wheel; the predictor does not
#                        run it): empty = PyPI only

ARG CUDA_VERSION=12.8.1
ARG PYTHON_IMAGE=python:3.12-slim-trixie

# -- the wheel --------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS builder
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# liburing and ISA-L are optional fast paths of the native core; the build copies their shared
# libraries next to the module, so the images need neither package.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-dev python3-venv build-essential git liburing-dev libisal-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/build-venv
ENV PATH=/opt/build-venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml CMakeLists.txt README.md LICENSE ./
COPY csrc ./csrc
COPY proto ./proto
COPY expertcache ./expertcache
COPY compute_svc ./compute_svc
COPY cache_daemon ./cache_daemon
COPY predictor_svc ./predictor_svc
COPY replay ./replay
RUN python -m pip wheel --no-deps -w /wheels . \
      -Ccmake.define.EXPERTCACHE_WITH_CUDA=ON \
      -Ccmake.define.EXPERTCACHE_WITH_URING=ON \
      -Ccmake.define.EXPERTCACHE_WITH_ISAL=ON

# -- the CUDA runtime images (compute, daemon) ------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04 AS cuda-runtime
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 expertcache \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin expertcache
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install /wheels/expertcache-*.whl \
 && /opt/venv/bin/python -m compileall -q /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/cache \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp

FROM cuda-runtime AS compute
EXPOSE 50051
ENTRYPOINT ["expertcache-compute"]

FROM cuda-runtime AS daemon
ENTRYPOINT ["expertcache-daemon"]

# -- the slim images (predictor, convert) -----------------------------------------------------------
FROM ${PYTHON_IMAGE} AS slim-runtime
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 10001 expertcache \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin expertcache
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m venv /opt/venv \
 && /opt/venv/bin/pip install ${PIP_EXTRA_INDEX_URL:+--extra-index-url "$PIP_EXTRA_INDEX_URL"} \
      /wheels/expertcache-*.whl \
 && /opt/venv/bin/python -m compileall -q /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/cache \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp

FROM slim-runtime AS predictor
EXPOSE 50070
ENTRYPOINT ["expertcache-predictor"]

FROM slim-runtime AS convert
ENTRYPOINT ["expertcache-convert"]
