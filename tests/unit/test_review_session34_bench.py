"""Reads timed by a benchmark (benchmarks/ and `mooncake bench`) are checked after their loop so that
a path that copies nothing after its warm-up, or copies another key's bytes, cannot look fast.

No sockets and no timing: stand-in clients whose reads are broken in one way each; what is under
test is the benchmarks' own checking."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import bench_module
from mooncake_cli.bench_checks import ReadCheckFailed
from mooncake_cli.commands.bench_measure import Bench, Results
from mooncake_cli.exits import CliError

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import benchlib  # noqa: E402

gpu = bench_module("gpu")

KiB = 1 << 10


class CopiesOnce:
    """A store whose reads copy bytes on their first call only; later ones return at once."""

    def __init__(self) -> None:
        self.data: dict[str, np.ndarray] = {}
        self.reads = 0

    def put(self, key: str, value: Any) -> None:
        self.data[key] = np.array(value, dtype=np.uint8, copy=True)

    def get_into(self, key: str, dst: np.ndarray) -> None:
        self.reads += 1
        if self.reads == 1:
            dst[:] = self.data[key]

    def put_many(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            self.put(key, value)

    def get_many_into(self, keys: list[str], outs: list[np.ndarray]) -> None:
        self.reads += 1
        if self.reads == 1:  # the warm-up call
            for key, out in zip(keys, outs, strict=True):
                out[:] = self.data[key]

    def stat(self) -> Any:
        """An empty 1 GiB host arena: the store's loop waits for room for each size's keys."""
        host = types.SimpleNamespace(tier="host", used_bytes=0, capacity_bytes=1 << 30)
        return types.SimpleNamespace(live_nodes=(types.SimpleNamespace(tiers=(host,)),))

    def remove_many(self, keys: list[str]) -> list[bool]:
        return [self.data.pop(key, None) is not None for key in keys]

    def remove(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def __enter__(self) -> CopiesOnce:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class ReadsTheFirstKey(CopiesOnce):
    """Every read returns the bytes of the first key put, whatever key it names."""

    def get_into(self, key: str, dst: np.ndarray) -> None:
        dst[:] = next(iter(self.data.values()))


class LatencyKeyWritesNothing(CopiesOnce):
    """Reads are right, but for the latency loop's key, whose reads write nothing."""

    def get_into(self, key: str, dst: np.ndarray) -> None:
        if not key.endswith("-lat"):
            dst[:] = self.data[key]


def cli_bench() -> Bench:
    results = Results(prefix="bench/x/", seconds=0.05)
    for size in (4 * KiB, 64 * KiB):
        results.memcpy[size] = 10.0
    progress = types.SimpleNamespace(
        add_task=lambda *a, **k: 0, update=lambda *a, **k: None, advance=lambda *a, **k: None
    )
    return Bench(base=None, target=None, results=results, progress=progress)  # type: ignore[arg-type]


@pytest.mark.parametrize("client", [CopiesOnce(), ReadsTheFirstKey()], ids=["copies-once", "reads-the-first-key"])
def test_cli_bench_throughput_checks_every_key_it_read(client: CopiesOnce) -> None:
    """Every key held the same bytes and only the last read, into a buffer the first had filled,
    was compared: both broken reads passed as fast ones."""
    with pytest.raises(CliError, match=r"get_into of 65536 B: key \d+ read back wrong bytes"):
        cli_bench()._throughput(client, "shm", 64 * KiB, 1 << 30, lambda _text: None)


def test_cli_bench_batch_checks_a_read_after_its_loop() -> None:
    with pytest.raises(CliError, match="shm get_many_into: read back wrong bytes"):
        cli_bench()._batch(CopiesOnce(), "shm", 16)


def test_the_store_batch_checks_a_read_after_its_loop() -> None:
    """compare.py's batch figures: the outs checked were those the warm-up had filled."""
    with pytest.raises(ReadCheckFailed, match="get_many_into: read back wrong bytes"):
        benchlib._store_batch(CopiesOnce(), "t", quick=True)


def test_the_store_latency_loop_checks_what_it_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 4 KiB get_into latency loop (the "p50 no worse than Mooncake" target) checked nothing."""
    import mooncake_store

    monkeypatch.setattr(mooncake_store, "connect", lambda *a, **k: LatencyKeyWritesNothing())
    with pytest.raises(ReadCheckFailed, match="shm 4 KiB get_into: read back wrong bytes"):
        benchlib._store_measure("redis://x", "ns", "shm", 1, (4 * KiB,), True, False)


def test_the_gpu_put_case_is_checked_on_a_key_only_its_timed_loop_wrote() -> None:
    """The warm-up's two puts wrote keys 0 and 1, and the check read key 0: a put that stored nothing
    after the warm-up was reported exact."""
    src = np.random.default_rng(1).integers(0, 256, 64 * KiB, dtype=np.uint8)
    stored: dict[str, np.ndarray] = {}
    puts = 0

    def put_stored_by_warm_up_only(key: str) -> None:
        nonlocal puts
        puts += 1
        if puts <= 2:
            stored[key] = src.copy()

    client = types.SimpleNamespace(
        object_meta=lambda key: types.SimpleNamespace(replicas=[types.SimpleNamespace(tier="gpu")]),
        get=lambda key: stored[key],
    )
    keys = [f"gpu/x/{i}" for i in range(gpu.SLOTS)]
    figures = gpu.measure(lambda i: put_stored_by_warm_up_only(keys[i % gpu.SLOTS]), src.nbytes, quick=True)
    key = gpu.put_check_key(keys, int(figures["iters"]))
    with pytest.raises(KeyError):  # the timed loop stored nothing there: no bytes to call exact
        gpu.check_case(None, client, None, gpu.PUT_GPU, key, key, src)


def test_an_output_path_a_run_could_not_write_is_refused_before_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json naming a directory was found out after the whole run, --out and --profile naming a
    file, and a --host-bytes /dev/shm cannot hold, each as a traceback (the last after the limits
    were measured). Each is exit 2 at once now, saying why."""
    import compare
    import tiers
    import transfer

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (transfer.main, ["--quick", "--json", str(tmp_path)], "--json .* is a directory; name a file"),
        (transfer.main, ["--quick", "--host-bytes", str(1 << 60)], "is more than /dev/shm has free"),
        (compare.main, ["--quick", "--out", str(a_file)], "--out .* is not a directory"),
        (tiers.main, ["--quick", "--spill-only", "--profile", str(a_file)], "--profile .* is not a directory"),
        (tiers.main, ["--quick", "--json", str(a_file / "x.json")], r"--json .*x.json: cannot write under"),
    ]
    for main, argv, said in cases:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2, argv
        assert re.search(said, capsys.readouterr().err), argv
