"""Exit codes of the `mooncake` command, and the one exception type commands raise.

The codes are part of the interface (scripts branch on them), so they are listed once here and
rendered into ``mooncake --help`` from this table.
"""

from __future__ import annotations

from enum import IntEnum

from mooncake_store.errors import exit_status


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1  # the operation failed (agent or server would not start, transfer failed, ...)
    USAGE = 2  # bad option, size, URL, key or local file: fix the command line
    NOT_FOUND = 3  # a key does not exist
    CANNOT_CONNECT = 4  # no Redis at the URL, an agent unreachable or busy, or no cluster running / recorded
    NO_CAPACITY = 5  # no node has room for the object, or /dev/shm none for an agent's arena
    INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT; other signals: 128 + N (signals.Stopped)


EXIT_CODE_HELP: tuple[tuple[ExitCode, str], ...] = (
    (ExitCode.OK, "success"),
    (ExitCode.ERROR, "error: the operation failed (doctor: a check failed)"),
    (ExitCode.USAGE, "usage or bad input: option, size, URL, key, local file"),
    (ExitCode.NOT_FOUND, "key not found"),
    (ExitCode.CANNOT_CONNECT, "cannot connect: Redis or an agent unreachable or busy, or no cluster running"),
    (ExitCode.NO_CAPACITY, "no room: no node has room for the object, or /dev/shm none for an agent's arena"),
    (
        ExitCode.INTERRUPTED,
        "interrupted (Ctrl-C); stopped by another signal: 128 + its number (143 SIGTERM, 129 SIGHUP)",
    ),
)


class CliError(Exception):
    """A failure the CLI reports as one red line and exits with ``code``."""

    def __init__(self, message: str, code: ExitCode = ExitCode.ERROR) -> None:
        super().__init__(message)
        self.code = code


def code_for(exc: BaseException) -> ExitCode:
    """The exit code for an exception that reached the top level."""
    if isinstance(exc, CliError):
        return exc.code
    return ExitCode(exit_status(exc))  # the agent module's codes too
