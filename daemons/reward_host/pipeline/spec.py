"""The ``pipeline`` reward backend's spec: a reward as stages in order (docs/design/reward.md).

    [reward_host.backend]
    kind = "pipeline"
    queue = "ebf"                # per-stage queue order: "ebf" (Earliest-Batch-First) | "fcfs"
    scaling = "timeout_aware"    # "none" (max_workers always) | "history" | "timeout_aware"
    max_extra_delay_s = 1.0      # D: the extra batch delay the plan may add (DistRS Eq. 5)
    batch_idle_s = 5.0           # a batch with nothing in the pipeline for this long is done
    scale_down_after_s = 0.0     # > 0: give workers back only after plans asked for fewer this long

    [[reward_host.backend.stages]]
    name = "check"
    cost = 1.0                   # per worker-second (C_j), any unit shared by the stages
    timeout_s = 5.0              # T_j: the trajectory fails here after it
    min_workers = 1
    max_workers = 2
    worker = { kind = "rule_pool" }   # any reward backend kind, or "sim"

    [[reward_host.backend.stages]]
    name = "judge"
    cost = 8.0
    timeout_s = 3.0
    min_workers = 1
    max_workers = 16
    worker = { kind = "sim", median_s = 0.2, sigma = 1.2 }

A stage's ``worker`` is the table of any registered reward-backend kind (``rule_pool``,
``user_code``, ``remote_http``, ...) but ``pipeline``, or ``sim``: a
simulated accelerator worker whose latency is lognormal (``median_s``, ``sigma``; σ = 1.2
puts p99 at ~16x the median), multiplied by ``time_scale``, failing a ``fail_rate``
fraction. ``timeout_s`` and the worker count belong to the stage, so a worker table may
not set ``timeout_s``, ``workers`` or ``concurrency``: the stage passes its own down.

The reward is the last stage's, except that a ``sim`` stage models time only and keeps
the reward the stage before it gave (a "judge" that agrees). A stage's error or timeout
ends the trajectory with ``error = "stage 'judge': ..."`` and reward 0; the service
forwards it as ``reward_error``, so nothing is lost.

Light on purpose: the spec imports this module to validate (pydantic only); ``build``
imports the backend (pipeline_backend.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictStr, ValidationError, field_serializer, field_validator, model_validator

from rlfleet.common.spec.errors import describe, dotted
from rlfleet.common.spec.fields import NonNegInt, PosFloat, PosInt, Section, fail, show
from rlfleet.common.spec.registry import Kind, KindConfig, UnknownKind

NonNegFloat = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(strict=True, ge=0, lt=1, allow_inf_nan=False)]

# What a stage owns and passes down to its worker kind (pipeline_backend.build_stage).
STAGE_OWNED = ("timeout_s", "workers", "concurrency")


class SimWorkerConfig(KindConfig):
    """A simulated accelerator worker: one request at a time per worker slot."""

    kind: Literal["sim"] = "sim"
    median_s: PosFloat = 0.5
    sigma: NonNegFloat = 1.0  # lognormal shape: the long tail
    time_scale: PosFloat = 1.0  # every latency multiplied by it (a benchmark runs faster than life)
    fail_rate: Fraction = 0.0  # this fraction ends with an error (a judge that cannot answer)
    seed: int = 0


def _worker_config(value: Any) -> KindConfig:
    """The worker table as its kind's Config: ``sim``, or a registered reward backend."""
    if isinstance(value, KindConfig):
        return value
    if not isinstance(value, dict):
        raise fail(f"expected a table with a kind, got {show(value)}")
    from rlfleet.common.spec.seams import REWARD_BACKENDS  # the registry loads this module: not at import

    kind = value.get("kind")
    if kind == "pipeline":
        raise fail("kind 'pipeline' cannot serve a stage (a stage is one worker kind)")
    if kind == "sim":
        config_type: type[KindConfig] = SimWorkerConfig
    else:
        names = [n for n in REWARD_BACKENDS.names() if n != "pipeline"] + ["sim"]
        if not isinstance(kind, str):
            raise fail(f"kind: required key missing (one of {', '.join(map(repr, names))})")
        try:
            config_type = REWARD_BACKENDS.get(kind).Config
        except UnknownKind:
            raise fail(f"kind: unknown kind {kind!r} (registered: {', '.join(map(repr, names))})") from None
    owned = [k for k in STAGE_OWNED if k in value]
    if owned:
        raise fail(f"{owned[0]}: set on the stage (timeout_s, min_workers, max_workers), "
                   "which passes it down to its worker")
    try:
        return config_type.model_validate(value)
    except ValidationError as exc:
        phrases = []
        for err in exc.errors():
            loc, phrase = describe(err, config_type)
            phrases.append(f"{dotted(loc)}: {phrase}" if loc else phrase)
        raise fail("; ".join(phrases)) from None


class StageConfig(Section):
    name: StrictStr
    worker: KindConfig
    cost: PosFloat = 1.0
    timeout_s: PosFloat = 10.0
    min_workers: NonNegInt = 1
    max_workers: PosInt = 4

    @field_validator("name")
    @classmethod
    def _a_name(cls, v: str) -> str:
        if not v or not v.replace("-", "_").isidentifier():
            raise fail(f"must be a name of letters, digits, '_' or '-', got {show(v)}")
        return v

    @field_validator("worker", mode="before")
    @classmethod
    def _worker(cls, v: Any) -> KindConfig:
        return _worker_config(v)

    @field_serializer("worker")
    def _worker_keys(self, worker: KindConfig) -> dict[str, Any]:
        # The kind's own keys (all of them, not KindConfig's), less those the stage owns:
        # the spec travels through etcd as JSON and must validate again as it was written.
        return {k: v for k, v in worker.model_dump(mode="json").items() if k not in STAGE_OWNED}

    @model_validator(mode="after")
    def _bounds(self) -> StageConfig:
        if self.min_workers > self.max_workers:
            raise fail(f"min_workers ({self.min_workers}) above max_workers ({self.max_workers})")
        return self


class PipelineConfig(KindConfig):
    kind: Literal["pipeline"] = "pipeline"
    stages: Annotated[list[StageConfig], Field(min_length=1)]
    queue: Literal["ebf", "fcfs"] = "ebf"
    scaling: Literal["none", "history", "timeout_aware"] = "timeout_aware"
    max_extra_delay_s: NonNegFloat = 1.0
    batch_idle_s: PosFloat = 5.0
    # The planner's history: each tenant's last N finished batches (the bench's 3 kept the
    # mean extra delay at 1.05 s against 1.19 s with one; a single batch's tail is noisy).
    history_batches: Annotated[int, Field(ge=1, le=100)] = 3
    # The planner expects the requests a batch still owes its history's size, also once the
    # history says none are left to come (scaling.py, Late; the bench: mean extra delay 0.57 s
    # against 1.05 s without).
    expect_late: bool = True
    # A stage gives workers back only after plans asked for fewer this long: plans come
    # at every batch arrival and completion, and following each one at once can start and
    # stop a process every few seconds. Scaling up is immediate. 0 (default): follow each plan.
    scale_down_after_s: NonNegFloat = 0.0

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, stages: list[StageConfig]) -> list[StageConfig]:
        seen: set[str] = set()
        for stage in stages:
            if stage.name in seen:
                raise fail(f"stage name {stage.name!r} used twice: each stage needs its own")
            seen.add(stage.name)
        return stages


class RewardPipeline(Kind):
    Config = PipelineConfig

    @classmethod
    def uses_sandbox(cls, config: PipelineConfig, /) -> bool:
        from rlfleet.common.spec.seams import REWARD_BACKENDS  # as in _worker_config

        return any(not isinstance(stage.worker, SimWorkerConfig)
                   and REWARD_BACKENDS.uses_sandbox(stage.worker) for stage in config.stages)

    @classmethod
    def build(cls, config: PipelineConfig, /, *, batch_requests: int = 0, **_: Any) -> Any:
        """``batch_requests``: trajectories expected per training batch (the daemon's
        estimate, docs/design/reward.md); a batch with that many finished is done at once."""
        from rlfleet.daemons.reward_host.pipeline.backend import PipelineBackend

        return PipelineBackend(config, batch_requests=batch_requests)
