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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import RelayMember, members_from
from rlfleet.common.control.records import RelayLayoutRequest, RelayMaster
from rlfleet.common.control.store import KeyValue, Store, WatchEvent, apply_event

__all__ = ["ChainFollower", "ChainView", "RelayMember", "chain_of", "derive", "natural_key", "parse_members",
           "read_chain"]


def natural_key(s: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


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


def parse_members(keys: JobKeys, kvs: list[KeyValue]) -> dict[str, RelayMember]:
    """{relay id: its typed registration} from `get_prefix(members/relay/)`."""
    return {m.id: RelayMember.of(m) for m in members_from(keys, kvs) if m.role == "relay"}


def derive(master: str | None, members: dict[str, RelayMember], layouts: frozenset[int] = frozenset()) -> ChainView:
    live = sorted((m for m in members if members[m].state == "running" and members[m].address), key=natural_key)
    order = ([master] if master in live else []) + [m for m in live if m != master]
    return ChainView(master if master in live else None, tuple(order), members, layouts)


def chain_of(keys: JobKeys, member_kvs: Iterable[KeyValue], relay_kvs: Iterable[KeyValue]) -> ChainView:
    """The chain from the keys under `members/relay/` and under `relay/` (master, layouts)."""
    master, layouts = None, set()
    for kv in relay_kvs:
        if kv.key == keys.relay_master:
            master = RelayMaster.from_kv(kv)
        elif kv.key.startswith(keys.relay_layouts_prefix):
            req = RelayLayoutRequest.from_kv(keys, kv)
            if req.layout > 1:
                layouts.add(req.layout)
    members = parse_members(keys, list(member_kvs))
    return derive((master.id or None) if master else None, members, frozenset(layouts))


def read_chain(store: Store, keys: JobKeys) -> ChainView:
    """One consistent-enough look at etcd (two reads; the watch corrects any race)."""
    return chain_of(keys, store.get_prefix(keys.role_members_prefix("relay")), store.get_prefix(keys.relay_prefix))


class ChainFollower:
    """The keys `chain_of` needs, kept current from watch events, so a relay re-derives
    the chain on every change without reading etcd (a relay's registration and the
    master's `newest` change with every version). `reload` re-reads them all."""

    def __init__(self, keys: JobKeys) -> None:
        self.keys = keys
        self._members: dict[str, KeyValue] = {}
        self._relay: dict[str, KeyValue] = {}

    def reload(self, store: Store) -> None:
        members = store.get_prefix(self.keys.role_members_prefix("relay"))
        relay = store.get_prefix(self.keys.relay_prefix)
        self._members = {kv.key: kv for kv in members}
        self._relay = {kv.key: kv for kv in relay}

    def apply(self, event: WatchEvent) -> None:
        """One watch event (ones older than what a reload read are skipped)."""
        apply_event(self._relay if event.key.startswith(self.keys.relay_prefix) else self._members, event)

    def chain(self) -> ChainView:
        return chain_of(self.keys, self._members.values(), self._relay.values())
