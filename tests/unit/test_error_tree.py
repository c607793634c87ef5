"""errors.py draws the tree of every error the store raises (DESIGN.md §6): the drawing is what
users read, so it must name every class errors.py defines, under its real parent."""

from __future__ import annotations

import re

from mooncake_store import errors


def _drawn() -> dict[str, str]:
    """class -> parent, from the docstring's tree: a class's depth is the column its name starts
    at (4 for the root, 4 more per level)."""
    parents: dict[str, str] = {}
    stack: list[str] = []
    for line in (errors.__doc__ or "").splitlines():
        match = re.search(r"[A-Z]\w+", line)
        if not match or not isinstance(getattr(errors, match.group(), None), type):
            continue
        depth = (match.start() - 4) // 4
        del stack[depth:]
        if stack:
            parents[match.group()] = stack[-1]
        stack.append(match.group())
    return parents


def test_the_docstring_draws_every_error_under_its_parent() -> None:
    defined = {
        name: cls.__mro__[1].__name__
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, errors.MooncakeError) and cls is not errors.MooncakeError
    }
    assert _drawn() == defined
