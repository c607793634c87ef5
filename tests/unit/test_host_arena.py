"""HostArena / SharedSegment: a real /dev/shm segment, read back from a separate process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_store.errors import (
    ConfigError,
    ConnectError,
    InvalidValue,
    MooncakeError,
    NoCapacity,
    ProtocolError,
)
from mooncake_store.index.schema import key_prefix
from mooncake_store.tiers.host import SHM_DIR, HostArena, SharedSegment, segment_name

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A fresh segment name; whatever the test leaves behind under it is removed."""
    name = f"mooncake-test-{uuid.uuid4().hex}"
    try:
        yield name
    finally:
        (SHM_DIR / name).unlink(missing_ok=True)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    # A separate interpreter proves the bytes travel through the shared file, not this process.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_segment_name_is_sanitized_and_bounded() -> None:
    name = segment_name("prod/ns 1", "node:a1")
    assert name == f"mooncake.9.prod_ns_1.node_a1.{os.getpid()}"
    long = segment_name("n" * 300, "x/y")
    assert len(long) == 200
    assert long.endswith(f".{os.getpid()}")  # truncation never drops the pid
    assert all(c.isalnum() or c in "._-" for c in long)


def test_write_in_arena_read_in_other_process(shm_name: str) -> None:
    size = 4 << 20
    payload = os.urandom(1 << 20) + b"\x00\xff" * 37  # odd length, includes NUL and 0xff bytes
    offset = 12_345
    with HostArena.create(shm_name, size) as arena:
        assert arena.path == SHM_DIR / shm_name
        assert arena.path.stat().st_size == size
        view = arena.view(offset, len(payload))
        view[:] = payload
        view.release()

        # The child reads the payload back byte-for-byte and writes a marker the parent checks,
        # so the mapping is shared in both directions.
        result = run_python(
            f"""
            import sys
            from mooncake_store.tiers.host import SharedSegment
            with SharedSegment.attach({shm_name!r}, {size}) as seg:
                view = seg.view({offset}, {len(payload)})
                sys.stdout.write(bytes(view).hex())
                view.release()
                marker = seg.view(0, 4)
                marker[:] = b"ACK!"
                marker.release()
            """
        )
        assert result.returncode == 0, result.stderr
        assert bytes.fromhex(result.stdout) == payload

        marker = arena.view(0, 4)
        assert bytes(marker) == b"ACK!"
        marker.release()
    # The child exiting must not unlink the segment; only the arena's close does.
    assert not (SHM_DIR / shm_name).exists()


def test_client_exit_does_not_unlink(shm_name: str) -> None:
    with HostArena.create(shm_name, 1 << 16, prefault=False) as arena:
        result = run_python(
            f"""
            from mooncake_store.tiers.host import SharedSegment
            SharedSegment.attach({shm_name!r}, {1 << 16}).close()
            """
        )
        assert result.returncode == 0, result.stderr
        assert arena.path.exists()


def test_close_unlinks_and_is_idempotent(shm_name: str) -> None:
    arena = HostArena.create(shm_name, 1 << 16)
    path = arena.path
    assert path.exists()
    arena.close()
    assert not path.exists()
    assert arena.closed
    arena.close()  # second close is a no-op
    with pytest.raises(MooncakeError, match="closed"):
        arena.view(0, 1)


def test_close_without_unlink_keeps_file(shm_name: str) -> None:
    arena = HostArena.create(shm_name, 1 << 16)
    view = arena.view(100, 5)
    view[:] = b"hello"
    view.release()
    arena.close(unlink=False)
    assert arena.path.exists()
    with SharedSegment.attach(shm_name, 1 << 16) as seg:
        view = seg.view(100, 5)
        assert bytes(view) == b"hello"
        view.release()


def test_close_with_live_view_still_unlinks(shm_name: str) -> None:
    arena = HostArena.create(shm_name, 1 << 16)
    view = arena.view(0, 8)
    arena.close()  # must not raise even though a view is outstanding
    assert not arena.path.exists()
    # The held view stays valid (the pages stay mapped until it is released).
    view[:] = b"stillok!"
    assert bytes(view) == b"stillok!"
    view.release()


def test_attach_missing_segment_is_connect_error(shm_name: str) -> None:
    with pytest.raises(ConnectError, match=shm_name):
        SharedSegment.attach(shm_name, 4096)


def test_attach_smaller_file_is_protocol_error(shm_name: str) -> None:
    with HostArena.create(shm_name, 8192, prefault=False), pytest.raises(ProtocolError, match="8192"):
        SharedSegment.attach(shm_name, 16384)


def test_out_of_range_views(shm_name: str) -> None:
    with HostArena.create(shm_name, 4096) as arena:
        assert len(arena.view(4000, 96)) == 96
        assert len(arena.view(4096, 0)) == 0
        with pytest.raises(InvalidValue, match=r"offset=4000 length=97.*4096"):
            arena.view(4000, 97)
        with pytest.raises(InvalidValue, match="offset=-1"):
            arena.view(-1, 10)
        with pytest.raises(InvalidValue, match="length=-1"):
            arena.view(0, -1)
        with SharedSegment.attach(shm_name, 4096) as seg, pytest.raises(InvalidValue, match="4096"):
            seg.view(1, 4096)


def test_duplicate_create_fails(shm_name: str) -> None:
    with HostArena.create(shm_name, 4096, prefault=False) as arena:
        with pytest.raises(MooncakeError, match=str(arena.path)):
            HostArena.create(shm_name, 4096)
        # The failed create must not have removed the existing segment.
        assert arena.path.exists()


def test_bad_sizes_and_names(shm_name: str) -> None:
    with pytest.raises(InvalidValue, match="0"):
        HostArena.create(shm_name, 0)
    with pytest.raises(InvalidValue, match="-1"):
        HostArena.create(shm_name, -1)
    with pytest.raises(InvalidValue, match="name"):
        HostArena.create("../etc/passwd", 4096)
    assert not (SHM_DIR / shm_name).exists()


def test_not_enough_room_is_no_capacity(shm_name: str) -> None:
    st = os.statvfs(SHM_DIR)
    available = st.f_bavail * st.f_frsize
    need = available + (1 << 30)
    with pytest.raises(NoCapacity, match=rf"need {need} B.*available"):
        HostArena.create(shm_name, need)
    assert not (SHM_DIR / shm_name).exists()


@pytest.mark.parametrize("namespace", ["a\n", "", "a" * 65, "a{b}", "a b"])
def test_a_namespace_the_config_refuses_is_refused_by_the_index_too(namespace: str) -> None:
    """key_prefix matched with `$`, which also matches before a trailing newline: Client, RedisIndex
    and Agent, called directly, took "a\\n", whose segments (sanitized to "a_") were namespace
    "a_"'s, and which its sweep removed as its own."""
    with pytest.raises(ConfigError, match="namespace"):
        key_prefix(namespace)
