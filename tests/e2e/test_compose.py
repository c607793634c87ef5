"""docker-compose.yml parses and describes the cluster: `docker compose config` where the compose
plugin exists (it needs no engine), else a structural check with PyYAML."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def _compose_plugin() -> bool:
    docker = shutil.which("docker")
    if not docker:
        return False
    probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = str(text).lower().rstrip("b")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _check(config: dict[str, Any]) -> None:
    services = config["services"]
    assert "redis" in services
    agents = {name: svc for name, svc in services.items() if name.startswith("agent")}
    assert len(agents) >= 2
    for name, svc in agents.items():
        command = svc["command"]
        command = command.split() if isinstance(command, str) else command
        assert command[0] == "agent", name
        host_mem = command[command.index("--host-mem") + 1]
        # The arena lives in /dev/shm: the container's shm must hold it (Docker's default is 64 MiB).
        from mooncake_store.config import parse_size

        assert _parse_size(svc["shm_size"]) > parse_size(host_mem), name
        assert "--listen" in command and "--node-id" in command
        env = svc["environment"]
        env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else env
        assert env["MOONCAKE_REDIS_URL"].startswith("redis://redis:")
        assert "redis" in svc["depends_on"]
    assert (ROOT / "Dockerfile").read_text().count("ENTRYPOINT") == 1


def test_compose_file_is_valid() -> None:
    if _compose_plugin():
        result = subprocess.run(
            ["docker", "compose", "-f", str(COMPOSE), "config", "--format", "json"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr.decode()
        import json

        _check(json.loads(result.stdout))
        return
    import yaml

    config = yaml.safe_load(COMPOSE.read_text())
    # Resolve the `<<: *agent` merge keys the way compose does (PyYAML already merges them).
    _check(config)
    assert "client" in COMPOSE.read_text()  # the commented client example
