"""The reward-host daemon: stateless reward workers; scored trajectories go to the
trainer until acknowledged.

Threads:
- main (Daemon loop): registration (publishing `addresses.trajectories`); each cycle
  finds the trainer leader in etcd (`members/trainer/*` whose registration says
  leader=true, cross-checked with `leader/trainer` when several claim it) and points
  the service at its `addresses.trajectories`;
- service (`RewardService`, named `reward-service`): the data path: receive, dedup,
  score in the worker pool, forward, ack;
- `reward-planner`, with the `pipeline` backend only (planner_thread.py): computes the
  scaling plans; the service thread hands it snapshots and applies its last plan, never
  waiting for one.

What scores is the backend of `[reward_host.backend]` (backends.py; `rule_pool`: child
processes, `workers` of them, each job killed after `timeout_s`), fed in the order of
`[reward_host.dispatch]` (dispatch.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rlfleet.common.control.members import Leader, Member, members_from
from rlfleet.common.control.store import StoreUnavailable
from rlfleet.common.daemon import Daemon
from rlfleet.common.spec.seams import REWARD_BACKENDS, REWARD_DISPATCH
from rlfleet.common.wire.messages import Trajectory
from rlfleet.common.wire.reliable import ReliableReceiver
from rlfleet.daemons.tasks.prompts import task_kwargs

from .service import RewardService

TRAINER_LOOKUP_S = 0.05  # etcd lookups of the trainer while there is none ...
FAST_LOOKUP_FOR_S = 30.0  # ... for this long after it went missing, then every cycle


def trainer_address(members: list[Member], leader_id: str | None) -> str | None:
    """The trajectories address of the trainer leader, or None if there is none."""
    leaders = {}
    for m in members:
        address = m.address("trajectories")
        if m.leader and address:
            leaders[m.id] = address
    if len(leaders) > 1 and leader_id in leaders:
        return leaders[leader_id]  # a deposed leader whose registration is not updated yet
    return next(iter(sorted(leaders.items())), (None, None))[1]


class RewardHost(Daemon):
    role = "reward-host"

    def setup(self) -> None:
        assert self.spec is not None
        spec = self.spec
        self.receiver = ReliableReceiver(f"tcp://{spec.reward_host.bind_host}:0", expect=Trajectory,
                                         name=f"{self.options.member_id}<-env-hosts",
                                         edge="reward-host-trajectories")
        self.addresses["trajectories"] = self.receiver.endpoint
        rh = spec.reward_host
        # Prompts per training batch, as the env-hosts claim them (env_host/pacing.py: a
        # batch-mode round adds its redundant prompts); docs/design/reward.md, "the batch estimate".
        per_batch = max(1, spec.trainer.batch_size // spec.task.group_size) + spec.env_host.redundant_prompts
        self.pool = REWARD_BACKENDS.build(rh.backend, dispatch=REWARD_DISPATCH.build(rh.dispatch),
                                          batch_requests=per_batch * spec.task.group_size)
        self.service = RewardService(receiver=self.receiver, pool=self.pool,
                                     task_name=spec.task.env.kind, task_kwargs=task_kwargs(spec),
                                     name=self.options.member_id, tenant=spec.job.name,
                                     prompts_per_batch=per_batch)
        self._trainer: str | None = None
        self._trainer_lost_at = time.monotonic()
        self._stop_service = threading.Event()
        self._thread = threading.Thread(target=self.service.run, args=(self._stop_service,),
                                        name="reward-service", daemon=True)
        self._thread.start()

    def cycle(self) -> str | None:
        if not self._thread.is_alive():
            self.request_stop()
            return "reward service thread died; stopping (env-hosts re-send what was not acked)"
        try:
            members = members_from(self.keys, self.store.get_prefix(self.keys.role_members_prefix("trainer")))
            leader = self.store.get(self.keys.leader("trainer"))
        except StoreUnavailable:
            return None  # keep the trainer we know
        leader_id = (Leader.from_kv(self.keys, leader).id or None) if leader is not None else None
        address = trainer_address(members, leader_id)
        if address == self._trainer:
            return None
        if address is None:
            self._trainer_lost_at = time.monotonic()
        self._trainer = address
        self.service.set_trainer(address)
        return f"trainer at {address}" if address else "no trainer leader: holding scored trajectories"

    def cycle_interval_s(self) -> float | None:
        # Without a trainer every scored trajectory waits: look for one often, for a while
        # (a job's start, a trainer failover), then at the normal pace (a trainer long gone).
        if self._trainer is None and time.monotonic() - self._trainer_lost_at < FAST_LOOKUP_FOR_S:
            return TRAINER_LOOKUP_S
        return None

    def drain(self) -> str | None:
        # Nothing to hand back: whatever the trainer did not ack is re-sent by env-hosts.
        self._stop_service.set()
        self._thread.join(5.0)
        self.pool.close()
        self.receiver.close()
        s = self.service.stats
        summary = getattr(self.pool, "summary", None)  # the pipeline's stages and plans
        return (f"scored {s['scored']}, reward errors {s['reward_errors']}, "
                f"{self.service.in_flight} in flight left to the env-hosts' re-sends"
                + (f"; {summary()}" if summary is not None else ""))

    def member_info(self) -> dict[str, Any]:
        service = getattr(self, "service", None)
        if service is None:
            return {}
        info = {"in_flight": service.in_flight, "scored": service.stats["scored"],
                "reward_errors": service.stats["reward_errors"]}
        status = getattr(self.pool, "status", None)  # the pipeline's stages (pipeline_backend.py)
        if status is not None:
            info["stages"] = status()
        return info
