"""The shared reward service's own spec (``rlfleet reward-service --spec SERVICE.toml``;
the service: shared_service.py, docs/reward.md "Shared reward service")::

    [service]
    auth_secret_file = "/etc/rlfleet/reward-token"  # optional: the Authorization value asked for
    max_body_bytes = 1048576      # a larger request is refused (413) unread
    max_pending = 4096            # trajectories accepted and not answered yet; more: 503
    max_pending_per_tenant = 2048 # optional: the most of those one job may hold
    answer_within_s = 120         # a request still waiting then gets 503 (retry: same answer)
    results_kept = 200000         # answers remembered per (tenant, trajectory id)
    answers_journal = "/var/lib/rlfleet/reward-service/answers.jsonl"  # optional: kept on disk too

    [pipeline]                    # the [reward_host.backend] table of kind "pipeline"
    queue = "ebf"
    scaling = "timeout_aware"
    [[pipeline.stages]]
    name = "check"
    worker = { kind = "rule_pool" }

The ``[pipeline]`` table is validated by the pipeline backend's own model
(pipeline.PipelineConfig; ``kind`` may be left out), so a stage is checked exactly as in
a job spec. Errors read as ``rlfleet job validate``'s: one line each, with the file, the
dotted key and the value. Light (pydantic only): validating starts nothing.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, StrictStr, ValidationError

from rlfleet.common.spec import SpecError
from rlfleet.common.spec_errors import describe, dotted, suggest, toml_error
from rlfleet.common.spec_fields import PosFloat, PosInt, Section, fail, show

from .pipeline import PipelineConfig


def _absolute(path: str | None) -> str | None:
    if path is not None and not os.path.isabs(path):
        raise fail(f"must be an absolute path, got {show(path)}")
    return path


class ServiceSection(Section):
    # The Authorization header a request must carry is this file's content (as the
    # reference endpoint's --auth-file); never the token in the spec itself.
    auth_secret_file: Annotated[StrictStr | None, AfterValidator(_absolute)] = None
    max_body_bytes: PosInt = 1 << 20
    # Each waiting request holds a thread and a socket; beyond this many the service
    # answers 503 (retried by the caller with backoff) instead of queueing without bound.
    max_pending: PosInt = 4096
    # So that one job's burst cannot take every slot and turn the others away: its own
    # trajectories beyond this get 503 (retried) while the others' are still taken.
    max_pending_per_tenant: PosInt | None = None
    # A request waits this long for its trajectory's answer, then gets 503; the trajectory
    # stays in the pipeline, and the retry (same key) gets its answer when it comes.
    answer_within_s: PosFloat = 120.0
    results_kept: PosInt = 200_000
    # Answers also on disk (answer_journal.py), so a restart after kill -9 does not score
    # again what was answered; unset, the record is in memory only.
    answers_journal: Annotated[StrictStr | None, AfterValidator(_absolute)] = None


class ServiceSpec(BaseModel):
    service: ServiceSection
    pipeline: PipelineConfig


def parse_service_spec(data: Any, source: str = "<service spec>") -> ServiceSpec:
    """Validate a parsed service spec; SpecError with every problem, one line each."""
    if not isinstance(data, dict):
        raise SpecError([f"{source}: expected a table at top level, got {show(data)}"])
    errors: list[tuple[tuple, str]] = [((key,), "unknown section" + suggest(key, ServiceSpec.model_fields))
                                       for key in data if key not in ServiceSpec.model_fields]
    valid: dict[str, BaseModel] = {}
    for name, model in (("service", ServiceSection), ("pipeline", PipelineConfig)):
        raw = data.get(name, {} if name == "service" else None)
        if raw is None:
            errors.append(((name,), "required table missing: the pipeline's stages"))
            continue
        if not isinstance(raw, dict):
            errors.append(((name,), f"expected a table, got {show(raw)}"))
            continue
        try:
            valid[name] = model.model_validate(raw)
        except ValidationError as exc:
            for err in exc.errors():
                loc, msg = describe(err, model)
                errors.append(((name, *loc), msg))
    if errors:
        raise SpecError([f"{source}: {dotted(loc)}: {msg}" for loc, msg in errors])
    return ServiceSpec.model_validate(valid)


def load_service_spec(path: str | os.PathLike[str]) -> ServiceSpec:
    # As common/spec.load_spec reads a job spec (that module is at its 500-line limit).
    source = os.fspath(path)
    try:
        data = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
    except OSError as exc:
        raise SpecError([f"{source}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise SpecError([f"{source}: invalid TOML: not UTF-8 ({exc.reason})"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError([f"{source}: {toml_error(str(exc))}"]) from None
    return parse_service_spec(data, source)
