"""The embedded fleet behind `rlfleet run`: a private etcd (unless one is given),
the spec written to it, the node agent's work for this machine, and a view: the
live table on a terminal, plain event lines otherwise.

The supervisor is the agent for localhost (daemons/agent/, docs/operations/agent.md), run
in-process with the process backend: it starts the spec's resource-managers
itself, and every other daemon because its `placement/<host>/...` key appeared
(written by the elected resource-manager), so `rlfleet run` and a cluster follow
one path. It records `nodes/<host>` for every host the spec places here, bound
to the run's owner lease (both read and written by tools/run/local_nodes.py).

One loop (`Supervisor.run`) reconciles placement with what runs, samples CPU and
watches four things that end the run: the trainer reporting `training: done`,
a daemon that keeps dying (`give_up`: N deaths within a window), no new
training step for `max_idle_s`, and another run taking the job over. A daemon
that dies is restarted with backoff; one whose registration expired while its
process still exists (stopped, or its loop stalled) is killed and restarted.
While the job is paused (`rlfleet pause`, docs/operations/maintenance-mode.md) it observes only,
like any agent: nothing is started, restarted, stopped or replaced, and the paused
time does not count toward max_idle_s. The run owns the job through
`/rlfleet/<job>/owner` (tools/run/job_owner.py): a second run of a live job is refused
(exit 8) unless `--take-over`.
Ctrl-C stops the daemons (SIGTERM, then SIGKILL after a grace period) and etcd
last. The run ends with the accounting check, the plots, the end summary and
an `Outcome`: the exit code (tools/exit_codes.py) and its one-line reason.

What ends the run and with which outcome, and how often each check runs, are
decisions without I/O: tools/run/run_policy.py. This module does the I/O.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from rlfleet.common.control.etcd_auth import EtcdCredentials
from rlfleet.common.control.etcd_store import EtcdStore
from rlfleet.common.control.keys import JobKeys
from rlfleet.common.control.members import members_from
from rlfleet.common.control.pause import PauseWatch
from rlfleet.common.control.placement import Placed, placement_from_spec
from rlfleet.common.control.store import StoreUnavailable
from rlfleet.common.daemon import INCARNATION_ENV
from rlfleet.common.signals import route_signals
from rlfleet.common.spec.job import JobSpec
from rlfleet.daemons.agent.policy import CRASH_LOOP_DEATHS, CRASH_LOOP_WINDOW_S, CrashLoop
from rlfleet.daemons.agent.process import ProcessBackend, daemon_command, tree_cpu_s
from rlfleet.daemons.agent.reconciler import Event, Reconciler
from rlfleet.tools.ctl.fleet_view import members_table, nodes_table, paused_banner, take_snapshot
from rlfleet.tools.exit_codes import Exit, Outcome
from rlfleet.tools.run.credentials import RunSecurity
from rlfleet.tools.run.etcd_local import EtcdCluster
from rlfleet.tools.run.job_owner import JobOwned, JobOwner, RegistrationCheck
from rlfleet.tools.run.layout import new_run_dir, torch_threads
from rlfleet.tools.run.local_nodes import LocalNodes
from rlfleet.tools.run.report import MetricsTail, RunMetrics, plot, read_metrics, summary
from rlfleet.tools.run.run_policy import Every, RunPolicy
from rlfleet.tools.run.summary import end_summary, eval_line, progress_line

log = logging.getLogger("rlfleet.supervisor")

MAX_IDLE_S = 300.0          # no training step for this long ends the run (--max-idle-s; 0: never)
PROGRESS_EVERY_S = 5.0      # plain mode: a progress line this often while steps advance
STOP_GRACE_S = 10.0
CPU_SAMPLE_S = 1.0          # how often each daemon's CPU time is read (what a kill -9 loses)


class Supervisor:
    def __init__(self, spec: JobSpec, spec_path: str, etcd: str | None, runs_dir: Path,
                 host: str | None = None, view: bool = True,
                 give_up: tuple[int, float] = (CRASH_LOOP_DEATHS, CRASH_LOOP_WINDOW_S),
                 max_idle_s: float = MAX_IDLE_S, take_over: bool = False, secure: bool = False,
                 etcd_creds: EtcdCredentials | None = None) -> None:
        self.spec, self.spec_path, self.runs_dir = spec, spec_path, runs_dir
        self.secure = secure
        self.security = RunSecurity(spec, secure, etcd, etcd_creds or EtcdCredentials())
        self.run_dir = runs_dir  # the run's own directory once `run` made it
        self.etcd_arg, self.view = etcd, view
        # Which placement hosts this supervisor starts daemons for; default all (one machine).
        self.host = host
        self.give_up_deaths, self.give_up_window_s = give_up
        self.max_idle_s = max_idle_s
        self.policy = RunPolicy(self.give_up_deaths, max_idle_s, spec.trainer.max_steps)
        self.cluster: EtcdCluster | None = None
        self.placed: list[Placed] = []  # what the spec places on this machine's hosts
        self.backend: ProcessBackend | None = None
        self.agent: Reconciler | None = None  # the node agent's reconcile step, for those hosts
        self.nodes: LocalNodes | None = None  # placement/ and nodes/ of those hosts in etcd
        self.events: deque[str] = deque(maxlen=8)
        self._stop = threading.Event()
        self.cpu_report: dict[str, float] = {}
        self.console = Console(stderr=False)
        self.accounting: dict | None = None
        self.plots: list[Path] = []
        self.metrics: MetricsTail | None = None
        self.final_metrics: RunMetrics | None = None  # the whole run, read once at the end
        self._accounting_failure: Outcome | None = None
        self._progress_step = -1  # the step of the last progress line printed
        self.take_over = take_over
        self.owner: JobOwner | None = None  # this run's hold on /rlfleet/<job>/owner
        self.registrations: RegistrationCheck | None = None
        self._claimed = ""  # how this run came to own the job, as a sentence
        self.job_state: PauseWatch | None = None  # `state`, read with placement/ (kept through an outage)

    # -- set-up ------------------------------------------------------------------
    def start_etcd(self) -> str:
        if self.etcd_arg:
            return self.etcd_arg
        # etcd's own default ticks, not the test clusters' 10 ms: a single member has no
        # peer to heartbeat, yet ticks every heartbeat interval (11 ms/s of CPU at 10 ms,
        # 3-4 ms/s at 100 ms); it costs ~0.3 s more to elect itself at start.
        self.cluster = EtcdCluster(1, base_dir=self.run_dir / "etcd", heartbeat_ms=100, election_ms=1000,
                                   tls=self.security.etcd_tls).start()
        return self.cluster.endpoints_arg

    def submit_spec(self, endpoints: str) -> EtcdStore:
        """Own the job (JobOwned if another live run does), then write its spec."""
        store = EtcdStore(endpoints, timeout_s=self.spec.etcd.retry_timeout_s, creds=self.security.store_credentials())
        keys = JobKeys(self.spec.job.name)
        try:
            self.owner = JobOwner(store, keys, self.spec.etcd.lease_ttl_s)
            claimed = self.owner.claim(self.take_over)
            store.put(keys.spec, self.security.submitted_spec())
        except BaseException:
            if self.owner is not None and self.owner.lease is not None:
                self.owner.release()
            store.close()
            raise
        self.registrations = RegistrationCheck(store, keys, self.spec.etcd.lease_ttl_s)
        self.job_state = PauseWatch(store, keys)
        self._claimed = claimed  # noted once the run's event log exists
        return store

    def make_agent(self, endpoints: str) -> None:
        """The agent's reconcile step for this machine's hosts, with the process backend."""
        self.placed = [p for p in placement_from_spec(self.spec) if self.host is None or p.host == self.host]
        base = {**os.environ, "PYTHONUNBUFFERED": "1", "RLFLEET_RUN_DIR": str(self.run_dir.resolve()),
                INCARNATION_ENV: self.owner.incarnation, **self.security.daemon_env()}

        def env(p: Placed) -> dict[str, str]:
            return {**base, "RLFLEET_TORCH_THREADS": str(torch_threads(self.placed, p.host)), **p.environment()}
        self.backend = ProcessBackend(lambda p: daemon_command(self.spec.job.name, endpoints, p), env,
                                      self.run_dir / "logs")
        self.backend.log_dir.mkdir(parents=True, exist_ok=True)
        self.agent = Reconciler(self.backend, CrashLoop(self.give_up_deaths or CRASH_LOOP_DEATHS,
                                                        self.give_up_window_s))
        self.nodes = LocalNodes(self.spec.job.name, self.placed, self.spec.etcd.lease_ttl_s)

    def desired(self, store: EtcdStore) -> list[Placed]:
        """The spec's resource-managers of this machine (bootstrap), and what placement/
        says for its hosts, read every PLACEMENT_READ_S (the last read through an outage);
        the job's state read with it, and nodes/<host> rewritten if changed."""
        if self.nodes.read_due():
            self.nodes.read_placement(store)
            if said := self.job_state.read():
                self.note(said + (": starting and stopping nothing" if self.paused else ""))
            self.nodes.publish(store, self.owner.lease if self.owner is not None else None, self.agent.report,
                               self.paused)
        return self.nodes.desired()

    # -- supervision ------------------------------------------------------------
    def note(self, message: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {message}"
        self.events.append(stamped)
        log.info(message)
        if not self.view:
            print(stamped, flush=True)

    def supervise_once(self, store: EtcdStore) -> Outcome | None:
        """One reconcile step: start what is placed and due, reap what died, stop what is
        no longer placed; an Outcome when a daemon keeps dying (and --give-up-after)."""
        outcome = None
        for event in self.agent.step(self.desired(store), time.monotonic(), self.paused):
            if event.kind == "started" and not event.restarts:
                continue  # the first start of each daemon is no news
            if event.kind != "crash_loop":
                self.note(event.sentence())
                continue
            outcome = outcome or self._crash_loop(event)
        return outcome

    def _crash_loop(self, event: Event) -> Outcome | None:
        """N deaths within the window: reported with the log's tail, and (N > 0) the end of the run."""
        log_path = self.backend.log_path(event.name)
        self.note(f"{event.name} keeps dying: {event.deaths} deaths in {event.span_s:.0f}s; "
                  f"log {log_path}, last lines:\n{self.backend.log_tail(event.name)}")
        return self.policy.crash_loop(event.name, event.deaths, event.span_s, event.exit, log_path)

    @property
    def paused(self) -> bool:
        return self.job_state is not None and self.job_state.paused

    def restarts(self) -> dict[str, int]:
        return {t.name: t.restarts for t in self.agent.tracked.values()} if self.agent is not None else {}

    def watch_training(self, last_step_at: float) -> tuple[float, Outcome | None]:
        """Read new metrics lines: note evaluations (and, in plain mode, progress); an
        Outcome when no training step came for max_idle_s. Returns the last step's time."""
        assert self.metrics is not None
        new_steps, new_evals = self.metrics.poll()
        now = time.monotonic()
        m = self.metrics.metrics
        if new_steps or self.paused:  # a paused job makes no progress on purpose
            last_step_at = now
        for index in range(len(m.evals) - new_evals, len(m.evals)):
            self.note(eval_line(m, index))
        return last_step_at, self.policy.idle(now, last_step_at, any(p.role == "trainer" for p in self.placed),
                                              m.train[-1]["step"] if m.train else None, self.run_dir / "logs")

    def note_progress(self) -> None:
        """Plain mode: the progress line, when a step was trained since the last one."""
        m = self.metrics.metrics
        if m.train and m.train[-1]["step"] != self._progress_step:
            self._progress_step = m.train[-1]["step"]
            self.note(progress_line(m, self.spec.trainer.max_steps))

    def render(self, store: EtcdStore, endpoints: str):
        restarts = self.restarts()
        try:
            snap = take_snapshot(store, self.spec.job.name)
        except StoreUnavailable as exc:
            return Group(Text(f"etcd {endpoints} unreachable: {exc}", style="red"), *self._events_text())
        banner = paused_banner(snap.cluster.state if snap.cluster is not None else None)
        parts = [*([banner] if banner else []), self._progress_text(), members_table(snap, restarts), nodes_table(snap)]
        if snap.problems:
            parts.append(Text("problems: " + "; ".join(snap.problems), style="yellow"))
        parts.append(Text(f"etcd {endpoints}   run dir {self.run_dir}   Ctrl-C stops everything", style="dim"))
        return Group(*parts, *self._events_text())

    def _progress_text(self) -> Text:
        m = self.metrics.metrics if self.metrics is not None else None
        if m is None:
            return Text("training: waiting for the first step", style="bold")
        return Text(progress_line(m, self.spec.trainer.max_steps), style="bold")

    def trainer_done(self, store: EtcdStore) -> bool:
        keys = JobKeys(self.spec.job.name)
        try:
            trainers = members_from(keys, store.get_prefix(keys.role_members_prefix("trainer")))
        except StoreUnavailable:
            return False
        return any(m.info.get("training") == "done" for m in trainers)

    def check_accounting(self, store: EtcdStore) -> Outcome | None:
        """With every daemon stopped (journals unlocked) and etcd still up; an Outcome
        when the invariant is broken or could not be checked."""
        from rlfleet.daemons.env_host.journal import launched_per_prompt
        from rlfleet.tools.ctl.accounting import check
        try:
            result = check(store, self.spec.job.name, self.run_dir, launched_per_prompt(self.spec))
        except Exception as exc:  # noqa: BLE001 — a report, never a reason to hang the shutdown
            self.note(f"accounting not checked: {exc!r}")
            return Outcome(Exit.ACCOUNTING_FAILED, f"accounting not checked: {exc!r}")
        self.accounting = result.to_json()
        (self.run_dir / "accounting.json").write_text(json.dumps(self.accounting, indent=2))
        self.note("accounting: " + result.sentence())
        if not result.ok:
            return Outcome(Exit.ACCOUNTING_FAILED, f"accounting invariant broken: {len(result.lost)} prompts lost, "
                                            f"{len(result.conflicts)} both trained and dropped; see "
                                            f"{self.run_dir / 'accounting.json'}")
        return None

    def finish_report(self) -> None:
        if self.metrics is None:
            return
        # The whole run, from the file: the live tail keeps only its last lines.
        m = self.final_metrics = read_metrics(self.metrics.path)
        if not m.train and not m.evals:
            return
        result = {**summary(m), "cpu_s": self.cpu_report}
        (self.run_dir / "summary.json").write_text(json.dumps(result, indent=2))
        self.plots = plot(m, self.run_dir, title=f"{self.spec.job.name} ({self.spec.task.env.kind})")

    def print_end_summary(self, headline: str) -> None:
        text = end_summary(self.final_metrics or RunMetrics(),
                           job=self.spec.job.name, max_steps=self.spec.trainer.max_steps, headline=headline,
                           run_dir=self.run_dir, accounting=self.accounting,
                           restarts=self.restarts(),
                           cpu_s=self.cpu_report, plots=self.plots)
        print(text, flush=True)

    def cpu_by_daemon(self) -> dict[str, float]:
        """CPU seconds each daemon used (all its restarts, its worker processes included),
        the private etcd and the supervisor itself: where the machine's time went."""
        cpu = {mid: round(self.backend.cpu_s(mid), 1) for mid in self.backend.children} if self.backend else {}
        if self.cluster is not None:
            cpu["etcd"] = round(sum(tree_cpu_s(m.proc.pid) for m in self.cluster.members
                                    if m.proc is not None), 1)
        own = resource.getrusage(resource.RUSAGE_SELF)
        cpu["supervisor"] = round(own.ru_utime + own.ru_stime, 1)
        return dict(sorted(cpu.items(), key=lambda kv: -kv[1]))

    def _events_text(self) -> list[Text]:
        return [Text(e, style="cyan") for e in self.events]

    def stop_children(self) -> None:
        if self.backend is not None:
            self.backend.release(STOP_GRACE_S, self.note)

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    # -- the run -------------------------------------------------------------------
    def run(self, duration_s: float | None = None) -> int:
        """The whole run; prints the one-line outcome last and returns its exit code."""
        route_signals({signal.SIGTERM: self.request_stop, signal.SIGINT: self.request_stop})
        outcome = self._run(duration_s)
        if outcome.code == Exit.OK:
            print(outcome.line(), flush=True)
        else:
            print(outcome.line(), file=sys.stderr, flush=True)
        return int(outcome.code)

    def _run(self, duration_s: float | None) -> Outcome:
        store = None
        if self.etcd_arg:  # an etcd we cannot reach: one line, no run dir left behind
            try:
                store = self.submit_spec(self.etcd_arg)
            except ValueError as exc:
                return Outcome(Exit.BAD_SPEC, f"--etcd {self.etcd_arg}: {exc}")
            except StoreUnavailable as exc:
                return Outcome(Exit.ETCD_UNREACHABLE, f"etcd at {self.etcd_arg} is unreachable: {exc}")
            except JobOwned as exc:
                return Outcome(Exit.JOB_OWNED, f"refused: {exc}")
        self.run_dir = new_run_dir(self.runs_dir)
        print(f"run dir: {self.run_dir}", flush=True)  # the first line: scripts read it
        if self.secure:
            try:
                self.note(self.security.make(self.run_dir))
            except (OSError, RuntimeError) as exc:
                if store is not None:
                    store.close()
                return Outcome(Exit.FAILURE, f"could not make this run's credentials: {exc} "
                                             "(--insecure runs without)")
        try:
            endpoints = self.start_etcd()
            if store is None:
                store = self.submit_spec(endpoints)
        except (OSError, RuntimeError, TimeoutError, StoreUnavailable) as exc:
            if store is not None:
                store.close()
            self._stop_etcd()
            return Outcome(Exit.ETCD_UNREACHABLE, f"the private etcd did not start: {exc}")
        self.metrics = MetricsTail(self.run_dir / "metrics.jsonl")
        failure: Outcome | None = None
        finished = False
        try:
            self.make_agent(endpoints)
            roles = len({p.role for p in self.placed})
            self.note(f"job {self.spec.job.name}: {len(self.placed)} daemons ({roles} roles), "
                      f"etcd {endpoints}, run dir {self.run_dir}")
            self.note(self._claimed)
            failure, finished = self._loop(store, endpoints, duration_s)
        finally:
            self.cpu_report = self.cpu_by_daemon()  # etcd's share must be read before it stops
            self._release_job()
            store.close()
            self._stop_etcd()
        self.finish_report()
        outcome = self.policy.final(failure, finished, self._stop.is_set(), duration_s, self._accounting_failure,
                                    self.run_dir)
        self.print_end_summary("finished" if outcome.code == Exit.OK else
                               f"{outcome.code.name.lower().replace('_', ' ')} (exit {int(outcome.code)})")
        return outcome

    def _release_job(self) -> None:
        try:
            self.owner.release()
        except StoreUnavailable as exc:
            self.note(f"could not release {JobKeys(self.spec.job.name).owner} ({exc}); its lease expires by itself")

    def keep_job(self) -> Outcome | None:
        """Refresh this run's ownership; an Outcome when another run took the job over."""
        try:
            lost = self.owner.keep()
        except StoreUnavailable:
            return None  # daemons keep working through an outage; so does the run
        if lost is None:
            return None
        self.note(f"job {self.spec.job.name} {lost}; stopping this run's daemons")
        return Outcome(Exit.JOB_OWNED, f"job {self.spec.job.name} {lost} (--take-over)")

    def replace_stalled(self) -> None:
        """SIGKILL a child whose registration expired while its process still exists (stopped,
        or its main loop stalled past the TTL): reaped and restarted like any dead child.
        Not while paused: an operator may have stopped it for maintenance."""
        if self.paused:
            return
        running = [(p.role, p.member_id, pid) for p in self.agent.running()
                   if (pid := self.backend.pid(p.member_id)) is not None]
        try:
            lost = self.registrations.lost(running)
        except StoreUnavailable:
            return  # no registration can be read: nothing to judge by
        for pid, why in lost:
            name = next(mid for role, mid, p in running if p == pid)
            self.note(f"replacing {name} (pid {pid}): {why}; SIGKILL")
            try:
                os.killpg(pid, signal.SIGKILL)  # its worker processes too
            except ProcessLookupError:
                pass

    def _loop(self, store: EtcdStore, endpoints: str, duration_s: float | None) -> tuple[Outcome | None, bool]:
        """Supervise until the trainer is done, a failure, a stop request or --duration;
        then stop the daemons and check the accounting. Returns (failure, finished)."""
        started = time.monotonic()
        deadline = started + duration_s if duration_s else None
        live = Live(self.render(store, endpoints), console=self.console, refresh_per_second=2,
                    transient=True) if self.view else None
        if live:
            live.start()
        failure: Outcome | None = None
        finished = False
        try:
            liveness, cpu, done_check = Every(self.spec.etcd.refresh_interval_s), Every(CPU_SAMPLE_S), Every(2.0)
            watch, progress = Every(0.5), Every(PROGRESS_EVERY_S)
            last_step_at = started
            while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
                failure = self.supervise_once(store)
                if failure:
                    break
                failure = self.keep_job()
                if failure:
                    break
                now = time.monotonic()
                if liveness.due(now):
                    self.replace_stalled()
                if cpu.due(now):
                    self.backend.sample_cpu()
                if done_check.due(now) and self.trainer_done(store):
                    finished = True
                    break
                if watch.due(now):
                    last_step_at, failure = self.watch_training(last_step_at)
                    if failure:
                        break
                    if live:
                        live.update(self.render(store, endpoints))
                    elif progress.due(now):
                        self.note_progress()
                self._stop.wait(0.1)
        finally:
            self.backend.sample_cpu()
            if live:
                live.stop()  # transient: the table goes; what happened is in the summary below
                for event in self.events:
                    print(event)
                self.view = False  # from here on events are printed as they come
            self.watch_training(time.monotonic())  # the last evaluations
            if not live:
                self.note_progress()
            if finished:
                self.note(f"trainer finished {self.spec.trainer.max_steps} steps")
            self.note("stopping daemons")
            self.stop_children()
            self._accounting_failure = self.check_accounting(store)
        return failure, finished

    def _stop_etcd(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.note("etcd stopped")
        self.security.discard(self.run_dir)
