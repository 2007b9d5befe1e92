"""The sim engine's output lengths: how many tokens a turn generates before it stops.

A length is a pure function of the engine's seed, the request's *base prompt* (the prompt
less its last ``prefix_tokens``, i.e. what every member of a GRPO group and every
continuation of one turn share) and its trajectory id. So a turn continued on another
engine (same seed) stops where the uninterrupted one would have, and the members of a
group are correlated through the prompt they share.

Two models, the table ``[rollout.engine.lengths]`` (``kind`` picks one):

- ``lognormal``: median and p99 in tokens; ``z = rho * z_group + sqrt(1 - rho^2) * z_member``
  with ``rho = group_correlation``, ``length = round(exp(ln(median) + sigma * z))``,
  ``sigma = ln(p99 / median) / 2.3263`` (2.3263 = the standard normal's 99th percentile).
- ``trace``: a JSONL file of observed lengths, one GRPO group per line
  (``{"lengths": [812, 4051, ...]}``; ``{"length": 812}`` is a group of one). The group
  hash picks the line, the trajectory hash a member of it.

Either way the engine caps the length at the turn's token budget (max_new_tokens +
prefix_tokens). Hashes are xxh64 (stable across processes, unlike ``hash()``).

Pure Python (no numpy): this module is imported whenever a spec is validated.
"""

from __future__ import annotations

import abc
import json
import math
import os
from pathlib import Path
from statistics import NormalDist
from typing import Annotated, Any, Literal

import xxhash
from pydantic import Field, ValidationInfo, field_validator

from rlfleet.common.spec.fields import PosFloat, fail, not_beyond
from rlfleet.common.spec.registry import Kind, KindConfig, Registry

Z_P99 = 2.3263478740408408  # NormalDist().inv_cdf(0.99)
_NORMAL = NormalDist()
Unit = Annotated[float, Field(strict=True, ge=0, le=1, allow_inf_nan=False)]


def length_keys(seed: int, base_prompt: bytes | memoryview, trajectory_id: str) -> tuple[int, int]:
    """(group key, member key): 64-bit hashes of the base prompt and of the trajectory."""
    return (xxhash.xxh64_intdigest(base_prompt, seed=seed),
            xxhash.xxh64_intdigest(b"member:" + trajectory_id.encode(), seed=seed))


def unit_normal(key: int) -> float:
    """A standard normal deviate from a 64-bit hash (its top 53 bits as a uniform in (0, 1))."""
    return _NORMAL.inv_cdf(((key >> 11) + 0.5) / 2.0**53)


class LengthModel(abc.ABC):
    @abc.abstractmethod
    def length(self, group_key: int, member_key: int) -> int:
        """The uncapped length (>= 1) of the turn with these keys."""


class Lognormal(LengthModel):
    def __init__(self, median: float, p99: float, group_correlation: float) -> None:
        self.mu = math.log(median)
        self.sigma = math.log(p99 / median) / Z_P99
        self.rho = group_correlation
        self.rho_member = math.sqrt(1.0 - group_correlation ** 2)

    def length(self, group_key: int, member_key: int) -> int:
        z = self.rho * unit_normal(group_key) + self.rho_member * unit_normal(member_key)
        return max(1, round(math.exp(self.mu + self.sigma * z)))


class Trace(LengthModel):
    def __init__(self, groups: list[list[int]]) -> None:
        self.groups = groups

    def length(self, group_key: int, member_key: int) -> int:
        group = self.groups[group_key % len(self.groups)]
        return group[member_key % len(group)]


def load_trace(path: str | os.PathLike) -> list[list[int]]:
    """The groups of a JSONL length trace; ValueError with the line that is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    groups: list[list[int]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        lengths = None
        if isinstance(item, dict) and set(item) == {"lengths"}:
            lengths = item["lengths"]
        elif isinstance(item, dict) and set(item) == {"length"}:
            lengths = [item["length"]]
        if not (isinstance(lengths, list) and lengths
                and all(type(n) is int and n > 0 for n in lengths)):
            shown = line if len(line) <= 60 else line[:57] + "..."
            raise ValueError(f"{path} line {number}: expected {{\"lengths\": [positive integers]}} "
                             f"or {{\"length\": a positive integer}}, got {shown}")
        groups.append(lengths)
    if not groups:
        raise ValueError(f"{path} holds no lengths")
    return groups


# ----------------------------------------------------------------------------- spec tables


class LognormalConfig(KindConfig):
    kind: Literal["lognormal"] = "lognormal"
    # Defaults: a reasoning workload with a long tail to a 16K cap (Laminar §8: max output
    # 16K on DAPO-Math; most responses a few thousand tokens, a few at the cap).
    median: PosFloat = 2048.0  # tokens
    p99: PosFloat = 12288.0  # tokens, >= median
    group_correlation: Unit = 0.5  # rho: 0 = members independent, 1 = a group shares its length

    _above_median = not_beyond("p99", "median", at_least=True)


class TraceConfig(KindConfig):
    kind: Literal["trace"] = "trace"
    path: Path  # JSONL; relative to the spec's folder; absolute once validated

    @field_validator("path", mode="before")
    @classmethod
    def _readable(cls, value: Any, info: ValidationInfo) -> Path:
        if not isinstance(value, (str, os.PathLike)):
            raise fail(f"expected a string, got {value!r}")
        base = (info.context or {}).get("base_dir") or Path.cwd()
        path = (Path(base) / Path(value).expanduser()).resolve()
        try:
            load_trace(path)
        except ValueError as e:
            raise fail(str(e)) from None
        return path


class LognormalKind(Kind):
    Config, Impl = LognormalConfig, Lognormal


class TraceKind(Kind):
    Config = TraceConfig

    @classmethod
    def build(cls, config: TraceConfig, /, **_: Any) -> Trace:
        return Trace(load_trace(config.path))


# A registry of its own (not a fleet-wide seam: only the sim engine has lengths), so the
# table is tagged by ``kind`` and errors read ``rollout.engine.lengths.p99: ...``.
LENGTH_MODELS = Registry("sim length model", "rlfleet.sim_lengths", default="lognormal")
LENGTH_MODELS.register(LognormalKind)
LENGTH_MODELS.register(TraceKind)
