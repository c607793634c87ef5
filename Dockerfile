# The mooncake-store image: the SDK, the agent and the `mooncake` CLI.
#   docker build -t mooncake-store .
#   docker run --rm --shm-size=2g -e MOONCAKE_REDIS_URL=redis://HOST:6379/0 mooncake-store agent --host-mem 1GiB
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Metadata first, so the dependency layer is reused while only the code changes.
COPY pyproject.toml README.md ./
COPY mooncake_store ./mooncake_store
COPY cli ./cli
RUN pip install . && rm -rf /src

# Agents hold their arena in /dev/shm: run containers with shm_size >= the arena (--host-mem) plus slack.
WORKDIR /
ENTRYPOINT ["mooncake"]
CMD ["--help"]
