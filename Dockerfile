# Image with etc-agent, its etcd v3 client and torch; `etcrun` is the entry point.
#   docker build -t etc-agent .
#   docker run --rm etc-agent --help
#   docker build --build-arg EXTRAS=megatron -t etc-agent:megatron .   # with megatron-core (pinned)
FROM python:3.11-slim
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/etc-agent

# torch first: the largest layer, changes least often.
COPY constraints.txt ./
RUN pip install -c constraints.txt torch

COPY pyproject.toml README.md ./
COPY etc_agent ./etc_agent
COPY configs ./configs
COPY scripts ./scripts
RUN pip install -c constraints.txt ".${EXTRAS:+[$EXTRAS]}" && python -c "import pyetcd, etc_agent; print('etc-agent', etc_agent.__version__)"

ENTRYPOINT ["etcrun"]
CMD ["--help"]
