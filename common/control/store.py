"""The control-plane store interface: what daemons may ask of etcd.

Daemon code talks to `Store`, never to an etcd client: values are JSON-able
Python objects, results are immutable snapshots, and every failure to reach the
store is one exception type, `StoreUnavailable`, so losing etcd is an ordinary
branch in a daemon's cycle rather than a crash. The implementation over a real
etcd cluster is `rlfleet.common.control.etcd_store.EtcdStore`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal


class StoreUnavailable(Exception):
    """No endpoint of the store answered in time. Callers retry on their next cycle."""


class LeaseExpired(Exception):
    """The lease is gone (expired or revoked); keys bound to it are deleted."""


@dataclasses.dataclass(frozen=True)
class KeyValue:
    key: str
    value: Any  # decoded JSON
    create_revision: int
    mod_revision: int
    lease_id: int = 0


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: Any  # decoded JSON, None for deletes
    revision: int


@dataclasses.dataclass(frozen=True)
class Lease:
    id: int
    ttl_s: int


@dataclasses.dataclass(frozen=True)
class LeaseInfo:
    """A lease as etcd sees it, read without refreshing it."""
    remaining_s: int           # -1 once the lease is gone (expired or revoked)
    granted_s: int             # the TTL it was granted with (0 once gone)
    keys: frozenset[str] = frozenset()  # the keys bound to it now


def apply_event(table: dict[str, KeyValue], event: WatchEvent) -> None:
    """Keep `table` (key -> KeyValue, as a get_prefix read them) current with one watch
    event. An event no newer than what the table holds is skipped: a watch started
    before the read replays older events, which must not step a key back."""
    known = table.get(event.key)
    if known is not None and event.revision <= known.mod_revision:
        return
    if event.kind == "delete":
        table.pop(event.key, None)
    else:
        table[event.key] = KeyValue(event.key, event.value, known.create_revision if known else event.revision,
                                    event.revision)


class Watch(abc.ABC):
    """An event stream over a key prefix that survives store restarts.

    Iterating yields events in revision order with no gaps: after a broken
    stream the watch re-subscribes from the revision after the last one it
    delivered.
    """

    @abc.abstractmethod
    def get(self, timeout: float | None = None) -> WatchEvent | None:
        """Next event, or None after `timeout` seconds without one."""

    @abc.abstractmethod
    def cancel(self) -> None: ...

    @property
    @abc.abstractmethod
    def last_revision(self) -> int: ...

    def __iter__(self) -> Iterator[WatchEvent]:
        while True:
            event = self.get(timeout=None)
            if event is None:
                return
            yield event


class Store(abc.ABC):
    """Key-value store with leases, watches, CAS and elections (etcd v3 semantics)."""

    # -- plain keys -------------------------------------------------------
    @abc.abstractmethod
    def get(self, key: str) -> KeyValue | None: ...

    @abc.abstractmethod
    def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    @abc.abstractmethod
    def leases_under(self, prefix: str) -> dict[str, int]:
        """key -> the lease it is bound to (0: none), for every key under `prefix`: one
        keys-only read, values left in etcd (a liveness sweep needs no values)."""

    @abc.abstractmethod
    def put(self, key: str, value: Any, lease: Lease | None = None) -> int:
        """Write `value` as JSON; returns the new revision."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int: ...

    @abc.abstractmethod
    def compare_and_swap(self, key: str, expected_mod_revision: int, value: Any,
                         lease: Lease | None = None) -> bool:
        """Write only if the key's mod revision is still `expected_mod_revision`
        (0: only if the key does not exist). False means someone else wrote first."""

    @abc.abstractmethod
    def swap(self, key: str, expected_mod_revision: int, value: Any,
             lease: Lease | None = None) -> tuple[bool, KeyValue | None]:
        """`compare_and_swap` that also says where the key stands, in one round trip:
        (True, the KeyValue just written) or (False, the key as it is now, None if absent).
        A writer that keeps the returned KeyValue can swap again at its mod_revision
        without reading first (one request per update instead of a read and a swap)."""

    @abc.abstractmethod
    def put_owned(self, key: str, value: Any, lease: Lease) -> tuple[bool, KeyValue | None]:
        """Overwrite `key` only while it is bound to `lease` (a key this lease holder
        wrote and still owns), in one round trip: (True, None), or (False, the key as
        it is now, None if absent). Never creates the key: claim an absent key with
        `swap(key, 0, value, lease)`, so a writer never takes over someone else's key."""

    def put_all(self, values: dict[str, Any], expected_mod_revisions: dict[str, int]) -> bool:
        """Put every value (no lease) in one transaction, only if each key of
        `expected_mod_revisions` still has that mod revision (0: absent); False: none written."""
        raise NotImplementedError

    @abc.abstractmethod
    def revision(self) -> int:
        """The store's current revision."""

    # -- leases -------------------------------------------------------------
    @abc.abstractmethod
    def grant_lease(self, ttl_s: int) -> Lease: ...

    @abc.abstractmethod
    def refresh_lease(self, lease: Lease) -> int:
        """Keep the lease alive; returns its remaining TTL. Raises LeaseExpired."""

    @abc.abstractmethod
    def revoke_lease(self, lease: Lease) -> None: ...

    @abc.abstractmethod
    def lease_remaining(self, lease_id: int) -> int:
        """Seconds left on a lease without refreshing it; -1 once it is gone."""

    @abc.abstractmethod
    def lease_info(self, lease_id: int) -> LeaseInfo:
        """Remaining and granted TTL of a lease and the keys bound to it, in one read
        (no refresh): how a holder checks that its keys are all still there."""

    # -- watches ------------------------------------------------------------
    @abc.abstractmethod
    def watch_prefix(self, prefix: str, start_revision: int | None = None) -> Watch: ...

    # -- elections ------------------------------------------------------------
    def campaign(self, key: str, value: Any, lease: Lease) -> bool:
        """Try to become leader: a create-only put of `key` bound to `lease`.

        True if we hold it now (just created, or already ours from an earlier
        cycle). The key disappears with the lease, which is what hands
        leadership to a standby when a leader dies.

        A read first: while the key exists (every cycle but the hand-over) it
        answers for holder and standby alike, and a read is no raft proposal,
        where a create-only transaction is one (a WAL write and an fsync) even
        when its comparison fails.
        """
        current = self.get(key)
        if current is None:
            won, current = self.swap(key, 0, value, lease=lease)
            if won:
                return True
        return current is not None and current.lease_id == lease.id

    def resign(self, key: str, lease: Lease) -> bool:
        """Give up leadership if we hold it (delete only our own key)."""
        current = self.get(key)
        if current is None or current.lease_id != lease.id:
            return False
        return self.compare_and_swap_delete(key, current.mod_revision)

    @abc.abstractmethod
    def compare_and_swap_delete(self, key: str, expected_mod_revision: int) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
