"""Key patterns in Redis's MATCH syntax, matched by character (index/key_glob.py), and the
widened pattern the server is asked first (a superset of what matches)."""

from __future__ import annotations

import pytest

from mooncake_store.index.key_glob import glob_regex, server_pattern

CASES = [
    ("ключ-?", "ключ-ü", True),  # one character of two UTF-8 bytes
    ("ключ-??", "ключ-ü", False),
    ("[к]люч-ü", "ключ-ü", True),
    ("[^к]люч-ü", "ключ-ü", False),
    ("a*b", "axxb", True),
    ("a*b", "a\nb", True),  # * takes a newline too, as the server's does
    ("a\\*b", "a*b", True),  # an escaped * is a literal
    ("a\\*b", "axb", False),
    ("[a-c]x", "bx", True),
    ("[c-a]x", "bx", True),  # a range's ends in either order
    ("[^a-c]x", "bx", False),
    ("[^a-c]x", "dx", True),
    ("[\\]]x", "]x", True),  # an escaped ] inside a class
    ("[", "[", False),  # an empty class matches nothing
    ("[]x", "x", False),
    ("[^]x", "zx", True),  # an empty negated class takes any one character
    ("a.b", "axb", False),  # no regular-expression syntax leaks through
    ("(x)+", "(x)+", True),
]


@pytest.mark.parametrize(("pattern", "key", "matches"), CASES)
def test_patterns_match_by_character(pattern: str, key: str, matches: bool) -> None:
    assert bool(glob_regex(pattern).fullmatch(key)) is matches


@pytest.mark.parametrize(
    ("pattern", "sent"),
    [("ключ-?", "ключ-*"), ("[к]люч-*", "*люч-*"), ("a\\*b", "a\\*b"), ("x??y", "x*y"), ("plain", "plain")],
)
def test_the_server_is_asked_a_widened_pattern(pattern: str, sent: str) -> None:
    assert server_pattern(pattern) == sent
