"""Pydantic's validation errors as the spec's short phrases, each with its key path.

    trainer.batch_size: must be > 0, got -4
    trainer.batch_sise: unknown key (did you mean 'batch_size'?)
    rollout.engine.kind: unknown kind 'sglang' (registered: 'sim', 'torch', 'vllm')

``describe(err, model)`` takes one pydantic error of ``model`` and returns the path
as the spec writes it (pydantic's union tags dropped) and the phrase.
"""

from __future__ import annotations

import difflib
import re
import typing
from typing import Any

from pydantic import BaseModel

from rlfleet.common.spec.fields import SPEC_ERROR, num, show
from rlfleet.common.spec.registry import KindSlot

__all__ = ["SpecError", "describe", "dotted", "suggest", "toml_error"]


class SpecError(Exception):
    """Every problem found in one spec; ``errors`` holds one full line each."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))

_TYPE_NAMES = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number",
    "string_type": "a string", "string_unicode": "a string",
    "bool_type": "a boolean", "bool_parsing": "a boolean",
    "list_type": "a list", "tuple_type": "a list", "set_type": "a list",
    "dict_type": "a table", "model_type": "a table", "model_attributes_type": "a table",
}
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}


def describe(err: dict, model: type[BaseModel]) -> tuple[tuple, str]:
    """(path inside ``model``, phrase) for one pydantic error of ``model``."""
    kind, ctx = err["type"], err.get("ctx") or {}
    loc, _, slot = _resolve(model, tuple(err["loc"]))
    value = err.get("input")
    if kind == SPEC_ERROR:
        return loc, err["msg"]
    if kind in ("union_tag_invalid", "union_tag_not_found") and slot is not None:
        listed = ", ".join(map(repr, slot.registry.names()))
        if kind == "union_tag_not_found":
            return (*loc, "kind"), f"required key missing (registered: {listed})"
        return (*loc, "kind"), f"unknown kind {str(ctx.get('tag'))!r} (registered: {listed})"
    if kind == "missing":
        if slot is not None:
            names = list(map(repr, slot.registry.names()))
            listed = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 2 else names)
            return loc, f"required table missing: one with kind = {listed}"
        return loc, "required key missing"
    if kind == "extra_forbidden":
        parent = _resolve(model, tuple(err["loc"])[:-1])[1]
        return loc, "unknown key" + suggest(str(loc[-1]), list(parent.model_fields) if parent else [])
    if kind in _TYPE_NAMES:
        return loc, f"expected {_TYPE_NAMES[kind]}, got {show(value)}"
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        return loc, f"must be {op} {num(ctx[key])}, got {show(value)}"
    if kind == "finite_number":
        return loc, f"must be a finite number, got {show(value)}"
    if kind == "literal_error":
        choices = _literal_choices(ctx.get("expected", ""))
        if err["loc"] and err["loc"][-1] == "[key]":  # a dict key outside its Literal, e.g. a role
            raw = err["loc"]
            noun = "role" if len(raw) >= 3 and raw[-3] == "roles" else "key"
            return loc, f"unknown {noun}" + suggest(str(value), choices, or_list=True)
        return loc, f"must be one of {', '.join(map(repr, choices))}, got {show(value)}"
    if kind in ("too_short", "string_too_short"):
        if ctx.get("min_length") == 1:
            return loc, f"must not be empty, got {show(value)}"
        return loc, f"must have at least {ctx.get('min_length')} items, got {show(value)}"
    return loc, f"{err['msg']}, got {show(value)}"


def _resolve(model: type[BaseModel], loc: tuple) -> tuple[tuple, type[BaseModel] | None, KindSlot | None]:
    """Follow ``loc`` from ``model``: (the path without pydantic's markers and union
    tags, the model reached or None, the KindSlot of the last field if loc ends on one)."""
    clean: list[Any] = []
    current: type[BaseModel] | None = model
    slot: KindSlot | None = None
    parts = list(loc)
    i = 0
    while i < len(parts):
        part = parts[i]
        i += 1
        if part == "[key]":  # pydantic's marker for "the key itself", already in the path
            continue
        clean.append(part)
        slot = None
        if current is None or isinstance(part, int):
            continue  # a list index: the same element model
        field = current.model_fields.get(part)
        if field is None:
            current = None  # a dict key, or an unknown key
            continue
        slot = next((m for m in field.metadata if isinstance(m, KindSlot)), None)
        if slot is None:
            current = _inner_model(field.annotation)
        elif i < len(parts) and parts[i] in slot.registry.kinds():
            current = slot.registry.kinds()[parts[i]].Config  # the tag pydantic inserted
            i += 1
            slot = None
        else:
            current = None
    return tuple(clean), current, slot


def dotted(loc: tuple) -> str:
    """('placement', 'hosts', 0, 'name') -> 'placement.hosts[0].name'."""
    out = ""
    for part in loc:
        if part == "[key]":
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def suggest(word: str, known: Any, or_list: bool = False) -> str:
    known = list(known)
    close = difflib.get_close_matches(word, known, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if or_list and known:
        return f" (expected one of {', '.join(map(repr, known))})"
    return ""


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _literal_choices(expected: str) -> list[str]:
    # pydantic renders Literal choices as "'a', 'b' or 'c'".
    return re.findall(r"'([^']*)'", expected)


def toml_error(message: str) -> str:
    # tomllib (3.11) only puts the position in the message: "... (at line 3, column 12)".
    m = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
    if m:
        return f"line {m.group(1)}: invalid TOML: {message[: m.start()]} (column {m.group(2)})"
    return f"invalid TOML: {message}"
