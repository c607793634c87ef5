# The mooncake-store image: the SDK, the agent and the `mooncake` CLI.
#   docker build -t mooncake-store .
#   docker run --rm --shm-size=2g -p 7601:7601 -e MOONCAKE_REDIS_URL=redis://HOST:6379/0 mooncake-store \
#       agent --host-mem 1GiB --listen 0.0.0.0:7601 --advertise THIS_HOST:7601
# (an agent listens on loopback unless told otherwise, and publishes the address peers dial:
# --advertise names this host's address, which the agent checks is not another agent's)
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# The dependencies first, from the metadata alone (empty packages stand in for the code), so
# that their layer is reused while only the code changes; then the code, without them.
COPY pyproject.toml README.md ./
RUN for p in config index index/lua tiers transport policy agent client integrations; do \
        mkdir -p mooncake_store/$p && touch mooncake_store/$p/__init__.py; done \
    && mkdir -p cli/commands && touch mooncake_store/__init__.py cli/__init__.py cli/commands/__init__.py \
    && pip install . && pip uninstall -y mooncake-store && rm -rf mooncake_store cli build
COPY mooncake_store ./mooncake_store
COPY cli ./cli
RUN pip install --no-deps . && rm -rf /src

# Agents hold their arena in /dev/shm: run containers with shm_size >= the arena (--host-mem) plus slack.
WORKDIR /
ENTRYPOINT ["mooncake"]
CMD ["--help"]
