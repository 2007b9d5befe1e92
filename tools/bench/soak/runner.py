"""The soak run: the two jobs, the faults done on schedule, the samples, the record.

``Soak`` mounts the runs' tmpfs, starts the shared etcd and both jobs (``Job``: one
`rlfleet run` each), then loops every ``TICK_S``: the faults due (``do``), the disk kept
full while a fill lasts, the follow-up of kills and etcd restarts, a sample every
``--sample-s``; ``teardown`` undoes the faults and stops everything. What the run
leaves (its record, the verdicts) is built from it by ``record.build_record``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.tools.bench.soak import REPO
from rlfleet.tools.bench.soak.faults import Fault, fault_schedule, fill
from rlfleet.tools.bench.soak.sampling import (
    MetricsReader,
    Proc,
    descends_from,
    mem_available_mib,
    proc_usage,
    read_procs,
    used_mib,
)
from rlfleet.tools.bench.soak.verdicts import drop_counts

TASKS = ("arithmetic", "longtail-sim")
STOP_WAIT_S = 180.0          # a stopped `rlfleet run`: its daemons' grace, the accounting, the plots
TICK_S = 0.5                 # the loop's turn: faults due, the disk topped up, follow-ups
ETCD_MEMBERS, ETCD_HEARTBEAT_MS, ETCD_ELECTION_MS = 3, 100, 1000   # like `rlfleet run`'s own etcd
# Defaults of the command's options (the results page's method reads them too).
HOURS = 2.0
TMPFS_MIB = 1024             # the runs' tmpfs
WINDOW_MIN = 5.0             # the drop share's window (at most a sixth of the run)


@dataclass
class Job:
    task: str
    name: str
    spec: Path
    out: Path
    proc: subprocess.Popen | None = None
    run_dir: Path | None = None
    metrics: MetricsReader | None = None
    alpha: int | None = None   # trainer.max_staleness (drops.windows' "at the bound")
    prev: tuple[int, int] = (0, 0)
    step_seen: tuple[Any, float] = (None, 0.0)   # (last step, when it was first seen)
    exit: int | None = None


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.duration_s = args.hours * 3600
        self.work = Path(tempfile.mkdtemp(prefix="rlfleet-soak-", dir=args.work_root))
        self.runs = self.work / "runs"
        self.filler = self.runs / "soak-filler"
        self.rng = random.Random(args.seed)
        self.stop = threading.Event()
        self.faults: list[dict[str, Any]] = []
        self.pending: list[dict[str, Any]] = []   # kills and etcd restarts awaiting their outcome
        self.samples: list[dict[str, Any]] = []
        self.jobs: list[Job] = []
        self.cluster: Any = None
        self.store: Any = None
        self.t0 = time.monotonic()
        self.t0_unix = time.time()
        self.mounted = False
        self.disk_full = False
        self.down: dict[int, Any] = {}   # n -> etcd member down
        self._followed_at = 0.0
        self.error: str | None = None    # the soak's own traceback, if it failed
        self.stopped_at = float("inf")   # when a stop was requested (Ctrl-C, SIGTERM)

    def t(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} t={self.t() / 60:6.2f} min  {text}", flush=True)

    def log_fault(self, kind: str, **what: Any) -> dict[str, Any]:
        entry = {"t": round(self.t(), 1), "time": round(time.time(), 1), "kind": kind, **what}
        self.faults.append(entry)
        self.say(f"FAULT {kind}: " + ", ".join(f"{k}={v}" for k, v in what.items()))
        return entry

    # -- set-up and tear-down -------------------------------------------------------------
    def setup(self) -> None:
        from rlfleet.common.control.etcd_store import EtcdStore
        from rlfleet.tools.bench.spec_variants import write_variant
        from rlfleet.tools.run.etcd_local import EtcdCluster
        if os.geteuid() != 0:
            raise SystemExit("soak: mounting the runs' tmpfs needs root")
        self.runs.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.tmpfs_mib}m", "tmpfs", str(self.runs)],
                       check=True)
        self.mounted = True
        self.cluster = EtcdCluster(ETCD_MEMBERS, base_dir=self.work / "etcd", heartbeat_ms=ETCD_HEARTBEAT_MS,
                                   election_ms=ETCD_ELECTION_MS).start()
        self.store = EtcdStore(self.cluster.endpoints_arg, timeout_s=2.0)
        for task in TASKS:
            def change(spec: dict[str, Any]) -> None:
                spec["job"]["name"] = f"{spec['job']['name']}-soak"
                spec["job"]["runs_dir"] = str(self.runs)
                spec["trainer"]["max_steps"] = 10**7
            spec = write_variant(self.args.examples / f"{task}.toml", "soak", change)
            parsed = tomllib.loads(spec.read_text())
            name = parsed["job"]["name"]
            self.jobs.append(Job(task, name, spec, self.work / f"{name}.out",
                                 alpha=parsed["trainer"].get("max_staleness")))
        self.say(f"work dir {self.work}, etcd {self.cluster.endpoints_arg}, runs on a "
                 f"{self.args.tmpfs_mib} MiB tmpfs at {self.runs}")

    def launch(self) -> None:
        from rlfleet.common.procs import with_parent_death
        self.t0, self.t0_unix = time.monotonic(), time.time()
        for job in self.jobs:
            cmd = [sys.executable, "-m", "rlfleet.tools.cli", "run", str(job.spec), "--no-view",
                   "--duration", str(self.duration_s), "--etcd", self.cluster.endpoints_arg]
            with open(job.out, "ab") as out:  # SIGTERM if the soak dies: the run stops cleanly
                job.proc = subprocess.Popen(with_parent_death(cmd, signal.SIGTERM), stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, cwd=REPO)
            self.say(f"started {job.name}: pid {job.proc.pid}, output {job.out}")

    def find_run_dirs(self) -> None:
        for job in self.jobs:
            if job.run_dir is None and job.out.exists():
                for line in job.out.read_text(errors="replace").splitlines():
                    if line.startswith("run dir:"):
                        job.run_dir = Path(line.split("run dir:", 1)[1].strip())
                        job.metrics = MetricsReader(job.run_dir / "metrics.jsonl")

    def teardown(self) -> None:
        """Faults undone, the runs stopped (SIGTERM) and waited for, etcd stopped, the
        run dirs copied off the tmpfs (without checkpoints), the tmpfs unmounted."""
        if self.disk_full:
            self.free_disk(0)
        for n in list(self.down):
            self.etcd_up(n)
        for job in self.jobs:
            if job.proc is not None and job.proc.poll() is None:
                job.proc.send_signal(signal.SIGTERM)
        for job in self.jobs:
            if job.proc is None:
                continue
            try:
                job.exit = job.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.say(f"{job.name}: rlfleet run still there {STOP_WAIT_S:.0f} s after SIGTERM; SIGKILL")
                job.proc.kill()
                job.exit = job.proc.wait()
        self.find_run_dirs()
        if self.store is not None:
            self.store.close()
        if self.cluster is not None:
            self.cluster.stop()
        for job in self.jobs:
            job.spec.unlink(missing_ok=True)
            if job.run_dir is not None and job.run_dir.exists():
                keep = self.work / "kept" / job.name
                shutil.copytree(job.run_dir, keep, ignore=shutil.ignore_patterns("checkpoints", "credentials"),
                                dirs_exist_ok=True)
                job.run_dir = keep
        if self.mounted:
            if subprocess.run(["umount", str(self.runs)]).returncode != 0:
                subprocess.run(["umount", "-l", str(self.runs)])
            self.mounted = False

    # -- faults -----------------------------------------------------------------------------
    def all_procs(self) -> list[Proc]:
        from rlfleet.common.control.store import StoreUnavailable
        out = []
        for job in self.jobs:
            try:
                out += read_procs(self.store, job.name)
            except StoreUnavailable:
                pass
        return out

    def kill_daemon(self) -> None:
        import psutil
        roots = {j.proc.pid for j in self.jobs if j.proc is not None}
        procs = [p for p in self.all_procs() if p.pid not in roots and descends_from(p.pid, roots)]
        if not procs:
            self.log_fault("kill", skipped="no daemon process found")
            return
        p = self.rng.choice(procs)
        try:
            children = psutil.Process(p.pid).children(recursive=True)
        except psutil.Error:
            children = []
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            self.log_fault("kill", job=p.job, member=p.label, pid=p.pid, skipped="gone before the kill")
            return
        entry = self.log_fault("kill", job=p.job, member=p.label, role=p.role, pid=p.pid,
                               members=len(p.members), children=[c.pid for c in children])
        self.pending.append({"entry": entry, "kind": "kill", "proc": p, "children": children, "at": self.t()})

    def etcd_down(self, n: int) -> None:
        m = self.rng.choice([m for m in self.cluster.members if m.alive()])
        self.cluster.kill_member(m)
        self.down[n] = m
        self.log_fault("etcd_down", member=m.name, endpoint=m.endpoint)

    def etcd_up(self, n: int) -> None:
        m = self.down.pop(n, None)
        if m is None:
            return
        self.cluster.start_member(m, wait=False)
        entry = self.log_fault("etcd_up", member=m.name)
        self.pending.append({"entry": entry, "kind": "etcd_up", "member": m, "at": self.t()})

    def fill_disk(self, n: int) -> None:
        written = fill(self.runs, self.filler)
        self.disk_full = True
        self.log_fault("disk_fill", n=n, filler_mib=round(written / 2**20, 1))

    def free_disk(self, n: int) -> None:
        size = self.filler.stat().st_size if self.filler.exists() else 0
        self.filler.unlink(missing_ok=True)
        self.disk_full = False
        self.log_fault("disk_free", n=n, filler_mib=round(size / 2**20, 1))

    def follow_up(self) -> None:
        """Kills: when the member is registered again (a new pid), which children outlived
        their daemon. etcd restarts: when the member is healthy."""
        if not self.pending or time.monotonic() - self._followed_at < 2.0:
            return
        self._followed_at = time.monotonic()
        procs = None
        for item in list(self.pending):
            age = self.t() - item["at"]
            entry = item["entry"]
            if item["kind"] == "etcd_up":
                try:
                    self.cluster.wait_healthy(0.2, members=[item["member"]])
                    entry["healthy_after_s"] = round(self.t() - item["at"], 1)
                except (TimeoutError, RuntimeError) as exc:
                    if age < 120:
                        continue
                    entry["healthy_after_s"] = None
                    entry["problem"] = str(exc)[:300]
                self.pending.remove(item)
                continue
            if "orphans" not in entry and age >= 10:
                entry["orphans"] = [c.pid for c in item["children"] if c.is_running()]
                if entry["orphans"]:
                    self.say(f"{entry['member']} ({entry['job']}): children {entry['orphans']} outlived "
                             f"their daemon (pid {entry['pid']}) by {age:.0f} s")
            if "back_after_s" not in entry:
                procs = procs if procs is not None else self.all_procs()
                p = item["proc"]
                new = next((q for q in procs if q.job == p.job and q.label == p.label and q.pid != p.pid), None)
                if new is not None:
                    entry["back_after_s"], entry["new_pid"] = round(age, 1), new.pid
                elif age >= 300:
                    entry["back_after_s"] = None  # not registered again within 5 minutes
            if "orphans" in entry and "back_after_s" in entry:
                self.pending.remove(item)

    def do(self, fault: Fault) -> None:
        if fault.kind == "kill":
            self.kill_daemon()
        elif fault.kind == "etcd_down":
            self.etcd_down(fault.n)
        elif fault.kind == "etcd_up":
            self.etcd_up(fault.n)
        elif fault.kind == "disk_fill":
            self.fill_disk(fault.n)
        elif fault.kind == "disk_free":
            self.free_disk(fault.n)

    # -- samples ------------------------------------------------------------------------------
    def sample(self) -> dict[str, Any]:
        self.find_run_dirs()
        rows = []
        for p in self.all_procs():
            use = proc_usage(p.pid)
            if use is not None:
                rows.append({"job": p.job, "label": p.label, "role": p.role, "pid": p.pid, **use})
        jobs = {}
        for job in self.jobs:
            # its children are the job's daemons: no tree figure of its own
            if job.proc is not None and (use := proc_usage(job.proc.pid, tree=False)) is not None:
                rows.append({"job": job.name, "label": "rlfleet-run", "role": "supervisor", "pid": job.proc.pid,
                             **use})
            line = job.metrics.poll() if job.metrics is not None else None
            waste, consumed = drop_counts(line) if line else (0, 0)
            d_waste, d_consumed = waste - job.prev[0], consumed - job.prev[1]
            job.prev = (waste, consumed)
            step = line.get("step") if line else None
            if step != job.step_seen[0]:
                job.step_seen = (step, self.t())
            jobs[job.name] = {"running": job.proc is not None and job.proc.poll() is None,
                              "no_step_s": round(self.t() - job.step_seen[1], 1),
                              "step": line.get("step") if line else None, "waste": waste, "consumed": consumed,
                              "dropped": dict(line.get("dropped") or {}) if line else {},
                              "drop_share": round(waste / consumed, 4) if consumed else None,
                              "drop_share_since_last": round(d_waste / d_consumed, 4) if d_consumed > 0 else None}
        for m in self.cluster.members:  # not judged: what a long run does to etcd, for the record
            if m.alive() and (use := proc_usage(m.proc.pid, tree=False)) is not None:
                db = m.data_dir / "member" / "snap" / "db"
                rows.append({"job": "etcd", "label": m.name, "role": "etcd", "pid": m.proc.pid, **use,
                             "db_mib": round(db.stat().st_size / 2**20, 1) if db.exists() else None})
        sample = {"t": round(self.t(), 1), "time": round(time.time(), 1), "procs": rows, "jobs": jobs,
                  "tmpfs_used_mib": used_mib(self.runs), "shm_used_mib": used_mib(Path("/dev/shm")),
                  "mem_available_mib": mem_available_mib(), "load_1m": round(os.getloadavg()[0], 2)}
        self.samples.append(sample)
        return sample

    def progress(self, s: dict[str, Any]) -> str:
        parts = []
        for name, j in s["jobs"].items():
            procs = [p for p in s["procs"] if p["job"] == name and p["role"] != "supervisor"]
            share = f"{j['drop_share']:.1%}" if j["drop_share"] is not None else "-"
            stall = f" (no step for {j['no_step_s']:.0f} s)" if j["no_step_s"] >= 30 else ""
            parts.append(f"{name}: {'up' if j['running'] else 'ENDED'} step {j['step']}{stall} drops {share} "
                         f"of {j['consumed']}, {len(procs)} procs, rss {sum(p['rss_kb'] for p in procs) / 2**20:.2f} "
                         f"GiB, fds {sum(p['fds'] for p in procs)}")
        etcd = [p for p in s["procs"] if p["job"] == "etcd"]
        parts.append(f"etcd {len(etcd)} up, rss {sum(p['rss_kb'] for p in etcd) / 2**10:.0f} MiB, "
                     f"db {max((p['db_mib'] or 0 for p in etcd), default=0):.0f} MiB")
        last = self.faults[-1] if self.faults else None
        return (" | ".join(parts) + f" | tmpfs {s['tmpfs_used_mib']:.0f}/{self.args.tmpfs_mib} MiB, "
                f"/dev/shm {s['shm_used_mib']:.0f} MiB, available {s['mem_available_mib']:.0f} MiB, "
                f"load {s['load_1m']}, {len(self.faults)} faults"
                + (f" (last {last['kind']} at {last['t'] / 60:.1f} min)" if last else ""))

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> None:
        a = self.args
        schedule = fault_schedule(self.duration_s, a.kill_every_min * 60, a.etcd_loss_every_min * 60, a.etcd_down_s,
                                  a.disk_full_every_min * 60, a.disk_full_s,
                                  min(a.quiet_end_s, self.duration_s / 10))
        self.say(f"{len(schedule)} scheduled faults: {dict(Counter(f.kind for f in schedule))}")
        self.launch()
        next_sample = a.sample_s
        while not self.stop.is_set():
            while schedule and schedule[0].at_s <= self.t():
                self.do(schedule.pop(0))
            if self.disk_full:
                fill(self.runs, self.filler)  # what the jobs freed is taken again: the disk stays full
            self.follow_up()
            if self.t() >= next_sample:
                next_sample += a.sample_s
                self.say(self.progress(self.sample()))
            if all(j.proc.poll() is not None for j in self.jobs):
                self.say("both runs ended")
                break
            if self.t() > self.duration_s + STOP_WAIT_S:
                self.say(f"the runs are still there {STOP_WAIT_S:.0f} s after their duration: stopping them")
                break
            self.stop.wait(TICK_S)
        if self.stop.is_set():
            self.stopped_at = self.t()
            self.say("stop requested: stopping both runs (SIGTERM)")
