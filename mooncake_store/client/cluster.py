"""LocalCluster: an embedded index server plus agent subprocesses on this machine.

For tests, benchmarks, demos and laptops. Every process it starts, it stops by PID; the shared
memory segments of agents it had to kill are removed too.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from mooncake_store.config import load_config, redact_url
from mooncake_store.config.values import shown
from mooncake_store.embedded import MAX_STARTUP_S, EmbeddedServer
from mooncake_store.errors import ConfigError, MooncakeError, NoCapacity, ServerError
from mooncake_store.tiers.disk_dir import sweep_tier_dir
from mooncake_store.tiers.host import arenas_refused, segment_paths, segment_pattern
from mooncake_store.types import is_collection_not_text


@dataclass(slots=True)
class AgentProcess:
    node_id: str
    process: subprocess.Popen[bytes]
    endpoint: str = ""
    shm_name: str = ""
    disk_dir: str = ""  # its disk tier's directory, as READY said ("": none)
    args: list[str] = field(default_factory=list)
    #: Where the agent's stderr goes: a file, never a pipe nobody reads (a full pipe would block
    #: every agent thread that logs).
    log: IO[bytes] | None = None
    #: The process that started it: only that one can wait for it. In a forked child poll() meets
    #: ECHILD and reads a running agent as exited, and stop() removed its arena and disk tier.
    owner_pid: int = field(default_factory=os.getpid)

    def log_tail(self, limit: int = 2000) -> str:
        """The last ``limit`` bytes of the agent's stderr."""
        if self.log is None or self.log.closed:
            return ""
        # Read through the descriptor's path, not the descriptor: a log_dir file is opened for
        # appending only, and a read of that descriptor failed (EBADF) in place of the agent's reason.
        try:
            with open(f"/proc/self/fd/{self.log.fileno()}", "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def _foreign(self) -> bool:
        """True in a process other than the one that started the agent (a forked child), where
        kill(), terminate() and stop() do nothing: the agent is the parent's."""
        return os.getpid() != self.owner_pid

    def kill(self) -> None:
        """SIGKILL, as a crash would: no deregistration, the segment stays until stop()."""
        if self._foreign():
            return
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM, not waited for (stop() waits): a cluster stops its agents in parallel."""
        if self._foreign():
            return
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the agent, remove its segment and disk tier; nothing in a forked child."""
        if self._foreign():
            return
        if self.alive():
            self.process.send_signal(signal.SIGTERM)  # again, if terminate() sent one: harmless
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        if self.shm_name:
            # A killed agent cannot remove its own segment; its name holds its pid, so this is ours
            # (a pattern before READY: the agent died before it said the name).
            for path in segment_paths(self.shm_name):
                path.unlink(missing_ok=True)
        if self.disk_dir:
            # Nor its disk tier's directory, which only a later agent on the same --disk would
            # sweep; a successor under the same node id holds its lock, and keeps it.
            with contextlib.suppress(OSError):  # one that cannot go stays; the cluster still stops
                sweep_tier_dir(Path(self.disk_dir))
        for stream in (self.process.stdout, self.process.stderr, self.log):
            if stream is not None:
                stream.close()


class LocalCluster:
    """``with LocalCluster(num_agents=2, host_bytes=256 << 20) as cluster: connect(cluster.redis_url)``"""

    def __init__(
        self,
        num_agents: int = 2,
        *,
        host_bytes: int = 256 << 20,
        redis_url: str | None = None,
        namespace: str | None = None,
        heartbeat_ttl_s: float = 5.0,
        reserve_timeout_s: float = 30.0,
        zones: list[str] | None = None,
        agent_args: list[str] | None = None,
        startup_timeout_s: float = 30.0,
        log_dir: str | Path | None = None,
    ) -> None:
        if type(num_agents) is not int or num_agents < 0:
            raise ConfigError(f"num_agents must be an int >= 0, got {num_agents!r:.80}")
        # Checked by the agents' own rules before anything starts: a bad size ("12XB", 0) was an
        # agent that "did not become ready", after the server had started.
        # The same for the other values the agents are given (a TTL of 0 was "did not become ready
        # within 30 s", at once), each zone through the agent's own rule. The TTL is checked by its
        # range alone, against the smallest interval, where agent_args or the environment set an
        # interval: the agent reads those itself (and one that refuses them exits "with status 2",
        # saying why). Where neither does, as the agent will: the interval derived from the TTL
        # (a TTL of 2 ms passed here, and every agent then refused its derived interval).
        if isinstance(heartbeat_ttl_s, bool) or not isinstance(heartbeat_ttl_s, int | float) or not heartbeat_ttl_s > 0:
            raise ConfigError(f"heartbeat_ttl_s must be a number of seconds > 0, got {shown(heartbeat_ttl_s)}")
        # A config file (MOONCAKE_CONFIG, --config) may set one too: the agents read it themselves.
        interval_given = any(var in os.environ for var in ("MOONCAKE_AGENT_HEARTBEAT_INTERVAL_S", "MOONCAKE_CONFIG"))
        interval_given = interval_given or any(
            isinstance(arg, str) and arg.startswith(("--heartbeat-interval-s", "--config")) for arg in agent_args or []
        )
        checked = load_config(
            env={},
            overrides={
                "agent.host_bytes": host_bytes,
                "agent.reserve_timeout_s": reserve_timeout_s,
                "agent.heartbeat_ttl_s": heartbeat_ttl_s,
                "agent.heartbeat_interval_s": 1e-3 if interval_given else None,
                "namespace": namespace,
            },
            override_flags={"agent.heartbeat_ttl_s": "heartbeat_ttl_s"},
        )
        # The rest by type: each was taken as given and failed later, after the server had started,
        # with a TypeError from deep inside (or, zones="ab", split into zones "a" and "b").
        if redis_url is not None:
            load_config(env={}, overrides={"redis_url": redis_url}, override_flags={"redis_url": "redis_url"})
        if zones is not None and not (is_collection_not_text(zones) and zones):
            raise ConfigError(f"zones must be a non-empty list of zone names, or None; got {zones!r:.80}")
        for zone in zones or []:
            load_config(env={}, overrides={"agent.zone": zone}, override_flags={"agent.zone": "zones"})
        _check_arguments("agent_args", agent_args)
        if log_dir is not None and not isinstance(log_dir, str | os.PathLike):
            raise ConfigError(f"log_dir must be a path (str or os.PathLike), got {log_dir!r:.80}")
        if (
            isinstance(startup_timeout_s, bool)
            or not isinstance(startup_timeout_s, int | float)
            or not 0 < startup_timeout_s <= MAX_STARTUP_S  # inf (or NaN) waited forever on a stuck start
        ):
            raise ConfigError(
                f"startup_timeout_s must be a number of seconds > 0 and <= {MAX_STARTUP_S:g}, "
                f"got {shown(startup_timeout_s)}"
            )
        self.host_bytes = checked.agent.host_bytes
        self.num_agents = num_agents
        # On its own private server the cluster uses the default namespace, so a plain
        # connect(cluster.redis_url) finds it; on a shared server it takes a namespace of its own.
        self.namespace = namespace or ("default" if redis_url is None else f"lc-{uuid.uuid4().hex[:8]}")
        self.heartbeat_ttl_s = float(heartbeat_ttl_s)
        self.reserve_timeout_s = checked.agent.reserve_timeout_s
        self.zones = list(zones) if zones is not None else None
        self.agent_args = list(agent_args or [])
        self.startup_timeout_s = startup_timeout_s
        self.log_dir = Path(log_dir) if log_dir else None
        self._external_url = redis_url
        self.server: EmbeddedServer | None = None
        self.agents: list[AgentProcess] = []
        self._started = False
        #: The process that started it (0: not yet): stop() does nothing in any other, a forked
        #: child whose ``with`` block or ``finally`` ended (as EmbeddedServer.stop).
        self._owner_pid = 0

    @property
    def redis_url(self) -> str:
        if self._external_url:
            return self._external_url
        if self.server is None:
            raise MooncakeError("LocalCluster is not started")
        return self.server.url

    def start(self) -> LocalCluster:
        """Start the server (unless ``redis_url`` names one) and the agents, and wait until each is
        registered. A cluster already started is left as it is: started again, its agents' node ids
        were held by themselves, the refusal stopped every agent (and what they stored was lost),
        and a private server started anew left the first one running, outside stop()'s reach."""
        if self._started:
            return self
        self._owner_pid = os.getpid()
        # Before anything starts: each agent checks /dev/shm for its own arena only, and all start
        # at once (kv_transfer.py --agents 1000, a demo whose two arenas outgrew the memory).
        why = arenas_refused(self.num_agents, self.host_bytes, prefault="--no-prefault" not in self.agent_args)
        if why is not None:
            raise NoCapacity(f"cannot start the cluster's agents: {why}; use a smaller host_bytes or fewer agents")
        try:
            if not self._external_url:
                # Killed without a chance to stop it (SIGKILL), this process must not leave the
                # server running either: a watchdog stops it (the agents watch for themselves).
                self.server = EmbeddedServer(exit_with_parent=True).start()
            # All started at once, then each waited for: they start in parallel (about half a
            # second each, most of it imports), not one after another.
            spawned = [
                self._spawn(f"agent-{i}", self.zones[i % len(self.zones)] if self.zones else None, [])
                for i in range(self.num_agents)
            ]
            for agent in spawned:
                self._become_ready(agent)
        except BaseException:
            self.stop()
            raise
        self._started = True
        return self

    def agent_command(self, node_id: str, zone: str | None, extra: list[str]) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "mooncake_store.agent",
            "--namespace",
            self.namespace,
            "--host-bytes",
            str(self.host_bytes),
            "--node-id",
            node_id,
            "--heartbeat-ttl-s",
            str(self.heartbeat_ttl_s),
            "--reserve-timeout-s",
            str(self.reserve_timeout_s),
            # Killed without a chance to stop them (SIGKILL), this process must not leave agents
            # holding their arenas: they stop once it is gone.
            "--exit-with-parent",
            str(os.getpid()),
        ]
        if zone:
            cmd += ["--zone", zone]
        return cmd + self.agent_args + extra

    def add_agent(
        self,
        *,
        node_id: str | None = None,
        zone: str | None = None,
        extra_args: list[str] | tuple[str, ...] | None = None,
    ) -> AgentProcess:
        """Start one more agent and wait until it is registered."""
        _check_arguments("extra_args", extra_args)
        # The agent's own rules, before its log file is named after the node id (a "/" there
        # escaped log_dir) and a process started: a refusal here is a ConfigError saying why.
        load_config(
            env={},
            overrides={"agent.node_id": node_id, "agent.zone": zone},
            override_flags={"agent.node_id": "node_id", "agent.zone": "zone"},
        )
        agent = self._spawn(node_id or f"agent-{len(self.agents)}", zone, list(extra_args or []))
        self._become_ready(agent)
        return agent

    def _spawn(self, node_id: str, zone: str | None, extra_args: list[str]) -> AgentProcess:
        """Start an agent's process (listed in ``agents`` at once, so stop() stops it)."""
        cmd = self.agent_command(node_id, zone, extra_args)
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log: IO[bytes] = open(self.log_dir / f"{node_id}.log", "ab")  # noqa: SIM115 - closed by AgentProcess.stop
        else:
            log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by AgentProcess.stop
        # The URL goes in the environment, not on the command line, where `ps` would show a password.
        env = {**os.environ, "MOONCAKE_REDIS_URL": self.redis_url}
        try:
            # A session of its own: a Ctrl-C (or hang-up, or Ctrl-Z) in the caller's terminal reaches
            # the caller, which may catch it and go on; in its process group it stopped every agent,
            # and their objects were lost. --exit-with-parent stops them once the caller is gone.
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        except BaseException:
            log.close()
            raise
        # Until READY says the segment's name, a pattern of it (its pid is in it): stop() removes
        # the segment of an agent that dies before it gets there.
        agent = AgentProcess(
            node_id=node_id,
            process=proc,
            args=cmd,
            shm_name=segment_pattern(self.namespace, node_id, proc.pid),
            log=log,
        )
        self.agents.append(agent)
        return agent

    def _become_ready(self, agent: AgentProcess) -> None:
        """Wait until a spawned agent is registered (its READY line), else stop it and raise."""
        try:
            ready = self._wait_ready(agent)
        except BaseException:
            self.agents.remove(agent)  # stopped by _wait_ready; cluster.agent(node_id) must not find it
            agent.stop()
            raise
        agent.endpoint, agent.shm_name = ready["endpoint"], ready["shm_name"]
        agent.disk_dir = ready.get("disk_dir", "")

    def _wait_ready(self, agent: AgentProcess) -> dict[str, Any]:
        assert agent.process.stdout is not None
        # Read from the pipe's descriptor, not the buffered file: select() sees only the pipe, so
        # a READY line a buffered readline() had already taken in with an earlier line would sit
        # in its buffer while select() waited out the whole timeout.
        fd = agent.process.stdout.fileno()
        deadline = time.monotonic() + self.startup_timeout_s
        pending = b""
        line = b""  # the last line read, for the message
        ended = False  # the pipe's end: the agent is exiting
        while time.monotonic() < deadline:
            if b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                if line.startswith(b"READY "):
                    return dict(json.loads(line[6:]))
                continue
            if ended:
                break
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            ended = not chunk
            if ended and pending:
                pending += b"\n"  # a last line without its newline is a line too
            pending += chunk
        if ended:  # give it a moment to finish its stderr
            try:
                agent.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        code = agent.process.poll()
        err = agent.log_tail() if code is not None else ""
        agent.stop()
        if code is not None:
            raise ServerError(f"agent {agent.node_id} exited with status {code} as it started: {err.strip() or line!r}")
        raise ServerError(f"agent {agent.node_id} did not become ready within {self.startup_timeout_s} s: {line!r}")

    def agent(self, node_id: str) -> AgentProcess:
        for agent in self.agents:
            if agent.node_id == node_id:
                return agent
        raise MooncakeError(f"no agent {node_id!r} in this cluster")

    def stop(self) -> None:
        """Stop every agent and the private server; the cluster may be started again (afresh: what
        it stored is gone). In a forked child it does nothing: the agents and the server are the
        parent's, and go on running."""
        if self._owner_pid and self._owner_pid != os.getpid():
            return
        for agent in self.agents:
            agent.terminate()  # all at once; each is then waited for
        for agent in self.agents:
            agent.stop()
        self.agents = []
        if self.server is not None:
            self.server.stop()
            self.server = None
        self._started = False

    def __repr__(self) -> str:
        if not self._started:
            return f"<LocalCluster {self.num_agents} agent(s) namespace={self.namespace!r} not started>"
        alive = sum(agent.alive() for agent in self.agents)
        return (
            f"<LocalCluster {redact_url(self.redis_url)} namespace={self.namespace!r} "
            f"agents={alive}/{len(self.agents)} alive>"
        )

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_arguments(name: str, args: object) -> None:
    """ConfigError unless ``args`` is None or a list or tuple of str (an agent's command-line
    arguments): add_agent's were taken unchecked, and a tuple, a bare string or a number in the
    list failed deep inside with a TypeError."""
    if args is not None and not (isinstance(args, list | tuple) and all(isinstance(a, str) for a in args)):
        raise ConfigError(f"{name} must be a list of str (command-line arguments), got {args!r:.80}")
