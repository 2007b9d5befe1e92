"""The chain's shape, derived from etcd the same way by every relay.

Order: the elected master first, then every other live, running relay sorted
by id (natural order: relay-2 before relay-10). Every relay computes it from
the same two facts (relay member registrations, the master key), so no relay
waits for anyone to write a chain; the master also writes the order it sees to
`relay/chain` for operators and `rlfleet status`.

Master election: a create-only put of `relay/master` bound to the relay's
lease (Store.campaign). Only relays holding the newest complete version any
live relay holds may campaign, so a new master never starts the chain from an
older version than a survivor has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.keys import JobKeys
from rlfleet.common.store import Store


def relay_master_key(keys: JobKeys) -> str:
    # Falls back to spelling the key here until common/keys.py grows `relay_master`.
    return getattr(keys, "relay_master", None) or f"{keys.prefix}relay/master"


def relay_layouts_prefix(keys: JobKeys) -> str:
    return getattr(keys, "relay_layouts_prefix", None) or f"{keys.prefix}relay/layouts/"


def relay_prefix(keys: JobKeys) -> str:
    return f"{keys.prefix}relay/"


def natural_key(s: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


@dataclass(frozen=True)
class RelayMember:
    id: str
    host: str
    address: str
    shm_dir: str
    newest: int            # newest complete unsharded version, -1 if none
    state: str
    started: float
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ChainView:
    master: str | None
    order: tuple[str, ...]
    members: dict[str, RelayMember]
    layouts: frozenset[int] = frozenset()

    def successor(self, me: str, skip: frozenset[str] | set[str] = frozenset()) -> str | None:
        if me not in self.order:
            return None
        for other in self.order[self.order.index(me) + 1:]:
            if other not in skip:
                return other
        return None

    def predecessor(self, me: str) -> str | None:
        if me not in self.order or self.order.index(me) == 0:
            return None
        return self.order[self.order.index(me) - 1]

    def eligible_master(self, me: str, my_newest: int) -> bool:
        """May `me` campaign? Only with the newest complete version any live relay has."""
        best = max((m.newest for m in self.members.values() if m.state == "running"), default=-1)
        return my_newest >= best

    def to_json(self) -> dict[str, Any]:
        return {"master": self.master, "order": list(self.order)}


def parse_members(keys: JobKeys, kvs: list[Any]) -> dict[str, RelayMember]:
    out = {}
    for kv in kvs:
        v = kv.value if isinstance(kv.value, dict) else {}
        mid = kv.key.rsplit("/", 1)[-1]
        addr = (v.get("addresses") or {}).get("chunks", "")
        newest = v.get("newest")
        out[mid] = RelayMember(mid, str(v.get("host", "")), str(addr), str(v.get("shm_dir", "")),
                               newest if isinstance(newest, int) else -1, str(v.get("state", "")),
                               float(v.get("started", 0) or 0), v)
    return out


def derive(master: str | None, members: dict[str, RelayMember], layouts: frozenset[int] = frozenset()) -> ChainView:
    live = sorted((m for m in members if members[m].state == "running" and members[m].address), key=natural_key)
    order = ([master] if master in live else []) + [m for m in live if m != master]
    return ChainView(master if master in live else None, tuple(order), members, layouts)


def read_chain(store: Store, keys: JobKeys) -> ChainView:
    """One consistent-enough look at etcd (three reads; the watch corrects any race)."""
    members = parse_members(keys, store.get_prefix(keys.role_members_prefix("relay")))
    kv = store.get(relay_master_key(keys))
    master = (kv.value or {}).get("id") if kv is not None and isinstance(kv.value, dict) else None
    layouts = set()
    for lkv in store.get_prefix(relay_layouts_prefix(keys)):
        lay = (lkv.value or {}).get("layout") if isinstance(lkv.value, dict) else None
        if isinstance(lay, int) and lay > 1:
            layouts.add(lay)
    return derive(master, members, frozenset(layouts))
