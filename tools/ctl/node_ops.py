"""What `rlfleet node` decides and watches, apart from the command line: which hosts a
job knows, whether draining one would leave a role without a running instance, and
the phases of a host joining (docs/operations/live-fleet.md). Pure code over `Cluster`
snapshots and the spec; tools/ctl/node.py does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.control.cluster import Cluster
from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.placement import ROLES

# The phases of `rlfleet node add`, in order: each is the time from the previous one.
ADD_PHASES = ("admit", "place", "start", "weights", "first_trajectory")


def known_hosts(cluster: Cluster, spec: JobSpec | None) -> set[str]:
    named = {h.name for h in spec.placement.hosts} if spec is not None else set()
    return named | set(cluster.nodes) | set(cluster.admissions) | set(cluster.node_states) | \
        {p.host for p in cluster.placement}


def sole_instances(cluster: Cluster, host: str) -> list[str]:
    """Roles whose every running member is on `host` ("trainer (trainer-0)"): draining it
    would stop that role in the whole job."""
    out = []
    roles = sorted({m.role for m in cluster.all_members if m.host == host and m.running and m.role in ROLES})
    for role in roles:
        running = [m for m in cluster.members(role) if m.running]
        if running and all(m.host == host for m in running):
            out.append(f"{role} ({', '.join(m.id for m in running)})")
    return out


def on_host(cluster: Cluster, host: str) -> list[str]:
    """Member ids of the job's daemons registered from `host` (not its agent), and
    daemons its agent still reports."""
    ids = {m.id for m in cluster.all_members if m.host == host and m.role in ROLES}
    node = cluster.nodes.get(host)
    if node is not None:
        ids |= {d.id for d in node.daemons}
    return sorted(ids)


@dataclass
class JoinWatch:
    """Timestamps of each milestone of a host joining the job, taken from successive
    snapshots (the caller's clock): registered, then the ADD_PHASES in order. A
    milestone is never earlier than the one before it."""
    host: str
    named: bool = False
    at: dict[str, float] = field(default_factory=dict)
    caught_up_to: int | None = None  # the newest weight version when the host's daemons started

    def observe(self, cluster: Cluster, now: float) -> list[str]:
        """Record what this snapshot shows; returns the milestones newly reached."""
        host, new = self.host, []
        placed = [p for p in cluster.placement if p.host == host]
        members = {p.id: cluster.member(p.role, p.id) for p in placed}
        relays = [m for m in members.values() if m is not None and m.role == "relay"]
        rollouts = [m for m in members.values() if m is not None and m.role == "rollout"]
        envs = [m for m in members.values() if m is not None and m.role == "env-host"]
        latest = cluster.weights.version if cluster.weights is not None else -1
        reached = {
            "registered": host in cluster.nodes,
            "admit": self.named or host in cluster.admissions,
            "place": bool(placed),
            "start": bool(placed) and all(m is not None and m.running for m in members.values()),
        }
        if reached["start"] and self.caught_up_to is None and "start" not in self.at:
            self.caught_up_to = latest
        target = self.caught_up_to if self.caught_up_to is not None else latest
        reached["weights"] = reached["start"] and all(
            int(m.info.get("newest", -1)) >= target for m in relays) and all(
            int(m.info.get("weight_version", -1)) >= target for m in rollouts)
        reached["first_trajectory"] = reached["weights"] and (
            any(m.info.get("first_result_at") for m in rollouts) if rollouts else
            any(int(m.info.get("done", 0)) > 0 for m in envs) if envs else True)
        for name in ("registered", *ADD_PHASES):
            if name in self.at:
                continue
            if not reached[name]:
                break
            self.at[name] = now
            new.append(name)
        return new

    @property
    def done(self) -> bool:
        return "first_trajectory" in self.at

    def phases(self) -> dict[str, float | None]:
        """Seconds each phase took (None: not reached)."""
        out: dict[str, float | None] = {}
        prev = self.at.get("registered")
        for name in ADD_PHASES:
            t = self.at.get(name)
            out[f"{name}_s"] = None if t is None or prev is None else round(t - prev, 3)
            prev = t
        return out

    def to_json(self) -> dict[str, Any]:
        start, end = self.at.get("registered"), self.at.get("first_trajectory")
        return {"host": self.host, "phases": self.phases(),
                "total_s": None if start is None or end is None else round(end - start, 3),
                "caught_up_to_version": self.caught_up_to}
