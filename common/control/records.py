"""Typed, immutable records of the values under a job's etcd keys (Patroni's
Member/Leader): every value is parsed once, here, and daemons and tools read
attributes — never `kv.value`.

Membership records (members, leaders, nodes, placement) are in
common/control/members.py; the whole job at once is common/control/cluster.py.

Parsing never raises on a malformed value. A value that is not a JSON object,
or a field of the wrong type, yields a record with that field's default and a
`problem` sentence naming the key and the field: one bad write (an operator's
`etcdctl put`, an older version of a daemon) must not crash another daemon's
loop, and `rlfleet status` shows what is wrong instead of a traceback. Each
consumer decides what a record with a problem is still good for (an address
that parsed is usable even when `pid` did not). Keys come from
`common/control/keys.py`; the values are described in docs/operations/etcd-keys.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar, Self

from rlfleet.common.control import keys as names
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.store import KeyValue, Store

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _no_fields() -> Any:
    # A mappingproxy is unhashable, so dataclasses want it from a factory.
    return field(default_factory=lambda: _EMPTY)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def freeze(v: Any) -> Any:
    """A read-only deep copy of decoded JSON: objects become mappingproxies, lists tuples."""
    if isinstance(v, Mapping):
        return MappingProxyType({str(k): freeze(x) for k, x in v.items()})
    if isinstance(v, (list, tuple)):
        return tuple(freeze(x) for x in v)
    return v


def thaw(v: Any) -> Any:
    """The inverse of `freeze`, for JSON output."""
    if isinstance(v, Mapping):
        return {k: thaw(x) for k, x in v.items()}
    if isinstance(v, tuple):
        return [thaw(x) for x in v]
    return v


class _Fields:
    """Reads typed fields out of one JSON object, collecting what is wrong with it.

    A field that is absent or null gets its default (daemons omit what they do not
    know yet); only a present field of the wrong type is a problem. bool is never
    taken for a number (JSON true is not 1 here).
    """

    def __init__(self, value: Any, where: str) -> None:
        self.where = where
        self.problems: list[str] = []
        if isinstance(value, Mapping):
            self.value: Mapping[str, Any] = value
        else:
            self.value = _EMPTY
            self.problems.append(f"{where}: expected a JSON object, got {_short(value)}")

    def _get(self, name: str, kinds: tuple[type, ...], default: Any, what: str, required: bool) -> Any:
        v = self.value.get(name)
        if v is None:
            if required and self.value is not _EMPTY:
                self.problems.append(f"{self.where}.{name}: missing")
            return default
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            self.problems.append(f"{self.where}.{name}: expected {what}, got {_short(v)}")
            return default
        return v

    def str(self, name: str, default: str = "", required: bool = False) -> str:
        return self._get(name, (str,), default, "a string", required)

    def opt_str(self, name: str) -> str | None:
        return self._get(name, (str,), None, "a string", False)

    def int(self, name: str, default: int = 0, required: bool = False) -> int:
        return self._get(name, (int,), default, "an integer", required)

    def opt_int(self, name: str) -> int | None:
        return self._get(name, (int,), None, "an integer", False)

    def float(self, name: str, default: float = 0.0, required: bool = False) -> float:
        return float(self._get(name, (int, float), default, "a number", required))

    def opt_float(self, name: str) -> float | None:
        v = self._get(name, (int, float), None, "a number", False)
        return None if v is None else float(v)

    def bool(self, name: str, default: bool = False) -> bool:
        return self._get(name, (bool,), default, "true or false", False)

    def str_map(self, name: str) -> Mapping[str, str]:
        raw = self._get(name, (Mapping,), _EMPTY, "an object", False)
        bad = [k for k, v in raw.items() if not isinstance(v, str)]
        if bad:
            self.problems.append(f"{self.where}.{name}.{bad[0]}: expected a string, got {_short(raw[bad[0]])}")
        return MappingProxyType({str(k): v for k, v in raw.items() if isinstance(v, str)})

    def list(self, name: str) -> tuple[Any, ...]:
        return freeze(self._get(name, (list,), [], "a list", False))

    @property
    def problem(self) -> str:
        return "; ".join(self.problems)


class _KeyRecord:
    """A record stored under one fixed key of the job (`KEY` names the JobKeys property)."""

    KEY: ClassVar[str] = ""

    @classmethod
    def parse(cls, value: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def from_kv(cls, kv: KeyValue) -> Self:
        return cls.parse(kv.value)

    @classmethod
    def read(cls, store: Store, keys: JobKeys) -> Self | None:
        """The record at its key, or None if the key does not exist. StoreUnavailable propagates."""
        kv = store.get(getattr(keys, cls.KEY))
        return None if kv is None else cls.from_kv(kv)


# -- weights and the relay chain ----------------------------------------------------------

@dataclass(frozen=True)
class WeightsLatest(_KeyRecord):
    """`weights/latest`: the newest version a master relay holds whole (never moves back)."""

    KEY: ClassVar[str] = "weights_latest"

    version: int = -1
    bytes: int = 0
    checksum: str = ""
    master: str = ""
    term: int = 0  # the publishing trainer leader's fencing term (docs/operations/failsafe.md); 0: none
    problem: str = ""

    @classmethod
    def parse(cls, value: Any) -> WeightsLatest:
        f = _Fields(value, names.WEIGHTS_LATEST)
        return cls(f.int("version", -1, required=True), f.int("bytes"), f.str("checksum"), f.str("master"),
                   f.int("term"), f.problem)

    def to_value(self) -> dict[str, Any]:
        value = {"version": self.version, "bytes": self.bytes, "checksum": self.checksum, "master": self.master}
        return {**value, "term": self.term} if self.term else value  # an unfenced publisher: no term


@dataclass(frozen=True)
class RelayChain(_KeyRecord):
    """`relay/chain`: the order the master relay sees, written for operators."""

    KEY: ClassVar[str] = "relay_chain"

    master: str | None = None
    order: tuple[str, ...] = ()
    layouts: tuple[int, ...] = ()
    updated: float | None = None
    problem: str = ""

    @classmethod
    def parse(cls, value: Any) -> RelayChain:
        f = _Fields(value, names.RELAY_CHAIN)
        order = f.list("order")
        layouts = f.list("layouts")
        if not all(isinstance(x, str) for x in order):
            f.problems.append(f"{names.RELAY_CHAIN}.order: expected relay ids, got {_short(thaw(order))}")
        if not all(type(x) is int for x in layouts):
            f.problems.append(f"{names.RELAY_CHAIN}.layouts: expected integers, got {_short(thaw(layouts))}")
        return cls(f.opt_str("master"), tuple(x for x in order if isinstance(x, str)),
                   tuple(x for x in layouts if type(x) is int), f.opt_float("updated"), f.problem)

    def to_value(self) -> dict[str, Any]:
        return {"master": self.master, "order": list(self.order), "layouts": list(self.layouts),
                "updated": self.updated}


@dataclass(frozen=True)
class RelayMaster(_KeyRecord):
    """`relay/master`: the elected master relay (bound to its lease) and the newest
    complete version it holds, kept current while it is master."""

    KEY: ClassVar[str] = "relay_master"

    id: str = ""
    since: float = 0.0
    newest: int | None = None
    lease_id: int = 0       # the master's lease: the key disappears with it
    mod_revision: int = 0   # for a compare-and-swap update by the master itself
    problem: str = ""

    @classmethod
    def parse(cls, value: Any, lease_id: int = 0, mod_revision: int = 0) -> RelayMaster:
        f = _Fields(value, names.RELAY_MASTER)
        return cls(f.str("id", required=True), f.float("since"), f.opt_int("newest"), lease_id, mod_revision,
                   f.problem)

    @classmethod
    def from_kv(cls, kv: KeyValue) -> RelayMaster:
        return cls.parse(kv.value, kv.lease_id, kv.mod_revision)

    def to_value(self) -> dict[str, Any]:
        return {"id": self.id, "since": self.since, "newest": self.newest}


@dataclass(frozen=True)
class RelayLayoutRequest:
    """`relay/layouts/tp<k>`: a reader asked the master for a k-way sharded copy."""

    layout: int = 0
    requested_by: str = ""
    at: float = 0.0
    problem: str = ""

    @classmethod
    def parse(cls, value: Any, key: str = names.RELAY_LAYOUTS) -> RelayLayoutRequest:
        f = _Fields(value, key)
        return cls(f.int("layout", required=True), f.str("requested_by"), f.float("at"), f.problem)

    @classmethod
    def from_kv(cls, keys: JobKeys, kv: KeyValue) -> RelayLayoutRequest:
        return cls.parse(kv.value, kv.key.removeprefix(keys.prefix))

    @classmethod
    def read_all(cls, store: Store, keys: JobKeys) -> list[RelayLayoutRequest]:
        return [cls.from_kv(keys, kv) for kv in store.get_prefix(keys.relay_layouts_prefix)]

    def to_value(self) -> dict[str, Any]:
        return {"layout": self.layout, "requested_by": self.requested_by, "at": self.at}


# -- trainer and prompts ------------------------------------------------------------------

@dataclass(frozen=True)
class TrainerProgress(_KeyRecord):
    """`trainer/progress`: groups trained or dropped, job-wide (env-hosts pace claims by it)."""

    KEY: ClassVar[str] = "trainer_progress"

    version: int = 0
    consumed_groups: int = 0   # trained + dropped; 0 when malformed: never more claims than honest
    trained_groups: int = 0
    dropped_groups: int = 0
    time: float = 0.0
    problem: str = ""
    received_groups: int = 0  # consumed + complete and waiting (one_step_off starts batches by it)

    @classmethod
    def parse(cls, value: Any) -> TrainerProgress:
        f = _Fields(value, names.TRAINER_PROGRESS)
        consumed = f.int("consumed_groups", required=True)
        return cls(f.int("version"), max(0, consumed), f.int("trained_groups"), f.int("dropped_groups"),
                   f.float("time"), f.problem, max(0, f.int("received_groups")))


@dataclass(frozen=True)
class RepackPlan(_KeyRecord):
    """`repack/plan`: the repack-manager's last plan; a new leader re-sends the orders of
    one still "executing" (orders are idempotent by id)."""

    KEY: ClassVar[str] = "repack_plan"

    id: str = ""
    state: str = ""  # executing | done
    moves: tuple[tuple[str, str], ...] = ()  # (source, destination)
    time: float = 0.0
    problem: str = ""

    @classmethod
    def parse(cls, value: Any) -> RepackPlan:
        f = _Fields(value, names.REPACK_PLAN)
        raw = f.list("moves")
        moves = tuple((m[0], m[1]) for m in raw
                      if isinstance(m, (list, tuple)) and len(m) == 2 and all(isinstance(x, str) for x in m))
        if len(moves) != len(raw):
            f.problems.append(f"{names.REPACK_PLAN}.moves: expected [source, destination] pairs, "
                              f"got {_short(thaw(raw))}")
        return cls(f.str("id", required=True), f.str("state"), moves, f.float("time"), f.problem)

    def to_value(self) -> dict[str, Any]:
        return {"id": self.id, "state": self.state, "moves": [list(m) for m in self.moves],
                "time": self.time}


@dataclass(frozen=True)
class Checkpoint(_KeyRecord):
    """`trainer/checkpoint`: the last checkpoint the trainer leader wrote (advisory: the
    checkpoint folder is the truth)."""

    KEY: ClassVar[str] = "trainer_checkpoint"

    version: int = -1
    path: str = ""
    step: int = 0
    time: float = 0.0
    problem: str = ""

    @classmethod
    def parse(cls, value: Any) -> Checkpoint:
        f = _Fields(value, names.TRAINER_CHECKPOINT)
        return cls(f.int("version", -1, required=True), f.str("path", required=True), f.int("step"),
                   f.float("time"), f.problem)


@dataclass(frozen=True)
class PromptCursor(_KeyRecord):
    """`prompts/cursor`: prompts [0, next) are claimed; `claims` keeps each env-host's
    last ranges (daemons/env_host/claims.py is the protocol that writes it).

    Stricter than the other records: a cursor with any problem must not be
    written over (the claim protocol would lose or repeat prompts), so callers
    refuse to claim while `problem` is set.
    """

    KEY: ClassVar[str] = "prompts_cursor"

    next: int = 0
    claims: Mapping[str, tuple[tuple[int, int], ...]] = _no_fields()
    problem: str = ""
    mod_revision: int = 0   # the claim protocol's compare-and-swap revision (0: no cursor yet)

    @classmethod
    def from_kv(cls, kv: KeyValue) -> PromptCursor:
        return replace(cls.parse(kv.value), mod_revision=kv.mod_revision)

    @classmethod
    def parse(cls, value: Any, key: str = names.PROMPTS_CURSOR) -> PromptCursor:
        if not isinstance(value, Mapping):
            return cls(problem=f"{key}: expected an object {{next, claims}}, got {_short(value)}")
        nxt = value.get("next")
        if type(nxt) is not int or nxt < 0:
            return cls(problem=f"{key}.next: expected an integer >= 0, got {_short(nxt)}")
        claims = value.get("claims", {})
        if not isinstance(claims, Mapping):
            return cls(nxt, problem=f"{key}.claims: expected an object, got {_short(claims)}")
        out = {}
        for owner, ranges in claims.items():
            if not isinstance(ranges, list) or not all(
                    isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
                    and 0 <= r[0] <= r[1] <= nxt for r in ranges):
                return cls(nxt, problem=f"{key}.claims.{owner}: expected [[start, end], ...] within "
                                        f"[0, {nxt}], got {_short(ranges)}")
            out[str(owner)] = tuple((r[0], r[1]) for r in ranges)
        return cls(nxt, MappingProxyType(out))

    def to_value(self) -> dict[str, Any]:
        return {"next": self.next, "claims": {o: [list(r) for r in rs] for o, rs in self.claims.items()}}


__all__ = ["Checkpoint", "PromptCursor", "RelayChain", "RelayLayoutRequest", "RelayMaster", "TrainerProgress",
           "WeightsLatest", "freeze", "thaw"]
