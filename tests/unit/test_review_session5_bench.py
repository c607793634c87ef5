"""Review of benchmarks/ (session 5): defects in what the benchmarks compute or check.

No sockets and no timing here: each test calls a benchmark's own function with stand-ins for the
cluster or the connections and checks what it computes, reports or verifies.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
from helpers import bench_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import rawtcp  # noqa: E402

MiB = 1 << 20


# ---- rawtcp: the whole-object stream moves the objects it is credited with ---------------------
class _CountingClient:
    """RawClient's shape for objects_stream: ``socks`` and ``each_connection``."""

    def __init__(self, conns: int) -> None:
        self.socks = [object() for _ in range(conns)]

    def each_connection(self, fn):  # type: ignore[no-untyped-def]
        for k, sock in enumerate(self.socks):
            fn(k, sock)


@pytest.mark.parametrize("count", [3, 5, 23])
def test_objects_stream_moves_count_objects(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    # _stream_trial credits count * size bytes to the stream; objects_stream must move that many.
    moved = []
    monkeypatch.setattr(rawtcp.RawClient, "_get", staticmethod(lambda sock, view, n=1: moved.append(n)))
    views = [memoryview(bytearray(16))]
    rawtcp.objects_stream(_CountingClient(2), "get", views, count)
    assert sum(moved) == count, f"credited {count} objects, moved {sum(moved)}"


# ---- compare.py: a run without Mooncake's figures (it failed once) does not crash the report ------
def _figs() -> dict:
    return {
        "put": {MiB: 1.0},
        "get": {MiB: 1.0},
        "lat": {"p50_us": 100.0, "p99_us": 200.0},
        "batch": {"get_many_gbps": 1.0, "put_many_gbps": 1.0, "get_many_p50_ms": 1.0},
        "stalls": {"no_capacity": 0},
    }


def _compare_run(with_mooncake: bool) -> dict:
    systems = {"store shm": _figs(), "store tcp x4": _figs(), "store tcp x1": _figs(), "redis": _figs()}
    run: dict = {
        "limits": {"memcpy": {"cold": {MiB: 10.0}}, "tcp": {1: {"get": {MiB: 2.0}, "put": {MiB: 2.0}}}},
        "systems": systems,
    }
    if with_mooncake:
        systems["mooncake tcp"] = _figs()
    else:
        run["mooncake_skipped"] = "mooncake_master not ready within 20 s"
    return run


def test_compare_report_with_mooncake_missing_in_a_later_run() -> None:
    import compare

    table, verdicts = compare.report([_compare_run(True), _compare_run(False)], (MiB,))
    assert "mooncake tcp" in table
    assert verdicts


# ---- transfer.py: the x4 store case is held against the x4 raw limit measured in the same run -----
def test_transfer_tcp_x4_verdict_uses_the_x4_raw_limit() -> None:
    import transfer

    size = 8 * MiB
    store_fig = {
        "put": {size: 1.0},
        "get": {size: 1.5},
        "lat": {"p50_us": 1.0, "p99_us": 1.0, "put_p50_us": 1.0, "put_p99_us": 1.0},
    }
    run = {
        "limits": {
            "memcpy": {"hot": {size: 10.0}, "cold": {size: 10.0}},
            # 4 raw connections move twice what one does on this (made-up) machine.
            "tcp": {1: {"get": {size: 1.0}, "put": {size: 1.0}}, 4: {"get": {size: 2.0}, "put": {size: 2.0}}},
        },
        "store": {"tcp x4": store_fig},
    }
    _table, verdicts = transfer.report([run], (size,))
    (line,) = [v for v in verdicts if v.startswith("tcp x4 get_into 8 MiB")]
    # 1.5 GB/s over 4 connections is 0.75x what 4 raw connections moved: under the 0.85 target.
    assert "MISSED" in line, line


# ---- gpu.py: the get_into-cupy case's check reads through get_into ------------------------------
class _StubCupy:
    uint8 = np.uint8

    @staticmethod
    def empty(n, dtype=np.uint8):  # type: ignore[no-untyped-def]
        return np.zeros(n, dtype=dtype)

    @staticmethod
    def asnumpy(a):  # type: ignore[no-untyped-def]
        return np.asarray(a).copy()


def test_gpu_check_of_get_into_cupy_catches_a_broken_device_copy() -> None:
    gpu = bench_module("gpu")

    expected = np.arange(4096, dtype=np.uint8)

    class Client:
        def get(self, key, device=None):  # type: ignore[no-untyped-def]
            return expected.copy()  # the host read path is fine

        def get_into(self, key, dest):  # type: ignore[no-untyped-def]
            dest[:] = 0  # the device-to-device path under test writes wrong bytes

        def object_meta(self, key):  # type: ignore[no-untyped-def]
            return types.SimpleNamespace(replicas=[types.SimpleNamespace(tier="gpu")])

    client = Client()
    ok = gpu.check_case(_StubCupy(), client, client, "get_into cupy <- GPU tier", "g", "h", expected)
    assert ok is False


# ---- prefix.py: the layout case's byte check can fail ---------------------------------------------
def test_prefix_layout_check_catches_a_restore_that_wrote_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import prefix

    class Client:
        def put_many(self, items):  # type: ignore[no-untyped-def]
            pass

        def get_many_into(self, keys, outs):  # type: ignore[no-untyped-def]
            pass  # restores nothing

        def remove_many(self, keys):  # type: ignore[no-untyped-def]
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(prefix, "connect", lambda *a, **k: Client())
    cluster = types.SimpleNamespace(redis_url="redis://unused", namespace="unused")
    with pytest.raises(AssertionError):
        prefix.bench_layout(cluster, quick=True)


# ---- disk_codec.py (tiers.py): the disk tier's read-back check covers the read path --------------
def test_tiers_tier_io_check_catches_a_read_that_wrote_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import disk_codec

    from mooncake_store.tiers.disk import DiskTier

    monkeypatch.setattr(DiskTier, "read_into", lambda self, alloc_id, dest: len(dest))
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 256, 64 << 10, dtype=np.uint8) for _ in range(2)]
    with pytest.raises(RuntimeError):
        disk_codec.tier_io(chunks, tmp_path / "tier", 2, "never")


# ---- tiers.py: --tokens below one chunk is a clear argument error --------------------------------
def test_tiers_tokens_below_one_chunk_is_an_argument_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiers

    def no_run(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("the benchmark must not start with no KV chunks")

    monkeypatch.setattr(tiers, "run_once", no_run)
    with pytest.raises(SystemExit) as exc:
        tiers.main(["--tokens", "100", "--no-e2e"])
    assert exc.value.code == 2


# ---- tiers.py: the demotion rate of a run over within a few polls --------------------------------
def test_tiers_steady_rate_of_a_short_run_is_its_whole_rate_not_zero() -> None:
    import tiers

    # Sampled every 80 ms, 50 objects demoted within three polls: too few samples between 10% and
    # 90% of the final count for a slope, so the whole run's rate (it read 0.00 GB/s before).
    short = [(0.0, 0), (0.08, 10), (0.16, 40), (0.24, 50), (0.32, 50)]
    assert tiers.steady_rate(short, 1) == 50 / 0.24
    steady = [(float(t), 10 * t) for t in range(6)]
    assert abs(tiers.steady_rate(steady, 1) - 10.0) < 1e-9
    assert tiers.steady_rate([(0.0, 0), (0.08, 0)], 1) == 0.0
