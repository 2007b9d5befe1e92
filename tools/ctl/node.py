"""`rlfleet node`: admit, cordon, drain and remove the machines of a live job
(docs/operations/live-fleet.md). The commands write the operator's intent
(`node_state/<host>`); the resource-manager leader acts on it and the hosts'
agents start and stop units. Waiting commands poll one snapshot of the job every
POLL_S and print each step as it is seen.

Exit codes (tools/exit_codes.py OPERATOR_CODES): 0 done, 2 unknown host or bad
usage, 3 etcd unreachable, 9 refused (the message says why), 10 not done within
--timeout (the request stays in effect).
"""

from __future__ import annotations

import getpass
import json
import socket
import sys
import time
from pathlib import Path

import click

from rlfleet.tools.ctl.etcd_options import _fail_unreachable, _pick_job, _store, etcd_option, job_name
from rlfleet.tools.exit_codes import Exit

POLL_S = 0.1


def _who() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


def _refuse(message: str) -> None:
    click.echo(f"refused: {message}", err=True)
    sys.exit(Exit.REFUSED)


class _Job:
    """The store, the job and its spec, read once per command."""

    def __init__(self, etcd: str, job: str | None) -> None:
        from rlfleet.common.control.cluster import read_spec
        from rlfleet.common.control.keys import JobKeys
        from rlfleet.common.control.store import StoreUnavailable
        self.etcd = etcd
        self.store = _store(etcd)
        try:
            self.job = _pick_job(self.store, job)
            self.keys = JobKeys(self.job)
            self.spec = read_spec(self.store, self.keys)
        except StoreUnavailable as exc:
            _fail_unreachable(exc, etcd)
        if self.spec is None:
            _refuse(f"job {self.job!r} has no spec in etcd (submit it first: rlfleet job submit)")

    def cluster(self):
        from rlfleet.common.control.cluster import Cluster
        from rlfleet.common.control.store import StoreUnavailable
        try:
            return Cluster.read(self.store, self.job)
        except StoreUnavailable as exc:
            _fail_unreachable(exc, self.etcd)

    def known(self, host: str, cluster) -> None:
        from rlfleet.tools.ctl.node_ops import known_hosts
        hosts = known_hosts(cluster, self.spec)
        if host not in hosts:
            raise click.BadParameter(f"unknown host {host!r} in job {self.job!r}: not named by the spec, no agent "
                                     f"registered, never admitted (known: {', '.join(sorted(hosts)) or 'none'})",
                                     param_hint="HOST")

    def write_state(self, host: str, state: str, reason: str) -> None:
        from rlfleet.common.control.operations import NodeState
        value = NodeState(host, state, time.time(), _who(), reason).to_value()
        self._write(lambda: self.store.put(self.keys.node_state(host), value))

    def clear_state(self, host: str) -> bool:
        return self._write(lambda: self.store.delete(self.keys.node_state(host)))

    def _write(self, fn):
        from rlfleet.common.control.store import StoreUnavailable
        try:
            return fn()
        except StoreUnavailable as exc:
            _fail_unreachable(exc, self.etcd)


def _wait(deadline: float, step) -> bool:
    """Call `step()` every POLL_S until it returns True or the deadline passes."""
    while True:
        if step():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


@click.group()
def node() -> None:
    """Admit, cordon, drain and remove the machines of a live job."""


def _common(fn):
    fn = etcd_option(fn)
    return click.option("--job", callback=job_name, default=None,
                        help="Job name; optional when etcd holds only one.")(fn)


@node.command("list")
@_common
@click.option("--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
def list_(job: str | None, etcd: str, output: str) -> None:
    """Every host the job knows: named or admitted (pool), state, agent, daemons."""
    from rich.table import Table

    from rlfleet.tools.ctl.fleet_view import report_console
    from rlfleet.tools.ctl.node_ops import known_hosts, on_host
    j = _Job(etcd, job)
    cluster = j.cluster()
    named = {h.name for h in j.spec.placement.hosts}
    waiting: dict[str, str] = {}
    for m in cluster.members("resource-manager"):
        waiting.update({str(k): str(v) for k, v in dict(m.info.get("waiting_hosts") or {}).items()})
    rows = []
    for host in sorted(known_hosts(cluster, j.spec)):
        state = cluster.node_states.get(host)
        admission = cluster.admissions.get(host)
        rows.append({"host": host, "pool": "(named)" if host in named else admission.pool if admission else "",
                     "state": state.state if state else "schedulable", "agent": host in cluster.nodes,
                     "daemons": on_host(cluster, host), "waiting": waiting.get(host, "")})
    if output == "json":
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"nodes of {j.job}")
    for col in ("host", "pool", "state", "agent", "daemons", "not admitted because"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["host"], r["pool"], r["state"], "up" if r["agent"] else "-", ", ".join(r["daemons"]),
                      r["waiting"])
    report_console().print(table)


@node.command()
@click.argument("host")
@_common
@click.option("--reason", default="", help="Why (shown by `rlfleet node list` and status).")
def cordon(host: str, job: str | None, etcd: str, reason: str) -> None:
    """Keep what runs on HOST, place nothing new there, admit it into no pool."""
    from rlfleet.common.control.operations import CORDONED
    j = _Job(etcd, job)
    cluster = j.cluster()
    j.known(host, cluster)
    state = cluster.node_states.get(host)
    if state is not None and state.state != CORDONED:
        _refuse(f"{host} is {state.state}; `rlfleet node uncordon {host}` first")
    j.write_state(host, CORDONED, reason)
    click.echo(f"{host} cordoned: what runs there stays, nothing new is placed")


@node.command()
@click.argument("host")
@_common
def uncordon(host: str, job: str | None, etcd: str) -> None:
    """Make HOST schedulable again (after cordon or drain): its placement comes back."""
    from rlfleet.common.control.operations import REMOVED
    j = _Job(etcd, job)
    cluster = j.cluster()
    j.known(host, cluster)
    state = cluster.node_states.get(host)
    if state is None:
        click.echo(f"{host} is schedulable already")
        return
    if state.state == REMOVED:
        _refuse(f"{host} was removed from the job; `rlfleet node add {host}` admits it again")
    j.clear_state(host)
    click.echo(f"{host} uncordoned (was {state.state}): the resource-manager places its work again")


@node.command()
@click.argument("host")
@_common
@click.option("--reason", default="", help="Why (shown by `rlfleet node list` and status).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="Seconds to wait until nothing of the job runs on HOST.")
@click.option("--force", is_flag=True, help="Drain even a host that runs the only instance of a role.")
@click.option("--no-wait", is_flag=True, help="Write the request and return.")
def drain(host: str, job: str | None, etcd: str, reason: str, timeout_s: float, force: bool, no_wait: bool) -> None:
    """Stop the job's daemons on HOST without losing work, then mark it drained.

    Rollouts finish what runs (up to their drain timeout) and refuse new requests; the
    env-hosts continue what was cut on another rollout holding the same version. The
    host's relay leaves the chain (its predecessor sends to its successor)."""
    from rlfleet.common.control.operations import DRAINED, DRAINING, REMOVED
    from rlfleet.tools.ctl.node_ops import on_host, sole_instances
    j = _Job(etcd, job)
    cluster = j.cluster()
    j.known(host, cluster)
    state = cluster.node_states.get(host)
    if state is not None and state.state == REMOVED:
        _refuse(f"{host} was removed from the job already")
    if state is None or state.state not in (DRAINING, DRAINED):
        sole = sole_instances(cluster, host)
        if sole and not force:
            _refuse(f"{host} runs the only running {'; '.join(sole)}: draining it stops that role in the whole "
                    "job (start another instance elsewhere first, or --force)")
        j.write_state(host, DRAINING, reason)
    started = time.monotonic()
    click.echo(f"{host} draining: {len(on_host(cluster, host))} daemon(s) there")
    if no_wait:
        return
    left: list[list[str]] = [on_host(cluster, host)]

    def drained() -> bool:
        c = j.cluster()
        now = on_host(c, host)
        if now != left[0]:
            click.echo(f"  {time.monotonic() - started:6.1f} s  left on {host}: {', '.join(now) or 'none'}")
            left[0] = now
        s = c.node_states.get(host)
        return s is not None and s.state == DRAINED

    if not _wait(time.monotonic() + timeout_s, drained):
        click.echo(f"{host} not drained within {timeout_s:.0f} s (still there: {', '.join(left[0])}); "
                   "the drain stays in effect", err=True)
        sys.exit(Exit.TIMED_OUT)
    click.echo(f"{host} drained in {time.monotonic() - started:.1f} s")


@node.command()
@click.argument("host")
@_common
@click.option("--force", is_flag=True, help="Remove a host that is not drained (its daemons are stopped).")
def remove(host: str, job: str | None, etcd: str, force: bool) -> None:
    """Take a drained HOST out of the job: its admission is forgotten and it is not
    admitted again until `rlfleet node add`."""
    from rlfleet.common.control.operations import DRAINED, REMOVED
    j = _Job(etcd, job)
    cluster = j.cluster()
    j.known(host, cluster)
    state = cluster.node_states.get(host)
    if (state is None or state.state not in (DRAINED, REMOVED)) and not force:
        _refuse(f"{host} is {state.state if state else 'schedulable'}, not drained: "
                f"`rlfleet node drain {host}` first (or --force)")
    j.write_state(host, REMOVED, "removed")
    click.echo(f"{host} removed from job {j.job}" +
               (" (its agent may be stopped now)" if host in cluster.nodes else ""))


@node.command()
@click.argument("host")
@_common
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0), default=180.0, show_default=True,
              help="Seconds to wait for the host's first trajectory.")
@click.option("--no-wait", is_flag=True, help="Clear the host's state and return.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write the phases' timings here.")
def add(host: str, job: str | None, etcd: str, timeout_s: float, no_wait: bool, json_out: str | None) -> None:
    """Admit HOST into the live job and wait until it generates its first trajectory.

    The host's agent must run (provision it: `ansible-playbook site.yml -l HOST`); the
    resource-manager admits it into the first pool its labels match (or it is named by
    the spec), places daemons there, its relay joins the chain and catches up, and its
    rollouts serve. Each phase is printed with its time from the agent's registration,
    taken from the records' own timestamps: the same whenever the command is started."""
    from rlfleet.tools.ctl.node_ops import JoinWatch
    j = _Job(etcd, job)
    cluster = j.cluster()
    state = cluster.node_states.get(host)
    floor = 0.0
    if state is not None:
        j.clear_state(host)
        floor = time.time()  # it could not join before: its phases start here
        click.echo(f"{host}: cleared its state ({state.state}); its phases count from now")
    if no_wait:
        click.echo(f"{host}: admitted as soon as its agent registers")
        return
    watch = JoinWatch(host, named=host in {h.name for h in j.spec.placement.hosts}, floor=floor)
    t0 = time.monotonic()
    waiting_said = [""]

    def step() -> bool:
        c = j.cluster()
        for name in watch.observe(c):
            if name == "registered":
                registered = time.strftime("%H:%M:%S", time.localtime(watch.at[name]))
                if watch.registered_again is not None:
                    again = time.strftime("%H:%M:%S", time.localtime(watch.registered_again))
                    click.echo(f"  {host}'s agent registered again at {again}, after its daemons started: the first "
                               f"registration is not in the records; each phase from its first record, {registered}:")
                else:
                    click.echo(f"  {host}'s agent registered at {registered}; each phase from then:")
                continue
            since = watch.at[name] - watch.at["registered"]
            click.echo(f"  {since:6.1f} s  {name}" + (f" (pool {c.admissions[host].pool})"
                                                       if name == "admit" and host in c.admissions else ""))
        if "registered" in watch.at and "admit" not in watch.at:
            why = next((str(m.info["waiting_hosts"][host]) for m in c.members("resource-manager")
                        if host in (m.info.get("waiting_hosts") or {})), "")
            if why and why != waiting_said[0]:
                click.echo(f"  not admitted yet: {why}")
                waiting_said[0] = why
        return watch.done

    if host not in cluster.nodes:
        click.echo(f"waiting for {host}'s agent to register ...")
    ok = _wait(t0 + timeout_s, step)
    record = {**watch.to_json(), "job": j.job, "ok": ok}
    if json_out:
        Path(json_out).write_text(json.dumps(record, indent=2) + "\n")
    if not ok:
        missing = next(n for n in ("registered", *record["phases"]) if n.removesuffix("_s") not in watch.at)
        click.echo(f"{host} did not join within {timeout_s:.0f} s (stuck before: {missing.removesuffix('_s')})",
                   err=True)
        sys.exit(Exit.TIMED_OUT)
    click.echo(f"{host} joined: first trajectory {record['total_s']:.1f} s after its agent registered")
