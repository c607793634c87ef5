"""Keys that are not UTF-8 on the command line, and how messages quote keys.

- A key given as bytes that are not UTF-8 was quoted as the lone surrogate Python decodes such a
  byte to (`'\\udcff'`); it is quoted as the byte (`'\\xff'`), and a character that repr() showed
  the same way (U+00A0 as `'\\xa0'`) as `'\\u00a0'`.
"""

from __future__ import annotations

import os

import pytest

from .conftest import Mooncake, assert_one_line_error

#: A key as `mooncake put $'bad\xff' -` passes it: the byte 0xff, not UTF-8.
UNDECODABLE = os.fsdecode(b"bad\xff")


@pytest.mark.parametrize(
    "args",
    [("put", UNDECODABLE, "-"), ("get", UNDECODABLE), ("rm", "fine", UNDECODABLE), ("ls", UNDECODABLE + "*")],
    ids=["put", "get", "rm", "ls"],
)
def test_a_key_that_is_not_utf8_is_refused_naming_its_byte(cluster_cli: Mooncake, args: tuple[str, ...]) -> None:
    line = assert_one_line_error(cluster_cli(*args, stdin=b"x"), 2, "'bad\\xff", "\\xff (character 4)")
    assert "udc" not in line, line


def test_a_missing_key_is_named_so_that_no_character_looks_like_a_byte(cluster_cli: Mooncake) -> None:
    """U+00A0 (no-break space) is a key's character like any other; repr() shows it as '\\xa0',
    as a byte 0xa0 that is not UTF-8 is shown now."""
    key = "nbsp\u00a0"
    assert_one_line_error(cluster_cli("get", key), 3, "key 'nbsp\\u00a0' not found")
    assert_one_line_error(cluster_cli("rm", key), 3, "1 key(s) not found: 'nbsp\\u00a0'")
