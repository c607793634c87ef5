"""`mooncake ls`, `stat` and `doctor` over an index holding a record not of this build's making
(review, thirty-sixth session): an object record of bytes that are no UTF-8 and a heartbeat
deadline of inf made them print "internal error: UnicodeDecodeError / OverflowError". `ls` now
names the bad record as a ProtocolError; `stat` and `doctor` leave the bad row out."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mooncake_store import Client, LocalCluster

from .conftest import Mooncake


@pytest.mark.parametrize("hostile", ["dtype_bytes", "hb_inf"])
def test_cli_commands_over_a_hostile_record_say_no_internal_error(
    mooncake: Mooncake, make_cluster: Callable[..., LocalCluster], make_client: Callable[..., Client], hostile: str
) -> None:
    cluster = make_cluster(1)
    client = make_client(cluster, timeout_s=5.0)
    client.put("k", b"v")
    r, p = client.index.redis, client.index.prefix
    if hostile == "dtype_bytes":
        r.hset(p + "o:k", "dtype", b"\xff")
    else:
        r.zadd(p + "hb", {"ghost": float("inf")})
    where = ("--redis-url", cluster.redis_url, "--namespace", cluster.namespace)
    for command in ("ls", "stat", "doctor"):
        done = mooncake(command, *where)
        said = done.stderr.decode(errors="replace")
        assert "internal error" not in said and "Traceback" not in said, (command, said)
        if hostile == "dtype_bytes" and command == "ls":
            assert done.returncode != 0 and "no UTF-8" in said, said
        if hostile == "hb_inf" or command != "ls":
            assert done.returncode in (0, 1), (command, done.returncode, said)  # doctor warns: 1
