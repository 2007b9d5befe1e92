"""rlfleet.daemons: one sub-package per daemon role.

`daemon_class(role)` imports lazily so that `rlfleet daemon --help` and spec
errors are instant and no role pays for another role's imports (torch, …).
"""

from __future__ import annotations

import importlib

DAEMON_CLASSES = {
    "resource-manager": "rlfleet.daemons.resource_manager.daemon:ResourceManager",
    "trainer": "rlfleet.daemons.trainer.daemon:Trainer",
    "relay": "rlfleet.daemons.relay.daemon:Relay",
    "rollout": "rlfleet.daemons.rollout.daemon:Rollout",
    "env-host": "rlfleet.daemons.env_host.daemon:EnvHost",
    "reward-host": "rlfleet.daemons.reward_host.daemon:RewardHost",
    "repack-manager": "rlfleet.daemons.repack_manager.daemon:RepackManager",
}
# Daemons of a machine, not of the job's work: never placed by a spec, never in ROLES.
NODE_DAEMON_CLASSES = {
    "agent": "rlfleet.daemons.agent.daemon:Agent",
}


def daemon_class(role: str) -> type:
    try:
        module_name, _, cls = {**DAEMON_CLASSES, **NODE_DAEMON_CLASSES}[role].partition(":")
    except KeyError:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join([*DAEMON_CLASSES, *NODE_DAEMON_CLASSES])}") \
            from None
    return getattr(importlib.import_module(module_name), cls)
