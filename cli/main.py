"""Entry point of the `mooncake` console script: the typer app, global options, and the one place
where errors become a red line and an exit code (tracebacks only with --debug)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Annotated, ParamSpec, TypeVar

import redis
import typer
from mooncake_cli.commands import agent as agent_cmd
from mooncake_cli.commands import bench, cluster, config, data, demo, doctor, stat
from mooncake_cli.context import ClosedStdout, Globals, NamespaceOpt, RedisUrlOpt, err, out, quiet_stdout
from mooncake_cli.exits import EXIT_CODE_HELP, CliError, ExitCode, code_for
from mooncake_cli.signals import Stopped
from rich.markup import escape

from mooncake_store import MooncakeError, __version__

try:  # typer >= 0.16 carries its own copy of click; older releases use click itself
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_exc  # type: ignore[no-redef]

_EPILOG = (
    "Exit codes: "
    + "; ".join(f"{int(code)} {text}" for code, text in EXIT_CODE_HELP)
    + ".\n\nThe cluster is found from --redis-url, else env MOONCAKE_REDIS_URL, else the config file, else the "
    "cluster `mooncake up` recorded in $MOONCAKE_STATE_DIR (default $XDG_STATE_HOME/mooncake, else "
    "~/.local/state/mooncake)."
)

app = typer.Typer(
    name="mooncake",
    help="mooncake-store: a distributed, tiered KV-cache store. Start a local cluster with `mooncake up`, "
    "then put, get, ls, rm objects and watch the cluster with stat and doctor.",
    epilog=_EPILOG,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # errors are one red line here; --debug shows the traceback
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        out.print(f"mooncake {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show the full traceback of an error.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    ctx.obj = Globals(redis_url=redis_url, namespace=namespace, debug=debug)


P = ParamSpec("P")
R = TypeVar("R")


def _reader_may_leave(command: Callable[P, R]) -> Callable[P, R]:
    """A command whose reader leaves early (`mooncake get k | head -c 10`, `mooncake up -d | head -1`)
    ends with status 0: that is not an error of ours. Done around each command because the command
    line's framework turns an EPIPE escaping one into exit status 1 before main() sees it. A command
    that fails after its output says so itself (doctor); `agent` is left out: a service whose
    output is cut stops, and its supervisor should see a failure."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except BrokenPipeError:
            quiet_stdout()
            raise typer.Exit(0) from None

    return run


def _help_of(command: Callable[..., object]) -> str:
    """A command's docstring as its help: each paragraph one line, which the console wraps to the
    terminal (with the docstring's own line breaks kept, an 80-column help broke mid-sentence)."""
    paragraphs = inspect.cleandoc(command.__doc__ or "").split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def _add(command: Callable[..., object], panel: str, *, reader_may_leave: bool = True, **settings: object) -> None:
    wrapped = _reader_may_leave(command) if reader_may_leave else command
    app.command(rich_help_panel=panel, help=_help_of(command), **settings)(wrapped)  # type: ignore[arg-type]


_add(cluster.up, "Cluster")
_add(cluster.down, "Cluster")
_add(agent_cmd.agent, "Cluster", reader_may_leave=False)
_add(stat.stat, "Cluster")
_add(doctor.doctor, "Cluster")
_add(config.config, "Cluster")
_add(data.put, "Objects")
_add(data.get, "Objects")
_add(data.rm, "Objects")
_add(data.ls, "Objects")
_add(bench.bench, "Cluster")
# The demo parses its own options (argparse in mooncake_store.demo): typer passes them through.
_add(demo.demo, "Demos", context_settings=demo.CONTEXT_SETTINGS, add_help_option=False)


def _fail(message: str, code: int, *, debug: bool) -> int:
    # With nobody reading stderr (`mooncake get k 2>&1 | true`), the print's BrokenPipeError
    # escaped and Python exited 1: the command's own code (3, key not found) is what scripts read.
    try:
        if debug:
            err.print_exception(show_locals=False)
        # One line, never wrapped or markup-parsed: scripts and tests read it, and messages hold "[...]".
        err.print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False, soft_wrap=True)
    except OSError:
        # What is left in stderr's buffer would fail again at exit (Python then exits 120).
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
    return code


def _stdout_is_null_device() -> bool:
    try:
        return os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(os.devnull))
    except (OSError, ValueError, AttributeError):  # no stdout at all (None when fd 1 is closed), or no descriptor
        return False


def _debug_first(args: list[str]) -> list[str]:
    """``--debug`` is an option of `mooncake` itself, but people add it to the command line they
    just ran (`mooncake get k --debug`): wherever it is, before a ``--``, it is taken as given
    first (the command's parser refused it, with a traceback since it asked for one)."""
    end = args.index("--") if "--" in args else len(args)
    if "--debug" not in args[:end]:
        return args
    return ["--debug", *(a for i, a in enumerate(args) if not (a == "--debug" and i < end))]


def main(argv: list[str] | None = None) -> None:
    args = _debug_first(sys.argv[1:] if argv is None else argv)
    # Also known before parsing, so a usage error can show its traceback too.
    debug = "--debug" in args
    command = typer.main.get_command(app)
    stdout_was_null = _stdout_is_null_device()
    if sys.stdout is None:  # descriptor 1 closed (`>&-`)
        sys.stdout = ClosedStdout()
    try:
        rc = command.main(args=args, prog_name="mooncake", standalone_mode=False)
        code = rc if isinstance(rc, int) else 0
    except SystemExit as exc:
        # The help is printed by the framework's own console, not ours (context._Console): when
        # its reader leaves (`mooncake --help | head -1`) it points stdout at the null device and
        # exits 1. That reader's leaving is no error of ours either.
        if exc.code == 1 and not stdout_was_null and _stdout_is_null_device():
            raise SystemExit(ExitCode.OK) from None
        raise
    except click_exc.NoArgsIsHelpError as exc:
        # The error made the help text when it was raised: with rich installed typer printed it
        # then (and returned ""); asking for it again printed it twice.
        if exc.format_message():
            out.print(exc.format_message(), markup=False, highlight=False)
        code = 0
    except click_exc.UsageError as exc:
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
        code = _fail(f"{exc.format_message()}{hint}", ExitCode.USAGE, debug=debug)
    except click_exc.ClickException as exc:
        code = _fail(exc.format_message(), exc.exit_code, debug=debug)
    except typer.Abort:
        code = ExitCode.INTERRUPTED
    except Stopped as exc:  # SIGTERM or SIGHUP, once the command has unwound: 128 + its number
        code = _fail(exc.message, exc.code, debug=debug) if exc.message else exc.code
    except CliError as exc:
        code = _fail(str(exc), exc.code, debug=debug)
    except MooncakeError as exc:
        code = _fail(str(exc), code_for(exc), debug=debug)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        code = _fail(f"lost the connection to Redis: {exc}", ExitCode.CANNOT_CONNECT, debug=debug)
    except redis.RedisError as exc:
        code = _fail(f"Redis error: {exc}", ExitCode.ERROR, debug=debug)
    except BrokenPipeError:
        # `mooncake get k | head -c 10`: the reader left; that is not our error.
        sys.stderr.close()
        code = ExitCode.OK
    except OSError as exc:
        code = _fail(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}", ExitCode.ERROR, debug=debug)
    except KeyboardInterrupt:
        code = ExitCode.INTERRUPTED
    except MemoryError as exc:  # its message is usually empty: say what ran out
        code = _fail(f"out of memory{': ' + str(exc) if str(exc) else ''}", ExitCode.ERROR, debug=debug)
    except Exception as exc:  # a bug: still one line, with the way to the details
        detail = "" if debug else " (run with --debug for the traceback)"
        code = _fail(f"internal error: {type(exc).__name__}: {exc}{detail}", ExitCode.ERROR, debug=debug)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
