"""From the spec's placement section to concrete daemons: (host, role, id).

Member ids are `<role>-<n>`, numbered across hosts in spec order, so they are
stable across restarts (a restarted daemon re-registers under the same key)
and unique within a job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from rlfleet.common.devices import GPU_ENV
from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.placement import ROLES


@dataclass(frozen=True, order=True)
class Placed:
    host: str
    role: str
    member_id: str
    # The host's GPU indices it is given; None: the job assigns no GPUs (its environment is
    # left alone), (): none while others have some (CUDA_VISIBLE_DEVICES empty).
    gpus: tuple[int, ...] | None = None

    def environment(self) -> dict[str, str]:
        """What its process's environment gets from the placement."""
        return {} if self.gpus is None else {GPU_ENV: ",".join(map(str, self.gpus))}


def assign_gpus(placed: list[Placed], gpus_per_daemon: Mapping[str, int]) -> list[Placed]:
    """One host's daemons, each given the next `gpus_per_daemon[role]` GPU indices in the
    order given (the spec's: stable across restarts, so a daemon keeps its GPUs)."""
    out, next_gpu = [], 0
    for p in placed:
        n = gpus_per_daemon.get(p.role, 0)
        out.append(replace(p, gpus=tuple(range(next_gpu, next_gpu + n))))
        next_gpu += n
    return out


def placement_from_spec(spec: JobSpec) -> list[Placed]:
    counters = {role: 0 for role in ROLES}
    placed = []
    for host in spec.placement.hosts:
        here = []
        # Resource-managers first: everything else is placed through them.
        for role in sorted(host.roles, key=lambda r: (r != "resource-manager", ROLES.index(r))):
            for _ in range(host.roles[role]):
                here.append(Placed(host.name, role, f"{role}-{counters[role]}"))
                counters[role] += 1
        placed += assign_gpus(here, host.gpus_per_daemon) if spec.placement.assigns_gpus else here
    return placed
