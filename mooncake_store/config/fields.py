"""The table of the config tree's fields (dotted key, kind, env var) and where a value came from.

Kept apart from the dataclasses so that the value checks can name a field and its source without
importing the tree, whose ``__post_init__`` calls those checks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from mooncake_store.config.values import ENV_PREFIX


@dataclass(frozen=True, slots=True, kw_only=True)
class _Field:
    key: str  # dotted: "redis_url", "agent.host_bytes"
    section: str | None
    name: str
    kind: str  # str, optstr, int, size, float, bool, tuple
    env_var: str


@dataclass(frozen=True, slots=True, kw_only=True)
class _Source:
    kind: str  # default, code, file, env, override
    detail: str = ""  # the file path or the env var name

    def label(self, key: str) -> str:
        """Prefix of an error message: where the value came from and which key it was for."""
        if self.kind == "env":
            return f"env {self.detail}"
        if self.kind == "file":
            return f"file {self.detail}: {key}"
        if self.kind == "override":
            return self.detail or f"override {key}"  # the detail: the flag that gave it, if known
        return key

    def describe(self) -> str:
        if self.kind == "env":
            return f"env {self.detail}"
        if self.kind == "file":
            return f"file {self.detail}"
        if self.kind == "override" and self.detail:
            return self.detail  # the flag that gave it
        return self.kind


_DEFAULT = _Source(kind="default")
_CODE = _Source(kind="code")

_KIND_BY_ANNOTATION = {
    "str": "str",
    "str | None": "optstr",
    "int": "int",
    "float": "float",
    "bool": "bool",
    "tuple[str, ...]": "tuple",
}


def _build_fields(sections: tuple[tuple[str | None, type], ...]) -> dict[str, _Field]:
    """The table of every leaf field of ``sections`` ((section name or None for the root, dataclass))."""
    nested = {section for section, _ in sections if section is not None}
    table: dict[str, _Field] = {}
    for section, cls in sections:
        for f in fields(cls):
            if f.name in nested:
                continue  # a section is not a value: its own fields are listed under it
            # Annotations are strings under `from __future__ import annotations` (which the tree's
            # module uses); the table maps them.
            kind = _KIND_BY_ANNOTATION[str(f.type)]
            if kind == "int" and f.name.endswith("_bytes"):
                kind = "size"
            key = f.name if section is None else f"{section}.{f.name}"
            env_var = ENV_PREFIX + key.replace(".", "_").upper()
            table[key] = _Field(key=key, section=section, name=f.name, kind=kind, env_var=env_var)
    return table
