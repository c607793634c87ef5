"""Start and stop a local cluster (embedded server + agent processes) that outlives this process.

Both `mooncake up` modes use this: every process gets a session of its own, so a Ctrl-C in the
terminal, or the terminal closing, never kills an agent half-way; the CLI stops them in order
(agents first, so they can still deregister from Redis, then the server) by recorded PID.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mooncake_cli.exits import CliError, ExitCode
from mooncake_cli.procs import (
    ProcRef,
    alive,
    log_tail,
    own_error,
    ref_of,
    remove_segments,
    spawn_detached,
    terminate,
    wait_for_line,
    wait_for_match,
)
from mooncake_cli.signals import signals_deferred
from mooncake_cli.state import (
    AgentRecord,
    ClusterState,
    StartingRecord,
    clear_starting,
    clear_state,
    save_starting,
    state_dir,
)

from mooncake_store.config import redact_url
from mooncake_store.tiers.host import arenas_refused, segment_pattern

_SERVER_PID_RE = re.compile(r", pid (\d+)(?:, temp dir (.+?))?\s*$", re.MULTILINE)
#: How the embedded server names its temp dir (tempfile.mkdtemp's prefix in mooncake_store.embedded).
_SERVER_DIR_PREFIX = "mooncake-redis-"


@dataclass(slots=True, kw_only=True)
class LaunchPlan:
    num_agents: int
    host_bytes: int
    redis_url: str | None  # None: start the embedded server
    namespace: str
    port: int = 0
    zone: str | None = None
    timeout_s: float = 30.0
    mode: str = "detached"


@dataclass(slots=True)
class StopReport:
    stopped: int = 0
    killed: int = 0
    segments: list[str] = field(default_factory=list)


def check_shm_room(num_agents: int, host_bytes: int) -> None:
    why = arenas_refused(num_agents, host_bytes)
    if why is not None:
        raise CliError(
            f"{why}; use a smaller --host-mem or fewer --agents",
            ExitCode.NO_CAPACITY,
        )


def _start_server(plan: LaunchPlan, logs: Path, state: ClusterState, save_progress: Callable[[], None]) -> str:
    out, log = logs / "server.out", logs / "server.log"
    log.write_bytes(b"")
    # runpy warns that the package imported the module it is about to run (mooncake_store imports
    # it for LocalCluster): harmless here, and it showed in every error's log tail.
    quiet = ["-W", "ignore::RuntimeWarning:runpy"]
    cmd = [sys.executable, *quiet, "-m", "mooncake_store.embedded", "--port", str(plan.port), *_owned(plan)]
    with signals_deferred():
        proc = spawn_detached(cmd, stdout=out, stderr=log)
        state.servers.append(ref_of(proc.pid))
        save_progress()
    line = wait_for_line(proc, out, "redis://", plan.timeout_s)
    if line is None:
        raise CliError(f"the embedded Redis server {_not_up(proc, log, plan.timeout_s)}", _code_of(proc))
    # The wrapper prints the server's own pid right after the URL; recording it lets `down` stop
    # the server even if the wrapper was killed outright.
    found = wait_for_match(proc, log, _SERVER_PID_RE, 2.0)
    if found:
        with signals_deferred():
            state.servers.append(ref_of(int(found.group(1))))
            state.server_dir = found.group(2) or ""
            save_progress()
    return line.strip()


def _owned(plan: LaunchPlan) -> list[str]:
    """In the foreground, the processes stop once this one is gone however it went (SIGKILL runs
    no cleanup: the whole cluster ran on, holding its arenas, until `mooncake down`); detached, they
    outlive it by design."""
    return ["--exit-with-parent", str(os.getpid())] if plan.mode == "foreground" else []


def _not_up(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> str:
    """Why a process did not say it was ready: it exited (with its status), or the time ran out;
    then the end of its log."""
    code = proc.poll()
    why = f"exited with status {code}" if code is not None else f"did not become ready within {timeout_s:g} s"
    # Its own last word ("error: port 7000 ... is already in use") says more than the log's last
    # lines, which are often the server's unrelated warnings printed after it.
    said = own_error(log)
    if said:
        return f"{why}: {said}"
    tail = log_tail(log)
    return f"{why}: {tail}" if tail else why


def _code_of(proc: subprocess.Popen[bytes]) -> ExitCode:
    """The exit status of a process that ended as it started, where it says what this command's
    would (agents and the server's wrapper share its codes: 2 a port in use or a bad value, 4 no
    Redis, 5 no room for an arena); any other end, or none yet, is an error."""
    code = proc.poll()
    passed = (ExitCode.USAGE, ExitCode.CANNOT_CONNECT, ExitCode.NO_CAPACITY)
    return ExitCode(code) if code in passed else ExitCode.ERROR


def _agent_env(redis_url: str, namespace: str) -> dict[str, str]:
    # The URL travels in the environment, not argv: a password in it would show in `ps`.
    env = os.environ.copy()
    env["MOONCAKE_REDIS_URL"] = redis_url
    env["MOONCAKE_NAMESPACE"] = namespace
    return env


def _start_agents(plan: LaunchPlan, logs: Path, state: ClusterState, save_progress: Callable[[], None]) -> None:
    env = _agent_env(state.redis_url, plan.namespace)
    started: list[tuple[str, subprocess.Popen[bytes], Path, Path]] = []
    # Start all, then wait for all: agents come up in parallel.
    for i in range(plan.num_agents):
        node_id = f"agent-{i}"
        out, log = logs / f"{node_id}.out", logs / f"{node_id}.log"
        log.write_bytes(b"")
        cmd = [sys.executable, "-m", "mooncake_store.agent", "--host-bytes", str(plan.host_bytes), "--node-id", node_id]
        cmd += _owned(plan)
        if plan.zone:
            cmd += ["--zone", plan.zone]
        with signals_deferred(), out.open("wb") as fo, log.open("ab") as fe:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, env=env, start_new_session=True, close_fds=True
            )
            state.agents.append(
                AgentRecord(
                    node_id=node_id,
                    proc=ref_of(proc.pid),
                    shm_name=segment_pattern(plan.namespace, node_id, proc.pid),  # its name, once READY says it
                    endpoint="",
                )
            )
            save_progress()
        started.append((node_id, proc, out, log))
    for record, (node_id, proc, out, log) in zip(state.agents, started, strict=True):
        line = wait_for_line(proc, out, "READY ", plan.timeout_s)
        if line is None:
            raise CliError(f"agent {node_id} {_not_up(proc, log, plan.timeout_s)}", _code_of(proc))
        ready = json.loads(line[len("READY ") :])
        record.shm_name = str(ready["shm_name"])
        record.endpoint = str(ready["endpoint"])


def launch(plan: LaunchPlan, owner: ProcRef | None = None) -> ClusterState:
    """Start the processes of ``plan``; on any failure stop what was started and raise.

    After each spawn what was started so far is written to the state directory's starting record
    (cluster-starting.json), with this process's own ref: a `mooncake up` killed outright half way
    (SIGKILL runs no cleanup) left its server and agents running with no record, out of `mooncake
    down`'s reach. The caller removes the record once the cluster is recorded (a failed start
    removes it here, once undone)."""
    logs = state_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True, mode=0o700)
    state = ClusterState(
        redis_url=plan.redis_url or "",
        namespace=plan.namespace,
        mode=plan.mode,
        owner=owner,
        log_dir=str(logs),
    )
    starting = StartingRecord(up=ref_of(os.getpid()), cluster=state)

    def save_progress() -> None:
        save_starting(starting)

    try:
        if plan.redis_url is None:
            state.redis_url = _start_server(plan, logs, state, save_progress)
        _start_agents(plan, logs, state, save_progress)
    except BaseException:
        stop_uninterrupted(state)
        raise
    return state


def stop_uninterrupted(state: ClusterState) -> StopReport:
    """Stop what a failed start started, with SIGINT, SIGTERM and SIGHUP deferred until it is done:
    a second Ctrl-C during the cleanup cut it short, and what it had not stopped yet (the embedded
    server, say) ran on unrecorded, out of `mooncake down`'s reach. The starting record goes last,
    once nothing it names runs."""
    with signals_deferred():
        report = stop(state, timeout_s=5.0, own=True)
        clear_starting()
        return report


def stop(state: ClusterState, *, timeout_s: float, own: bool = False) -> StopReport:
    """Stop every recorded process (agents, then servers), remove leftover segments and the state
    file. ``own``: this process is the cluster's owner (it must not wait for itself)."""
    report = _stop_processes(state, timeout_s=timeout_s, own=own)
    clear_state()
    return report


def stop_abandoned(starting: StartingRecord, *, timeout_s: float) -> StopReport:
    """Stop what a `mooncake up` that is gone without finishing its start had started (by
    recorded PID and start time, as for a recorded cluster), remove its segments and server temp
    dir, then its starting record. cluster.json is left alone: it is not this start's."""
    report = _stop_processes(starting.cluster, timeout_s=timeout_s, own=False)
    clear_starting()
    return report


def _stop_processes(state: ClusterState, *, timeout_s: float, own: bool) -> StopReport:
    report = StopReport()
    owner = state.owner
    # Counted before anything is signalled: a foreground owner stops its agents and server itself,
    # and counting only what was still running after it reported 1 process for a whole cluster.
    running = [ref for ref in [*(a.proc for a in state.agents), *state.servers] if alive(ref)]
    if owner is not None and not own and owner.pid != os.getpid() and alive(owner):
        # A foreground `mooncake up` stops its own cluster on SIGTERM; give it the time it needs.
        report.killed += len(terminate([owner], timeout_s + 10.0))
        report.stopped += 1
    agents = [a.proc for a in state.agents if alive(a.proc)]
    report.killed += len(terminate(agents, timeout_s))
    report.segments = remove_segments(state.shm_segments)
    for server in state.servers:  # the wrapper first: it stops the server and removes its temp dir
        if alive(server):
            report.killed += len(terminate([server], timeout_s))
    report.stopped += len(running)
    if state.server_dir:
        _remove_server_dir(Path(state.server_dir))  # a wrapper killed outright left it
    return report


def _remove_server_dir(path: Path) -> None:
    """The embedded server's temp dir, once its processes are stopped; only a directory named as
    the server names them and owned by this user (the path comes from the state file)."""
    if not path.is_absolute() or not path.name.startswith(_SERVER_DIR_PREFIX):
        return
    try:
        info = path.lstat()
    except OSError:
        return  # gone already: its wrapper removed it
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
        shutil.rmtree(path, ignore_errors=True)


def describe(state: ClusterState) -> list[str]:
    lines = [f"redis {redact_url(state.redis_url)}  namespace {state.namespace}"]
    for agent in state.agents:
        lines.append(f"{agent.node_id}  pid {agent.proc.pid}  {agent.endpoint}  shm {agent.shm_name}")
    return lines
