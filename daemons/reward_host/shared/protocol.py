"""The shared reward service's request reading, with no I/O (shared_service.py does the
I/O): a ``POST /score`` body of the remote_http protocol (docs/design/reward.md, "Remote
endpoints") plus the fields a shared service schedules by::

    {"trajectory_id": "p17-g3", "task": "arithmetic", "task_kwargs": {...},
     "prompt": {"task", "split", "uid", "question", "answer", "seed"}, "completions": ["122"],
     "tenant": "job-a",          # optional: the job's name ("" when absent)
     "batch": 4,                 # optional: its estimated training batch (0)
     "batch_requests": 64}       # optional: trajectories per batch of that tenant (0: unknown)

Everything a caller sends is checked here, so a hostile or broken body becomes one
precise ``BadRequest`` (400, the key path and what was wrong) and never reaches the
pipeline: the stages see only well-typed RewardJobs.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from rlfleet.common.wire.messages import Prompt
from rlfleet.daemons.reward_host.workers import RewardJob

_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")  # no '/': see pipeline_key
_MAX_KEY_CHARS = 256
_MAX_INT = 2**53  # JSON numbers beyond it are not exact in every client
_PROMPT_STRINGS = ("task", "split", "uid", "question", "answer")


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    tenant: str
    trajectory_id: str
    job: RewardJob  # keyed by pipeline_key: two tenants' ids never meet in the pipeline
    batch_requests: int

    @property
    def ident(self) -> tuple[str, str]:
        """What is idempotent: a repeated (tenant, trajectory id) gets the first answer."""
        return self.tenant, self.trajectory_id


def pipeline_key(tenant: str, trajectory_id: str) -> str:
    """The key inside the pipeline: ids are unique per job only. A tenant has no '/',
    so the first '/' splits it back (split_key)."""
    return f"{tenant}/{trajectory_id}"


def split_key(key: str) -> tuple[str, str]:
    tenant, _, trajectory_id = key.partition("/")
    return tenant, trajectory_id


def _show(value: Any) -> str:
    text = json.dumps(value)[:60] if not isinstance(value, str) else repr(value[:60])
    return text + ("..." if len(text) >= 60 else "")


def _string(doc: dict[str, Any], name: str, where: str = "", *, required: bool = True,
            default: str = "") -> str:
    if name not in doc:
        if required:
            raise BadRequest(f"{where}{name}: required")
        return default
    value = doc[name]
    if not isinstance(value, str):
        raise BadRequest(f"{where}{name}: expected a string, got {_show(value)}")
    return value


def _count(doc: dict[str, Any], name: str, upper: int = _MAX_INT) -> int:
    value = doc.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= upper:
        raise BadRequest(f"{name}: expected an integer in 0..{upper}, got {_show(value)}")
    return value


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadRequest(f"body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:  # [[[[...]]]]: a hostile body must not take the handler down
        raise BadRequest("body is not JSON this service reads: nested too deeply") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"body must be a JSON object, got {type(doc).__name__}")
    return doc


def read_request(raw: bytes, idempotency_key: str | None) -> ScoreRequest:
    """The request of a ``POST /score`` body and its Idempotency-Key header."""
    doc = decode_body(raw)
    tid = _string(doc, "trajectory_id")
    if not 0 < len(tid) <= _MAX_KEY_CHARS:
        raise BadRequest(f"trajectory_id: expected 1..{_MAX_KEY_CHARS} characters, got {len(tid)}")
    if idempotency_key != tid:
        raise BadRequest(f"the Idempotency-Key header ({_show(idempotency_key or '')}) must equal "
                         f"the body's trajectory_id ({_show(tid)})")
    tenant = _string(doc, "tenant", required=False)
    if tenant and not _TENANT.match(tenant):
        raise BadRequest(f"tenant: expected 1..128 letters, digits, '_', '.' or '-' (starting with a "
                         f"letter or digit), got {_show(tenant)}")
    task = _string(doc, "task")
    if not task:
        raise BadRequest("task: must not be empty")
    kwargs = doc.get("task_kwargs", {})
    if not isinstance(kwargs, dict):
        raise BadRequest(f"task_kwargs: expected an object, got {_show(kwargs)}")
    prompt = doc.get("prompt")
    if not isinstance(prompt, dict):
        raise BadRequest(f"prompt: expected an object, got {_show(prompt)}")
    fields = {name: _string(prompt, name, "prompt.") for name in _PROMPT_STRINGS}
    seed = prompt.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadRequest(f"prompt.seed: expected an integer, got {_show(seed)}")
    completions = doc.get("completions")
    if not isinstance(completions, list) or not completions:
        raise BadRequest(f"completions: expected a non-empty list of strings, got {_show(completions)}")
    for i, text in enumerate(completions):
        if not isinstance(text, str):
            raise BadRequest(f"completions[{i}]: expected a string, got {_show(text)}")
    job = RewardJob(pipeline_key(tenant, tid), task, kwargs, Prompt(**fields, seed=seed),
                    list(completions), tenant, _count(doc, "batch"))
    return ScoreRequest(tenant, tid, job, _count(doc, "batch_requests", 1_000_000))
