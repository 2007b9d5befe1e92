"""Typed, immutable records of who is in the job: `members/<role>/<id>`,
`leader/<role>`, `nodes/<host>`, `placement/<host>/<role>/<id>` (Patroni's
Member and Leader). Parsed like every record (common/control/records.py): never an
exception for a malformed value, a `problem` sentence instead.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rlfleet.common.control import keys as names
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import _Fields, _no_fields, _short, freeze, thaw
from rlfleet.common.control.store import KeyValue

# Fields every daemon writes into its registration (common/daemon.py, common/control/session.py).
MEMBER_FIELDS = frozenset({"id", "role", "host", "pid", "state", "leader", "lease", "addresses", "metrics", "started",
                           "boot_id", "pid_start", "pid_ns", "incarnation"})

# Role fields (each daemon's `member_info()`) whose type is checked; others are kept as they are.
ROLE_FIELDS: Mapping[str, Mapping[str, tuple[type, ...]]] = MappingProxyType({
    "relay": {"shm_dir": (str,), "transport": (str,), "newest": (int,), "newest_at": (int, float),
              "first_version_at": (int, float), "versions": (list,), "successor": (str,), "master": (bool,)},
    "trainer": {"training": (str,), "version": (int,), "checkpoint_version": (int,), "paused": (bool,),
                "checkpoint_error": (str,), "journal_error": (str,),  # these two: docs/operations/disk-full.md
                "non_finite_groups": (int,), "non_finite_steps": (int,), "non_finite": (str,),
                "rewinds": (int,)},  # trainer/guard.py
    "rollout": {"weight_version": (int,), "first_weights_at": (int, float), "first_weights_version": (int,),
                "first_result_at": (int, float), "relay": (str,)},
    "resource-manager": {"waiting_hosts": (dict,)},
    "env-host": {"in_flight": (int,), "claimed": (int,), "done": (int,), "first_done_at": (int, float),
                 "claim_limit": (int,), "error": (str,)},
    "reward-host": {"in_flight": (int,), "scored": (int,), "reward_errors": (int,), "stages": (dict,)},
    "repack-manager": {"rollouts": (int,), "versions": (list,)},
    "agent": {"backend": (str,)},  # a host's node agent (daemons/agent/), not a job role
})


@dataclass(frozen=True)
class Member:
    """A live daemon: `members/<role>/<id>`. Role and id come from the key (where it is
    registered); `info` holds the role's own fields, read-only, type-checked per ROLE_FIELDS."""

    role: str
    id: str
    host: str = ""
    pid: int = 0
    state: str = ""
    leader: bool = False       # what the daemon believes; `leader/<role>` is the election itself
    lease: str = ""            # the lease id in hex, as the daemon wrote it
    lease_id: int = 0          # the lease the key is bound to in etcd (0: none)
    addresses: Mapping[str, str] = _no_fields()
    metrics: str = ""
    started: float = 0.0
    info: Mapping[str, Any] = _no_fields()
    problem: str = ""
    boot_id: str = ""          # the machine's boot id (common/procs.py): where the pid can be checked
    pid_start: int = 0         # the process's start time in ticks since boot (tells a reused pid apart)
    pid_ns: int = 0            # its pid namespace: with the boot id, where the pid means this process
    incarnation: str = ""      # the `rlfleet run` that started it (its owner key), "" if started by hand

    @classmethod
    def parse(cls, role: str, member_id: str, value: Any, lease_id: int = 0) -> Member:
        f = _Fields(value, f"{names.MEMBERS}/{role}/{member_id}")
        if f.value.get("id") not in (None, member_id):
            f.problems.append(f"{f.where}.id: {_short(f.value['id'])} differs from the key")
        info: dict[str, Any] = {}
        schema = ROLE_FIELDS.get(role, {})
        for name, v in f.value.items():
            if name in MEMBER_FIELDS:
                continue
            kinds = schema.get(name)
            if kinds is not None and v is not None and (not isinstance(v, kinds) or
                                                        (isinstance(v, bool) and bool not in kinds)):
                f.problems.append(f"{f.where}.{name}: expected {'/'.join(k.__name__ for k in kinds)}, got {_short(v)}")
                continue
            info[str(name)] = freeze(v)
        identity = {"boot_id": f.str("boot_id"), "pid_start": f.int("pid_start"), "pid_ns": f.int("pid_ns"),
                    "incarnation": f.str("incarnation")}
        return cls(role, member_id, f.str("host"), f.int("pid"), f.str("state"), f.bool("leader"),
                   f.str("lease"), lease_id, f.str_map("addresses"), f.str("metrics"), f.float("started"),
                   MappingProxyType(info), f.problem, **identity)

    @classmethod
    def from_kv(cls, keys: JobKeys, kv: KeyValue) -> Member:
        """ValueError if the key is not a member key of this job (the value never raises)."""
        role, member_id = keys.parse_member(kv.key)
        return cls.parse(role, member_id, kv.value, kv.lease_id)

    @property
    def running(self) -> bool:
        return self.state == "running"

    def address(self, name: str) -> str | None:
        """The named data-plane endpoint it serves, or None."""
        return self.addresses.get(name) or None

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "id": self.id, "host": self.host, "pid": self.pid, "state": self.state,
                "leader": self.leader, "lease": self.lease, "addresses": dict(self.addresses),
                "metrics": self.metrics, "started": self.started, **thaw(self.info),
                **({"incarnation": self.incarnation} if self.incarnation else {}),
                **({"problem": self.problem} if self.problem else {})}


def members_from(keys: JobKeys, kvs: list[KeyValue]) -> list[Member]:
    """Members of `get_prefix(members...)` results; keys that are no member key are skipped
    (they cannot name a daemon; `Cluster` reports them)."""
    out = []
    for kv in kvs:
        try:
            out.append(Member.from_kv(keys, kv))
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class RelayMember:
    """A relay's registration, with its role fields typed (relay/topology, relay/status)."""

    id: str
    host: str
    address: str           # its chunk endpoint
    shm_dir: str
    newest: int            # newest complete unsharded version, -1 if none
    state: str
    started: float
    newest_at: float | None = None
    versions: tuple[tuple[int, int], ...] = ()   # complete (version, layout) pairs
    successor: str | None = None
    master: bool = False

    @classmethod
    def of(cls, m: Member) -> RelayMember:
        newest, newest_at = m.info.get("newest"), m.info.get("newest_at")
        versions = tuple((v[0], v[1]) for v in m.info.get("versions", ())
                         if isinstance(v, tuple) and len(v) == 2 and all(type(x) is int for x in v))
        successor = m.info.get("successor")
        return cls(m.id, m.host, m.address("chunks") or "", str(m.info.get("shm_dir", "")),
                   newest if isinstance(newest, int) else -1, m.state, m.started,
                   float(newest_at) if isinstance(newest_at, (int, float)) else None, versions,
                   successor if isinstance(successor, str) else None, m.info.get("master") is True)


@dataclass(frozen=True)
class Leader:
    """`leader/<role>`: the elected member of a singleton role."""

    role: str
    id: str = ""
    since: float = 0.0
    lease_id: int = 0
    problem: str = ""
    handover_to: str = ""  # the standby this leader resigns to next (`rlfleet switchover`)

    @classmethod
    def parse(cls, role: str, value: Any, lease_id: int = 0) -> Leader:
        f = _Fields(value, f"{names.LEADER}/{role}")
        return cls(role, f.str("id", required=True), f.float("since"), lease_id, f.problem, f.str("handover_to"))

    @classmethod
    def from_kv(cls, keys: JobKeys, kv: KeyValue) -> Leader:
        return cls.parse(keys.parse_leader(kv.key), kv.value, kv.lease_id)


@dataclass(frozen=True)
class Owner:
    """`owner`: the `rlfleet run` (one incarnation) that runs the job, bound to its lease."""

    incarnation: str
    host: str = ""
    pid: int = 0
    boot_id: str = ""
    pid_start: int = 0
    started: float = 0.0
    lease_id: int = 0
    problem: str = ""
    pid_ns: int = 0

    @classmethod
    def parse(cls, value: Any, lease_id: int = 0) -> Owner:
        f = _Fields(value, names.OWNER)
        fields = (f.str("incarnation", required=True), f.str("host"), f.int("pid"), f.str("boot_id"),
                  f.int("pid_start"), f.float("started"))
        return cls(*fields, lease_id=lease_id, problem=f.problem, pid_ns=f.int("pid_ns"))

    @classmethod
    def from_kv(cls, kv: KeyValue) -> Owner:
        return cls.parse(kv.value, kv.lease_id)

    def to_value(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, "host": self.host, "pid": self.pid, "boot_id": self.boot_id,
                "pid_start": self.pid_start, "pid_ns": self.pid_ns, "started": self.started}

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "?"
        return f"incarnation {self.incarnation} (pid {self.pid} on {self.host or '?'}, started {since})"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_bytes: int


@dataclass(frozen=True)
class NodeDaemon:
    """One placed daemon as its host's agent reports it (`nodes/<host>.daemons.<id>`)."""

    id: str
    role: str = ""
    state: str = ""        # running | waiting (to be restarted) | held (down while paused) | stopping
    restarts: int = 0
    last_exit: str = ""
    failing: bool = False  # it keeps dying: N deaths within the agent's window

    def to_value(self) -> dict[str, Any]:
        return {"role": self.role, "state": self.state, "restarts": self.restarts, "last_exit": self.last_exit,
                "failing": self.failing}


@dataclass(frozen=True)
class Node:
    """`nodes/<host>`: a machine as its node agent (daemons/agent/) records it: inventory,
    labels, the agent's own process and backend, and the daemons it runs there. Bound
    to the agent's lease (in `rlfleet run`, to the run's owner lease)."""

    host: str
    cpus_logical: int = 0
    cpus_physical: int = 0
    memory_bytes: int = 0
    memory_available_bytes: int = 0
    gpus: tuple[Gpu, ...] = ()
    boot_time: float = 0.0
    seen: float = 0.0
    problem: str = ""
    labels: Mapping[str, str] = _no_fields()
    agent: Mapping[str, Any] = _no_fields()  # pid, boot_id, pid_start, backend, metrics
    daemons: tuple[NodeDaemon, ...] = ()
    paused: bool = False  # its agent saw the job paused: it observes only

    @classmethod
    def parse(cls, host: str, value: Any) -> Node:
        f = _Fields(value, f"{names.NODES}/{host}")
        gpus = []
        for i, g in enumerate(f.list("gpus")):
            gf = _Fields(g, f"{names.NODES}/{host}.gpus[{i}]")
            gpus.append(Gpu(gf.int("index", i), gf.str("name", "?"), gf.int("memory_bytes")))
            f.problems += gf.problems
        daemons = []
        raw = f.value.get("daemons")
        for member_id, d in sorted(raw.items()) if isinstance(raw, Mapping) else ():
            df = _Fields(d, f"{names.NODES}/{host}.daemons.{member_id}")
            daemons.append(NodeDaemon(str(member_id), df.str("role"), df.str("state"), df.int("restarts"),
                                      df.str("last_exit"), df.bool("failing")))
            f.problems += df.problems
        agent, labels, paused = f.value.get("agent"), f.str_map("labels"), f.bool("paused")
        inventory = (f.int("cpus_logical"), f.int("cpus_physical"), f.int("memory_bytes"),
                     f.int("memory_available_bytes"), tuple(gpus), f.float("boot_time"), f.float("seen"))
        return cls(host, *inventory, f.problem, labels,  # the problem once every field was read
                   MappingProxyType(dict(agent) if isinstance(agent, Mapping) else {}), tuple(daemons), paused)

    @classmethod
    def from_kv(cls, keys: JobKeys, kv: KeyValue) -> Node:
        return cls.parse(keys.parse_node(kv.key), kv.value)

    @property
    def failing(self) -> tuple[NodeDaemon, ...]:
        return tuple(d for d in self.daemons if d.failing)

    @property
    def registered(self) -> float:
        """When this agent first wrote the record (wall time; 0.0: unknown). An agent older
        than the field took its inventory (`seen`) just before it."""
        at = self.agent.get("registered")
        return float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else self.seen

    def to_value(self) -> dict[str, Any]:
        """The record as the agent writes it (daemons/agent/policy.py node_value)."""
        return {"host": self.host, "cpus_logical": self.cpus_logical, "cpus_physical": self.cpus_physical,
                "memory_bytes": self.memory_bytes, "memory_available_bytes": self.memory_available_bytes,
                "gpus": [{"index": g.index, "name": g.name, "memory_bytes": g.memory_bytes} for g in self.gpus],
                "boot_time": self.boot_time, "seen": self.seen, "labels": dict(self.labels),
                "agent": thaw(self.agent), "daemons": {d.id: d.to_value() for d in self.daemons},
                **({"paused": True} if self.paused else {})}


@dataclass(frozen=True, order=True)
class Placement:
    """`placement/<host>/<role>/<id>`: one daemon that should run on a machine. The key
    says which; the value repeats it for `etcdctl` readers and must agree, and says
    `since` when the resource-manager placed it (`rlfleet node add` reports from it)."""

    host: str
    role: str
    id: str
    problem: str = ""
    since: float = field(default=0.0, compare=False)  # wall time; 0.0: not said (placed by hand)
    gpus: tuple[int, ...] | None = None  # the host's GPU indices it is given (None: the job assigns none)

    @classmethod
    def from_kv(cls, keys: JobKeys, kv: KeyValue) -> Placement:
        host, role, member_id = keys.parse_placement(kv.key)
        placed = cls(host, role, member_id)
        value = dict(kv.value) if isinstance(kv.value, Mapping) else kv.value
        since = value.pop("since", 0.0) if isinstance(value, dict) else 0.0
        gpus = value.pop("gpus", None) if isinstance(value, dict) else None
        where = f"{names.PLACEMENT}/{host}/{role}/{member_id}"
        if value != placed.to_value() or not isinstance(since, (int, float)) or isinstance(since, bool):
            return cls(host, role, member_id, f"{where}: value {_short(kv.value)} does not repeat the key")
        if gpus is not None and not (isinstance(gpus, list) and all(
                isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus)):
            return cls(host, role, member_id, f"{where}: gpus {_short(gpus)} is not a list of GPU indices")
        return cls(host, role, member_id, since=float(since), gpus=None if gpus is None else tuple(gpus))

    def to_value(self) -> dict[str, Any]:
        return {"host": self.host, "role": self.role, "id": self.id, **({"since": self.since} if self.since else {}),
                **({"gpus": list(self.gpus)} if self.gpus is not None else {})}


def placements_from(keys: JobKeys, kvs: list[KeyValue]) -> list[Placement]:
    """Placements of `get_prefix(placement...)` results; keys that name no daemon (a
    component too many or too few) are skipped, as in `members_from`."""
    out = []
    for kv in kvs:
        try:
            out.append(Placement.from_kv(keys, kv))
        except ValueError:
            continue
    return out
