"""A daemon's presence in etcd: one lease, its member key, and (for singleton
roles) its claim on leadership — all bound to that one lease (Patroni's lease
discipline), so a dead daemon disappears from etcd by itself.

`Session.step()` is called once per daemon cycle and returns a sentence saying
what it did; losing etcd is an ordinary outcome ("etcd unreachable …"), not an
exception.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.keys import JobKeys
from rlfleet.common.store import Lease, LeaseExpired, Store, StoreUnavailable

log = logging.getLogger("rlfleet.session")


@dataclass
class Session:
    store: Store
    keys: JobKeys
    role: str
    member_id: str
    ttl_s: float
    elect: bool = False  # singleton role: campaign for /leader/<role>
    lease: Lease | None = None
    is_leader: bool = False
    degraded: bool = False
    lease_grants: int = 0
    _published: dict[str, Any] | None = None
    _leader_since: float = 0.0
    extra_keys: dict[str, Any] = field(default_factory=dict)  # more lease-bound keys (e.g. node inventory)
    # A newcomer waits one TTL before its first campaign, so the standbys that
    # were already waiting take over from a dead leader first, and a leader in a
    # crash loop cannot grab leadership back on every restart.
    campaign_after: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.campaign_after = time.monotonic() + self.ttl_s

    @property
    def member_key(self) -> str:
        return self.keys.member(self.role, self.member_id)

    @property
    def leader_key(self) -> str:
        return self.keys.leader(self.role)

    def step(self, member_value: dict[str, Any]) -> list[str]:
        """Keep the registration (and leadership) alive; returns what changed."""
        said: list[str] = []
        try:
            if self.lease is not None:
                try:
                    self.store.refresh_lease(self.lease)
                except LeaseExpired:
                    said.append(f"lease {self.lease.id:x} expired")
                    self.lease, self._published = None, None
                    if self.is_leader:
                        said.append(f"lost leadership of {self.role}")
                        self.is_leader = False
            if self.lease is None:
                self.lease = self.store.grant_lease(self.ttl_s)
                self.lease_grants += 1
                said.append(f"registered as {self.role}/{self.member_id} with lease {self.lease.id:x}")
                for key, value in self.extra_keys.items():
                    self.store.put(key, value, lease=self.lease)
            if self.elect and time.monotonic() >= self.campaign_after:
                said += self._campaign()
            value = {**member_value, "leader": self.is_leader, "lease": f"{self.lease.id:x}"}
            if value != self._published:
                self.store.put(self.member_key, value, lease=self.lease)
                self._published = value
            if self.degraded:
                said.insert(0, "etcd reachable again")
                self.degraded = False
        except StoreUnavailable as exc:
            if not self.degraded:
                said.append(f"etcd unreachable, degraded, keeping local work: {exc}")
            self.degraded = True
            # Leadership we cannot renew may already have passed to a standby:
            # stop acting as leader until etcd confirms it again.
            if self.is_leader:
                said.append(f"stepped down as {self.role} leader (cannot renew)")
                self.is_leader = False
        return said

    def _campaign(self) -> list[str]:
        assert self.lease is not None
        value = {"id": self.member_id, "since": self._leader_since or time.time()}
        holds = self.store.campaign(self.leader_key, value, self.lease)
        if holds and not self.is_leader:
            self.is_leader, self._leader_since = True, value["since"]
            return [f"became {self.role} leader"]
        if not holds and self.is_leader:
            self.is_leader = False
            return [f"lost leadership of {self.role}"]
        return []

    def put_lease_bound(self, key: str, value: Any) -> None:
        """A key that lives and dies with this daemon (re-written on re-registration)."""
        self.extra_keys[key] = value
        if self.lease is not None:
            self.store.put(key, value, lease=self.lease)

    def close(self) -> str:
        """Deregister at once: resign, delete the member key, revoke the lease."""
        if self.lease is None:
            return "no registration to remove"
        try:
            if self.is_leader:
                self.store.resign(self.leader_key, self.lease)
            self.store.delete(self.member_key)
            self.store.revoke_lease(self.lease)
            return f"deregistered {self.role}/{self.member_id}"
        except StoreUnavailable as exc:
            # The lease will expire on its own within the TTL.
            return f"could not deregister (etcd unreachable: {exc}); lease expires by itself"
        finally:
            self.lease, self.is_leader = None, False
