"""Records of the live-fleet keys: what operators ask of the job and its hosts, and
what the resource-manager decided about them (docs/operations/live-fleet.md).

    state                 JobState     running | paused (`rlfleet pause` / `resume`) | stopped (`rlfleet stop` / `start`)
    node_state/<host>     NodeState    cordoned | draining | drained | removed (`rlfleet node ...`)
    admitted/<host>       Admission    the pool a host the spec does not name was admitted into
    switchover/<role>     Switchover   a requested leadership handover (`rlfleet switchover`)

Parsed like every other value (common/control/records.py): a malformed value never
raises; its record carries a `problem` and the field keeps its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rlfleet.common.control import keys as names
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.records import _Fields, _KeyRecord
from rlfleet.common.control.store import KeyValue, Store

RUNNING, PAUSED, STOPPED = "running", "paused", "stopped"
JOB_STATES = (RUNNING, PAUSED, STOPPED)

# A host's life in a job, as the operator asks it (absent: schedulable).
CORDONED = "cordoned"   # keep what runs there, place nothing new
DRAINING = "draining"   # stop what runs there without losing work; drained when nothing is left
DRAINED = "drained"     # nothing of the job runs there; uncordon places work again
REMOVED = "removed"     # out of the job: never admitted again until `rlfleet node add`
NODE_STATES = (CORDONED, DRAINING, DRAINED, REMOVED)
UNPLACED_STATES = (DRAINING, DRAINED, REMOVED)  # hosts that get no placement at all


@dataclass(frozen=True)
class JobState(_KeyRecord):
    """`state`: running; paused for maintenance (agents stop restarting and re-placing,
    the trainer stops at a step boundary and checkpoints); or stopped (agents stop what
    they run and start nothing, across their own restarts and the hosts' reboots)."""

    KEY: ClassVar[str] = "state"

    state: str = RUNNING
    since: float = 0.0
    by: str = ""
    reason: str = ""
    problem: str = ""

    @classmethod
    def parse(cls, value: Any) -> JobState:
        f = _Fields(value, names.STATE)
        state = f.str("state", RUNNING, required=True)
        if state not in JOB_STATES:
            f.problems.append(f"{names.STATE}.state: expected one of {', '.join(JOB_STATES)}, got {state!r}")
            state = RUNNING
        return cls(state, f.float("since"), f.str("by"), f.str("reason"), f.problem)

    @property
    def paused(self) -> bool:
        return self.state == PAUSED

    @property
    def stopped(self) -> bool:
        return self.state == STOPPED

    def to_value(self) -> dict[str, Any]:
        return {"state": self.state, "since": self.since, "by": self.by, "reason": self.reason}


def job_paused(store: Store, keys: JobKeys) -> bool:
    """Whether the job is paused (one read; StoreUnavailable propagates)."""
    record = JobState.read(store, keys)
    return record is not None and record.paused


@dataclass(frozen=True)
class NodeState:
    """`node_state/<host>`: what the operator asked of a host. The resource-manager moves
    `draining` to `drained` (a compare-and-swap on `mod_revision`) once nothing of the job
    runs there."""

    host: str
    state: str = CORDONED
    since: float = 0.0
    by: str = ""
    reason: str = ""
    mod_revision: int = 0
    problem: str = ""

    @classmethod
    def parse(cls, host: str, value: Any, mod_revision: int = 0) -> NodeState:
        where = f"{names.NODE_STATE}/{host}"
        f = _Fields(value, where)
        state = f.str("state", CORDONED, required=True)
        if state not in NODE_STATES:
            # Unknown intent: the safe reading is "place nothing new here".
            f.problems.append(f"{where}.state: expected one of {', '.join(NODE_STATES)}, got {state!r}")
            state = CORDONED
        return cls(host, state, f.float("since"), f.str("by"), f.str("reason"), mod_revision, f.problem)

    @classmethod
    def from_kv(cls, keys: JobKeys, kv: KeyValue) -> NodeState:
        return cls.parse(keys.parse_node_state(kv.key), kv.value, kv.mod_revision)

    @property
    def placeable(self) -> bool:
        """Whether the job's daemons may stay placed on this host."""
        return self.state not in UNPLACED_STATES

    def to_value(self) -> dict[str, Any]:
        return {"state": self.state, "since": self.since, "by": self.by, "reason": self.reason}


@dataclass(frozen=True)
class Admission:
    """`admitted/<host>`: a host the spec does not name, admitted by the resource-manager
    into one of the spec's `[[placement.pools]]`."""

    host: str
    pool: str = ""
    since: float = 0.0
    labels: Any = None  # the labels it was admitted with (for operators)
    problem: str = ""

    @classmethod
    def parse(cls, host: str, value: Any) -> Admission:
        f = _Fields(value, f"{names.ADMITTED}/{host}")
        return cls(host, f.str("pool", required=True), f.float("since"), dict(f.str_map("labels")), f.problem)

    @classmethod
    def from_kv(cls, keys: JobKeys, kv: KeyValue) -> Admission:
        return cls.parse(keys.parse_admitted(kv.key), kv.value)

    def to_value(self) -> dict[str, Any]:
        return {"pool": self.pool, "since": self.since, "labels": dict(self.labels or {})}


@dataclass(frozen=True)
class Switchover:
    """`switchover/<role>`: hand the role's leadership to member `to`. Bound to a short
    lease of the requesting command, so a request nobody acted on expires by itself."""

    role: str
    to: str = ""
    from_: str = ""
    by: str = ""
    at: float = 0.0
    problem: str = ""

    @classmethod
    def parse(cls, role: str, value: Any) -> Switchover:
        f = _Fields(value, f"{names.SWITCHOVER}/{role}")
        return cls(role, f.str("to", required=True), f.str("from"), f.str("by"), f.float("at"), f.problem)

    @classmethod
    def from_kv(cls, keys: JobKeys, kv: KeyValue) -> Switchover:
        return cls.parse(keys.parse_switchover(kv.key), kv.value)

    def to_value(self) -> dict[str, Any]:
        return {"to": self.to, "from": self.from_, "by": self.by, "at": self.at}
