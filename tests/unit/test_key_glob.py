"""Key patterns in Redis's MATCH syntax, matched by character (index/key_glob.py), and the
widened pattern the server is asked first (a superset of what matches)."""

from __future__ import annotations

import pytest

from mooncake_store.index.key_glob import glob_matcher, server_pattern

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
    assert glob_matcher(pattern)(key) is matches


@pytest.mark.parametrize(
    ("pattern", "sent"),
    [("ключ-?", "ключ-*"), ("[к]люч-*", "*люч-*"), ("a\\*b", "a\\*b"), ("x??y", "x*y"), ("plain", "plain")],
)
def test_the_server_is_asked_a_widened_pattern(pattern: str, sent: str) -> None:
    assert server_pattern(pattern) == sent


def test_a_name_that_fails_a_pattern_of_many_stars_is_told_at_once() -> None:
    """A regular expression backtracked over every split of the name (minutes for 80 characters
    and eight stars); the matcher keeps the set of places reached, one pass over the name. No
    timing is asserted: before, this test did not finish."""
    pattern = "*[a]" * 12 + "b"
    assert glob_matcher(pattern)("a" * 2000 + "cb") is False
    assert glob_matcher(pattern)("a" * 2000 + "b") is True
