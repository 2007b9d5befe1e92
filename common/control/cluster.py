"""The whole job as etcd holds it, in one immutable snapshot (Patroni's `Cluster`).

`Cluster.read(store, job)` is one range read of `/rlfleet/<job>/`, so every
record in it comes from the same store revision; each value is parsed once
into its record (common/control/records.py). Tools (`rlfleet status`, the live view,
the supervisor) ask it questions — `cluster.members("rollout")`,
`cluster.leader("trainer")`, `cluster.weights` — instead of reading keys.
Keys under the job that name nothing (a member key with an extra component, a
value of the wrong shape) are listed in `problems`, never raised.

Daemons whose loop needs one kind of record read just that prefix and parse
it with the same constructors (`members.members_from`, `TrainerProgress.parse`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import Leader, Member, Node, Placement
from rlfleet.common.control.operations import Admission, JobState, NodeState, Switchover
from rlfleet.common.control.records import (
    Checkpoint,
    PromptCursor,
    RelayChain,
    RelayLayoutRequest,
    RelayMaster,
    TrainerProgress,
    WeightsLatest,
)
from rlfleet.common.control.store import KeyValue, Store
from rlfleet.common.spec.job import JobSpec, parse_spec

_NO_LEADERS: Mapping[str, Leader] = MappingProxyType({})
_NO_NODES: Mapping[str, Node] = MappingProxyType({})
# Cluster field -> the record kept under one fixed key of the job.
_SINGLE_RECORDS = {"weights": WeightsLatest, "relay_chain": RelayChain, "relay_master": RelayMaster,
                   "progress": TrainerProgress, "checkpoint": Checkpoint, "cursor": PromptCursor,
                   "state": JobState}
# Cluster field -> the record kept per host or role under a prefix (common/control/operations.py).
_KEYED_RECORDS = {"node_states": ("node_states_prefix", NodeState), "admissions": ("admitted_prefix", Admission),
                  "switchovers": ("switchovers_prefix", Switchover)}


@dataclass(frozen=True)
class Cluster:
    job: str
    taken_at: float
    all_members: tuple[Member, ...] = ()          # sorted by (role, id)
    leaders: Mapping[str, Leader] = field(default_factory=lambda: _NO_LEADERS)  # role -> leader
    nodes: Mapping[str, Node] = field(default_factory=lambda: _NO_NODES)  # host -> inventory
    placement: tuple[Placement, ...] = ()         # sorted by (host, role, id)
    weights: WeightsLatest | None = None
    relay_chain: RelayChain | None = None
    relay_master: RelayMaster | None = None
    relay_layouts: tuple[RelayLayoutRequest, ...] = ()
    progress: TrainerProgress | None = None
    checkpoint: Checkpoint | None = None
    cursor: PromptCursor | None = None
    state: JobState | None = None                 # None: never paused (running)
    node_states: Mapping[str, NodeState] = field(default_factory=lambda: _NO_NODES)  # host -> operator intent
    admissions: Mapping[str, Admission] = field(default_factory=lambda: _NO_NODES)   # host -> pool admission
    switchovers: Mapping[str, Switchover] = field(default_factory=lambda: _NO_NODES)  # role -> request
    has_spec: bool = False
    problems: tuple[str, ...] = ()                # malformed values and keys that name nothing

    # -- questions ------------------------------------------------------------
    def members(self, role: str | None = None) -> tuple[Member, ...]:
        return self.all_members if role is None else tuple(m for m in self.all_members if m.role == role)

    def member(self, role: str, member_id: str) -> Member | None:
        return next((m for m in self.all_members if m.role == role and m.id == member_id), None)

    def leader(self, role: str) -> Leader | None:
        return self.leaders.get(role)

    @property
    def paused(self) -> bool:
        return self.state is not None and self.state.paused

    def leader_member(self, role: str) -> Member | None:
        """The registration of the elected member of `role`, if both exist."""
        lead = self.leaders.get(role)
        return None if lead is None else self.member(role, lead.id)

    # -- building -------------------------------------------------------------
    @classmethod
    def read(cls, store: Store, job: str) -> Cluster:
        """One range read of the job's keys. StoreUnavailable propagates."""
        keys = JobKeys(job)
        return cls.from_kvs(keys, store.get_prefix(keys.prefix))

    @classmethod
    def from_kvs(cls, keys: JobKeys, kvs: list[KeyValue], taken_at: float | None = None) -> Cluster:
        members, placement, layouts, problems = [], [], [], []
        leaders: dict[str, Leader] = {}
        nodes: dict[str, Node] = {}
        single: dict[str, Any] = {}
        keyed: dict[str, dict[str, Any]] = {name: {} for name in _KEYED_RECORDS}
        keyed_prefixes = [(getattr(keys, prefix), name, kind) for name, (prefix, kind) in _KEYED_RECORDS.items()]
        has_spec = False
        single_keys = {getattr(keys, record.KEY): (name, record) for name, record in _SINGLE_RECORDS.items()}
        for kv in kvs:
            try:
                if kv.key == keys.spec:
                    has_spec = True
                    continue
                if kv.key.startswith(keys.members_prefix):
                    record = Member.from_kv(keys, kv)
                    members.append(record)
                elif kv.key.startswith(keys.leaders_prefix):
                    record = Leader.from_kv(keys, kv)
                    leaders[record.role] = record
                elif kv.key.startswith(keys.nodes_prefix):
                    record = Node.from_kv(keys, kv)
                    nodes[record.host] = record
                elif kv.key.startswith(keys.placement_prefix):
                    record = Placement.from_kv(keys, kv)
                    placement.append(record)
                elif kv.key.startswith(keys.relay_layouts_prefix):
                    record = RelayLayoutRequest.from_kv(keys, kv)
                    layouts.append(record)
                elif (hit := next((k for k in keyed_prefixes if kv.key.startswith(k[0])), None)) is not None:
                    _, name, kind = hit
                    record = kind.from_kv(keys, kv)
                    keyed[name][kv.key.removeprefix(hit[0])] = record
                elif kv.key in single_keys:
                    name, kind = single_keys[kv.key]
                    record = kind.from_kv(kv)
                    single[name] = record
                else:
                    continue  # a key this version does not know (newer daemons, owner, state...)
            except ValueError as exc:
                problems.append(f"skipped {kv.key}: {exc}")
                continue
            if record.problem:
                problems.append(record.problem)
        return cls(keys.job, time.time() if taken_at is None else taken_at,
                   all_members=tuple(sorted(members, key=lambda m: (m.role, m.id))),
                   leaders=MappingProxyType(leaders), nodes=MappingProxyType(nodes),
                   placement=tuple(sorted(placement)), relay_layouts=tuple(layouts),
                   has_spec=has_spec, problems=tuple(problems),
                   **{name: MappingProxyType(records) for name, records in keyed.items()}, **single)


def read_spec(store: Store, keys: JobKeys) -> JobSpec | None:
    """The job spec stored at `spec`, validated (SpecError if it no longer validates);
    None if no spec was submitted. StoreUnavailable propagates."""
    kv = store.get(keys.spec)
    if kv is None:
        return None
    return parse_spec(kv.value, source=f"etcd:{keys.spec}")
