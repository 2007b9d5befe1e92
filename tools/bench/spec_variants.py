"""Variants of a job spec for benchmarks: a copy of an example with a few keys changed,
written beside it (``examples/.*.toml`` is git-ignored) so its relative paths still hold."""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_variant(base: Path, suffix: str, change: Callable[[dict[str, Any]], None]) -> Path:
    """``base`` parsed, changed in place by ``change``, written to ``.<stem>-<suffix>.toml``."""
    spec = tomllib.loads(base.read_text())
    change(spec)
    out = base.with_name(f".{base.stem}-{suffix}.toml")
    out.write_text(f"# {base.name} with {suffix}, written by a benchmark (tools/bench)\n" + to_toml(spec))
    return out


def apply_overrides(spec: dict[str, Any], overrides: dict[str, Any] | None) -> None:
    """{"trainer.learning_rate": 1e-4, ...} set in ``spec``, tables made as needed."""
    for dotted, value in (overrides or {}).items():
        *tables, key = dotted.split(".")
        node = spec
        for t in tables:
            node = node.setdefault(t, {})
        node[key] = value


def parse_override(text: str) -> tuple[str, Any]:
    """SECTION.KEY=VALUE with VALUE read as TOML (1e-4, "linear", true); for argparse."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. trainer.learning_rate=1e-4), got {text!r}")
    try:
        return key.strip(), tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is not TOML: {exc}") from None


def to_toml(d: dict[str, Any], prefix: str = "") -> str:
    """Enough TOML for a job spec: scalars, lists of scalars, tables, arrays of tables."""
    lines, tables = [], []
    for k, v in d.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for item in v:
                tables.append((k, [item]))
        else:
            lines.append(f"{k} = {_value(v)}")
    out = "\n".join(lines) + ("\n" if lines else "")
    for k, v in tables:
        name = f"{prefix}{k}"
        if isinstance(v, list):
            out += f"\n[[{name}]]\n" + to_toml(v[0], f"{name}.")
        else:
            out += f"\n[{name}]\n" + to_toml(v, f"{name}.")
    return out


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")
