"""How messages quote a key (types.shown_text / shown_key): as repr() does, except that a byte that
was not UTF-8 on the command line (a lone surrogate U+DC80..U+DCFF after Python's surrogateescape)
shows as that byte, ``\\xff``, and a character repr() would show the same way as ``\\u00NN``."""

from __future__ import annotations

import os

import pytest

from mooncake_store.types import shown_key, shown_text


@pytest.mark.parametrize("text", ["plain/key", "it's", 'say "hi"', "both ' and \"", "back\\slash", "日本語", "é", "\n"])
def test_text_without_such_characters_is_quoted_as_repr_quotes_it(text: str) -> None:
    assert shown_text(text) == repr(text)


def test_an_undecodable_byte_shows_as_the_byte() -> None:
    assert shown_text(os.fsdecode(b"a\xff")) == "'a\\xff'"  # repr: 'a\udcff'
    assert shown_text(os.fsdecode(b"\xc3\xa9\x80's")) == '"é\\x80\'s"'


def test_a_byte_and_a_character_never_look_alike() -> None:
    byte, char = os.fsdecode(b"\xa0"), "\u00a0"
    assert shown_text(byte) == "'\\xa0'"
    assert shown_text(char) == "'\\u00a0'"  # repr: '\xa0', what the byte shows as
    assert shown_text("\x85") == "'\\u0085'"
    assert shown_text("\x07") == repr("\x07")  # ASCII control characters are never such bytes


def test_a_long_key_is_cut_with_its_length() -> None:
    key = os.fsdecode(b"\xff" * 100)
    assert shown_key(key) == "'" + "\\xff" * 60 + "'… (100 characters)"
