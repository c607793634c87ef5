"""The arena allocator's cost per operation as its free blocks grow in number.

An arena of many small objects freed out of order holds as many free blocks as objects. Each case
here leaves N one-object holes (every other 4 KiB block of 2N freed), then frees and takes back
objects in random order, timing each ``free`` and ``allocate``; a second case frees all 2N
objects in random order (every free merges, each removing its neighbours from the size heaps in
O(log n)). The table gives the mean and the slowest operation. The machine's own floor is timed in
the same run: a Python dict store and pop per operation (the least bookkeeping any allocator
written in Python does); the ratio to it should not grow with N.

    python benchmarks/allocator.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import exit_on_stop_signals, machine_line, markdown_table

from mooncake_store.tiers.allocator import OffsetAllocator

BLOCK = 4096
OPS = 2000


def holes(n: int) -> tuple[OffsetAllocator, list[int]]:
    """An allocator with ``n`` isolated free blocks, and its live offsets in random order."""
    alloc = OffsetAllocator(2 * n * BLOCK, alignment=64)
    offsets = [alloc.allocate(BLOCK) for _ in range(2 * n)]
    for off in offsets[::2]:
        alloc.free(off)  # type: ignore[arg-type]
    live = [off for off in offsets[1::2] if off is not None]
    random.Random(n).shuffle(live)
    return alloc, live


def timed(calls: list[Callable[[], object]]) -> tuple[float, float]:
    """(mean, slowest) of the calls, in us."""
    times = []
    for call in calls:
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.fmean(times), 1e6 * max(times)


def per_op_us(n: int) -> dict[str, tuple[float, float]]:
    """(mean, slowest) us per free and allocate among ``n`` holes, and per free of everything."""
    alloc, live = holes(n)
    out = {
        "free": timed([partial(alloc.free, off) for off in live[:OPS]]),
        "allocate": timed([partial(alloc.allocate, BLOCK) for _ in range(OPS)]),
    }
    alloc, live = holes(n)
    rest = [off for off, _ in alloc.allocations()]
    random.Random(-n).shuffle(rest)
    out["free all"] = timed([partial(alloc.free, off) for off in rest])
    assert alloc.free_blocks() == [(0, alloc.capacity_bytes)]
    return out


def dict_floor_us(n: int) -> float:
    """A dict store and pop per operation, on a dict of ``n`` entries: the floor of Python bookkeeping."""
    table = {i * BLOCK: BLOCK for i in range(n)}
    keys = list(table)[:OPS]
    started = time.perf_counter()
    for key in keys:
        size = table.pop(key)
        table[key] = size
    return 1e6 * (time.perf_counter() - started) / OPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and one round each")
    args = parser.parse_args()
    exit_on_stop_signals()
    print(machine_line())
    sizes = (1_000, 100_000) if args.quick else (1_000, 10_000, 100_000, 400_000)
    rounds = 1 if args.quick else 3
    rows = []
    for n in sizes:
        cases: dict[str, list[tuple[float, float]]] = {}
        floors = []
        for _ in range(rounds):
            for case, stat in per_op_us(n).items():
                cases.setdefault(case, []).append(stat)
            floors.append(dict_floor_us(n))
        floor = statistics.median(floors)
        row = [f"{n:,}", f"{floor:.2f}"]
        for stats in cases.values():
            mean = statistics.median(m for m, _ in stats)
            row.append(f"{mean:.1f} / {max(s for _, s in stats):,.0f} ({mean / floor:.0f}x)")
        rows.append(row)
    header = ["holes", "dict floor, us", "free, us: mean / slowest", "allocate", "free all (2N)"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
