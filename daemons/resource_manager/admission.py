"""The resource-manager's placement policy for a live fleet, apart from its I/O
(STYLE: policy apart from I/O): pure code over plain records.

What runs where is decided from three sources (docs/operations/live-fleet.md):

- the spec's named hosts (`[[placement.hosts]]`): their daemons, as before;
- the spec's pools (`[[placement.pools]]`): a host the spec does not name whose
  agent registers (`nodes/<host>`) is admitted into the first pool, in spec
  order, whose labels it carries and which has room (`capacity`, 0: no limit);
  a pool with no labels matches every host (the fallback, last). The admission
  is recorded (`admitted/<host>`) and outlives the agent: a host that reboots
  comes back into the same pool with the same member ids;
- the operator's intent per host (`node_state/<host>`): `cordoned` keeps what
  runs and admits nothing new; `draining` places nothing there, and becomes
  `drained` once no daemon of the job is left on it; `removed` also forgets the
  host's admission, and it is not admitted again until `rlfleet node add`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rlfleet.common.control.operations import DRAINING, REMOVED, Admission, NodeState
from rlfleet.common.control.placement import Placed, assign_gpus, placement_from_spec
from rlfleet.common.spec.job import JobSpec
from rlfleet.common.spec.placement import Pool


@dataclass(frozen=True)
class Fleet:
    """What the resource-manager reads before deciding (one snapshot of the job)."""
    nodes: Mapping[str, Mapping[str, str]]           # registered host -> its labels
    gpus: Mapping[str, int] = field(default_factory=dict)  # registered host -> GPUs its agent reports
    admissions: Mapping[str, Admission] = field(default_factory=dict)
    node_states: Mapping[str, NodeState] = field(default_factory=dict)
    busy_hosts: frozenset[str] = frozenset()        # hosts where a daemon of the job still runs


@dataclass(frozen=True)
class Decision:
    placed: tuple[Placed, ...]                      # what should run, all hosts
    admit: tuple[Admission, ...] = ()               # new admissions to record
    forget: tuple[str, ...] = ()                    # admissions to delete (removed hosts, vanished pools)
    drained: tuple[str, ...] = ()                   # draining hosts with nothing left: now drained
    waiting: Mapping[str, str] = field(default_factory=dict)  # registered host -> why it is not admitted


def pool_placement(pool: Pool, host: str, assigns_gpus: bool = False) -> list[Placed]:
    """The daemons a pool puts on one admitted host. Ids name the host, so they are
    stable across the host's reboots and unique however many hosts join; where the job
    assigns GPUs (`assigns_gpus`), each is given its own."""
    placed = [Placed(host, role, f"{role}-{host}-{i}") for role, n in pool.roles.items() for i in range(n)]
    return assign_gpus(placed, pool.gpus_per_daemon) if assigns_gpus else placed


def describe_labels(labels: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"


def choose_pool(pools: Iterable[Pool], labels: Mapping[str, str], members: Mapping[str, int],
                gpus: int = 0) -> tuple[Pool | None, str]:
    """The first pool whose labels the host carries, whose daemons' GPUs it has, and which
    has room; else None and why."""
    matching = [p for p in pools if p.matches(dict(labels))]
    if not matching:
        return None, f"no pool matches its labels {describe_labels(labels)}"
    fitting = [p for p in matching if p.gpus_wanted <= gpus]
    if not fitting:
        return None, f"it has {gpus} GPU(s); every matching pool needs more: " + ", ".join(
            f"{p.name} ({p.gpus_wanted})" for p in matching)
    for pool in fitting:
        if not pool.capacity or members.get(pool.name, 0) < pool.capacity:
            return pool, ""
    return None, "every matching pool is full: " + ", ".join(
        f"{p.name} ({members.get(p.name, 0)}/{p.capacity})" for p in fitting)


def decide(spec: JobSpec, fleet: Fleet, now: float) -> Decision:
    named = {h.name for h in spec.placement.hosts}
    pools = {p.name: p for p in spec.placement.pools}
    states = fleet.node_states

    def unplaced(host: str) -> bool:
        return host in states and not states[host].placeable

    # Admissions kept: their pool still exists and the host was not removed.
    kept = {h: a for h, a in fleet.admissions.items()
            if a.pool in pools and h not in named and states.get(h, NodeState(h, "")).state != REMOVED}
    forget = tuple(sorted(set(fleet.admissions) - set(kept)))
    members = {name: sum(1 for a in kept.values() if a.pool == name) for name in pools}
    admit, waiting = [], {}
    for host in sorted(set(fleet.nodes) - named - set(kept)):
        state = states.get(host)
        if state is not None:
            waiting[host] = f"{state.state}: not admitted" + (" (rlfleet node add admits it)"
                                                              if state.state == REMOVED else "")
            continue
        if not pools:
            waiting[host] = "the spec has no [[placement.pools]]: only its named hosts run the job"
            continue
        pool, why = choose_pool(pools.values(), fleet.nodes[host], members, fleet.gpus.get(host, 0))
        if pool is None:
            waiting[host] = why
            continue
        members[pool.name] += 1
        admission = Admission(host, pool.name, now, dict(fleet.nodes[host]))
        admit.append(admission)
        kept[host] = admission

    placed = [p for p in placement_from_spec(spec) if not unplaced(p.host)]
    for host, admission in sorted(kept.items()):
        if not unplaced(host):
            placed += pool_placement(pools[admission.pool], host, spec.placement.assigns_gpus)
    drained = tuple(sorted(h for h, s in states.items() if s.state == DRAINING and h not in fleet.busy_hosts))
    return Decision(tuple(placed), tuple(admit), forget, drained, waiting)
