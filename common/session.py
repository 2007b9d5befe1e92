"""A daemon's presence in etcd: one lease, its member key, and (for singleton
roles) its claim on leadership — all bound to that one lease (Patroni's lease
discipline), so a dead daemon disappears from etcd by itself.

`Session.step()` is called once per daemon cycle and returns a sentence saying
what it did; losing etcd is an ordinary outcome ("etcd unreachable …"), not an
exception.

A role that sets ``failsafe`` (the trainer) does not throw its leader's work away
when etcd stops answering (docs/failsafe.md, after Patroni's failsafe mode): it
loses the *authority* of a leader at once (``is_leader`` False: nothing that needs
it, such as publishing or checkpointing, happens) but keeps ``failsafe_since`` set,
and its local work goes on. When etcd answers again the session decides, from the
leader key and ``term/<role>``, whether anybody else led meanwhile: if not, the same
reign continues (``reign`` unchanged, in-memory state kept); if so, it was
superseded, and its in-memory state must be discarded. ``term`` (the leader key's
create revision, strictly increasing over takeovers) is the fencing token that a
leader's writes carry.
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
    failsafe: bool = False  # keep a leader's local work through an etcd outage (see above)
    failsafe_since: float | None = None  # monotonic time a failsafe leader lost etcd; None: not
    term: int = 0  # the leader key's create revision while we hold it: the fencing token
    reign: int = 0  # the term our leadership began with; kept by a failsafe that continues
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
                    if self.is_leader and self.failsafe:
                        # Someone may have taken over meanwhile; the campaign below finds out.
                        self.is_leader, self.failsafe_since = False, time.monotonic()
                        said.append(f"failsafe: {self.role} leadership unconfirmed (term {self.term})")
                    elif self.is_leader:
                        said.append(f"lost leadership of {self.role}")
                        self.is_leader, self.term = False, 0
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
                self.is_leader = False
                if self.failsafe:
                    # Nobody can take the leader key without a quorum, and one who can
                    # is found out when etcd answers (_take_office): keep the work.
                    self.failsafe_since = time.monotonic()
                    said.append(f"failsafe: {self.role} leadership unconfirmed (term {self.term}), "
                                "keeping in-memory state, holding back what needs a leader")
                else:
                    said.append(f"stepped down as {self.role} leader (cannot renew)")
        return said

    @property
    def term_key(self) -> str:
        return self.keys.term(self.role)

    def _take_office(self) -> list[str]:
        """We hold the leader key and were not the confirmed leader: fix our term, and for
        a failsafe role decide whether our reign continues (nobody else led since our last
        term) before acting as leader. A failsafe leader writes its term to term/<role>
        before it does anything a leader does, so a term record that still names our last
        term proves nobody else led in between."""
        assert self.lease is not None
        kv = self.store.get(self.leader_key)
        if kv is None or kv.lease_id != self.lease.id:
            return []  # gone again: the next cycle campaigns anew
        term, since = kv.create_revision, self._leader_since or time.time()
        continues = False
        if self.failsafe:
            record = self.store.get(self.term_key)
            last = record.value if record is not None and isinstance(record.value, dict) else {}
            continues = (self.failsafe_since is not None and last.get("id") == self.member_id
                         and last.get("term") == self.term)
            reign = self.reign if continues else term
            if last.get("term") != term:
                won, _ = self.store.swap(self.term_key, record.mod_revision if record else 0,
                                         {"term": term, "reign": reign, "id": self.member_id,
                                          "since": since})
                if not won:
                    return []  # raced with another writer: decide again next cycle
        said = []
        if continues:
            said.append(f"{self.role} leadership confirmed after {time.monotonic() - self.failsafe_since:.1f} s "
                        f"in failsafe: nobody else led, continuing from in-memory state "
                        f"(term {self.term} -> {term})")
        else:
            if self.failsafe_since is not None:
                said.append(f"another {self.role} led during the outage: in-memory state superseded")
            said.append(f"became {self.role} leader (term {term})")
            self.reign = term
        self.is_leader, self._leader_since, self.term, self.failsafe_since = True, since, term, None
        return said

    def _campaign(self) -> list[str]:
        assert self.lease is not None
        value = {"id": self.member_id, "since": self._leader_since or time.time()}
        holds = self.store.campaign(self.leader_key, value, self.lease)
        if holds and not self.is_leader:
            return self._take_office()
        if not holds and self.failsafe_since is not None:
            # Another daemon holds the key: it took over while we could not renew.
            self.failsafe_since, self.term = None, 0
            return [f"superseded as {self.role} leader during the outage: fenced, "
                    "discarding in-memory state"]
        if not holds and self.is_leader:
            self.is_leader, self.term = False, 0
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
