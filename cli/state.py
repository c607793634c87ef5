"""The per-user record of the cluster `mooncake up` started, so later commands in other shells find
it with no flags and `mooncake down` stops exactly what was started.

Lives in ``$MOONCAKE_STATE_DIR`` (default ``~/.local/state/mooncake``, the XDG state directory) as
``cluster.json``, written atomically (temp file + rename) and readable only by its owner.

While `mooncake up` starts its processes, ``cluster-starting.json`` (written the same way) names
what it has started so far and the `up` process itself, rewritten after each spawn and removed once
``cluster.json`` is written or the failed start is undone. An `up` killed outright (SIGKILL) half
way leaves it behind: `mooncake down`, and the next `up`, stop what it names.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from mooncake_cli.exits import CliError, ExitCode
from mooncake_cli.procs import ProcRef, alive

STATE_DIR_ENV = "MOONCAKE_STATE_DIR"
STATE_FILE = "cluster.json"
STARTING_FILE = "cluster-starting.json"
STATE_VERSION = 1
_Record = TypeVar("_Record")


def state_dir() -> Path:
    configured = os.environ.get(STATE_DIR_ENV, "")
    if configured:
        path = Path(configured).expanduser()
        if not path.is_absolute():
            # Taken from the working directory, each directory a command ran in had a state of its
            # own: `mooncake stat` or `down` run elsewhere than `up` found no cluster, and a second
            # `up` from another directory started a second cluster beside the first.
            raise CliError(
                f"{STATE_DIR_ENV}={configured!r} is a relative path: every command would look for the cluster "
                f"in its own working directory; give an absolute one (here: {STATE_DIR_ENV}={path.absolute()})",
                ExitCode.USAGE,
            )
        return path
    # A relative XDG_STATE_HOME is to be ignored (the XDG base directory spec): taken from the
    # working directory, `down` run elsewhere than `up` found no cluster to stop.
    xdg = os.environ.get("XDG_STATE_HOME", "")
    base = xdg if os.path.isabs(xdg) else str(Path.home() / ".local" / "state")
    return Path(base) / "mooncake"


def state_path() -> Path:
    return state_dir() / STATE_FILE


def starting_path() -> Path:
    return state_dir() / STARTING_FILE


@dataclass(slots=True, kw_only=True)
class AgentRecord:
    node_id: str
    proc: ProcRef
    shm_name: str
    endpoint: str

    def to_dict(self) -> dict[str, Any]:
        return {"node_id": self.node_id, **self.proc.to_dict(), "shm_name": self.shm_name, "endpoint": self.endpoint}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AgentRecord:
        return cls(
            node_id=str(data["node_id"]),
            proc=ProcRef.from_dict(data),
            shm_name=str(data.get("shm_name", "")),
            endpoint=str(data.get("endpoint", "")),
        )


@dataclass(slots=True, kw_only=True)
class ClusterState:
    redis_url: str
    namespace: str
    mode: str  # "detached" or "foreground"
    owner: ProcRef | None = None  # the `mooncake up` process of a foreground cluster
    servers: list[ProcRef] = field(default_factory=list)  # embedded server wrapper, then the server itself
    server_dir: str = ""  # the embedded server's temp dir ("" for an external server)
    agents: list[AgentRecord] = field(default_factory=list)
    log_dir: str = ""
    started_at: float = field(default_factory=time.time)
    #: The boot the processes ran in: after a reboot a PID and its start time can come again.
    boot_id: str = field(default_factory=lambda: current_boot_id())

    @property
    def shm_segments(self) -> list[str]:
        return [a.shm_name for a in self.agents if a.shm_name]

    def all_procs(self) -> list[ProcRef]:
        return [*([self.owner] if self.owner else []), *(a.proc for a in self.agents), *self.servers]

    def running(self) -> bool:
        """True while any recorded process still runs, or when none is recorded: `up --agents 0
        --redis-url URL` records a cluster of that server's, of which nothing here can die (taken
        for one no longer running, every command that finds it with no flags failed, exit 4)."""
        procs = self.all_procs()
        return not procs or any(alive(p) for p in procs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "redis_url": self.redis_url,
            "namespace": self.namespace,
            "mode": self.mode,
            "owner": self.owner.to_dict() if self.owner else None,
            "servers": [s.to_dict() for s in self.servers],
            "server_dir": self.server_dir,
            "agents": [a.to_dict() for a in self.agents],
            "shm_segments": self.shm_segments,
            "log_dir": self.log_dir,
            "started_at": self.started_at,
            "boot_id": self.boot_id,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterState:
        owner = data.get("owner")
        state = cls(
            redis_url=str(data["redis_url"]),
            namespace=str(data.get("namespace", "default")),
            mode=str(data.get("mode", "detached")),
            owner=ProcRef.from_dict(owner) if owner else None,
            servers=[ProcRef.from_dict(s) for s in data.get("servers", [])],
            server_dir=str(data.get("server_dir", "")),
            agents=[AgentRecord.from_dict(a) for a in data.get("agents", [])],
            log_dir=str(data.get("log_dir", "")),
            started_at=float(data.get("started_at", 0.0)),
            boot_id=str(data.get("boot_id", "")),
        )
        if state.boot_id and state.boot_id != current_boot_id():
            # Recorded before a reboot: none of those processes runs, whatever now has their PIDs.
            state.owner, state.servers = None, []
            for agent in state.agents:
                agent.proc = ProcRef(pid=0, start_ticks=0)
        return state


def current_boot_id() -> str:
    """This boot's id (Linux), "" where there is none to read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(slots=True, kw_only=True)
class StartingRecord:
    """What a `mooncake up` has started so far (``cluster``), and that `up` process (``up``): while
    ``up`` runs it is still starting; once it is gone (SIGKILL runs no cleanup) nothing else will
    stop what it started, unless this record is read."""

    up: ProcRef
    cluster: ClusterState

    def to_dict(self) -> dict[str, Any]:
        return {**self.cluster.to_dict(), "up": self.up.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StartingRecord:
        cluster = ClusterState.from_dict(data)
        up = ProcRef.from_dict(data["up"])
        if cluster.boot_id and cluster.boot_id != current_boot_id():
            up = ProcRef(pid=0, start_ticks=0)  # recorded before a reboot, as from_dict's processes
        return cls(up=up, cluster=cluster)


def _load(path: Path, parse: Callable[[dict[str, Any]], _Record]) -> _Record | None:
    """The record at ``path`` as ``parse`` reads it; None when there is none."""
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CliError(f"cannot read the state file {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else '?'}")
        return parse(data)
    except RecursionError:  # json reads nesting by recursion: a few thousand levels were an internal error
        raise CliError(
            f"the state file {path} is damaged (nested too deep to read); stop its processes by hand and delete it",
            ExitCode.ERROR,
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CliError(
            f"the state file {path} is damaged ({exc}); stop its processes by hand and delete it", ExitCode.ERROR
        ) from None


def _write_private(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # mkstemp: a new file (O_EXCL) of mode 0600 under a name no one can guess. A name from the pid
    # alone, opened with O_TRUNC, followed a link another user had put there in a shared state
    # directory and truncated its target; and the file names processes to kill, so no one else
    # may rewrite it.
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load_state() -> ClusterState | None:
    return _load(state_path(), ClusterState.from_dict)


def save_state(state: ClusterState) -> Path:
    return _write_private(state_path(), state.to_dict())


def clear_state() -> None:
    with contextlib.suppress(FileNotFoundError):
        state_path().unlink()


def load_starting() -> StartingRecord | None:
    return _load(starting_path(), StartingRecord.from_dict)


def save_starting(record: StartingRecord) -> Path:
    return _write_private(starting_path(), record.to_dict())


def clear_starting() -> None:
    with contextlib.suppress(FileNotFoundError):
        starting_path().unlink()
