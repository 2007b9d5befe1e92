"""The one base every rlfleet daemon runs on.

Lifecycle: load the spec (from etcd, or a file) → register under
/rlfleet/<job>/members/<role>/<id> with a lease → loop over `run_cycle()` →
on SIGTERM: drain, deregister, exit 0; on SIGHUP: reload the spec.

Under systemd (`Type=notify`, systemd/README.md) the same transitions are told to
systemd (common/sd_notify.py; no-ops elsewhere): READY=1 once the first cycle has
registered us, STATUS= each new cycle sentence, WATCHDOG=1 from this loop once per
cycle (never from a thread: a stalled loop stops pinging and systemd kills and
restarts it), RELOADING=1 … READY=1 around a SIGHUP reload, STOPPING=1 when the
drain starts.

Signals only set flags; the loop does the work, so every transition happens
at one well-defined place and is logged as one sentence (STYLE §3).
Subclasses fill in `setup()`, `cycle()`, `drain()` and `member_info()`;
long-running data-plane work belongs in their own threads, never in `cycle()`,
which must stay short so the lease is refreshed in time.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from rlfleet.common import metrics, security
from rlfleet.common.control.cluster import read_spec
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.session import Session
from rlfleet.common.control.store import Store, StoreUnavailable
from rlfleet.common.procs import ProcessId
from rlfleet.common.sd_notify import Notifier, status_field
from rlfleet.common.signals import route_signals
from rlfleet.common.spec.errors import SpecError
from rlfleet.common.spec.job import JobSpec, load_spec
from rlfleet.common.spec.overrides import with_bind_host
from rlfleet.common.spec.placement import SINGLETON_ROLES
from rlfleet.common.wire import curve

log = logging.getLogger("rlfleet.daemon")

# The `rlfleet run` that started this daemon (its owner key's incarnation), stamped into
# the member record so an operator sees which run a registration belongs to.
INCARNATION_ENV = "RLFLEET_INCARNATION"
EXIT_SECURITY = 2  # like a bad spec: restarting does not help until someone provides the keys


@dataclass(frozen=True)
class DaemonOptions:
    job: str
    member_id: str
    host: str = socket.gethostname()
    spec_file: str | None = None  # else the spec is read from etcd (`spec`)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    incarnation: str = ""  # the owning run's incarnation ("" when started by hand)
    bind_host: str | None = None  # replaces every bind_host of the spec (this host's cluster address)


class Daemon:
    role: ClassVar[str] = ""
    # READY=1 before the job's spec exists (a node agent: installed and started with the
    # host, it waits for a job that may be submitted much later, and `systemctl start`
    # must not time out on that). Job daemons say READY=1 only once registered.
    ready_without_spec: ClassVar[bool] = False

    def __init__(self, options: DaemonOptions, store: Store) -> None:
        self.options = options
        self.store = store
        self.keys = JobKeys(options.job)
        self.spec: JobSpec | None = None
        self.session: Session | None = None
        self.state = "starting"
        self.addresses: dict[str, str] = {}  # data-plane endpoints this daemon serves
        self.metrics_url = ""
        self.started_at = time.time()
        self.cycles = 0
        self._process = ProcessId.current()
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._wake = threading.Event()
        self._labels = {"role": self.role, "id": options.member_id}
        self.notifier = Notifier.from_env()
        self._told_ready = False
        self._told_status = ""
        metrics.set_role(self.role)  # the role label of rlfleet_rejected_messages_total

    # -- hooks for subclasses ------------------------------------------------
    def setup(self) -> None:
        """Bind sockets (fill self.addresses), start worker threads."""

    def cycle(self) -> str | None:
        """The role's periodic control work; return a sentence if something happened."""
        return None

    def drain(self) -> str | None:
        """Finish or hand back in-flight work before deregistering."""
        return None

    def reload(self, spec: JobSpec) -> str:
        self.spec = spec
        return "reloaded spec"

    def member_info(self) -> dict[str, Any]:
        """Extra role-specific fields for the member registration (keep them slow-changing)."""
        return {}

    def prepare_handover(self, to: str) -> bool:
        """A switchover to `to` is requested (docs/operations/switchover.md): save what the successor
        must resume from. Asked once a cycle while leading, until it returns True; then
        the leader resigns. Keep it short (start the work, report when it is done): the
        lease is refreshed by the same loop. While ``session.handover_to`` is set, start
        no new leader's work; when it is cleared again (the request withdrawn), resume."""
        return True

    # -- the loop -------------------------------------------------------------
    def request_stop(self, *_: object) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """Run the next cycle now (from any thread): a role's worker has news to publish."""
        self._wake.set()

    def request_reload(self, *_: object) -> None:
        self._reload.set()
        self._wake.set()

    def install_signal_handlers(self) -> None:
        route_signals({signal.SIGTERM: self.request_stop, signal.SIGINT: self.request_stop,
                       signal.SIGHUP: self.request_reload})

    def run(self) -> int:
        self.spec = self._load_spec_until_available()
        if self.spec is None:
            return 0  # stopped while waiting for the spec
        try:  # before registering or binding anything: sockets take their keys at creation
            said = security.enforce(self.spec, self.role)
        except security.SecurityError as exc:
            log.error("refusing to start: %s", exc, extra={"event": "security_refused"})
            self.notifier.status(f"refusing to start: {exc}")
            return EXIT_SECURITY
        if said:
            log.info(said, extra={"event": "security"})
        self.session = Session(self.store, self.keys, self.role, self.options.member_id,
                               ttl_s=self.spec.etcd.lease_ttl_s, elect=self.role in SINGLETON_ROLES)
        self.session.prepare_handover = self.prepare_handover
        self.metrics_url = self.serve_metrics()
        self.setup()
        self.state = "running"
        metrics.UP.labels(**self._labels).set(1)
        interval = self.spec.etcd.refresh_interval_s
        while not self._stop.is_set():
            started = time.monotonic()
            said = self.run_cycle()
            if said:
                log.info(said, extra={"event": "cycle"})
            self._tell_systemd(said)
            metrics.CYCLE_SECONDS.labels(**self._labels).observe(time.monotonic() - started)
            wait_s = min(interval, self.cycle_interval_s() or interval)
            handover_s = self.session.handover_wait_s()  # a switchover's next step is due sooner
            if handover_s is not None:
                wait_s = min(wait_s, handover_s)
            if self.notifier.watchdog_s:
                # A third of the watchdog timeout (sd_watchdog_enabled(3) asks for less
                # than half) leaves room for a slow cycle before systemd gives up on us.
                wait_s = min(wait_s, self.notifier.watchdog_s / 3)
            self._wake.wait(max(0.0, wait_s - (time.monotonic() - started)))
            self._wake.clear()
        return self.shutdown()

    def serve_metrics(self) -> str:
        """Start the /metrics endpoint; returns its URL (the node agent serves more there)."""
        return metrics.serve_metrics(self.options.metrics_host, self.options.metrics_port)

    def cycle_interval_s(self) -> float | None:
        """Seconds to the next cycle when a role is waiting for something it must act on
        at once (a peer's address); None: the lease refresh interval. Never longer than
        that interval, whatever a role returns, so the lease is always kept."""
        return None

    def run_cycle(self) -> str:
        """One pass: reload if asked, keep the registration alive, run the role's work."""
        assert self.session is not None and self.spec is not None
        said: list[str] = []
        if self._reload.is_set():
            self._reload.clear()
            said.append(self._reload_spec())
        said += self.session.step(self.member_value())
        if self.session.blocked:
            # Another live process holds our member key (a duplicate daemon): do no role
            # work that it is doing too; the session keeps asking until the key is free.
            role_said = None
        else:
            role_said = self.cycle()
        if role_said:
            said.append(role_said)
        self.cycles += 1
        metrics.CYCLES.labels(**self._labels).inc()
        metrics.DEGRADED.labels(**self._labels).set(int(self.session.degraded))
        metrics.IS_LEADER.labels(**self._labels).set(int(self.session.is_leader))
        metrics.LEASE_GRANTS.labels(**self._labels)._value.set(self.session.lease_grants)
        return "; ".join(said)

    def _tell_systemd(self, said: str) -> None:
        """One datagram per cycle: the watchdog ping, READY=1 the first time we are
        registered, and the cycle sentence whenever a new one comes."""
        assert self.session is not None
        new = said if said and said != self._told_status else ""
        self._told_status = new or self._told_status
        if not self._told_ready and self.session.registered:
            self._told_ready = self.notifier.notify("READY=1", "WATCHDOG=1", *status_field(self._told_status))
        else:
            self.notifier.watchdog(new)

    def shutdown(self) -> int:
        self.state = "draining"
        self.notifier.stopping(f"draining {self.role}/{self.options.member_id}")
        said = [s for s in (self.drain(),) if s]
        if self.session is not None:
            said.append(self.session.close())
        metrics.UP.labels(**self._labels).set(0)
        log.info("; ".join(said + ["exiting"]), extra={"event": "exit"})
        return 0

    @property
    def is_leader(self) -> bool:
        return self.session is not None and self.session.is_leader

    def member_value(self) -> dict[str, Any]:
        return {
            "id": self.options.member_id,
            "role": self.role,
            "host": self.options.host,
            **self._process.to_fields(),  # pid, boot_id, pid_start: status checks a local pid
            "state": self.state,
            "addresses": dict(self.addresses),  # a copy: the session compares against what it published
            "metrics": self.metrics_url,
            "started": round(self.started_at, 3),
            **({"incarnation": self.options.incarnation} if self.options.incarnation else {}),
            **self.member_info(),
        }

    # -- spec ----------------------------------------------------------------
    def _fetch_spec(self) -> JobSpec:
        if self.options.spec_file:
            spec = load_spec(self.options.spec_file)
        else:
            spec = read_spec(self.store, self.keys)
        if spec is None:
            raise LookupError(f"no spec at {self.keys.spec} yet (submit one with `rlfleet job submit`)")
        return with_bind_host(spec, self.options.bind_host)

    def _load_spec_until_available(self) -> JobSpec | None:
        backoff = 0.1
        last_reason = ""
        while not self._stop.is_set():
            try:
                return self._fetch_spec()
            except (StoreUnavailable, LookupError) as exc:
                if str(exc) != last_reason:
                    log.warning("waiting for the job spec: %s", exc, extra={"event": "wait_spec"})
                    self.notifier.status(f"waiting for the job spec: {exc}")
                    last_reason = str(exc)
            if self.ready_without_spec:  # READY once, then the watchdog's pings while we wait
                if self._told_ready:
                    self.notifier.watchdog()
                else:
                    self._told_ready = self.notifier.ready(f"waiting for the job spec: {last_reason}")
            self._wake.wait(backoff)
            self._wake.clear()
            backoff = min(backoff * 2, 2.0)
        return None

    def _reload_spec(self) -> str:
        # systemd's reload job (ExecReload sends the SIGHUP) lasts from RELOADING=1 to
        # READY=1; before we said READY=1 once, a READY=1 would end the start-up early.
        told = self._told_ready and self.notifier.reloading()
        try:
            keys = curve.reload_authorized()  # SIGHUP also re-reads the authorized CURVE keys
            said = "; ".join(s for s in (keys, self.reload(self._fetch_spec())) if s)
        except (StoreUnavailable, LookupError, SpecError, curve.CurveError) as exc:
            said = f"kept the current spec, reload failed: {exc}"
        if told:
            self.notifier.ready()  # the cycle's STATUS (this sentence) follows at once
        return said
