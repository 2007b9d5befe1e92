"""One `rlfleet run` per job: the owner key, and the supervisor's check that each of
its daemons still holds a live registration.

`JobOwner` holds `/rlfleet/<job>/owner` for this run: created only if absent and
bound to a lease the supervisor's loop refreshes, so a second `rlfleet run` of a
live job is refused (naming the owner), a dead run frees the key within its TTL,
and `--take-over` replaces a live owner by compare-and-swap (the old run notices
at its next refresh and stops its daemons). An owner whose process this machine
can prove dead (common/procs.py) is replaced at once.

`RegistrationCheck` finds children whose registration expired while their
process still exists: a SIGSTOPed process, or a main loop stalled longer than
the TTL (the lease is refreshed only by the daemon's loop, common/control/session.py).
It costs one keys-only read of the members prefix per check (every TTL/3).
"""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass

from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import Member, Owner
from rlfleet.common.control.store import Lease, LeaseExpired, Store
from rlfleet.common.procs import ProcessId


class JobOwned(Exception):
    """Another live `rlfleet run` owns the job; the message names it."""


class JobOwner:
    def __init__(self, store: Store, keys: JobKeys, ttl_s: float) -> None:
        self.store, self.keys, self.ttl_s = store, keys, ttl_s
        me = ProcessId.current()
        self.me = Owner(uuid.uuid4().hex[:12], socket.gethostname(), me.pid, me.boot_id, me.start, time.time(),
                    pid_ns=me.pid_ns)
        self.lease: Lease | None = None
        self._refreshed_at = 0.0

    @property
    def incarnation(self) -> str:
        return self.me.incarnation

    def claim(self, take_over: bool = False) -> str:
        """Become the owner, or raise JobOwned. Returns what happened, as a sentence."""
        self.lease = self.store.grant_lease(self.ttl_s)
        self._refreshed_at = time.monotonic()
        try:
            return self._claim(take_over)
        except BaseException:
            self.store.revoke_lease(self.lease)
            self.lease = None
            raise

    def _claim(self, take_over: bool) -> str:
        assert self.lease is not None
        said = ""
        for _ in range(2):
            won, current = self.store.swap(self.keys.owner, 0, self.me.to_value(), lease=self.lease)
            if won:
                return said + f"owner of job {self.keys.job}: {self.me.describe()}"
            assert current is not None
            holder = Owner.from_kv(current)
            state = ProcessId(holder.boot_id, holder.pid, holder.pid_start, holder.pid_ns).state() if holder.pid else "remote"
            if state in ("dead", "zombie"):
                # Its lease would keep the key for up to a TTL after a kill -9.
                if current.lease_id:
                    self.store.revoke_lease(Lease(current.lease_id, 0))
                else:
                    self.store.compare_and_swap_delete(self.keys.owner, current.mod_revision)
                said = f"the previous owner {holder.describe()} is dead; "
                continue
            if take_over:
                won, _ = self.store.swap(self.keys.owner, current.mod_revision, self.me.to_value(), lease=self.lease)
                if won:
                    return f"took job {self.keys.job} over from {holder.describe()}"
            raise JobOwned(f"job {self.keys.job!r} is already being run by {holder.describe()}, "
                           f"which holds {self.keys.owner}; stop that run first, or pass --take-over to replace it")
        raise JobOwned(f"job {self.keys.job!r}: could not claim {self.keys.owner} (it keeps changing)")

    def keep(self) -> str | None:
        """Called from the supervisor's loop: refresh the lease every TTL/3 and check the
        key is still ours. Returns why this run lost the job (taken over), else None.
        StoreUnavailable propagates (the caller retries at its next pass)."""
        if self.lease is None or time.monotonic() - self._refreshed_at < self.ttl_s / 3:
            return None
        self._refreshed_at = time.monotonic()
        try:
            self.store.refresh_lease(self.lease)
        except LeaseExpired:
            self.lease = self.store.grant_lease(self.ttl_s)  # this loop stalled, or etcd was away
        current = self.store.get(self.keys.owner)  # a read: no raft write while all is well
        if current is None:  # expired with our stalled lease, or deleted by hand: ours again if free
            won, current = self.store.swap(self.keys.owner, 0, self.me.to_value(), lease=self.lease)
            if won:
                return None
        holder = Owner.from_kv(current)
        if holder.incarnation == self.incarnation:
            return None
        return f"taken over by {holder.describe()}"

    def release(self) -> None:
        """Give the job up (the lease deletes the key only if it is still ours)."""
        if self.lease is not None:
            self.store.revoke_lease(self.lease)
            self.lease = None


@dataclass
class _Tracked:
    pid: int
    lease_id: int = 0              # the lease its registration was seen under (0: not yet)
    lost_at: float | None = None   # when its lease was first found gone with the process alive


class RegistrationCheck:
    """Children whose registration expired while their process still runs.

    One keys-only read of the members prefix per check, whatever the number of
    children; a `get` when a child's key shows a lease it has not seen for that pid,
    and a lease read only when a key is missing (deleted by hand while the lease
    lives: the daemon writes it back itself; expired: the process is replaced)."""

    def __init__(self, store: Store, keys: JobKeys, ttl_s: float) -> None:
        self.store, self.keys, self.ttl_s = store, keys, ttl_s
        self._tracked: dict[str, _Tracked] = {}

    def lost(self, children: list[tuple[str, str, int]]) -> list[tuple[int, str]]:
        """(role, member id, pid) of each running child -> [(pid, why it must be replaced)].
        StoreUnavailable propagates: with etcd away no registration says anything."""
        now = time.monotonic()
        leases = self.store.leases_under(self.keys.members_prefix)
        out = []
        for role, member_id, pid in children:
            key = self.keys.member(role, member_id)
            t = self._tracked.get(member_id)
            if t is None or t.pid != pid:
                t = self._tracked[member_id] = _Tracked(pid)
            lease_id = leases.get(key)
            if lease_id is not None and lease_id == t.lease_id:
                t.lost_at = None
                continue
            if lease_id is not None:  # a registration we have not seen: this pid's, or a predecessor's?
                kv = self.store.get(key)
                if kv is not None and Member.from_kv(self.keys, kv).pid == pid:
                    t.lease_id, t.lost_at = kv.lease_id, None
                    continue
            if not t.lease_id or self.store.lease_remaining(t.lease_id) > 0:
                continue  # still starting up (or waiting for its key to be free), or deleted by hand
            state = ProcessId.local(pid).state()
            if state == "stopped":
                out.append((pid, f"stopped (SIGSTOP?) and its registration (lease {t.lease_id:x}) expired"))
            elif state == "running":
                if t.lost_at is None:
                    t.lost_at = now  # a loop that recovers registers again within a cycle or two
                elif now - t.lost_at >= self.ttl_s:
                    out.append((pid, f"its main loop stalled: registration (lease {t.lease_id:x}) expired and "
                                     f"not renewed for {now - t.lost_at:.1f} s"))
        return out
