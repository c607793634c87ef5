"""`mooncake put`/`get` local-path errors (review, thirty-third session): a stream source that
fails to read was exit 1 naming no file, and an empty path was "': is a directory"."""

from __future__ import annotations

from .conftest import Mooncake, assert_one_line_error


def test_put_of_a_size_zero_file_that_refuses_reads_is_usage_naming_it(cluster_cli: Mooncake) -> None:
    """/proc/self/mem is a regular file of size 0, read as a stream (as stdin or a FIFO); reading
    it from offset 0 fails with EIO: "error: Input/output error", exit 1."""
    assert_one_line_error(cluster_cli("put", "s33/mem", "/proc/self/mem"), 2, "/proc/self/mem: cannot read")


def test_put_of_an_empty_path_says_so(cluster_cli: Mooncake) -> None:
    assert_one_line_error(cluster_cli("put", "s33/empty-path", ""), 2, "FILE is empty")


def test_get_into_an_empty_output_path_says_so(cluster_cli: Mooncake) -> None:
    cluster_cli.ok("put", "s33/small", "-", stdin=b"abc")
    assert_one_line_error(cluster_cli("get", "s33/small", "-o", ""), 2, "the output path is empty")
