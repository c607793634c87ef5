"""`mooncake up` and `mooncake down`: a local cluster on this machine."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Annotated

import typer
from mooncake_cli import launcher
from mooncake_cli.context import (
    JsonOpt,
    NamespaceOpt,
    RedisUrlOpt,
    down_then_up,
    err,
    globals_of,
    live_out,
    out,
    seconds_between,
)
from mooncake_cli.exits import CliError, ExitCode
from mooncake_cli.procs import ProcRef, alive, ref_of
from mooncake_cli.render import cluster_view
from mooncake_cli.signals import STOP_SIGNALS, StopOnce, Stopped, hide_lost_stops, stopping_with
from mooncake_cli.state import (
    ClusterState,
    StartingRecord,
    clear_starting,
    clear_state,
    load_starting,
    load_state,
    save_state,
    starting_path,
    state_dir,
    state_path,
)
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from mooncake_store import ClusterStats, MooncakeError, connect
from mooncake_store.config import agent_flag_names, format_size, load_config, redact_url, split_host_port
from mooncake_store.index.connection import connect_redis

#: How long `mooncake down` waits for an `up` still starting to record its cluster (agents that
#: prefault large arenas take a while on a loaded machine; `up --timeout` bounds its own waits).
UP_WAIT_S = 120.0


@contextlib.contextmanager
def _only_up() -> Iterator[None]:
    """One `mooncake up` at a time per state directory, from its check of the state file until
    the cluster is recorded (detached) or stopped (foreground): two at once would both pass the
    check and start two clusters, one of which `down` would not know. The lock goes with the
    process (its children do not inherit the descriptor: they are spawned with close_fds)."""
    directory = state_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / "up.lock", os.O_CREAT | os.O_RDWR, 0o600)
    except OSError as exc:
        raise CliError(f"cannot use the state directory {directory}: {exc.strerror or exc}", ExitCode.ERROR) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CliError(
                f"another `mooncake up` is starting or running with the state directory {directory}", ExitCode.ERROR
            ) from None
        yield
    finally:
        os.close(fd)


def _up_starting() -> bool:
    """Whether a `mooncake up` holds the state directory's lock (_only_up): starting, or running
    in the foreground. Only asked when no cluster is recorded, i.e. one is still starting."""
    try:
        fd = os.open(state_dir() / "up.lock", os.O_RDWR)
    except OSError:
        return False  # never created: no `up` ever ran here
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock this took
    return False


def _wait_for_starting_up(limit_s: float) -> ClusterState | None:
    """The cluster a starting `up` records, once it has; None if that `up` ended without one (it
    failed, or was stopped) or did not record one within ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        state = load_state()
        if state is not None or not _up_starting():
            return state if state is not None else load_state()
        time.sleep(0.1)
    return load_state()


def _abandoned_start() -> StartingRecord | None:
    """The starting record of a `mooncake up` that is gone without finishing its start (killed
    outright: SIGKILL runs no cleanup), whose processes nothing else would stop; None when there is
    none, or when the `up` that writes it still runs (it is starting, not abandoned)."""
    starting = load_starting()
    if starting is None or alive(starting.up):
        return None
    return starting


def _stop_abandoned_start(timeout_s: float) -> launcher.StopReport | None:
    """Stop what an abandoned start (_abandoned_start) left, if there is one, and say so."""
    starting = _abandoned_start()
    if starting is None:
        return None
    report = launcher.stop_abandoned(starting, timeout_s=timeout_s)
    killed = f" ({report.killed} killed after {timeout_s:g} s)" if report.killed else ""
    err.print(
        f"stopped {report.stopped} process(es){killed} left by a `mooncake up` (pid {starting.up.pid}) that ended "
        f"while starting, removed {len(report.segments)} shared-memory segment(s) and {starting_path()}"
    )
    return report


def _refuse_if_running() -> None:
    state = load_state()
    if state is None:
        _stop_abandoned_start(timeout_s=10.0)
        return
    if not state.all_procs():
        # `up --agents 0 --redis-url URL` records a cluster of no processes of its own: nothing of
        # it can die, so it stays recorded until `down` forgets it (replaced silently, the commands
        # that found it with no flags went to another cluster).
        raise CliError(
            f"a cluster is recorded in {state_path()} ({redact_url(state.redis_url)}, namespace "
            f"{state.namespace!r}) with no processes of its own; `mooncake down` forgets it first",
            ExitCode.ERROR,
        )
    if state.running():
        if state.servers and not any(alive(p) for p in state.servers):
            # Its server died (killed, out of memory) while agents run on: "already running" was
            # no help in finding out why its stat and ls fail.
            raise CliError(
                f"the cluster recorded in {state_path()} lost its embedded server "
                f"({redact_url(state.redis_url)}) while its agents run on: "
                f"{down_then_up()}",
                ExitCode.ERROR,
            )
        raise CliError(
            f"a cluster is already running ({redact_url(state.redis_url)}, recorded in {state_path()}); "
            "stop it with `mooncake down` first",
            ExitCode.ERROR,
        )
    # Left by a cluster that died (reboot, SIGKILL): clean its leftovers so they cannot confuse us.
    report = launcher.stop(state, timeout_s=1.0)
    if report.segments:
        err.print(f"[dim]removed {len(report.segments)} stale shared-memory segment(s)[/dim]")
    # Only now: an `up` killed between writing cluster.json and removing its starting record left
    # both, naming the same processes, and while that cluster ran they were not to be stopped here.
    _stop_abandoned_start(timeout_s=10.0)


def up(
    ctx: typer.Context,
    agents: Annotated[int, typer.Option("--agents", "-n", min=0, max=64, help="Number of agent processes.")] = 2,
    host_mem: Annotated[
        str | None,
        typer.Option(
            "--host-mem",
            help="Host-DRAM arena per agent: 512MiB, 1GiB, 1073741824 (bytes). "
            "Default: env MOONCAKE_AGENT_HOST_BYTES, then the config file, then 1GiB.",
            show_default=False,
        ),
    ] = None,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="Start in the background and return; `mooncake down` stops it.")
    ] = False,
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port of the embedded Redis server (0: a free one).")
    ] = 0,
    zone: Annotated[str | None, typer.Option("--zone", help="Topology zone label of the agents.")] = None,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            parser=seconds_between(1, 3600),
            help="Seconds to wait for each process to start (1 to 3600).",
        ),
    ] = 30.0,
    as_json: JsonOpt = False,
) -> None:
    """Start a local cluster: an embedded Redis server (unless a URL is given) and N agents.

    In the foreground it shows a live view until Ctrl-C, then stops everything it started and removes
    the agents' shared memory. With --detach it returns at once. Either way the cluster is recorded in
    the state file ($MOONCAKE_STATE_DIR, default ~/.local/state/mooncake), so later commands in any
    shell find it with no flags.
    """
    g = globals_of(ctx)
    # Validates every value the agents will be given (ConfigError -> exit 2) with the same rules and
    # the same layers as the agents themselves, before any process starts; an option not given
    # (None) leaves env and config file standing.
    config = load_config(
        overrides={
            "redis_url": g.redis_url if redis_url is None else redis_url,  # "" is refused, not skipped
            "namespace": g.namespace if namespace is None else namespace,
            "agent.host_bytes": host_mem,
            "agent.zone": zone,
        },
        override_flags=agent_flag_names(host_flag="--host-mem"),
    )
    if port and config.redis_url is not None:
        raise CliError(
            f"--port {port} is for the cluster's own embedded server, and none starts with a Redis URL "
            f"({redact_url(config.redis_url)}): leave out one or the other",
            ExitCode.USAGE,
        )
    # What each agent would refuse on its own is refused here, before a server or agent starts.
    config.agent.check_published_endpoint()
    _, listen_port = split_host_port(config.agent.listen, what="agent.listen")
    if agents > 1 and listen_port != 0:
        # Every agent is given the same agent.listen: the second found its port taken by the first.
        raise CliError(
            f"agent.listen={config.agent.listen!r} (from the config file or MOONCAKE_AGENT_LISTEN) names one port, "
            f"and the {agents} agents of `up` would all bind it: use port 0 (any free port) or --agents 1",
            ExitCode.USAGE,
        )
    plan = launcher.LaunchPlan(
        num_agents=agents,
        host_bytes=config.agent.host_bytes,
        redis_url=config.redis_url,
        namespace=config.namespace,
        port=port,
        zone=zone,
        timeout_s=timeout,
        mode="detached" if detach else "foreground",
    )
    with _only_up():
        _start(plan, as_json=as_json)


def _start(plan: launcher.LaunchPlan, *, as_json: bool) -> None:
    """Start the planned cluster; the caller holds the state directory (_only_up)."""
    _refuse_if_running()
    launcher.check_shm_room(plan.num_agents, plan.host_bytes)
    if plan.redis_url is not None:
        # A server that does not answer is reported as such (ConnectError: exit 4) before any agent
        # starts: each would find out on its own and exit, and `up` reported their exits (exit 1).
        advice = "Start that server first, or leave out --redis-url for a server of the cluster's own."
        connect_redis(plan.redis_url, timeout_s=min(plan.timeout_s, 5.0), advice=advice).close()
    if not as_json:
        where = "the embedded server" if plan.redis_url is None else redact_url(plan.redis_url)
        err.print(f"[dim]starting {plan.num_agents} agent(s) x {format_size(plan.host_bytes)} on {where}...[/dim]")
    if plan.mode == "detached":
        # A SIGINT, SIGTERM or SIGHUP while starting unwinds launch(), which stops what it started:
        # nothing is recorded yet, so nothing else could. Signals after the first are ignored, and
        # so are all of them once the block has recorded the cluster: `up` has started it then,
        # and reports so and exits 0. Put back to their default actions there, one that came while
        # `up` printed or exited (~0.15 s) ended it, exit 143 with nothing said, the cluster left
        # running and recorded.
        stop_once = StopOnce()
        state: ClusterState | None = None
        try:
            with stopping_with(stop_once, then_ignore=True):
                state = launcher.launch(plan)
                save_state(state)
                clear_starting()  # recorded in cluster.json now
        except BaseException as exc:
            if state is not None:
                # Launched, and then not recorded (no room on the disk, a signal, ...), so `mooncake
                # down` could not find it, or recorded and then stopped by a signal before `up`
                # returned (the handler raises wherever the signal lands: in clear_starting, or
                # while stopping_with puts the handlers back). Either way it is stopped here and
                # cluster.json removed, so that the message below is true: a cluster reported as
                # stopped ran on, recorded, with `up` exiting 143.
                launcher.stop_uninterrupted(state)
            if not isinstance(exc, KeyboardInterrupt | Stopped):
                raise
            # Exit 128 + the signal's number, as for any command a signal stopped (SIGTERM was
            # exit 1 here, while Ctrl-C was 130 and said nothing).
            message = "stopped by a signal while starting; everything it started was stopped"
            raise Stopped(stop_once.signum or signal.SIGINT, message) from None
        _print_started(state, as_json=as_json)
        return
    _run_foreground(plan, ref_of(os.getpid()), as_json=as_json)


def _print_started(state: ClusterState, *, as_json: bool) -> None:
    if as_json:
        out.print_json_document({**state.to_dict(), "redis_url": redact_url(state.redis_url)})
        return
    out.print(f"[green]✓[/green] mooncake cluster up ({state.mode}): {redact_url(state.redis_url)}")
    for line in launcher.describe(state)[1:]:
        out.print(f"  {line}")
    out.print(f"  state {state_path()}  logs {state.log_dir}")
    if state.mode == "detached":
        out.print("  stop it with `mooncake down`")


def _run_foreground(plan: launcher.LaunchPlan, owner: ProcRef | None, *, as_json: bool) -> None:
    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python then never raises
    # KeyboardInterrupt; the cluster must still stop on Ctrl-C, `kill -INT`, `kill` or a closed terminal.
    stop_once = StopOnce()
    previous = {s: signal.signal(s, stop_once) for s in STOP_SIGNALS}
    previous_hook = hide_lost_stops(stop_once)
    state: ClusterState | None = None
    try:
        state = launcher.launch(plan, owner=owner)
        save_state(state)
        clear_starting()  # recorded in cluster.json now
        _print_started(state, as_json=as_json)
        if as_json or not out.is_terminal:
            # With --json stdout holds the one JSON document, and the tables would follow it there;
            # into a file or a pipe a live view showed one cropped frame, at the stop, with no
            # newline before the stop's report.
            _wait_quietly(state, stop_once)
        else:
            _live_view(state, stop_once)
    except (KeyboardInterrupt, Stopped):
        pass  # the way to stop a foreground cluster: exit 0 once it is stopped
    finally:
        # Ignore further signals while stopping: a half-stopped cluster is the one outcome to avoid.
        for signum in previous:
            signal.signal(signum, signal.SIG_IGN)
        if state is not None:
            report = launcher.stop(state, timeout_s=10.0, own=True)
            clear_starting()  # still there if cluster.json could not be written
            err.print(
                f"stopped {report.stopped} process(es)"
                + (f" ({report.killed} killed)" if report.killed else "")
                + f", removed {len(report.segments)} shared-memory segment(s)"
            )
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        sys.unraisablehook = previous_hook


def _wait_quietly(state: ClusterState, stop_once: StopOnce) -> None:
    """The foreground cluster with --json, or into a file or a pipe: nothing more on stdout until it
    stops; an agent process that exits is reported on stderr, once."""
    reported: set[str] = set()
    while True:
        for agent in state.agents:
            if agent.node_id not in reported and not alive(agent.proc):
                reported.add(agent.node_id)
                err.print(f"[red]agent process exited:[/red] {agent.node_id} (see {state.log_dir})")
        stop_once.check()
        time.sleep(1.0)


def _live_view(state: ClusterState, stop_once: StopOnce) -> None:
    client = connect(state.redis_url, namespace=state.namespace)
    try:
        prev: tuple[float, ClusterStats] | None = None
        with Live(console=live_out, refresh_per_second=2, transient=False, auto_refresh=False) as live:
            while True:
                now, stats = time.monotonic(), client.stat()
                rate = ""
                if prev is not None:
                    dt = max(now - prev[0], 1e-6)
                    gets = (stats.hits + stats.misses - prev[1].hits - prev[1].misses) / dt
                    stored = (stats.used_bytes - prev[1].used_bytes) / dt
                    sign = "+" if stored >= 0 else "-"
                    rate = f"   {gets:.0f} gets/s   stored {sign}{format_size(int(abs(stored)))}/s"
                prev = (now, stats)
                exited = [a.node_id for a in state.agents if not alive(a.proc)]
                header = Text.assemble(
                    ("mooncake ", "bold"),
                    redact_url(state.redis_url),
                    ("  namespace ", "dim"),
                    state.namespace,
                    rate,
                    ("   Ctrl-C stops the cluster", "dim"),
                    (f"\nagent process exited: {', '.join(exited)} (see {state.log_dir})" if exited else "", "red"),
                )
                live.update(cluster_view(stats, header=header), refresh=True)
                stop_once.check()
                time.sleep(1.0)
    except MooncakeError as exc:
        err.print(f"[red]error:[/red] live view stopped: {escape(str(exc))}")
        # Keep the cluster up until the user asks to stop; the view is only a view.
        while True:
            stop_once.check()
            time.sleep(1.0)
    finally:
        client.close()


def down(
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            parser=seconds_between(0, 3600),
            help="Seconds to wait after SIGTERM before SIGKILL (0 to 3600).",
        ),
    ] = 10.0,
) -> None:
    """Stop the cluster that `mooncake up` recorded.

    SIGTERM its processes by PID (detached or foreground), SIGKILL those still running after --timeout,
    then remove leftover shared-memory segments and the state file. What an `up` killed while it
    started had started (named in cluster-starting.json) is stopped the same way.
    """
    state = load_state()
    if state is None and _up_starting():
        # Nothing recorded yet: the `up` is still starting its processes. Saying "nothing to stop"
        # left that cluster to come up behind the user's back; it is waited for and stopped.
        err.print(f"[dim]a `mooncake up` is starting; waiting up to {UP_WAIT_S:g} s for it to record its cluster[/dim]")
        state = _wait_for_starting_up(UP_WAIT_S)
        if state is None and _up_starting():
            raise CliError(
                f"a `mooncake up` has been starting for over {UP_WAIT_S:g} s without recording a cluster in "
                f"{state_path()}; stop that process (Ctrl-C, or kill its PID), then run `mooncake down` again",
                ExitCode.ERROR,
            )
    if state is None:
        # An `up` killed outright while starting recorded no cluster, but left its starting record
        # (the `up` is gone: it no longer holds the lock, so no wait above).
        abandoned = _abandoned_start()
        if abandoned is None:
            err.print(f"no cluster recorded in {state_path()}; nothing to stop")
            return
        report = launcher.stop_abandoned(abandoned, timeout_s=timeout)
        killed = f" ({report.killed} killed after {timeout:g} s)" if report.killed else ""
        out.print(
            f"[green]✓[/green] stopped {report.stopped} process(es){killed} that a `mooncake up` "
            f"(pid {abandoned.up.pid}) started before it ended without recording a cluster, removed "
            f"{len(report.segments)} shared-memory segment(s) and {starting_path()}"
        )
        return
    report = launcher.stop(state, timeout_s=timeout)
    clear_state()
    killed = f" ({report.killed} killed after {timeout:g} s)" if report.killed else ""
    out.print(
        f"[green]✓[/green] stopped {report.stopped} process(es){killed}, "
        f"removed {len(report.segments)} shared-memory segment(s) and {state_path()}"
    )
    # An `up` killed between writing cluster.json and removing its starting record left both,
    # naming the same processes (stopped by now); the record goes too.
    _stop_abandoned_start(timeout_s=timeout)
