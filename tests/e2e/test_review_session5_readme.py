"""Review pass 5 (README against the code): defects a test can show.

Each test failed when it was written; the docstring says what the README promises and where the
code falls short. Real processes only: LocalCluster agents and the installed `mooncake` script.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from mooncake_store import LocalCluster
from mooncake_store.transport import frames

from .conftest import Mooncake


def test_local_cluster_agent_keeps_closing_bad_connections_after_many_warnings(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """README's SDK section starts clusters with `LocalCluster` (also the demo and
    examples/kv_transfer.py), and DESIGN.md §3.6 promises "never a hung agent" on bad input.
    LocalCluster.add_agent (client/cluster.py) starts each agent with ``stderr=subprocess.PIPE``
    and never reads it. The agent logs a WARNING per unknown op (agent/server.py `_dispatch`), so
    after about 64 KiB of warnings (~770 bad frames) its stderr pipe is full: every connection
    thread that logs then blocks forever in the write, and its connection is never closed (a
    heartbeat or sync failure logged from then on would stall that thread too). `mooncake up`
    sends agent stderr to a log file and has no such limit."""
    cluster = make_cluster(1, host_bytes=4 << 20)
    host, port = cluster.agents[0].endpoint.rsplit(":", 1)
    bad = frames.pack(99)  # a well-formed header with an op the agent does not know
    for batch in range(15):  # 1500 frames: about twice what fills a 64 KiB pipe
        socks = []
        for _ in range(100):
            s = socket.create_connection((host, int(port)), timeout=5.0)
            s.sendall(bad)
            socks.append(s)
        try:
            for i, s in enumerate(socks):
                try:
                    # The agent answers an unknown op (BAD_REQUEST, its version), then closes.
                    s.recv(frames.HEADER_BYTES, socket.MSG_WAITALL)
                    closed = s.recv(1) == b""
                except TimeoutError:
                    closed = False
                assert closed, (
                    f"bad frame {batch * 100 + i + 1}: the agent did not close the connection within 5 s "
                    "(its stderr pipe, which LocalCluster never reads, is full)"
                )
        finally:
            for s in socks:
                s.close()
    assert cluster.agents[0].alive()


def test_mooncake_agent_takes_the_gpu_tier_options(mooncake: Mooncake) -> None:
    """README, Tiers: "gpu (`--gpu-mem SIZE --gpu-id N` ...)", and its command table says
    `mooncake agent` is "what each node and docker-compose run". Only `python -m
    mooncake_store.agent` has --gpu-mem/--gpu-id; `mooncake agent` (cli/commands/agent.py) answers
    "No such option: --gpu-mem", so a node run the documented way cannot have a GPU tier except
    through MOONCAKE_AGENT_GPU_BYTES. The agent may still refuse to start here (no Redis at this
    URL, or no cupy/CUDA device): what must not happen is a usage error about the option."""
    result = mooncake(
        "agent", "--host-mem", "4MiB", "--gpu-mem", "64MiB", "--gpu-id", "0",
        "--redis-url", "redis://127.0.0.1:1/0", timeout=60,
    )  # fmt: skip
    stderr = result.stderr.decode(errors="replace")
    assert "No such option" not in stderr, stderr
    assert result.returncode != 0  # nothing listens on port 1 (and this machine may have no GPU)


def test_mooncake_agent_help_names_the_config_section(mooncake: Mooncake) -> None:
    """`mooncake agent --help` renders --config as "TOML config file ( section)." : the help string
    "([agent] section)" is parsed as rich markup (the app uses rich_markup_mode="rich") and the
    section name disappears."""
    result = mooncake("agent", "--help")
    assert result.returncode == 0
    text = result.stdout.decode(errors="replace")
    assert "[agent]" in text, [line for line in text.splitlines() if "--config" in line]
