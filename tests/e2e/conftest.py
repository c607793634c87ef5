"""End-to-end fixtures: the installed `mooncake` console script, run as a subprocess with a state
directory of its own, so no test ever reads or stops the real user's cluster."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import mooncake_bin

# Small arenas: the suite runs several clusters on a 2-core machine with a few GiB of /dev/shm.
HOST_MEM = "64MiB"


@dataclass(frozen=True, slots=True)
class Mooncake:
    """Runs the CLI with one environment: its own state dir and no MOONCAKE_* from the caller."""

    env: dict[str, str]
    state_dir: Path

    def __call__(
        self, *args: str, stdin: bytes | None = None, timeout: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [mooncake_bin(), *args],
            input=stdin,
            capture_output=True,
            env={**self.env, **(env or {})},
            timeout=timeout,
            check=False,
        )

    def popen(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([mooncake_bin(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env)

    def ok(
        self, *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        result = self(*args, stdin=stdin, env=env)
        assert result.returncode == 0, (args, result.returncode, result.stderr.decode(errors="replace"))
        return result

    def state(self) -> dict[str, Any]:
        return dict(json.loads((self.state_dir / "cluster.json").read_text()))


def make_mooncake(root: Path) -> Mooncake:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    env.update(
        MOONCAKE_STATE_DIR=str(root / "state"),
        XDG_CONFIG_HOME=str(root / "config"),  # no user config file leaks in
        COLUMNS="200",  # help and tables unwrapped, so tests can search them
        NO_COLOR="1",
    )
    return Mooncake(env=env, state_dir=root / "state")


@pytest.fixture
def mooncake(tmp_path: Path) -> Mooncake:
    """A CLI with an empty state dir: no cluster recorded."""
    return make_mooncake(tmp_path)


@pytest.fixture(scope="module")
def cluster_cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mooncake]:
    """A CLI whose state dir records a detached 2-agent cluster, shared by a module's tests."""
    cli = make_mooncake(tmp_path_factory.mktemp("cluster"))
    try:
        cli.ok("up", "--detach", "--agents", "2", "--host-mem", HOST_MEM)
        yield cli
    finally:
        cli("down", "--timeout", "5")


def error_lines(result: subprocess.CompletedProcess[bytes]) -> list[str]:
    return [line for line in result.stderr.decode(errors="replace").splitlines() if line.strip()]


def assert_one_line_error(result: subprocess.CompletedProcess[bytes], code: int, *needles: str) -> str:
    lines = error_lines(result)
    assert result.returncode == code, (result.returncode, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def pid_alive() -> Callable[[int], bool]:
    def check(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] != "Z"

    return check
