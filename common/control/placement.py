"""From the spec's placement section to concrete daemons: (host, role, id).

Member ids are `<role>-<n>`, numbered across hosts in spec order, so they are
stable across restarts (a restarted daemon re-registers under the same key)
and unique within a job.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.placement import ROLES


@dataclass(frozen=True, order=True)
class Placed:
    host: str
    role: str
    member_id: str


def placement_from_spec(spec: JobSpec) -> list[Placed]:
    counters = {role: 0 for role in ROLES}
    placed = []
    for host in spec.placement.hosts:
        # Resource-managers first: everything else is placed through them.
        for role in sorted(host.roles, key=lambda r: (r != "resource-manager", ROLES.index(r))):
            for _ in range(host.roles[role]):
                placed.append(Placed(host.name, role, f"{role}-{counters[role]}"))
                counters[role] += 1
    return placed
