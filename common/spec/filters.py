"""Dynamic filtering's keys in ``[trainer]`` and their checks (docs/guide/agentic.md, "Queue
scheduling and dynamic filtering"; used by common/spec/job.py).

- ``filter_schedule``: when a group without signal is filtered. ``"queue"``: as soon as it is
  complete, its prompt replaced by a new claim at once; ``"after_batch"``: rounds of
  batch_size/group_size prompts are generated to completion, then filtered, and a short
  batch waits for another round (the synchronous batch rollout).
- ``max_extra_prompts``: queue only: prompts claimed beyond the batch(es) in flight (ROLL
  Flash's max_additional_running_prompts), enforced by the env-hosts' claim pacer.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationInfo

from rlfleet.common.spec.fields import fail

FilterSchedule = Literal["queue", "after_batch"]


def check_schedule(schedule: str, info: ValidationInfo) -> str:
    if schedule == "after_batch" and info.data.get("no_signal_drops_per_batch") == 0:
        raise fail("'after_batch' filters each round once it is complete, but no_signal_drops_per_batch = 0 "
                   "turns filtering off: set it > 0, or remove filter_schedule")
    return schedule


def check_extra(extra: int | None, info: ValidationInfo) -> int | None:
    if extra is not None and info.data.get("filter_schedule") == "after_batch":
        raise fail(f"bounds the 'queue' schedule's extra claims; 'after_batch' claims rounds of exactly "
                   f"batch_size/group_size prompts: remove max_extra_prompts (got {extra}) or use 'queue'")
    return extra


def filter_errors(sections: dict[str, Any]) -> list[tuple[tuple, str]]:
    """Filtering against the rollout mode and the claim pacing. ``sections``: the sections
    that validated on their own (a missing one is skipped)."""
    t, rollout, env = sections.get("trainer"), sections.get("rollout"), sections.get("env_host")
    errors: list[tuple[tuple, str]] = []
    if t is None:
        return errors
    if rollout is not None and t.no_signal_drops_per_batch > 0 and rollout.mode in ("sync", "one_step_off"):
        # The barrier generates batch k from prompts k*P .. (k+1)*P - 1 only (docs/design/modes.md):
        # a dropped group is never replaced, and the step would wait for it forever.
        errors.append((("trainer", "no_signal_drops_per_batch"),
                       f"dynamic filtering needs rollout.mode 'trajectory' or 'partial': mode {rollout.mode!r} "
                       f"makes batch k of its own prompts only, so a dropped group is never replaced and "
                       f"the step waits forever (got {t.no_signal_drops_per_batch:g})"))
    if env is not None and t.max_extra_prompts is not None and not env.pace_claims:
        errors.append((("trainer", "max_extra_prompts"),
                       f"is enforced by the claim pacer, which env_host.pace_claims = false turns off: set "
                       f"pace_claims = true or remove max_extra_prompts (got {t.max_extra_prompts})"))
    return errors
