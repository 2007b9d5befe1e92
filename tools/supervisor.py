"""The embedded fleet behind `rlfleet run`: a private etcd (unless one is given),
the spec written to it, every placed daemon as a supervised subprocess, and a
live view. A daemon that dies is restarted with backoff; one that keeps dying is
reported with the tail of its log. Ctrl-C stops the daemons (SIGTERM, then
SIGKILL after a grace period) and etcd last.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from rlfleet.common.etcd_store import EtcdStore
from rlfleet.common.keys import JobKeys
from rlfleet.common.placement import Placed, placement_from_spec
from rlfleet.common.signals import route_signals
from rlfleet.common.spec import JobSpec
from rlfleet.common.store import StoreUnavailable
from rlfleet.tools.etcd_local import EtcdCluster, die_with_parent
from rlfleet.tools.fleet_view import members_table, nodes_table, take_snapshot
from rlfleet.tools.report import plot, read_metrics, summary

log = logging.getLogger("rlfleet.supervisor")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0
HEALTHY_AFTER_S = 30.0      # a child that lived this long gets its backoff reset
CRASH_LOOP_RESTARTS = 5     # this many restarts within CRASH_LOOP_WINDOW_S is reported loudly
CRASH_LOOP_WINDOW_S = 60.0
STOP_GRACE_S = 10.0
TORCH_ROLES = ("trainer", "rollout")  # the processes that compute; they share the cores
CPU_SAMPLE_S = 1.0          # how often each daemon's CPU time is read (what a kill -9 loses)


def tree_cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process and its live descendants (reward workers)."""
    try:
        root = psutil.Process(pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # a descendant that just exited
                pass
        return total
    except psutil.Error:
        return 0.0


def torch_threads(placed: list[Placed], host: str) -> int:
    """Threads per torch process so the processes on one machine do not oversubscribe its cores."""
    n = sum(1 for p in placed if p.host == host and p.role in TORCH_ROLES)
    return max(1, (os.cpu_count() or 1) // max(1, n))


@dataclass
class Child:
    placed: Placed
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_START_S
    next_start_at: float = 0.0
    recent_deaths: deque = field(default_factory=lambda: deque(maxlen=CRASH_LOOP_RESTARTS))
    env: dict[str, str] = field(default_factory=dict)
    cpu_s_ended: float = 0.0    # CPU of this daemon's earlier (dead) processes, as last sampled
    cpu_s_current: float = 0.0  # CPU of the running process at the last sample

    @property
    def name(self) -> str:
        return self.placed.member_id

    @property
    def cpu_s(self) -> float:
        return self.cpu_s_ended + self.cpu_s_current

    def sample_cpu(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.cpu_s_current = max(self.cpu_s_current, tree_cpu_s(self.proc.pid))

    def process_ended(self) -> None:
        self.cpu_s_ended += self.cpu_s_current
        self.cpu_s_current = 0.0

    def start(self, env: dict[str, str]) -> None:
        env = {**env, **self.env}
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True,
                                         preexec_fn=die_with_parent(signal.SIGTERM))  # a clean drain
        self.started_at = time.monotonic()

    def log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Supervisor:
    def __init__(self, spec: JobSpec, spec_path: str, etcd: str | None, run_dir: Path,
                 host: str | None = None, view: bool = True) -> None:
        self.spec, self.spec_path, self.run_dir = spec, spec_path, run_dir
        self.etcd_arg, self.view = etcd, view
        # Which placement hosts this supervisor starts daemons for; default all (one machine).
        self.host = host
        self.cluster: EtcdCluster | None = None
        self.children: list[Child] = []
        self.events: deque[str] = deque(maxlen=8)
        self._stop = threading.Event()
        self.cpu_report: dict[str, float] = {}
        self.console = Console(stderr=False)

    # -- set-up ------------------------------------------------------------------
    def start_etcd(self) -> str:
        if self.etcd_arg:
            return self.etcd_arg
        self.cluster = EtcdCluster(1, base_dir=self.run_dir / "etcd").start()
        return self.cluster.endpoints_arg

    def submit_spec(self, endpoints: str) -> EtcdStore:
        store = EtcdStore(endpoints, timeout_s=self.spec.etcd.retry_timeout_s)
        store.put(JobKeys(self.spec.job.name).spec, self.spec.to_dict())
        return store

    def make_children(self, endpoints: str) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        placed = placement_from_spec(self.spec)
        for p in placed:
            if self.host is not None and p.host != self.host:
                continue
            cmd = [sys.executable, "-m", "rlfleet.tools.cli", "daemon", p.role,
                   "--job", self.spec.job.name, "--etcd", endpoints, "--id", p.member_id, "--host", p.host]
            env = {"RLFLEET_RUN_DIR": str(self.run_dir.resolve()),
                   "RLFLEET_TORCH_THREADS": str(torch_threads(placed, p.host))}
            self.children.append(Child(p, cmd, logs / f"{p.member_id}.log", env=env))

    # -- supervision ------------------------------------------------------------
    def note(self, message: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {message}"
        self.events.append(stamped)
        log.info(message)
        if not self.view:
            print(stamped, flush=True)

    def supervise_once(self, env: dict[str, str]) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is None:
                if now >= child.next_start_at:
                    child.start(env)
                    if child.restarts:
                        self.note(f"restarted {child.name} (restart #{child.restarts}, pid {child.proc.pid})")
                continue
            code = child.proc.poll()
            if code is None:
                if now - child.started_at > HEALTHY_AFTER_S:
                    child.backoff_s = BACKOFF_START_S
                continue
            child.proc = None
            child.process_ended()
            child.restarts += 1
            child.recent_deaths.append(now)
            child.next_start_at = now + child.backoff_s
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            self.note(f"{child.name} died ({how}); restarting in {child.backoff_s:.1f}s")
            if (len(child.recent_deaths) == CRASH_LOOP_RESTARTS
                    and now - child.recent_deaths[0] < CRASH_LOOP_WINDOW_S):
                self.note(f"{child.name} keeps dying: {CRASH_LOOP_RESTARTS} deaths in "
                          f"{now - child.recent_deaths[0]:.0f}s; log {child.log_path}, last lines:\n"
                          f"{child.log_tail()}")
            child.backoff_s = min(child.backoff_s * 2, BACKOFF_MAX_S)

    def render(self, store: EtcdStore, endpoints: str):
        restarts = {c.name: c.restarts for c in self.children}
        try:
            snap = take_snapshot(store, self.spec.job.name)
        except StoreUnavailable as exc:
            return Group(Text(f"etcd {endpoints} unreachable: {exc}", style="red"), *self._events_text())
        parts = [self._progress_text(), members_table(snap, restarts), nodes_table(snap)]
        if snap.problems:
            parts.append(Text("problems: " + "; ".join(snap.problems), style="yellow"))
        parts.append(Text(f"etcd {endpoints}   run dir {self.run_dir}   Ctrl-C stops everything", style="dim"))
        return Group(*parts, *self._events_text())

    def _progress_text(self) -> Text:
        m = read_metrics(self.run_dir / "metrics.jsonl")
        if not m.train and not m.evals:
            return Text("training: waiting for the first step", style="bold")
        last = m.train[-1] if m.train else {}
        ev = m.evals[-1]["eval_success"] if m.evals else None
        stale = m.staleness()
        hist = "  ".join(f"{k}:{v}" for k, v in sorted(stale.items())) or "—"
        return Text(f"step {last.get('step', 0)}/{self.spec.trainer.max_steps}   "
                    f"reward {last.get('reward_mean', 0.0):.3f}   "
                    f"eval success {'—' if ev is None else f'{ev:.3f}'}   "
                    f"{last.get('tokens_per_s', 0.0):.0f} tok/s   staleness {hist}", style="bold")

    def trainer_done(self, store: EtcdStore) -> bool:
        try:
            kvs = store.get_prefix(JobKeys(self.spec.job.name).role_members_prefix("trainer"))
        except StoreUnavailable:
            return False
        return any(isinstance(kv.value, dict) and kv.value.get("training") == "done" for kv in kvs)

    def check_accounting(self, store: EtcdStore) -> None:
        """With every daemon stopped (journals unlocked) and etcd still up."""
        from rlfleet.tools.accounting import check
        try:
            result = check(store, self.spec.job.name, self.run_dir, self.spec.task.group_size)
        except Exception as exc:  # noqa: BLE001 — a report, never a reason to hang the shutdown
            self.note(f"accounting not checked: {exc!r}")
            return
        (self.run_dir / "accounting.json").write_text(json.dumps(result.to_json(), indent=2))
        self.note("accounting: " + result.sentence())

    def finish_report(self) -> None:
        m = read_metrics(self.run_dir / "metrics.jsonl")
        if not m.train and not m.evals:
            return
        result = {**summary(m), "cpu_s": self.cpu_report}
        (self.run_dir / "summary.json").write_text(json.dumps(result, indent=2))
        for path in plot(m, self.run_dir, title=f"{self.spec.job.name} ({self.spec.task.env.kind})"):
            self.note(f"wrote {path}")
        self.note("summary: " + json.dumps(result))

    def cpu_by_daemon(self) -> dict[str, float]:
        """CPU seconds each daemon used (all its restarts, its worker processes included),
        the private etcd and the supervisor itself: where the machine's time went."""
        cpu = {c.name: round(c.cpu_s, 1) for c in self.children}
        if self.cluster is not None:
            cpu["etcd"] = round(sum(tree_cpu_s(m.proc.pid) for m in self.cluster.members
                                    if m.proc is not None), 1)
        own = resource.getrusage(resource.RUSAGE_SELF)
        cpu["supervisor"] = round(own.ru_utime + own.ru_stime, 1)
        return dict(sorted(cpu.items(), key=lambda kv: -kv[1]))

    def _events_text(self) -> list[Text]:
        return [Text(e, style="cyan") for e in self.events]

    def stop_children(self) -> None:
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.note(f"{child.name} ignored SIGTERM for {STOP_GRACE_S:.0f}s; killing it")
                child.proc.kill()
                child.proc.wait()

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def run(self, duration_s: float | None = None) -> int:
        route_signals({signal.SIGTERM: self.request_stop, signal.SIGINT: self.request_stop})
        self.run_dir.mkdir(parents=True, exist_ok=True)
        endpoints = self.start_etcd()
        store = None
        try:
            store = self.submit_spec(endpoints)
            self.make_children(endpoints)
            self.note(f"job {self.spec.job.name}: {len(self.children)} daemons, etcd {endpoints}, "
                      f"run dir {self.run_dir}")
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            deadline = time.monotonic() + duration_s if duration_s else None
            live = Live(self.render(store, endpoints), console=self.console, refresh_per_second=2,
                        transient=False) if self.view else None
            if live:
                live.start()
            try:
                last_render = 0.0
                last_done_check = 0.0
                last_cpu_sample = 0.0
                while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
                    self.supervise_once(env)
                    if time.monotonic() - last_cpu_sample > CPU_SAMPLE_S:
                        last_cpu_sample = time.monotonic()
                        for child in self.children:
                            child.sample_cpu()
                    if time.monotonic() - last_done_check > 2.0:
                        last_done_check = time.monotonic()
                        if self.trainer_done(store):
                            self.note(f"trainer finished {self.spec.trainer.max_steps} steps")
                            break
                    if live and time.monotonic() - last_render > 0.5:
                        live.update(self.render(store, endpoints))
                        last_render = time.monotonic()
                    self._stop.wait(0.1)
            finally:
                for child in self.children:
                    child.sample_cpu()
                self.note("stopping daemons")
                self.stop_children()
                self.check_accounting(store)
                if live:
                    live.update(self.render(store, endpoints))
                    live.stop()
        finally:
            if store is not None:
                store.close()
            self.cpu_report = self.cpu_by_daemon()  # etcd's share must be read before it stops
            if self.cluster is not None:
                self.cluster.stop()
                self.note("etcd stopped")
        self.finish_report()
        self.note(f"stopped; logs in {self.run_dir / 'logs'}, results in {self.run_dir}")
        return 0
