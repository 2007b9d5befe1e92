"""What `rlfleet node` decides and watches, apart from the command line: which hosts a
job knows, whether draining one would leave a role without a running instance, and
the phases of a host joining (docs/operations/live-fleet.md). Pure code over `Cluster`
snapshots and the spec; tools/ctl/node.py does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.control.cluster import Cluster
from rlfleet.common.control.members import Member
from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.placement import ROLES

# The phases of `rlfleet node add`, in order: each is the time from the previous one.
ADD_PHASES = ("admit", "place", "start", "weights", "first_trajectory")
MILESTONES = ("registered", *ADD_PHASES)


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
    """The milestones of a host joining the job: its agent registered, then the ADD_PHASES
    in order, each at the wall time its own etcd record gives (the agent's `registered`,
    the admission's and the placement's `since`, the daemons' `started`, the rollouts'
    `first_weights_at` and `first_result_at`), so the phases are the same whenever the
    command looks. A milestone counts only once every one before it is reached, and is
    never earlier than the one before (the hosts' clocks may differ a little)."""
    host: str
    named: bool = False   # the spec names it: admitted as soon as it registers
    floor: float = 0.0    # it could not join before this (when `node add` cleared its state)
    at: dict[str, float] = field(default_factory=dict)
    caught_up_to: int | None = None  # the first weight version its rollouts loaded
    # When its agent registered again after the host's daemons had started (an agent
    # restart): the registration the join began with is no longer in the records.
    registered_again: float | None = None

    def observe(self, cluster: Cluster) -> list[str]:
        """Record what this snapshot's records show; returns the milestones newly reached."""
        raw = self._raw(cluster)
        new, prev = [], None
        for name in MILESTONES:
            t = raw.get(name)
            if t is None:
                break
            t = t if prev is None else max(prev, t)
            if name not in self.at:
                self.at[name] = t
                new.append(name)
            prev = self.at[name]
        return new

    def _raw(self, cluster: Cluster) -> dict[str, float | None]:
        host = self.host
        node = cluster.nodes.get(host)
        if node is None:
            return {}
        placed = [p for p in cluster.placement if p.host == host]
        members = [cluster.member(p.role, p.id) for p in placed]
        running = [m for m in members if m is not None and m.running]
        admission = cluster.admissions.get(host)
        raw: dict[str, float | None] = {"registered": max(node.registered, self.floor)}
        raw["admit"] = raw["registered"] if self.named else admission.since if admission is not None else None
        raw["place"] = max(p.since for p in placed) if placed else None
        if not placed or len(running) < len(placed):
            return raw
        raw["start"] = max(m.started for m in running)
        if node.registered > raw["start"] and node.registered > self.floor:
            # Counting from this registration would make every phase 0 s: count from the
            # first milestone the records still hold (the admission; a named host's first start).
            self.registered_again = node.registered
            first = min(m.started for m in running) if self.named or admission is None else admission.since
            raw["registered"] = max(first, self.floor)
            if self.named:
                raw["admit"] = raw["registered"]
        rollouts = [m for m in running if m.role == "rollout"]
        relays = [m for m in running if m.role == "relay"]
        envs = [m for m in running if m.role == "env-host"]
        raw["weights"] = (_latest(rollouts, "first_weights_at") if rollouts else
                          _latest(relays, "first_version_at") if relays else raw["start"])
        if rollouts and raw["weights"] is not None:
            self.caught_up_to = min(int(m.info["first_weights_version"]) for m in rollouts)
        raw["first_trajectory"] = (_earliest(rollouts, "first_result_at") if rollouts else
                                   _earliest(envs, "first_done_at") if envs else raw["weights"])
        return raw

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
                "caught_up_to_version": self.caught_up_to,
                "milestones_at": {name: round(t, 3) for name, t in self.at.items()},
                **({"agent_registered_again_at": round(self.registered_again, 3)}
                   if self.registered_again is not None else {})}


def _latest(members: list[Member], name: str) -> float | None:
    """When the last of `members` reached what `info[name]` records; None until all did."""
    times = [m.info.get(name) for m in members]
    return None if any(t is None for t in times) else max(float(t) for t in times)  # type: ignore[arg-type]


def _earliest(members: list[Member], name: str) -> float | None:
    """When the first of `members` reached what `info[name]` records; None until one did."""
    times = [float(t) for m in members if (t := m.info.get(name)) is not None]
    return min(times) if times else None
