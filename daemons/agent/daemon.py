"""The node agent: `rlfleet daemon agent --job J [--backend process|systemd]`, one per
host per job (docs/operations/agent.md).

It registers `nodes/<host>` (bound to its lease: a host whose agent is gone drops
out) with the machine's inventory, its labels and a report of every daemon it
runs; starts the spec's resource-managers of its host itself (the bootstrap:
everything else is placed through them); and each cycle reads
`placement/<host>/` and reconciles it with what runs through its backend
(reconciler.py). While the job is paused (`state`, read once per cycle: one Range)
it observes only: deaths are recorded and reported in `nodes/<host>` (with
`paused: true`), nothing is started or stopped (docs/operations/maintenance-mode.md);
while it is stopped (`rlfleet stop`) it stops what it runs and starts nothing. It
serves `/metrics` and `/targets` (http.py) on --metrics-port. Its member key is `members/agent/<host>`; "agent" is no job
role, so no spec places one.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from rlfleet.common.control.members import members_from, placements_from
from rlfleet.common.control.pause import PauseWatch
from rlfleet.common.control.placement import Placed, placement_from_spec
from rlfleet.common.control.store import Store, StoreUnavailable
from rlfleet.common.daemon import Daemon, DaemonOptions
from rlfleet.common.procs import ProcessId
from rlfleet.common.spec.seams import sandboxed_roles
from rlfleet.daemons.agent import http, policy
from rlfleet.daemons.agent.backend import Backend
from rlfleet.daemons.agent.inventory import machine_inventory
from rlfleet.daemons.agent.process import ProcessBackend, daemon_command
from rlfleet.daemons.agent.reconciler import Reconciler
from rlfleet.daemons.agent.systemd import SystemdBackend

log = logging.getLogger("rlfleet.agent")

AGENT_ROLE = "agent"
SYSTEMD_METRICS_PORT = 9464  # the port Prometheus is told to scrape on every host (ansible/)
TARGETS_EVERY_CYCLES = 5     # how often the members are read again for /targets
STOP_GRACE_S = 10.0          # process backend: SIGTERM, then SIGKILL after this long
# Per-daemon variables: never copied from the agent's own environment into a unit's.
UNIT_ONLY_ENV = ("RLFLEET_ROLE", "RLFLEET_MEMBER_ID")


def unit_env(job: str, etcd: str, host: str, etcd_env: dict[str, str]) -> dict[str, str]:
    """What every unit of this job gets: the agent's RLFLEET_* variables (from the job's
    env file), with the job, etcd, host and credentials it runs with stated explicitly."""
    env = {k: v for k, v in os.environ.items() if k.startswith("RLFLEET_") and k not in UNIT_ONLY_ENV}
    env.update({k: v for k, v in etcd_env.items() if v})
    env.update(RLFLEET_JOB=job, RLFLEET_ETCD=etcd, RLFLEET_HOST=host)
    return env


class Agent(Daemon):
    role = AGENT_ROLE
    ready_without_spec = True

    def __init__(self, options: DaemonOptions, store: Store, *, backend: str = "process",
                 labels: dict[str, str] | None = None, etcd: str = "", etcd_env: dict[str, str] | None = None,
                 backend_impl: Any = None) -> None:
        super().__init__(options, store)
        self.backend_kind, self.labels = backend, dict(labels or {})
        self.etcd, self.etcd_env = etcd, dict(etcd_env or {})
        self.backend = backend_impl  # tests pass one in; else made in setup()
        self.reconciler: Reconciler | None = None
        self.inventory: dict[str, Any] = {}
        self.http = None
        self._placed: list[Placed] = []  # the last placement read (kept through an etcd outage)
        self._targets: list[dict] = []
        self._node: dict[str, Any] | None = None
        self._registered_at = 0.0
        self._job_state = PauseWatch(store, self.keys)  # an etcd outage keeps the last state read

    @property
    def host(self) -> str:
        return self.options.host

    def make_backend(self) -> Backend:
        return BACKENDS[self.backend_kind](self)

    # -- Daemon hooks -----------------------------------------------------------------
    def serve_metrics(self) -> str:
        self.http = http.serve(self.options.metrics_host, self.options.metrics_port, lambda: self._targets)
        return self.http.url("/metrics")

    def setup(self) -> None:
        self.inventory = machine_inventory(self.host)
        self._registered_at = round(time.time(), 3)  # `rlfleet node add` times a new host from it
        if self.backend is None:
            self.backend = self.make_backend()
        self.reconciler = Reconciler(self.backend)
        self.reconciler.adopt([self.host], time.monotonic())
        self.publish_node()

    def cycle(self) -> str | None:
        assert self.reconciler is not None
        changed = self._job_state.read()
        if changed:
            changed += (": observing only" if self._job_state.paused else
                        ": stopping what runs here, starting nothing" if self._job_state.stopped else
                        ": acting on placement again")
        events = self.reconciler.step(self.desired(), time.monotonic(), self._job_state.paused)
        for event in events:
            if event.kind == "crash_loop":
                log.warning(event.sentence(), extra={"event": "failing"})
        self.publish_node()
        if self.cycles % TARGETS_EVERY_CYCLES == 0:
            self.read_targets()
        return "; ".join([*([changed] if changed else []), *(e.sentence() for e in events)]) or None

    def drain(self) -> str | None:
        return self.backend.release(STOP_GRACE_S, log.warning) if self.backend is not None else None

    def member_info(self) -> dict[str, Any]:
        return {"backend": self.backend_kind}

    # -- what it reads and writes ---------------------------------------------------------
    def desired(self) -> list[Placed]:
        """The resource-managers the spec puts here, and `placement/<host>/`; nothing while
        the job is stopped (`rlfleet stop`), even after this host reboots."""
        assert self.spec is not None
        if self._job_state.stopped:
            return []
        boot = policy.bootstrap(placement_from_spec(self.spec), [self.host])
        try:
            kvs = self.store.get_prefix(self.keys.host_placement_prefix(self.host))
            self._placed = [Placed(p.host, p.role, p.id, p.gpus) for p in placements_from(self.keys, kvs)]
        except StoreUnavailable:
            pass  # keep acting on the last placement read: an outage stops nothing
        return sorted(set(boot) | set(self._placed))

    def publish_node(self) -> None:
        assert self.session is not None and self.reconciler is not None
        agent = {**ProcessId.current().to_fields(), "backend": self.backend_kind, "metrics": self.metrics_url,
                 "registered": self._registered_at}
        value = policy.node_value(self.inventory, self.labels, agent,
                                  self.reconciler.report(time.monotonic(), self.host), self._job_state.paused)
        if value != self._node:
            self._node = value
            self.session.put_lease_bound(self.keys.node(self.host), value)

    def read_targets(self) -> None:
        try:
            members = members_from(self.keys, self.store.get_prefix(self.keys.members_prefix))
        except StoreUnavailable:
            return  # serve the last list
        self._targets = http.http_sd_groups(self.options.job, self.host, members)


def _process_backend(agent: Agent) -> ProcessBackend:
    """Subprocesses logging to $RLFLEET_RUN_DIR/logs (default runs/<job>), with the agent's
    environment and etcd credentials."""
    job = agent.options.job
    run_dir = Path(os.environ.get("RLFLEET_RUN_DIR") or Path("runs") / job).resolve()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RLFLEET_RUN_DIR": str(run_dir),
           **{k: v for k, v in agent.etcd_env.items() if v}}
    return ProcessBackend(lambda p: daemon_command(job, agent.etcd, p), lambda p: {**env, **p.environment()},
                          run_dir / "logs")


def _systemd_backend(agent: Agent) -> SystemdBackend:
    # Asked at each start, so a reloaded spec's task or reward backend counts.
    def sandboxed(role: str) -> bool:
        return agent.spec is not None and role in sandboxed_roles(agent.spec)

    return SystemdBackend(agent.options.job, agent.host,
                          unit_env(agent.options.job, agent.etcd, agent.host, agent.etcd_env),
                          sandboxed=sandboxed)


BACKENDS = {"process": _process_backend, "systemd": _systemd_backend}  # --backend
