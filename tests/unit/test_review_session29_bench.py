"""Review of benchmarks/ (session 29): a read check that a get copying nothing passed, and
verdicts given on a limit the table itself marks unreliable. No sockets and no timing: each test
calls a benchmark's own function and checks what it verifies or reports."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import benchlib  # noqa: E402
import compare_report  # noqa: E402

MiB = 1 << 20


def _stored(count: int, size: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """A case's source and what each of its keys holds once put (its stamp in the first 8 bytes)."""
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    held = {}
    for i in range(count):
        benchlib.stamp(src, i)
        held[i] = src.copy()
    return src, held


def test_check_reads_passes_reads_of_each_keys_own_bytes() -> None:
    src, held = _stored(4, 4096)
    dst = np.empty_like(src)
    benchlib.check_reads(lambda i: dst.__setitem__(slice(None), held[i]), src, dst, 4, "store")


@pytest.mark.parametrize("fault", ["writes nothing", "another key's bytes"])
def test_check_reads_catches_a_get_that_copied_nothing_or_the_wrong_key(fault: str) -> None:
    """The loop's last read was checked alone, against bytes every key shared: a get that copied
    nothing after the warm-up (which had filled the buffer) passed at 714 GB/s."""
    src, held = _stored(4, 4096)
    dst = held[3].copy()  # what the warm-up and the loop's reads left there

    def read(i: int) -> None:
        if fault == "another key's bytes":
            dst[:] = held[(i + 1) % 4]

    with pytest.raises(RuntimeError, match="key 0 read back wrong bytes"):
        benchlib.check_reads(read, src, dst, 4, "store")


def _figs(get_gbps: float) -> dict[str, Any]:
    sizes = (8 * MiB, 32 * MiB)
    return {
        "put": dict.fromkeys(sizes, 1.0),
        "get": dict.fromkeys(sizes, get_gbps),
        "lat": {"p50_us": 100.0, "p99_us": 200.0},
        "batch": {"get_many_gbps": 1.0, "put_many_gbps": 1.0, "get_many_p50_ms": 1.0},
        "stalls": {"no_capacity": 0},
    }


def test_a_store_figure_above_its_raw_limit_is_not_judged_met() -> None:
    """The table cell said "1.50 (limit unreliable)" while the verdict said "met"."""
    sizes = (8 * MiB, 32 * MiB)
    raw = {c: {"get": dict.fromkeys(sizes, 2.0), "put": dict.fromkeys(sizes, 2.0)} for c in (1, 4)}
    run = {
        "limits": {"memcpy": {"cold": dict.fromkeys(sizes, 10.0)}, "tcp": raw},
        "systems": {
            "store shm": _figs(3.0),
            "store tcp x4": _figs(3.0),
            "store tcp x1": _figs(1.0),
            "redis": _figs(1.0),
        },
        "mooncake_skipped": "not installed",
    }
    lines = compare_report.verdicts([run], list(run["systems"]))
    x4 = [line for line in lines if line.startswith("tcp x4 get_into") and "raw TCP" in line]
    x1 = [line for line in lines if line.startswith("tcp x1 get_into") and "raw TCP" in line]
    assert x4 and all("1.50x -> not judged (limit unreliable)" in line for line in x4), x4
    assert x1 and all("0.50x -> MISSED" in line for line in x1), x1
