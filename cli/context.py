"""What every command shares: the consoles, the connection options, and finding the cluster.

The cluster is found, first match wins: ``--redis-url`` (on the command or before it), then
``MOONCAKE_REDIS_URL``, then ``redis_url`` in the config file, then the state file that
``mooncake up`` wrote. Options are not bound to env vars by typer: the SDK's ``load_config`` reads
``MOONCAKE_*`` itself and rejects misspelt ones, so both layers agree on precedence.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, BinaryIO

import typer
from mooncake_cli.exits import CliError, ExitCode
from mooncake_cli.state import ClusterState, load_state, state_path
from rich.console import Console

from mooncake_store import Client, ConnectError, connect
from mooncake_store.config import Config, explain_config, redact_url
from mooncake_store.index.connection import START_A_CLUSTER, connect_redis


def quiet_stdout() -> None:
    """After the reader of stdout left: point it at /dev/null, so that the interpreter's own flush
    at exit is quiet too."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


#: What the refusal of a closed stdout says.
_STDOUT_CLOSED = (
    "stdout is closed (the command started with descriptor 1 closed, as `>&-` does): its output has "
    "nowhere to go; leave stdout open, or give -o FILE where the command takes one"
)


class ClosedStdout(io.TextIOBase):
    """``sys.stdout`` for a command started with descriptor 1 closed: Python makes it None, and
    rich then wrote every line nowhere. What only tells what was done (`down`'s summary, an
    agent's banner) is dropped as before; a command whose stdout is its output (`get` without -o,
    `ls`, `stat`, ...) refuses up front (require_stdout), not after the work (an `ls` exited 0
    with its listing lost, and `get` failed with an AttributeError)."""

    def write(self, text: str) -> int:
        return len(text)

    @property
    def buffer(self) -> BinaryIO:
        raise CliError(_STDOUT_CLOSED, ExitCode.USAGE)

    def isatty(self) -> bool:
        return False

    def flush(self) -> None:
        """Nothing is kept: nothing to flush."""


def require_stdout() -> None:
    """Refuse now, before any work, a command whose output is for stdout when it is closed."""
    if isinstance(sys.stdout, ClosedStdout):
        raise CliError(_STDOUT_CLOSED, ExitCode.USAGE)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich exits with status 1 when the reader leaves (`mooncake up -d | head -1`); raised as
        # the pipe's own error instead, it ends the command with 0 (main._reader_may_leave).
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of the output left")

    def print_json_document(self, data: object) -> None:
        """One JSON document, exactly as json.dumps writes it: never coloured (rich's print_json
        colours it under FORCE_COLOR, even into a pipe or a file, which no parser then reads)."""
        self.file.write(json.dumps(data, indent=2) + "\n")
        self.file.flush()


# Data goes to stdout (so `mooncake get k - > file` works); everything for people goes to stderr.
# No emoji codes: ":smile:" inside a key or a message is text, never a picture.
out = _Console(soft_wrap=True, emoji=False)
err = _Console(stderr=True, soft_wrap=True, emoji=False)
#: For live views (`up`, `stat --watch`) on a terminal: a Live display crops the lines of a
#: soft-wrapping console at the terminal's width, which hid the totals' last counters (evicted,
#: corrupt, short) in 80 columns; this one wraps them.
live_out = _Console(soft_wrap=False, emoji=False)
#: For listings into a pipe or a file (`ls | ...`): rich lays them out in 80 columns there and cut
#: what did not fit; in this width a row of the longest key (1024 bytes) stays whole on its line.
wide_out = _Console(soft_wrap=True, emoji=False, width=1 << 16)


def _given_url(value: str | None) -> str | None:
    # An empty URL in the environment means "not set" (config/checks.py); given as a flag it is a
    # mistake (an unset shell variable), not a reason to talk to another cluster than the one named.
    if value == "":
        raise typer.BadParameter("is empty: give a Redis URL (redis://HOST:PORT/DB), or leave the option out")
    return value


RedisUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--redis-url",
        callback=_given_url,
        help="Redis URL of the cluster's index (redis://HOST:PORT/DB). Default: env MOONCAKE_REDIS_URL, "
        "then the config file, then the cluster recorded by `mooncake up`.",
        show_default=False,
    ),
]
NamespaceOpt = Annotated[
    str | None,
    typer.Option(
        "--namespace",
        help="Key namespace inside Redis. Default: env MOONCAKE_NAMESPACE, then the config file, then the "
        "recorded cluster's, else 'default'.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")]


def seconds_between(low: float, high: float) -> Callable[[str], float]:
    """The parser of a seconds option: a finite number from ``low`` to ``high``. A range check
    alone let ``inf`` through a lower bound (wait for ever) and called ``nan`` too large."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value):
            raise typer.BadParameter(f"{text!r} is not a finite number of seconds (from {low:g} to {high:g})")
        if not low <= value <= high:
            raise typer.BadParameter(f"{text} seconds is outside {low:g} to {high:g}")
        return value

    return parse


@dataclass(slots=True)
class Globals:
    """Options given before the command name (``mooncake --redis-url URL stat``)."""

    redis_url: str | None = None
    namespace: str | None = None
    debug: bool = False


def globals_of(ctx: typer.Context) -> Globals:
    root = ctx.find_root()
    obj = root.obj
    return obj if isinstance(obj, Globals) else Globals()


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    redis_url: str
    namespace: str
    source: str  # where the URL came from, for doctor and error messages
    state: ClusterState | None

    @property
    def shown_url(self) -> str:
        return redact_url(self.redis_url)


def explain_here(
    ctx: typer.Context, redis_url: str | None = None, namespace: str | None = None
) -> tuple[Config, dict[str, str]]:
    """The configuration in effect for a command, with each value's source: the command's own
    --redis-url/--namespace, else the global ones given before the command, over the config layers."""
    g = globals_of(ctx)
    redis_url = g.redis_url if redis_url is None else redis_url  # "" is a value (refused), not "not given"
    namespace = g.namespace if namespace is None else namespace
    return explain_config(
        overrides={"redis_url": redis_url, "namespace": namespace},
        override_flags={"redis_url": "--redis-url", "namespace": "--namespace"},
    )


def resolve_target(ctx: typer.Context, redis_url: str | None = None, namespace: str | None = None) -> Target:
    config, sources = explain_here(ctx, redis_url, namespace)
    if config.redis_url:
        source = sources["redis_url"]
        if source.startswith("file "):
            source = f"config {source}"
        return Target(redis_url=config.redis_url, namespace=config.namespace, source=source, state=None)
    state = load_state()
    path = state_path()
    if state is None:
        raise CliError(
            "no cluster to talk to: start one with `mooncake up --detach`, or pass --redis-url / set "
            "MOONCAKE_REDIS_URL",
            ExitCode.CANNOT_CONNECT,
        )
    if not state.running():
        raise CliError(
            f"the cluster recorded in {path} is no longer running; run `mooncake down` to clean up, then `mooncake up`",
            ExitCode.CANNOT_CONNECT,
        )
    # A namespace given anywhere (flag, env, config file: merged in that order), "default" too,
    # comes before the recorded cluster's: told apart by its source, not its value (an explicit
    # --namespace default was taken for none and replaced by the recorded one).
    ns = config.namespace if sources["namespace"] != "default" else state.namespace
    return Target(redis_url=state.redis_url, namespace=ns, source=f"state file {path}", state=state)


def open_client(target: Target) -> Client:
    try:
        return connect(target.redis_url, namespace=target.namespace)
    except ConnectError:
        if target.state is None:
            raise
        # The recorded cluster's processes run, but its index does not answer (its server died):
        # connect's advice, `mooncake up`, would be refused while it is recorded. Asked again with
        # the advice that applies; should it answer now after all, the first error stands.
        connect_redis(target.redis_url, timeout_s=5.0, advice=recorded_cluster_advice(target)).close()
        raise


def recorded_cluster_advice(target: Target) -> str:
    """What to do when the index does not answer: for a cluster recorded here (its server died),
    `mooncake down` first, since `mooncake up`, connect's own advice, is refused while it is
    recorded (doctor gave that advice too); connect's otherwise."""
    if target.state is None:
        return START_A_CLUSTER
    return down_then_up()


def down_then_up() -> str:
    """The advice for a recorded cluster that is partly gone."""
    return f"`mooncake down` stops what is left of the cluster recorded in {state_path()}, then `mooncake up`"
