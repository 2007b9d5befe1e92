"""A daemon's presence in etcd: one lease, its member key, and (for singleton
roles) its claim on leadership — all bound to that one lease (Patroni's lease
discipline), so a dead daemon disappears from etcd by itself.

Ownership: a session writes only keys it owns. A key is claimed by a create-only
put bound to the session's lease and updated by a transaction that holds only
while the key is still bound to that lease (`Store.put_owned`), so two processes
started with the same member id never overwrite each other: the second says who
holds the key and waits (`blocked`), and closing revokes the lease, which deletes
exactly the keys bound to it. The one exception is a predecessor this machine can
prove dead (same boot id, its pid gone: common/procs.py), whose lease is revoked at
once instead of after its TTL. A key that vanished while the lease lives (deleted
by hand) is noticed by reading the lease's key list once a TTL and written again.

The lease is refreshed only here, from the daemon's main loop, never from a
thread of its own: a loop that stalls stops refreshing, its registration expires
within the TTL, and the supervisor replaces the process.

`Session.step()` is called once per daemon cycle and returns a sentence saying
what it did; losing etcd is an ordinary outcome ("etcd unreachable …"), not an
exception.

A role that sets ``failsafe`` (the trainer) does not throw its leader's work away
when etcd stops answering (docs/operations/failsafe.md, after Patroni's failsafe mode): it
loses the *authority* of a leader at once (``is_leader`` False: nothing that needs
it, such as publishing or checkpointing, happens) but keeps ``failsafe_since`` set,
and its local work goes on. When etcd answers again the session decides, from the
leader key and ``term/<role>``, whether anybody else led meanwhile: if not, the same
reign continues (``reign`` unchanged, in-memory state kept); if so, it was
superseded, and its in-memory state must be discarded. ``term`` (the leader key's
create revision, strictly increasing over takeovers) is the fencing token that a
leader's writes carry.

A switchover (`rlfleet switchover`, docs/operations/switchover.md) hands leadership to a named
standby: the leader reads `switchover/<role>` each cycle; when it names another live
member, the leader prepares (``prepare_handover``, the daemon's hook), marks the leader
key with ``handover_to`` (the target, reading that key each cycle anyway, then cycles
fast), and one refresh interval later resigns. While the request stands only its target
campaigns on the vacant key (a candidate reads the request only then), and the target
deletes it once it leads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import Leader
from rlfleet.common.control.operations import Switchover
from rlfleet.common.control.store import KeyValue, Lease, LeaseExpired, Store, StoreUnavailable
from rlfleet.common.control.switchover import DONE, HAND_OVER, leader_action, vacancy_target
from rlfleet.common.procs import ProcessId

log = logging.getLogger("rlfleet.session")

# Cycle period of a standby its leader marked as successor (`rlfleet switchover`): the
# leader key is vacant from the leader's resignation to this standby's next cycle.
HANDOVER_POLL_S = 0.02


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
    # Why the member key is not ours ("" while it is): another live process holds it.
    blocked: str = ""
    _written: set[str] = field(default_factory=set)  # keys written under the current lease
    _refused: set[str] = field(default_factory=set)  # lease-bound keys another process holds
    _refusals: dict[str, str] = field(default_factory=dict)  # what was said about each
    _keys_checked_at: float = 0.0
    # A newcomer waits one TTL before its first campaign, so the standbys that
    # were already waiting take over from a dead leader first, and a leader in a
    # crash loop cannot grab leadership back on every restart.
    campaign_after: float = field(default_factory=time.monotonic)
    # Switchover: the daemon's hook, asked each cycle until it says the leader's work is
    # saved for the successor (`to`); the target we are handing over to; whether a leader
    # marked us as its successor (then the daemon cycles fast, to take over at once).
    prepare_handover: Callable[[str], bool] = lambda to: True
    handover_to: str = ""
    handover_poll: bool = False
    _marked_at: float | None = None
    _said_switchover: str = ""

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
                    self._forget_lease()
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
                self._keys_checked_at = time.monotonic()
                said.append(f"registered as {self.role}/{self.member_id} with lease {self.lease.id:x}")
            elif time.monotonic() - self._keys_checked_at >= self.ttl_s:
                said += self._check_keys()
            # Campaign only as the owner of our member key: a daemon whose key another
            # live process holds is a duplicate and must not lead either. A newcomer only
            # looks (a switchover may name it) until its wait is over.
            if self.elect and not self.blocked and self._published is not None:
                said += self._campaign(newcomer=time.monotonic() < self.campaign_after)
            value = {**member_value, "leader": self.is_leader, "lease": f"{self.lease.id:x}"}
            if value != self._published:
                said += self._publish(self.member_key, value)
                self._published = value if self.member_key in self._written else None
            if self.blocked and self.is_leader:
                self.store.resign(self.leader_key, self.lease)
                self.is_leader = False
                said.append(f"stepped down as {self.role} leader (member key not ours)")
            if not self.blocked:
                for key, extra in self.extra_keys.items():
                    if key not in self._written and key not in self._refused:
                        said += self._publish(key, extra)
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

    # -- keys this session owns ---------------------------------------------------
    def _forget_lease(self) -> None:
        self.lease, self._published, self.blocked = None, None, ""
        self._written.clear()
        self._refused.clear()

    def _publish(self, key: str, value: Any) -> list[str]:
        """Write a key this session owns, or claim it: never overwrite a key bound to
        another live lease. A key we wrote is updated in one transaction that holds
        only while the key is still bound to our lease; a key we have not (or no
        longer) hold is created only if absent."""
        assert self.lease is not None
        if key in self._written:
            ok, current = self.store.put_owned(key, value, self.lease)
            if ok:
                return []
            self._written.discard(key)
            if current is not None:
                return self._foreign(key, current)
            return [f"{key} vanished while lease {self.lease.id:x} lives"] + self._claim(key, value)
        return self._claim(key, value)

    def _claim(self, key: str, value: Any) -> list[str]:
        assert self.lease is not None
        said: list[str] = []
        if self.blocked and key == self.member_key:
            # Still held by someone else? A read answers without a raft write.
            current = self.store.get(key)
            if current is not None and current.lease_id != self.lease.id:
                holder = ProcessId.of(current.value)
                if holder is None or holder.state() not in ("dead", "zombie"):
                    return []
        for _ in range(2):
            won, current = self.store.swap(key, 0, value, lease=self.lease)
            if won:
                self._written.add(key)
                self._refusals.pop(key, None)
                if key == self.member_key and self.blocked:
                    said.append(f"registered {self.role}/{self.member_id}: the key is ours now")
                    self.blocked = ""
                return said
            assert current is not None
            if current.lease_id == self.lease.id:
                self._written.add(key)
                return said + self._publish(key, value)
            holder = ProcessId.of(current.value)
            if holder is None or holder.state() not in ("dead", "zombie"):
                return said + self._foreign(key, current)
            # Our dead predecessor on this machine (a kill -9, then a restart): its lease
            # would hold the key for up to a TTL more. Revoking it removes exactly the
            # keys that process owned (its member key, its leadership, its sub-members).
            if current.lease_id:
                self.store.revoke_lease(Lease(current.lease_id, 0))
            else:
                self.store.compare_and_swap_delete(key, current.mod_revision)
            said.append(f"took over {key} from dead pid {holder.pid} (lease {current.lease_id:x} revoked)")
        return said

    def _foreign(self, key: str, current: KeyValue) -> list[str]:
        """Someone else holds `key`: say so (once) and leave it alone."""
        value = current.value if isinstance(current.value, dict) else {}
        who = (f"pid {value.get('pid', '?')} on {value.get('host', '?')}"
               + (f", incarnation {value['incarnation']}" if value.get("incarnation") else "")
               + f", lease {current.lease_id:x}")
        reason = f"{key} is held by another live process ({who}); not overwriting it"
        if key != self.member_key:
            # Asked again at the next key check, not every cycle; said once, not at every ask
            # (two agents started for one host share its node key: one holds it).
            self._refused.add(key)
            if self._refusals.get(key) == reason:
                return []
            self._refusals[key] = reason
            return [reason]
        said = [reason + "; waiting for it to go"] if self.blocked != reason else []
        self.blocked = reason
        return said

    def _check_keys(self) -> list[str]:
        """Once a TTL: are our keys still bound to our lease? One read (the lease's own key
        list) instead of a read per key; a key deleted by hand is written again now."""
        assert self.lease is not None
        self._keys_checked_at = time.monotonic()
        self._refused.clear()
        bound = self.store.lease_info(self.lease.id).keys
        gone = [key for key in self._written if key not in bound]
        for key in gone:
            self._written.discard(key)
            if key == self.member_key:
                self._published = None
        return [f"{key} vanished while lease {self.lease.id:x} lives; writing it again" for key in sorted(gone)]

    def handover_wait_s(self) -> float | None:
        """Seconds to the cycle a switchover needs next, if sooner than the usual one: the
        leader's resignation a refresh interval after its mark; a marked successor's next
        look at the leader key (HANDOVER_POLL_S: the vacancy lasts until then)."""
        if self._marked_at is not None:
            return max(0.0, self._marked_at + self.ttl_s / 3 - time.monotonic())
        return HANDOVER_POLL_S if self.handover_poll else None

    @property
    def switchover_key(self) -> str:
        return self.keys.switchover(self.role)

    def _campaign(self, newcomer: bool = False) -> list[str]:
        """Store.campaign (a read; a create-only put only on a vacancy), with a standing
        switchover request honoured on a vacancy: only its target may campaign then, as
        long as it is registered (a dead target's request is ignored)."""
        assert self.lease is not None
        said: list[str] = []
        current, request, target = self.store.get(self.leader_key), None, ""
        if current is None:
            request = self.store.get(self.switchover_key)
            target = vacancy_target(Switchover.from_kv(self.keys, request) if request else None)
            if target and target != self.member_id \
                    and self.store.get(self.keys.member(self.role, target)) is not None:
                said += self._say(f"leaving {self.role} leadership to {target} (switchover requested)")
            elif newcomer and not target:
                return []
            elif not newcomer or target == self.member_id:
                _, current = self.store.swap(self.leader_key, 0, self._leader_value(), lease=self.lease)
        holds = current is not None and current.lease_id == self.lease.id
        self.handover_poll = (not holds and current is not None
                              and Leader.from_kv(self.keys, current).handover_to == self.member_id)
        if current is not None and not holds:
            self._said_switchover = ""  # a leader is in place: say the next vacancy's news again
        if holds and not self.is_leader:
            said += self._take_office()
            if self.is_leader and request is not None and target == self.member_id:
                # We took over on a vacancy the request reserved for us: it is done.
                self.store.compare_and_swap_delete(self.switchover_key, request.mod_revision)
                said.append(f"switchover of {self.role} to {self.member_id} done")
            return said
        if holds:
            return said + self._hand_over()
        if self.failsafe_since is not None:
            # Another daemon holds the key: it took over while we could not renew.
            self.failsafe_since, self.term, self.handover_to, self._marked_at = None, 0, "", None
            return said + [f"superseded as {self.role} leader during the outage: fenced, "
                           "discarding in-memory state"]
        if self.is_leader:
            self.is_leader, self.term = False, 0
            self.handover_to, self._marked_at = "", None
            return said + [f"lost leadership of {self.role}"]
        return said

    def _hand_over(self) -> list[str]:
        """The leader's look at `switchover/<role>` (one read a cycle): hand over to the
        member it names once the daemon's work is saved, the leader key marked for the
        target, and a refresh interval passed (the target has read the mark by then)."""
        assert self.lease is not None
        kv = self.store.get(self.switchover_key)
        request = Switchover.from_kv(self.keys, kv) if kv is not None else None
        action = leader_action(request, self.member_id)
        if action == DONE and kv is not None:
            self.store.compare_and_swap_delete(self.switchover_key, kv.mod_revision)
        if action != HAND_OVER or request is None:
            said = [f"switchover of {self.role} to {self.handover_to} withdrawn, staying leader"] \
                if self.handover_to else []
            self._said_switchover = ""
            return said + self._unmark()
        to = request.to
        if self.store.get(self.keys.member(self.role, to)) is None:
            return self._say(f"switchover of {self.role} to {to} not done: no registered {self.role} {to}, "
                             "staying leader") + self._unmark()
        self.handover_to = to
        if not self.prepare_handover(to):
            return self._say(f"switchover of {self.role} to {to}: preparing the handover")
        if self._marked_at is None:
            self.store.put_owned(self.leader_key, {**self._leader_value(), "handover_to": to}, self.lease)
            self._marked_at = time.monotonic()
            return [f"switchover of {self.role} to {to}: ready, resigning in {self.ttl_s / 3:.2g} s"]
        if time.monotonic() - self._marked_at < self.ttl_s / 3:
            return []
        self.store.resign(self.leader_key, self.lease)
        self.is_leader, self.term, self.handover_to, self._marked_at = False, 0, "", None
        return [f"resigned {self.role} leadership to {to} (switchover)"]

    def _unmark(self) -> list[str]:
        """No handover (any more): the leader key loses its mark, and the daemon (seeing
        ``handover_to`` empty) takes up the leader's work again."""
        if self._marked_at is not None and self.lease is not None:
            self.store.put_owned(self.leader_key, self._leader_value(), self.lease)
        self.handover_to, self._marked_at = "", None
        return []

    def _leader_value(self) -> dict[str, Any]:
        return {"id": self.member_id, "since": self._leader_since or time.time()}

    def _say(self, sentence: str) -> list[str]:
        """A switchover sentence once, not every cycle it stays true."""
        if sentence == self._said_switchover:
            return []
        self._said_switchover = sentence
        return [sentence]

    @property
    def registered(self) -> bool:
        """Our member key is in etcd under our lease (written by us, not another's)."""
        return self.lease is not None and not self.blocked and self.member_key in self._written

    def put_lease_bound(self, key: str, value: Any) -> None:
        """A key that lives and dies with this daemon (re-written on re-registration);
        like the member key, only ever written while it is ours or absent."""
        self.extra_keys[key] = value
        if self.lease is not None and not self.blocked:
            for sentence in self._publish(key, value):
                log.warning(sentence)

    def close(self) -> str:
        """Deregister at once: revoking the lease deletes exactly the keys bound to it
        (member key, leadership, sub-members), never a key another process owns."""
        if self.lease is None:
            return "no registration to remove"
        owned = self.member_key in self._written
        try:
            self.store.revoke_lease(self.lease)
            if not owned:
                return f"released lease {self.lease.id:x} ({self.role}/{self.member_id} was never ours)"
            return f"deregistered {self.role}/{self.member_id}"
        except StoreUnavailable as exc:
            # The lease will expire on its own within the TTL.
            return f"could not deregister (etcd unreachable: {exc}); lease expires by itself"
        finally:
            self.lease, self.is_leader = None, False
            self._written.clear()
