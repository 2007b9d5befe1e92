"""The job spec: one TOML file, parsed into typed, immutable sections.

A bad spec must fail before any daemon starts, with every problem reported at
once and each line naming the file, the dotted key and the offending value::

    examples/bad.toml: trainer.batch_size: must be > 0, got -4
    examples/bad.toml: trainer.batch_sise: unknown key (did you mean 'batch_size'?)

Each TOML table is validated by its own pydantic model, so an error in one
section does not hide errors in the others; cross-section checks then run on
the sections that did validate. Pydantic's error types are translated into
the short phrases above (``_describe``).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "ROLES",
    "SINGLETON_ROLES",
    "JobSpec",
    "SpecError",
    "load_spec",
    "parse_spec",
]

Role = Literal[
    "resource-manager", "trainer", "relay", "rollout", "env-host", "reward-host", "repack-manager"
]
ROLES: tuple[str, ...] = typing.get_args(Role)
# Leader-elected: one instance works, extra instances wait as standbys.
SINGLETON_ROLES: tuple[str, ...] = ("resource-manager", "repack-manager", "trainer")

DEFAULT_PLACEMENT: dict[str, int] = {
    "resource-manager": 2,  # a standby, so the single-machine run exercises failover
    "repack-manager": 1,
    "trainer": 1,
    "relay": 1,
    "rollout": 1,
    "env-host": 1,
    "reward-host": 1,
}

# Our own error type: its message is already in the final phrasing.
_SPEC_ERROR = "rlfleet_spec"


def _fail(message: str) -> PydanticCustomError:
    return PydanticCustomError(_SPEC_ERROR, message)


class SpecError(Exception):
    """Every problem found in one spec; ``errors`` holds one full line each."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


# ---------------------------------------------------------------- field types
# Strict: TOML `true` is not a number and "3" is not an integer. Floats accept
# integers (TOML `lease_ttl_s = 3`) but never NaN/inf.
Int = StrictInt
PosInt = Annotated[StrictInt, Field(gt=0)]
NonNegInt = Annotated[StrictInt, Field(ge=0)]
PosFloat = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]


def _knob(value: Any) -> Any:
    # One clear message instead of one per member of a union type.
    ok = (isinstance(value, (int, float, str)) and not isinstance(value, bool)
          and not (isinstance(value, float) and not math.isfinite(value)))
    if not ok:
        raise PydanticCustomError("knob_type", "expected an integer, a number or a string")
    return value


Knob = Annotated[Any, BeforeValidator(_knob)]
Host = Annotated[StrictStr, Field(min_length=1)]

_JOB_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# host:port, host a DNS name / IPv4 or a bracketed IPv6 literal; no scheme.
_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def _check_job_name(name: str) -> str:
    if not _JOB_NAME.match(name):
        raise _fail(
            "must be 1-63 lowercase letters, digits or '-', starting with a letter or digit "
            f"(it is an etcd key component), got {_show(name)}"
        )
    return name


def _check_endpoint(endpoint: str) -> str:
    m = _ENDPOINT.match(endpoint)
    if not m or not 1 <= int(m.group(2)) <= 65535:
        raise _fail(f"must be 'host:port' with port 1..65535, got {_show(endpoint)}")
    return endpoint


def _check_host_name(name: str) -> str:
    # Host names become etcd key components (/rlfleet/<job>/nodes/<host>).
    if "/" in name or any(c.isspace() for c in name):
        raise _fail(f"must not contain '/' or whitespace, got {_show(name)}")
    return name


# ------------------------------------------------------------------- sections
class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobSection(_Section):
    name: Annotated[StrictStr, AfterValidator(_check_job_name)]
    runs_dir: StrictStr = "runs"  # left as written; the runner decides what it is relative to
    seed: NonNegInt = 0


class EtcdSection(_Section):
    endpoints: tuple[Annotated[StrictStr, AfterValidator(_check_endpoint)], ...] = (
        "127.0.0.1:2379",
    )
    lease_ttl_s: Annotated[float, Field(strict=True, ge=1, allow_inf_nan=False)] = 3.0
    retry_timeout_s: PosFloat = 1.0

    @property
    def refresh_interval_s(self) -> float:
        """How often a daemon refreshes its lease (Patroni: loop_wait ~ ttl/3)."""
        return self.lease_ttl_s / 3

    @field_validator("endpoints")
    @classmethod
    def _not_empty(cls, endpoints: tuple[str, ...]) -> tuple[str, ...]:
        # Not min_length: that also fires when an endpoint is bad, as a second error.
        if not endpoints:
            raise _fail("must not be empty, got []")
        return endpoints

    @field_validator("retry_timeout_s")
    @classmethod
    def _fits_in_ttl(cls, retry: float, info: ValidationInfo) -> float:
        # A refresh that is late by one full retry must still land before the
        # lease expires, or a healthy daemon loses its keys (and leadership).
        ttl = info.data.get("lease_ttl_s")
        if ttl is not None and ttl / 3 + retry >= ttl:
            raise _fail(
                f"refresh interval (lease_ttl_s/3 = {ttl / 3:g}) + retry_timeout_s ({retry:g}) "
                f"must be < lease_ttl_s ({ttl:g})"
            )
        return retry


class ModelSection(_Section):
    path: Path  # absolute once validated
    dtype: Literal["float32", "bfloat16"] = "float32"

    @field_validator("path", mode="before")
    @classmethod
    def _resolve(cls, value: Any, info: ValidationInfo) -> Path:
        if not isinstance(value, (str, os.PathLike)):
            raise _fail(f"expected a string, got {_show(value)}")
        base = (info.context or {}).get("base_dir") or Path.cwd()
        path = (Path(base) / Path(value).expanduser()).resolve()
        if not path.is_dir():
            raise _fail(f"directory does not exist: {path}")
        if not (path / "config.json").is_file():
            raise _fail(f"not a model directory (no config.json): {path}")
        return path


class TaskSection(_Section):
    name: Literal["arithmetic", "frozenlake"]
    group_size: PosInt = 8  # GRPO samples per prompt
    max_turns: PosInt = 1
    eval_size: PosInt = 64
    eval_every_steps: PosInt = 5
    # per-task knobs, read by the env (digits = 2, p = 0.75, ops = "+-")
    difficulty: dict[str, Knob] = Field(default_factory=dict)


class TrainerSection(_Section):
    batch_size: PosInt = 32  # trajectories per step
    learning_rate: PosFloat = 1e-4
    # "linear": learning_rate after warmup_steps, falling linearly to 0 at max_steps, so
    # late updates stop undoing what was learned (a small model oscillates at a fixed rate).
    lr_schedule: Literal["constant", "linear"] = "constant"
    warmup_steps: NonNegInt = 0  # learning rate ramps up linearly over these first steps
    max_steps: PosInt = 100
    checkpoint_every: PosInt = 10
    max_staleness: NonNegInt | None = None  # the bound α in versions; None = unbounded
    clip_eps: PosFloat = 0.2
    bind_host: Host = "127.0.0.1"


class RolloutSection(_Section):
    engine: Literal["torch", "vllm", "sim"] = "torch"
    max_batch: PosInt = 32
    temperature: PosFloat = 1.0
    top_p: Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)] = 1.0
    max_new_tokens: PosInt = 16
    bind_host: Host = "127.0.0.1"


class RelaySection(_Section):
    transport: Literal["tcp", "ucx"] = "tcp"
    chunk_mib: PosInt = 32
    keep_versions: Annotated[StrictInt, Field(ge=1)] = 2
    window_chunks: PosInt = 4  # chunks in flight per hop
    bind_host: Host = "127.0.0.1"


class EnvHostSection(_Section):
    max_concurrent: PosInt = 64
    turn_timeout_s: PosFloat = 30.0
    trajectory_timeout_s: PosFloat = 300.0
    max_retries: NonNegInt = 3
    # Claim no more prompts than trainer.max_staleness batches ahead of what the trainer
    # has consumed (docs/dataflow.md); false: claim as fast as max_concurrent allows.
    pace_claims: bool = True
    bind_host: Host = "127.0.0.1"

    @field_validator("trajectory_timeout_s")
    @classmethod
    def _covers_a_turn(cls, total: float, info: ValidationInfo) -> float:
        turn = info.data.get("turn_timeout_s")
        if turn is not None and total < turn:
            raise _fail(f"must be >= turn_timeout_s ({turn:g}), got {total:g}")
        return total


class RewardHostSection(_Section):
    workers: PosInt = 2
    timeout_s: PosFloat = 10.0
    bind_host: Host = "127.0.0.1"


class HostPlacement(_Section):
    name: Annotated[StrictStr, Field(min_length=1), AfterValidator(_check_host_name)]
    roles: dict[Role, NonNegInt]


def _default_hosts() -> tuple[HostPlacement, ...]:
    return (HostPlacement(name="localhost", roles=DEFAULT_PLACEMENT),)


class PlacementSection(_Section):
    hosts: tuple[HostPlacement, ...] = Field(default_factory=_default_hosts)

    @model_validator(mode="after")
    def _complete(self) -> PlacementSection:
        names = [h.name for h in self.hosts]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise _fail(f"duplicate host name(s): {', '.join(map(repr, dups))}")
        totals = {role: sum(h.roles.get(role, 0) for h in self.hosts) for role in ROLES}
        missing = [role for role, n in totals.items() if n < 1]
        if missing:
            raise _fail(
                "every role needs at least one instance; none placed for "
                + ", ".join(map(repr, missing))
            )
        return self


# -------------------------------------------------------------------- the spec
def _cross_errors(sections: dict[str, BaseModel]) -> list[tuple[tuple, str]]:
    """Checks that span sections; skips those whose sections failed on their own."""
    errors: list[tuple[tuple, str]] = []
    trainer, task = sections.get("trainer"), sections.get("task")
    if isinstance(trainer, TrainerSection) and isinstance(task, TaskSection):
        if trainer.batch_size % task.group_size:
            # GRPO advantages are computed per group: a batch must hold whole groups.
            errors.append((
                ("trainer", "batch_size"),
                f"must be a multiple of task.group_size ({task.group_size}), "
                f"got {trainer.batch_size}",
            ))
    return errors


class JobSpec(_Section):
    job: JobSection
    etcd: EtcdSection = Field(default_factory=EtcdSection)
    model: ModelSection
    task: TaskSection
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    relay: RelaySection = Field(default_factory=RelaySection)
    env_host: EnvHostSection = Field(default_factory=EnvHostSection)
    reward_host: RewardHostSection = Field(default_factory=RewardHostSection)
    placement: PlacementSection = Field(default_factory=PlacementSection)

    @model_validator(mode="after")
    def _cross_check(self) -> JobSpec:
        # parse_spec reports these with their paths; this guards direct construction.
        errors = _cross_errors(dict(self))
        if errors:
            raise _fail("; ".join(f"{_dotted(loc)}: {msg}" for loc, msg in errors))
        return self

    def to_dict(self) -> dict:
        """JSON-able (model.path as an absolute string); parse_spec() inverts it."""
        return self.model_dump(mode="json")

    def roles_on(self, host: str) -> dict[str, int]:
        """Role -> count placed on ``host`` (roles with count 0 left out; {} if unknown)."""
        for h in self.placement.hosts:
            if h.name == host:
                return {role: h.roles[role] for role in ROLES if h.roles.get(role, 0) > 0}
        return {}

    def all_roles(self) -> dict[str, int]:
        """Role -> total count over all hosts, for every role in ROLES."""
        return {
            role: sum(h.roles.get(role, 0) for h in self.placement.hosts) for role in ROLES
        }


# ------------------------------------------------------------------- loading
def load_spec(path: str | os.PathLike) -> JobSpec:
    """Read and validate a TOML spec; relative model paths are relative to its folder."""
    source = os.fspath(path)
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise SpecError([f"{source}: cannot read: {e.strerror or e}"]) from None
    except UnicodeDecodeError as e:
        raise SpecError([f"{source}: invalid TOML: not UTF-8 ({e.reason})"]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError([f"{source}: {_toml_error(str(e))}"]) from None
    return parse_spec(data, source=source, base_dir=Path(path).absolute().parent)


def parse_spec(data: dict, source: str = "<spec>", base_dir: Path | None = None) -> JobSpec:
    """Validate an already-parsed spec (e.g. fetched from etcd); raises SpecError."""
    if not isinstance(data, dict):
        raise SpecError([f"{source}: expected a table at top level, got {_show(data)}"])
    sections = JobSpec.model_fields
    errors: list[tuple[tuple, str]] = []
    for key in data:
        if key not in sections:
            errors.append(((key,), "unknown section" + _suggest(key, sections)))

    context = {"base_dir": base_dir}
    valid: dict[str, BaseModel] = {}
    for name, field in sections.items():
        raw = data.get(name, {})  # absent: defaults, or "required key missing" inside
        if not isinstance(raw, dict):
            errors.append(((name,), f"expected a table, got {_show(raw)}"))
            continue
        try:
            valid[name] = field.annotation.model_validate(raw, context=context)
        except ValidationError as e:
            errors.extend(((name, *err["loc"]), _describe(err, field.annotation)) for err in e.errors())
    errors.extend(_cross_errors(valid))

    if errors:
        raise SpecError([f"{source}: {_dotted(loc)}: {msg}" for loc, msg in errors])
    return JobSpec.model_validate(valid)


# --------------------------------------------------------- error translation
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


def _describe(err: dict, model: type[BaseModel]) -> str:
    """One pydantic error as a short phrase (without the key path)."""
    kind, loc, ctx = err["type"], err["loc"], err.get("ctx") or {}
    value = err.get("input")
    if kind == _SPEC_ERROR:
        return err["msg"]
    if kind == "missing":
        return "required key missing"
    if kind == "extra_forbidden":
        return "unknown key" + _suggest(str(loc[-1]), _known_keys(model, loc[:-1]))
    if kind in _TYPE_NAMES:
        return f"expected {_TYPE_NAMES[kind]}, got {_show(value)}"
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        return f"must be {op} {_num(ctx[key])}, got {_show(value)}"
    if kind == "finite_number":
        return f"must be a finite number, got {_show(value)}"
    if kind == "literal_error":
        choices = _literal_choices(ctx.get("expected", ""))
        if loc and loc[-1] == "[key]":  # a dict key outside its Literal, e.g. a role name
            noun = "role" if len(loc) >= 3 and loc[-3] == "roles" else "key"
            return f"unknown {noun}" + _suggest(str(value), choices, or_list=True)
        return f"must be one of {', '.join(map(repr, choices))}, got {_show(value)}"
    if kind in ("too_short", "string_too_short"):
        if ctx.get("min_length") == 1:
            return f"must not be empty, got {_show(value)}"
        return f"must have at least {ctx.get('min_length')} items, got {_show(value)}"
    return f"{err['msg']}, got {_show(value)}"


def _dotted(loc: tuple) -> str:
    """('placement', 'hosts', 0, 'name') -> 'placement.hosts[0].name'."""
    out = ""
    for part in loc:
        if part == "[key]":  # pydantic's marker for "the key itself", already in the path
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _suggest(word: str, known, or_list: bool = False) -> str:
    known = list(known)
    close = difflib.get_close_matches(word, known, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if or_list and known:
        return f" (expected one of {', '.join(map(repr, known))})"
    return ""


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the model reached by following ``loc`` from ``model``."""
    for part in loc:
        if isinstance(part, int):
            continue  # a list index: same element model
        field = model.model_fields.get(part)
        inner = _inner_model(field.annotation) if field else None
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


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


def _toml_error(message: str) -> str:
    # tomllib (3.11) only puts the position in the message: "... (at line 3, column 12)".
    m = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
    if m:
        return f"line {m.group(1)}: invalid TOML: {message[: m.start()]} (column {m.group(2)})"
    return f"invalid TOML: {message}"


def _num(x: Any) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def _show(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan / inf, as TOML writes them
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
