"""The key reference: every dotted key with its type, default and meaning, read from the
schema's field comments (so the docs cannot drift from the dataclasses)."""

import ast
import dataclasses
import functools
import inspect
import typing
from typing import Any

import yaml

import oppo_jax.config.schema as schema
from oppo_jax.config.schema import STABLE_KEYS, Config
from oppo_jax.config.validate import type_name


def leaves(cls: type, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, comment) of every leaf field, in declaration order."""
    out = []
    hints, comments = typing.get_type_hints(cls), _field_comments().get(cls.__name__, {})
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += leaves(hint, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        out.append((prefix + f.name, hint, default, comments.get(f.name, "")))
    return out


@functools.cache
def _field_comments() -> dict[str, dict[str, str]]:
    """``field_comments`` of the schema module."""
    return field_comments(inspect.getsource(schema))


def field_comments(source: str) -> dict[str, dict[str, str]]:
    """{class: {field: comment}} of the dataclass fields in ``source``: a field's trailing
    comment, else the comment lines just above it joined into one text.

    Example: ``# two\\n# lines\\nx: int = 1`` gives x "two lines"; ``y: int = 2  # one`` gives
    y "one".
    """
    lines = source.splitlines()
    out: dict[str, dict[str, str]] = {}
    for cls in [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]:
        for stmt in [s for s in cls.body if isinstance(s, ast.AnnAssign)]:
            code, above = lines[stmt.end_lineno - 1], []
            row = stmt.lineno - 2  # 0-based index of the line above the field
            while row >= 0 and lines[row].strip().startswith("#"):
                above.insert(0, lines[row].strip().removeprefix("#").strip())
                row -= 1
            text = code.split("  # ", 1)[1] if "  # " in code else " ".join(above)
            out.setdefault(cls.name, {})[ast.unparse(stmt.target)] = text.strip()
    return out


def _yaml_value(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    return yaml.safe_dump(value, default_flow_style=True).splitlines()[0]


def config_keys_doc() -> str:
    """Markdown table of every dotted key: type, default and meaning (from the field comments)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, hint, default, comment in leaves(Config):
        meaning = comment + (" (stable key)" if key in STABLE_KEYS else "")
        cells = (f"`{key}`", f"`{type_name(hint)}`", f"`{_yaml_value(default)}`", meaning)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
