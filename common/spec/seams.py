"""The registry of every seam (ARCHITECTURE §5), one per spec table.

    seam               spec table                  entry-point group            default
    rollout engine     [rollout.engine]            rlfleet.rollout_engines      torch
    policy loss        [trainer.loss]              rlfleet.policy_losses        ppo_clip
    trainer backend    [trainer.backend]           rlfleet.trainer_backends     torch
    reward backend     [reward_host.backend]       rlfleet.reward_backends      rule_pool
    reward dispatch    [reward_host.dispatch]      rlfleet.reward_dispatch      fifo
    task               [task.env]                  rlfleet.tasks                (required)
    env-host routing   [env_host.routing]          rlfleet.env_routers          least_loaded
    repack planner     [repack_manager.planner]    rlfleet.repack_planners      none

A daemon asks the registry of its seam for the implementation
(``ROLLOUT_ENGINES.build(spec.rollout.engine, model_path=...)``) rather than
branching on the kind; docs/design/seams.md says how to add one.
"""

from __future__ import annotations

from typing import Any

from rlfleet.common.spec.registry import Registry

__all__ = ["ENV_ROUTERS", "sandboxed_roles", "POLICY_LOSSES", "REPACK_PLANNERS", "REWARD_BACKENDS",
           "REWARD_DISPATCH", "ROLLOUT_ENGINES", "SEAMS", "TASKS", "TRAINER_BACKENDS"]

ROLLOUT_ENGINES = Registry("rollout engine", "rlfleet.rollout_engines", default="torch")
POLICY_LOSSES = Registry("policy loss", "rlfleet.policy_losses", default="ppo_clip")
TRAINER_BACKENDS = Registry("trainer backend", "rlfleet.trainer_backends", default="torch")
REWARD_BACKENDS = Registry("reward backend", "rlfleet.reward_backends", default="rule_pool")
REWARD_DISPATCH = Registry("reward dispatch", "rlfleet.reward_dispatch", default="fifo")
# No default: which task a job trains is the one thing every spec must say.
TASKS = Registry("task", "rlfleet.tasks", default=None)
ENV_ROUTERS = Registry("env-host routing", "rlfleet.env_routers", default="least_loaded")
REPACK_PLANNERS = Registry("repack planner", "rlfleet.repack_planners", default="none")

SEAMS: tuple[Registry, ...] = (ROLLOUT_ENGINES, POLICY_LOSSES, TRAINER_BACKENDS, REWARD_BACKENDS,
                               REWARD_DISPATCH, TASKS, ENV_ROUTERS, REPACK_PLANNERS)


def sandboxed_roles(spec: Any) -> frozenset[str]:
    """The roles of `spec` (a JobSpec) whose daemons run untrusted code in the sandbox:
    the env-host when the task's tool does, the reward-host when its backend does."""
    roles = set()
    if TASKS.uses_sandbox(spec.task.env):
        roles.add("env-host")
    if REWARD_BACKENDS.uses_sandbox(spec.reward_host.backend):
        roles.add("reward-host")
    return frozenset(roles)
