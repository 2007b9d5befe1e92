"""The reward-backend seam: ``[reward_host.backend]``, what scores a trajectory.

``rule_pool``: the task's rule reward in a pool of local worker processes, each job
killed after ``timeout_s`` (workers.RewardPool); ``remote_http``: HTTP endpoints
(remote_config.py, remote.py); ``user_code``: a reward function given as source in the
spec, run in the sandbox (user_code.py); ``pipeline``: stages in order, each served by any
of these kinds or a simulated worker, with per-stage queues and scaling (pipeline.py,
ARCHITECTURE §5). The reward service drives
a backend from its one thread: ``submit`` jobs, wait on ``fds`` for at most
``next_deadline_in`` seconds, ``poll`` the outcomes.

Registered in pyproject.toml (``rlfleet.reward_backends``); importing this module
starts nothing (the spec imports it to validate).
"""

from __future__ import annotations

import abc
from typing import Any, Literal

from rlfleet.common.spec.fields import PosFloat, PosInt
from rlfleet.common.spec.registry import Kind, KindConfig


class RewardBackend(abc.ABC):
    """Scores RewardJobs into RewardOutcomes (workers.py); never raises into its owner:
    a job that cannot be scored comes back as an outcome with ``error`` set."""

    @abc.abstractmethod
    def submit(self, job: Any) -> None: ...

    @abc.abstractmethod
    def poll(self, timeout: float = 0.0) -> list[Any]:
        """Outcomes that are ready, waiting up to ``timeout`` for the first one."""

    @abc.abstractmethod
    def fds(self) -> list[int]:
        """File descriptors that become readable when poll() has something to do."""

    @abc.abstractmethod
    def next_deadline_in(self) -> float:
        """Seconds until poll() has something to do without any fd becoming readable."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def resize(self, workers: int) -> None:  # noqa: B027 — a default that does nothing, not abstract
        """Hold ``workers`` workers from now on: a scaling plan applied (the ``pipeline``
        kind, pipeline.py). A stop lets a running job finish. The default does nothing,
        which is right for a kind whose concurrency is simply how many jobs its owner
        hands it at once (the pipeline never hands a stage more than its plan)."""


class RulePoolConfig(KindConfig):
    kind: Literal["rule_pool"] = "rule_pool"
    workers: PosInt = 2  # worker processes
    timeout_s: PosFloat = 10.0  # a job running longer is killed with its worker


class RulePool(Kind):
    Config = RulePoolConfig

    @classmethod
    def build(cls, config: RulePoolConfig, /, *, dispatch: Any = None, **_: Any) -> RewardBackend:
        from .workers import RewardPool

        return RewardPool(config.workers, config.timeout_s, dispatch=dispatch)
