"""`mooncake put / get / rm / ls`: objects by key, as raw bytes."""

from __future__ import annotations

import os
import stat
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, BinaryIO

import numpy as np
import typer
from mooncake_cli.context import (
    JsonOpt,
    NamespaceOpt,
    RedisUrlOpt,
    err,
    open_client,
    out,
    quiet_stdout,
    require_stdout,
    resolve_target,
    wide_out,
)
from mooncake_cli.exits import CliError, ExitCode
from mooncake_cli.render import age, keys_view
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from mooncake_store import Client, InvalidValue, NoCapacity
from mooncake_store.client.gets import uncounted
from mooncake_store.config import format_size
from mooncake_store.types import check_key, shown_key

#: Objects at least this big get a progress bar (when stderr is a terminal).
PROGRESS_MIN_BYTES = 4 << 20
#: Chunk for reading stdin and writing outputs, so the bar moves and memory stays bounded per call.
IO_CHUNK = 4 << 20

KeyArg = Annotated[str, typer.Argument(help="Object key: UTF-8 text, at most 1024 bytes, no control characters.")]


def _progress(total: int, what: str) -> Progress:
    return Progress(
        TextColumn(f"[bold]{what}[/bold]"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=total < PROGRESS_MIN_BYTES or not err.is_terminal,
    )


@dataclass(frozen=True, slots=True)
class _RegularFile:
    fh: BinaryIO
    size: int  # when opened


@contextmanager
def _source(path: str) -> Iterator[_RegularFile | BinaryIO]:
    """The bytes to put, read once the cluster says how much of them could be stored: a regular
    file at its size (_read_file), refused unread when that is too much; stdin, a pipe, a FIFO or
    a file that says it is empty (those of /proc do, and hold bytes) as a stream (_read_up_to). A
    file is read, not mapped: a mapped file truncated by another process during the put killed
    the command with SIGBUS, and its reservation then blocked other puts until it timed out."""
    if path == "-":
        if sys.stdin is None:  # descriptor 0 closed (`<&-`): Python makes it None
            raise CliError("stdin is closed (started with `<&-`): nothing to read; give FILE", ExitCode.USAGE)
        yield sys.stdin.buffer
        return
    if not path:  # Path("") is ".": "': is a directory", naming nothing (an empty $VAR)
        raise CliError("FILE is empty: give a file's path, or - for stdin", ExitCode.USAGE)
    file = Path(path)
    try:
        fh = file.open("rb")
    except FileNotFoundError:
        raise CliError(f"{path}: no such file", ExitCode.USAGE) from None
    except IsADirectoryError:
        raise CliError(f"{path}: is a directory, expected a file", ExitCode.USAGE) from None
    except PermissionError:
        raise CliError(f"{path}: permission denied", ExitCode.USAGE) from None
    with fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            # /proc's files are regular files of size 0 and were stored as 0 B: read to the end.
            yield fh
            return
        yield _RegularFile(fh, st.st_size)


def _read_file(fh: BinaryIO, size: int, *, name: str) -> memoryview:
    """The bytes of a regular file of ``size`` bytes (at most that many: sysfs's files say 4096 and
    hold fewer); CliError when it cannot be read or was cut short while it was read."""
    data = memoryview(bytearray(size))
    got = 0
    try:
        while got < size and (n := fh.readinto(data[got:])):
            got += n
        now = os.fstat(fh.fileno()).st_size
    except OSError as exc:  # a file on a device gone, a special file refusing reads: say which
        raise CliError(f"{name}: cannot read: {exc.strerror or exc}", ExitCode.USAGE) from None
    if got < size and now < size:
        raise CliError(
            f"{name}: was {size} B when opened and {now} B once read (changed meanwhile); nothing was stored",
            ExitCode.USAGE,
        )
    return data[:got]


def _read_up_to(stream: BinaryIO, limit: int, *, name: str) -> memoryview:
    """All of ``stream``, unless it holds more than ``limit`` bytes: then NoCapacity, having read
    one byte more than that (`mooncake put k /dev/zero` ran out of memory, as did a stream larger
    than any node could hold, before the cluster was asked anything)."""
    data = bytearray()
    try:
        while len(data) <= limit and (chunk := stream.read(min(IO_CHUNK, limit + 1 - len(data)))):
            data += chunk
    except OSError as exc:  # a special file refusing reads (/proc/self/mem): say which, as _read_file
        raise CliError(f"{name}: cannot read: {exc.strerror or exc}", ExitCode.USAGE) from None
    if len(data) > limit:
        raise _too_large(name, limit)
    return memoryview(data)


def _too_large(name: str, limit: int, size: int | None = None) -> NoCapacity:
    largest = f"{limit} B ({format_size(limit)})"
    if size is None:
        held = f"more than {largest}, the"
    else:
        held = f"{size} B ({format_size(size)}), more than the {largest} of the"
    return NoCapacity(
        f"{name} holds {held} largest host tier of the cluster's live agents: no node could store it", permanent=True
    )


def _largest_host_tier(client: Client) -> int:
    tiers = [t for node in client.stat().live_nodes for t in node.tiers if t.tier == "host"]
    if not tiers:  # said so, rather than "stdin holds more than 0 B"
        raise NoCapacity("the cluster has no live agent to store it on", permanent=True)
    return max(t.capacity_bytes for t in tiers)


def put(
    ctx: typer.Context,
    key: KeyArg,
    file: Annotated[str, typer.Argument(help="File to store, or - for stdin.", metavar="FILE|-")],
    replicas: Annotated[int, typer.Option("--replicas", "-r", min=1, max=16, help="Copies on distinct nodes.")] = 1,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Store the bytes of FILE (or stdin) under KEY, replacing any object already there."""
    check_key(key)  # bad keys and files fail before any connection is made
    with _source(file) as source:
        target = resolve_target(ctx, redis_url, namespace)
        with open_client(target) as client:
            name = "stdin" if file == "-" else file
            limit = _largest_host_tier(client)
            if not isinstance(source, _RegularFile):
                view = _read_up_to(source, limit, name=name)
            elif source.size > limit:  # refused unread: it was read whole first, into memory
                raise _too_large(name, limit, source.size)
            else:
                view = _read_file(source.fh, source.size, name=name)
            size, took = _put(client, key, view, replicas)
    rate = f", {size / took / 1e9:.2f} GB/s" if size >= PROGRESS_MIN_BYTES and took > 0 else ""
    shown = f"{escape(key)} ({format_size(size)}, {replicas} replica(s))"
    err.print(f"[green]✓[/green] put {shown} in {took * 1000:.1f} ms{rate}")


def _put(client: Client, key: str, view: memoryview, replicas: int) -> tuple[int, float]:
    """(bytes, seconds). The SDK's put is one call with no progress hook, so the bar shows it
    start and finish; it still tells a person that a large put is running."""
    size = len(view)
    started = time.perf_counter()
    with _progress(size, "put") as bar:
        task = bar.add_task("put", total=size)
        client.put(key, view, replicas=replicas)
        bar.update(task, completed=size)
    return size, time.perf_counter() - started


def _fetch(client: Client, key: str) -> np.ndarray:
    """The object's raw bytes, whatever dtype it was put with, copied once into a fresh buffer."""
    for attempt in range(3):
        meta = client.object_meta(key)
        buf = np.empty(meta.size_bytes if meta is not None else 0, dtype=np.uint8)
        try:
            # A missing key raises KeyNotFound here, from the read, which counts it as a miss in
            # stat() as any get does (the size lookup counts nothing); a second try counts nothing
            # more, as a get's own retries do.
            with nullcontext() if attempt == 0 else uncounted():
                written = client.get_into(key, buf)
        except InvalidValue:
            continue  # replaced by a bigger object between the size lookup and the read: look again
        # Replaced by a smaller one meanwhile: only what the read wrote is the object.
        return buf[:written]
    raise CliError(f"key {shown_key(key)} kept changing size while being read; try again")


def get(
    ctx: typer.Context,
    key: KeyArg,
    file: Annotated[
        str | None,
        typer.Argument(help="Write to this file instead of stdout (- is stdout), as -o does.", metavar="[FILE|-]"),
    ] = None,
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", help="Write to this file instead of stdout (- is stdout).", metavar="FILE|-"),
    ] = None,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Write the bytes stored under KEY to stdout or to a file (`get KEY FILE`, as `put KEY FILE`)."""
    check_key(key)
    if file is not None and output is not None and file != output:
        raise CliError(f"two places to write to: FILE {file!r} and --output {output!r}; give one", ExitCode.USAGE)
    output = file if file is not None else output if output is not None else "-"
    target = resolve_target(ctx, redis_url, namespace)
    if not output:  # Path("") is ".": "': is a directory", naming nothing (an empty $VAR)
        raise CliError("the output path is empty: give a file's path, or - for stdout", ExitCode.USAGE)
    dest = None if output == "-" else Path(output)
    if dest is None:
        require_stdout()  # before the object is fetched
    if dest is not None and dest.is_dir():
        raise CliError(f"{output}: is a directory, expected a file path", ExitCode.USAGE)
    with open_client(target) as client:
        started = time.perf_counter()
        buf = _fetch(client, key)
        took = time.perf_counter() - started
    view = memoryview(buf)
    with _progress(len(view), "write") as bar:
        task = bar.add_task("write", total=len(view))
        try:
            fh = sys.stdout.buffer if dest is None else dest.open("wb")
        except OSError as exc:
            raise CliError(f"{output}: cannot write it ({exc.strerror or exc})", ExitCode.USAGE) from None
        try:
            for start in range(0, len(view), IO_CHUNK):
                fh.write(view[start : start + IO_CHUNK])
                bar.update(task, advance=min(IO_CHUNK, len(view) - start))
            fh.flush()  # a reader that left (`| head -c 10`) is no error: see main._reader_may_leave
            if dest is not None:
                fh.close()  # its last flush may fail too (a full disk)
        except BrokenPipeError:
            raise
        except OSError as exc:  # `> /dev/full`: said "No space left on device" alone, naming nothing
            if dest is None:
                quiet_stdout()  # what is left in its buffer would fail again at exit, with a traceback
            where = "stdout" if dest is None else str(dest)
            raise CliError(f"cannot write {shown_key(key)} to {where}: {exc.strerror or exc}") from None
        finally:
            if dest is not None:
                with suppress(OSError):  # closed above, or failing again: the first error is told
                    fh.close()
    if dest is not None:
        err.print(f"[green]✓[/green] got {escape(key)} ({format_size(len(view))}) in {took * 1000:.1f} ms -> {dest}")


def rm(
    ctx: typer.Context,
    keys: Annotated[list[str], typer.Argument(help="Keys to remove.")],
    force: Annotated[bool, typer.Option("--force", "-f", help="Succeed even if some keys do not exist.")] = False,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Remove KEYS; exits 3 if any did not exist (unless --force), the others are removed anyway."""
    for key in keys:
        check_key(key)
    keys = list(dict.fromkeys(keys))  # `rm a a` removes a once, and does not call the second one missing
    target = resolve_target(ctx, redis_url, namespace)
    with open_client(target) as client:
        removed = client.remove_many(keys)
    missing = [k for k, ok in zip(keys, removed, strict=True) if not ok]
    done = len(keys) - len(missing)
    if missing and not force:
        shown = ", ".join(shown_key(k) for k in missing[:5]) + (" ..." if len(missing) > 5 else "")
        # One line either way: what was missing, and that the rest went.
        raise CliError(f"{len(missing)} key(s) not found: {shown} (removed {done} other(s))", ExitCode.NOT_FOUND)
    err.print(f"[green]✓[/green] removed {done} key(s)")


def _dtype_name(dtype: str) -> str:
    try:
        return np.dtype(dtype).name  # "|u1" -> "uint8"
    except TypeError:
        return dtype  # e.g. bfloat16, which numpy does not know


def ls(
    ctx: typer.Context,
    pattern: Annotated[
        str, typer.Argument(help="Glob over keys (Redis MATCH syntax: * ? \\[abc] \\[^a-z], by character).")
    ] = "*",
    limit: Annotated[int, typer.Option("--limit", min=1, help="List at most this many keys.")] = 1000,
    as_json: JsonOpt = False,
    redis_url: RedisUrlOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """List keys with size, dtype, tier, node and age (sorted by key)."""
    require_stdout()
    target = resolve_target(ctx, redis_url, namespace)
    with open_client(target) as client:
        # One more than shown: whether the limit cut the listing short, not merely met it.
        listing = client.index.list_keys(pattern, limit=limit + 1)
        now_ms = client.index.server_time_ms()
    cut = len(listing) > limit
    listing = listing[:limit]
    if as_json:
        rows = [
            {
                "key": k.key,
                "size_bytes": k.size_bytes,
                "dtype": k.dtype,
                "shape": list(k.shape),
                "replicas": [{"node_id": r.node_id, "tier": str(r.tier), "state": str(r.state)} for r in k.replicas],
                "age_s": round(max(0, now_ms - k.created_ms) / 1000, 3),
            }
            for k in listing
        ]
        out.print_json_document(rows)
        if cut:  # not in the document: stdout holds the listing alone
            err.print(f"[dim](limit {limit} reached: more keys match)[/dim]")
        return
    if not listing:
        err.print(f"[dim]no keys match {escape(shown_key(pattern))} in namespace {target.namespace}[/dim]")
        return
    rows = [
        (
            k.key,
            format_size(k.size_bytes),
            _dtype_name(k.dtype) + (str(list(k.shape)) if len(k.shape) != 1 else ""),
            ",".join(sorted({str(r.tier) for r in k.replicas})),
            ",".join(r.node_id for r in k.replicas),
            age(max(0, now_ms - k.created_ms) / 1000),
        )
        for k in listing
    ]
    # Into a pipe or a file, each key's row whole on its line, however long (a script reads the
    # keys back); on a terminal, folded to its width.
    (out if out.is_terminal else wide_out).print(keys_view(rows))
    suffix = f" (limit {limit} reached: more keys match)" if cut else ""
    err.print(f"[dim]{len(listing)} key(s){suffix}[/dim]")
