"""The spec's `[placement]`: which daemons run on which named host, and the pools
that hosts the spec does not name are admitted into while the job runs
(docs/operations/live-fleet.md; the resource-manager's admission policy is
daemons/resource_manager/admission.py).
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StrictStr, model_validator

from rlfleet.common.spec.fields import NonNegInt, Section, fail, show

Role = Literal[
    "resource-manager", "trainer", "relay", "rollout", "env-host", "reward-host", "repack-manager"
]
ROLES: tuple[str, ...] = typing.get_args(Role)
# Leader-elected: one instance works, extra instances wait as standbys.
SINGLETON_ROLES: tuple[str, ...] = ("resource-manager", "repack-manager", "trainer")

DEFAULT_PLACEMENT: dict[str, int] = {
    "resource-manager": 2,  # a standby, so the single-machine run exercises failover
    "repack-manager": 1,
    "trainer": 1,
    "relay": 1,
    "rollout": 1,
    "env-host": 1,
    "reward-host": 1,
}

# What a pool may place on an admitted host: workers, never a singleton (those are
# named in `hosts`, so a job's leaders never depend on which machines turn up).
PoolRole = Literal["relay", "rollout", "env-host", "reward-host"]


def _check_host_name(name: str) -> str:
    # Host names become etcd key components (/rlfleet/<job>/nodes/<host>).
    if "/" in name or any(c.isspace() for c in name):
        raise fail(f"must not contain '/' or whitespace, got {show(name)}")
    return name


def check_gpus(where: str, roles: dict[str, int], gpus_per_daemon: dict[str, int], gpus: int | None) -> None:
    """A role asking for GPUs must be placed there, and (where the host's count is known)
    what its daemons ask for together must fit: the error names the host and the key."""
    for role, n in gpus_per_daemon.items():
        if n and not roles.get(role):
            raise fail(f"{where}: gpus_per_daemon.{role} = {n}, but it places no {role}")
    wanted = sum(roles.get(role, 0) * n for role, n in gpus_per_daemon.items())
    if gpus is None or wanted <= gpus:
        return
    asked = " + ".join(f"{roles[r]} {r} x {n}" for r, n in gpus_per_daemon.items() if n)
    if gpus == 0:
        raise fail(f"{where}: gpus_per_daemon asks for {wanted} GPU(s) ({asked}) on a host without one "
                   "(gpus = 0; set gpus to the number the host has)")
    raise fail(f"{where}: gpus_per_daemon asks for {wanted} GPU(s) ({asked}), more than its gpus = {gpus}")


class HostPlacement(Section):
    name: Annotated[StrictStr, Field(min_length=1), AfterValidator(_check_host_name)]
    roles: dict[Role, NonNegInt]
    # GPUs the host has, and how many each daemon of a role is given (CUDA_VISIBLE_DEVICES,
    # assigned in placement order): docs/operations/gpus.md.
    gpus: NonNegInt = 0
    gpus_per_daemon: dict[Role, NonNegInt] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _gpus_fit(self) -> HostPlacement:
        check_gpus(f"host {self.name!r}", dict(self.roles), dict(self.gpus_per_daemon), self.gpus)
        return self


def _check_pool_name(name: str) -> str:
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise fail(f"must be letters, digits, '-', '_' or '.', got {show(name)}")
    return name


class Pool(Section):
    """Hosts the spec does not name are admitted into the first pool, in spec order,
    whose labels they all carry (an agent's `--label`/$RLFLEET_LABELS) and which has
    room; `labels = {}` matches every host: the fallback pool, last."""
    name: Annotated[StrictStr, AfterValidator(_check_pool_name)]
    labels: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    roles: dict[PoolRole, NonNegInt]
    capacity: NonNegInt = 0  # hosts at most; 0: no limit
    # GPUs each daemon of a role is given; a host is admitted only if its agent reports that many.
    gpus_per_daemon: dict[PoolRole, NonNegInt] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _places_something(self) -> Pool:
        if not any(self.roles.values()):
            raise fail(f"pool {self.name!r} places nothing: give roles, e.g. {{ relay = 1, rollout = 1 }}")
        check_gpus(f"pool {self.name!r}", dict(self.roles), dict(self.gpus_per_daemon), None)
        return self

    @property
    def gpus_wanted(self) -> int:
        """GPUs a host needs to be admitted into this pool."""
        return sum(self.roles.get(role, 0) * n for role, n in self.gpus_per_daemon.items())

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.labels.items())


def _default_hosts() -> tuple[HostPlacement, ...]:
    return (HostPlacement(name="localhost", roles=DEFAULT_PLACEMENT),)


class PlacementSection(Section):
    hosts: tuple[HostPlacement, ...] = Field(default_factory=_default_hosts)
    pools: tuple[Pool, ...] = ()  # empty: only the named hosts run the job

    @property
    def assigns_gpus(self) -> bool:
        """Whether any daemon is given GPUs: then every daemon's CUDA_VISIBLE_DEVICES is set
        (empty for one given none, so it never takes another's GPU)."""
        return any(any(h.gpus_per_daemon.values()) for h in self.hosts) or \
            any(any(p.gpus_per_daemon.values()) for p in self.pools)

    @model_validator(mode="after")
    def _complete(self) -> PlacementSection:
        names = [h.name for h in self.hosts]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise fail(f"duplicate host name(s): {', '.join(map(repr, dups))}")
        pools = [p.name for p in self.pools]
        dup_pools = sorted({n for n in pools if pools.count(n) > 1})
        if dup_pools:
            raise fail(f"duplicate pool name(s): {', '.join(map(repr, dup_pools))}")
        fallback = [i for i, p in enumerate(self.pools) if not p.labels]
        if fallback and fallback[0] != len(self.pools) - 1:
            raise fail(f"pool {self.pools[fallback[0]].name!r} has no labels, so it matches every host "
                       "and the pools after it are never used: put the fallback pool last")
        totals = {role: sum(h.roles.get(role, 0) for h in self.hosts) for role in ROLES}
        missing = [role for role, n in totals.items() if n < 1]
        if missing:
            raise fail(
                "every role needs at least one instance; none placed for "
                + ", ".join(map(repr, missing))
            )
        return self


