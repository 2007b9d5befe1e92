"""A snapshot of one job as etcd sees it, and its rendering (table or JSON).

Shared by `rlfleet status` and the live view of `rlfleet run`: both show the
same facts the same way. Reads only; every read here has an `etcdctl`
equivalent (see `etcdctl_equivalent`).

A registration is not taken at its word: a member whose process runs on this
machine (its boot id is ours) is checked in /proc at once (dead, a zombie, or
stopped), so a kill -9 shows before its lease runs out; with `check_leases`
each lease is read too (one request per lease, not per member), and a lease not
refreshed for over half its TTL means a main loop that stalled. Members bound
to the lease of a dead one (a sim host's rollouts) are dead with it.

A paused or stopped job (`rlfleet pause`, `rlfleet stop`) is said first, in one banner line
(`paused_banner`); a stopped job's placed daemons are not expected to run.

Nodes are the hosts' agents' records (docs/operations/agent.md): a placed daemon its agent
reports `failing` (it keeps dying) is a problem, and so is an agent whose
process on this machine is gone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from rlfleet.common.control import members as registrations
from rlfleet.common.control.cluster import Cluster
from rlfleet.common.control.keys import NODES
from rlfleet.common.control.operations import JobState
from rlfleet.common.control.pause import describe
from rlfleet.common.control.store import Store
from rlfleet.common.procs import ProcessId
from rlfleet.common.spec.placement import ROLES, SINGLETON_ROLES


@dataclass(frozen=True)
class MemberRow:
    role: str
    member_id: str
    host: str
    pid: int
    state: str
    leader: bool
    addresses: dict[str, str]
    metrics: str
    started: float
    health: str = "running"  # running, or what is wrong: dead / stopped / stalled (...)
    lease_id: int = 0
    incarnation: str = ""

    @property
    def healthy(self) -> bool:
        return self.health == "running"


@dataclass(frozen=True)
class FleetSnapshot:
    job: str
    taken_at: float
    members: list[MemberRow]
    leaders: dict[str, str]                 # role -> member id
    nodes: dict[str, dict[str, Any]]        # host -> inventory
    placed: list[tuple[str, str, str]]      # (host, role, id)
    problems: list[str] = field(default_factory=list)
    cluster: Cluster | None = field(default=None, compare=False)  # everything else etcd said (progress, weights...)

    @property
    def gpus(self) -> dict[str, tuple[int, ...]]:
        """Member id -> the GPU indices its placement gives it (only where the job assigns GPUs)."""
        placement = self.cluster.placement if self.cluster is not None else ()
        return {p.id: p.gpus for p in placement if p.gpus is not None}

    def by_role(self) -> dict[str, list[MemberRow]]:
        out: dict[str, list[MemberRow]] = {r: [] for r in ROLES}
        for m in self.members:
            out.setdefault(m.role, []).append(m)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "taken_at": self.taken_at,
            "members": [vars(m) for m in self.members],
            "leaders": self.leaders,
            "nodes": self.nodes,
            "placement": [{"host": h, "role": r, "id": i, **({"gpus": list(g)} if (g := self.gpus.get(i)) is not None
                                                              else {})} for h, r, i in self.placed],
            "problems": self.problems,
            "state": _state_json(self.cluster.state if self.cluster is not None else None),
        }


def take_snapshot(store: Store, job: str, check_leases: bool = False) -> FleetSnapshot:
    """One read of the job's keys (common/control/cluster.py), in the shape the views render;
    values etcd holds in a malformed shape are listed among the problems. Local pids
    are checked always (no etcd request), leases only with `check_leases`."""
    cluster = Cluster.read(store, job)
    members = [MemberRow(m.role, m.id, m.host or "?", m.pid, m.state or "?", m.leader, dict(m.addresses),
                      m.metrics, m.started, _process_health(m), m.lease_id, m.incarnation)
               for m in cluster.members()]
    members = _lease_health(store, members, check_leases)
    leaders = {role: lead.id or "?" for role, lead in cluster.leaders.items()}
    nodes = {host: node.to_value() for host, node in cluster.nodes.items()}
    placed = [(p.host, p.role, p.id) for p in cluster.placement]
    # A stopped job keeps its placement for `rlfleet start`: nothing placed is expected to run.
    expected = [] if cluster.state is not None and cluster.state.stopped else placed
    return FleetSnapshot(job, cluster.taken_at, members, leaders, nodes, placed,
                         _problems(members, leaders, expected) + _node_problems(cluster) + _training_problems(cluster)
                         + list(cluster.problems),
                         cluster)


def _agent_health(node: registrations.Node) -> str:
    """"alive" while its record exists (it is bound to the agent's lease), unless the
    agent's process is on this machine and gone."""
    ident = ProcessId.of(dict(node.agent))
    if ident is not None and ident.state() in ("dead", "zombie"):
        return f"dead (pid {ident.pid} is gone; lease not expired yet)"
    return "alive"


def _node_problems(cluster: Cluster) -> list[str]:
    problems = []
    for host, node in sorted(cluster.nodes.items()):
        if _agent_health(node) != "alive":
            problems.append(f"{NODES}/{host}: agent {_agent_health(node)}")
        problems += [f"{d.id} on {host}: failing (keeps dying: {d.restarts} deaths, last {d.last_exit or '?'})"
                     for d in node.failing]
    return problems


def _training_problems(cluster: Cluster) -> list[str]:
    """Steps the trainer skipped for a non-finite number (daemons/trainer/guard.py): training
    goes on, but a reward function or a model producing them needs a look."""
    out = []
    for m in cluster.members():
        groups = m.info.get("non_finite_groups") if m.role == "trainer" else None
        if groups:
            steps, rewinds = m.info.get("non_finite_steps") or 0, m.info.get("rewinds") or 0
            out.append(f"{m.role}/{m.id}: {groups} groups dropped for non-finite numbers ({steps} steps skipped, "
                       f"{rewinds} checkpoints restored); last: {m.info.get('non_finite', '?')}")
    return out


def _process_health(m: registrations.Member) -> str:
    ident = ProcessId(m.boot_id, m.pid, m.pid_start, m.pid_ns) if m.boot_id and m.pid > 0 else None
    state = ident.state() if ident else "remote"
    if state in ("dead", "zombie"):
        return f"dead (pid {m.pid} {'is a zombie' if state == 'zombie' else 'is gone'}; lease not expired yet)"
    if state == "stopped":
        return f"stopped (pid {m.pid} is stopped, SIGSTOP?)"
    return "running"


def _lease_health(store: Store, members: list[MemberRow], check_leases: bool) -> list[MemberRow]:
    dead_leases = {m.lease_id for m in members if m.health.startswith("dead") and m.lease_id}
    stalled: dict[int, str] = {}
    if check_leases:
        for lease_id in sorted({m.lease_id for m in members if m.lease_id} - dead_leases):
            info = store.lease_info(lease_id)
            silent = info.granted_s - info.remaining_s
            if info.remaining_s < 0:
                dead_leases.add(lease_id)
            elif info.granted_s and silent > info.granted_s / 2:  # refreshed every third of it
                stalled[lease_id] = f"stalled (no lease refresh for ~{silent} s of {info.granted_s} s)"
    out = []
    for m in members:
        if m.healthy and m.lease_id in dead_leases:
            m = replace(m, health="dead (its lease's holder is dead)")
        elif m.healthy and m.lease_id in stalled:
            m = replace(m, health=stalled[m.lease_id])
        out.append(m)
    return out


def _problems(members: list[MemberRow], leaders: dict[str, str], placed: list[tuple[str, str, str]]) -> list[str]:
    """What an operator should look at: missing daemons, missing leaders, odd states."""
    live = {(m.role, m.member_id) for m in members}
    problems = [f"{role}/{mid} placed on {host} but not registered"
                for host, role, mid in placed if (role, mid) not in live]
    roles_live = {m.role for m in members}
    problems += [f"{role}: no leader" for role in SINGLETON_ROLES if role in roles_live and role not in leaders]
    problems += [f"{m.role}/{m.member_id}: state {m.state}" for m in members if m.state not in ("running",)]
    problems += [f"{m.role}/{m.member_id}: {m.health}" for m in members if not m.healthy]
    return problems


def members_table(snap: FleetSnapshot, restarts: dict[str, int] | None = None) -> Table:
    table = Table(title=f"job {snap.job}", expand=False)
    gpus = snap.gpus
    for col in ("role", "id", "host", "pid", "state", "leader", "up", *(("gpus",) if gpus else ()), "addresses"):
        table.add_column(col, overflow="fold")  # a narrow terminal wraps an id, never cuts it
    if restarts is not None:
        table.add_column("restarts", justify="right")
    by_role = snap.by_role()
    for role in by_role:
        members = sorted(by_role[role], key=lambda m: m.member_id)
        if not members:
            row = [role, "—", "", "", "[red]none live[/red]", "", "", *([""] if gpus else []), ""]
            table.add_row(*row, *([""] if restarts is not None else []))
            continue
        for m in members:
            leader = "★" if snap.leaders.get(role) == m.member_id else ("standby" if role in SINGLETON_ROLES else "")
            state = m.state if m.state == "running" else f"[yellow]{m.state}[/yellow]"
            if not m.healthy:
                state = f"[red]{m.health.split(' (')[0]}[/red]"
            up = f"{snap.taken_at - m.started:.0f}s" if m.started else ""
            addrs = " ".join(f"{k}={v}" for k, v in sorted(m.addresses.items()))
            given = gpus.get(m.member_id)
            held = [("" if given is None else ",".join(map(str, given)) or "none")] if gpus else []
            row = [role, m.member_id, m.host, str(m.pid), state, leader, up, *held, addrs]
            if restarts is not None:
                row.append(str(restarts.get(m.member_id, 0)))
            table.add_row(*row)
    return table


def nodes_table(snap: FleetSnapshot) -> Table:
    """One row per host with an agent's record or a placement: inventory, labels, the
    agent, and what it runs (failing daemons named)."""
    table = Table(title="nodes")
    for col in ("host", "cpus", "memory", "gpus", "labels", "agent", "daemons"):
        table.add_column(col, overflow="fold")
    records = snap.cluster.nodes if snap.cluster is not None else {}
    placed_hosts = {host for host, _, _ in snap.placed}
    for host in sorted(set(snap.nodes) | placed_hosts):
        inv = snap.nodes.get(host)
        if inv is None:
            table.add_row(host, "—", "—", "—", "", "[yellow]no agent[/yellow]", "")
            continue
        mem = inv.get("memory_bytes", 0) / 2**30
        gpus = ", ".join(g.get("name", "?") for g in inv.get("gpus", [])) or "—"
        labels = " ".join(f"{k}={v}" for k, v in sorted((inv.get("labels") or {}).items()))
        node = records.get(host)
        agent, daemons = "", ""
        if node is not None:
            health = _agent_health(node)
            backend = node.agent.get("backend", "?") if node.agent else "?"
            agent = f"{health} ({backend})" if health == "alive" else f"[red]{health.split(' (')[0]}[/red]"
            failing = [d.id for d in node.failing]
            daemons = f"{len(node.daemons)} daemons" + (f", [red]failing: {' '.join(failing)}[/red]" if failing else "")
        table.add_row(host, str(inv.get("cpus_logical", "?")), f"{mem:.1f} GiB", gpus, labels, agent, daemons)
    return table


def _state_json(state: JobState | None) -> dict[str, Any]:
    return state.to_value() if state is not None else {"state": "running"}


def paused_banner(state: JobState | None) -> Text | None:
    """The first line of `rlfleet status` and of `rlfleet run`'s live view while paused
    or stopped."""
    if state is not None and state.paused:
        return Text(f"{describe(state).replace('job paused', 'PAUSED', 1)} — `rlfleet resume` to continue",
                    style="bold yellow")
    if state is not None and state.stopped:
        return Text(f"{describe(state).replace('job stopped', 'STOPPED', 1)} — its agents start nothing; "
                    "`rlfleet start` to run it again", style="bold yellow")
    return None


def report_console() -> Console:
    """Where a report goes. A terminal: its own width (columns fold long cells). A file or
    a pipe: rich would assume 80 columns and cut cells ("resourc…"); there is no screen
    to fit, so the width is unbounded and every id, address and problem stays whole."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=100_000, no_color=True, highlight=False)


def etcdctl_equivalent(endpoints: str, prefix: str, keys_only: bool = False, credentials: str = "") -> str:
    """The plain etcdctl command that shows the same data (no Python needed); ``credentials``:
    its TLS / user flags (EtcdCredentials.etcdctl_flags)."""
    extra = " --keys-only" if keys_only else ""
    creds = f" {credentials}" if credentials else ""
    return f"ETCDCTL_API=3 etcdctl --endpoints={endpoints}{creds} get --prefix {prefix}{extra}"
