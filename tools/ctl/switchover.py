"""`rlfleet switchover ROLE --to ID`: hand a singleton's leadership to a named standby
(after `patronictl switchover`; docs/operations/switchover.md).

The command checks the target the way `rlfleet status` judges a member (its record says
`running`, its process is not dead or stopped, its lease is refreshed), writes
`switchover/<role>` bound to a short lease of its own, and watches `leader/<role>` until
it names the target. The leader and its standbys do the rest (common/control/session.py). The
lease is kept while the command waits; a request nobody acts on expires by itself
max(10 s, 3 x lease TTL) after the command stops refreshing it.
"""

from __future__ import annotations

import getpass
import json
import math
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import click

from rlfleet.tools.ctl.etcd_options import _fail_unreachable, _pick_job, _store, etcd_option, job_name
from rlfleet.tools.exit_codes import Exit

REQUEST_LEASE_MIN_S = 10  # the request's lease: at least this, and three of the job's lease TTLs


class Refused(Exception):
    """The target cannot take leadership now; the message says why (exit 9)."""


@dataclass
class Outcome:
    code: Exit
    message: str
    role: str
    to: str
    from_: str = ""
    elapsed_s: float | None = None
    vacant_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "from": self.from_, "to": self.to, "ok": self.code == Exit.OK,
                "exit": int(self.code), "message": self.message, "elapsed_s": self.elapsed_s,
                "vacant_s": self.vacant_s}


@click.command("switchover")
@click.argument("role")
@click.option("--to", "target", required=True, metavar="ID", help="The standby member id to hand leadership to.")
@click.option("--job", callback=job_name, default=None, help="Job name (default: the only job in etcd).")
@etcd_option
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds to wait for the target to lead (the trainer checkpoints first).")
@click.option("--output", type=click.Choice(["text", "json"]), default="text", show_default=True)
def switchover(role: str, target: str, job: str | None, etcd: str, timeout_s: float, output: str) -> None:
    """Hand the leadership of a singleton ROLE (resource-manager, repack-manager, trainer)
    to the standby --to, with the leader key vacant far less than one lease TTL.

    Exit 0 once leader/ROLE names the target; 9 refused (no leader, the target is not a
    healthy standby of ROLE, or a switchover is pending); 10 not done within --timeout
    (the request stays until its lease expires); 2 bad usage; 3 etcd unreachable."""
    from rlfleet.common.control.store import StoreUnavailable
    from rlfleet.common.spec.placement import SINGLETON_ROLES

    if role not in SINGLETON_ROLES:
        raise click.BadParameter(f"{role!r} is not a singleton role (one of {', '.join(SINGLETON_ROLES)})",
                                 param_hint="ROLE")
    store = _store(etcd)
    current = ""
    try:
        job = _pick_job(store, job)
        current, ttl_s = _check(store, job, role, target)
        outcome = _request_and_wait(store, job, role, target, current, ttl_s, timeout_s)
    except Refused as exc:
        outcome = Outcome(Exit.REFUSED, f"refused: {exc}", role, target, current)
    except StoreUnavailable as exc:
        _fail_unreachable(exc, etcd)
    if output == "json":
        click.echo(json.dumps(outcome.to_json()))
    elif outcome.code == Exit.OK:
        click.echo(outcome.message)
    if outcome.code != Exit.OK:
        click.echo(f"rlfleet switchover: {outcome.message}", err=True)
    sys.exit(int(outcome.code))


def _check(store, job: str, role: str, target: str) -> tuple[str, float]:
    """The current leader and the job's lease TTL, or Refused: the target must be a
    registered, healthy, non-leading member of the role, and no other request pending."""
    from rlfleet.tools.ctl.fleet_view import take_snapshot

    snap = take_snapshot(store, job, check_leases=True)
    assert snap.cluster is not None
    members = {m.member_id: m for m in snap.members if m.role == role}
    leader = snap.leaders.get(role, "")
    standbys = sorted(i for i, m in members.items() if i != leader and m.healthy and m.state == "running")
    if not leader:
        raise Refused(f"{role} has no leader now: nothing to switch over (its standbys campaign by themselves)")
    if target == leader:
        raise Refused(f"{target} is already the {role} leader")
    if target not in members:
        raise Refused(f"{target} is not a registered {role} member; healthy standbys: {', '.join(standbys) or 'none'}")
    m = members[target]
    if m.state != "running":
        raise Refused(f"{role} {target} is not a healthy standby: its member record says {m.state!r}")
    if not m.healthy:
        raise Refused(f"{role} {target} is not a healthy standby: {m.health}")
    pending = snap.cluster.switchovers.get(role)
    if pending is not None:
        raise Refused(f"a switchover of {role} to {pending.to or '?'} is already pending (requested by "
                      f"{pending.by or '?'} {max(0.0, time.time() - pending.at):.0f} s ago); it ends when done "
                      "or when its lease expires")
    return leader, _spec_ttl(store, job)


def _spec_ttl(store, job: str) -> float:
    """The job's lease TTL (the daemons' cycle is a third of it); a missing or invalid spec
    gives the shortest request lease's third."""
    from rlfleet.common.control.cluster import read_spec
    from rlfleet.common.control.keys import JobKeys
    from rlfleet.common.spec.errors import SpecError

    try:
        spec = read_spec(store, JobKeys(job))
    except SpecError:
        spec = None
    return spec.etcd.lease_ttl_s if spec is not None else REQUEST_LEASE_MIN_S / 3


def _request_and_wait(store, job: str, role: str, target: str, leader: str, ttl_s: float,
                      timeout_s: float) -> Outcome:
    """Write the request under its own lease, then watch leader/<role> until it names the
    target. The vacancy is timed from the leader key's delete to its create by the target,
    as this command receives the watch's events."""
    from rlfleet.common.control.keys import JobKeys
    from rlfleet.common.control.members import Leader
    from rlfleet.common.control.operations import Switchover

    keys = JobKeys(job)
    request = Switchover(role, to=target, from_=leader, by=f"{getpass.getuser()}@{socket.gethostname()}",
                         at=time.time())
    lease = store.grant_lease(max(REQUEST_LEASE_MIN_S, math.ceil(3 * ttl_s)))
    start = time.monotonic()
    won, current = store.swap(keys.switchover(role), 0, request.to_value(), lease=lease)
    if not won:
        store.revoke_lease(lease)
        other = Switchover.from_kv(keys, current).to if current is not None else "?"
        raise Refused(f"a switchover of {role} to {other} is already pending")
    assert current is not None
    watch = store.watch_prefix(keys.leader(role), start_revision=current.mod_revision)
    vacant_at: float | None = None
    refreshed = checked = start
    try:
        while (now := time.monotonic()) - start < timeout_s:
            if now - refreshed >= lease.ttl_s / 3:
                store.refresh_lease(lease)
                refreshed = now
            if now - checked >= ttl_s / 3:
                checked = now
                if store.get(keys.member(role, target)) is None:
                    store.revoke_lease(lease)  # withdrawn: any standby may lead again at once
                    return Outcome(Exit.FAILURE, f"{role} {target} deregistered before taking over; request "
                                   "withdrawn", role, target, leader, now - start)
            event = watch.get(timeout=0.05)
            if event is None or event.key != keys.leader(role):
                continue
            if event.kind == "delete":
                vacant_at = vacant_at or time.monotonic()
                continue
            done = time.monotonic()  # when the put arrived; who made it is read now (values are parsed in common/)
            kv = store.get(keys.leader(role))
            holder = Leader.from_kv(keys, kv).id if kv is not None else leader
            if holder == target:
                vacant_s = done - vacant_at if vacant_at is not None else 0.0
                store.revoke_lease(lease)  # the target deleted the request already
                return Outcome(Exit.OK, f"{role} leadership: {leader} -> {target} in {done - start:.2f} s "
                               f"(leader key vacant {vacant_s:.3f} s)", role, target, leader,
                               round(done - start, 3), round(vacant_s, 3))
            if holder != leader:
                store.revoke_lease(lease)
                return Outcome(Exit.FAILURE, f"{role} leadership went to {holder}, not {target}; request "
                               "withdrawn", role, target, leader, time.monotonic() - start)
    finally:
        watch.cancel()
    return Outcome(Exit.TIMED_OUT, f"{role} leadership not handed to {target} within {timeout_s:g} s; the "
                   f"request stays in effect until its lease expires ({lease.ttl_s} s)", role, target, leader,
                   round(time.monotonic() - start, 3))
