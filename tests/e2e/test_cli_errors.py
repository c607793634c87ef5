"""Bad input: a documented exit code and one red line, no traceback (unless --debug); and help text."""

from __future__ import annotations

import re
import socket

import pytest

from .conftest import Mooncake, assert_one_line_error


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["up", "--host-mem", "12x"], 2, "not a size"),
        # Errors name the flag that gave the value (they said "override agent.host_bytes='1000'").
        (["up", "--host-mem", "1000"], 2, "--host-mem='1000': must be between 64.0 KiB"),
        (["agent", "--redis-url", "redis://127.0.0.1:1/0", "--disk-mem", "12XB"], 2, "--disk-mem='12XB': not a size"),
        (
            ["agent", "--redis-url", "redis://127.0.0.1:1/0", "--high-watermark", "0.5", "--low-watermark", "0.7"],
            2,
            "--low-watermark=0.7: must be below agent.high_watermark=0.5 (from --high-watermark)",
        ),
        (["up", "--agents", "abc"], 2, "--agents"),
        (["--redis-url", "http://example.com", "stat"], 2, "scheme"),
        (["stat", "--redis-url", "redis://127.0.0.1:notaport/0"], 2, "--redis-url="),
        (["stat", "--redis-url", "redis://127.0.0.1:70000/0"], 2, "port must be 1..65535, got 70000"),
        # An empty value is a value, refused: `up` started a cluster in the default namespace.
        (["up", "--namespace", "", "--agents", "1"], 2, "namespace must be 1..64 characters"),
        (["--redis-url", "", "stat"], 2, "is empty"),
        (["stat", "--redis-url", ""], 2, "is empty"),
        (["put", "k", "/nonexistent/file"], 2, "no such file"),
        (["put", "bad\x01key", "-"], 2, "control character"),
        (["get", "x" * 1100], 2, "1024"),
        (["put"], 2, "Missing argument"),
        (["stat", "--bogus"], 2, "--bogus"),
        (["stat", "--interval", "5"], 2, "applies to --watch only"),  # was taken and ignored
        (["stat"], 4, "mooncake up"),  # nothing recorded in this test's state dir
        (["get", "k"], 4, "mooncake up"),
        # No cluster to join is "no cluster running" (4), as for every other command; it was 2.
        (["agent", "--host-mem", "1MiB"], 4, "an agent needs a cluster"),
        (["doctor"], 4, None),
    ],
)
def test_bad_input_exit_code_and_one_line(mooncake: Mooncake, args: list[str], code: int, needle: str | None) -> None:
    result = mooncake(*args, stdin=b"data")
    if args == ["doctor"]:  # doctor reports every check, then exits 4 for the unreachable index
        assert result.returncode == 4
        assert "✗ redis" in result.stdout.decode()
        return
    assert_one_line_error(result, code, *([needle] if needle else []))
    assert b"Traceback" not in result.stderr


def test_unreachable_redis_is_exit_4(mooncake: Mooncake) -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    for args in (["--redis-url", url, "stat"], ["put", "k", "-", "--redis-url", url]):
        assert_one_line_error(mooncake(*args, stdin=b"x"), 4, "cannot reach Redis")
    result = mooncake("stat", env={"MOONCAKE_REDIS_URL": url})
    assert_one_line_error(result, 4, url)


@pytest.mark.parametrize("where", ["first", "after the command"])
def test_debug_shows_the_traceback(mooncake: Mooncake, where: str) -> None:
    """Given after the command (as people add it to the line they just ran), `--debug` was a usage
    error of that command, printed with the parser's own traceback."""
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    args = ["--debug", "--redis-url", url, "stat"] if where == "first" else ["stat", "--redis-url", url, "--debug"]
    result = mooncake(*args)
    assert result.returncode == 4
    text = result.stderr.decode()
    assert "Traceback" in text and text.strip().splitlines()[-1].startswith("error: cannot reach Redis")


def test_misspelt_env_var_is_a_usage_error(mooncake: Mooncake) -> None:
    result = mooncake("stat", env={"MOONCAKE_REDIS_ULR": "redis://127.0.0.1:6379/0"})
    assert_one_line_error(result, 2, "MOONCAKE_REDIS_ULR")


def test_down_with_nothing_recorded_is_ok(mooncake: Mooncake) -> None:
    result = mooncake("down")
    assert result.returncode == 0
    assert "nothing to stop" in result.stderr.decode()


def test_help_describes_every_option_and_exit_code(mooncake: Mooncake) -> None:
    from mooncake_cli.main import app
    from typer.main import get_command
    from typer.testing import CliRunner

    top = mooncake.ok("--help").stdout.decode()  # the installed script, once
    assert "Exit codes" in top
    for code in ("0 success", "2 usage", "3 key not found", "4 cannot connect", "5 no room"):
        assert code in top, code
    root = get_command(app)
    commands = root.commands  # type: ignore[attr-defined]
    assert {"up", "down", "agent", "put", "get", "rm", "ls", "stat", "doctor"} <= set(commands)
    runner = CliRunner()
    for name, command in [("", root), *commands.items()]:
        # Each command's own --help, rendered in-process: ten interpreter starts would cost seconds.
        args = [name, "--help"] if name else ["--help"]
        result = runner.invoke(app, args, env={"COLUMNS": "200"}, terminal_width=200)
        assert result.exit_code == 0, (name, result.output)
        text = result.output
        assert command.help, name
        for param in command.params:
            if param.hidden:
                continue
            assert param.help, (name, param.name)  # type: ignore[attr-defined]
            if param.param_type_name == "option":
                long = max(param.opts, key=len)
                assert re.search(re.escape(long) + r"\b", text), (name, long)


def test_a_commands_help_paragraphs_are_wrapped_by_the_terminal_not_the_source(mooncake: Mooncake) -> None:
    """The docstrings' own line breaks were kept, so an 80-column help broke mid-sentence; each
    paragraph is one line now, which the console wraps to the terminal (200 columns here)."""
    for command, sentence in (
        ("up", "then stops everything it started and removes the agents' shared memory. With --detach"),
        ("doctor", "clock skew against Redis, /dev/shm size, and the transports this machine has"),
    ):
        text = mooncake.ok(command, "--help").stdout.decode()
        assert sentence in text, text
