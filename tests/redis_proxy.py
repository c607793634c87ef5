"""A TCP proxy in front of the real Redis-compatible server, for review tests that break an
agent's index connection at a chosen point: it forwards bytes both ways; when told to, it lets a
request naming a script reach the server and loses the reply with the connection (what a reset, a
failover or a NAT timeout does after the server ran the command), or answers it with bytes that
are no Redis protocol, or goes "down" right after a given reply (every connection closed, new
ones closed at once) until up(). Fixtures that use it are in tests/integration/conftest.py."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mooncake_store.agent.node import Agent

#: A script's sha1, as rules name it: 40 hex digits.
SHA_CHARS = 40
#: What garble_reply answers: "?" is no RESP type byte.
GARBLED = b"?this is no redis reply\r\n"


@dataclass
class _Rule:
    sha: str
    times: int
    after: str | None = None
    hits: int = 0
    delay_s: float = 0.0
    garble: bool = False


@dataclass
class _Pair:
    client: socket.socket
    server: socket.socket
    drop_next: bool = False
    drop_delay_s: float = 0.0
    down_after_reply: bool = False
    garble_next: bool = False


class RedisProxy:
    """Forwards one agent's Redis connections to the real server; can lose a reply after the server
    ran the command, or go down after a given reply (see the module docstring)."""

    def __init__(self, upstream_url: str) -> None:
        parsed = urllib.parse.urlparse(upstream_url)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 6379)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._seen: set[str] = set()
        self._watch: set[str] = set()
        self._down = False
        self._down_after: str | None = None
        self._pairs: list[_Pair] = []
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        th = threading.Thread(target=target, args=args, daemon=True)
        th.start()
        self._threads.append(th)

    def drop_reply(self, sha: str, *, times: int = 1, after: str | None = None, delay_s: float = 0.0) -> _Rule:
        """The next ``times`` requests that name script ``sha`` reach the server, and their replies
        are lost with the connection (``delay_s`` after the reply came: a break the client sees
        late); with ``after``, only once a request naming ``after`` went by."""
        rule = _Rule(sha=sha, times=times, after=after, delay_s=delay_s)
        with self._lock:
            self._rules.append(rule)
            if after:
                self._watch.add(after)
        return rule

    def garble_reply(self, sha: str, *, times: int = 1) -> _Rule:
        """The next ``times`` requests that name script ``sha`` reach the server, and the client is
        answered bytes that are no Redis protocol instead of the reply (what another service on the
        port would say), then the connection closes."""
        rule = _Rule(sha=sha, times=times, garble=True)
        with self._lock:
            self._rules.append(rule)
        return rule

    def down_after_reply_of(self, sha: str) -> None:
        with self._lock:
            self._down_after = sha

    def up(self) -> None:
        with self._lock:
            self._down = False
            self._down_after = None
            for rule in self._rules:
                rule.times = 0

    def _go_down(self, keep: _Pair | None = None) -> None:
        """Refuse new connections and close the open ones (all but ``keep``)."""
        with self._lock:
            self._down = True
            pairs, self._pairs = [p for p in self._pairs if p is not keep], []
        for p in pairs:
            self._close(p)

    @staticmethod
    def _close(p: _Pair) -> None:
        for s in (p.client, p.server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                c, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refuse = self._down or self._closed
            if refuse:
                c.close()
                continue
            try:
                s = socket.create_connection(self._upstream, timeout=5)
                s.settimeout(None)
            except OSError:
                c.close()
                continue
            pair = _Pair(client=c, server=s)
            with self._lock:
                # Gone down (or closed) while this connection was being made: refused after all,
                # or it would outlive the _go_down that closed the others.
                refuse = self._down or self._closed
                if not refuse:
                    self._pairs.append(pair)
            if refuse:
                self._close(pair)
                continue
            self._spawn(self._to_server, pair)
            self._spawn(self._to_client, pair)

    def _to_server(self, p: _Pair) -> None:
        tail = b""
        while True:
            try:
                data = p.client.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self._close(p)
                return
            window = (tail + data).decode("latin-1")
            with self._lock:
                for sha in self._watch:
                    if sha in window:
                        self._seen.add(sha)
                for rule in self._rules:
                    if rule.times > 0 and rule.sha in window and (rule.after is None or rule.after in self._seen):
                        rule.times -= 1
                        rule.hits += 1
                        if rule.garble:
                            p.garble_next = True
                        else:
                            p.drop_next = True
                            p.drop_delay_s = rule.delay_s
                if self._down_after and self._down_after in window:
                    p.down_after_reply = True
            # A sha split over two reads is still seen, but one seen whole already is not seen
            # again with the next command on this connection (it would fire a rule installed since).
            tail = (tail + data)[-(SHA_CHARS - 1) :]
            try:
                p.server.sendall(data)
            except OSError:
                self._close(p)
                return

    def _to_client(self, p: _Pair) -> None:
        while True:
            try:
                data = p.server.recv(1 << 16)
            except OSError:
                data = b""
            if not data or p.drop_next:
                if p.drop_next and p.drop_delay_s:
                    time.sleep(p.drop_delay_s)
                if p.drop_next and p.down_after_reply:
                    # The index stays out of reach, so the outcome stays unknown. Down before this
                    # connection closes: a client that retries the moment it sees the close must
                    # find the proxy refusing (closing first let a retry through on a loaded machine).
                    self._go_down(keep=p)
                self._close(p)  # the server ran the command; its reply is lost with the connection
                return
            if data and p.garble_next:
                with contextlib.suppress(OSError):
                    p.client.sendall(GARBLED)
                self._close(p)
                return
            if p.down_after_reply:
                # Down before the reply is on its way: a client that sends its next command the
                # moment the reply arrives must find the index gone, not this connection still up.
                self._go_down(keep=p)
                # This connection's server side closes first too: a command the client sends the
                # moment the reply arrives must not reach the server through it before _close (on a
                # loaded machine one did: an eviction ran there while the agent saw a failure).
                with contextlib.suppress(OSError):
                    p.server.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    p.client.sendall(data)
                self._close(p)
                return
            try:
                p.client.sendall(data)
            except OSError:
                self._close(p)
                return

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs, self._pairs = self._pairs, []
        self._listener.close()
        for p in pairs:
            self._close(p)
        for th in self._threads:
            th.join(timeout=2)


def idle_pressure(agent: Agent) -> None:
    """Stub an in-process agent's pressure loop: its passes run only when a test calls them."""
    agent.pressure.run = lambda stop: stop.wait()  # type: ignore[method-assign]


#: In-process agents whose passes and syncs run only when a test calls them.
QUIET: dict[str, Any] = {
    "host_bytes": 4 << 20,
    "sync_interval_s": 3600.0,
    "heartbeat_interval_s": 600.0,
    "heartbeat_ttl_s": 1200.0,
    "reserve_timeout_s": 30.0,
    "prefault": False,
    "spill_to_peers": False,
}
