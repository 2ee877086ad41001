# syntax=docker/dockerfile:1.7
# The etc-agent image: a venv with etc-agent and torch, `etcrun` the entry point under tini.
#   scripts/build_image.sh                      # builds (docker, or podman/buildah without a daemon) and smoke-tests
#   docker build -t etc-agent:cpu .             # FLAVOUR=cpu (default): torch's CPU build, constraints.txt
#   docker build --build-arg FLAVOUR=cuda -t etc-agent:cuda .   # torch's CUDA build, constraints-cuda.txt
#   docker run --rm etc-agent:cpu --standalone --nproc-per-node 2 -m etc_agent.examples.gpt --steps 20
# Build arguments and secrets, the base digest's refresh, the user and the signals:
# docs/deployment.md#the-image.

# python:3.11-slim-bookworm by digest (refresh: docs/deployment.md#the-image).
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${BASE_IMAGE} AS build
# cpu or cuda: which lock file, and which build of torch.
ARG FLAVOUR=cpu
# Extras of the package to install beside it, e.g. megatron.
ARG EXTRAS=""
# Where torch's CPU wheels are (the cpu flavour). A directory listing of wheels works too (find-links).
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 DEBIAN_FRONTEND=noninteractive

# tini from Debian (its static build is copied into the runtime stage, which gets no apt state).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends tini \
    && cp /usr/bin/tini-static /tini && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/etc-agent
ENV PATH=/opt/etc-agent/bin:$PATH
WORKDIR /src

# torch first: the largest layer, and the one that changes least often. A CA bundle for networks
# that re-sign TLS comes as the secret ca_bundle (it never lands in a layer).
COPY constraints.txt constraints-cuda.txt ./
RUN --mount=type=secret,id=ca_bundle,required=false \
    set -eu; \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    case "$FLAVOUR" in \
      cpu) lock=constraints.txt; torch="torch==$(sed -n 's/^torch==//p' constraints.txt)+cpu"; \
           set -- ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} ;; \
      cuda) lock=constraints-cuda.txt; torch="torch==$(sed -n 's/^torch==//p' constraints-cuda.txt)"; set -- ;; \
      *) echo "FLAVOUR must be cpu or cuda, not $FLAVOUR" >&2; exit 2 ;; \
    esac; \
    echo "$lock" > /opt/etc-agent/lock-file; \
    pip install -q "$@" -c "$lock" "$torch"

COPY pyproject.toml README.md ./
COPY etc_agent ./etc_agent
RUN --mount=type=secret,id=ca_bundle,required=false \
    set -eu; \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    lock=$(cat /opt/etc-agent/lock-file); \
    pip wheel -q --no-deps -w /wheels . \
    && wheel=$(ls /wheels/etc_agent-*.whl) \
    && pip install -q -c "$lock" "${wheel}${EXTRAS:+[$EXTRAS]}" \
    && pip check \
    && python -c "import pyetcd, torch, etc_agent; print('etc-agent', etc_agent.__version__, 'torch', torch.__version__)"
# The C++ test programs and protoc that torch's wheel ships (about 130 MB) are neither imported nor
# run; torch_shm_manager (shared-memory tensors between processes) stays.
RUN torch_dir=$(python -c "import os, torch; print(os.path.dirname(torch.__file__))") \
    && rm -rf "$torch_dir/test" \
    && find "$torch_dir/bin" -mindepth 1 -maxdepth 1 ! -name torch_shm_manager -exec rm -rf {} + \
    && python -c "import torch.distributed, etc_agent.cli.etcrun"
COPY configs /opt/etc-agent/share/configs

FROM ${BASE_IMAGE} AS runtime
ARG BASE_IMAGE
ARG FLAVOUR=cpu
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="etc-agent" \
      org.opencontainers.image.description="Elastic launcher for hybrid-parallel PyTorch training (etcrun, a drop-in for torchrun) with live state migration" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.etc-agent.flavour="${FLAVOUR}"

# One fixed UID and GID for every container of a pod: a sidecar agent can signal only the workers
# of its own user (shareProcessNamespace), and files on shared volumes keep one owner.
RUN echo "etc:x:10001:10001:etc-agent:/home/etc:/usr/sbin/nologin" >> /etc/passwd \
    && echo "etc:x:10001:" >> /etc/group \
    && mkdir -p /home/etc /workspace && chown 10001:10001 /home/etc /workspace
COPY --from=build /tini /usr/bin/tini
COPY --from=build /opt/etc-agent /opt/etc-agent
ENV PATH=/opt/etc-agent/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/home/etc
USER 10001:10001
WORKDIR /workspace
# tini is PID 1: it forwards SIGTERM (a pod's termination, `docker stop`) to etcrun alone, which
# turns it into a planned departure (its workers hand their state over first), and it reaps the
# orphans that PID 1 inherits. A user script goes under /workspace (docs/deployment.md).
ENTRYPOINT ["tini", "--", "etcrun"]
CMD ["--help"]
