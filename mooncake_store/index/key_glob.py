"""Key patterns for listing, in Redis's MATCH syntax (``*``, ``?``, ``[abc]``, ``[^a-z]``, ``\\x``)
but matched by character. The server matches bytes: ``?`` took one byte of UTF-8, so ``ключ-?``
never listed ``ключ-ü`` (two bytes), and ``[к]`` matched neither of its two bytes. The server is
still asked, with every ``?`` and class widened to ``*`` (what it then lists is a superset), and
each name it lists is matched here by character (list_keys)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

#: What the server's matcher treats as syntax outside a class: escaped when a literal is sent.
_SYNTAX = frozenset("*?[]\\")


def _tokens(pattern: str) -> Iterator[tuple[str, str]]:
    """(kind, text) per element of ``pattern``, as the server's matcher reads it: ("any", "*"),
    ("one", "?"), ("class", a Python character class) or ("char", one literal character)."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            yield "any", c
        elif c == "?":
            yield "one", c
        elif c == "[":
            i += 1
            negate = i < n and pattern[i] == "^"
            i += negate
            items: list[str] = []
            while i < n and pattern[i] != "]":
                if pattern[i] == "\\" and i + 1 < n:
                    items.append(re.escape(pattern[i + 1]))
                    i += 2
                elif i + 2 < n and pattern[i + 1] == "-":
                    # A range, its ends in either order (as the server takes them).
                    low, high = sorted((pattern[i], pattern[i + 2]))
                    items.append(f"{re.escape(low)}-{re.escape(high)}")
                    i += 3
                else:
                    items.append(re.escape(pattern[i]))
                    i += 1
            # Unclosed, the class runs to the pattern's end, as on the server.
            if not items:
                yield "class", "." if negate else "(?!)"
            else:
                yield "class", f"[{'^' if negate else ''}{''.join(items)}]"
        elif c == "\\" and i + 1 < n:
            i += 1
            yield "char", pattern[i]
        else:
            yield "char", c
        i += 1


def glob_matcher(pattern: str) -> Callable[[str], bool]:
    """Whether a whole name matches ``pattern``, by character. In time linear in the name for a
    given pattern (the set of places in the pattern the name's prefix can have reached): a regular
    expression's backtracking took minutes over a name that failed a pattern of several stars, as
    the server's widened pattern lets through (``*[a]*[a]*[a]b`` sent as ``*b``)."""
    steps: list[Callable[[str], bool] | None] = []  # None: a star
    for kind, text in _tokens(pattern):
        if kind == "any":
            steps.append(None)
        elif kind == "one":
            steps.append(lambda _: True)
        elif kind == "class":
            steps.append(re.compile(text, re.DOTALL).fullmatch)
        else:
            steps.append(text.__eq__)
    end = len(steps)

    def closure(places: set[int]) -> set[int]:
        # A star may match nothing: the place after it is reached too.
        for place in sorted(places):
            while place < end and steps[place] is None:
                place += 1
                places.add(place)
        return places

    def matches(name: str) -> bool:
        places = closure({0})
        for ch in name:
            after: set[int] = set()
            for place in places:
                if place == end:
                    continue
                step = steps[place]
                if step is None:
                    after.add(place)  # a star takes the character and stays
                elif step(ch):
                    after.add(place + 1)
            if not after:
                return False
            places = closure(after)
        return end in places

    return matches


def server_pattern(pattern: str) -> str:
    """What the server is asked to match: ``pattern`` with each ``?`` and class widened to ``*``
    (they match characters here, bytes there), literals kept, escaped where they are syntax."""
    out: list[str] = []
    for kind, text in _tokens(pattern):
        if kind != "char":
            if not out or out[-1] != "*":
                out.append("*")
        else:
            out.append("\\" + text if text in _SYNTAX else text)
    return "".join(out)
