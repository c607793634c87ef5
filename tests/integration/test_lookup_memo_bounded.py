"""A client keeps the decoded record of each key it read, for reuse: keyed by the record's fields
too, every replace of a key that was read again left an entry for a record gone (about 1 KiB
each, 17 MiB per client before the cap cleared them all; a probe). One entry per key now."""

from __future__ import annotations

import numpy as np

from mooncake_store import Client


def test_reading_a_key_replaced_again_and_again_keeps_one_decoded_record(shared_client: Client) -> None:
    index = shared_client.index
    for i in range(200):
        value = np.full(64, i % 251, dtype=np.uint8)
        shared_client.put("memo/replaced", value)
        assert np.array_equal(shared_client.get("memo/replaced"), value)  # the new record, never the old
    # An entry is the key's (here), or was a (key, *fields) tuple's: counted either way.
    entries = [k for k in index._decoded if (k if isinstance(k, str) else k[0]) == "memo/replaced"]
    assert len(entries) == 1, len(entries)
    shared_client.remove("memo/replaced")
