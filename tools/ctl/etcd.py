"""`rlfleet etcd`: maintenance of the etcd a live job runs on (docs/operations/etcd-maintenance.md).

    rlfleet etcd snapshot FILE   the job's durable keys (not lease-bound) as one JSON file
    rlfleet etcd restore FILE    put them back (refused over a live job or newer counters)
    rlfleet etcd members         the cluster's members: voter/learner, leader, raft index

`members` runs `etcdctl ... -w json`: etcd-sdk-python's protocol files predate learners
(its Member has no isLearner field and it has no MemberPromote), and a member replacement
is exactly when an operator needs to see which member is a learner.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

import click

from rlfleet.tools.ctl.etcd_options import (
    _etcd_credentials,
    _fail_unreachable,
    _pick_job,
    _store,
    etcd_option,
    job_name,
)
from rlfleet.tools.exit_codes import Exit


@click.group("etcd")
def etcd_group() -> None:
    """Snapshot and restore a job's keys; the etcd cluster's members (docs/operations/etcd-maintenance.md)."""


@etcd_group.command()
@click.argument("file", type=click.Path(dir_okay=False, writable=True))
@click.option("--job", callback=job_name, default=None, help="Job name; default: the only job in etcd.")
@etcd_option
def snapshot(file: str, job: str | None, etcd: str) -> None:
    """Write the job's durable keys (every key under /rlfleet/<job>/ not bound to a lease)
    to FILE, atomically, mode 0600."""
    from rlfleet.common.control import job_snapshot
    from rlfleet.common.control.store import StoreUnavailable
    try:
        store = _store(etcd)
        job = _pick_job(store, job)
        snap = job_snapshot.take(store, job, etcd)
    except StoreUnavailable as exc:
        _fail_unreachable(exc, etcd)
    job_snapshot.write(snap, file)
    skipped = sorted(snap.skipped)
    click.echo(f"wrote {len(snap.keys)} durable keys of job {job} at etcd revision {snap.revision} to {file}")
    if skipped:
        click.echo(f"skipped {len(skipped)} lease-bound keys (their daemons write them again): "
                   f"{', '.join(skipped[:6])}{', ...' if len(skipped) > 6 else ''}")


@etcd_group.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--job", callback=job_name, default=None,
              help="Job name; default: the file's. Must match the file's.")
@click.option("--force", is_flag=True,
              help="Restore over a live job, and move counters (prompts/cursor, weights/latest, "
                   "trainer/checkpoint) backwards.")
@click.option("--dry-run", is_flag=True, help="Say what would be written; write nothing.")
@etcd_option
def restore(file: str, job: str | None, force: bool, dry_run: bool, etcd: str) -> None:
    """Write the keys of a snapshot FILE back into etcd (exit 9 when refused, 2 when FILE is
    not a snapshot)."""
    from rlfleet.common.control import job_snapshot
    from rlfleet.common.control.store import StoreUnavailable
    try:
        snap = job_snapshot.load(file)
    except job_snapshot.SnapshotError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(Exit.BAD_SPEC)
    if job is not None and job != snap.job:
        click.echo(f"refused: {file} holds job {snap.job!r}, not {job!r} (a snapshot restores only "
                   "the job it was taken of)", err=True)
        sys.exit(Exit.REFUSED)
    try:
        store = _store(etcd)
        plan = job_snapshot.plan(store, snap, force=force)
        if plan.refusals:
            for reason in plan.refusals:
                click.echo(f"refused: {reason}", err=True)
            sys.exit(Exit.REFUSED)
        if plan.clamped:
            click.echo("fencing terms newer than this etcd's revision (a snapshot of another etcd) set to 0, "
                       f"no fence: any trainer elected from now on is newer: {'; '.join(plan.clamped)}")
        if plan.extra:
            click.echo(f"left as they are: {len(plan.extra)} durable keys in etcd that {file} lacks "
                       f"({', '.join(plan.extra[:6])}{', ...' if len(plan.extra) > 6 else ''})")
        if dry_run:
            click.echo(f"dry run: would write {len(plan.values)} keys of job {snap.job} "
                       f"({len(plan.unchanged)} already equal) in {len(plan.batches())} transaction(s): "
                       f"{', '.join(k for batch in plan.batches() for k in batch)}")
            return
        try:
            txns = job_snapshot.apply(store, plan)
        except RuntimeError as exc:
            click.echo(f"refused: {exc}", err=True)
            sys.exit(Exit.REFUSED)
    except StoreUnavailable as exc:
        _fail_unreachable(exc, etcd)
    click.echo(f"restored {len(plan.values)} keys of job {snap.job} from {file} (taken at revision "
               f"{snap.revision}, {snap.time}) in {txns} transaction(s); {len(plan.unchanged)} already equal")


# -- members -----------------------------------------------------------------------------
@dataclass
class MemberView:
    id: str                 # hex, as etcdctl member remove/promote take it
    name: str
    peer_urls: list[str]
    client_urls: list[str]
    learner: bool
    answers: bool
    leader: bool
    raft_index: int | None
    raft_term: int | None
    behind: int | None      # the leader's raft index minus this member's (caught up: ~0)

    @property
    def status(self) -> str:
        if not self.client_urls:
            return "not started"  # added (member add) but never joined: etcd knows no client URL yet
        if not self.answers:
            return "unreachable"
        return "leader" if self.leader else ("learner" if self.learner else "follower")


def etcdctl_base(endpoints: list[str], creds=None) -> tuple[list[str], dict[str, str]]:
    """etcdctl's command line and environment for these endpoints and credentials (default:
    this command's); the password goes in ETCDCTL_USER (the environment), never in argv."""
    exe = shutil.which("etcdctl")
    if exe is None:
        raise click.ClickException("etcdctl is not on PATH (Debian: apt-get install etcd-client)")
    creds = _etcd_credentials() if creds is None else creds
    scheme = "https" if creds.tls else "http"
    urls = [e if "://" in e else f"{scheme}://{e}" for e in endpoints]
    argv = [exe, f"--endpoints={','.join(urls)}", "--dial-timeout=1s", "--command-timeout=3s"]
    if creds.cacert:
        argv.append(f"--cacert={creds.cacert}")
    if creds.cert:
        argv += [f"--cert={creds.cert}", f"--key={creds.key}"]
    env = {**os.environ, "ETCDCTL_API": "3"}
    if creds.user:
        env["ETCDCTL_USER"] = f"{creds.user}:{creds.password()}"
    return argv, env


def read_members(endpoints: list[str], creds=None) -> list[MemberView]:
    """The members etcd lists, each asked for its own status. RuntimeError when no
    endpoint answers the member list."""
    argv, env = etcdctl_base(endpoints, creds)
    listed = subprocess.run([*argv, "member", "list", "-w", "json"], capture_output=True, text=True,
                            env=env, timeout=30)
    if listed.returncode != 0:
        raise RuntimeError(listed.stderr.strip().splitlines()[-1] if listed.stderr.strip() else
                           f"etcdctl member list exited {listed.returncode}")
    members = json.loads(listed.stdout).get("members", [])
    urls = [u for m in members for u in m.get("clientURLs", [])]
    statuses: dict[int, dict] = {}
    if urls:
        argv, env = etcdctl_base(urls, creds)
        # Exits 1 when a member does not answer, yet prints those that do.
        asked = subprocess.run([*argv, "endpoint", "status", "-w", "json"], capture_output=True,
                               text=True, env=env, timeout=60)
        try:
            for item in json.loads(asked.stdout or "[]"):
                status = item.get("Status", {})
                statuses[status.get("header", {}).get("member_id")] = status
        except ValueError:
            pass  # nothing parsable: every member shows as unreachable
    leader_id = next((s.get("leader") for s in statuses.values() if s.get("leader")), None)
    leader_index = statuses.get(leader_id, {}).get("raftIndex")
    views = []
    for m in members:
        status = statuses.get(m["ID"])
        index = status.get("raftIndex") if status else None
        views.append(MemberView(f"{m['ID']:x}", m.get("name", ""), m.get("peerURLs", []),
                                m.get("clientURLs", []), bool(m.get("isLearner")), status is not None,
                                m["ID"] == leader_id, index, status.get("raftTerm") if status else None,
                                leader_index - index if index is not None and leader_index is not None else None))
    return sorted(views, key=lambda v: (v.name, v.id))


@etcd_group.command()
@click.option("--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@etcd_option
def members(output: str, etcd: str) -> None:
    """The etcd cluster's members: id, name, voter or learner, leader, raft index (exit 1
    when a member does not answer)."""
    endpoints = [e.strip() for e in etcd.split(",") if e.strip()]
    try:
        views = read_members(endpoints)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        _fail_unreachable(exc, etcd)
    if output == "json":
        click.echo(json.dumps([{**asdict(v), "status": v.status} for v in views], indent=1))
    else:
        rows = [("ID", "NAME", "KIND", "STATUS", "RAFT INDEX", "BEHIND", "PEER URLS", "CLIENT URLS")]
        for v in views:
            rows.append((v.id, v.name or "-", "learner" if v.learner else "voter", v.status,
                         "-" if v.raft_index is None else str(v.raft_index),
                         "-" if v.behind is None else str(v.behind), ",".join(v.peer_urls),
                         ",".join(v.client_urls) or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        flags = " ".join([etcdctl_base(endpoints)[0][1], _etcd_credentials().etcdctl_flags()]).strip()
        click.echo(f"# same data: ETCDCTL_API=3 etcdctl {flags} member list -w table; "
                   f"ETCDCTL_API=3 etcdctl {flags} endpoint status --cluster -w table", err=True)
    voters = sum(not v.learner for v in views)
    if any(not v.answers for v in views):
        click.echo(f"{sum(not v.answers for v in views)} of {len(views)} members do not answer "
                   f"({voters} voters: quorum {voters // 2 + 1})", err=True)
        sys.exit(Exit.FAILURE)
