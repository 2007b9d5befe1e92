"""The job spec: one TOML file, parsed into typed, immutable sections.

A bad spec must fail before any daemon starts, with every problem reported at
once and each line naming the file, the dotted key and the offending value::

    examples/bad.toml: trainer.batch_size: must be > 0, got -4
    examples/bad.toml: trainer.batch_sise: unknown key (did you mean 'batch_size'?)
    examples/bad.toml: rollout.engine.kind: unknown kind 'sglang' (registered: 'sim', 'torch', 'vllm')

Each TOML table is validated by its own pydantic model, so an error in one
section does not hide errors in the others; cross-section checks then run on
the sections that did validate. Pydantic's error types are translated into
the short phrases above (``spec_errors``).

Where a capability comes in variants (engine, loss, reward backend, task,
schedulers) its table is tagged: ``kind = "..."`` plus only that kind's keys,
the kinds coming from the registries in ``common/spec/seams.py`` (docs/design/seams.md).
Keys that an earlier spec had and that moved or went away are refused with
where they went (``MOVED``), so an old spec never half-works.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlfleet.common.job_name import JOB_NAME_RULE, is_job_name
from rlfleet.common.spec.errors import SpecError, describe, dotted, suggest
from rlfleet.common.spec.fields import Host, NonNegInt, PosFloat, PosInt, Section, fail, not_beyond, show
from rlfleet.common.spec.file import read_spec_toml
from rlfleet.common.spec.filters import FilterSchedule, check_extra, check_schedule, filter_errors
from rlfleet.common.spec.placement import ROLES, PlacementSection
from rlfleet.common.spec.registry import Kind, KindConfig, KindSlot
from rlfleet.common.spec.seams import (
    ENV_ROUTERS,
    POLICY_LOSSES,
    REPACK_PLANNERS,
    REWARD_BACKENDS,
    REWARD_DISPATCH,
    ROLLOUT_ENGINES,
    TASKS,
    TRAINER_BACKENDS,
)
from rlfleet.common.weights_size import published_bytes

__all__ = ["MOVED", "JobSpec", "load_spec", "parse_spec"]

# Keys of earlier specs -> where they went. Refused with this text rather than as an
# "unknown key", so whoever upgrades a spec is told what to write instead.
MOVED: dict[tuple[str, str], str] = {
    ("etcd", "endpoints"): "removed: daemons and tools take the etcd endpoints from --etcd "
                           "(`rlfleet run` starts its own etcd), so a stored spec cannot name "
                           "another cluster than the one the job runs on",
    ("rollout", "max_batch"): "moved to [rollout.engine] max_batch",
    ("rollout", "max_new_tokens"): "removed: each task sets its own per-turn token budget "
                                   "(arithmetic: digits + 2, frozenlake: 1)",
    ("trainer", "clip_eps"): "moved to [trainer.loss] clip_eps (kind = 'ppo_clip')",
    ("task", "name"): "replaced by [task.env] kind (e.g. kind = 'arithmetic')",
    ("task", "difficulty"): "replaced by [task.env]: the task's own keys next to its kind "
                            "(e.g. digits = 2)",
    ("reward_host", "workers"): "moved to [reward_host.backend] workers",
    ("reward_host", "timeout_s"): "moved to [reward_host.backend] timeout_s",
}

# The required table an old key is now written as.
_REQUIRED_BY_MOVED = {("task", "name"): ("task", "env"), ("task", "difficulty"): ("task", "env")}

# A seam's table, typed from its registry (the kinds are found through entry points).
EngineConfig = ROLLOUT_ENGINES.config_type()
LossConfig = POLICY_LOSSES.config_type()
TrainerBackendConfig = TRAINER_BACKENDS.config_type()
RewardBackendConfig = REWARD_BACKENDS.config_type()
RewardDispatchConfig = REWARD_DISPATCH.config_type()
TaskEnvConfig = TASKS.config_type()
RoutingConfig = ENV_ROUTERS.config_type()
PlannerConfig = REPACK_PLANNERS.config_type()


# A lease outlives its daemon by up to one TTL: that long a dead trainer keeps its
# leadership, a dead env-host its prompt claims, a dead rollout its place in every
# router. 60 s bounds that stall; beyond it a crash looks like a hung job (Patroni's
# default TTL is 30 s). At least 1 s: refreshes come every ttl/3.
MAX_LEASE_TTL_S = 60.0


def _check_job_name(name: str) -> str:
    if not is_job_name(name):
        raise fail(f"{JOB_NAME_RULE}, got {show(name)}")
    return name


def _check_group_size(n: int) -> int:
    if n < 2:
        raise fail("must be >= 2: a GRPO advantage is a reward minus its group's mean, so in "
                   f"a group of one every advantage is 0 and nothing is learned, got {n}")
    return n


# ------------------------------------------------------------------- sections
class JobSection(Section):
    name: Annotated[StrictStr, AfterValidator(_check_job_name)]
    runs_dir: StrictStr = "runs"  # left as written; the runner decides what it is relative to
    seed: NonNegInt = 0


class EtcdSection(Section):
    # Endpoints are not here: every daemon and tool gets them from --etcd (MOVED).
    lease_ttl_s: Annotated[float, Field(strict=True, ge=1, le=MAX_LEASE_TTL_S,
                                        allow_inf_nan=False)] = 3.0
    retry_timeout_s: PosFloat = 1.0

    @property
    def refresh_interval_s(self) -> float:
        """How often a daemon refreshes its lease (Patroni: loop_wait ~ ttl/3)."""
        return self.lease_ttl_s / 3

    @field_validator("retry_timeout_s")
    @classmethod
    def _fits_in_ttl(cls, retry: float, info: ValidationInfo) -> float:
        # A refresh that is late by one full retry must still land before the
        # lease expires, or a healthy daemon loses its keys (and leadership).
        ttl = info.data.get("lease_ttl_s")
        if ttl is not None and ttl / 3 + retry >= ttl:
            raise fail(
                f"refresh interval (lease_ttl_s/3 = {ttl / 3:g}) + retry_timeout_s ({retry:g}) "
                f"must be < lease_ttl_s ({ttl:g})"
            )
        return retry


class ModelSection(Section):
    path: Path  # absolute once validated
    dtype: Literal["float32", "bfloat16"] = "float32"

    @field_validator("path", mode="before")
    @classmethod
    def _resolve(cls, value: Any, info: ValidationInfo) -> Path:
        if not isinstance(value, (str, os.PathLike)):
            raise fail(f"expected a string, got {show(value)}")
        base = (info.context or {}).get("base_dir") or Path.cwd()
        written = Path(base) / Path(value).expanduser()
        try:
            path = written.resolve()
        except (OSError, RuntimeError) as e:  # a symlink loop: RuntimeError up to Python 3.12, then ELOOP
            raise fail(f"cannot resolve {written}: {getattr(e, 'strerror', None) or e}") from None
        if path.is_file():
            raise fail(f"is a file, not a directory: {path} (model.path names the HF model folder)")
        if not path.is_dir():
            raise fail(f"directory does not exist: {path}")
        if not (path / "config.json").is_file():
            raise fail(f"not a model directory (no config.json): {path}")
        # Every role that holds weights (trainer, rollout) loads safetensors; a folder
        # with only a tokenizer would validate and then crash-loop those daemons.
        if not any(path.glob("*.safetensors")):
            raise fail(f"no weights in {path}: it has no *.safetensors file "
                       "(an HF model folder holds config.json, model*.safetensors and the tokenizer)")
        return path

    def config(self) -> dict[str, Any]:
        """The model's config.json ({} when it cannot be read as a JSON object)."""
        try:
            data = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


class TaskSection(Section):
    env: TaskEnvConfig  # which task, with its own typed knobs (daemons/tasks)
    group_size: Annotated[StrictInt, AfterValidator(_check_group_size)] = 8  # GRPO samples per prompt
    max_turns: PosInt = 1
    eval_size: PosInt = 64
    eval_every_steps: PosInt = 5
    # The held-out set is drawn with its own seed, not job.seed: runs that differ only
    # in their training seed are scored on the same problems, so their figures compare.
    eval_seed: StrictInt = 0


class TrainerSection(Section):
    batch_size: PosInt = 32  # trajectories per step
    learning_rate: PosFloat = 1e-4
    # "linear": learning_rate after warmup_steps, falling linearly to 0 at max_steps, so
    # late updates stop undoing what was learned (a small model oscillates at a fixed rate).
    lr_schedule: Literal["constant", "linear"] = "constant"
    warmup_steps: NonNegInt = 0  # learning rate ramps up linearly over these first steps
    max_steps: PosInt = 100
    checkpoint_every: PosInt = 10
    max_staleness: NonNegInt | None = None  # the bound α in versions; None = unbounded
    buffer_order: Literal["fifo", "newest", "staleness"] = "fifo"  # trainer/buffer.py, docs/design/dataflow.md
    # Dynamic filtering: drop groups whose rewards are all equal ("no_signal", accounted), at
    # most this many times a batch's groups per step; 0: off (docs/design/dataflow.md).
    no_signal_drops_per_batch: Annotated[float, Field(strict=False, ge=0, le=64, allow_inf_nan=False)] = 0.0
    # When filtering happens, and how far queue claims reach (common/spec/filters.py).
    filter_schedule: Annotated[FilterSchedule, AfterValidator(check_schedule)] = "queue"
    max_extra_prompts: Annotated[NonNegInt | None, AfterValidator(check_extra)] = None
    loss: LossConfig = POLICY_LOSSES.field()
    # What makes the versions: "torch" trains the policy; "sim" sleeps a timing model
    # and publishes stand-in weights (daemons/trainer/backends.py).
    backend: TrainerBackendConfig = TRAINER_BACKENDS.field()
    bind_host: Host = "127.0.0.1"
    # A group with a reward beyond ±this is dropped ("non_finite", daemons/trainer/guard.py):
    # wide, but its squares stay finite in float32 (the advantages' std).
    max_abs_reward: Annotated[float, Field(strict=False, gt=0, le=1e18, allow_inf_nan=False)] = 1e6
    # After this many consecutive steps skipped for non-finite numbers, restore the last checkpoint.
    max_skipped_steps: PosInt = 3


# How rollouts and the trainer coordinate weight versions (ARCHITECTURE §4, docs/design/modes.md):
# sync: on-policy, a global barrier per batch; one_step_off: batch n+1 is generated with
# version n while n trains; partial: every publish interrupts running requests, which go
# on with the new weights (versions mix within a turn); trajectory: each rollout pulls the
# newest version whenever it has nothing running (repack via [repack_manager.planner]).
RolloutMode = Literal["sync", "one_step_off", "partial", "trajectory"]


class RolloutSection(Section):
    engine: EngineConfig = ROLLOUT_ENGINES.field()
    mode: RolloutMode = "trajectory"
    # Sampling: the env-host puts these in every request, whatever the engine.
    temperature: PosFloat = 1.0
    top_p: Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)] = 1.0
    bind_host: Host = "127.0.0.1"


class RelaySection(Section):
    transport: Literal["tcp", "ucx"] = "tcp"
    chunk_mib: PosInt = 32
    keep_versions: Annotated[StrictInt, Field(ge=1)] = 2
    window_chunks: PosInt = 4  # chunks in flight per hop
    bind_host: Host = "127.0.0.1"
    # The largest object a peer may offer a relay; unset: twice a version's size plus 64 MiB
    # (relay.admission.ceiling_bytes). A header is never trusted with more than this.
    max_object_mib: PosInt | None = None


class EnvHostSection(Section):
    max_concurrent: PosInt = 64
    turn_timeout_s: PosFloat = 30.0
    trajectory_timeout_s: PosFloat = 300.0
    max_retries: NonNegInt = 3
    # Claim no more prompts than trainer.max_staleness batches ahead of what the trainer
    # has consumed (docs/design/dataflow.md); false: claim as fast as max_concurrent allows.
    pace_claims: bool = True
    # Pacing also counts the weights the rollouts generate with: while they trail the trainer
    # by L versions, L batches fewer may be outstanding (at least one). On: in the drops
    # benchmark's side-by-side runs only this arm met the target (docs/results/drops.md), for
    # fewer steps in the same time; false gives the deeper pipeline back.
    pace_for_lag: bool = True
    # With pace_for_lag: the versions of lag it lets pass before it takes batches off (1: the
    # steady lag of a relay that keeps up is let pass, a spike behind it is paced for).
    pace_lag_allowance: NonNegInt = 0
    routing: RoutingConfig = ENV_ROUTERS.field()  # which rollout gets a turn
    bind_host: Host = "127.0.0.1"
    # Agentic scheduling (docs/guide/agentic.md). "async": each trajectory steps its environment on
    # its own; "batch": the prompts claimed together step together, a barrier per turn.
    env_mode: Literal["async", "batch"] = "async"
    # Redundant rollouts: this many extra trajectories per prompt (the first group_size that
    # finish well make the group), and extra prompts per batch-mode round (the first
    # batch's worth of complete groups close it). The rest end as "redundant".
    redundant_samples: NonNegInt = 0
    redundant_prompts: NonNegInt = 0

    @field_validator("redundant_prompts")
    @classmethod
    def _rounds_are_batch_mode(cls, extra: int, info: ValidationInfo) -> int:
        if extra and info.data.get("env_mode") != "batch":
            raise fail(f"needs env_mode = \"batch\" (a round is the prompts claimed together), "
                       f"got env_mode = {show(info.data.get('env_mode'))}")
        return extra

    @field_validator("pace_lag_allowance")
    @classmethod
    def _allowance_paces_for_lag(cls, allowance: int, info: ValidationInfo) -> int:
        if allowance and not info.data.get("pace_for_lag"):
            raise fail("needs pace_for_lag = true (it is the lag that pacing lets pass), "
                       f"got pace_for_lag = {show(info.data.get('pace_for_lag'))}")
        return allowance

    _covers_a_turn = not_beyond("trajectory_timeout_s", "turn_timeout_s", at_least=True)


class RewardHostSection(Section):
    backend: RewardBackendConfig = REWARD_BACKENDS.field()  # what scores a trajectory
    dispatch: RewardDispatchConfig = REWARD_DISPATCH.field()  # in which order waiting ones go
    bind_host: Host = "127.0.0.1"


class RepackManagerSection(Section):
    planner: PlannerConfig = REPACK_PLANNERS.field()


def _absolute(path: str | None) -> str | None:
    # Read by daemons on other machines, from other working directories.
    if path is not None and not os.path.isabs(path):
        raise fail(f"must be an absolute path (each daemon reads it on its own machine), got {show(path)}")
    return path


class SecuritySection(Section):
    """What the job requires of every daemon (docs/operations/security.md). etcd's credentials are
    not here: a daemon needs them to read the spec (--etcd-cacert etc., $RLFLEET_ETCD_*)."""

    curve: StrictBool = False  # CURVE on every ZeroMQ socket; a daemon without keys refuses to start
    # The keys' directory on each machine where $RLFLEET_CURVE_DIR is not set.
    curve_dir: Annotated[StrictStr | None, AfterValidator(_absolute)] = None
    relay_auth: StrictBool = False  # the relay's chunk transport authenticated with the job secret
    # The job secret on each machine where $RLFLEET_JOB_SECRET_FILE is not set.
    job_secret_file: Annotated[StrictStr | None, AfterValidator(_absolute)] = None

    @model_validator(mode="after")
    def _used(self) -> SecuritySection:
        if self.curve_dir is not None and not self.curve:
            raise fail("curve_dir is set but curve = false: set curve = true, or remove curve_dir")
        if self.job_secret_file is not None and not self.relay_auth:
            raise fail("job_secret_file is set but relay_auth = false: set relay_auth = true, "
                       "or remove job_secret_file")
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
    errors += _env_host_errors(sections)
    errors += filter_errors(sections)
    relay = sections.get("relay")
    if isinstance(relay, RelaySection) and relay.max_object_mib is not None and "model" in sections:
        need = published_bytes(SimpleNamespace(**sections)) if "trainer" in sections else None
        if need is not None and relay.max_object_mib << 20 < need:
            errors.append((("relay", "max_object_mib"),
                           f"must be >= {-(-need >> 20)} (MiB of weights published per version; the relays "
                           f"would refuse every version), got {relay.max_object_mib}"))
    # Each kind checks itself against the rest (e.g. an engine's KV cache vs the model).
    for loc, kind, config in _kinds(sections):
        errors += [((*loc, *where), msg) for where, msg in kind.check(config, sections)]
    return errors


def _kinds(sections: dict[str, BaseModel]) -> list[tuple[tuple[str, str], type[Kind], KindConfig]]:
    """(section, field), Kind and config of every seam's table among ``sections``."""
    found = []
    for name, section in sections.items():
        for field_name, field in type(section).model_fields.items():
            slot = next((m for m in field.metadata if isinstance(m, KindSlot)), None)
            if slot is not None:
                config = getattr(section, field_name)
                found.append(((name, field_name), slot.registry.get(config.kind), config))
    return found


def _env_host_errors(sections: dict[str, BaseModel]) -> list[tuple[tuple, str]]:
    """The env-host's agentic options against the task, batch and coordination mode."""
    env, task, trainer = sections.get("env_host"), sections.get("task"), sections.get("trainer")
    rollout = sections.get("rollout")
    if not (isinstance(env, EnvHostSection) and isinstance(task, TaskSection)):
        return []
    errors: list[tuple[tuple, str]] = []
    launch = task.group_size + env.redundant_samples
    if env.max_concurrent < launch:
        errors.append((("env_host", "max_concurrent"), f"must be >= task.group_size + "
                       f"env_host.redundant_samples ({launch}: one prompt's trajectories), "
                       f"got {env.max_concurrent}"))
    if env.redundant_prompts and isinstance(rollout, RolloutSection) and rollout.mode in ("sync", "one_step_off"):
        # Those modes tie a prompt id to its batch's weight version; rounds of extra
        # prompts would shift every batch (use trajectory or partial).
        errors.append((("env_host", "redundant_prompts"), f"cannot be used with rollout.mode = "
                       f"{show(rollout.mode)} (a batch's prompts are fixed there); use \"trajectory\" "
                       f"or \"partial\""))
    if env.env_mode == "batch" and isinstance(trainer, TrainerSection):
        round_size = (trainer.batch_size // task.group_size + env.redundant_prompts) * launch
        if env.max_concurrent < round_size:
            errors.append((("env_host", "max_concurrent"), f"must hold a batch-mode round: (trainer.batch_size"
                           f" / task.group_size + redundant_prompts) x (group_size + redundant_samples) = "
                           f"{round_size}, got {env.max_concurrent}"))
    return errors


class JobSpec(Section):
    job: JobSection
    etcd: EtcdSection = Field(default_factory=EtcdSection)
    model: ModelSection
    task: TaskSection
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    relay: RelaySection = Field(default_factory=RelaySection)
    env_host: EnvHostSection = Field(default_factory=EnvHostSection)
    reward_host: RewardHostSection = Field(default_factory=RewardHostSection)
    repack_manager: RepackManagerSection = Field(default_factory=RepackManagerSection)
    placement: PlacementSection = Field(default_factory=PlacementSection)
    security: SecuritySection = Field(default_factory=SecuritySection)

    @model_validator(mode="after")
    def _cross_check(self) -> JobSpec:
        # parse_spec reports these with their paths; this guards direct construction.
        errors = _cross_errors(dict(self))
        if errors:
            raise fail("; ".join(f"{dotted(loc)}: {msg}" for loc, msg in errors))
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
def load_spec(path: str | os.PathLike, *, check_imports: bool = False) -> JobSpec:
    """Read and validate a TOML spec; relative model paths are relative to its folder.

    ``check_imports``: also refuse a kind whose library does not import in this Python
    (``Kind.unavailable``), for a command that checks the spec for this machine. Off by
    default: a spec is read on machines that never run some of its kinds."""
    source = os.fspath(path)
    spec = parse_spec(read_spec_toml(path), source=source, base_dir=Path(path).absolute().parent)
    if check_imports:
        errors = [f"{source}: {dotted((*loc, 'kind'))}: {config.kind!r} cannot run in this Python "
                  f"({sys.executable}): {reason}"
                  for loc, kind, config in _kinds(dict(spec)) if (reason := kind.unavailable(config))]
        if errors:
            raise SpecError(errors)
    return spec


def parse_spec(data: dict, source: str = "<spec>", base_dir: Path | None = None) -> JobSpec:
    """Validate an already-parsed spec (e.g. fetched from etcd); raises SpecError."""
    if not isinstance(data, dict):
        raise SpecError([f"{source}: expected a table at top level, got {show(data)}"])
    sections = JobSpec.model_fields
    errors: list[tuple[tuple, str]] = []
    for key in data:
        if key not in sections:
            errors.append(((key,), "unknown section" + suggest(key, sections)))

    context = {"base_dir": base_dir}
    valid: dict[str, BaseModel] = {}
    for name, field in sections.items():
        raw = data.get(name, {})  # absent: defaults, or "required key missing" inside
        if not isinstance(raw, dict):
            errors.append(((name,), f"expected a table, got {show(raw)}"))
            continue
        raw = _without_moved(name, raw, errors)
        model = field.annotation
        try:
            valid[name] = model.model_validate(raw, context=context)
        except ValidationError as e:
            for err in e.errors():
                loc, msg = describe(err, model)
                errors.append(((name, *loc), msg))
    errors.extend(_cross_errors(valid))
    # An old key already said where to write it: "required ... missing" there is noise.
    covered = {table for (name, key), table in _REQUIRED_BY_MOVED.items()
               if isinstance(data.get(name), dict) and key in data[name]}
    errors = [(loc, msg) for loc, msg in errors
              if not (tuple(loc[:2]) in covered and msg.startswith("required"))]

    if errors:
        raise SpecError([f"{source}: {dotted(loc)}: {msg}" for loc, msg in errors])
    return JobSpec.model_validate(valid)


def _without_moved(name: str, raw: dict, errors: list[tuple[tuple, str]]) -> dict:
    """``raw`` less the keys of earlier specs (MOVED), each reported with where it went."""
    out = {}
    for key, value in raw.items():
        if (name, key) in MOVED:
            errors.append(((name, key), MOVED[(name, key)]))
        elif name == "rollout" and key == "engine" and isinstance(value, str):
            kinds = ", ".join(map(repr, ROLLOUT_ENGINES.names()))
            errors.append(((name, key), f"now a table: write [rollout.engine] with kind = one of "
                                        f"{kinds} (got {value!r}); engine keys such as max_batch "
                                        "go there too"))
        else:
            out[key] = value
    return out
