"""Field types and helpers shared by every section of the job spec, including the
sections that plugins declare for their own kinds (``common/spec/registry.py``).

Strict on purpose: TOML `true` is not a number and "3" is not an integer. Floats
accept integers (TOML `lease_ttl_s = 3`) but never NaN/inf.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

__all__ = ["Host", "Int", "NonNegInt", "PosFloat", "PosInt", "Section", "SPEC_ERROR",
           "fail", "not_beyond", "num", "show"]

# Our own error type: its message is already in the final phrasing (spec_errors.describe).
SPEC_ERROR = "rlfleet_spec"

Int = StrictInt
PosInt = Annotated[StrictInt, Field(gt=0)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
PosFloat = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
Host = Annotated[StrictStr, Field(min_length=1)]


class Section(BaseModel):
    """A table of the spec: unknown keys are errors, values immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def fail(message: str) -> PydanticCustomError:
    """An error whose message is reported as written (raise it inside a validator)."""
    return PydanticCustomError(SPEC_ERROR, message)


def num(x: Any) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def not_beyond(key: str, other: str, *, at_least: bool) -> Any:
    """A validator for a Section's ``key``: it must be >= (``at_least``) or <= ``other``,
    a key declared before it (pydantic validates in that order). Assign it in the class
    body under a name of its own: ``_p99_above_median = not_beyond("p99", "median", at_least=True)``."""
    def check(cls: type, value: Any, info: ValidationInfo) -> Any:
        bound = info.data.get(other)
        if bound is not None and (value < bound if at_least else value > bound):
            raise fail(f"must be {'>=' if at_least else '<='} {other} ({num(bound)}), got {num(value)}")
        return value
    return field_validator(key)(classmethod(check))  # type: ignore[arg-type]


def show(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan / inf, as TOML writes them
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
