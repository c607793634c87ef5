"""`mooncake bench` against a detached cluster, its argument errors, and `mooncake demo` passing
through to the scenario-A demo (help, the message without torch, one tiny end-to-end run)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import mooncake_bin

from .conftest import Mooncake, assert_one_line_error

KiB, MiB = 1 << 10, 1 << 20


def test_bench_json_has_every_cell_and_leaves_no_keys(cluster_cli: Mooncake) -> None:
    result = cluster_cli("bench", "--seconds", "0.2", "--sizes", "4KiB,1MiB", "--batch", "16", "--json", timeout=120)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    data = json.loads(result.stdout)
    assert data["skipped"] == [], data["skipped"]
    assert data["prefix"].startswith("bench/") and data["prefix"].endswith("/")
    # The limit is measured for every size, and for the batch's 64 KiB objects.
    assert set(data["memcpy_gbps"]) == {str(4 * KiB), str(64 * KiB), str(MiB)}
    assert all(v > 0 for v in data["memcpy_gbps"].values())
    cells = {(c["transport"], c["size_bytes"]): c for c in data["cells"]}
    assert set(cells) == {(t, s) for t in ("shm", "tcp") for s in (4 * KiB, MiB)}
    for cell in cells.values():
        for name in ("put_gbps", "get_gbps", "put_ratio", "get_ratio", "memcpy_gbps"):
            assert isinstance(cell[name], float) and cell[name] > 0, (name, cell)
        assert cell["puts"] >= 3 and cell["gets"] >= 3 and cell["keys"] >= 1
    assert [lat["transport"] for lat in data["latency"]] == ["shm", "tcp"]
    for lat in data["latency"]:
        assert 0 < lat["get_p50_us"] <= lat["get_p99_us"], lat
    assert [b["transport"] for b in data["batch"]] == ["shm", "tcp"]
    for b in data["batch"]:
        assert b["objects"] == 16 and b["object_bytes"] == 64 * KiB
        assert b["get_many_gbps"] > 0 and b["get_many_ratio"] > 0 and b["put_many_gbps"] > 0, b
    listing = cluster_cli.ok("ls", "bench/*", "--json")
    assert json.loads(listing.stdout) == []


def test_bench_table_for_one_transport(cluster_cli: Mooncake) -> None:
    result = cluster_cli("bench", "--seconds", "0.05", "--sizes", "64KiB", "--transport", "tcp", "--batch", "4")
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    text = result.stdout.decode()
    assert "get/memcpy" in text and "64 KiB" in text and "p99" in text
    rows = [line.split()[0] for line in text.splitlines() if line.split()]
    assert "tcp" in rows and "shm" not in rows
    assert json.loads(cluster_cli.ok("ls", "bench/*", "--json").stdout) == []


def test_bench_skips_what_does_not_fit(cluster_cli: Mooncake) -> None:
    # 32 MiB objects cannot stay under 70 % of these 64 MiB arenas: skipped with the reason, not evicting.
    result = cluster_cli(
        "bench", "--seconds", "0.05", "--sizes", "32MiB", "--transport", "tcp", "--batch", "1", "--json"
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    data = json.loads(result.stdout)
    assert data["cells"] == []
    assert [(s["transport"], s["what"]) for s in data["skipped"]] == [("tcp", "32 MiB")]
    assert "does not fit" in data["skipped"][0]["reason"]


def _bench_keys(cli: Mooncake) -> list[str]:
    return [row["key"] for row in json.loads(cli.ok("ls", "bench/*", "--json").stdout)]


def test_bench_ctrl_c_removes_its_keys(cluster_cli: Mooncake) -> None:
    # Long enough that the run cannot end on its own before the signal lands, even when each
    # `mooncake ls` below takes seconds on a loaded machine (with 3 s it sometimes did: exit 0).
    # faulthandler: should it not stop, a SIGABRT prints where each of its threads was.
    proc = subprocess.Popen(
        [mooncake_bin(), "bench", "--seconds", "60", "--sizes", "64KiB", "--transport", "tcp"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**cluster_cli.env, "PYTHONFAULTHANDLER": "1"},
    )
    try:
        deadline = time.monotonic() + 30
        while not _bench_keys(cluster_cli):  # the put loop has started
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, stderr = proc.communicate(timeout=30)
            raise AssertionError(f"bench ran on 30 s after Ctrl-C:\n{stderr.decode(errors='replace')}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr.decode(errors="replace")
    assert b"Traceback" not in stderr
    assert _bench_keys(cluster_cli) == []


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["--sizes", "4KiB,zz"], 2, "not a size"),
        (["--sizes", "4KiB,,1MiB"], 2, "comma-separated"),
        (["--sizes", "0"], 2, "each size must be"),
        (["--transport", "rdma"], 2, "--transport"),
        (["--seconds", "0"], 2, "--seconds"),
        ([], 4, "mooncake up"),  # arguments are fine, but this test's state dir records no cluster
    ],
)
def test_bench_bad_input_is_one_line(mooncake: Mooncake, args: list[str], code: int, needle: str) -> None:
    result = mooncake("bench", *args)
    assert_one_line_error(result, code, needle)
    assert b"Traceback" not in result.stderr


def test_demo_and_bench_are_listed(mooncake: Mooncake) -> None:
    text = mooncake.ok("--help").stdout.decode()
    assert "demo" in text and "bench" in text
    text = mooncake.ok("bench", "--help").stdout.decode()
    for option in ("--sizes", "--transport", "--seconds", "--batch", "--json", "--redis-url"):
        assert option in text, option


def test_demo_help_lists_the_demo_options(mooncake: Mooncake) -> None:
    text = mooncake.ok("demo", "--help").stdout.decode()
    for option in ("--doc-tokens", "--chunk-tokens", "--new-tokens", "--layers", "--threads", "--no-check"):
        assert option in text, option
    bad = mooncake("demo", "--bogus")
    assert bad.returncode == 2 and b"--bogus" in bad.stderr and b"Traceback" not in bad.stderr


@pytest.mark.parametrize(
    ("option", "value", "needle"),
    [
        ("--doc-tokens", "-5", "-5 is less than 1"),
        ("--chunk-tokens", "0", "0 is less than 1"),
        ("--new-tokens", "-1", "-1 is less than 1"),
        ("--layers", "many", "'many' is not an integer"),
        ("--threads", "-2", "-2 is less than 0"),
        # 100000 threads crashed in libgomp (SIGSEGV) with the cluster up; 100000 tokens ran on.
        ("--threads", "100000", "100000 is more than"),
        ("--new-tokens", "100000", "100000 is more than 1024"),
    ],
)
def test_demo_numbers_out_of_range_are_refused_before_anything_runs(
    mooncake: Mooncake, option: str, value: str, needle: str
) -> None:
    """A negative document length reached torch ("internal error: RuntimeError ... negative
    dimension", exit 1) and --new-tokens -1 ran and exited 0."""
    result = mooncake("demo", option, value)
    text = result.stderr.decode()
    assert result.returncode == 2, text
    assert f"argument {option}: {needle}" in text and "Traceback" not in text
    # Named as it was run: the usage said `python -m mooncake_store.demo`.
    assert f"mooncake demo: error: argument {option}" in text and "usage: mooncake demo" in text


def test_demo_refuses_a_document_shorter_than_a_chunk(mooncake: Mooncake) -> None:
    """It ran with nothing stored ("chunks written by Q1: 0") and said the chunks were shared."""
    result = mooncake("demo", "--doc-tokens", "100", "--chunk-tokens", "256")
    text = result.stderr.decode()
    assert result.returncode == 2 and "Traceback" not in text, text
    assert "--doc-tokens 100 is less than --chunk-tokens 256" in text, text


def test_demo_that_would_not_fit_in_memory_is_refused_before_anything_is_built(mooncake: Mooncake) -> None:
    """--layers 1000 started two 11.5 GiB arenas on 24 GiB, and the OOM killer ended the demo with
    its agents left running. Now judged from the model's shape before it is built or started."""
    result = mooncake("demo", "--layers", "1000000", timeout=60)
    text = result.stderr.decode()
    assert result.returncode == 5 and "Traceback" not in text, text
    assert "use fewer --doc-tokens or --layers" in text and ("B free" in text or "B available" in text), text
    assert "parameters" not in result.stdout.decode()  # no model was built
    assert not (mooncake.state_dir / "cluster.json").exists()


def test_demo_without_torch_says_what_to_install(mooncake: Mooncake, tmp_path: Path) -> None:
    hidden = tmp_path / "no-torch"
    (hidden / "torch").mkdir(parents=True)
    (hidden / "torch" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    result = mooncake("demo", "--doc-tokens", "600", env={"PYTHONPATH": str(hidden)})
    text = result.stderr.decode()
    assert result.returncode == 2, text
    assert "pip install 'mooncake-store[hf]'" in text and "Traceback" not in text


def test_demo_runs_end_to_end(mooncake: Mooncake) -> None:
    args = ("--doc-tokens", "600", "--chunk-tokens", "64", "--layers", "2", "--new-tokens", "2")
    result = mooncake("demo", *args, timeout=300)
    text = result.stdout.decode()
    assert result.returncode == 0, (text, result.stderr.decode(errors="replace"))
    rows = [line for line in text.splitlines() if line[:2] in ("Q1", "Q2", "Q3") and "= recompute" in line]
    assert len(rows) == 3, text
    assert rows[1].split()[4] == "576" and rows[2].split()[4] == "576", text  # Q2 and Q3 matched the document
    assert rows[2].split()[1] == "pid", text  # Q3 restored in another process
    assert "restored 576 tokens" in text  # 9 full chunks of 64 tokens from the 600-token document
    assert "chunks written by Q1: 9, by Q2/Q3: 0" in text  # the document's chunks, stored once


def test_demo_refuses_a_chunk_size_past_the_caches_bound_before_it_starts(mooncake: Mooncake) -> None:
    """Refused only once the model was built and a cluster started, ~13 s in (then cleaned up)."""
    result = mooncake("demo", "--chunk-tokens", "2000000", timeout=30)
    assert result.returncode == 2, result.stderr
    assert b"2000000 is more than 1048576" in result.stderr and b"Traceback" not in result.stderr
    assert not (mooncake.state_dir / "cluster.json").exists()
